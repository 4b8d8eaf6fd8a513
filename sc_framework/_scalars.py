"""Numpy (and concrete JAX) scalars given where a spec wants a Python number.

Sizes and hyperparameters often come out of numpy: `ids.max() + 1` is an
`np.int64`, a config loaded with numpy gives `np.float32` rates. Specs keep
Python numbers (they are hashed as static `jit` arguments and written to
JSON), so such a scalar is replaced by the Python `bool`, `int` or `float`
it holds -- `value.item()`, exact for every numpy integer and float type --
before validation. Anything else, arrays with elements included, is left for
the validation to judge.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

_NUMERIC_KINDS = "biuf"  # bool, signed and unsigned integers, floats


def python_scalar(value: Any) -> Any:
  """The Python number a 0-d numpy/JAX numeric scalar holds; any other value unchanged."""
  if isinstance(value, jax.core.Tracer):
    return value
  # Before any test against float: np.float64 is a subclass of it.
  if isinstance(value, (np.generic, np.ndarray, jax.Array)):
    if np.ndim(value) == 0 and np.dtype(value.dtype).kind in _NUMERIC_KINDS:
      return np.asarray(value).item()
  return value


def python_scalar_fields(instance: Any) -> None:
  """Replaces, in place, each numpy scalar field of a (frozen) dataclass.

  Elements of tuple and list fields are converted too (shapes, clip ranges);
  the container keeps its type.
  """
  for field in dataclasses.fields(instance):
    value = getattr(instance, field.name)
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
      converted = type(value)(python_scalar(element) for element in value)
      changed = any(a is not b for a, b in zip(converted, value))
    else:
      converted = python_scalar(value)
      changed = converted is not value
    if changed:
      object.__setattr__(instance, field.name, converted)
