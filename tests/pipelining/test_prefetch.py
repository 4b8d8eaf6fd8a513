"""The host prefetcher: order, errors, and continuing an iterator across prefetchers,
with one thread preparing the batches and with several."""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest

from pipelining._prefetch import Prefetcher, Prepared


def _prepare(raw, index):
  assert raw == index  # the index handed to prepare is the batch's position
  return raw * 10


WORKERS = [1, 3]


@pytest.mark.parametrize("workers", WORKERS)
def test_batches_come_out_in_order_once_then_the_end(workers):
  with Prefetcher(iter(range(7)), _prepare, depth=2, workers=workers) as prefetcher:
    got = [(p.index, p.batch) for p in prefetcher]
  assert got == [(i, 10 * i) for i in range(7)]


@pytest.mark.parametrize("workers", WORKERS)
def test_an_error_of_the_iterator_reaches_the_consumer_in_its_place(workers):
  def items():
    yield 0
    yield 1
    raise KeyError("broken record 2")

  with Prefetcher(items(), _prepare, depth=3, workers=workers) as prefetcher:
    assert [next(prefetcher).batch, next(prefetcher).batch] == [0, 10]
    with pytest.raises(KeyError, match="broken record 2"):
      next(prefetcher)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("depth", [1, 3])
@pytest.mark.parametrize("workers", WORKERS)
def test_a_stopped_prefetcher_hands_on_every_batch_it_took(seed, depth, workers):
  """Consumers that stop early, one after another on one iterator: each batch once, in order.

  A slow `prepare` makes the thread hold batches in every state when it is
  stopped: queued, prepared but not queued, being pulled.
  """
  rng = np.random.default_rng(seed)
  total = 40
  iterator = iter(range(total))

  def slow_prepare(raw, index):
    time.sleep(float(rng.uniform(0, 0.004)))
    return _prepare(raw, index)

  got, remainder, start = [], (), 0
  while True:
    prefetcher = Prefetcher(iterator, slow_prepare, depth=depth, workers=workers,
                            start_index=start, remainder=remainder)
    take = int(rng.integers(0, 6))
    ended = False
    for _ in range(take):
      try:
        got.append(next(prefetcher).batch)
      except StopIteration:
        ended = True
        break
    time.sleep(float(rng.uniform(0, 0.01)))
    kept = prefetcher.close_and_keep()
    assert kept is not None
    if ended:
      assert kept.at_end
      break
    remainder = kept.items
    # The index of the next batch pulled from `iterator`: after those handed on.
    start = len(got) + sum(isinstance(item, Prepared) for item in remainder)
  assert got == [10 * i for i in range(total)]


@pytest.mark.parametrize("workers", WORKERS)
def test_at_end_waits_for_the_next_item_and_leaves_it_to_be_handed_out(workers):
  """`at_end` tells the end of the data apart from a batch or a failure, taking neither."""
  def items():
    yield 0
    yield 1
    raise KeyError("broken record 2")

  prefetcher = Prefetcher(items(), _prepare, depth=1, workers=workers)
  assert not prefetcher.at_end() and not prefetcher.at_end()
  assert next(prefetcher).batch == 0
  assert not prefetcher.at_end()
  assert next(prefetcher).batch == 10
  assert not prefetcher.at_end()  # the failure is raised by next, in its place
  kept = prefetcher.close_and_keep()
  assert kept is not None and not kept.at_end
  following = Prefetcher(iter(()), _prepare, remainder=kept.items)
  with pytest.raises(KeyError, match="broken record 2"):
    next(following)
  with Prefetcher(iter(range(2)), _prepare, depth=3, workers=workers) as prefetcher:
    assert [next(prefetcher).batch for _ in range(2)] == [0, 10]
    assert prefetcher.at_end() and prefetcher.at_end()
    with pytest.raises(StopIteration):
      next(prefetcher)
    assert prefetcher.at_end()
  with Prefetcher(iter(range(3)), _prepare, depth=1, workers=workers) as prefetcher:
    assert not prefetcher.at_end()
    kept = prefetcher.close_and_keep()
  assert [item.batch for item in kept.items if isinstance(item, Prepared)][0] == 0


class _Tracked:
  """A prepare that records how many calls run at once and in which order they start."""

  def __init__(self, seed: int):
    self.rng = np.random.default_rng(seed)
    self.lock = threading.Lock()
    self.running = self.most_running = 0
    self.started: list[int] = []
    self.first_done = threading.Event()

  def __call__(self, raw, index):
    with self.lock:
      if index != 0:
        assert self.first_done.is_set(), f"batch {index} started before the first ended"
      self.started.append(index)
      self.running += 1
      self.most_running = max(self.most_running, self.running)
    time.sleep(float(self.rng.uniform(0.002, 0.02)))  # workers finish out of order
    with self.lock:
      self.running -= 1
    if index == 0:
      self.first_done.set()
    return _prepare(raw, index)


