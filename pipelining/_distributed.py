"""Several processes (one per host, or several on one machine) as one job.

JAX's own distributed runtime is the engine: `initialize_distributed` joins
this process to the job (`jax.distributed.initialize`, gloo collectives on
CPU) and returns a `DistributedJob`; after it, `jax.devices()` lists the
devices of every process and the Trainer, the primitives and the checkpoints
run unchanged, each process feeding only its share of every global batch
(`EmbeddingPlan.local_devices`). Entering the job (`with
initialize_distributed(...):`) scopes the fail-fast exit below to the code
inside; nothing here changes process-wide state such as `sys.excepthook`.

Failure, not a hang:
  * a process that never connects: the others end after `timeout_s` in
    `initialize_distributed` (JAX stops them with "DEADLINE_EXCEEDED ...
    RegisterTask", or raises, reworded here);
  * a process that dies (killed, crashed): the runtime misses its heartbeats
    and ends every other process within about `heartbeat_timeout_s`, with
    "Terminating process because the JAX distributed service detected fatal
    errors ... another task died";
  * a process that raises out of an entered `DistributedJob`: it prints the
    error and exits at once (status 1), skipping the orderly shutdown that
    would otherwise keep the others waiting in their next collective for
    `shutdown_timeout_s`; they then stop as for a dead process (process 0,
    which hosts the coordinator, first gives processes failing with it a few
    seconds to print their own errors). Outside a `with` block an exception
    takes Python's usual path;
  * processes that disagree (other specs, batch sizes, options, steps) or a
    process that does not arrive: `check_agreement` and `barrier` raise
    `DistributedError` after at most `timeout_s`, naming the processes and
    the difference, before any collective could hang on them;
  * a workdir that is not one directory shared by every process (each
    host's own disk) or that only some processes have: the Trainer raises
    `DistributedError` when it is built (`check_shared_directory`), instead
    of the first save waiting forever for the other processes' parts.

The environment variables read when an argument is not given:
  JAX_COORDINATOR_ADDRESS  host:port of process 0's coordinator service
  JAX_NUM_PROCESSES        the number of processes
  JAX_PROCESS_ID           this process's id, 0 .. JAX_NUM_PROCESSES - 1
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import json
import math
import os
import socket
import sys
import time
import traceback
import uuid
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import jax
from etils import epath

ENV_COORDINATOR_ADDRESS = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"

DEFAULT_TIMEOUT_S = 120.0
_KEY_PREFIX = "sc_framework"


class DistributedError(RuntimeError):
  """Processes of one job disagree, or one did not arrive in time."""


class _State:
  timeout_s: float = DEFAULT_TIMEOUT_S
  calls: collections.Counter = collections.Counter()


_state = _State()


def _from_env(value: Any, env: str, kind: type) -> Any:
  if value is not None:
    return value
  raw = os.environ.get(env)
  if raw is None or raw == "":
    return None
  if kind is int:
    try:
      return int(raw)
    except ValueError:
      raise ValueError(f"environment variable {env}={raw!r} is not an integer.") from None
  return raw


def resolve_job_settings(coordinator_address=None, num_processes=None,
                         process_id=None) -> tuple[str | None, int, int]:
  """(coordinator address, number of processes, process id) as `initialize_distributed`
  takes them: the arguments, else the environment variables; (None, 1, 0) for a single
  process. A program can check its flags with it before starting (examples/dlrm.py).

  Raises:
    ValueError: settings that name no job (a process id without a number of
      processes, a missing coordinator, an id out of range), naming them.
  """
  address = _from_env(coordinator_address, ENV_COORDINATOR_ADDRESS, str)
  count = _from_env(num_processes, ENV_NUM_PROCESSES, int)
  index = _from_env(process_id, ENV_PROCESS_ID, int)
  if count is None or count == 1:
    if count is None and (address is not None or index not in (None, 0)):
      raise ValueError(
          f"a coordinator address ({address!r}) or process id ({index!r}) was given but no"
          f" number of processes; pass num_processes or set {ENV_NUM_PROCESSES}."
      )
    return None, 1, 0
  if isinstance(count, bool) or not isinstance(count, int) or count < 1:
    raise ValueError(f"num_processes must be an int >= 1, got {count!r}.")
  missing = [name for name, value, env in (
      ("coordinator_address", address, ENV_COORDINATOR_ADDRESS),
      ("process_id", index, ENV_PROCESS_ID)) if value is None]
  if missing:
    envs = {"coordinator_address": ENV_COORDINATOR_ADDRESS, "process_id": ENV_PROCESS_ID}
    raise ValueError(
        f"num_processes={count} needs {' and '.join(missing)}: pass them or set"
        f" {', '.join(envs[m] for m in missing)} (the coordinator is host:port of process 0)."
    )
  if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
    raise ValueError(f"process_id must be an int in [0, {count}), got {index!r}.")
  _coordinator_port(address)
  return address, count, index


def _coordinator_port(address: str) -> int:
  """The port of a "host:port" coordinator address (IPv6 hosts in brackets).

  Raises:
    ValueError: no port, or one that is not an integer in [1, 65535].
  """
  host, colon, port = address.rpartition(":")
  if not colon or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
    raise ValueError(
        f"coordinator_address must be host:port with a port in [1, 65535], got {address!r}"
        " (e.g. 'localhost:12345', or '10.0.0.1:12345' for several hosts)."
    )
  return int(port)


@dataclasses.dataclass(frozen=True)
class DistributedJob:
  """This process's place in a job; a context manager that fails fast.

  Leaving the `with` block with an exception prints it and ends the process
  at once with status 1 (`os._exit`: no `finally` blocks or exit handlers
  outside the block run), so that the other processes stop within
  `heartbeat_timeout_s` instead of waiting in a collective for a peer that
  will never come; see the module docstring. A `SystemExit` of a failure
  (a status other than 0 or None, as argparse's error exits with 2) ends it
  the same way with its own status, after its message; one of success takes
  Python's usual path, as leaving normally or any use in a single process.
  Nothing is installed process-wide: the fail-fast exit covers exactly the
  code inside the block.

  Attributes:
    process_id: this process, in [0, num_processes).
    num_processes: processes in the job (1: a single process, no job).
    heartbeat_timeout_s: how long the runtime waits for a silent process.
  """

  process_id: int
  num_processes: int
  heartbeat_timeout_s: int

  @property
  def joined(self) -> bool:
    """Whether this process is part of a job of several processes."""
    return self.num_processes > 1

  def __bool__(self) -> bool:
    # `if initialize_distributed(...):` keeps meaning "joined a job".
    return self.joined

  def __enter__(self) -> DistributedJob:
    return self

  def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
               tb: TracebackType | None) -> None:
    if value is None or not self.joined:
      return
    if isinstance(value, SystemExit) and value.code in (None, 0):
      return  # A successful exit: the others finish too.
    _fail_fast(self, kind, value, tb)


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    heartbeat_timeout_s: int = 10,
    shutdown_timeout_s: int = 60,
) -> DistributedJob:
  """Joins this process to a multi-process job; a no-op for one process.

  Call it first, before any other JAX call, and run the job inside the
  returned `DistributedJob` so that a failing process ends the whole job
  quickly. Every process runs the same program with the same arguments
  except the process id; process 0 also runs the coordinator service at
  `coordinator_address`.

  Args:
    coordinator_address: "host:port" of process 0, reachable from every
      process; default $JAX_COORDINATOR_ADDRESS.
    num_processes: processes in the job; default $JAX_NUM_PROCESSES, and
      none (or 1) means a single process: nothing is initialised.
    process_id: this process, in [0, num_processes); default $JAX_PROCESS_ID.
    timeout_s: how long to wait for every process to connect, and the
      timeout of `barrier` and `check_agreement`.
    heartbeat_timeout_s: a process silent this long counts as dead, and the
      runtime ends every other process.
    shutdown_timeout_s: how long a finishing process waits for the others at
      exit.

  Returns:
    The job: its `joined` (also its truth value) is True when this process
    is one of several (also when the runtime was already initialised), False
    for a single process. Use it as a context manager to fail fast.

  Raises:
    ValueError: missing or malformed arguments / environment variables.
    RuntimeError: JAX was used before this call, or the job did not form
      within `timeout_s`.

  Example:
    with initialize_distributed("10.0.0.1:1234", num_processes=2, process_id=0):
      trainer = Trainer(model, specs, loss, optax.adam(1e-3))  # all devices
      trainer.fit(my_slices)
  """
  if jax.distributed.is_initialized():
    _state.timeout_s = float(timeout_s)
    return DistributedJob(jax.process_index(), jax.process_count(), int(heartbeat_timeout_s))
  address, count, index = resolve_job_settings(coordinator_address, num_processes, process_id)
  _state.timeout_s = float(timeout_s)
  if count == 1:
    return DistributedJob(0, 1, int(heartbeat_timeout_s))
  if getattr(jax.config, "jax_cpu_collectives_implementation", "gloo") is None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  minutes = max(1, math.ceil(timeout_s / 60))
  for option in ("jax_cpu_get_local_topology_timeout_minutes",
                 "jax_cpu_get_global_topology_timeout_minutes"):
    if hasattr(jax.config, option):  # CPU start-up waits for every process this long
      jax.config.update(option, minutes)
  if index == 0:
    _check_port_free(address, count)
  # Said before the wait: a process that never comes leaves the others silent until the
  # timeout, when JAX's runtime may end them itself.
  sys.stderr.write(f"process {index} of {count}: joining the job at {address} (waiting up to"
                   f" {timeout_s:g}s for every process to connect)\n")
  sys.stderr.flush()
  started = time.monotonic()
  try:
    jax.distributed.initialize(
        address, count, index,
        initialization_timeout=max(1, int(timeout_s)),
        heartbeat_timeout_seconds=int(heartbeat_timeout_s),
        shutdown_timeout_seconds=int(shutdown_timeout_s),
    )
  except RuntimeError as error:
    if "must be called before" in str(error):
      raise RuntimeError(
          "initialize_distributed must run before any other JAX call (jax.devices(), creating"
          " arrays, a Trainer, ...): move it to the start of the program."
      ) from error
    raise RuntimeError(_join_failure(error, address, count, index,
                                     time.monotonic() - started, timeout_s)) from error
  return DistributedJob(index, count, int(heartbeat_timeout_s))


def _port_in_use(address: str, count: int, reason: str) -> str:
  return (
      f"process 0 of {count} could not start the job's coordinator service at {address}"
      f" ({reason}): the port is in use, by another job or by a process of an earlier run"
      " that is still running, or the host is not an address of this machine. Choose a free"
      " port (the same coordinator address for every process) or end the process holding it."
  )


def _check_port_free(address: str, count: int) -> None:
  """Raises if process 0's coordinator service could not listen on its port.

  JAX's runtime listens on every address of this host at the coordinator's
  port (`[::]:port`, or $JAX_COORDINATOR_BIND_ADDRESS) and, when the port is
  taken, sometimes crashes the process (a segmentation fault) instead of
  raising. So the port is tried here first, the way the runtime binds it
  (SO_REUSEADDR: a port left in TIME_WAIT by an earlier run is free).

  Raises:
    RuntimeError: the port is in use, naming it and what to do.
  """
  bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS") or f"[::]:{_coordinator_port(address)}"
  host, _, port = bind.rpartition(":")
  host = host.strip("[]")
  families = [(socket.AF_INET6, host or "::"), (socket.AF_INET, "0.0.0.0")] if host in (
      "", "::", "0.0.0.0") else [(socket.AF_UNSPEC, host)]
  for family, bind_host in families:
    try:
      infos = socket.getaddrinfo(bind_host, int(port), family, socket.SOCK_STREAM, 0,
                                 socket.AI_PASSIVE)
    except (OSError, ValueError):
      continue  # an address the runtime resolves otherwise: it says what is wrong
    for info_family, kind, protocol, _, socket_address in infos:
      try:
        probe = socket.socket(info_family, kind, protocol)
      except OSError:
        continue  # no IPv6 here: the IPv4 wildcard is tried next
      with probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if info_family == socket.AF_INET6:
          probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        try:
          probe.bind(socket_address)
        except OSError as error:
          if error.errno == errno.EADDRINUSE:
            raise RuntimeError(_port_in_use(address, count, f"port {port}: {error.strerror}"))
          continue
        return


def _join_failure(error: Exception, address: str, count: int, index: int,
                  elapsed_s: float, timeout_s: float) -> str:
  """Why this process could not join the job, and what to check.

  Process 0 starts the coordinator service on the address's port; when the
  runtime cannot start it ("Failed to start RPC server"), the port is taken
  or the host is no address of this machine: that is said instead of a
  timeout, since it fails at once.
  """
  if index == 0 and "Failed to start RPC server" in str(error):
    return _port_in_use(address, count, str(error))
  return (
      f"process {index} of {count} could not join the job at {address}: {error} (after"
      f" {elapsed_s:.0f}s; the timeout is {timeout_s:g}s). Check that every process was started"
      " with the same coordinator address and process count, that process 0 runs, and that"
      " the port is reachable."
  )


_FAILED_KEY = f"{_KEY_PREFIX}/failed"
_COORDINATOR_GRACE_S = 5.0


def _fail_fast(job: DistributedJob, kind, value, tb) -> None:
  """Prints the exception, tells the coordinator, and ends the process (status 1, or
  a failing SystemExit's own status: its message, e.g. argparse's, is printed already)."""
  status = 1
  try:
    if isinstance(value, SystemExit):
      status = value.code if isinstance(value.code, int) else 1
      if not isinstance(value.code, int):
        sys.stderr.write(f"{value.code}\n")
      failed = f"exited with status {status}"
    else:
      traceback.print_exception(kind, value, tb)
      failed = f"failed with {kind.__name__}"
    hint = ""
    if isinstance(value, jax.errors.JaxRuntimeError):
      hint = (" A failed collective or runtime call usually means another process died or"
              " failed first: see the other processes' logs.")
    sys.stderr.write(
        f"process {job.process_id} of {job.num_processes} {failed}; exiting"
        f" now so that the other processes stop within {job.heartbeat_timeout_s}s instead of"
        f" hanging in a collective.{hint}\n"
    )
    sys.stderr.flush()
    sys.stdout.flush()
    _report_failure(job.process_id, job.num_processes)
  finally:
    os._exit(status)


def _report_failure(index: int, count: int) -> None:
  """Publishes this process's failure; process 0 first waits for its peers.

  Process 0 hosts the coordinator service, and once it exits the runtime
  aborts every other process at once, possibly before they print their own
  error. So a failing process 0 waits up to `_COORDINATOR_GRACE_S` for every
  other process to publish a failure of its own (processes that all raise
  the same `DistributedError` then all print it); a process that is still
  running normally is stopped once the grace period ends.
  """
  try:
    client = _client()
    client.key_value_set(f"{_FAILED_KEY}/{index}", "1")
    if index != 0:
      return
    deadline = time.monotonic() + _COORDINATOR_GRACE_S
    for peer in range(1, count):
      remaining_ms = int(1000 * (deadline - time.monotonic()))
      if remaining_ms <= 0:
        return
      client.blocking_key_value_get(f"{_FAILED_KEY}/{peer}", remaining_ms)
  except Exception:  # noqa: BLE001 - best effort: the runtime may be gone already
    return


def _client():
  """The distributed runtime's client: its key-value store and barriers.

  JAX has no public API for them (`jax.experimental.multihost_utils` offers
  device collectives only, which hang instead of timing out), so this is the
  one place that reads JAX's private runtime state, as Orbax does;
  tests/multiprocess/test_distributed_setup.py fails loudly when JAX moves it.
  """
  try:
    from jax._src import distributed  # pylint: disable=g-import-not-at-top
    client = distributed.global_state.client
  except (ImportError, AttributeError) as error:
    raise DistributedError(
        f"this JAX version ({jax.__version__}) no longer has its distributed runtime client at"
        " jax._src.distributed.global_state.client, which the multi-process key-value"
        " exchanges and barriers use; install a JAX version this package supports (see"
        f" pyproject.toml) or update pipelining/_distributed.py:_client. ({error})"
    ) from error
  if client is None:
    raise DistributedError(
        f"jax.process_count() is {jax.process_count()} but JAX's distributed runtime is not"
        " initialised in this process; call initialize_distributed first."
    )
  return client


def _unique_key(name: str) -> str:
  """A key no earlier call used; every process derives the same one."""
  _state.calls[name] += 1
  return f"{_KEY_PREFIX}/{name}/{_state.calls[name]}"


def _timeout_ms(timeout_s: float | None) -> int:
  return max(1, int(1000 * (_state.timeout_s if timeout_s is None else timeout_s)))


def barrier(name: str, *, timeout_s: float | None = None) -> None:
  """Waits until every process reached the barrier `name`; no-op for one process.

  Raises:
    DistributedError: not every process arrived within the timeout (default:
      `initialize_distributed`'s timeout_s).
  """
  if jax.process_count() == 1:
    return
  key = _unique_key(name)
  try:
    _client().wait_at_barrier(key, _timeout_ms(timeout_s))
  except Exception as error:  # the runtime raises JaxRuntimeError
    raise DistributedError(
        f"process {jax.process_index()}: not every process reached barrier {name!r} within"
        f" {_timeout_ms(timeout_s) / 1000:g}s ({error}). A process died, is stuck, or runs"
        " other code or arguments; check the logs of the other processes."
    ) from error


def allgather_json(name: str, value: Any, *, timeout_s: float | None = None,
                   hint: str = "") -> list[Any]:
  """Every process's `value` (JSON-serialisable), indexed by process id.

  Uses the runtime's key-value store, not a device collective, so a process
  that never arrives makes the others raise instead of hang.

  Args:
    name: the exchange; every process calls allgather_json with the same
      names in the same order.
    value: this process's value.
    timeout_s: the longest wait for the other processes (default:
      `initialize_distributed`'s timeout_s).
    hint: appended to the timeout message (what the user should check).

  Raises:
    DistributedError: a process did not publish its value within the timeout.
  """
  count = jax.process_count()
  if count == 1:
    return [json.loads(json.dumps(value))]
  client = _client()
  key = _unique_key(name)
  client.key_value_set(f"{key}/{jax.process_index()}", json.dumps(value, sort_keys=True))
  deadline = time.monotonic() + _timeout_ms(timeout_s) / 1000
  values, missing = [], []
  for index in range(count):
    remaining_ms = max(1, int(1000 * (deadline - time.monotonic())))
    try:
      values.append(json.loads(client.blocking_key_value_get(f"{key}/{index}", remaining_ms)))
    except Exception:  # noqa: BLE001 - the runtime raises JaxRuntimeError on timeout
      missing.append(index)
      values.append(None)
  if missing:
    raise DistributedError(
        f"process {jax.process_index()}: processes {missing} did not reach {name!r} within"
        f" {_timeout_ms(timeout_s) / 1000:g}s. They died, are stuck, or run other code or"
        f" arguments; check their logs.{' ' + hint if hint else ''}"
    )
  return values


def check_agreement(what: str, value: Mapping[str, Any], *, timeout_s: float | None = None,
                    hint: str = "") -> None:
  """Checks that every process has the same `value`; no-op for one process.

  Args:
    what: names the check in messages and keys, e.g. "trainer setup".
    value: field name -> JSON-serialisable value.
    timeout_s: as in `allgather_json`.
    hint: appended to the messages (what must agree, what to check).

  Raises:
    DistributedError: naming the first field and processes that differ (every
      process raises the same error), or a process that did not arrive.
  """
  values = allgather_json(f"agree/{what}", dict(value), timeout_s=timeout_s, hint=hint)
  differing = [index for index, other in enumerate(values) if other != values[0]]
  if differing:
    # Every process has read every value before any raises (and perhaps
    # exits), so all of them name the same difference.
    try:
      barrier(f"agree/{what}/read", timeout_s=timeout_s)
    except DistributedError:
      pass  # a peer is gone already; the difference is still the error to report
    index = differing[0]
    field, mine, theirs = _first_difference(values[0], values[index], "")
    raise DistributedError(
        f"processes disagree on the {what}: process 0 has {field} = {mine!r} but process"
        f" {index} has {theirs!r}. Every process must run the same program with the same specs,"
        " batch sizes, options and step counts; only the process id and each process's slice"
        f" of the data differ.{' ' + hint if hint else ''}"
    )


def check_shared_directory(what: str, directory: epath.PathLike) -> None:
  """Checks that `directory` is one directory that every process reaches; no-op for one process.

  Each process writes its part of every checkpoint there and process 0
  commits the step, so a directory each process has on its own disk (the
  same path on several hosts, or other paths) leaves every save waiting for
  files that never appear. Process 0 writes a marker file there, every
  process looks for it, and process 0 removes it.

  Args:
    what: names the directory in messages and keys, e.g. "workdir".
    directory: this process's path of it.

  Raises:
    DistributedError: naming the processes that do not see process 0's
      marker and their paths (every process raises the same error).
  """
  if jax.process_count() == 1:
    return
  directory = epath.Path(directory)
  marker = None
  if jax.process_index() == 0:
    marker = f".shared-{what}-check-{uuid.uuid4().hex}"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / marker).write_text(marker)
  paths = allgather_json(f"shared {what}", {"path": str(directory), "marker": marker})
  marker = paths[0]["marker"]
  try:
    seen = (directory / marker).read_text() == marker
  except OSError:
    seen = False
  everyone = allgather_json(f"shared {what} seen", seen)
  if jax.process_index() == 0:
    try:
      (directory / marker).unlink()
    except OSError:
      pass
  blind = [index for index, ok in enumerate(everyone) if not ok]
  if blind:
    raise DistributedError(
        f"processes {blind} do not reach the {what} of process 0 ({paths[0]['path']!r}): process"
        f" 0 wrote {marker!r} there, but process {blind[0]} finds no such file in its {what}"
        f" {paths[blind[0]]['path']!r}. The {what} must be one directory that every process"
        " reaches (shared storage, or a cloud path such as gs://bucket/run): each process"
        " writes its part of every checkpoint there."
    )


def _first_difference(a: Any, b: Any, path: str) -> tuple[str, Any, Any]:
  """(dotted path, a's value, b's value) of the first place where a and b differ."""
  if isinstance(a, dict) and isinstance(b, dict):
    for key in sorted(set(a) | set(b), key=str):
      if a.get(key) != b.get(key):
        return _first_difference(a.get(key), b.get(key), f"{path}.{key}" if path else str(key))
  if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
    for i, (x, y) in enumerate(zip(a, b)):
      if x != y:
        return _first_difference(x, y, f"{path}[{i}]")
  return path, a, b
