"""Fault injection summary: damage a checkpoint every way the suite does, count outcomes.

Runs every case of tests/checkpoint/fault_lib.py (the table that
tests/checkpoint/test_fault_injection.py asserts on) and prints one line per
case, the summary line

  cases N, detected D, fallbacks F, silent S

(`ignored` cases, where a stray entry is named in a warning and the newest
step restores bit for bit, count as neither), and the results as JSON.

Run: python benchmarks/fault_injection.py [--json PATH]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
import tempfile


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests", "checkpoint")]

from benchmarks._common import default_to_host_devices, json_path  # noqa: E402

default_to_host_devices(8)  # before jax is imported

import fault_lib  # noqa: E402


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="fault_injection.py", description=__doc__.split("\n\n")[0], allow_abbrev=False)
  parser.add_argument("--json", metavar="PATH", type=json_path,
                      help="also write every case's result here")
  return parser


def main(argv: list[str]) -> int:
  json_path = _parser().parse_args(argv).json
  results = []
  with tempfile.TemporaryDirectory() as scratch:
    template = fault_lib.build_template(os.path.join(scratch, "template", "checkpoints"))
    for index, case in enumerate(fault_lib.CASES):
      result = fault_lib.run_case(template, case, os.path.join(scratch, f"case{index}"))
      results.append(result)
      mark = "ok " if result.outcome == result.expected else "BAD"
      print(f"{mark} {result.outcome:9} {case.name:36} {result.detail[:160]}", flush=True)
  counts = collections.Counter(result.outcome for result in results)
  summary = {
      "cases": len(results),
      "detected": counts["detected"],
      "fallbacks": counts["fallback"],
      "ignored": counts["ignored"],
      "silent": counts["silent"],
      "as_expected": sum(result.outcome == result.expected for result in results),
  }
  print(
      f"cases {summary['cases']}, detected {summary['detected']}, fallbacks"
      f" {summary['fallbacks']}, silent {summary['silent']} (ignored stray entries:"
      f" {summary['ignored']}; as expected: {summary['as_expected']})"
  )
  report = {"summary": summary, "results": [dataclasses.asdict(r) for r in results]}
  print(json.dumps(report["summary"]))
  if json_path:
    with open(json_path, "w") as f:
      json.dump(report, f, indent=1)
  return 0 if summary["silent"] == 0 and summary["as_expected"] == len(results) else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
