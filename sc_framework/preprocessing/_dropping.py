"""Step 3 of `_partition`: the entries kept when a batch overflows its capacities.

Notation of `_batch` and `_locate`. A partition may hold C entries and U
distinct rows. Overflow raises, or with dropping enabled removes, in every
partition:
  (a) every entry whose row is not among the first U distinct rows of the
      partition, rows ordered by their first entry in (sample, row) order;
  (b) then every entry after the first C remaining ones, in (sample, row)
      order; so later samples lose their ids first.
The result is exactly the batch without the dropped ids: combiner factors
are recomputed over the kept ids (`_partition`), and rows left without
entries are not requested. The kept entries come from linear passes without
a sort and the kept rows' unique indices from step 2's result (`_drop`).
With dropping allowed, the C++ loops apply the rules inside step 2's bit-map
pass instead (`_locate_within_limits`): an overflowing batch then takes the
same passes as one within its limits.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from sc_framework.preprocessing import _native
from sc_framework.preprocessing._locate import _device_bounds, _index_rows, _Rows
from sc_framework.preprocessing._scratch import arange32, scratch
from sc_framework.preprocessing._stats import StackCapacity
from sc_framework.stacking import StackLayout


def _exclusive_cumsum(counts: np.ndarray) -> np.ndarray:
  out = np.zeros(counts.size, np.int64)
  np.cumsum(counts[:-1], out=out[1:])
  return out


def _nth_per_partition(mask: np.ndarray, parts: np.ndarray | None, num_parts: int,
                       n: int) -> np.ndarray:
  """Per partition p, the index of the n-th (1-based) True of `mask` in p.

  parts: the partition of every index, or None for one partition. Returns
  int64 [num_parts]; a partition with at most n Trues gets the largest int64
  (nothing of it lies beyond its n-th True).
  """
  out = np.full(num_parts, np.iinfo(np.int64).max, np.int64)
  size = mask.size
  grouped = parts is None or not np.less(parts[1:], parts[:-1],
                                         out=scratch("drop_step", max(size - 1, 0), np.bool_)).any()
  if grouped:
    # Partitions are ranges [lo_p, hi_p): with seen[k] = Trues before index k,
    # p's n-th True is at the first k with seen[k + 1] = seen[lo_p] + n.
    dtype = np.int32 if size < 2**31 else np.int64
    seen = scratch("drop_seen", size + 1, dtype)
    seen[0] = 0
    np.cumsum(mask, dtype=dtype, out=seen[1:])
    edges = (np.array([0, size]) if parts is None
             else np.searchsorted(parts, np.arange(num_parts + 1)))
    before = seen[edges[:-1]]
    over = np.flatnonzero(seen[edges[1:]] - before > n)
    out[over] = np.searchsorted(seen, before[over] + n) - 1
    return out
  items = np.flatnonzero(mask)
  item_parts = parts[items]
  counts = np.bincount(item_parts, minlength=num_parts)
  over = np.flatnonzero(counts > n)
  if over.size:
    # A stable counting (radix) sort when the partition fits 16 bits.
    small = item_parts.astype(np.uint16) if num_parts <= 1 << 16 else item_parts
    order = np.argsort(small, kind="stable")
    out[over] = items[order[_exclusive_cumsum(counts)[over] + (n - 1)]]
  return out


class _Numbered(NamedTuple):
  """The entries' rows numbered over all partitions (step 3).

  Partition p = g * N + n holds the distinct rows offsets[p] ... offsets[p + 1] - 1,
  in the order of `_Rows` (ascending); entry e's row is ids[e], in parts[e].
  """

  ids: np.ndarray  # int64 [n_e] (scratch)
  parts: np.ndarray | None  # int64 [n_e] (scratch); None when there is one partition
  offsets: np.ndarray  # int64 [P + 1]


def _number_rows(located: _Rows, bounds, n_count: int) -> _Numbered:
  """Numbers the located rows 0 ... (distinct rows of all partitions) - 1."""
  g_count = len(bounds) - 1
  num_parts, stride = g_count * n_count, located.stride
  offsets = np.zeros(num_parts + 1, np.int64)
  offsets[1:] = np.cumsum(np.diff(located.edges, axis=1).reshape(-1))
  size = located.unique_index.size
  ids = scratch("drop_ids", size, np.int64)  # numpy indexes faster with int64 than int32
  if num_parts == 1:
    ids[...] = located.unique_index
    return _Numbered(ids, None, offsets)
  parts = scratch("drop_parts", size, np.int64)
  for g in range(g_count):
    lo, hi = bounds[g], bounds[g + 1]
    unique_index = located.unique_index[lo:hi]
    # unique index n * stride + u -> offsets[g * N + n] + u.
    shard = np.floor_divide(unique_index, stride, out=parts[lo:hi])
    shift = offsets[g * n_count:(g + 1) * n_count] - np.arange(n_count) * stride
    np.take(shift, shard, mode="clip", out=ids[lo:hi])
    ids[lo:hi] += unique_index
    shard += g * n_count
  return _Numbered(ids, parts, offsets)


def _drop_mask(rows: _Numbered, capacity: StackCapacity) -> np.ndarray:
  """Step 3 (numpy): bool [n_e] (scratch), the entries kept by rules (a) and (b).

  Entries come in (sample, row) order. Linear passes, no sort of the
  entries: the first entry of every row is the minimum entry index over its
  entries (first[row]). Rule (a) keeps the rows with first[row] <= T_p, T_p
  the first entry of partition p's U-th row in first-entry order (the U-th
  entry e of p with first[row_e] = e); rule (b) then keeps the remaining
  entries e <= S_p, S_p partition p's C-th remaining entry. A partition
  within a limit has T_p (S_p) = infinity.
  """
  ids, parts = rows.ids, rows.parts
  num_parts, size = rows.offsets.size - 1, ids.size
  index = arange32(size) if size < 2**31 else np.arange(size)
  first = scratch("drop_first", int(rows.offsets[-1]), index.dtype)
  first.fill(size)
  np.minimum.at(first, ids, index)
  first_of_entry = np.take(first, ids, mode="clip",
                           out=scratch("drop_first_of_entry", size, index.dtype))
  limit = scratch("drop_limit", size, np.int64)

  def per_entry(values: np.ndarray):
    return values[0] if parts is None else np.take(values, parts, mode="clip", out=limit)

  keep = scratch("drop_keep", size, np.bool_)
  starts = np.equal(first_of_entry, index, out=keep)  # the entries that start a row
  last_start = _nth_per_partition(starts, parts, num_parts, capacity.max_unique_ids_per_partition)
  np.less_equal(first_of_entry, per_entry(last_start), out=keep)
  last_entry = _nth_per_partition(keep, parts, num_parts, capacity.max_ids_per_partition)
  if (last_entry < size).any():
    in_first = np.less_equal(index, per_entry(last_entry), out=scratch("drop_in", size, np.bool_))
    np.logical_and(keep, in_first, out=keep)
  return keep


def _kept_rows(located: _Rows, rows: _Numbered, keep: np.ndarray, n_count: int,
               unique_capacity: int) -> _Rows:
  """Step 2 (numpy) for the entries kept by `keep`, from `located` (before dropping).

  A row stays when any of its entries does; its new rank u' counts the rows
  that stay before it in its partition, so a kept entry's unique index becomes
  n * U + u' (after dropping, no partition holds more than U rows).
  """
  g_count = located.edges.shape[0]
  offsets = rows.offsets
  num_parts, num_rows = offsets.size - 1, int(offsets[-1])
  dtype = np.int32 if max(n_count * unique_capacity, num_rows) < 2**31 else np.int64
  kept = rows.ids[keep]
  alive = scratch("drop_alive", num_rows, np.bool_)
  alive.fill(False)
  alive[kept] = True
  unique_index, unique_counts = _kept_unique_index(rows, kept, alive, n_count, unique_capacity,
                                                   dtype)
  distinct = [
      located.distinct[g][alive[offsets[g * n_count]:offsets[(g + 1) * n_count]]]
      for g in range(g_count)
  ]
  edges = np.zeros((g_count, n_count + 1), np.int64)
  np.cumsum(unique_counts, axis=1, out=edges[:, 1:])
  if rows.parts is None:
    counts = np.full((1, 1), unique_index.size, np.int64)
  else:
    counts = np.bincount(rows.parts[keep], minlength=num_parts).reshape(g_count, n_count)
  return _Rows(distinct, edges, counts, unique_index, unique_capacity)


class _Dropped(NamedTuple):
  """Step 3's result: the kept entries, and step 2 for them."""

  keep: np.ndarray  # bool [n_e]: the entries kept (scratch)
  samples: np.ndarray  # int32 [k]: the kept entries' samples, ascending
  weights: np.ndarray | None  # float32 [k]: their weights, or None (all ones)
  bounds: np.ndarray  # [G + 1]: device g's kept entries are [bounds[g], bounds[g + 1])
  located: _Rows  # the kept entries' rows; stride U


