"""Runs a job of several worker processes on localhost, bounded and cleaned up.

Each process gets its own CPU devices (XLA_FLAGS) and finds the others
through JAX's coordinator on a free port; the job runs under a deadline and
any process still alive when `launch` returns is killed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "mp_worker.py")


@dataclasses.dataclass
class Outcome:
  """One process: exit status (None: killed at the deadline), output, exit time."""

  returncode: int | None
  stdout: str
  stderr: str
  ended_at: float


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def launch(num_processes: int, devices_per_process: int, config: dict, logs: str, *,
           timeout_s: float = 150, only: list[int] | None = None) -> list[Outcome]:
  """Starts the job, waits for every process (at most timeout_s), kills leftovers.

  Args:
    only: start just these process ids (the others never come up).
  """
  os.makedirs(logs, exist_ok=True)
  port = free_port()
  base = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
  base.update(
      XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_process}",
      JAX_PLATFORMS="cpu",
      PYTHONPATH=os.pathsep.join([REPO, HERE]),
      PYTHONUNBUFFERED="1",
  )
  if num_processes > 1:
    base.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(num_processes))
  processes, files = [], []
  try:
    for index in (range(num_processes) if only is None else only):
      env = dict(base, JAX_PROCESS_ID=str(index)) if num_processes > 1 else base
      out = open(os.path.join(logs, f"stdout_{index}.txt"), "w+")
      err = open(os.path.join(logs, f"stderr_{index}.txt"), "w+")
      files.append((out, err))
      processes.append(subprocess.Popen([sys.executable, WORKER, json.dumps(config)], env=env,
                                        stdout=out, stderr=err, cwd=REPO))
    deadline = time.monotonic() + timeout_s
    ended = [None] * len(processes)
    while time.monotonic() < deadline and None in ended:
      for index, process in enumerate(processes):
        if ended[index] is None and process.poll() is not None:
          ended[index] = time.time()
      time.sleep(0.05)
  finally:
    for process in processes:
      if process.poll() is None:
        process.kill()
      process.wait()
  outcomes = []
  for index, (process, (out, err)) in enumerate(zip(processes, files)):
    out.seek(0)
    err.seek(0)
    outcomes.append(Outcome(process.returncode if ended[index] is not None else None,
                            out.read(), err.read(), ended[index] or time.time()))
    out.close()
    err.close()
  return outcomes


def describe(outcomes: list[Outcome]) -> str:
  """The tail of every process's stderr, for assertion messages."""
  return "\n".join(f"--- process {i} exit {o.returncode}:\n{o.stderr[-2500:]}"
                   for i, o in enumerate(outcomes))


def history(out, process: int) -> dict:
  """What process `process` of a job recorded in `out` (mp_worker.py writes it)."""
  return json.loads((out / f"history_{process}.json").read_text())
