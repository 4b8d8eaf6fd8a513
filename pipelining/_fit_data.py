"""The training data across fits: where each fit's stream starts, what a stopped fit hands on.

Every fit reads its batches through a `Prefetcher` over a `DataStream`
(`pipelining._data`). Where that stream starts:
- a fit given the same data object (and epochs) as a fit that stopped before
  its data ended (at num_steps, on a stop request, or on an exception raised
  by a callback, an evaluation or a save) continues that fit's stream, first
  handing out the batches that fit took but did not apply. So
  fits in chunks on the same data equal one fit, also for a one-shot
  iterator, as a new Trainer resuming the final checkpoint would;
- any other fit starts at `position(after_interruption)`: given the data
  object of a fit whose stream could not be carried after a stop request
  (or an exception, once the loop ran) before its data ended, at the loop's
  data position (a re-iterable skips the batches consumed; a one-shot
  iterator cannot go back, and says so); else at a newer checkpoint's
  position, or at the beginning: other data starts from its beginning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, Literal, NamedTuple

import jax

from pipelining._data import DataStream
from pipelining._distributed import allgather_json
from pipelining._in_flight import Staged
from pipelining._prefetch import Prefetcher, Prepared

_LOG = logging.getLogger("pipelining")


def epoch_count(epochs: int | None) -> int:
  """fit's `epochs` as a count (None is one pass)."""
  return 1 if epochs is None else epochs


class _CarriedStream(NamedTuple):
  """The data stream of a fit that stopped before its data ended (`FitData.hand_on`)."""

  data: Iterable[Any]  # the train_data the fit was given (compared by identity)
  epochs: int
  stream: DataStream
  remainder: tuple[Any, ...]  # taken from `stream`, not applied: handed out first


