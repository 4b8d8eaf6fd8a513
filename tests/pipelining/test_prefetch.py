"""The host prefetcher: order, errors, and continuing an iterator across prefetchers."""

from __future__ import annotations

import time

import numpy as np
import pytest

from pipelining._prefetch import Prefetcher, Prepared


def _prepare(raw, index):
  assert raw == index  # the index handed to prepare is the batch's position
  return raw * 10


def test_batches_come_out_in_order_once_then_the_end():
  with Prefetcher(iter(range(7)), _prepare, depth=2) as prefetcher:
    got = [(p.index, p.batch) for p in prefetcher]
  assert got == [(i, 10 * i) for i in range(7)]


def test_an_error_of_the_iterator_reaches_the_consumer_in_its_place():
  def items():
    yield 0
    yield 1
    raise KeyError("broken record 2")

  with Prefetcher(items(), _prepare, depth=3) as prefetcher:
    assert [next(prefetcher).batch, next(prefetcher).batch] == [0, 10]
    with pytest.raises(KeyError, match="broken record 2"):
      next(prefetcher)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("depth", [1, 3])
def test_a_stopped_prefetcher_hands_on_every_batch_it_took(seed, depth):
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
    prefetcher = Prefetcher(iterator, slow_prepare, depth=depth, start_index=start,
                            remainder=remainder)
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


def test_at_end_waits_for_the_next_item_and_leaves_it_to_be_handed_out():
  """`at_end` tells the end of the data apart from a batch or a failure, taking neither."""
  def items():
    yield 0
    yield 1
    raise KeyError("broken record 2")

  prefetcher = Prefetcher(items(), _prepare, depth=1)
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
  with Prefetcher(iter(range(2)), _prepare, depth=3) as prefetcher:
    assert [next(prefetcher).batch for _ in range(2)] == [0, 10]
    assert prefetcher.at_end() and prefetcher.at_end()
    with pytest.raises(StopIteration):
      next(prefetcher)
    assert prefetcher.at_end()
  with Prefetcher(iter(range(3)), _prepare, depth=1) as prefetcher:
    assert not prefetcher.at_end()
    kept = prefetcher.close_and_keep()
  assert [item.batch for item in kept.items if isinstance(item, Prepared)][0] == 0
