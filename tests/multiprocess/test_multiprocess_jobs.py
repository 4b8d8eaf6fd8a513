"""Jobs of several processes on localhost, against one process of 8 devices.

Every job runs mp_worker.py in 2 or 4 processes that find each other through
JAX's coordinator (gloo collectives on CPU), each with its own CPU devices and
its own slice of every global batch. The reference runs in this pytest
process, on its 8 CPU devices. Gloo's all-reduce sums in another order than
the in-process one, so values agree to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest

from checkpoint import (
    CheckpointManager,
    EmbeddingCheckpointHandler,
    EmbeddingRestore,
    TableRestore,
    inspect,
)
from mp_launch import describe, history, launch
from mp_model import (
    BATCH,
    BATCHES,
    SEED,
    TERMS,
    local_batches,
    logical_arrays,
    make_batches,
    make_specs,
    make_trainer,
    state_arrays,
)
from sc_framework.primitives import EmbeddingPlan
from sc_framework.stacking import unstack
from tests.numerics import assert_close, assert_same_bits

STOP_AT = 3  # the 2 x 4 job stops here, mid-pipeline, and checkpoints


def assert_states_close(got: dict, want: dict) -> None:
  assert sorted(got) == sorted(want)
  for name, value in want.items():
    assert_close(got[name], value, terms=TERMS, steps=BATCHES, err_msg=name)


def reference_run(num_steps=None):
  trainer = make_trainer()
  data = local_batches(trainer, make_batches(BATCHES, SEED))
  return trainer, data, trainer.fit(data, num_steps=num_steps)


@pytest.fixture(scope="module")
def two_by_four(tmp_path_factory):
  """2 processes x 4 devices: train 3 steps, checkpoint (with an in-flight batch), predict.

  Only process 1 requests the stop: both must stop after the same step.
  """
  out = tmp_path_factory.mktemp("two_by_four")
  config = {"out": str(out), "workdir": str(out / "workdir"), "batches": BATCHES, "seed": SEED,
            "stop_at": STOP_AT, "stop_process": 1, "predict": True}
  outcomes = launch(2, 4, config, str(out / "logs"))
  assert [o.returncode for o in outcomes] == [0, 0], describe(outcomes)
  return out


def test_two_processes_train_like_one(two_by_four):
  reference, data, reference_history = reference_run(num_steps=STOP_AT)
  assert_states_close(dict(np.load(two_by_four / "state.npz")), state_arrays(reference))
  losses = [m["loss"] for m in reference_history.metrics]
  for process in (0, 1):
    result = history(two_by_four, process)
    assert result["local_devices"] == [4 * process, 4 * process + 4]
    assert result["final_step"] == STOP_AT and result["interrupted"]
    assert_close(result["losses"], losses, terms=TERMS, steps=STOP_AT)  # global-batch losses
  assert_close(np.load(two_by_four / "predictions.npy"), reference.predict(data), terms=TERMS,
               steps=STOP_AT)
  assert history(two_by_four, 0)["evaluate"] == history(two_by_four, 1)["evaluate"]
  assert_close(history(two_by_four, 0)["evaluate"]["loss"], reference.evaluate(data)["loss"],
               terms=TERMS, steps=STOP_AT)


def test_checkpoint_of_two_by_four_resumes_in_one_process_of_eight(two_by_four, tmp_path):
  workdir = tmp_path / "workdir"
  shutil.copytree(two_by_four / "workdir", workdir)
  trainer = make_trainer(workdir)
  resumed = trainer.fit(local_batches(trainer, make_batches(BATCHES, SEED)))
  assert resumed.resumed_from == STOP_AT and resumed.final_step == BATCHES
  reference, _, _ = reference_run()
  assert_states_close(state_arrays(trainer), state_arrays(reference))


def test_checkpoint_of_two_by_four_resumes_in_four_processes_of_two(two_by_four, tmp_path):
  workdir = tmp_path / "workdir"
  shutil.copytree(two_by_four / "workdir", workdir)
  config = {"out": str(tmp_path), "workdir": str(workdir), "batches": BATCHES, "seed": SEED}
  outcomes = launch(4, 2, config, str(tmp_path / "logs"))
  assert [o.returncode for o in outcomes] == [0] * 4, describe(outcomes)
  for process in range(4):
    result = history(tmp_path, process)
    assert result["local_devices"] == [2 * process, 2 * process + 2]
    assert result["resumed_from"] == STOP_AT and result["final_step"] == BATCHES
  reference, _, _ = reference_run()
  assert_states_close(dict(np.load(tmp_path / "state.npz")), state_arrays(reference))


def test_a_chunk_failing_its_checksum_in_one_process_fails_the_job_saying_what_to_do(
    two_by_four, tmp_path):
  """Only the process reading the chunk sees the damage while the other waits for it inside
  the restore: the job fails fast, telling to move the step away, instead of hanging."""
  workdir = tmp_path / "workdir"
  shutil.copytree(two_by_four / "workdir", workdir)
  item = workdir / "checkpoints" / str(STOP_AT) / "embedding"
  chunk = sorted(item.glob("stacks/*/table/c/*/*"))[-1]  # a shard of process 1's devices
  data = bytearray(chunk.read_bytes())
  data[len(data) // 2] ^= 0x5A
  chunk.write_bytes(bytes(data))
  config = {"out": str(tmp_path), "workdir": str(workdir), "batches": BATCHES, "seed": SEED,
            "timeout_s": 30, "heartbeat_timeout_s": 5}
  outcomes = launch(2, 4, config, str(tmp_path / "logs"), timeout_s=90)
  assert all(o.returncode not in (0, None) for o in outcomes), describe(outcomes)
  assert any(str(chunk) in o.stderr and "A job of several processes cannot skip it on its own"
             " (each process reads its own part of it): move the step out of" in o.stderr
             for o in outcomes), describe(outcomes)


def assert_logically_close(got: dict, got_layout, want: dict, want_layout) -> None:
  """Per-table states equal up to reordered float32 sums (another device count)."""
  got, want = logical_arrays(got, got_layout), logical_arrays(want, want_layout)
  assert sorted(got) == sorted(want)
  for name, value in want.items():
    # Up to every id of a batch (6 per sample) sums into one row, over BATCHES steps.
    assert_close(got[name], value, terms=6 * BATCH, steps=BATCHES, err_msg=name)


def test_mid_run_checkpoint_of_two_by_four_resumes_in_one_process_of_four(two_by_four, tmp_path):
  """The in-flight batch saved by two processes is rebuilt whole and preprocessed for G = 4."""
  workdir = tmp_path / "workdir"
  shutil.copytree(two_by_four / "workdir", workdir)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("devices",))
  trainer = make_trainer(workdir, mesh=mesh)
  resumed = trainer.fit(local_batches(trainer, make_batches(BATCHES, SEED)))
  assert resumed.resumed_from == STOP_AT and resumed.final_step == BATCHES
  reference, _, _ = reference_run()
  assert_logically_close(state_arrays(trainer), trainer.plan.layout,
                         state_arrays(reference), reference.plan.layout)


def test_mid_run_checkpoint_of_two_by_four_resumes_in_two_processes_of_two(two_by_four, tmp_path):
  workdir = tmp_path / "workdir"
  shutil.copytree(two_by_four / "workdir", workdir)
  config = {"out": str(tmp_path), "workdir": str(workdir), "batches": BATCHES, "seed": SEED}
  outcomes = launch(2, 2, config, str(tmp_path / "logs"))
  assert [o.returncode for o in outcomes] == [0, 0], describe(outcomes)
  for process in range(2):
    result = history(tmp_path, process)
    assert result["local_devices"] == [2 * process, 2 * process + 2]
    assert result["resumed_from"] == STOP_AT and result["final_step"] == BATCHES
  reference, _, _ = reference_run()
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("devices",))
  layout = EmbeddingPlan.create(make_specs(), mesh=mesh).layout
  assert_logically_close(dict(np.load(tmp_path / "state.npz")), layout,
                         state_arrays(reference), reference.plan.layout)


def test_checkpoint_of_two_by_four_restores_into_another_device_count(two_by_four):
  """Through the restore-into-layout path: G = 4 devices with S = 2 shards each."""
  saved = make_trainer().plan.layout
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("devices",))
  plan = EmbeddingPlan.create(make_specs(), mesh=mesh, shards_per_device=2)
  assert plan.layout != saved
  with CheckpointManager(two_by_four / "workdir" / "checkpoints") as manager:
    restored = manager.restore(STOP_AT, EmbeddingRestore(
        plan.layout, mesh, "devices", slot_specs=plan.slot_specs()))["embedding"]
  state = np.load(two_by_four / "state.npz")
  for stack in saved.stacks:
    want = unstack({stack.name: state[f".embeddings.tables['{stack.name}']"]}, saved,
                   tables=stack.table_names)
    slot = unstack({stack.name: state[f".embeddings.slots['{stack.name}']['accumulator']"]},
                   saved, tables=stack.table_names)
    for name in stack.table_names:
      target = plan.layout.stack_of_table(name).name
      got = unstack({target: np.asarray(restored.tables[target])}, plan.layout, tables=[name])
      assert_same_bits(got[name], want[name])
      got_slot = unstack({target: np.asarray(restored.slots[target]["accumulator"])},
                         plan.layout, tables=[name])
      assert_same_bits(got_slot[name], slot[name])


def test_incremental_checkpoints_of_two_processes_restore_exactly_and_resume(tmp_path):
  """2 x 4 with a delta save every step: each process writes its rows of every delta."""
  config = {"out": str(tmp_path), "workdir": str(tmp_path / "workdir"), "batches": BATCHES,
            "seed": SEED, "stop_at": STOP_AT, "save_every": 1,
            "incremental": {"max_delta_share": 1.0}}
  outcomes = launch(2, 4, config, str(tmp_path / "logs"))
  assert [o.returncode for o in outcomes] == [0, 0], describe(outcomes)
  root = tmp_path / "workdir" / "checkpoints"
  chain = inspect(root / str(STOP_AT))["embedding"]["chain"]
  assert [link["kind"] for link in chain][-1] == "delta" and len(chain) >= 3
  # The delta step holds the stopped state bit for bit, table by table.
  layout = make_trainer().plan.layout
  state = logical_arrays(dict(np.load(tmp_path / "state.npz")), layout)
  restored = EmbeddingCheckpointHandler().restore(root / str(STOP_AT) / "embedding",
                                                  TableRestore())
  for name, table in restored.tables.items():
    assert_same_bits(table, state[f".embeddings.tables[{name!r}]"])
  # And resumes in one process of 8 devices like the uninterrupted run.
  trainer = make_trainer(tmp_path / "workdir")
  resumed = trainer.fit(local_batches(trainer, make_batches(BATCHES, SEED)))
  assert resumed.resumed_from == STOP_AT and resumed.final_step == BATCHES
  reference, _, _ = reference_run()
  assert_states_close(state_arrays(trainer), state_arrays(reference))
