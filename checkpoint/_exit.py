"""Background saves finished when the interpreter exits.

A `CheckpointManager` writes in the background (`async_save=True`). A
program that ended without `close()` or a `with` block lost its last save:
Python stops the thread pools that Orbax's background save still submits
work to, so the save failed half written ("cannot schedule new futures after
interpreter shutdown") and left only a temporary directory. The first manager
opened registers `_finish_saves` to run at exit before those pools stop; it
waits for

  1. every manager still open (`wait_until_finished`, as `close()` would),
     which reports a save that failed;
  2. then every Orbax save thread still running: those of managers collected
     without being closed, and those whose wait a Ctrl-C interrupted (Python
     3.11 then takes the running thread for ended, so Orbax's own wait
     returns at once). A thread counts as running while the interpreter
     still has a frame for it (`sys._current_frames`), whatever its Thread
     object says.

A save that fails then, and a Ctrl-C that abandons the wait, are named on
stderr (the exit goes on; its status is the program's). Python 3.12.0 to
3.12.2 refuse to start threads once the interpreter exits (CPython issue
113964, fixed in 3.12.3), and Orbax starts one to commit a save: there a save
still running at exit fails whatever is waited for, and stderr says so and
what to do. Only in a
single-process job: with several processes a save's commit waits for every
process, and one process ending alone would wait for peers that may never
come; such jobs close their managers (the Trainer waits for its saves).

The same registry serves `finish_saves_into`: a manager opened on a directory
first waits for the saves this process's other managers still write there,
which it would otherwise remove as unfinished.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
import warnings
import weakref
from typing import Any

import jax

# Orbax's threads that write and commit a save (AsyncCheckpointer, CheckpointManager).
_SAVE_THREADS = frozenset({"async_save", "save_finalize"})
_SAY_AFTER_S = 1.0  # A wait this long at exit is announced.

# CPython issue 113964: no new thread at exit, which Orbax's commit of a save needs.
THREADS_REFUSED_AT_EXIT = (3, 12, 0) <= sys.version_info[:3] < (3, 12, 3)

_open_managers: weakref.WeakSet = weakref.WeakSet()
_lock = threading.Lock()
_registered = False


def finish_at_exit(manager: Any) -> None:
  """Has the saves of `manager` (see the module doc) finished at interpreter exit."""
  global _registered
  with _lock:
    _open_managers.add(manager)
    if not _registered:
      # threading's exit hooks run before the thread pools shut down (atexit's run
      # after), the latest registered first; the pools registered theirs on import.
      register = getattr(threading, "_register_atexit", atexit.register)
      try:
        register(_finish_saves)
      except RuntimeError:  # Opened while the interpreter exits: too late to wait at exit.
        return
      _registered = True


def finish_saves_into(directory: Any) -> None:
  """Waits for the saves of this process's open managers of `directory`.

  A manager opened on a directory removes the temporary directories of
  unfinished saves there: one that another manager of this process is still
  writing (a Trainer whose fit raised, with its save in flight) must be
  finished first, not removed under it. One that fails is named in a warning
  (it is that manager's failure, not the opening's).
  """
  with _lock:
    managers = [manager for manager in _open_managers if manager.directory == directory]
  for manager in managers:
    try:
      manager.wait_until_finished()
    except Exception as error:  # noqa: BLE001 - that manager's failure, named
      warnings.warn(f"a save into {directory} by another manager of this process failed:"
                    f" {type(error).__name__}: {error}", RuntimeWarning, stacklevel=3)
  if managers and jax.process_count() == 1:
    # A save whose wait a Ctrl-C interrupted (a fit aborted by a second Ctrl-C) still
    # writes, but its manager's wait returns at once (see the module doc): its thread
    # is waited for, or the opening manager's cleanup would remove files under it.
    _wait_for_save_threads("waiting for a checkpoint save of this process still being"
                           f" written into {directory} (Ctrl-C abandons it).")


def forget(manager: Any) -> None:
  """`manager` was closed: its saves are waited for already."""
  with _lock:
    _open_managers.discard(manager)


def _finish_saves() -> None:
  if jax.process_count() > 1:
    return
  with _lock:
    managers = list(_open_managers)
  if THREADS_REFUSED_AT_EXIT and _save_threads():
    _say(f"a checkpoint save is still running at exit, and Python {sys.version.split()[0]}"
         " cannot start the thread Orbax needs to commit it (CPython issue 113964, fixed in"
         " 3.12.3): that save will fail, and the steps saved before it are kept. Close the"
         " CheckpointManager (or use it in a with block) before the program ends, or use"
         " Python 3.12.3 or newer.")
  try:
    for manager in managers:
      try:
        manager.wait_until_finished()
      except Exception as error:  # noqa: BLE001 - reported; the other saves still finish
        _say(f"the checkpoint save in {manager.directory} still running at exit failed"
             f" ({type(error).__name__}: {error}); its step is not complete, and the"
             " steps saved before it are kept.")
    _wait_for_save_threads("waiting at exit for a checkpoint save still being written (Ctrl-C"
                           " abandons it).")
  except KeyboardInterrupt:
    _say("interrupted while a checkpoint save was finishing at exit: that save is abandoned"
         " (the steps saved before it are kept; the next manager opened there removes what"
         " it left).")


def _save_threads() -> list[threading.Thread]:
  """The Orbax save threads still running, besides this one."""
  current = threading.current_thread()
  return [thread for thread in threading.enumerate()
          if thread.name in _SAVE_THREADS and thread is not current
          and thread.ident in sys._current_frames()]


def _wait_for_save_threads(announcement: str) -> None:
  """Blocks while an Orbax save thread still runs (see the module doc); a wait longer than
  `_SAY_AFTER_S` is announced."""
  threads = _save_threads()
  start, said = time.monotonic(), False
  while any(thread.ident in sys._current_frames() for thread in threads):
    if not said and time.monotonic() - start > _SAY_AFTER_S:
      _say(announcement)
      said = True
    time.sleep(0.02)


def _say(message: str) -> None:
  print(f"sc-framework: {message}", file=sys.stderr, flush=True)
