"""Jobs of several processes on localhost, against one process of 8 devices.

Every job runs mp_worker.py in 2 or 4 processes that find each other through
JAX's coordinator (gloo collectives on CPU), each with its own CPU devices and
its own slice of every global batch. The reference runs in this pytest
process, on its 8 CPU devices. Gloo's all-reduce sums in another order than
the in-process one, so values agree to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import json
import re
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
from mp_launch import describe, launch
from mp_model import (
    BATCH,
    local_batches,
    logical_arrays,
    make_batches,
    make_specs,
    make_trainer,
    state_arrays,
)
from sc_framework.primitives import EmbeddingPlan
from sc_framework.primitives._row_ops import cpu_kernels_available
from sc_framework.stacking import unstack
from tests.numerics import assert_close, assert_same_bits

SEED = 11
BATCHES = 6
STOP_AT = 3  # the 2 x 4 job stops here, mid-pipeline, and checkpoints
FAILURE_BOUND_S = 30  # a failure ends every process within this (heartbeat: 5 s)


# Processes x devices reorder the cross-device sums: a row of table "a" sums
# the gradients of all its ids in a global batch (BATCH * 4), over up to
# BATCHES chained steps.
TERMS = BATCH * 4


def assert_states_close(got: dict, want: dict) -> None:
  assert sorted(got) == sorted(want)
  for name, value in want.items():
    assert_close(got[name], value, terms=TERMS, steps=BATCHES, err_msg=name)


def history(out, process: int) -> dict:
  return json.loads((out / f"history_{process}.json").read_text())


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


def failed_at(out) -> float:
  return float((out / "failed_at.txt").read_text())


def run_failing(tmp_path, **config):
  config = {"out": str(tmp_path), "workdir": None, "batches": BATCHES, "seed": SEED,
            "timeout_s": 30, "heartbeat_timeout_s": 5, **config}
  return launch(2, 4, config, str(tmp_path / "logs"), timeout_s=90)


def test_a_killed_process_stops_the_others(tmp_path):
  outcomes = run_failing(tmp_path, fail={"process": 1, "step": 2, "how": "kill"})
  assert outcomes[1].returncode == -9, describe(outcomes)
  survivor = outcomes[0]
  assert survivor.returncode not in (0, None), describe(outcomes)
  assert survivor.ended_at - failed_at(tmp_path) < FAILURE_BOUND_S
  assert re.search(r"process 0 of 2 failed|distributed service detected fatal errors",
                   survivor.stderr), describe(outcomes)


def test_a_raising_process_stops_the_others(tmp_path):
  outcomes = run_failing(tmp_path, fail={"process": 1, "step": 2, "how": "raise"})
  assert "injected failure in process 1" in outcomes[1].stderr, describe(outcomes)
  assert "process 1 of 2 failed with RuntimeError" in outcomes[1].stderr
  assert outcomes[1].returncode == 1 and outcomes[0].returncode not in (0, None)
  assert max(o.ended_at for o in outcomes) - failed_at(tmp_path) < FAILURE_BOUND_S


def test_processes_that_disagree_fail_naming_the_difference(tmp_path):
  outcomes = run_failing(tmp_path, learning_rate=[0.3, 0.2])
  named = [
      outcome for outcome in outcomes
      if ("processes disagree on the trainer setup: process 0 has optimizers.a__b ="
          " 'Adagrad(learning_rate=0.3") in outcome.stderr
      and "process 1 has 'Adagrad(learning_rate=0.2" in outcome.stderr
  ]
  # Every process reads every value before any raises, and process 0 (which
  # hosts the coordinator) waits for the others to report before it exits,
  # so every process names the difference.
  assert len(named) == len(outcomes), describe(outcomes)
  # Exit status 1 from the fail-fast exit, or a signal when the runtime ends a
  # process that has already printed its error once the coordinator is gone.
  assert all(outcome.returncode not in (0, None) for outcome in outcomes), describe(outcomes)


def test_processes_with_workdirs_they_do_not_share_fail_naming_them(tmp_path):
  """Each process writes its part of every checkpoint in the workdir: directories that are
  not shared would leave the first save waiting forever for the other parts."""
  own = [str(tmp_path / "host0"), str(tmp_path / "host1")]
  outcomes = run_failing(tmp_path, workdir=own, stop_at=2)
  named = [outcome for outcome in outcomes
           if f"processes [1] do not reach the workdir of process 0 ({own[0]!r})" in outcome.stderr
           and f"in its workdir {own[1]!r}" in outcome.stderr]
  assert len(named) == len(outcomes), describe(outcomes)
  assert all(outcome.returncode not in (0, None) for outcome in outcomes), describe(outcomes)
  assert [p.name for p in (tmp_path / "host0").iterdir()] == []  # the marker is removed


def test_a_workdir_on_one_process_only_fails_naming_it(tmp_path):
  outcomes = run_failing(tmp_path, workdir=[str(tmp_path / "workdir"), None], stop_at=2)
  named = [outcome for outcome in outcomes
           if "processes disagree on the trainer setup: process 0 has workdir given = True but"
              " process 1 has False" in outcome.stderr]
  assert len(named) == len(outcomes), describe(outcomes)
  assert all(outcome.returncode not in (0, None) for outcome in outcomes), describe(outcomes)


def test_a_mesh_without_the_devices_of_a_process_fails_naming_it(tmp_path):
  outcomes = run_failing(tmp_path, mesh_devices=4)  # process 0's devices only
  assert "process 1 has no device on mesh axis 'devices' (the mesh's devices belong to" \
         " processes [0])" in outcomes[1].stderr, describe(outcomes)
  assert all(outcome.returncode not in (0, None) for outcome in outcomes), describe(outcomes)


@pytest.mark.skipif(not cpu_kernels_available(), reason="needs the C++ CPU kernels")
def test_processes_that_choose_different_backends_fail_naming_them(tmp_path):
  """A host without the built kernels picks the portable backend under "auto";
  the job must stop naming it, not hang in programs that differ."""
  outcomes = run_failing(tmp_path, no_kernels=1)
  named = [
      outcome for outcome in outcomes
      if "processes disagree on the trainer setup: process 0 has backend = 'cpu' but process 1"
         " has 'xla'" in outcome.stderr and "build the kernels on every host" in outcome.stderr
  ]
  assert len(named) == len(outcomes), describe(outcomes)
  assert all(outcome.returncode not in (0, None) for outcome in outcomes), describe(outcomes)


def test_a_process_that_does_not_arrive_times_out(tmp_path):
  outcomes = run_failing(tmp_path, late={"process": 1, "seconds": 60}, timeout_s=8)
  assert outcomes[0].returncode == 1, describe(outcomes)
  assert "DistributedError: process 0: processes [1] did not reach 'agree/trainer setup'" \
         " within 8s" in outcomes[0].stderr
  assert outcomes[1].returncode not in (0, None), describe(outcomes)  # taken down, not hung
  assert outcomes[1].ended_at - outcomes[0].ended_at < FAILURE_BOUND_S


def test_the_data_ends_for_all_when_one_process_has_fewer_batches(tmp_path):
  outcomes = run_failing(tmp_path, short=1)
  assert [o.returncode for o in outcomes] == [0, 0], describe(outcomes)
  for process in (0, 1):
    assert history(tmp_path, process)["final_step"] == BATCHES - 1
  assert "process 0: another process's data ended" in outcomes[0].stderr


@pytest.mark.parametrize("pipelining", [False, True])
def test_passes_of_unequal_length_stop_every_process_where_the_shortest_ends(tmp_path,
                                                                              pipelining):
  """With epochs=2, the process with fewer batches started its second pass while the other
  was still in its first: steps 4 to 6 joined slices of different global batches, and the
  job ended with exit status 0."""
  outcomes = run_failing(tmp_path, short=1, epochs=2, pipelining=pipelining)
  assert [o.returncode for o in outcomes] == [0, 0], describe(outcomes)
  for process in (0, 1):
    assert history(tmp_path, process)["final_step"] == BATCHES - 1
    assert "batches are of different passes over their data" in outcomes[process].stderr
  trainer = make_trainer(pipelining=pipelining)  # one process: the first pass's steps
  reference = trainer.fit(local_batches(trainer, make_batches(BATCHES, SEED)),
                          num_steps=BATCHES - 1)
  assert_close(history(tmp_path, 0)["losses"], [m["loss"] for m in reference.metrics],
               terms=TERMS, steps=BATCHES - 1)


def test_a_synchronous_job_stopped_at_num_steps_sees_the_data_end_on_any_process(tmp_path):
  """The look past num_steps agrees on the end like a step does: one process's data ends."""
  outcomes = run_failing(tmp_path, short=1, num_steps=BATCHES - 1, pipelining=False)
  assert [o.returncode for o in outcomes] == [0, 0], describe(outcomes)
  for process in (0, 1):
    assert history(tmp_path, process)["final_step"] == BATCHES - 1
  assert "process 0: another process's data ended" in outcomes[0].stderr, describe(outcomes)
  assert "another process's data ended" not in outcomes[1].stderr, describe(outcomes)


def test_the_data_ends_for_all_when_one_process_has_no_batches(tmp_path):
  """A process without a batch cannot build: every process stops before building, none
  waits for it until the distributed timeout and fails."""
  outcomes = run_failing(tmp_path, empty=1)
  assert [o.returncode for o in outcomes] == [0, 0], describe(outcomes)
  for process in (0, 1):
    assert history(tmp_path, process)["final_step"] == 0
  assert "process 0: the data of processes [1] holds no batch" in outcomes[0].stderr


def test_a_job_whose_processes_do_not_all_start_fails_at_start_up(tmp_path):
  config = {"out": str(tmp_path), "workdir": None, "batches": BATCHES, "seed": SEED,
            "timeout_s": 5}
  outcomes = launch(2, 4, config, str(tmp_path / "logs"), timeout_s=60, only=[0])
  assert outcomes[0].returncode not in (0, None), describe(outcomes)  # ended, did not hang
  # JAX ends the process itself (or raises, which initialize_distributed rewords).
  assert re.search(r"DEADLINE_EXCEEDED|process 0 of 2 could not join the job",
                   outcomes[0].stderr), describe(outcomes)
