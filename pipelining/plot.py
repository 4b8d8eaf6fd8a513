"""The training picture of a workdir: `python -m pipelining.plot WORKDIR [--output FILE]`.

Reads the workdir's metrics.jsonl (the records `Trainer.fit` appends, see
`pipelining._progress`) across every run that resumed in it, and draws with
matplotlib (Agg backend, no display needed):

  top:    training loss per recorded step (raw) and its exponential moving
          average (smoothed), evaluation loss, and evaluation AUC on a
          right-hand axis;
  bottom: training throughput in examples per second;
  both:   a dashed vertical line where a run resumed from a checkpoint.

A run that resumed from checkpoint step R after its predecessor had recorded
steps beyond R (it was killed after the save of R) re-trained those steps:
the history keeps the records of the run that resumed, so each step appears
once. The file may belong to a running job: a partial last line is ignored.
Files written by earlier versions (no "start" records, no examples/s) plot
without resume markers and throughput.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
import sys
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
from etils import epath

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "training_curve.png"

# Weight of the past in the smoothed loss: y_k = a y_(k-1) + (1 - a) x_k,
# debiased by 1 - a^k (TensorBoard's smoothing).
_SMOOTHING = 0.8


@dataclasses.dataclass(frozen=True)
class MetricsHistory:
  """The whole recorded history of a workdir, one entry per step.

  Attributes:
    train_steps, train_loss: recorded training steps and their loss.
    throughput_steps, examples_per_sec: steps with a throughput measurement.
    eval_steps: steps of the evaluations; eval_metrics: name -> values there
      (e.g. "loss", "auc"; NaN where an evaluation lacks that metric).
    resumes: the checkpoint steps that runs resumed from, in order.
    setup: the latest run's "start" record (backend, devices, batch size, ...).
  """

  train_steps: np.ndarray
  train_loss: np.ndarray
  throughput_steps: np.ndarray
  examples_per_sec: np.ndarray
  eval_steps: np.ndarray
  eval_metrics: dict[str, np.ndarray]
  resumes: tuple[int, ...]
  setup: dict[str, Any]


def _records(path: epath.Path) -> list[dict[str, Any]]:
  """The JSON records of metrics.jsonl; a partial last line (a running job) is skipped."""
  lines = path.read_text().split("\n")
  records = []
  for number, line in enumerate(lines, start=1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as error:
      if number == len(lines):  # no newline yet: being written
        break
      raise ValueError(f"{path}, line {number}: not a JSON record ({error}).") from None
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
      raise ValueError(f"{path}, line {number}: a record needs an int 'step', got {line[:80]!r}.")
    records.append(record)
  return records


def _current_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Drops the records that a later resume superseded (steps after its checkpoint)."""
  kept: list[dict[str, Any]] = []
  for record in records:
    if record.get("event") == "start" and record.get("resumed_from") is not None:
      kept = [r for r in kept if r["step"] <= record["resumed_from"]]
    kept.append(record)
  return kept


def _last_per_step(records) -> list[dict[str, Any]]:
  """One record per step (the last written), in step order."""
  by_step = {r["step"]: r for r in records}
  return [by_step[step] for step in sorted(by_step)]


def _float(value: Any) -> float:
  return float("nan") if value is None else float(value)


