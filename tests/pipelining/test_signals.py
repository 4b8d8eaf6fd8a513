"""Stop signals during fit: the first asks for a stop, a second Ctrl-C aborts."""

from __future__ import annotations

import os
import signal
import time
import warnings

import pytest

from pipelining import Prefetcher
from test_resume import make_trainer
from test_trainer import make_batches


def _wait_for(condition, timeout_s: float = 60) -> None:
  deadline = time.monotonic() + timeout_s
  while not condition() and time.monotonic() < deadline:
    time.sleep(0.05)


def _hanging_after(batches, index: int, hang_s: float, ready, first_handled):
  """Yields `batches`; before batch `index` (once `ready()`, so the steps before
  it have run) it sends SIGINT twice, then hangs. The second goes once
  `first_handled()`: two SIGINTs that arrive while the main thread is inside
  one C call (a step, a compilation) run Python's handler only once."""
  for position, batch in enumerate(batches):
    if position == index:
      _wait_for(ready)
      os.kill(os.getpid(), signal.SIGINT)
      _wait_for(first_handled)
      os.kill(os.getpid(), signal.SIGINT)
      time.sleep(hang_s)
    yield batch


@pytest.mark.parametrize("pipelining", [True, False])
def test_a_second_ctrl_c_aborts_a_fit_whose_data_hangs(tmp_path, pipelining, monkeypatch):
  """The abort does not wait for the thread stuck in the data (it waited 10 s)."""
  waits = []
  close = Prefetcher.close
  monkeypatch.setattr(Prefetcher, "close",
                      lambda self, **kwargs: (waits.append(kwargs), close(self, **kwargs))[1])
  before = signal.getsignal(signal.SIGINT)
  trainer = make_trainer(tmp_path, pipelining)
  with pytest.raises(KeyboardInterrupt, match="second SIGINT"):
    trainer.fit(_hanging_after(make_batches(8, seed=90), 4, hang_s=2.0,
                               ready=lambda: (trainer.latest_checkpoint_step() or 0) >= 2,
                               first_handled=lambda: trainer.stop_requested))
  assert waits[-1] == {"wait_s": 0.0}
  assert signal.getsignal(signal.SIGINT) is before
  # The checkpoints written before the abort are intact: a new fit resumes. The save the
  # abort left writing is waited for, not cleaned up under it (which left a step missing a
  # listed file, skipped with a warning, or a save failing at exit).
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    resumed = make_trainer(tmp_path, pipelining)
    history = resumed.fit(make_batches(8, seed=90))
  assert not [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
  assert history.resumed_from is not None and history.resumed_from >= 2
  assert history.final_step == 8


def test_one_signal_stops_after_the_step_and_saves(tmp_path):
  trainer = make_trainer(tmp_path, True)

  def batches():
    for position, batch in enumerate(make_batches(8, seed=91)):
      if position == 3:
        os.kill(os.getpid(), signal.SIGINT)
      yield batch

  history = trainer.fit(batches())
  assert history.interrupted and trainer.latest_checkpoint_step() == history.final_step
