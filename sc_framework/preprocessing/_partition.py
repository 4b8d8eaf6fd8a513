"""One stack's keys -> one `StackBatch`: gains, partitions, capacities, dropping.

Notation of `_batch`: G devices, N shards of R rows, V_s = N * R, B_loc local
samples per device, capacities C (entries) and U (distinct rows) per
partition (device g, shard n). Steps, after `_dedup.merge`:

1. Combiner factor of stack sample b, over the sample's ids (duplicates
   counted separately, as TensorFlow's embedding_lookup_sparse does):
     sum: 1,   mean: 1 / sum_j w_j,   sqrtn: 1 / sqrt(sum_j w_j^2);
   1 for a position of a sequence feature (no combiner);
   entry gain = w_e * factor(b). A sample without ids has no entries.
2. Entry e of sample b has device g = floor(b / B_loc) (entries are ordered by
   b, so each device owns one range of them) and global row
   row = key - b * V_s in shard n = floor(row / R). Per device, the distinct
   rows come ascending from one pass over a [V_s] bitmap when V_s is small
   next to the device's entries, else from a sort; u is a row's rank among
   the distinct rows of its shard, and the entry's unique index is n * U + u (looked
   up through a [V_s] table, so no per-entry division is needed). The C++
   loops of `_native` use a bit map with per-word counts instead, which gives
   the same distinct rows and ranks from the cache.
3. Capacities: a partition may hold C entries and U distinct rows. Overflow
   raises, or with dropping enabled removes, in every partition:
     (a) every entry whose row is not among the first U distinct rows of the
         partition, rows ordered by their first entry in (sample, row) order;
     (b) then every entry after the first C remaining ones, in (sample, row)
         order; so later samples lose their ids first.
   The result is exactly the batch without the dropped ids: combiner factors
   are recomputed over the kept ids, and rows left without entries are not
   requested. Statistics always describe the batch before dropping. The
   kept entries come from linear passes without a sort and the kept rows'
   unique indices from step 2's result (`_drop`). With dropping allowed, the
   C++ loops apply the rules inside step 2's bit-map pass instead
   (`_locate_within_limits`): an overflowing batch then takes the same passes
   as one within its limits.
4. Write the buffers of `_batch.StackBatch`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from sc_framework.preprocessing import _native
from sc_framework.preprocessing._assemble import StackKeys
from sc_framework.preprocessing._batch import StackBatch
from sc_framework.preprocessing._dedup import Merged, merge
from sc_framework.preprocessing._scratch import arange32, clear_mask, scratch
from sc_framework.preprocessing._stats import StackCapacity, StackStats
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


def _factors(combiner: str, denominators: np.ndarray, owners: np.ndarray,
             masses: np.ndarray | None, describe: Callable[[int], str]) -> np.ndarray | None:
  """Step 1: per sample None (sum), 1 / sum w (mean) or 1 / sqrt(sum w^2) (sqrtn).

  `denominators` holds sum w (mean) or sum w^2 (sqrtn) per sample; owners[i]
  is the sample of weight masses[i] (None: all 1). A zero denominator gives
  factor 0 when every weight of the sample is 0 (or it has no ids); with a
  nonzero weight it is an error (weights cancelling out under 'mean').
  """
  if combiner == "sum":
    return None
  denominators = np.asarray(denominators, np.float64)
  if combiner == "sqrtn":
    denominators = np.sqrt(denominators)
  zero = denominators == 0
  factor = np.divide(1.0, denominators, out=np.zeros_like(denominators), where=~zero)
  if zero.any():
    magnitude = None if masses is None else np.abs(masses)
    has_weight = np.bincount(owners, magnitude, minlength=zero.size) > 0
    bad = np.flatnonzero(zero & has_weight)
    if bad.size:
      raise ValueError(
          f"{describe(int(bad[0]))}: its weights sum to 0 under the 'mean' combiner, so the"
          " mean is undefined. Give the sample weights with a nonzero sum, or use 'sum'."
      )
  return factor.astype(np.float32)


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


def _overflow_error(stack: StackLayout, counts, unique_counts,
                    capacity: StackCapacity, first_device: int = 0) -> ValueError:
  worst = []
  for what, observed, limit, name in (
      ("sends {} ids (distinct (sample, row) pairs) to", counts,
       capacity.max_ids_per_partition, "max_ids_per_partition"),
      ("requests {} distinct rows from", unique_counts,
       capacity.max_unique_ids_per_partition, "max_unique_ids_per_partition"),
  ):
    g, n = np.unravel_index(int(np.argmax(observed)), observed.shape)
    if observed[g, n] > limit:
      worst.append(
          f"device {g + first_device} {what.format(int(observed[g, n]))} shard {n}, above"
          f" {name} = {limit}"
      )
  needed = StackCapacity(int(counts.max()), int(unique_counts.max()))
  return ValueError(
      f"partition overflow in stack {stack.name!r} (tables {list(stack.table_names)}): "
      + "; ".join(worst)
      + f". The batch needs at least {needed}; the limits are the maxima over the stack's"
      " tables. Raise the tables' max_ids_per_partition / max_unique_ids_per_partition"
      " (size_limits_from_stats computes them from a few batches), pass"
      f" capacities={{{stack.name!r}: {needed}}}, or pass allow_id_dropping=True to drop the"
      " excess ids deterministically."
  )


class _Partitioned(NamedTuple):
  """Dedup and step 2 of one stack, before the capacities are applied."""

  merged: Merged
  samples: np.ndarray  # int [n_e]: every entry's stack sample, ascending
  rows: np.ndarray  # int64 [n_e]: every entry's global row
  bounds: np.ndarray  # [G + 1]: device g's entries are [bounds[g], bounds[g + 1])
  located: _Rows
  unique_counts: np.ndarray  # int64 [G, N]: distinct rows per partition
  stats: StackStats  # of the batch before any dropping


def _merge_stack(stack: StackLayout, stack_keys: StackKeys, num_devices: int):
  """Dedup: (merged, entry samples, entry rows, device bounds of the entries)."""
  lengths = stack_keys.lengths
  merged = merge(stack_keys.keys, stack_keys.weights, stack_keys.samples, lengths,
                 stack.vocabulary_size)
  samples = merged.entry_samples
  bounds = _device_bounds(samples, num_devices, lengths.size // num_devices)
  return merged, samples, merged.entry_rows, bounds


def _stats(stack: StackLayout, merged: Merged, counts, unique_counts,
           capacity: StackCapacity) -> StackStats:
  """The statistics of a batch with these entries / distinct rows per partition."""
  return StackStats(
      tables=stack.table_names,
      max_ids_per_partition=int(counts.max(initial=0)),
      max_unique_ids_per_partition=int(unique_counts.max(initial=0)),
      num_ids=int(merged.num_ids),
      num_entries=int(merged.entry_samples.size),
      num_dropped_ids=0,
      capacity=capacity,
  )


def _partition(stack: StackLayout, stack_keys: StackKeys, num_devices: int,
               capacity: StackCapacity) -> _Partitioned:
  """Dedup and step 2 for the `num_devices` devices whose samples `stack_keys` hold."""
  merged, samples, rows, bounds = _merge_stack(stack, stack_keys, num_devices)
  located = _locate_rows(rows, bounds, stack.vocabulary_size, stack.rows_per_shard,
                         stack.num_shards, capacity.max_unique_ids_per_partition)
  unique_counts = np.diff(located.edges, axis=1)
  stats = _stats(stack, merged, located.counts, unique_counts, capacity)
  return _Partitioned(merged, samples, rows, bounds, located, unique_counts, stats)


def _one_pass_drop(kernels, stack: StackLayout, bounds) -> bool:
  """Whether `_locate_within_limits` applies: C++ loops, and every device's
  distinct rows would come from the bit map (`_distinct`)."""
  if kernels is None:
    return False
  sizes = np.diff(bounds)
  return bool((sizes < 2**31).all() and (
      stack.vocabulary_size <= np.maximum(_BITMAP_FACTOR * sizes, _BITMAP_MIN)).all())


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


def partition_stats(stack: StackLayout, stack_keys: StackKeys, *, num_devices: int,
                    capacity: StackCapacity) -> StackStats:
  """One stack's partition statistics (dedup and step 2); never raises on overflow.

  The maxima of ids and distinct rows over its partitions are those of the
  whole batch (nothing is dropped), whatever `capacity`, which is only
  recorded. Arguments as in `partition_stack`.
  """
  return _partition(stack, stack_keys, num_devices, capacity).stats


def partition_stack(
    stack: StackLayout,
    stack_keys: StackKeys,
    *,
    num_devices: int,
    combiner: str,
    capacity: StackCapacity,
    allow_id_dropping: bool,
    describe_sample: Callable[[int], str],
    first_device: int = 0,
    sequence_samples: np.ndarray | None = None,
) -> tuple[StackBatch, StackStats]:
  """Dedup and steps 1-4 of the module docstring for one stack.

  Args:
    stack: the stack's layout.
    stack_keys: the stack's keys (`assemble_stack`).
    num_devices: the devices whose samples `stack_keys` hold: G, or the L
      devices one process feeds.
    combiner: the stack's combiner.
    capacity: (C, U).
    allow_id_dropping: drop overflowing ids instead of raising.
    describe_sample: stack sample b -> "feature 'f' ... sample i" for messages.
    first_device: the layout index of the first of those devices (messages).
    sequence_samples: bool [B_total], the samples that are positions of
      sequence features (`_assemble.sequence_samples`): their factor is 1
      whatever the combiner, so their gain is the id's weight. None: none.

  Returns:
    (StackBatch, StackStats); `partition_stats` gives the statistics alone.
  """
  g_count, n_count, r = num_devices, stack.num_shards, stack.rows_per_shard
  v_s, u_cap = stack.vocabulary_size, capacity.max_unique_ids_per_partition
  lengths = stack_keys.lengths
  total = lengths.size
  local_batch = total // g_count

  kernels = _native.host_kernels()
  merged, samples, rows, bounds = _merge_stack(stack, stack_keys, num_devices)
  weights = merged.weights
  entry_weights = merged.entry_sum(weights, "entry_weights")
  if allow_id_dropping and _one_pass_drop(kernels, stack, bounds):
    counts, unique_counts, dropped = _locate_within_limits(
        kernels, stack, samples, rows, entry_weights, bounds, capacity)
    located = dropped.located
  else:
    located = _locate_rows(rows, bounds, v_s, r, n_count, u_cap)
    counts, unique_counts, dropped = located.counts, np.diff(located.edges, axis=1), None
  stats = _stats(stack, merged, counts, unique_counts, capacity)
  overflow = (stats.max_ids_per_partition > capacity.max_ids_per_partition
              or stats.max_unique_ids_per_partition > u_cap)
  if overflow and not allow_id_dropping:
    raise _overflow_error(stack, counts, unique_counts, capacity, first_device)

  if not overflow:
    # Per sample, over its ids: sum w (mean) or sum w^2 (sqrtn).
    owners, masses = stack_keys.samples, weights
    if weights is None or combiner == "sum":
      denominators = lengths
    else:
      squared = weights if combiner == "mean" else np.square(weights, dtype=np.float64)
      denominators = np.bincount(owners, squared, minlength=total)
  else:
    if dropped is None:
      dropped = _drop(samples, entry_weights, bounds, located, capacity, n_count, local_batch)
    keep, samples, entry_weights, bounds, located = dropped
    stats = dataclasses.replace(stats, num_dropped_ids=merged.num_ids - merged.kept_ids(keep))
    if combiner == "sum":
      denominators = lengths  # unused: 'sum' has no factor
    else:
      mass = (merged.entry_sum(np.square(weights, dtype=np.float64))[keep]
              if combiner == "sqrtn" and weights is not None else entry_weights)
      denominators = np.bincount(samples, mass, minlength=total)
    owners, masses = samples, entry_weights
  if sequence_samples is not None and combiner != "sum":
    denominators = np.where(sequence_samples, 1, denominators)
  factor = _factors(combiner, denominators, owners, masses, describe_sample)
  return _write_buffers(stack, capacity, local_batch, bounds, samples, located, factor,
                        entry_weights), stats


def _write_buffers(stack: StackLayout, capacity: StackCapacity, local_batch: int, bounds,
                   samples, located: _Rows, factor, entry_weights) -> StackBatch:
  """Step 4: the fixed-shape buffers; gain = entry weight (1) * factor[sample] (1)."""
  g_count, n_count, r = len(bounds) - 1, stack.num_shards, stack.rows_per_shard
  u_cap = capacity.max_unique_ids_per_partition
  e_cap = capacity.entries_per_device(n_count)
  # One allocation for the four arrays: the allocator recycles one large block
  # from call to call, where four smaller ones often come back as fresh pages
  # (a page fault per 4 KiB costs about as much as the rest of the work).
  size, entries = g_count * n_count * u_cap, g_count * e_cap
  buffer = np.empty(size + 3 * entries, np.int32)
  unique_rows = buffer[:size].reshape(g_count, n_count, u_cap)
  entry_samples = buffer[size : size + entries].reshape(g_count, e_cap)
  entry_unique_index = buffer[size + entries : size + 2 * entries].reshape(g_count, e_cap)
  entry_gains = buffer[size + 2 * entries :].view(np.float32).reshape(g_count, e_cap)
  for g in range(g_count):
    distinct, edges = located.distinct[g], located.edges[g]
    for n in range(n_count):
      count = edges[n + 1] - edges[n]
      np.subtract(distinct[edges[n]:edges[n + 1]], n * r, out=unique_rows[g, n, :count],
                  casting="unsafe")
      unique_rows[g, n, count:] = -1
    lo, hi = bounds[g], bounds[g + 1]
    count = hi - lo
    np.subtract(samples[lo:hi], g * local_batch, out=entry_samples[g, :count], casting="unsafe")
    entry_samples[g, count:] = local_batch
    entry_unique_index[g, :count] = located.unique_index[lo:hi]
    entry_unique_index[g, count:] = 0
    gains = entry_gains[g, :count]
    if factor is not None:
      np.take(factor, samples[lo:hi], out=gains)
      if entry_weights is not None:
        gains *= entry_weights[lo:hi]
    elif entry_weights is not None:
      gains[...] = entry_weights[lo:hi]
    else:
      gains.fill(1.0)
    entry_gains[g, count:] = 0.0
  return StackBatch(unique_rows, entry_samples, entry_unique_index, entry_gains)
