"""What a user sees during fit: a progress bar or log lines, and metrics.jsonl.

metrics.jsonl gets one JSON object per line, appended across runs:

  {"event": "start", "step": S, "resumed_from": R or null, "time": unix seconds,
   "backend": ..., "num_devices": ..., "batch_size": ..., "pipelining": ...}
      when fit starts (after any resume from checkpoint step R);
  {"step": S, "loss": ..., <other training metrics>, "steps_per_sec": ...,
   "examples_per_sec": ...}
      every `log_every` steps and at the last step of fit (the rate is
      1 / the median step time since the previous record);
  {"step": S, "eval_loss": ..., "eval_auc": ...}
      after each evaluation during fit.

Non-finite floats are written as null. `pipelining.plot` draws the file.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import sys
import time
import warnings
from typing import Any, TextIO

from etils import epath

from sc_framework.primitives import EmbeddingBackend, EmbeddingPlan


def describe_run(plan: EmbeddingPlan, *, backend: EmbeddingBackend, pipelining: bool,
                 batch_size: int) -> dict[str, Any]:
  """What a fit runs on, for the start-up line and the "start" record."""
  return {
      "backend": f"{backend.name} ({backend.description})" if backend.description else backend.name,
      "num_devices": plan.num_devices,
      "batch_size": batch_size,
      "pipelining": pipelining,
  }


class Progress:
  """Reports steps to a terminal (a one-line bar) or as periodic log lines.

  Args:
    total_steps: the run's last step, when known (for the bar).
    mode: "bar", "log" or "off" ("auto" is resolved by the caller).
    log_every: steps between log lines / JSONL records.
    metrics_path: file to append one JSON object per record to, or None.
    batch_size: examples per step (for examples/s).
  """

  def __init__(
      self,
      *,
      total_steps: int | None,
      mode: str,
      log_every: int,
      metrics_path: epath.Path | None,
      batch_size: int,
      stream: TextIO | None = None,
  ):
    if mode == "auto":
      mode = "bar" if (stream or sys.stderr).isatty() else "log"
    self._mode = mode
    self._total = total_steps
    self._end_note: str | None = None  # how the fit ended, written by close
    self._log_every = log_every
    self._metrics_path = metrics_path
    self._record_failed = False  # warned once about a refused record
    self._batch_size = batch_size
    self._stream = stream or sys.stderr
    self._start_time = time.perf_counter()
    self._window_time = self._start_time
    self._window_steps = 0
    self._steps_per_sec = float("nan")
    self._last: tuple[int, dict[str, float]] | None = None  # the last step not yet recorded
    self._step_time = self._start_time
    self._durations: list[float] = []  # step times since the last record

  def start(self, step: int, *, resumed_from: int | None, setup: dict[str, Any]) -> None:
    """Reports the start of fit: one line (unless "off") and a "start" record.

    Args:
      step: the updates applied before the first step of this fit.
      resumed_from: the checkpoint step restored, or None.
      setup: what the run is (e.g. backend, device count), shown as `key value`.
    """
    origin = f"resumed from step {resumed_from}" if resumed_from is not None else f"at step {step}"
    total = "" if self._total is None else (
        f" to step {self._total}" if self._total >= step
        else f", nothing to train (num_steps={self._total} is passed)")
    if self._mode != "off":
      details = ", ".join(f"{key.replace('_', ' ')} {value}" for key, value in setup.items())
      self._stream.write(f"fit: {origin}{total}; {details}\n")
      self._stream.flush()
    self.record({"event": "start", "step": step, "resumed_from": resumed_from,
                 "time": time.time(), **setup})

  def step(self, step: int, metrics: dict[str, float]) -> None:
    """Records that `step` updates are done, with that step's metrics."""
    self._window_steps += 1
    now = time.perf_counter()
    self._durations.append(now - self._step_time)
    self._step_time = now
    elapsed = now - self._window_time
    if elapsed >= 0.5 or step % self._log_every == 0:
      self._steps_per_sec = self._window_steps / max(elapsed, 1e-9)
      self._window_time, self._window_steps = now, 0
    if self._mode == "bar":
      self._draw_bar(step, metrics)
    self._last = (step, metrics)
    if step % self._log_every == 0:
      self._log_step()

  def _log_step(self) -> None:
    """Writes the log line and the record of the last step.

    Their rate is 1 / the median step time since the previous record: a
    compilation, evaluation or checkpoint pause between two steps does not
    drag it down (the bar shows the plain rate of the last half second).
    """
    step, metrics = self._last
    self._last = None
    steps_per_sec = 1.0 / max(statistics.median(self._durations), 1e-9)
    self._durations = []
    if self._mode == "log":
      self._stream.write(self._line(step, metrics, steps_per_sec) + "\n")
      self._stream.flush()
    self.record({"step": step, **metrics, "steps_per_sec": steps_per_sec,
                 "examples_per_sec": steps_per_sec * self._batch_size})

  def record(self, payload: dict[str, Any]) -> None:
    """Appends one JSON line to metrics.jsonl (if enabled).

    A record the storage refuses (full, read-only) is not worth a training
    run: it is left out with a warning, the first time only, and training
    and its checkpoints go on (`History` still holds every step's metrics).
    """
    if self._metrics_path is None:
      return
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in payload.items()}
    try:
      _append_whole_line(self._metrics_path, json.dumps(clean, sort_keys=True) + "\n")
    except OSError as error:
      if not self._record_failed:
        self._record_failed = True
        warnings.warn(
            f"{self._metrics_path}: a record could not be appended ({error}); training goes"
            " on without it (fit's History keeps every step's metrics). Later records that"
            " fail are left out without a warning; free space or fix the storage to have"
            " them again.", RuntimeWarning, stacklevel=2)

  def _line(self, step: int, metrics: dict[str, float], steps_per_sec: float) -> str:
    total = f"/{self._total}" if self._total else ""
    parts = [f"step {step}{total}"]
    parts += [f"{k} {v:.4f}" for k, v in metrics.items()]
    parts.append(f"{steps_per_sec:.1f} steps/s")
    parts.append(f"{steps_per_sec * self._batch_size:.0f} examples/s")
    return " | ".join(parts)

  def _draw_bar(self, step: int, metrics: dict[str, float]) -> None:
    width = 24
    if self._total:
      filled = min(width, int(width * step / self._total))
      bar = "[" + "#" * filled + "." * (width - filled) + "] "
    else:
      bar = ""
    self._stream.write("\r" + bar + self._line(step, metrics, self._steps_per_sec) + "\033[K")
    self._stream.flush()

  def end_note(self, text: str) -> None:
    """A line `close` writes after the last step's (unless "off"): how the fit ended."""
    self._end_note = text

  def close(self) -> None:
    """Ends the report; the last step is recorded even between `log_every` marks."""
    if self._last is not None:
      self._log_step()
    if self._mode == "bar":
      self._stream.write("\n")
    if self._end_note is not None and self._mode != "off":
      self._stream.write(f"fit: {self._end_note}\n")
    if self._mode != "off":
      self._stream.flush()


def _append_whole_line(path: epath.Path, line: str) -> None:
  """Appends `line` to the file, on a local file system whole or not at all: a write the
  storage cuts short (a full disk) is cut back off, so the file never holds half a
  record that the next one would be appended to."""
  if "://" in os.fspath(path):  # cloud storage writes whole objects
    with path.open("a") as f:
      f.write(line)
    return
  fd = os.open(os.fspath(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
  try:
    start = os.lseek(fd, 0, os.SEEK_END)
    data = line.encode()
    try:
      while data:
        data = data[os.write(fd, data):]
    except OSError:
      with contextlib.suppress(OSError):
        os.ftruncate(fd, start)
      raise
  finally:
    os.close(fd)
