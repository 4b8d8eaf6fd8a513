"""Counting XLA compilations in a block of test code."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def count_compiles(fun_name: str | None = None) -> Iterator[list[str]]:
  """Collects the XLA compilations in the block: of `fun_name` (e.g. "jit(step)"), or all.

  jax records the event for a program read from the persistent compilation
  cache as well, so a count does not depend on what earlier tests compiled.
  """
  compiled: list[str] = []

  def listener(event, duration, **kwargs):
    del duration
    name = kwargs.get("fun_name")
    if event == _BACKEND_COMPILE_EVENT and fun_name in (None, name):
      compiled.append(name)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield compiled
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
