"""The benchmarks' shared flags and table: a bad --json path is refused before the run."""

from __future__ import annotations

import argparse
import math
import os

import pytest

from benchmarks._common import json_path, print_table


@pytest.mark.parametrize("make, reason", [
    (lambda tmp: "", "is no file path"),
    (lambda tmp: str(tmp) + os.sep, "is no file path"),
    (lambda tmp: str(tmp / "later") + os.sep, "is no file path"),  # a directory-to-be
    (lambda tmp: str(tmp), "is no file path"),
    (lambda tmp: str(tmp / "missing" / "r.json"), "does not exist"),
])
def test_a_json_path_no_run_could_write_is_refused_before_it(tmp_path, make, reason):
  """'' and a path ending in '/' passed the check and failed after the whole run."""
  with pytest.raises(argparse.ArgumentTypeError, match=reason):
    json_path(make(tmp_path))


def test_a_json_path_in_a_directory_this_process_cannot_write_is_refused(tmp_path, monkeypatch):
  """It failed after the whole run. (Permission bits do not bind root, so the test
  answers for the file system.)"""
  locked = tmp_path / "locked"
  locked.mkdir()
  real_access = os.access
  monkeypatch.setattr("benchmarks._common.os.access",
                      lambda path, mode: False if str(path).startswith(str(locked))
                      else real_access(path, mode))
  with pytest.raises(argparse.ArgumentTypeError, match="r.json' cannot be written"):
    json_path(str(locked / "r.json"))


def test_a_json_path_that_can_be_written_is_taken(tmp_path):
  assert json_path(str(tmp_path / "r.json")) == str(tmp_path / "r.json")
  (tmp_path / "old.json").write_text("{}")
  assert json_path(str(tmp_path / "old.json")) == str(tmp_path / "old.json")


def test_cells_that_do_not_apply_print_as_a_dash(capsys):
  print_table([{"case": "a", "ms": 1.25, "ratio": math.nan}, {"case": "b", "ms": None,
                                                             "ratio": 0.5}],
              [("case", "case", "s"), ("ms", "ms", ".1f"), ("ratio", "ratio", ".2f")])
  lines = capsys.readouterr().out.splitlines()
  assert [line.split() for line in lines[2:]] == [["a", "1.2", "-"], ["b", "-", "0.50"]]
