"""Host prefetch: prepares upcoming batches on a background thread.

The thread pulls raw batches from the user's iterator, preprocesses them and
copies them to the devices, keeping at most `depth` prepared batches in a
bounded queue, so host work overlaps device work. A thread (not a process
pool) is used because the preprocessing is vectorised numpy that releases the
GIL in its heavy loops and the prepared arrays must land in this process's
device buffers anyway.

Guarantees:
  * batches come out in order, each exactly once;
  * an exception raised by the iterator or by `prepare` is re-raised in the
    consumer, with its original traceback, when the consumer reaches it;
  * the end of the data is a clean StopIteration; `close()` stops the thread
    without hanging even if the consumer stops early.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple


class Prepared(NamedTuple):
  """A prepared batch and the iterator position right after it.

  Attributes:
    index: 0-based position of the batch in the stream.
    batch: the result of `prepare`.
    position: `iterator.get_state()` after pulling the batch, when the
      iterator has one; otherwise None.
  """

  index: int
  batch: Any
  position: Any


class _Failure(NamedTuple):
  error: BaseException


_END = object()


class Prefetcher:
  """Iterates prepared batches produced by a background thread.

  Args:
    iterator: the raw batches.
    prepare: (raw batch, its index) -> prepared batch (runs on the
      background thread; the index lets its errors name the batch).
    depth: the most prepared batches held at once (>= 1).
    start_index: the index of the first batch (for resumed streams).
  """

  def __init__(
      self,
      iterator: Iterator[Any],
      prepare: Callable[[Any, int], Any],
      *,
      depth: int = 2,
      start_index: int = 0,
  ):
    if depth < 1:
      raise ValueError(f"prefetch depth must be >= 1, got {depth}.")
    self._iterator = iterator
    self._prepare = prepare
    self._queue: queue.Queue = queue.Queue(maxsize=depth)
    self._stop = threading.Event()
    self._index = start_index
    self._finished = False
    self._thread = threading.Thread(target=self._run, name="sc-prefetch", daemon=True)
    self._thread.start()

  def _put(self, item) -> bool:
    while not self._stop.is_set():
      try:
        self._queue.put(item, timeout=0.1)
        return True
      except queue.Full:
        continue
    return False

  def _run(self) -> None:
    get_state = getattr(self._iterator, "get_state", None)
    index = self._index
    try:
      while not self._stop.is_set():
        try:
          raw = next(self._iterator)
        except StopIteration:
          break
        position = get_state() if callable(get_state) else None
        prepared = Prepared(index, self._prepare(raw, index), position)
        index += 1
        if not self._put(prepared):
          return
    except BaseException as error:  # surfaced to the consumer, never lost
      self._put(_Failure(error))
      return
    self._put(_END)

  def __iter__(self) -> "Prefetcher":
    return self

  def __next__(self) -> Prepared:
    if self._finished:
      raise StopIteration
    while True:
      try:
        item = self._queue.get(timeout=0.1)
        break
      except queue.Empty:
        if not self._thread.is_alive() and self._queue.empty():
          self._finished = True
          raise RuntimeError("the prefetch thread stopped without reporting; this is a bug.")
    if item is _END:
      self._finished = True
      raise StopIteration
    if isinstance(item, _Failure):
      self._finished = True
      raise item.error
    return item

  def close(self) -> None:
    """Stops the background thread (pending prepared batches are discarded)."""
    self._stop.set()
    self._thread.join(timeout=10)

  def __enter__(self) -> "Prefetcher":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
