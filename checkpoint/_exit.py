"""Background saves finished when the interpreter exits.

A `CheckpointManager` writes in the background (`async_save=True`). A
program that ends without `close()` or a `with` block lost its last save:
Python stops the thread pools that Orbax's background save still submits
work to, so the save failed half written ("cannot schedule new futures after
interpreter shutdown") and left only a temporary directory. Each manager is
registered here when opened and forgotten when closed; at exit, before those
pools stop, every manager still open waits for its save, as `close()` would.
A save that fails then is named in a warning (the exit goes on).

Only in a single-process job: with several processes, a save's commit waits
for every process, and one process ending alone would wait for peers that may
never come; such jobs close their managers (the Trainer does).
"""

from __future__ import annotations

import atexit
import threading
import warnings
import weakref
from typing import Any

import jax

_open_managers: weakref.WeakSet = weakref.WeakSet()
_lock = threading.Lock()
_registered = False


def finish_at_exit(manager: Any) -> None:
  """Has `manager.wait_until_finished()` run at interpreter exit unless it is forgotten."""
  global _registered
  with _lock:
    _open_managers.add(manager)
    if not _registered:
      # threading's exit hooks run before the thread pools shut down (atexit's run
      # after), the latest registered first; the pools registered theirs on import.
      register = getattr(threading, "_register_atexit", atexit.register)
      register(_finish_open_saves)
      _registered = True


def forget(manager: Any) -> None:
  """`manager` was closed: nothing is left to finish at exit."""
  with _lock:
    _open_managers.discard(manager)


def _finish_open_saves() -> None:
  with _lock:
    managers = list(_open_managers)
  if not managers or jax.process_count() > 1:
    return
  for manager in managers:
    try:
      manager.wait_until_finished()
    except Exception as error:  # noqa: BLE001 - the exit goes on; the warning names it
      warnings.warn(f"the checkpoint save in {manager.directory} still running at exit failed:"
                    f" {type(error).__name__}: {error}", RuntimeWarning, stacklevel=1)
