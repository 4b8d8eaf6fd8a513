"""Jobs of several processes on localhost that fail, or whose data ends unevenly.

Every job runs mp_worker.py in 2 processes of 4 CPU devices that find each
other through JAX's coordinator; a failure injected into one process (killed,
raising, late, disagreeing on the setup) must end every process within a
bound, naming the cause, and data that ends on one process must end the job
for all (test_multiprocess_jobs.py holds the jobs that train and checkpoint).
"""

from __future__ import annotations

import re

import pytest

from mp_launch import describe, history, launch
from mp_model import BATCHES, SEED, TERMS, local_batches, make_batches, make_trainer
from sc_framework.primitives._row_ops import cpu_kernels_available
from tests.numerics import assert_close

FAILURE_BOUND_S = 30  # a failure ends every process within this (heartbeat: 5 s)


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
      if "processes disagree on the embedding backend: process 0 has backend = 'cpu' but"
         " process 1 has 'xla'" in outcome.stderr
         and "build the kernels on every host" in outcome.stderr
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
  """Then predict and evaluate the same data: the warning says which data ended."""
  outcomes = run_failing(tmp_path, short=1, predict=True)
  assert [o.returncode for o in outcomes] == [0, 0], describe(outcomes)
  for process in (0, 1):
    assert history(tmp_path, process)["final_step"] == BATCHES - 1
  for use, covered in (("training", ""),
                       ("prediction", " (the predictions cover only the batches every process"
                                      " had)"),
                       ("evaluation", " (the metrics cover only the batches every process had)")):
    assert (f"process 0: another process's data ended before this process's, in {use}; the"
            f" global batches end there and this process's remaining batches are not"
            f" used{covered}.") in outcomes[0].stderr, describe(outcomes)
  assert "another process's data ended" not in outcomes[1].stderr, describe(outcomes)


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
