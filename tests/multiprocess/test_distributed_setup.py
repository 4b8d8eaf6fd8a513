"""The single-process side of the multi-process support (no job is started here)."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from pipelining import (
    DistributedError,
    DistributedJob,
    allgather_json,
    barrier,
    check_agreement,
    initialize_distributed,
)
from pipelining._distributed import _client
from pipelining._data import own_position, share_position
from pipelining._placement import to_global
from sc_framework.primitives import EmbeddingPlan, process_major_devices
from mp_model import make_specs

ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


@pytest.fixture
def clean_env(monkeypatch):
  for name in ENV:
    monkeypatch.delenv(name, raising=False)
  return monkeypatch


def test_one_process_initialises_nothing(clean_env):
  assert initialize_distributed() == DistributedJob(0, 1, 10)
  assert not initialize_distributed(num_processes=1)
  clean_env.setenv("JAX_NUM_PROCESSES", "1")
  assert initialize_distributed().joined is False
  assert not jax.distributed.is_initialized()


def test_a_one_process_job_lets_exceptions_through(clean_env):
  hook = sys.excepthook
  with pytest.raises(ValueError, match="raised inside"):
    with initialize_distributed() as job:
      assert sys.excepthook is hook
      raise ValueError("raised inside")
  assert job.joined is False and sys.excepthook is hook


_FAILING_JOB = """
import sys
from pipelining import DistributedJob
hook = sys.excepthook
try:
  with DistributedJob(process_id=1, num_processes=2, heartbeat_timeout_s=7):
    assert sys.excepthook is hook, "entering the job changed sys.excepthook"
    print("inside", flush=True)
    raise KeyError("failure inside the job")
finally:
  print("outer finally ran", flush=True)
"""

_EXITING_JOB = """
import sys
from pipelining import DistributedJob
try:
  with DistributedJob(process_id=1, num_processes=2, heartbeat_timeout_s=7):
    print("inside", flush=True)
    if {code} == 2:
      print("prog: error: a bad flag", file=sys.stderr)
    sys.exit({code})
finally:
  print("outer finally ran", flush=True)
"""

_FINISHING_JOB = """
import sys
from pipelining import DistributedJob
hook = sys.excepthook
with DistributedJob(process_id=1, num_processes=2, heartbeat_timeout_s=7):
  pass
try:
  with DistributedJob(process_id=1, num_processes=2, heartbeat_timeout_s=7):
    sys.exit(0)
finally:
  assert sys.excepthook is hook
  print("after the job", flush=True)
"""


def _run_python(code: str) -> subprocess.CompletedProcess:
  root = pathlib.Path(__file__).resolve().parents[2]
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                        timeout=120, check=False)


def test_a_joined_job_fails_fast_only_inside():
  """An exception leaving the job ends the process at once; nothing is installed globally."""
  failed = _run_python(_FAILING_JOB)
  assert failed.returncode == 1, failed.stderr
  assert failed.stdout == "inside\n", failed.stdout  # the outer finally never ran
  assert "KeyError: 'failure inside the job'" in failed.stderr
  assert "process 1 of 2 failed with KeyError; exiting now so that the other processes stop" \
         " within 7s" in failed.stderr
  # Leaving normally, or with a SystemExit of success, takes Python's usual path.
  finished = _run_python(_FINISHING_JOB)
  assert (finished.returncode, finished.stdout) == (0, "after the job\n"), finished.stderr


def test_a_failing_exit_of_one_process_ends_it_at_once_with_its_status():
  """An argparse error in one process only (a flag the others did not get) exited through
  Python's shutdown, which waits for the other processes: the job hung a minute, then the
  runtime aborted every process without saying why."""
  failed = _run_python(_EXITING_JOB.format(code=2))
  assert failed.returncode == 2 and failed.stdout == "inside\n", failed.stderr
  assert "prog: error: a bad flag" in failed.stderr and "Traceback" not in failed.stderr
  assert ("process 1 of 2 exited with status 2; exiting now so that the other processes stop"
          " within 7s") in failed.stderr, failed.stderr
  message = _run_python(_EXITING_JOB.format(code="'a message'"))
  assert message.returncode == 1 and "a message\nprocess 1 of 2 exited with status 1" in (
      message.stderr), message.stderr


_JOB_ON_A_TAKEN_PORT = """
from pipelining import initialize_distributed
initialize_distributed("localhost:{port}", num_processes=2, process_id=0, timeout_s=60)
"""


def test_a_coordinator_port_in_use_is_named_at_once():
  """Process 0 on a port another program holds failed at once, with "could not join the job
  within 120s: Failed to start RPC server": neither the port nor the real elapsed time."""
  with socket.socket() as holder:
    holder.bind(("localhost", 0))
    holder.listen()
    failed = _run_python(_JOB_ON_A_TAKEN_PORT.format(port=holder.getsockname()[1]))
  assert failed.returncode == 1, failed.stderr
  assert "process 0 of 2 could not start the job's coordinator service at localhost:" in (
      failed.stderr), failed.stderr
  assert "the port is in use" in failed.stderr and "the timeout is" not in failed.stderr