@pytest.mark.parametrize("seed", range(3))
def test_workers_prepare_batches_at_once_and_hand_them_out_in_order(seed):
  prepare = _Tracked(seed)
  with Prefetcher(iter(range(30)), prepare, depth=4, workers=3) as prefetcher:
    got = [(p.index, p.batch) for p in prefetcher]
  assert got == [(i, 10 * i) for i in range(30)]
  assert sorted(prepare.started) == list(range(30)) and prepare.started[0] == 0
  assert prepare.most_running > 1  # the pool did prepare several batches at once
  assert prepare.most_running <= 3


def test_one_worker_prepares_one_batch_at_a_time():
  prepare = _Tracked(0)
  with Prefetcher(iter(range(10)), prepare, depth=4) as prefetcher:
    assert [p.batch for p in prefetcher] == [10 * i for i in range(10)]
  assert prepare.most_running == 1 and prepare.started == list(range(10))


@pytest.mark.parametrize("workers", WORKERS)
def test_a_failing_prepare_is_raised_in_its_batchs_place(workers):
  def prepare(raw, index):
    time.sleep(0.01 if index < 3 else 0.0)  # later batches finish first
    if index == 3:
      raise ValueError("bad ids in batch 3")
    return _prepare(raw, index)

  with Prefetcher(iter(range(8)), prepare, depth=4, workers=workers) as prefetcher:
    assert [next(prefetcher).batch for _ in range(3)] == [0, 10, 20]
    with pytest.raises(ValueError, match="bad ids in batch 3"):
      next(prefetcher)
    assert prefetcher.failed
    with pytest.raises(StopIteration):
      next(prefetcher)


def test_close_drops_the_batches_not_started():
  """close() leaves the batches queued for the workers unprepared, and none starts after it."""
  started, pulled = [], []

  def items():
    for i in range(100):
      pulled.append(i)
      yield i

  def prepare(raw, index):
    started.append(index)
    if index:
      time.sleep(0.5)  # far longer than the consumer takes to close
    return _prepare(raw, index)

  prefetcher = Prefetcher(items(), prepare, depth=8, workers=2)
  assert next(prefetcher).batch == 0
  deadline = time.monotonic() + 30
  while len(pulled) < 10 and time.monotonic() < deadline:  # 8 queued, 1 held by the puller
    time.sleep(0.001)
  assert len(pulled) == 10
  prefetcher.close()
  count = len(started)
  time.sleep(0.1)
  assert len(started) == count  # nothing started after close
  assert count < len(pulled)  # the queued batches that no worker had started were dropped


@pytest.mark.parametrize("workers", [0, -1])
def test_workers_must_be_at_least_one(workers):
  with pytest.raises(ValueError, match=f"prefetch workers must be >= 1, got {workers}"):
    Prefetcher(iter(()), _prepare, workers=workers)


def _wait_until(condition, seconds=30.0) -> None:
  deadline = time.monotonic() + seconds
  while not condition() and time.monotonic() < deadline:
    time.sleep(0.001)
  assert condition()


@pytest.mark.parametrize("workers", WORKERS)
def test_close_on_the_prefetchers_own_thread_stops_it_without_joining_that_thread(workers):
  """close() called by prepare: on the pulling thread (1 worker) or a pool worker (3)."""
  errors, box, built = [], {}, threading.Event()

  def prepare(raw, index):
    if index == 2:
      assert built.wait(timeout=30)
      try:
        box["prefetcher"].close()
      except BaseException as error:  # noqa: BLE001 - what a thread cannot join raises
        errors.append(error)
    return raw

  prefetcher = box["prefetcher"] = Prefetcher(iter(range(100)), prepare, depth=2, workers=workers)
  built.set()
  assert next(prefetcher).batch == 0
  _wait_until(lambda: not prefetcher._thread.is_alive())
  assert errors == []
  prefetcher.close()


@pytest.mark.parametrize("workers", WORKERS)
def test_an_abandoned_consumer_collected_on_a_prefetch_thread_closes_it_quietly(
    workers, monkeypatch):
  """A consumer generator left suspended inside `with Prefetcher` (it stopped early) and
  held in a reference cycle is finalized by whichever thread the garbage collector runs
  on: here the prefetcher's own, which must not try to join itself."""
  unraisable, dropped, box = [], threading.Event(), {}
  monkeypatch.setattr("sys.unraisablehook", unraisable.append)

  def prepare(raw, index):
    if index == 3:
      assert dropped.wait(timeout=30)
      gc.collect()  # finalizes the abandoned consumer, on this thread
    return raw

  def consume():
    with Prefetcher(iter(range(100)), prepare, depth=2, workers=workers) as prefetcher:
      box["prefetcher"] = prefetcher
      for prepared in prefetcher:
        yield prepared.batch

  gc_was_enabled = gc.isenabled()
  gc.disable()  # only the prefetch thread's collect may finalize the consumer
  try:
    consumer = consume()
    assert next(consumer) == 0
    cycle = {"consumer": consumer}
    cycle["self"] = cycle
    del consumer, cycle
    dropped.set()
    prefetcher = box["prefetcher"]
    _wait_until(lambda: not prefetcher._thread.is_alive())
  finally:
    if gc_was_enabled:
      gc.enable()
  assert [f"{u.exc_type.__name__}: {u.exc_value}" for u in unraisable] == []
  assert prefetcher._stop.is_set()  # the finalized consumer closed it