def read_metrics(workdir: epath.PathLike) -> MetricsHistory:
  """Reads WORKDIR/metrics.jsonl (or the file itself) into a MetricsHistory.

  Raises:
    FileNotFoundError: there is no metrics.jsonl (with a hint when `workdir`
      is the workdir's checkpoints folder).
    ValueError: a line other than the last is not a JSON record.
  """
  path = epath.Path(workdir)
  if path.is_dir():
    path = path / METRICS_FILE
  if not path.exists():
    hint = ""
    if path.parent.name == "checkpoints":
      hint = f" (metrics.jsonl is in the workdir: try {path.parent.parent})"
    raise FileNotFoundError(
        f"no {METRICS_FILE} at {path}{hint}; the Trainer writes it when it has a workdir.")
  records = _current_records(_records(path))
  train = _last_per_step(r for r in records if "loss" in r and r.get("event") is None)
  throughput = [r for r in train if r.get("examples_per_sec") is not None]
  evals = _last_per_step(r for r in records if any(k.startswith("eval_") for k in r))
  names = sorted({k[len("eval_"):] for r in evals for k in r if k.startswith("eval_")})
  starts = [r for r in records if r.get("event") == "start"]
  return MetricsHistory(
      train_steps=np.array([r["step"] for r in train], dtype=np.int64),
      train_loss=np.array([_float(r["loss"]) for r in train]),
      throughput_steps=np.array([r["step"] for r in throughput], dtype=np.int64),
      examples_per_sec=np.array([_float(r["examples_per_sec"]) for r in throughput]),
      eval_steps=np.array([r["step"] for r in evals], dtype=np.int64),
      eval_metrics={n: np.array([_float(r.get(f"eval_{n}")) for r in evals]) for n in names},
      resumes=tuple(r["resumed_from"] for r in starts if r.get("resumed_from") is not None),
      setup={k: v for k, v in starts[-1].items() if k not in ("event", "step", "resumed_from",
                                                              "time")} if starts else {},
  )


def smooth(values: np.ndarray, weight: float = _SMOOTHING) -> np.ndarray:
  """Debiased exponential moving average: y_k = sum_j w^(k-j) (1-w) x_j / (1 - w^(k+1)).

  NaNs (non-finite values recorded as null) are skipped, keeping the average.
  """
  out = np.empty(len(values))
  average, norm = 0.0, 0.0
  for k, x in enumerate(values):
    if math.isfinite(x):
      average = weight * average + (1 - weight) * x
      norm = weight * norm + (1 - weight)
    out[k] = average / norm if norm else float("nan")
  return out


def _title(history: MetricsHistory, name: str) -> str:
  setup = history.setup
  parts = [f"{key.replace('_', ' ')} {value}" for key, value in setup.items()]
  runs = len(history.resumes) + 1
  last = max([int(s[-1]) for s in (history.train_steps, history.eval_steps) if len(s)], default=0)
  head = f"{name}: {last} steps in {runs} run{'s' if runs > 1 else ''}"
  return head + ("\n" + ", ".join(parts) if parts else "")


def draw(history: MetricsHistory, output: epath.PathLike, *, name: str = "training",
         loss_floor: tuple[str, float] | None = None) -> epath.Path:
  """Draws `history` into the image file `output`; returns its path.

  The format follows the file's extension (.png, .pdf, .svg, ... as matplotlib
  writes them; PNG without one); another extension is refused.

  `loss_floor` = (label, value) adds a horizontal reference line to the loss
  panel, e.g. the entropy of a synthetic data source (the best loss there is).
  """
  import matplotlib

  matplotlib.use("Agg")
  from matplotlib import pyplot as plt
  from matplotlib.ticker import MaxNLocator

  figure, (top, bottom) = plt.subplots(
      2, 1, figsize=(10, 7), sharex=True, height_ratios=(2, 1), layout="constrained")
  try:
    figure.suptitle(_title(history, name))
    if len(history.train_steps):
      top.plot(history.train_steps, history.train_loss, color="tab:blue", alpha=0.3, lw=1,
               marker="." if len(history.train_steps) < 30 else None, label="training loss (raw)")
      top.plot(history.train_steps, smooth(history.train_loss), color="tab:blue", lw=2,
               label=f"training loss (smoothed, EMA {_SMOOTHING})")
    if "loss" in history.eval_metrics:
      top.plot(history.eval_steps, history.eval_metrics["loss"], color="tab:orange", marker="o",
               lw=1.5, label="evaluation loss")
    if loss_floor is not None:
      top.axhline(loss_floor[1], color="gray", ls=":", lw=1.5, label=loss_floor[0])
    top.set_ylabel("loss (per example)")
    top.grid(alpha=0.3)
    handles, labels = top.get_legend_handles_labels()
    if "auc" in history.eval_metrics:
      right = top.twinx()
      right.plot(history.eval_steps, history.eval_metrics["auc"], color="tab:green", marker="s",
                 lw=1.5, label="evaluation AUC")
      right.set_ylabel("AUC (0.5 = chance)")
      more_handles, more_labels = right.get_legend_handles_labels()
      handles, labels = handles + more_handles, labels + more_labels
    if len(history.throughput_steps):
      bottom.plot(history.throughput_steps, history.examples_per_sec, color="tab:purple",
                  marker="." if len(history.throughput_steps) < 30 else None, lw=1.5)
    bottom.set_ylabel("throughput (examples/s)")
    bottom.set_xlabel("step (updates applied)")
    bottom.grid(alpha=0.3)
    bottom.set_ylim(bottom=0)
    bottom.set_xlim(left=0)
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    for k, step in enumerate(history.resumes):
      for axis in (top, bottom):
        line = axis.axvline(step, color="gray", ls="--", lw=1)
      if k == 0:
        handles.append(line)
        labels.append("resumed from a checkpoint")
    if not handles:
      top.text(0.5, 0.5, "no steps recorded yet", ha="center", va="center",
               transform=top.transAxes)
    else:
      figure.legend(handles, labels, loc="outside lower center", ncols=3, fontsize="small")
    path = epath.Path(output)
    image_format = path.suffix.lstrip(".").lower() or "png"
    if image_format not in figure.canvas.get_supported_filetypes():
      raise ValueError(
          f"{path}: matplotlib writes no {path.suffix!r} images; use one of"
          f" {sorted('.' + kind for kind in figure.canvas.get_supported_filetypes())}.")
    image = io.BytesIO()
    figure.savefig(image, format=image_format, dpi=100)
    _write_whole(path, image.getvalue())
    return path
  finally:
    plt.close(figure)