def _drop(samples: np.ndarray, entry_weights: np.ndarray | None, bounds, located: _Rows,
          capacity: StackCapacity, n_count: int, local_batch: int) -> _Dropped:
  """Step 3: the entries kept by rules (a) and (b), compacted, and their rows.

  With the C++ loops one kernel call per device (`_drop_native`), else
  numpy (`_drop_mask`, `_kept_rows`); both give the same arrays.
  """
  u_cap = capacity.max_unique_ids_per_partition
  kernels = _native.host_kernels()
  if (kernels is not None and located.unique_index.dtype == np.int32
      and n_count * u_cap < 2**31):  # the kernel's int32 bounds
    return _drop_native(kernels, samples, entry_weights, bounds, located, capacity, n_count)
  numbered = _number_rows(located, bounds, n_count)
  keep = _drop_mask(numbered, capacity)
  kept_samples = samples[keep]
  return _Dropped(
      keep, kept_samples, None if entry_weights is None else entry_weights[keep],
      _device_bounds(kept_samples, len(bounds) - 1, local_batch),
      _kept_rows(located, numbered, keep, n_count, u_cap),
  )


def _drop_native(kernels, samples, entry_weights, bounds, located: _Rows,
                 capacity: StackCapacity, n_count: int) -> _Dropped:
  """`_drop` with the C++ loops: `drop_device` (see `_native`) for every device.

  Device g's kept entries go right after those of devices 0 ... g - 1 (never
  past its own entries), its kept rows likewise after theirs.
  """
  g_count, size = len(bounds) - 1, samples.size
  sizes = [d.size for d in located.distinct]
  keep = scratch("drop_keep", size, np.bool_)
  kept_samples = scratch("drop_samples", size, np.int32)
  kept_weights = None if entry_weights is None else scratch("drop_weights", size, np.float32)
  unique_index = scratch("drop_unique_index", size, np.int32)
  rows = scratch("drop_distinct", sum(sizes), np.int64)
  words = scratch("drop_words", max(sizes) // 64 + 1, np.uint64)
  counts = np.empty((g_count, n_count), np.int64)
  unique_counts = np.empty((g_count, n_count), np.int64)
  kept_bounds = np.zeros(g_count + 1, np.int64)
  distinct = []
  row_at = 0
  for g in range(g_count):
    lo, hi, at = int(bounds[g]), int(bounds[g + 1]), int(kept_bounds[g])
    out = slice(at, at + hi - lo)
    device_rows = rows[row_at:row_at + sizes[g]]
    kept = kernels.drop_device(
        located.unique_index[lo:hi], located.stride, located.edges[g],
        capacity.max_unique_ids_per_partition, capacity.max_ids_per_partition, samples[lo:hi],
        None if entry_weights is None else entry_weights[lo:hi], located.distinct[g], words,
        keep[lo:hi], kept_samples[out], None if kept_weights is None else kept_weights[out],
        unique_index[out], device_rows, counts[g], unique_counts[g])
    kept_bounds[g + 1] = at + kept
    distinct.append(device_rows[:int(unique_counts[g].sum())])
    row_at += sizes[g]
  total = int(kept_bounds[-1])
  edges = np.zeros((g_count, n_count + 1), np.int64)
  np.cumsum(unique_counts, axis=1, out=edges[:, 1:])
  return _Dropped(
      keep, kept_samples[:total], None if kept_weights is None else kept_weights[:total],
      kept_bounds,
      _Rows(distinct, edges, counts, unique_index[:total], capacity.max_unique_ids_per_partition),
  )


def _kept_unique_index(rows: _Numbered, kept: np.ndarray, alive: np.ndarray, n_count: int,
                       unique_capacity: int, dtype) -> tuple[np.ndarray, np.ndarray]:
  """(unique index n * U + u' of every kept entry, staying rows per partition [G, N]).

  kept: the numbered row of every kept entry; alive: bool, the rows kept.
  """
  offsets = rows.offsets
  num_parts, num_rows = offsets.size - 1, int(offsets[-1])
  # seen[j]: staying rows among rows 0 ... j - 1; row j of partition p has
  # u' = seen[j] - seen[offsets[p]] and its unique index n * U + u'.
  seen = scratch("drop_unique_of", num_rows + 1, dtype)
  seen[0] = 0
  np.cumsum(alive, dtype=dtype, out=seen[1:])
  before = seen[offsets[:-1]].astype(np.int64)
  unique_counts = (seen[offsets[1:]] - before).reshape(-1, n_count)
  shift = np.arange(num_parts, dtype=np.int64) % n_count * unique_capacity - before
  unique_of = seen[:-1]
  unique_of += shift[0] if num_parts == 1 else np.repeat(shift.astype(dtype), np.diff(offsets))
  unique_index = np.take(
      unique_of, kept, mode="clip", out=scratch("drop_unique_index", kept.size, dtype)
  )
  return unique_index, unique_counts


def _locate_within_limits(kernels, stack: StackLayout, samples: np.ndarray, rows: np.ndarray,
                          entry_weights: np.ndarray | None, bounds, capacity: StackCapacity
                          ) -> tuple[np.ndarray, np.ndarray, _Dropped]:
  """Steps 2 and 3 in one C++ pass per device (`rank_kept_rows`, see `_native`).

  Returns (entries [G, N], distinct rows [G, N] per partition before any
  dropping, the kept entries): what `_locate_rows` and then `_drop` give. The
  kept entries' rows and samples move to the front of `rows` and `samples`
  (in place; nothing moves when nothing is dropped).
  """
  g_count, n_count = len(bounds) - 1, stack.num_shards
  v_s, u_cap = stack.vocabulary_size, capacity.max_unique_ids_per_partition
  size = rows.size
  keep = scratch("drop_keep", size, np.bool_)
  kept_weights = None if entry_weights is None else scratch("drop_weights", size, np.float32)
  out = scratch("distinct", size, np.int64)
  ranks = scratch("ranks", size, np.int32)
  words = scratch("rank_words", 2 * (v_s // 64 + 1), np.uint64)
  counts = np.empty((g_count, n_count), np.int64)
  unique_counts = np.empty((g_count, n_count), np.int64)
  kept_bounds = np.zeros(g_count + 1, np.int64)
  found = []
  for g in range(g_count):
    lo, hi, at = int(bounds[g]), int(bounds[g + 1]), int(kept_bounds[g])
    into = slice(at, at + hi - lo)
    kept, distinct = kernels.rank_kept_rows(
        rows[lo:hi], rows[into], samples[lo:hi], samples[into],
        None if entry_weights is None else entry_weights[lo:hi],
        None if kept_weights is None else kept_weights[into], words, v_s,
        stack.rows_per_shard, u_cap, capacity.max_ids_per_partition, keep[lo:hi],
        out[lo:hi], ranks[into], counts[g], unique_counts[g])
    found.append((out[lo:lo + distinct], ranks[at:at + kept]))
    kept_bounds[g + 1] = at + kept
  total = int(kept_bounds[-1])
  kept_rows = rows[:total]
  located = _index_rows(found, kept_rows, kept_bounds, v_s, stack.rows_per_shard, n_count,
                        u_cap)
  return counts, unique_counts, _Dropped(
      keep, samples[:total], None if kept_weights is None else kept_weights[:total],
      kept_bounds, located)
