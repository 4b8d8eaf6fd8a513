"""The fault-injection script's command line: --help describes it, other flags are refused."""

from __future__ import annotations

import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "fault_injection.py"


def _run(*argv: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True,
                        timeout=120)


def test_help_prints_usage_without_running_the_cases():
  """--help used to be ignored: it ran every case (about half a minute) instead."""
  result = _run("--help")
  assert result.returncode == 0, result.stderr
  assert result.stdout.startswith("usage: fault_injection.py") and "--json PATH" in result.stdout
  assert "cases " not in result.stdout


def test_an_unknown_flag_is_refused():
  result = _run("--quick")
  assert result.returncode == 2
  assert "unrecognized arguments: --quick" in result.stderr
