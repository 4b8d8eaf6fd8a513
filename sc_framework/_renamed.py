"""Arguments that other embedding libraries name otherwise: a TypeError that names ours.

A config ported from jax-tpu-embedding (the SparseCore stack) or TensorFlow's
TPUEmbedding passes their argument names (`table_spec=`, `beta_1=`,
`initial_accumulator_value=`, ...). Python's own error ("unexpected keyword
argument") does not say what to write instead; `refuse_renamed` does, before
the constructor runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any


def refusing_renamed(renamed: Mapping[str, str],
                     check_args: Callable[[tuple], None] | None = None) -> Callable[[type], type]:
  """A class decorator (outside @dataclass): its __init__ first refuses `renamed`'s
  arguments (`refuse_renamed`) and runs check_args(args) on the positional ones.

  The wrapped __init__ keeps the dataclass's signature (inspect, help, IDEs).
  """

  def decorate(cls: type) -> type:
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
      refuse_renamed(cls.__name__, kwargs, renamed)
      if check_args is not None:
        check_args(args)
      init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls

  return decorate


def refusing_renamed_keywords(renamed: Mapping[str, str]) -> Callable[[Callable], Callable]:
  """A function decorator: the function first refuses `renamed`'s keyword arguments
  (`refuse_renamed`); it keeps its signature."""

  def decorate(function: Callable) -> Callable:
    @functools.wraps(function)
    def wrapped(*args, **kwargs):
      refuse_renamed(function.__qualname__, kwargs, renamed)
      return function(*args, **kwargs)

    return wrapped

  return decorate


def refuse_renamed(owner: str, kwargs: Mapping[str, Any], renamed: Mapping[str, str]) -> None:
  """Raises TypeError for a keyword argument of `kwargs` that `renamed` knows.

  Args:
    owner: the class, as the message names it.
    kwargs: the keyword arguments given.
    renamed: another library's argument name -> what to pass here instead
      (a sentence).
  """
  for name in kwargs:
    if name in renamed:
      raise TypeError(f"{owner}() got an unexpected keyword argument {name!r}: {renamed[name]}")


def use_instead(ours: str, theirs: str) -> str:
  """The advice for an argument that is only named otherwise here."""
  return f"it is named {ours} here: pass {ours}= instead of {theirs}=."


# The SparseCore stack's name for the shards of a stack on one device.
SHARDS_RENAMED = {"num_sc_per_device": use_instead("shards_per_device", "num_sc_per_device")}
