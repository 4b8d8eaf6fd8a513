"""Argument types for command lines: bounded numbers and work directories, with one-line errors.

`argparse` calls a type on the flag's text and, on `ArgumentTypeError`, prints
`error: argument --flag: <message>`. The types here refuse what a training
or checkpoint command cannot use (a negative step count, zero devices, a
NaN learning rate) with a message that gives the bound and the value:

  parser.add_argument("--steps", type=integer_at_least(0))
  parser.add_argument("--learning-rate", type=positive_float)
  parser.add_argument("--workdir", type=workdir_path)

`sc-checkpoint` and the examples use them; so can a user's own script.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable


def integer_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
  """A type accepting an integer n >= `minimum` (and <= `maximum`, where given)."""

  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < minimum:
      raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
      raise argparse.ArgumentTypeError(f"must be <= {maximum}, got {value}")
    return value

  parse.__name__ = f"int >= {minimum}"  # argparse names the type by it
  return parse


# A seed: JAX's PRNG key keeps 32 bits of it, so a larger one would start the
# run of a smaller one.
seed = integer_at_least(0, 2**32 - 1)


def positive_float(text: str) -> float:
  """A type accepting a finite number x > 0."""
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
  if not (math.isfinite(value) and value > 0):
    raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
  return value


def workdir_path(text: str) -> str:
  """A type accepting a directory to write into: one that exists, or one that can be made.

  A local path is refused when it, or the nearest of its parents that exists,
  is not a directory (a regular file there would otherwise fail the first
  save with a bare `NotADirectoryError`). The empty string (no workdir) and
  URL-like paths (`gs://bucket/run`, any `scheme://`) are returned unchecked.
  """
  if not text or "://" in text:
    return text
  if os.path.lexists(text) and not os.path.isdir(text):
    raise argparse.ArgumentTypeError(
        f"{text!r} exists and is not a directory; give a directory (it is created if missing)")
  parent = os.path.normpath(text)
  while parent and not os.path.lexists(parent):
    parent = os.path.dirname(parent)  # ends at "/" or "" (the current directory)
  if parent and not os.path.isdir(parent):
    raise argparse.ArgumentTypeError(
        f"{text!r} cannot be created: {parent!r} is not a directory")
  if not os.access(parent or os.curdir, os.W_OK | os.X_OK):
    raise argparse.ArgumentTypeError(
        f"{text!r} cannot be written: {parent or os.curdir!r} is read-only or not writable"
        " by this user")
  return text
