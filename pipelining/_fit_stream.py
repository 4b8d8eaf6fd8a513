"""One fit's data stream: the batches the fit takes, and what it hands on at its end.

`FitData` opens the stream and keeps, across fits, what a fit that stopped
hands on. `FitStream` is the fit's side: it hands the loop its batches and
records what the end of the fit needs to know:
- whether the data ended (of any process);
- the newest batch taken, with the loop's data position at that moment:
  the loop replaces that position when it takes the batch (applies it, or
  holds it in flight), so an unchanged position means the batch is still
  unapplied: the first batch of a fit that trained nothing, or one that
  arrived after a stop was requested;
- whether the loop state is this fit's (the loop started), and whether the
  fit has handed on already.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import jax

from pipelining._data import is_one_shot
from pipelining._fit_data import FitData
from pipelining._prefetch import Prefetcher, Prepared


class FitStream:
  """The batches of one fit, and its hand-on to the next fit (`FitData.hand_on`).

  Args:
    fit_data: the Trainer's data across fits; it opens the stream.
    train_data, epochs: fit's.
    can_continue, position, at_end: as `FitData.open`.
    take: (prefetcher) -> the next batch, or None when the data of any
      process ended.
    ends: (prefetcher) -> whether the data of any process ends here; the
      next batch stays in the prefetcher.
    loop_data: the data position of the Trainer's loop state now (None
      before it has a state).
  """

  def __init__(self, fit_data: FitData, train_data: Iterable[Any], epochs: int | None, *,
               can_continue: Callable[[], bool], position: Callable[[bool], dict[str, Any]],
               at_end: Literal["stop", "start_over"],
               take: Callable[[Prefetcher], Prepared | None],
               ends: Callable[[Prefetcher], bool],
               loop_data: Callable[[], Mapping[str, Any] | None]):
    self._fit_data, self._train_data, self._epochs = fit_data, train_data, epochs
    self._take, self._ends, self._loop_data = take, ends, loop_data
    self._can_continue, self._position, self._at_end = can_continue, position, at_end
    self._loop_at_open = loop_data()
    self._took_carried_stream = False  # whether a stream of this fit continued the last's
    self._prefetcher, self.continued = self._open()
    self._data_ended = False
    self._last_taken: Prepared | None = None
    self._position_before: Mapping[str, Any] | None = None
    self._started = self._handed_on = False

  def next_batch(self) -> Prepared | None:
    """The next batch, or None when the data of any process ended."""
    prepared = self._take(self._prefetcher)
    self._data_ended = self._data_ended or prepared is None
    if prepared is not None:
      self._last_taken, self._position_before = prepared, self._loop_data()
    return prepared

  def _open(self) -> tuple[Prefetcher, bool]:
    prefetcher, continued = self._fit_data.open(
        self._train_data, self._epochs, can_continue=self._can_continue(),
        position=self._position, at_end=self._at_end)
    self._took_carried_stream = self._took_carried_stream or continued
    return prefetcher, continued

  def reopen(self, dropped: Callable[[], None]) -> None:
    """Opens the stream again, as at first, before the loop started.

    The checkpoint the fit resumes changed (the one it first chose was
    damaged): the stream starts at the data position of the one it resumes
    now, or continues the last fit's stream if none is newer than the
    Trainer's state. The batches taken so far are dropped (`dropped()` runs
    once the stream is closed); they are read again.
    """
    if self._started:
      raise RuntimeError("the fit's loop started: its stream cannot start over.")
    self._prefetcher.close()
    dropped()
    self._prefetcher, self.continued = self._open()
    self._data_ended = False
    self._last_taken = self._position_before = None

  def start(self, first: Prepared | None) -> None:
    """The loop starts from the Trainer's loop state (as a restore left it) with `first`."""
    self._fit_data.consume()
    self._started = True
    self._last_taken, self._position_before = first, self._loop_data()

  def _unapplied(self) -> tuple[Prepared, ...]:
    """The newest batch taken, unless the loop applied it or holds it in flight."""
    untaken = self._last_taken is not None and self._loop_data() is self._position_before
    return (self._last_taken,) if untaken else ()

  def hand_on(self, *, interrupted: bool, pipelined: bool) -> None:
    """Hands on what the next fit continues from, after the loop ended normally.

    Args:
      interrupted: the loop stopped on request.
      pipelined: the loop took the batch after its last update (for its
        lookup), so it met the end of the data if the data ended there.
    """
    if not (self._data_ended or interrupted or pipelined or self._unapplied()):
      # Stopped at num_steps without looking past the last batch, where a
      # pipelined fit takes the next one (its lookup): a fit ending with
      # the data sees the end in both modes (the next fit starts anew).
      # The next batch is not taken: an error in it is the next fit's.
      self._data_ended = self._ends(self._prefetcher)
    self._handed_on = True
    self._fit_data.hand_on(self._train_data, self._epochs, self._prefetcher, self._unapplied(),
                           interrupted=interrupted, data_ended=self._data_ended)

  def hand_on_after_error(self, error: BaseException) -> None:
    """Hands on what the next fit continues from, after `error` ended the fit.

    Once the loop started, the loop state holds the batches taken so far:
    the next fit goes on after them. A broken stream, or an abort (a second
    Ctrl-C), is not carried, nor is any stream with several processes (they
    no longer agree). Nothing is handed on before the loop started, or
    again after `hand_on`.
    """
    if not self._started:
      self._note_spent()
    if not self._started or self._handed_on:
      return
    keep = (isinstance(error, Exception) and not self._prefetcher.failed
            and jax.process_count() == 1)
    self._fit_data.hand_on(self._train_data, self._epochs, self._prefetcher, self._unapplied(),
                           interrupted=True, data_ended=self._data_ended, keep_stream=keep)

  def _note_spent(self) -> None:
    """Before the loop started: a one-shot iterator this fit's own stream took batches from
    lost them (`FitData.spent`). A carried stream's loss is `drop_carry`'s."""
    data = self._train_data
    took = self._prefetcher.iterator.batches_consumed > self._prefetcher.start_index
    if took and not self.continued and is_one_shot(data):
      self._fit_data.spent(data)

  def close(self, *, aborted: bool = False) -> None:
    """Stops the prefetch thread, waiting boundedly: it may be stuck in the user's iterator.

    After an abort (`aborted`: a second Ctrl-C, `pipelining._signals`) it
    does not wait at all. A fit that ends before its loop started (nothing
    to fit, an error) trained nothing: what the last fit handed on still
    holds for the next fit, except a carried stream this fit took batches
    from (the next fit then starts at the loop's data position). All of it is forgotten, as by a
    fit that started, where the data ended (the next fit starts anew) or
    the loop state changed all the same (a checkpoint was restored).
    """
    if not self._started:
      if self._data_ended or self._loop_data() is not self._loop_at_open:
        self._fit_data.consume()
      elif self._took_carried_stream:
        self._fit_data.drop_carry()
    if aborted:
      self._prefetcher.close(wait_s=0.0)
    else:
      self._prefetcher.close()
