"""User hooks into fit: subclass `Callback` and override what you need."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class Callback:
  """Hooks called by `Trainer.fit`; every method is a no-op by default.

  Metrics are host floats. A callback may stop training early by calling
  `trainer.request_stop()`. Each hook is called on every callback, in order,
  even when an earlier callback's raises an Exception: every callback sees
  every step, evaluation and save that happened (a logger still records the
  step another callback failed on). fit then raises the first error, the
  others attached to it as notes. A KeyboardInterrupt or SystemExit from a
  hook is raised at once (the callbacks after it are not called; those
  before it that raised are noted on it).
  """

  def on_fit_start(self, trainer: Any, step: int) -> None:
    """Before the first step (after any resume); `step` is the resumed step."""

  def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
    """After update `step` (1-based count of updates applied)."""

  def on_eval_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
    """After an evaluation run during fit."""

  def on_save(self, trainer: Any, step: int) -> None:
    """After a checkpoint of `step` was started."""

  def on_fit_end(self, trainer: Any, history: Any) -> None:
    """When fit returns, also after an interruption or an error (history.final_step
    counts the updates applied)."""


HOOKS = tuple(name for name in vars(Callback) if name.startswith("on_"))


def checked_callbacks(callbacks: Sequence[Callback]) -> tuple[Callback, ...]:
  """fit's callbacks: each a `Callback`, or an object with all of its hooks (fit calls them)."""
  if isinstance(callbacks, Callback) or (
      not isinstance(callbacks, (list, tuple)) and hasattr(callbacks, HOOKS[0])):
    callbacks = (callbacks,)
  try:
    callbacks = tuple(callbacks)
  except TypeError:  # one function or another object that is no sequence of callbacks
    raise TypeError(
        f"callbacks must be a sequence of pipelining.Callback objects (subclass Callback and"
        f" override the hooks you need, e.g. on_step_end), got {callbacks!r}."
    ) from None
  for callback in callbacks:
    missing = [name for name in HOOKS if not callable(getattr(callback, name, None))]
    if missing and not isinstance(callback, Callback):
      raise TypeError(
          f"callbacks must be pipelining.Callback objects (subclass Callback and override the"
          f" hooks you need, e.g. on_step_end), or have all of its hooks; {callback!r} lacks"
          f" {missing}."
      )
  return tuple(callbacks)


def call_each(callbacks: Sequence[Callback], hook: str, *args: Any) -> None:
  """Calls `hook(*args)` on every callback, also after one of them raised an Exception;
  then raises the first such error, noting the others on it. A KeyboardInterrupt or
  SystemExit is raised at once, noting the errors before it (see `Callback`)."""
  raised: list[tuple[Callback, Exception]] = []
  for callback in callbacks:
    try:
      getattr(callback, hook)(*args)
    except Exception as error:  # noqa: BLE001 - re-raised below
      raised.append((callback, error))
    except BaseException as stop:
      _note(stop, hook, raised)
      raise
  if raised:
    first = raised[0][1]
    _note(first, hook, raised[1:])
    raise first


def _note(error: BaseException, hook: str, others: Sequence[tuple[Callback, Exception]]) -> None:
  for callback, other in others:
    error.add_note(f"{callback!r}.{hook} also raised {type(other).__name__}: {other}")
