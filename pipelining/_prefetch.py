"""Host prefetch: prepares upcoming batches on background threads.

A thread pulls raw batches from the user's iterator, preprocesses them and
copies them to the devices, keeping at most `depth` prepared batches in a
bounded queue, so host work overlaps device work. With `workers` > 1 it hands
each batch's preparation to a pool of that many threads instead, so that up
to `workers` batches are prepared at once (on a host with cores to spare: an
accelerator's host, whose device step is far shorter than the preprocessing
of its batch). Threads (not processes) are used because the preprocessing is
vectorised numpy and C++ loops that release the GIL, and the prepared arrays
must land in this process's device buffers anyway.

Guarantees (for any `workers`):
  * batches come out in order, each exactly once; the iterator is pulled by
    one thread, in order, and with `workers` > 1 the first batch is prepared
    before any other starts (what `prepare` records from a first batch comes
    from it);
  * an exception raised by the iterator or by `prepare` is re-raised in the
    consumer, with its original traceback, when the consumer reaches it;
  * the end of the data is a clean StopIteration; `close()` stops the thread
    without hanging even if the consumer stops early;
  * `close_and_keep()` also returns what was taken from the iterator but not
    handed out (a `Remainder`), so that a later Prefetcher on the same
    iterator continues exactly where the consumer stopped: no batch is lost;
  * `at_end()` says whether the data ended, without handing out (or raising)
    the next item;
  * an iterator may refill the same arrays for every batch (a loader with
    preallocated buffers): `prepare` runs before the next pull, and with
    `workers` > 1, where the next batch is pulled while this one is
    prepared, a worker gets a copy of the batch's numpy arrays (`detached`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np


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


class _Pending(NamedTuple):
  """A batch being prepared by a worker: Prepared once `future` is done."""

  index: int
  future: concurrent.futures.Future
  position: Any

  def resolved(self) -> Prepared | _Failure:
    """The Prepared batch or the failure of its `prepare` (waits for it)."""
    try:
      return Prepared(self.index, self.future.result(), self.position)
    except BaseException as error:  # surfaced to the consumer, never lost
      return _Failure(error)


_END = object()
# How long close() waits for the pulling thread, which may be inside the user's iterator.
JOIN_TIMEOUT_S = 10.0


class Remainder(NamedTuple):
  """What a stopped Prefetcher took from its iterator but did not hand out.

  Attributes:
    items: in order: prepared batches, then possibly the end of the data or
      the iterator's failure, to be reported by the next Prefetcher.
  """

  items: tuple[Any, ...]

  @property
  def at_end(self) -> bool:
    """Whether nothing is left: the next item is the end of the data."""
    return bool(self.items) and self.items[0] is _END


def detached(raw: Any) -> Any:
  """`raw` with a copy of every numpy array in it, so that its source may change.

  Arrays are found at any depth of the pytree (dicts, lists, tuples, ...; the
  containers are rebuilt as jax.tree does) and inside the dataclass instances
  at its leaves (the id forms `DenseIds`, `RaggedIds`, ...), and in mappings
  jax.tree takes for leaves (rebuilt as dicts); the elements of an object
  array (per-sample id arrays) are copied too. Anything else (jax arrays,
  which never change, scalars, other array types) is kept as is.
  """
  return jax.tree.map(_detached_leaf, raw)


def _detached_leaf(leaf: Any) -> Any:
  if isinstance(leaf, Mapping):  # one jax.tree does not enter (a dict subclass, a proxy)
    return {key: detached(value) for key, value in leaf.items()}
  if isinstance(leaf, np.ndarray):
    copy = leaf.copy()
    if leaf.dtype == object:
      for position, element in enumerate(leaf.flat):
        copy.flat[position] = detached(element)
    return copy
  if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
    return dataclasses.replace(leaf, **{
        field.name: detached(getattr(leaf, field.name))
        for field in dataclasses.fields(leaf) if field.init})
  return leaf


class Prefetcher:
  """Iterates prepared batches produced by background threads.

  Args:
    iterator: the raw batches.
    prepare: (raw batch, its index) -> prepared batch (runs on a background
      thread; the index lets its errors name the batch). With `workers` > 1
      it runs on several threads at once, for different batches, and must
      be thread-safe.
    depth: the most batches held at once, prepared or being prepared (>= 1).
    workers: threads preparing batches at once (>= 1); more than `depth` + 1
      cannot all be busy.
    start_index: the index of the first batch pulled from `iterator` (for
      resumed streams).
    remainder: `Remainder.items` of an earlier Prefetcher on the same
      iterator, handed out first; the thread pulls from `iterator` only once
      they are, so batches taken but not handed out never exceed what one
      Prefetcher holds (`depth` + 1) or the remainder.
  """

  def __init__(
      self,
      iterator: Iterator[Any],
      prepare: Callable[[Any, int], Any],
      *,
      depth: int = 2,
      workers: int = 1,
      start_index: int = 0,
      remainder: Sequence[Any] = (),
  ):
    if depth < 1:
      raise ValueError(f"prefetch depth must be >= 1, got {depth}.")
    if workers < 1:
      raise ValueError(f"prefetch workers must be >= 1, got {workers}.")
    self._own_threads: set[int] = set()  # idents of the pulling thread and the workers
    self._pool = (concurrent.futures.ThreadPoolExecutor(
        workers, thread_name_prefix="sc-prepare", initializer=self._register_thread)
                  if workers > 1 else None)
    self._iterator = iterator
    self._prepare = prepare
    self._remainder = collections.deque(remainder)
    self._queue: queue.Queue = queue.Queue(maxsize=depth)
    self._stop = threading.Event()
    self._index = self._start_index = start_index
    self._finished = False
    self._failed = False
    self._closed = False
    self._unplaced: list[Any] = []  # an item the thread could not queue before stopping
    self._remainder_out = threading.Event()  # every remainder item was handed out
    if not self._remainder:
      self._remainder_out.set()
    ended = any(item is _END or isinstance(item, _Failure) for item in self._remainder)
    self._thread = threading.Thread(target=self._run, name="sc-prefetch", daemon=True)
    if ended:  # the iterator has nothing more to give
      self._stop.set()
    self._thread.start()

  def _register_thread(self) -> None:
    self._own_threads.add(threading.get_ident())

  def _on_own_thread(self) -> bool:
    """Whether the caller is this Prefetcher's pulling thread or one of its workers.

    close() can run there: a garbage collection on that thread may finalize
    an abandoned generator that holds this Prefetcher (a consumer that
    stopped early). A thread cannot join itself, so close() then only
    signals the threads to stop.
    """
    return threading.get_ident() in self._own_threads

  def _put(self, item) -> bool:
    while not self._stop.is_set():
      try:
        self._queue.put(item, timeout=0.1)
        return True
      except queue.Full:
        continue
    self._unplaced.append(item)
    return False

  def _run(self) -> None:
    self._register_thread()
    get_state = getattr(self._iterator, "get_state", None)
    index = self._index
    while not self._remainder_out.wait(timeout=0.1):
      if self._stop.is_set():
        return
    try:
      while not self._stop.is_set():
        try:
          raw = next(self._iterator)
        except StopIteration:
          self._put(_END)
          return
        position = get_state() if callable(get_state) else None
        if self._pool is None or index == self._index:
          prepared = Prepared(index, self._prepare(raw, index), position)
        else:  # The iterator may refill its arrays for the next batch, pulled meanwhile.
          prepared = _Pending(index, self._pool.submit(self._prepare, detached(raw), index),
                              position)
        index += 1
        if not self._put(prepared):
          return
    except BaseException as error:  # surfaced to the consumer, never lost
      self._put(_Failure(error))
    # Stopped (close): the iterator may hold more; nothing marks an end.

  @property
  def failed(self) -> bool:
    """Whether the consumer got a failure of the iterator or of `prepare` (the stream broke)."""
    return self._failed

  @property
  def start_index(self) -> int:
    """The stream position of the first batch taken from `iterator`."""
    return self._start_index

  @property
  def iterator(self) -> Iterator[Any]:
    """The iterator the batches are taken from."""
    return self._iterator

  def __iter__(self) -> "Prefetcher":
    return self

  def __next__(self) -> Prepared:
    if self._finished:
      raise StopIteration
    if self._remainder:
      item = self._remainder.popleft()
      if not self._remainder:
        self._remainder_out.set()
      return self._handed_out(item)
    return self._handed_out(self._get())

  def at_end(self) -> bool:
    """Whether the data ended here: waits for the next item without handing it out.

    A batch, or a failure of the iterator or of `prepare`, stays to be
    handed out (or raised) by the next `next`, or kept by `close_and_keep`.
    """
    if self._finished:
      return True
    if not self._remainder:
      self._remainder.append(self._get())  # the thread pulls on: it is handed out first
    return self._remainder[0] is _END

  def _get(self) -> Any:
    """The next item the thread queued (waits for it)."""
    while True:
      try:
        return self._queue.get(timeout=0.1)
      except queue.Empty:
        if not self._thread.is_alive() and self._queue.empty():
          self._finished = True
          raise RuntimeError("the prefetch thread stopped without reporting; this is a bug.")

  def _handed_out(self, item) -> Prepared:
    if isinstance(item, _Pending):
      item = item.resolved()
    if item is _END:
      self._finished = True
      raise StopIteration
    if isinstance(item, _Failure):
      self._finished = self._failed = True
      raise item.error
    return item

  def close(self, *, wait_s: float = JOIN_TIMEOUT_S) -> None:
    """Stops the background thread (pending prepared batches are discarded).

    Waits up to `wait_s` seconds for it (it may be inside the iterator), on
    the first call only: a thread stuck there is not waited for twice. An
    abort (a second Ctrl-C) passes 0. Called on one of the Prefetcher's own
    threads, it waits for none of them.
    """
    self._stop_thread(wait_s)
    if self._pool is not None:  # batches not started are dropped; running ones end
      self._pool.shutdown(wait=not self._on_own_thread(), cancel_futures=True)

  def _stop_thread(self, wait_s: float = JOIN_TIMEOUT_S) -> None:
    """Stops the pulling thread, waiting up to `wait_s` for it on the first call only."""
    self._stop.set()
    if not self._closed and not self._on_own_thread():
      self._closed = True
      self._thread.join(timeout=wait_s)

  def close_and_keep(self) -> Remainder | None:
    """Stops the thread; returns what it took from the iterator and did not hand out.

    None when the thread did not stop in time (it is still inside the
    iterator, which then cannot be handed to another Prefetcher).
    """
    self._stop_thread()  # the workers go on: the batches taken are kept prepared
    if self._thread.is_alive():
      self.close()
      return None
    items = list(self._remainder)
    while True:
      try:
        items.append(self._queue.get_nowait())
      except queue.Empty:
        break
    items.extend(self._unplaced)
    items = [item.resolved() if isinstance(item, _Pending) else item for item in items]
    self.close()
    if self._finished:
      items = [_END]  # the consumer saw the end (or a failure) already
    return Remainder(tuple(items))

  def __enter__(self) -> "Prefetcher":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
