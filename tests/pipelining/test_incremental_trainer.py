"""Trainer with incremental checkpoints: delta saves hold the state a full save holds."""

from __future__ import annotations

import numpy as np
import optax
import pytest

import checkpoint as ck
from pipelining import Callback, Trainer
from sc_framework.optimizers import Adagrad
from test_resume import assert_same_run, stop_at
from test_trainer import LinearHead, logical_tables, make_batches, make_specs, mesh_of, mse
from tests.numerics import assert_same_bits


def make_trainer(workdir, pipelining, incremental, workers=1):
  return Trainer(LinearHead(), make_specs(Adagrad(0.3)), mse, optax.adam(0.05),
                 mesh=mesh_of(1), pipelining=pipelining, progress="off", padding_id=-1,
                 workdir=workdir, save_every=1 if workdir else None, keep=10,
                 incremental=incremental, prefetch_depth=2, prefetch_workers=workers)


def _tables(root, step):
  return ck.EmbeddingCheckpointHandler().restore(
      root / "checkpoints" / str(step) / "embedding", ck.TableRestore())


@pytest.mark.parametrize("pipelining", [True, False])
def test_delta_steps_equal_full_steps_and_resume_exactly(tmp_path, pipelining):
  batches = make_batches(8, seed=70 + pipelining)
  runs = {}
  for name, policy in (("delta", ck.IncrementalPolicy(max_delta_share=1.0)), ("full", None)):
    trainer = make_trainer(tmp_path / name, pipelining, policy)
    history = trainer.fit(batches, callbacks=[stop_at(5)])
    assert history.final_step == 5
    runs[name] = trainer
  chain = ck.inspect(tmp_path / "delta" / "checkpoints" / "5")["embedding"]["chain"]
  assert [link["kind"] for link in chain] == ["full"] + ["delta"] * (len(chain) - 1)
  assert len(chain) >= 4
  for step in range(1, 6):
    delta, full = _tables(tmp_path / "delta", step), _tables(tmp_path / "full", step)
    for name, table in full.tables.items():
      assert_same_bits(delta.tables[name], table)
      for slot, values in full.slots[name].items():
        assert_same_bits(delta.slots[name][slot], values)
  resumed = make_trainer(tmp_path / "delta", pipelining, ck.IncrementalPolicy(max_delta_share=1.0))
  history = resumed.fit(batches)
  assert history.resumed_from == 5 and history.final_step == 8
  reference = make_trainer(None, pipelining, None)
  reference.fit(batches)
  assert_same_run(resumed, reference)
  # The saves after the resume continue the chain and still equal the state.
  last = _tables(tmp_path / "delta", 8)
  for name, table in logical_tables(reference).items():
    assert_same_bits(last.tables[name], np.asarray(table))
  chain = ck.inspect(tmp_path / "delta" / "checkpoints" / "8")["embedding"]["chain"]
  assert chain[-1]["kind"] == "delta"


@pytest.mark.parametrize("seed, workers", [(0, 1), (1, 1), (2, 1), (3, 3), (4, 3)])
def test_fits_in_chunks_save_deltas_that_hold_every_update(tmp_path, seed, workers):
  """A fit continuing another's stream has more batches prepared but not applied.

  Their rows must still reach the next delta: every step of the chain equals
  the same step of full saves, and the last restores one fit's tables. With
  several prefetch workers the batches' rows are recorded out of order.
  """
  batches = make_batches(14, seed=90 + seed)
  policy = ck.IncrementalPolicy(full_every=100, max_delta_share=1.0)
  chunked = make_trainer(tmp_path / "delta", True, policy, workers)
  for total in (3, 6, None):
    chunked.fit(batches, num_steps=total)
  full = make_trainer(tmp_path / "full", True, None)
  full.fit(batches)
  for step in range(5, 15):  # the steps that keep=10 leaves
    delta, whole = _tables(tmp_path / "delta", step), _tables(tmp_path / "full", step)
    for name, table in whole.tables.items():
      assert_same_bits(delta.tables[name], table)


class _TablesAtEachStep(Callback):
  def __init__(self):
    self.tables = {}

  def on_step_end(self, trainer, step, metrics):
    self.tables[step] = {name: np.asarray(t) for name, t in logical_tables(trainer).items()}


