"""metrics.jsonl as fit writes it (Progress) and as pipelining.plot reads and draws it."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from etils import epath

from pipelining import plot
from pipelining._progress import Progress
from tests.numerics import assert_close


def write(path, records, tail=""):
  path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def run(progress: Progress, first: int, last: int, losses) -> None:
  for step in range(first, last + 1):
    progress.step(step, {"loss": losses(step)})
  progress.close()


def test_progress_records_start_steps_and_the_last_step(tmp_path):
  path = epath.Path(tmp_path) / "metrics.jsonl"
  stream = io.StringIO()
  progress = Progress(total_steps=7, mode="log", log_every=3, metrics_path=path, batch_size=4,
                      stream=stream)
  progress.start(0, resumed_from=None, setup={"backend": "xla (portable XLA ops)",
                                              "num_devices": 8})
  run(progress, 1, 7, lambda step: 1.0 / step)
  records = [json.loads(line) for line in path.read_text().splitlines()]
  assert records[0]["event"] == "start" and records[0]["resumed_from"] is None
  assert records[0]["backend"] == "xla (portable XLA ops)" and records[0]["num_devices"] == 8
  assert [r["step"] for r in records[1:]] == [3, 6, 7]  # every 3 steps, and the last
  assert all(r["examples_per_sec"] == 4 * r["steps_per_sec"] for r in records[1:])
  lines = stream.getvalue().splitlines()
  assert lines[0] == ("fit: at step 0 to step 7; backend xla (portable XLA ops), num devices 8")
  assert lines[1].startswith("step 3/7 | loss 0.3333 |") and len(lines) == 4


def test_the_start_line_of_a_passed_num_steps_and_the_end_note():
  """'fit: resumed from step 10 to step 5' followed the warning that nothing trains."""
  stream = io.StringIO()
  progress = Progress(total_steps=5, mode="log", log_every=3, metrics_path=None, batch_size=4,
                      stream=stream)
  progress.start(10, resumed_from=10, setup={"batch_size": 4})
  progress.end_note("the data ended at step 10, before num_steps=5")
  progress.close()
  assert stream.getvalue().splitlines() == [
      "fit: resumed from step 10, nothing to train (num_steps=5 is passed); batch size 4",
      "fit: the data ended at step 10, before num_steps=5"]
  quiet = io.StringIO()
  progress = Progress(total_steps=5, mode="off", log_every=3, metrics_path=None, batch_size=4,
                      stream=quiet)
  progress.end_note("not shown")
  progress.close()
  assert quiet.getvalue() == ""


def test_the_rate_is_the_median_step_not_dragged_down_by_a_pause(tmp_path, monkeypatch):
  clock = iter([0.0, 0.0] + [0.1, 0.2, 5.2, 5.3] + [9.0] * 10)  # step 3 paused 5 s
  monkeypatch.setattr("pipelining._progress.time.perf_counter", lambda: next(clock))
  path = epath.Path(tmp_path) / "metrics.jsonl"
  progress = Progress(total_steps=None, mode="off", log_every=4, metrics_path=path, batch_size=2)
  for step in range(1, 5):
    progress.step(step, {"loss": 0.5})
  record = json.loads(path.read_text())
  assert_close(record["steps_per_sec"], 10.0, terms=2)  # median step 0.1 s (mean: 0.76 / s)


def test_history_across_resumes_keeps_each_step_once(tmp_path):
  records = [
      {"event": "start", "step": 0, "resumed_from": None, "backend": "cpu", "batch_size": 8},
      *({"step": s, "loss": 1.0 / s, "examples_per_sec": 100.0} for s in (10, 20, 30)),
      {"step": 20, "eval_loss": 0.5, "eval_auc": 0.6},
      {"step": 20, "eval_loss": 0.5, "eval_auc": 0.6},  # evaluated twice at one step
      # killed after step 30; resumed from the checkpoint of step 20: 30 trains again
      {"event": "start", "step": 20, "resumed_from": 20, "backend": "cpu", "batch_size": 8},
      *({"step": s, "loss": 2.0 / s, "examples_per_sec": None} for s in (30, 40)),
      {"step": 40, "eval_loss": 0.4},
  ]
  write(tmp_path / "metrics.jsonl", records, tail='{"step": 50, "lo')  # being written
  history = plot.read_metrics(tmp_path)
  np.testing.assert_array_equal(history.train_steps, [10, 20, 30, 40])
  assert history.train_loss[2] == 2.0 / 30  # the resumed run's record of step 30
  np.testing.assert_array_equal(history.throughput_steps, [10, 20])
  np.testing.assert_array_equal(history.eval_steps, [20, 40])
  assert history.eval_metrics["loss"].tolist() == [0.5, 0.4]
  assert history.eval_metrics["auc"][0] == 0.6 and np.isnan(history.eval_metrics["auc"][1])
  assert history.resumes == (20,)
  assert history.setup == {"backend": "cpu", "batch_size": 8}


def test_plot_command_draws_a_workdir(tmp_path, capsys):
  records = [{"event": "start", "step": 0, "resumed_from": None, "backend": "cpu"},
             *({"step": s, "loss": 1.0 / s, "examples_per_sec": 50.0 + s} for s in range(1, 40))]
  write(tmp_path / "metrics.jsonl", records)
  assert plot.main([str(tmp_path), "--output", str(tmp_path / "curve.png")]) == 0
  assert "39 training records, 0 evaluations, 0 resumes" in capsys.readouterr().out
  assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"
  assert (tmp_path / "curve.png").stat().st_size > 20_000
  assert plot.main([str(tmp_path), "--output", str(tmp_path / "curve.png")]) == 0  # replaced
  # The extension chooses the format (a .pdf once held a PNG); an unknown one is refused.
  assert plot.main([str(tmp_path), "--output", str(tmp_path / "curve.pdf")]) == 0
  assert (tmp_path / "curve.pdf").read_bytes()[:5] == b"%PDF-"
  capsys.readouterr()
  assert plot.main([str(tmp_path), "--output", str(tmp_path / "curve.xyz")]) == 1
  assert "matplotlib writes no '.xyz' images" in capsys.readouterr().err


def test_smoothing_is_a_debiased_moving_average():
  values = np.array([1.0, float("nan"), 3.0])
  w = 0.8
  assert_close(plot.smooth(values, w), [1.0, 1.0, (w * (1 - w) * 1.0 + (1 - w) * 3.0) / (1 - w**2)],
               terms=3)


@pytest.mark.parametrize("make, message", [
    (lambda d: None, "no metrics.jsonl at"),
    (lambda d: (d / "checkpoints").mkdir(), "no metrics.jsonl at"),
    (lambda d: (d / "metrics.jsonl").write_text('{"step": 1, "loss": 1}\nnot json\n{"step": 2}\n'),
     "metrics.jsonl, line 2: not a JSON record"),
])
def test_plot_command_errors_are_one_line(tmp_path, capsys, make, message):
  make(tmp_path)
  target = tmp_path / "checkpoints" if (tmp_path / "checkpoints").exists() else tmp_path
  assert plot.main([str(target)]) == 1
  err = capsys.readouterr().err
  assert message in err and err.count("\n") == 1, err
  if target.name == "checkpoints":
    assert f"metrics.jsonl is in the workdir: try {tmp_path}" in err


def test_a_write_the_storage_refuses_leaves_no_partial_image_and_names_the_file(
    tmp_path, capsys, monkeypatch):
  """A full disk left a truncated 4 KiB image, and its error named no file."""
  import errno
  from etils import epath
  records = [{"step": s, "loss": 1.0 / s} for s in range(1, 5)]
  write(tmp_path / "metrics.jsonl", records)
  write_bytes = epath.Path.write_bytes

  def full(self, data):
    write_bytes(self, data[:4096])
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(epath.Path, "write_bytes", full)
  assert plot.main([str(tmp_path), "--output", str(tmp_path / "new.png")]) == 1
  err = capsys.readouterr().err
  assert f"writing {tmp_path / 'new.png'}: No space left on device" in err, err
  assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_an_output_in_a_missing_directory_is_named_with_its_directory(tmp_path, capsys):
  """The error named the temporary sibling the image is first written to."""
  write(tmp_path / "metrics.jsonl", [{"step": s, "loss": 1.0 / s} for s in range(1, 5)])
  target = tmp_path / "figures" / "curve.png"
  assert plot.main([str(tmp_path), "--output", str(target)]) == 1
  err = capsys.readouterr().err
  assert f"writing {target}: No such file or directory (its directory {target.parent} does not"\
      " exist: create it first)" in err, err
  assert ".partial" not in err and err.count("\n") == 1, err
  assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_a_record_the_disk_cuts_short_is_cut_back_off_and_the_next_follows_whole(
    tmp_path, monkeypatch):
  """A full disk stored half a record, and the next record, once there was room, was
  appended to it: a broken line in the middle, which the plot refuses."""
  import errno
  import os
  from pipelining import _progress
  path = epath.Path(tmp_path) / "metrics.jsonl"
  progress = Progress(total_steps=6, mode="off", log_every=1, metrics_path=path, batch_size=4)
  write_ = os.write
  full = {"left": 1}

  def short_write(fd, data):
    if full["left"]:  # the disk holds 10 more bytes of this record, then is full
      full["left"] -= 1
      write_(fd, data[:10])
      raise OSError(errno.ENOSPC, "No space left on device")
    return write_(fd, data)

  monkeypatch.setattr(_progress.os, "write", short_write)
  with pytest.warns(RuntimeWarning, match="metrics.jsonl: a record could not be appended"):
    run(progress, 1, 6, lambda step: 1.0 / step)
  records = [json.loads(line) for line in path.read_text().splitlines()]
  assert [r["step"] for r in records] == [2, 3, 4, 5, 6]
  assert list(plot.read_metrics(path).train_steps) == [2, 3, 4, 5, 6]