class FitData:
  """Opens each fit's stream of staged batches and keeps what a stopped fit hands on.

  Args:
    stage: (raw batch, index in the stream) -> the staged batch.
    prefetch_depth: batches staged ahead of the fit loop.
    prefetch_workers: threads staging batches at once.
  """

  def __init__(self, stage: Callable[[Any, int], Staged], prefetch_depth: int,
               prefetch_workers: int = 1):
    self._stage = stage
    self._prefetch_depth = prefetch_depth
    self._prefetch_workers = prefetch_workers
    # After a fit that stopped before its data ended: its data, stream and the
    # batches taken but not applied. Each fit consumes it (`consume`).
    self._carry: _CarriedStream | None = None
    # After a stop request or an exception whose data did not end, when its
    # stream is not carried: that fit's data, which the next fit given it
    # starts at the loop's position. Each fit consumes it.
    self._at_loop_position_of: Iterable[Any] | None = None
    # A one-shot iterator a fit took batches from, then raised before training
    # on them (`spent`): no later fit can be given it.
    self._spent: Iterable[Any] | None = None

  def open(self, train_data: Iterable[Any], epochs: int | None, *, can_continue: bool,
           position: Callable[[bool], dict[str, Any]],
           at_end: Literal["stop", "start_over"]) -> tuple[Prefetcher, bool]:
    """The prefetched stream of fit's staged batches.

    Args:
      train_data, epochs: fit's.
      can_continue: whether the state is still the one the last fit left
        (no newer checkpoint to resume); if not, nothing is continued.
      position: (after an interruption) -> the data position to start at
        ({} is the beginning; keys as `DataStream`'s arguments, and
        "batch_in_flight": whether the state resumed holds a batch whose update is
        still to run, which makes a position at the end of the data "stop").
      at_end: `DataStream`'s, for a position at the end of the data.

    What the last fit handed on stays until `consume`: a fit whose
    checkpoint turned out damaged opens its stream again, as if the step were
    not there.

    Returns:
      The prefetcher, and whether it continues the last fit's stream.
    """
    carry = self._carry
    if train_data is self._spent:
      raise ValueError(
          "train_data is the one-shot iterator that an earlier fit of this Trainer took"
          " batches from and then raised before it trained on them: it cannot hand those"
          " batches out again. Pass a new iterator that starts at the batch the data should"
          " start at, or a re-iterable (a list, or an object whose __iter__ starts over).")
    after_interruption = (self._at_loop_position_of is not None
                          and self._at_loop_position_of is train_data)
    continued = (carry is not None and carry.data is train_data
                 and carry.epochs == epoch_count(epochs) and can_continue)
    if continued:
      stream, remainder = carry.stream, carry.remainder
    else:
      start = position(after_interruption)
      if start.get("batch_in_flight"):
        # The run is not complete at the end of its data: its last batch's update is
        # still to run, and the run ends after it (as it would have, uninterrupted).
        at_end = "stop"
      stream = DataStream(
          train_data, epochs=epochs,
          batches_consumed=start.get("batches_consumed", 0),
          position=start.get("position"), epoch=start.get("epoch", 0), at_end=at_end,
      )
      if stream.resumed_at_end:
        _LOG.info(
            "the resumed data position (%d batches) is at the end of train_data: %s",
            start.get("batches_consumed", 0),
            "the data starts over, as the next fit of a Trainer whose data ended does."
            if at_end == "start_over" else
            "the run it continues is complete and nothing is left to train (pass a num_steps"
            " beyond the resumed step to train on: the data then starts over).")
      remainder = ()
    prefetcher = Prefetcher(stream, self._stage, depth=self._prefetch_depth,
                            workers=self._prefetch_workers,
                            start_index=stream.batches_consumed, remainder=remainder)
    return prefetcher, continued

  def consume(self) -> None:
    """Forgets what the last fit handed on: this fit's stream is open (its loop starts)."""
    self._carry, self._at_loop_position_of = None, None

  def spent(self, train_data: Iterable[Any]) -> None:
    """A fit took batches from the one-shot iterator `train_data` (a stream of its own, not
    a carried one), then raised before its loop started: a later fit given it refuses it,
    where it would silently start after the lost batches."""
    self._spent = train_data

  def drop_carry(self) -> None:
    """Forgets the carried stream: a fit took batches from it, then ended untrained.

    The next fit given that data starts at the loop's data position, as
    after a fit that raised once its loop ran (a one-shot iterator cannot go
    back there, and says so, where it would otherwise lose the batches taken).
    """
    carried = self._carry
    self._carry = None
    self._at_loop_position_of = None if carried is None else carried.data

  def hand_on(self, train_data: Iterable[Any], epochs: int | None, prefetcher: Prefetcher,
              unapplied: tuple[Prepared, ...], *, interrupted: bool, data_ended: bool,
              keep_stream: bool = True) -> None:
    """Keeps what the next fit continues from, at the end of a fit.

    A fit that stopped before its data ended has taken batches that it did
    not apply: `unapplied` (its first batch, when it trained nothing), the
    prefetched ones, and, pipelined, the one in flight (kept in the loop
    state). The next fit given the same data object continues that stream
    with them. Every process carries its stream, or none does.

    A fit that raised once its loop ran stopped too (`interrupted`): the
    loop state holds the batches taken so far. With `keep_stream` False (the
    stream broke, or the processes cannot agree any more) nothing is
    carried: the next fit starts at the loop's data position.
    """
    self._at_loop_position_of = train_data if interrupted and not data_ended else None
    self._carry = None
    if data_ended or not keep_stream:
      return
    remainder = prefetcher.close_and_keep()
    if remainder is None:
      _LOG.warning(
          "the data iterator did not return within 10 s after fit stopped; a later fit cannot"
          " continue its stream: it starts at the data position, iterating the data again and"
          " skipping the batches consumed (which a one-shot iterator cannot).")
    kept = remainder is not None
    if jax.process_count() > 1:
      kept = all(allgather_json("fit carries its data stream", kept))
    if kept:
      self._carry = _CarriedStream(train_data, epoch_count(epochs), prefetcher.iterator,
                                   unapplied + remainder.items)
