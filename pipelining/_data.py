"""The training data stream: epochs, the data position, and resuming it.

A batch is a mapping with keys
  "sparse":  feature name -> ids in any form `sc_framework.preprocessing`
             accepts (dense [B, L] array, ragged rows, RaggedIds, SparseIds,
             DenseIds with weights, ...);
  "dense":   the dense features (an array [B, F] or any pytree of arrays
             with leading dimension B), passed to the model;
  "labels":  the labels (array or pytree with leading dimension B), passed
             to loss_fn; needed by fit and evaluate, ignored by predict.

Other entries are not read (a warning names each the first time it is seen).
Every batch is checked before it is preprocessed (`pipelining._batch_check`).

Data position. The stream counts the batches it has handed out
(`batches_consumed`, over all epochs). When the underlying iterator has
`get_state()` / `set_state(state)` (as grain's iterators do), its state is
recorded with every batch and restored on resume; otherwise a resumed stream
re-iterates the data from the start and skips the consumed batches, which
needs a re-iterable (a list, a dataset object whose __iter__ starts over),
not a one-shot iterator.

The checkpointed position also lists, under "skipped", the batches that were
not applied because their loss was not finite (`TrainerConfig.save_on_nonfinite`).

Several processes. Each process iterates its own data: its slice of every
global batch (B * P / G samples of a batch of B for its P devices, in order, see
`pipelining._placement`), the same number of batches on every process.
Checkpoints keep every process's iterator state; a job resumed with another
number of processes re-iterates and skips instead.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Iterator
from typing import Any, Literal

import jax

from pipelining._config import check_count
from pipelining._distributed import allgather_json


def encode_position(state: Any) -> Any:
  """Makes an iterator state JSON-safe (bytes become {"base64": ...})."""
  if isinstance(state, bytes):
    return {"base64": base64.b64encode(state).decode("ascii")}
  try:
    json.dumps(state)
  except TypeError as error:
    raise TypeError(
        "the data iterator's get_state() returned a value that is neither bytes nor JSON"
        f" serialisable ({type(state).__name__}); checkpoints store data positions as JSON."
    ) from error
  return state


def decode_position(state: Any) -> Any:
  if isinstance(state, dict) and set(state) == {"base64"}:
    return base64.b64decode(state["base64"])
  return state


class _ReadAhead:
  """An iterator with its next batch already read: hands that one out first.

  `get_state` gives the position before that batch until it is handed out,
  so the position recorded with every batch stays exact.
  """

  def __init__(self, first: Any, iterator: Iterator[Any], state_before: Any):
    self._first, self._pending = first, True
    self._iterator, self._state_before = iterator, state_before
    if callable(getattr(iterator, "get_state", None)):
      self.get_state = self._get_state

  def __iter__(self) -> "_ReadAhead":
    return self

  def __next__(self) -> Any:
    if self._pending:
      self._pending, first, self._first = False, self._first, None
      return first
    return next(self._iterator)

  def _get_state(self) -> Any:
    return self._state_before if self._pending else self._iterator.get_state()


def is_one_shot(data: Iterable[Any]) -> bool:
  """Whether `data` is an iterator that iterating again continues (not starts over)."""
  return hasattr(data, "__next__") and iter(data) is data


class DataStream:
  """Yields raw batches over `epochs` passes (None: one pass), resumable.

  Args:
    data: an iterable of batches.
    epochs: passes over the data; None means one pass. An epoch count > 1
      needs a re-iterable.
    batches_consumed: batches already consumed by an earlier run (resume).
    position: the iterator state recorded with the last consumed batch, or
      None.
    epoch: the epoch of the last consumed batch (resume).
    at_end: what a stream resumed at the end of its data (its last epoch)
      does: "stop" (it yields nothing: the run it continues is complete) or
      "start_over" (from the first batch, as the next fit of a Trainer whose
      data ended does; fit asks for it when num_steps asks for more steps).
      `resumed_at_end` tells that it was so.
  """

  def __init__(
      self,
      data: Iterable[Any],
      *,
      epochs: int | None = None,
      batches_consumed: int = 0,
      position: Any = None,
      epoch: int = 0,
      at_end: Literal["stop", "start_over"] = "stop",
  ):
    check_count("epochs", epochs, minimum=1, optional=True)
    if at_end not in ("stop", "start_over"):
      raise ValueError(f"at_end must be 'stop' or 'start_over', got {at_end!r}.")
    self._data = data
    self._epochs = 1 if epochs is None else epochs
    self.batches_consumed = batches_consumed
    self.epoch = epoch
    self.resumed_at_end = False
    self._iterator = self._open(batches_consumed, position)
    if self.epoch + 1 < self._epochs and is_one_shot(data):
      raise ValueError(
          f"epochs={self._epochs} needs re-iterable train_data (a list, or an object whose"
          " __iter__ starts over); got a one-shot iterator, which can make one pass only."
          " Pass epochs=1 (or None), or a re-iterable.")
    if batches_consumed:
      self._iterator = self._at_the_end(self._iterator, at_end)

  def _at_the_end(self, iterator: Iterator[Any], at_end: str) -> Iterator[Any]:
    """A resumed stream: whether it is at the end of its data, and then `at_end`.

    One batch is read ahead to tell, and handed out first; the position
    stays the one before it. A one-shot iterator cannot start over: it stays
    at its end.
    """
    get_state = getattr(iterator, "get_state", None)
    before = get_state() if callable(get_state) else None
    try:
      first = next(iterator)
    except StopIteration:
      if self.epoch + 1 < self._epochs:
        return iterator  # `__next__` opens the next epoch.
      self.resumed_at_end = True
      if at_end == "stop" or iter(self._data) is self._data:
        return iterator
      self.batches_consumed, self.epoch = 0, 0
      return iter(self._data)
    return _ReadAhead(first, iterator, before)

  def _open(self, batches_consumed: int, position: Any) -> Iterator[Any]:
    iterator = iter(self._data)
    if batches_consumed == 0:
      return iterator
    if position is not None and hasattr(iterator, "set_state"):
      iterator.set_state(decode_position(position))
      return iterator
    if iterator is self._data and hasattr(iterator, "set_state"):
      raise ValueError(
          f"cannot resume the data at batch {batches_consumed}: train_data is a one-shot"
          " iterator, and the checkpoint holds no iterator state for its set_state() (it was"
          " written while training on data without get_state(), e.g. a list). Pass the data"
          " the checkpoint was written with, or a re-iterable (a list, or an object whose"
          " __iter__ starts over), which resumes by skipping the batches consumed."
      )
    if iterator is self._data:
      raise ValueError(
          f"cannot resume the data at batch {batches_consumed}: train_data is a one-shot"
          " iterator without get_state()/set_state(). Pass a re-iterable (a list, or an object"
          " whose __iter__ starts over) or an iterator with get_state()/set_state()."
      )
    # Re-iterate from the start and skip what was consumed, over as many passes as the
    # run that consumed them made (a fit with epochs=3, resumed by one without epochs).
    passes = max(self._epochs, self.epoch + 1)
    skipped = 0
    epoch = 0
    while skipped < batches_consumed:
      try:
        next(iterator)
        skipped += 1
      except StopIteration:
        epoch += 1
        if skipped == 0 or epoch >= passes:
          raise ValueError(
              f"cannot resume the data at batch {batches_consumed}: it holds only {skipped}"
              " batches."
          ) from None
        iterator = iter(self._data)
    self.epoch = epoch
    return iterator

  def __iter__(self) -> "DataStream":
    return self

  def __next__(self) -> Any:
    while True:
      try:
        batch = next(self._iterator)
        break
      except StopIteration:
        if self.epoch + 1 >= self._epochs:
          raise
        if iter(self._data) is self._data:
          raise ValueError(
              "epochs > 1 needs re-iterable train_data; got a one-shot iterator."
          ) from None
        self.epoch += 1
        self._iterator = iter(self._data)
    self.batches_consumed += 1
    return batch

  def get_state(self) -> dict[str, Any]:
    """The position after the last batch handed out (JSON-safe)."""
    get_state = getattr(self._iterator, "get_state", None)
    position = encode_position(get_state()) if callable(get_state) else None
    return {"batches_consumed": self.batches_consumed, "epoch": self.epoch, "position": position}


def share_position(data_state: dict[str, Any]) -> dict[str, Any]:
  """The data state to checkpoint, with every process's iterator position.

  With several processes each reads its own slice of the data, so each has
  its own iterator state: they are gathered (a key-value exchange, not a
  device collective) into "process_positions", indexed by process id. The
  batch count and epoch are the same on every process.
  """
  if jax.process_count() == 1:
    return data_state
  positions = allgather_json("data position", data_state.get("position"))
  return {**data_state, "position": None, "process_positions": positions}


def own_position(data_state: dict[str, Any]) -> dict[str, Any]:
  """The data state of this process from a checkpointed one (see `share_position`).

  A checkpoint written by another number of processes keeps the batch count
  only: the resumed stream re-iterates and skips the consumed batches.
  """
  positions = data_state.get("process_positions")
  if positions is None:
    if jax.process_count() == 1 or data_state.get("position") is None:
      return data_state
    return {**data_state, "position": None}  # one process's position fits no other
  state = {k: v for k, v in data_state.items() if k != "process_positions"}
  state["position"] = (positions[jax.process_index()]
                       if len(positions) == jax.process_count() else None)
  return state