def _write_whole(path: epath.Path, data: bytes) -> None:
  """Writes `path` through a temporary sibling renamed over it: a reader (a viewer
  refreshing beside a running job) never sees half an image, and storage that refuses
  the write (full, read-only) leaves the old image, or none, but never a truncated one."""
  partial = path.parent / f".{path.name}.{uuid.uuid4().hex[:12]}.partial"  # one per writer
  try:
    partial.write_bytes(data)
    partial.replace(path)
  except OSError as error:
    with contextlib.suppress(OSError):
      partial.unlink(missing_ok=True)
    # Named by the file asked for, not the temporary sibling it failed on.
    reason = error.strerror or str(error)
    with contextlib.suppress(OSError):
      if not path.parent.is_dir():
        reason += f" (its directory {path.parent} does not exist: create it first)"
    message = f"writing {path}: {reason}"
    # OSError(errno, ...) is the errno's subclass (FileNotFoundError, PermissionError, ...).
    raise (OSError(error.errno, message) if error.errno else OSError(message)) from error


def plot_workdir(workdir: epath.PathLike, output: epath.PathLike | None = None, *,
                 loss_floor: tuple[str, float] | None = None
                 ) -> tuple[epath.Path, MetricsHistory]:
  """Plots WORKDIR/metrics.jsonl to `output` (default WORKDIR/training_curve.png).

  `loss_floor`: an optional (label, value) reference line for the loss (`draw`).

  Returns:
    The PNG's path and the history drawn (its `resumes` are the markers).
  """
  workdir = epath.Path(workdir)
  history = read_metrics(workdir)
  directory = workdir if workdir.is_dir() else workdir.parent
  target = epath.Path(output) if output is not None else directory / PLOT_FILE
  return draw(history, target, name=directory.name or str(directory),
              loss_floor=loss_floor), history


def main(argv: Sequence[str] | None = None) -> int:
  """`python -m pipelining.plot WORKDIR [--output FILE]`; returns the exit status."""
  parser = argparse.ArgumentParser(
      prog="python -m pipelining.plot",
      description="Plot a Trainer workdir's metrics.jsonl (also while the job runs).",
      allow_abbrev=False,
  )
  parser.add_argument("workdir", help="the Trainer's workdir (or its metrics.jsonl)")
  parser.add_argument("--output", help="image file to write, in the format its extension names:"
                      " .png, .svg, .pdf, ... (default: WORKDIR/training_curve.png)")
  args = parser.parse_args(argv)
  try:
    path, history = plot_workdir(args.workdir, args.output)
  except (OSError, ValueError) as error:
    print(f"python -m pipelining.plot: error: {error}", file=sys.stderr)
    return 1
  print(f"wrote {path} ({len(history.train_steps)} training records,"
        f" {len(history.eval_steps)} evaluations, {len(history.resumes)} resumes)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
