"""The command-line argument types: bounds, and one-line errors naming the value."""

import argparse
import os

import pytest

from sc_framework.cli_types import integer_at_least, positive_float, seed, workdir_path


def _parser():
  parser = argparse.ArgumentParser(prog="prog", exit_on_error=False)
  parser.add_argument("--steps", type=integer_at_least(0))
  parser.add_argument("--devices", type=integer_at_least(1))
  parser.add_argument("--rate", type=positive_float)
  return parser


@pytest.mark.parametrize("argv, expected", [
    (["--steps", "0"], dict(steps=0)),
    (["--steps", "12"], dict(steps=12)),
    (["--devices", "1"], dict(devices=1)),
    (["--rate", "0.25"], dict(rate=0.25)),
    (["--rate", "3e-4"], dict(rate=3e-4)),
])
def test_values_within_the_bounds_parse(argv, expected):
  args = vars(_parser().parse_args(argv))
  assert {k: args[k] for k in expected} == expected
  assert all(type(args[k]) is type(v) for k, v in expected.items())


@pytest.mark.parametrize("argv, message", [
    (["--steps", "-1"], "argument --steps: must be >= 0, got -1"),
    (["--devices", "0"], "argument --devices: must be >= 1, got 0"),
    (["--devices", "2.5"], "argument --devices: expected an integer, got '2.5'"),
    (["--rate", "0"], "argument --rate: must be a number > 0, got 0"),
    (["--rate", "-0.5"], "argument --rate: must be a number > 0, got -0.5"),
    (["--rate", "nan"], "argument --rate: must be a number > 0, got nan"),
    (["--rate", "inf"], "argument --rate: must be a number > 0, got inf"),
    (["--rate", "fast"], "argument --rate: expected a number, got 'fast'"),
])
def test_values_outside_the_bounds_name_flag_bound_and_value(argv, message):
  with pytest.raises(argparse.ArgumentError) as error:
    _parser().parse_args(argv)
  assert str(error.value) == message


def _workdir_parser():
  parser = argparse.ArgumentParser(prog="prog", exit_on_error=False)
  parser.add_argument("--workdir", type=workdir_path)
  return parser


def test_a_workdir_that_is_or_can_become_a_directory_parses(tmp_path):
  (tmp_path / "run").mkdir()
  for text in [str(tmp_path), str(tmp_path / "run"), str(tmp_path / "new" / "deeper"), "",
               "gs://bucket/run"]:
    assert _workdir_parser().parse_args(["--workdir", text]).workdir == text


def test_a_workdir_blocked_by_a_file_names_the_file(tmp_path):
  """A regular file at the workdir, or above it, used to fail the first save with a bare
  NotADirectoryError; the flag is refused instead, naming the path."""
  blocker = tmp_path / "notes.txt"
  blocker.write_text("not a directory")
  with pytest.raises(argparse.ArgumentError) as error:
    _workdir_parser().parse_args(["--workdir", str(blocker)])
  assert str(error.value) == (f"argument --workdir: {str(blocker)!r} exists and is not a"
                              " directory; give a directory (it is created if missing)")
  with pytest.raises(argparse.ArgumentError) as error:
    _workdir_parser().parse_args(["--workdir", str(blocker / "run" / "1")])
  assert str(error.value) == (f"argument --workdir: {str(blocker / 'run' / '1')!r} cannot be"
                              f" created: {str(blocker)!r} is not a directory")


def test_a_seed_beyond_32_bits_is_refused_naming_the_bound():
  """JAX's PRNG key keeps 32 bits of a seed: 2**32 started the run of seed 0."""
  parser = argparse.ArgumentParser(prog="prog", exit_on_error=False)
  parser.add_argument("--seed", type=seed)
  assert parser.parse_args(["--seed", str(2**32 - 1)]).seed == 2**32 - 1
  with pytest.raises(argparse.ArgumentError) as error:
    parser.parse_args(["--seed", str(2**32)])
  assert str(error.value) == f"argument --seed: must be <= {2**32 - 1}, got {2**32}"


def test_a_workdir_that_cannot_be_written_is_refused_naming_the_directory(tmp_path, monkeypatch):
  """A read-only file system: the first save failed with an OSError traceback."""
  (tmp_path / "run").mkdir()
  monkeypatch.setattr(os, "access", lambda path, mode: os.fspath(path) != str(tmp_path))
  with pytest.raises(argparse.ArgumentError) as error:
    _workdir_parser().parse_args(["--workdir", str(tmp_path / "new")])
  assert str(error.value) == (f"argument --workdir: {str(tmp_path / 'new')!r} cannot be written:"
                              f" {str(tmp_path)!r} is read-only or not writable by this user")
  assert _workdir_parser().parse_args(["--workdir", str(tmp_path / "run")]).workdir == str(
      tmp_path / "run")
