"""Step 2 of `_partition`: every device's distinct rows and its entries' unique indices.

Notation of `_batch`: G devices, N shards of R rows, V_s = N * R, B_loc local
samples per device, U distinct rows per partition (device g, shard n).

Entry e of sample b has device g = floor(b / B_loc) (entries are ordered by
b, so each device owns one range of them) and global row
row = key - b * V_s in shard n = floor(row / R). Per device, the distinct
rows come ascending from one pass over a [V_s] bitmap when V_s is small
next to the device's entries, else from a sort; u is a row's rank among
the distinct rows of its shard, and the entry's unique index is n * U + u (looked
up through a [V_s] table, so no per-entry division is needed). The C++
loops of `_native` use a bit map with per-word counts instead, which gives
the same distinct rows and ranks from the cache.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from sc_framework.preprocessing import _native
from sc_framework.preprocessing._scratch import arange32, clear_mask, scratch
from sc_framework.stacking import StackLayout

# The bitmap of step 2 is used while V_s <= _BITMAP_FACTOR * a device's entries
# (or V_s <= _BITMAP_MIN): then its linear scans cost less than a sort.
_BITMAP_FACTOR = 8
_BITMAP_MIN = 1 << 22


class _Rows(NamedTuple):
  """Step 2 for every device."""

  distinct: list[np.ndarray]  # per device: int64 ascending distinct global rows
  edges: np.ndarray  # int64 [G, N + 1]: shard n's rows are distinct[g][edges[g, n]:edges[g, n + 1]]
  counts: np.ndarray  # int64 [G, N]: entries per partition
  unique_index: np.ndarray  # int [n_e]: n * stride + u of every entry (scratch)
  stride: int  # U, or the largest distinct count if that is larger


def _distinct(rows: np.ndarray, v_s: int, out: np.ndarray,
              ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
  """(ascending distinct values of rows, their rank for every row or None for bitmap).

  out: int64 [rows.size] and ranks: int32 [rows.size], where the C++ loops
  (a bit map instead of the byte map) write the distinct values and ranks.
  """
  if v_s <= max(_BITMAP_FACTOR * rows.size, _BITMAP_MIN):
    kernels = _native.host_kernels()
    if kernels is not None and rows.size < 2**31:
      words = scratch("rank_words", -(-v_s // 64), np.uint64)
      return out[:kernels.rank_rows(rows, words, v_s, out, ranks)], ranks
    mark = clear_mask(v_s)
    distinct = None
    try:
      mark[rows] = True
      distinct = np.flatnonzero(mark)
    finally:
      if distinct is None:
        mark.fill(False)
      else:
        mark[distinct] = False
    return distinct, None
  order = np.argsort(rows)
  ordered = rows[order]
  new = np.empty(ordered.size, np.bool_)
  new[:1] = True
  np.not_equal(ordered[1:], ordered[:-1], out=new[1:])
  rank = np.empty(ordered.size, np.int64)
  rank[order] = np.cumsum(new) - 1
  return ordered[new], rank


def _locate_rows(rows: np.ndarray, bounds, v_s: int, r: int, n_count: int,
                 unique_capacity: int) -> _Rows:
  """Step 2: distinct rows, counts and unique indices of every device's entries."""
  g_count = len(bounds) - 1
  # Device g's distinct rows (at most its entries) may go to out[bounds[g]:bounds[g + 1]].
  out = scratch("distinct", rows.size, np.int64)
  ranks = scratch("ranks", rows.size, np.int32)
  found = [_distinct(rows[bounds[g]:bounds[g + 1]], v_s, out[bounds[g]:bounds[g + 1]],
                     ranks[bounds[g]:bounds[g + 1]])
           for g in range(g_count)]
  return _index_rows(found, rows, bounds, v_s, r, n_count, unique_capacity)


def _index_rows(found: list[tuple[np.ndarray, np.ndarray | None]], rows: np.ndarray, bounds,
                v_s: int, r: int, n_count: int, unique_capacity: int) -> _Rows:
  """Step 2 from every device's (ascending distinct rows, ranks or None) (`_distinct`)."""
  g_count = len(bounds) - 1
  shard_starts = np.arange(n_count + 1, dtype=np.int64) * r
  edges = np.stack([np.searchsorted(distinct, shard_starts) for distinct, _ in found])
  unique_counts = np.diff(edges, axis=1)
  stride = max(unique_capacity, int(unique_counts.max(initial=0)))
  dtype = np.int32 if n_count * stride < 2**31 else np.int64
  unique_index = scratch("unique_index", rows.size, dtype)
  counts = np.zeros((g_count, n_count), np.int64)
  for g, (distinct, rank) in enumerate(found):
    lo, hi = bounds[g], bounds[g + 1]
    # unique index of the j-th distinct row, in shard n: n * stride + j - edges[g, n].
    values = arange32(distinct.size).astype(dtype, copy=False)
    if n_count > 1:
      shift = np.arange(n_count, dtype=np.int64) * stride - edges[g, :-1]
      values = values + np.repeat(shift, unique_counts[g]).astype(dtype)
    if rank is None:
      index = scratch("index", v_s, dtype)
      index[distinct] = values
      index.take(rows[lo:hi], mode="clip", out=unique_index[lo:hi])
    elif n_count == 1:  # values[j] = j
      unique_index[lo:hi] = rank
    else:
      np.take(values, rank, out=unique_index[lo:hi])
    if n_count == 1:
      counts[g, 0] = hi - lo
    else:
      counts[g] = np.bincount(unique_index[lo:hi] // stride, minlength=n_count)
  return _Rows([d for d, _ in found], edges, counts, unique_index, stride)


def _device_bounds(samples: np.ndarray, g_count: int, local_batch: int):
  """Device g's entries are [bounds[g], bounds[g + 1]) (samples ascend)."""
  if g_count == 1:
    return [0, samples.size]
  return np.searchsorted(samples, np.arange(g_count + 1, dtype=samples.dtype) * local_batch)


def _one_pass_drop(kernels, stack: StackLayout, bounds) -> bool:
  """Whether `_locate_within_limits` applies: C++ loops, and every device's
  distinct rows would come from the bit map (`_distinct`)."""
  if kernels is None:
    return False
  sizes = np.diff(bounds)
  return bool((sizes < 2**31).all() and (
      stack.vocabulary_size <= np.maximum(_BITMAP_FACTOR * sizes, _BITMAP_MIN)).all())
