"""The command-line argument types: bounds, and one-line errors naming the value."""

import argparse

import pytest

from sc_framework.cli_types import integer_at_least, positive_float


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