def test_a_synchronous_resume_of_a_pipelined_checkpoint_saves_deltas_of_every_update(tmp_path):
  """The resumed batch in flight (the data's last) is applied first, with the checkpoint's
  data position; the next fit starts the data over, numbering its batches from 0: a rule
  that told applied batches by their stream positions dropped those batches' rows from the
  next deltas."""
  batches = make_batches(6, seed=132)
  policy = ck.IncrementalPolicy(full_every=100, max_delta_share=1.0)
  seen = _TablesAtEachStep()
  make_trainer(tmp_path, True, policy).fit(batches, num_steps=5, callbacks=[seen])
  resumed = make_trainer(tmp_path, False, policy)
  # The run ends with the data, after its batch in flight, as it would have uninterrupted.
  assert resumed.fit(batches, num_steps=9, callbacks=[seen]).final_step == 6
  assert resumed.fit(batches, num_steps=9, callbacks=[seen]).final_step == 9
  assert sorted(seen.tables) == list(range(1, 10))
  for step in range(6, 10):
    assert ck.inspect(tmp_path / "checkpoints" / str(step))["embedding"]["chain"][-1][
        "kind"] == "delta"
    restored = _tables(tmp_path, step)
    for name, table in seen.tables[step].items():
      assert_same_bits(restored.tables[name], table)


@pytest.mark.filterwarnings("ignore:checkpoint step .* is skipped:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:.* was in the way of saving step:RuntimeWarning")
def test_a_damaged_link_under_later_deltas_falls_back_and_trains_on(tmp_path):
  """Step 4's chunk truncated under delta 5: the latest step was 5, whose restore raised;
  then the save of step 4 again was refused, and step 5, which no longer restores, blocked
  its own save. Now the run resumes from 3, saves 4 and 5 again (the old ones kept aside)
  and equals one uninterrupted run."""
  batches = make_batches(7, seed=74)
  policy = ck.IncrementalPolicy(max_delta_share=1.0)
  make_trainer(tmp_path, False, policy).fit(batches, num_steps=5)
  root = tmp_path / "checkpoints"
  chunk = next(path for path in sorted((root / "4" / "embedding").rglob("*"))
               if path.is_file() and "/c/" in str(path))
  chunk.write_bytes(chunk.read_bytes()[:-2])
  resumed = make_trainer(tmp_path, False, policy)
  history = resumed.fit(batches)
  assert history.resumed_from == 3 and history.final_step == 7
  reference = make_trainer(None, False, None)
  reference.fit(batches)
  assert_same_run(resumed, reference)
  for step in (4, 5, 7):
    saved = ck.EmbeddingCheckpointHandler().restore(root / str(step) / "embedding",
                                                    ck.TableRestore())
    assert saved.tables  # every step of the new chain restores
  assert (root / "4.incomplete-0").exists() and (root / "5.incomplete-0").exists()
  assert not [p for p in ck.verify(root) if p.severity == "error"]
  last = _tables(tmp_path, 7)
  for name, table in logical_tables(reference).items():
    assert_same_bits(last.tables[name], np.asarray(table))


@pytest.mark.parametrize("pipelining", [True, False])
def test_replaced_tables_are_saved_whole_by_the_next_delta(tmp_path, pipelining):
  """replace_tables changes rows no batch touches: the delta after it must hold them."""
  policy = ck.IncrementalPolicy(full_every=10, max_delta_share=1.0)
  batches = make_batches(5, seed=11)
  for batch in batches:  # Table b: batches touch rows 0 and 1 only.
    batch["sparse"]["fb"] = batch["sparse"]["fb"] % 2
  trainer = make_trainer(tmp_path, pipelining, policy)
  trainer.fit(batches[:1])  # Step 1, a full save.
  pretrained = np.random.default_rng(12).standard_normal((24, 4)).astype(np.float32)
  trainer.replace_tables({"b": pretrained})
  trainer.fit(batches[1:])  # Deltas.
  assert_same_bits(logical_tables(trainer)["b"][2:], pretrained[2:])
  saved = _tables(tmp_path, trainer.latest_checkpoint_step()).tables["b"]
  assert_same_bits(np.asarray(saved)[2:], pretrained[2:])
  resumed = make_trainer(tmp_path, pipelining, policy)
  resumed.fit(batches[1:])  # Resumes the last step; nothing left to train.
  assert_same_run(resumed, trainer)
