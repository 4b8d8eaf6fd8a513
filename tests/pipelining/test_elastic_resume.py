"""Every Trainer checkpoint resumes on another layout; a non-finite batch is recorded.

A fit on 8 devices stops mid-run (request_stop after step STOP, so a
pipelined checkpoint holds a batch in flight) and resumes on 1, 2 and 4 of
the devices, with 2 shards per device, and with another stacking; each
resumed run is compared with the uninterrupted run on 8 devices: equal up to
the changed order of float32 sums, bit for bit on the same layout.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil

import jax
import numpy as np
import optax
import pytest

from checkpoint import IncompatibleCheckpointError
from pipelining import NonFiniteLossError, Trainer
from pipelining._checkpointing import LAYOUT_SPECIFIC_FORMAT, TrainerCheckpoints
from pipelining._in_flight import FeatureInFlight
from sc_framework.optimizers import Adagrad
from sc_framework.preprocessing import RaggedRows
from sc_framework.stacking import unstack
from test_resume import stop_at
from test_trainer import BATCH, LinearHead, make_specs, mesh_of, mse
from tests.numerics import assert_close, assert_same_bits

STOP = 3
NUM_BATCHES = 6
# The longest sum behind a table row's gradient: every id of a batch (3 + 2 + 1
# per sample) may hit one row.
TERMS = 6 * BATCH


def make_batches(count, seed):
  """Dense ids with padding, ragged weighted ids (empty samples too), one id per sample."""
  rng = np.random.default_rng(seed)
  batches = []
  for _ in range(count):
    fa = rng.integers(0, 40, (BATCH, 3))
    fa[rng.uniform(size=fa.shape) < 0.3] = -1
    lengths = rng.integers(0, 3, BATCH)
    fb = RaggedRows([rng.integers(0, 24, n) for n in lengths],
                    [rng.uniform(0.5, 2.0, n).astype(np.float32) for n in lengths])
    batches.append({
        "sparse": {"fa": fa, "fb": fb, "fa2": rng.integers(0, 40, (BATCH, 1))},
        "dense": rng.normal(size=(BATCH, 3)).astype(np.float32),
        "labels": rng.normal(size=BATCH).astype(np.float32),
    })
  return batches


def make_trainer(workdir, pipelining, devices=8, shards=1, specs=None, **options):
  return Trainer(LinearHead(), specs or make_specs(Adagrad(0.3)), mse, optax.adam(0.05),
                 mesh=mesh_of(devices), pipelining=pipelining, progress="off", padding_id=-1,
                 workdir=workdir, shards_per_device=shards, **options)


def logical_state(trainer):
  """Tables and slots per table (layout removed), dense parameters, step."""
  layout = trainer.plan.layout
  embeddings = jax.device_get(trainer.state.embeddings)
  slots = {name: unstack({s: v[name] for s, v in embeddings.slots.items()}, layout)
           for name in ("accumulator",)}
  return {"tables": unstack(embeddings.tables, layout), "slots": slots,
          "params": jax.device_get(trainer.state.params), "step": int(trainer.state.step)}


def assert_states(got, want, *, same_layout):
  assert got["step"] == want["step"]
  pairs = jax.tree_util.tree_flatten_with_path((got["tables"], got["slots"], got["params"]))[0]
  expected = jax.tree.leaves((want["tables"], want["slots"], want["params"]))
  for (path, actual), value in zip(pairs, expected):
    name = jax.tree_util.keystr(path)
    if same_layout:
      assert_same_bits(actual, value, err_msg=name)
    else:
      assert_close(actual, value, terms=TERMS, steps=NUM_BATCHES, err_msg=name)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
  """mode -> (workdir of a fit on 8 devices stopped after STOP, the uninterrupted state)."""
  runs = {}

  def run(pipelining):
    if pipelining not in runs:
      workdir = tmp_path_factory.mktemp("stopped")
      batches = make_batches(NUM_BATCHES, seed=90)
      history = make_trainer(workdir, pipelining).fit(batches, callbacks=[stop_at(STOP)])
      assert history.interrupted and history.final_step == STOP
      reference = make_trainer(None, pipelining)
      reference.fit(batches)
      runs[pipelining] = workdir, logical_state(reference)
    return runs[pipelining]

  return run


def resume(workdir, tmp_path, pipelining, **layout):
  copy = tmp_path / "workdir"
  shutil.copytree(workdir, copy)
  trainer = make_trainer(copy, pipelining, **layout)
  history = trainer.fit(make_batches(NUM_BATCHES, seed=90))
  assert history.resumed_from == STOP and history.final_step == NUM_BATCHES
  return trainer


@pytest.mark.parametrize("pipelining", [True, False], ids=["pipelined", "synchronous"])
def test_the_mid_run_checkpoint_is_layout_free(stopped, pipelining):
  workdir, _ = stopped(pipelining)
  meta = make_trainer(workdir, pipelining)._checkpoints.read_meta(STOP)
  assert meta["format"] == "sc_framework.trainer/2"
  assert meta["has_in_flight"] == pipelining
  if pipelining:
    ids = meta["in_flight_ids"]
    assert {name: entry["weights"] for name, entry in ids.items()} == {
        "fa": False, "fb": True, "fa2": False}  # only fb was fed with weights
    assert 1 <= ids["fa"]["width"] <= 3 and 1 <= ids["fb"]["width"] <= 2
    assert ids["fa2"]["width"] == 1


@pytest.mark.parametrize("pipelining, layout", [
    (True, dict(devices=1)), (True, dict(devices=2)), (True, dict(devices=4)),
    (True, dict(devices=8, shards=2)), (True, dict(devices=4, stacking="separate")),
    (False, dict(devices=2)), (False, dict(devices=4, shards=2, stacking="separate")),
], ids=["1_device", "2_devices", "4_devices", "8_devices_2_shards", "4_devices_unstacked",
        "synchronous_2_devices", "synchronous_4_devices_2_shards_unstacked"])
def test_resumes_on_another_layout(stopped, tmp_path, pipelining, layout):
  workdir, reference = stopped(pipelining)
  trainer = resume(workdir, tmp_path, pipelining, **layout)
  assert trainer.plan.layout.num_devices == layout["devices"]
  assert trainer.plan.layout.shards_per_device == layout.get("shards", 1)
  # The checkpoint has one stack of both tables; unstacked, each has its own.
  assert len(trainer.plan.layout.stacks) == (2 if layout.get("stacking") == "separate" else 1)
  assert_states(logical_state(trainer), reference, same_layout=False)


@pytest.mark.parametrize("pipelining", [True, False], ids=["pipelined", "synchronous"])
def test_resumes_bit_exact_on_the_same_layout(stopped, tmp_path, pipelining):
  workdir, reference = stopped(pipelining)
  trainer = resume(workdir, tmp_path, pipelining, devices=8)
  assert_states(logical_state(trainer), reference, same_layout=True)


def write_layout_specific_checkpoint(workdir, batches):
  """A checkpoint as the format before "trainer/2" wrote it: preprocessed in-flight buffers."""
  trainer = make_trainer(None, True)
  trainer.fit(batches, callbacks=[stop_at(STOP)])
  state = trainer._loop
  checkpoints = TrainerCheckpoints(workdir, trainer.plan, keep=3)
  in_flight = FeatureInFlight(
      trainer._steps.feature_activations(state.in_flight.stacked_activations),
      state.in_flight.batch)
  checkpoints.save(STOP, state.train, in_flight, dict(state.data), pipelining=True)
  checkpoints.wait()
  assert checkpoints.read_meta(STOP)["format"] == LAYOUT_SPECIFIC_FORMAT
  checkpoints.close()


def test_a_layout_specific_checkpoint_resumes_on_its_own_layout(stopped, tmp_path):
  batches = make_batches(NUM_BATCHES, seed=90)
  write_layout_specific_checkpoint(tmp_path / "old", batches)
  shutil.copytree(tmp_path / "old", tmp_path / "other")
  resumed = make_trainer(tmp_path / "old", True)
  assert resumed.fit(batches).resumed_from == STOP
  assert_states(logical_state(resumed), stopped(True)[1], same_layout=True)
  with pytest.raises(IncompatibleCheckpointError, match="trainer/1.*another layout"):
    make_trainer(tmp_path / "other", True, devices=4).fit(batches)


@pytest.mark.parametrize("pipelining", [True, False])
def test_a_nonfinite_batch_is_recorded_as_skipped(tmp_path, pipelining, caplog):
  batches = make_batches(NUM_BATCHES, seed=92)
  batches[2]["labels"][0] = np.nan
  trainer = make_trainer(tmp_path, pipelining, devices=2, save_on_nonfinite=True)
  with pytest.raises(NonFiniteLossError, match="batch 2 of the data stream") as info:
    trainer.fit(batches)
  assert (info.value.step, info.value.batch_index, info.value.saved_step) == (3, 2, 2)
  assert info.value.recorded_as_skipped
  assert "records batch 2 as skipped" in str(info.value)
  resumed = make_trainer(tmp_path, pipelining, devices=2)
  with caplog.at_level(logging.WARNING, logger="pipelining"):
    history = resumed.fit(batches)
  assert history.resumed_from == 2 and history.final_step == NUM_BATCHES - 1
  assert [skip["batch"] for skip in history.skipped_batches] == [2]
  assert any("not applied because their loss was not finite" in r.message for r in caplog.records)
  # The record stays in later checkpoints.
  assert resumed._checkpoints.read_meta(NUM_BATCHES - 1)["data"]["skipped"][0]["batch"] == 2
  if not pipelining:
    # Synchronous steps are independent of the skipped batch's timing: the
    # run equals one that never saw it.
    reference = make_trainer(None, False, devices=2)
    reference.fit(batches[:2] + batches[3:])
    assert_states(logical_state(resumed), logical_state(reference), same_layout=True)


@pytest.mark.parametrize("pipelining", [True, False])
def test_the_trainer_that_raised_reports_the_skipped_batch_as_a_resume_does(tmp_path, pipelining,
                                                                           caplog):
  """After a NonFiniteLossError the same Trainer's next fit goes on past the batch, as a new
  Trainer resuming the save_on_nonfinite checkpoint does: it lists the batch in
  `skipped_batches`, warns, and its later checkpoints keep the record."""
  batches = make_batches(NUM_BATCHES, seed=94)
  batches[2]["labels"][0] = np.nan
  trainer = make_trainer(tmp_path / "run", pipelining, devices=2, save_on_nonfinite=True)
  with pytest.raises(NonFiniteLossError, match="batch 2 of the data stream") as info:
    trainer.fit(batches)
  shutil.copytree(tmp_path / "run", tmp_path / "copy")
  with caplog.at_level(logging.WARNING, logger="pipelining"):
    continued = trainer.fit(batches)
  assert any("not applied because their loss was not finite" in r.message for r in caplog.records)
  resumed = make_trainer(tmp_path / "copy", pipelining, devices=2)
  history = resumed.fit(batches)
  assert continued.resumed_from is None and history.resumed_from == 2
  assert continued.final_step == history.final_step == NUM_BATCHES - 1
  assert [skip["batch"] for skip in history.skipped_batches] == [2]
  assert continued.skipped_batches == history.skipped_batches == [info.value.skipped]
  final = NUM_BATCHES - 1
  assert (trainer._checkpoints.read_meta(final)["data"]["skipped"]
          == resumed._checkpoints.read_meta(final)["data"]["skipped"])
  assert_states(logical_state(trainer), logical_state(resumed), same_layout=True)


def test_a_checkpoint_written_before_a_nonfinite_batch_meets_it_again(tmp_path):
  """With save_every=1 the step exists already: the error says a resume meets the batch."""
  batches = make_batches(4, seed=93)
  batches[2]["labels"][0] = np.inf
  trainer = make_trainer(tmp_path, False, devices=1, save_every=1, save_on_nonfinite=True)
  with pytest.raises(NonFiniteLossError, match="points at it: resuming from it meets the batch"
                     " again") as info:
    trainer.fit(batches)
  assert info.value.saved_step == 2 and not info.value.recorded_as_skipped
  with pytest.raises(NonFiniteLossError, match="batch 2 of the data stream"):
    make_trainer(tmp_path, False, devices=1, save_every=1).fit(batches)


def _limited_specs(limit):
  """make_specs with partition limits of `limit` ids and rows (shared table kept shared)."""
  specs = make_specs(Adagrad(0.3))
  tables = {spec.table.name: dataclasses.replace(spec.table, max_ids_per_partition=limit,
                                                 max_unique_ids_per_partition=limit)
            for spec in specs}
  return [dataclasses.replace(spec, table=tables[spec.table.name]) for spec in specs]


@pytest.mark.parametrize("devices", [1, 8])
def test_the_in_flight_batch_applies_the_ids_its_lookup_kept_on_any_layout(tmp_path, devices):
  """On 1 device the batches overflow the limits and ids are dropped; on 8 (at most 6 ids
  per device) none are. The in-flight batch was stored with its raw ids, so on 8 devices
  its update also reached the rows of the ids its lookup had dropped."""
  specs = _limited_specs(6)
  batches = make_batches(STOP + 1, seed=91)
  reference = make_trainer(None, True, devices=1, specs=specs, allow_id_dropping=True)
  assert reference.fit(batches).dropped_ids > 0
  history = make_trainer(tmp_path, True, devices=1, specs=specs, allow_id_dropping=True).fit(
      batches, callbacks=[stop_at(STOP)])
  assert history.interrupted and history.final_step == STOP
  resumed = make_trainer(tmp_path, True, devices=devices, specs=specs, allow_id_dropping=True)
  history = resumed.fit(batches)  # Only the batch in flight is left to apply.
  assert history.resumed_from == STOP and history.final_step == STOP + 1
  got, want = logical_state(resumed), logical_state(reference)
  if devices == 1:
    assert_states(got, want, same_layout=True)
  else:
    for name in ("a", "b"):
      assert_close(got["tables"][name], want["tables"][name], terms=TERMS, steps=STOP + 1,
                   err_msg=name)
