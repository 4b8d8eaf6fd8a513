"""The DLRM example (the README's main job), small: trains, resumes, plots, checks flags."""

from __future__ import annotations

import json
import math
import os

import pytest

from examples import dlrm

SMALL = ["--batch-size", "64", "--vocab-scale", "0.01", "--eval-batches", "2",
         "--save-every", "100", "--eval-every", "5"]


def small_run(workdir, steps):
  return dlrm.main(["--steps", str(steps), *SMALL, "--workdir", str(workdir)])


def test_trains_resumes_and_plots_the_whole_history(tmp_path):
  first = small_run(tmp_path, 12)
  assert first["steps"] == 12 and math.isfinite(first["loss"]) and 0.0 <= first["auc"] <= 1.0
  assert first["plot_resume_markers"] == []
  # Training throughput over the 10 steps between the compiled first and the last.
  assert first["timed_steps"] == 10 and first["examples_per_sec"] > 0
  assert set(first["one_off_s"]) == {"setup_and_restore", "compile", "evaluation", "final_save"}
  assert all(seconds >= 0 for seconds in first["one_off_s"].values())
  second = small_run(tmp_path, 4)  # resumes at step 12
  assert second["steps"] == 16
  assert second["plot_resume_markers"] == [12]  # one marker, where the second run resumed
  size = os.path.getsize(second["plot"])
  assert 20_000 < size < 2_000_000, size  # a drawn figure, not an empty canvas
  with open(second["plot"], "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  starts = [r for r in records if r.get("event") == "start"]
  assert [(r["step"], r["resumed_from"]) for r in starts] == [(0, None), (12, 12)]
  assert starts[0]["backend"].split()[0] in ("cpu", "xla") and starts[0]["batch_size"] == 64
  trained = [r["step"] for r in records if "loss" in r]
  assert trained[-1] == 16 and 12 in trained  # the last step of each run is recorded
  evaluated = [r["step"] for r in records if "eval_loss" in r]
  assert {5, 10, 12, 15, 16} <= set(evaluated)


def test_a_resume_past_a_damaged_step_trains_steps_more_from_the_step_restored(tmp_path, capsys):
  """It printed "resuming from step 4" (the damaged step) and trained 4 + 3 - 2 = 5 steps."""
  dlrm.main(["--steps", "4", *SMALL, "--save-every", "2", "--workdir", str(tmp_path)])
  chunk = next(path for path in sorted((tmp_path / "checkpoints" / "4" / "embedding").rglob("*"))
               if path.is_file() and "/c/" in str(path))
  data = bytearray(chunk.read_bytes())
  data[len(data) // 2] ^= 0x5A
  chunk.write_bytes(bytes(data))
  capsys.readouterr()
  with pytest.warns(RuntimeWarning, match="is skipped: a restore found it damaged"):
    result = small_run(tmp_path, 3)
  assert "resuming from step 2\n" in capsys.readouterr().out
  assert result["steps"] == 5


def test_zero_steps_neither_trains_nor_fails(tmp_path):
  result = small_run(tmp_path, 0)
  assert result["steps"] == 0 and result["examples_per_sec"] is None
  assert result["timed_steps"] == 0
  assert os.path.getsize(result["plot"]) > 0  # a short run still draws what it has


def test_an_undefined_auc_prints_valid_json(capsys):
  """Seed 12's one evaluation batch of 8 samples has labels of one class only: its AUC is
  NaN, which the last line, one JSON object, must still be able to hold (as null)."""
  result = dlrm.main(["--steps", "0", "--batch-size", "8", "--vocab-scale", "0.01",
                      "--eval-batches", "1", "--seed", "12", "--workdir", ""])
  assert result["auc"] is None
  last = capsys.readouterr().out.strip().splitlines()[-1]
  assert json.loads(last, parse_constant=lambda name: pytest.fail(f"{name} in {last}")) == result


@pytest.mark.parametrize("argv, message", [
    (["--steps", "-5"], "dlrm.py: error: argument --steps: must be >= 0, got -5 (see --help)"),
    (["--batch-size", "0"], "argument --batch-size: must be >= 1, got 0"),
    (["--batch-size", "many"], "argument --batch-size: expected an integer, got 'many'"),
    (["--step", "10"], "unrecognized arguments: --step 10"),
    (["--vocab-scale", "0"], "argument --vocab-scale: must be a number > 0, got 0"),
    (["--learning-rate", "nan"], "argument --learning-rate: must be a number > 0, got nan"),
    (["--num-processes", "2", "--process-id", "2"],
     "argument --process-id: must be < --num-processes 2, got 2"),
    # These ended in a traceback from the distributed set-up.
    (["--process-id", "1"], "the multi-process flags: a coordinator address (None) or process"
                            " id (1) was given but no number of processes"),
    (["--num-processes", "2", "--process-id", "0"],
     "the multi-process flags: num_processes=2 needs coordinator_address"),
])
def test_bad_flags_give_one_line_naming_the_flag(argv, message, capsys):
  with pytest.raises(SystemExit) as exit_:
    dlrm.main([*argv, "--workdir", ""])
  assert exit_.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and message in err and "Traceback" not in err, err


def test_a_workdir_that_is_a_file_gives_one_line_naming_it(tmp_path, capsys):
  """It used to fail at the first save with a NotADirectoryError traceback."""
  blocker = tmp_path / "dlrm_workdir"
  blocker.write_text("a file, not a directory")
  for workdir in (blocker, blocker / "run"):
    with pytest.raises(SystemExit) as exit_:
      dlrm.main(["--steps", "1", *SMALL, "--workdir", str(workdir)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --workdir: " in err, err
    assert f"{str(blocker)!r}" in err and "is not a directory" in err, err
  assert blocker.read_text() == "a file, not a directory"


def test_a_resume_with_another_batch_size_gives_one_line_naming_both(tmp_path, capsys):
  """It printed the Trainer's IncompatibleCheckpointError as a traceback."""
  small_run(tmp_path, 2)  # its last checkpoint holds the pipelined batch in flight
  capsys.readouterr()
  with pytest.raises(SystemExit) as exit_:
    dlrm.main(["--steps", "1", *SMALL, "--batch-size", "128", "--workdir", str(tmp_path)])
  assert exit_.value.code == 2
  error = capsys.readouterr().err.strip().splitlines()[-1]
  assert (f"--workdir {tmp_path} holds checkpoints written with other flags than these (resume"
          " with those flags, or pass a new --workdir): checkpoint step 2") in error, error
  assert "in-flight batch of other shapes" in error and "64 samples then, 128 now" in error, error


def test_a_loss_that_becomes_infinite_gives_one_line_naming_the_rate(capsys):
  """It ended with the NonFiniteLossError's traceback."""
  with pytest.raises(SystemExit) as exit_:
    dlrm.main(["--steps", "3", *SMALL, "--learning-rate", "1e30", "--workdir", ""])
  assert exit_.value.code == 1
  error = capsys.readouterr().err.strip().splitlines()[-1]
  assert error.startswith("dlrm.py: error: the loss is "), error
  assert "Lower the learning rate" in error and error.endswith("(here: --learning-rate 1e+30)")


def test_a_workdir_with_glob_characters_gives_one_line_naming_it(tmp_path, capsys):
  """It failed after start-up with a traceback from the checkpoint manager."""
  with pytest.raises(SystemExit) as exit_:
    dlrm.main(["--steps", "1", *SMALL, "--workdir", str(tmp_path / "a*b")])
  assert exit_.value.code == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "argument --workdir: cannot save checkpoints under" in err, err
  assert not (tmp_path / "a*b").exists()


def test_batch_size_must_divide_over_the_devices(capsys):
  with pytest.raises(SystemExit):
    dlrm.main(["--batch-size", "60", "--steps", "0", "--workdir", ""])  # 8 devices in tests
  assert "argument --batch-size: must be a multiple of the 8 devices, got 60" in (
      capsys.readouterr().err)


def test_help_describes_every_flag_with_its_default(capsys):
  with pytest.raises(SystemExit):
    dlrm.main(["--help"])
  text = capsys.readouterr().out
  formatter = dlrm._HelpFormatter("dlrm.py")
  for action in dlrm._parser()._actions:
    if action.dest != "help":
      assert "(default: " in formatter._get_help_string(action), action.dest
  assert "--steps STEPS" in text and "(default: 1000)" in text
  assert "$JAX_NUM_PROCESSES" in text
