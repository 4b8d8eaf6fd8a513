"""The sequence-feature language model example, small: learns, resumes, plots, checks flags."""

from __future__ import annotations

import os

import pytest

from examples import sequence_lm

SMALL = ["--vocab", "8", "--successors", "2", "--batch-size", "32", "--seq-len", "4",
         "--embedding-dim", "8", "--hidden", "32", "--corpus-tokens", "4000",
         "--eval-batches", "2", "--save-every", "40"]


def test_perplexity_falls_and_the_run_resumes(tmp_path, capsys):
  first = sequence_lm.main(SMALL + ["--steps", "120", "--workdir", str(tmp_path)])
  out = capsys.readouterr().out
  assert "source entropy rate" in out and out.strip().splitlines()[-1].startswith("{")
  assert first["steps"] == 120
  assert first["perplexity_before"] > 6.0  # about the 8 tokens of a uniform guess
  assert first["perplexity_after"] < 0.7 * first["perplexity_before"]
  assert first["perplexity_after"] > 0.9 * first["best_perplexity"]  # no model beats the source
  assert os.path.getsize(first["plot"]) > 0
  second = sequence_lm.main(SMALL + ["--steps", "10", "--workdir", str(tmp_path)])
  assert second["steps"] == 130
  assert "resuming from step 120" in capsys.readouterr().out
  assert second["perplexity_before"] == first["perplexity_after"]  # the same evaluation
  assert second["perplexity_after"] < 0.7 * first["perplexity_before"]  # the trained tables


def test_any_text_file(tmp_path):
  text = tmp_path / "corpus.txt"
  text.write_text("the cat sat on the mat. " * 80, encoding="utf-8")
  result = sequence_lm.main(SMALL + ["--text", str(text), "--steps", "80", "--workdir", "",
                                     "--no-pipelining"])
  assert result["source_entropy"] is None and "plot" not in result
  assert result["perplexity_after"] < 0.7 * result["perplexity_before"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "-1"], "argument --steps: must be >= 0, got -1"),
        (["--batch-size", "0"], "argument --batch-size: must be >= 1, got 0"),
        # The corpus and windows are seeded by SeedSequence([seed, ...]): seed >= 0.
        (["--seed", "-1"], "argument --seed: must be >= 0, got -1"),
        (["--learning-rate", "nan"], "argument --learning-rate: must be a number > 0, got nan"),
        (["--vocab", "4", "--successors", "5"], "--successors 5 exceeds --vocab 4"),
        (["--batch-size", "12"], "--batch-size 12 is not a multiple of the 8 devices"),
        (["--text", "/nonexistent/file.txt"], "--text '/nonexistent/file.txt' is not a readable"),
        (["--step", "3"], "unrecognized arguments: --step"),  # no abbreviations
    ],
)
def test_bad_flags_give_one_line_errors(argv, message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    sequence_lm.main(argv + ["--workdir", ""])
  assert exit_info.value.code == 2
  error = capsys.readouterr().err.strip().splitlines()[-1]
  assert message in error


def test_a_job_of_several_processes_is_refused(monkeypatch, capsys):
  """With JAX_NUM_PROCESSES=2 each process trained alone on the same workdir, and their
  saves collided in raw Orbax tracebacks."""
  monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
  with pytest.raises(SystemExit) as exit_info:
    sequence_lm.main(SMALL + ["--steps", "1", "--workdir", ""])
  assert exit_info.value.code == 2
  assert ("this example runs in one process, but JAX_NUM_PROCESSES=2 is set" in
          capsys.readouterr().err.strip().splitlines()[-1])


def test_a_text_that_is_not_utf8_is_one_line_naming_the_byte(tmp_path, capsys):
  """It was a UnicodeDecodeError traceback."""
  text = tmp_path / "latin1.txt"
  text.write_bytes("caf\u00e9 au lait ".encode("latin-1") * 200)
  with pytest.raises(SystemExit) as exit_info:
    sequence_lm.main(SMALL + ["--steps", "1", "--text", str(text), "--workdir", ""])
  assert exit_info.value.code == 2
  error = capsys.readouterr().err.strip().splitlines()[-1]
  assert f"--text {str(text)!r} is not UTF-8 text (byte 3: invalid continuation byte)" in error


def test_a_workdir_that_is_a_file_is_refused_naming_it(tmp_path, capsys):
  """It used to fail at the first save with a NotADirectoryError traceback."""
  blocker = tmp_path / "sequence_lm_workdir"
  blocker.write_text("a file, not a directory")
  with pytest.raises(SystemExit) as exit_info:
    sequence_lm.main(SMALL + ["--steps", "1", "--workdir", str(blocker)])
  assert exit_info.value.code == 2
  error = capsys.readouterr().err.strip().splitlines()[-1]
  assert f"argument --workdir: {str(blocker)!r} exists and is not a directory" in error


def test_a_resume_with_another_batch_size_gives_one_line_naming_both(tmp_path, capsys):
  """It printed the Trainer's IncompatibleCheckpointError as a traceback."""
  sequence_lm.main(SMALL + ["--steps", "2", "--workdir", str(tmp_path)])
  capsys.readouterr()
  with pytest.raises(SystemExit) as exit_info:
    sequence_lm.main(SMALL + ["--steps", "1", "--batch-size", "64", "--workdir", str(tmp_path)])
  assert exit_info.value.code == 2
  error = capsys.readouterr().err.strip().splitlines()[-1]
  assert (f"--workdir {tmp_path} holds checkpoints written with other flags than these"
          " (resume with those flags, or pass a new --workdir): checkpoint step 2") in error, error
  assert "in-flight batch of other shapes" in error and "32 samples then, 64 now" in error, error


def test_a_resume_with_another_sequence_length_gives_one_line(tmp_path, capsys):
  """The hidden layer's input grows with --seq-len: the checkpoint's dense item no
  longer fits, which evaluate (adopting the checkpoint) printed as a traceback."""
  sequence_lm.main(SMALL + ["--steps", "2", "--workdir", str(tmp_path)])
  capsys.readouterr()
  with pytest.raises(SystemExit) as exit_info:
    sequence_lm.main(SMALL + ["--steps", "1", "--seq-len", "6", "--workdir", str(tmp_path)])
  assert exit_info.value.code == 2
  error = capsys.readouterr().err.strip().splitlines()[-1]
  assert (f"--workdir {tmp_path} holds checkpoints written with other flags than these"
          f" (resume with those flags, or pass a new --workdir): checkpoint {tmp_path}") in error, error
  assert "params/Dense_0/kernel is stored with shape (32, 32) but the model asks for (48, 32)" \
      in error, error