def test_the_private_runtime_client_is_where_it_is_read(monkeypatch):
  """JAX has no public key-value store; `_client` reads its private one (only there).

  Fails loudly when a JAX upgrade moves it: then update `_client`.
  """
  from jax._src import distributed  # the one private import, as in _client
  assert hasattr(distributed.global_state, "client"), (
      f"JAX {jax.__version__} moved jax._src.distributed.global_state.client, which"
      " pipelining/_distributed.py:_client reads: update _client.")
  client_type = type(distributed.global_state).__annotations__.get("client", "")
  runtime_client = getattr(getattr(jax._src.lib, "_jax", None), "DistributedRuntimeClient", None)
  for method in ("key_value_set", "blocking_key_value_get", "wait_at_barrier"):
    assert hasattr(runtime_client, method), (
        f"JAX {jax.__version__}'s distributed runtime client ({client_type}) has no {method}"
        " any more, which pipelining/_distributed.py uses: update it.")
  with pytest.raises(DistributedError, match=r"runtime is not initialised in this process"):
    _client()
  monkeypatch.setattr(distributed, "global_state", object())
  with pytest.raises(DistributedError, match=r"no longer has its distributed runtime client at"
                                             r" jax._src.distributed.global_state.client"):
    _client()


@pytest.mark.parametrize("env, match", [
    ({"JAX_NUM_PROCESSES": "2", "JAX_COORDINATOR_ADDRESS": "localhost:1"},
     r"num_processes=2 needs process_id: pass them or set JAX_PROCESS_ID"),
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"},
     r"needs coordinator_address: pass them or set JAX_COORDINATOR_ADDRESS"),
    ({"JAX_NUM_PROCESSES": "two"}, r"environment variable JAX_NUM_PROCESSES='two' is not an"),
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2", "JAX_COORDINATOR_ADDRESS": "h:1"},
     r"process_id must be an int in \[0, 2\), got 2"),
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1", "JAX_COORDINATOR_ADDRESS": "host"},
     r"coordinator_address must be host:port with a port in \[1, 65535\], got 'host'"),
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1", "JAX_COORDINATOR_ADDRESS": "host:x"},
     r"with a port in \[1, 65535\], got 'host:x'"),
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1", "JAX_COORDINATOR_ADDRESS": ":123"},
     r"with a port in \[1, 65535\], got ':123'"),
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1", "JAX_COORDINATOR_ADDRESS": "h:70000"},
     r"with a port in \[1, 65535\], got 'h:70000'"),
    ({"JAX_COORDINATOR_ADDRESS": "localhost:1"}, r"no number of processes"),
])
def test_incomplete_settings_name_what_is_missing(clean_env, env, match):
  for name, value in env.items():
    clean_env.setenv(name, value)
  with pytest.raises(ValueError, match=match):
    initialize_distributed()
  assert not jax.distributed.is_initialized()


def test_coordination_helpers_are_free_in_one_process():
  barrier("anything", timeout_s=0.001)
  check_agreement("setup", {"a": 1})
  assert allgather_json("x", {"b": [1, 2]}) == [{"b": [1, 2]}]


def test_default_mesh_is_process_major():
  plan = EmbeddingPlan.create(make_specs())
  assert list(plan.mesh.devices) == process_major_devices() == jax.devices()
  assert plan.local_devices() == range(8)


def test_processes_with_other_device_counts_are_refused_by_count(monkeypatch, tmp_path):
  """Processes started with other --cpu-devices (2 and 3) failed in Orbax's manager with
  "cannot reshape array of size 5 into shape (2,2)"."""
  from checkpoint import CheckpointManager
  from sc_framework.primitives import check_devices_per_process
  for name, value in (("process_count", 2), ("process_index", 1), ("local_device_count", 3),
                      ("device_count", 5)):
    monkeypatch.setattr(jax, name, lambda value=value: value)
  message = "process 1 has 3 devices, but the job's 2 processes have 5 in all"
  for refused in (check_devices_per_process, process_major_devices,
                  lambda: CheckpointManager(tmp_path / "ckpt")):
    with pytest.raises(ValueError, match=message):
      refused()
  assert not (tmp_path / "ckpt").exists()
  monkeypatch.setattr(jax, "device_count", lambda: 6)
  check_devices_per_process()  # an equal share: nothing to say


def test_data_positions_follow_the_process_count():
  assert share_position({"batches_consumed": 3, "position": {"i": 3}}) == {
      "batches_consumed": 3, "position": {"i": 3}}
  one = {"batches_consumed": 3, "epoch": 0, "position": {"i": 3}}
  assert own_position(one) == one
  same = {"batches_consumed": 3, "position": None, "process_positions": [{"i": 7}]}
  assert own_position(same) == {"batches_consumed": 3, "position": {"i": 7}}
  other = {"batches_consumed": 3, "position": None, "process_positions": [{"i": 1}, {"i": 2}]}
  assert own_position(other) == {"batches_consumed": 3, "position": None}


def test_a_slice_the_devices_cannot_split_is_named():
  sharding = EmbeddingPlan.create(make_specs()).row_sharding()
  with pytest.raises(ValueError, match=r"labels: this process's slice has 12 rows, which its 8"
                                       r" devices cannot split evenly"):
    to_global(np.zeros(12, np.float32), sharding, 8, 8, "labels")
