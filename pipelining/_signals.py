"""SIGTERM and SIGINT during fit: a request to stop, not the end of the process.

While fit runs, both signals only set the Trainer's stop request; fit then
finishes the current step, saves (with a workdir) and returns with
`history.interrupted`. A second SIGINT (Ctrl-C again) while that stop is
pending raises KeyboardInterrupt at once: the way out of a fit whose data
iterator hangs, so the step never ends. fit then returns without finishing
the step or saving; the checkpoints already written stay intact. The
previous handlers come back when fit returns. Only the main thread may
install signal handlers: fit called from another thread leaves them alone
(use `Trainer.request_stop` there).
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

_LOG = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def install_stop_handlers(stop_requested: threading.Event) -> dict[int, Any] | None:
  """Makes SIGTERM and SIGINT set `stop_requested`; returns the previous handlers."""
  if threading.current_thread() is not threading.main_thread():
    return None
  previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}

  def handle(signum: int, _frame) -> None:
    if signum == signal.SIGINT and stop_requested.is_set():
      raise KeyboardInterrupt(
          "a second SIGINT while a stop was pending: fit aborted without finishing its step"
          " or saving; the checkpoints already written are intact."
      )
    stop_requested.set()
    _LOG.warning("%s: fit stops after the current step (and saves, with a workdir)%s.",
                 signal.Signals(signum).name,
                 "; press Ctrl-C again to abort at once" if signum == signal.SIGINT else "")

  for signum in STOP_SIGNALS:
    signal.signal(signum, handle)
  return previous


def restore_handlers(previous: dict[int, Any] | None) -> None:
  """Reinstalls what `install_stop_handlers` returned."""
  for signum, handler in (previous or {}).items():
    signal.signal(signum, handler)
