"""Small helpers shared by the benchmark scripts: flags, timing, tables, JSON.

Every script takes `--quick` (a short run, under a minute), `--repeats N` and
`--json PATH` (write the figures as JSON), times its cases with `time_median`
(or `time_interleaved`, for ratios on a shared machine) and prints them with
`print_table`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

try:
  import resource
except ImportError:  # not a POSIX system: page faults are not counted
  resource = None


def default_to_host_devices(count: int) -> None:
  """Before jax is imported: run on `count` host CPU devices unless JAX_PLATFORMS
  names the platform.

  With JAX_PLATFORMS unset, this sets it to "cpu" and asks XLA for `count`
  host devices (--xla_force_host_platform_device_count). With JAX_PLATFORMS
  set (e.g. "cuda" or "tpu"), the script runs on that platform's devices:
  as many as it has, up to `count`.
  """
  if "jax" in sys.modules:
    raise RuntimeError("default_to_host_devices must run before jax is imported")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  flag = f"--xla_force_host_platform_device_count={count}"
  if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


def json_path(text: str) -> str:
  """An argparse type: a file path this process can write, in a directory that
  exists (checked before the run, not after it)."""
  if not text or text.endswith(os.sep) or os.path.isdir(text):
    raise argparse.ArgumentTypeError(f"{text!r} is no file path; give one, e.g. results.json")
  directory = os.path.dirname(os.path.abspath(text))
  if not os.path.isdir(directory):
    raise argparse.ArgumentTypeError(f"{text!r}: its directory {directory!r} does not exist")
  writable = os.access(text, os.W_OK) if os.path.exists(text) else os.access(
      directory, os.W_OK | os.X_OK)
  if not writable:
    raise argparse.ArgumentTypeError(f"{text!r} cannot be written (no permission there)")
  return text


def parse_args(description: str, *, repeats: int = 10, quick_repeats: int = 3,
               argv: Sequence[str] | None = None,
               choices: Mapping[str, Sequence[str]] | None = None,
               switches: Mapping[str, str] | None = None) -> argparse.Namespace:
  """Parses the common flags; `args.repeats` already accounts for --quick.

  `choices` adds a flag --NAME per entry, taking one of its values (the first
  is the default); `switches` adds an on/off flag --NAME per entry, with its
  help text.
  """
  parser = argparse.ArgumentParser(description=description)
  for name, values in (choices or {}).items():
    parser.add_argument(f"--{name}", choices=tuple(values), default=values[0],
                        help=f"one of {', '.join(values)} (default {values[0]})")
  for name, help_text in (switches or {}).items():
    parser.add_argument(f"--{name}", action="store_true", help=help_text)
  parser.add_argument("--quick", action="store_true",
                      help="a short run (a minute or two on two cores)")
  parser.add_argument("--repeats", type=int, default=None,
                      help=f"timed runs per case (default {repeats}, {quick_repeats} with --quick)")
  parser.add_argument("--json", metavar="PATH", type=json_path, default=None,
                      help="write the figures as JSON (its directory must exist)")
  args = parser.parse_args(argv)
  if args.repeats is None:
    args.repeats = quick_repeats if args.quick else repeats
  if args.repeats < 1:
    parser.error("--repeats must be >= 1")
  return args


def minor_faults() -> float:
  """Minor page faults of this process so far (pages mapped in on first touch);
  NaN where the system does not count them."""
  if resource is None:
    return float("nan")
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def time_median(fn: Callable[[int], Any], repeats: int, *, warmup: int = 1) -> dict[str, float]:
  """Times fn(i) for i in range(repeats) after `warmup` untimed calls.

  Returns:
    {"median_s", "min_s", "max_s"} of the wall-clock times, "cpu_median_s",
    the median CPU time of this process per call (all threads), and
    "faults_median", its median minor page faults per call. On a shared
    machine the CPU time of single-threaded work is the steadier figure.
  """
  for i in range(warmup):
    fn(i)
  times, cpu, faults = [], [], []
  for i in range(repeats):
    start, start_cpu, start_faults = time.perf_counter(), time.process_time(), minor_faults()
    fn(i)
    times.append(time.perf_counter() - start)
    cpu.append(time.process_time() - start_cpu)
    faults.append(minor_faults() - start_faults)
  return {
      "median_s": statistics.median(times),
      "min_s": min(times),
      "max_s": max(times),
      "cpu_median_s": statistics.median(cpu),
      "faults_median": statistics.median(faults),
  }


def time_interleaved(cases: Mapping[str, Callable[[int], object]], repeats: int, *,
                     settle_s: float = 0.0) -> dict[str, dict]:
  """Calls every case once per round, fn(i) in round i = 0..repeats; round 0
  is the untimed warm-up. A load change on a shared machine then hits every
  case alike, which keeps their ratios meaningful. `settle_s` seconds are
  slept, untimed, after every call: a thread pool that spins idle after its
  work (OpenMP's, Eigen's) then stops before the next case is timed, so no
  case pays for the one before it.

  Returns per case {"ms", "min_ms", "max_ms", "cpu_ms", "faults"}: medians
  (and extremes) of the wall-clock and process CPU times of its calls, and
  the median of their minor page faults.
  """
  wall = {name: [] for name in cases}
  cpu = {name: [] for name in cases}
  faults = {name: [] for name in cases}
  for round_index in range(repeats + 1):
    for name, fn in cases.items():
      start, start_cpu, start_faults = time.perf_counter(), time.process_time(), minor_faults()
      fn(round_index)
      if round_index:
        wall[name].append(1e3 * (time.perf_counter() - start))
        cpu[name].append(1e3 * (time.process_time() - start_cpu))
        faults[name].append(minor_faults() - start_faults)
      time.sleep(settle_s)
  return {name: {"ms": statistics.median(wall[name]), "min_ms": min(wall[name]),
                 "max_ms": max(wall[name]), "cpu_ms": statistics.median(cpu[name]),
                 "faults": statistics.median(faults[name])}
          for name in cases}


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> None:
  """Prints rows as an aligned text table.

  Args:
    rows: one dict per row.
    columns: (key, header, format spec) per column, e.g. ("ms", "ms/batch", ".1f").
  """
  cells = [[header for _, header, _ in columns]]
  for row in rows:
    cells.append([_cell(row[key], spec) for key, _, spec in columns])
  widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
  for index, line in enumerate(cells):
    print("  ".join(cell.rjust(width) for cell, width in zip(line, widths)))
    if index == 0:
      print("  ".join("-" * width for width in widths))


def _cell(value: Any, spec: str) -> str:
  """A table cell; '-' where the value does not apply (None or NaN)."""
  if value is None or (isinstance(value, float) and math.isnan(value)):
    return "-"
  return format(value, spec)


def machine_info() -> dict[str, Any]:
  """What the figures were measured on (no paths, no host names): also jax's
  version, backend and device kind when the script has imported jax."""
  import numpy

  info = {
      "python": platform.python_version(),
      "numpy": numpy.__version__,
      "machine": platform.machine(),
      "cpu_count": os.cpu_count(),
  }
  if "jax" in sys.modules:
    import jax

    info.update(jax=jax.__version__, backend=jax.default_backend(),
                device=jax.devices()[0].device_kind, device_count=jax.device_count())
  return info


def _strict(value: Any) -> Any:
  """`value` with NaN and infinities (figures that do not apply) as None: JSON has neither."""
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, Mapping):
    return {key: _strict(item) for key, item in value.items()}
  if isinstance(value, (list, tuple)):
    return [_strict(item) for item in value]
  return value


def write_json(path: str | None, payload: dict[str, Any]) -> None:
  """Writes payload plus machine_info() to `path` (nothing when path is None),
  as standard JSON: a figure that is NaN or infinite is written as null."""
  if path is None:
    return
  with open(path, "w") as f:
    json.dump(_strict({**payload, "machine": machine_info()}), f, indent=1, sort_keys=True,
              allow_nan=False)
    f.write("\n")
  print(f"wrote {path}")
