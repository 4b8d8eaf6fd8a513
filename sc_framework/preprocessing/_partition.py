"""One stack's keys -> one `StackBatch`: gains, partitions, capacities, dropping.

Notation of `_batch`: G devices, N shards of R rows, V_s = N * R, B_loc local
samples per device, capacities C (entries) and U (distinct rows) per
partition (device g, shard n). Steps, after `_dedup.merge`:

1. Combiner factor of stack sample b, over the sample's ids (duplicates
   counted separately, as TensorFlow's embedding_lookup_sparse does):
     sum: 1,   mean: 1 / sum_j w_j,   sqrtn: 1 / sqrt(sum_j w_j^2);
   1 for a position of a sequence feature (no combiner);
   entry gain = w_e * factor(b). A sample without ids has no entries.
2. Entry e of sample b goes to device g = floor(b / B_loc) and shard n of
   its global row; per device, its distinct rows and every entry's unique
   index n * U + u, u the row's rank in its shard (`_locate`).
3. Capacities: a partition may hold C entries and U distinct rows. Overflow
   raises, or with dropping enabled removes the ids beyond them, later
   samples first (rules (a) and (b) of `_dropping`). The result is exactly
   the batch without the dropped ids: combiner factors are recomputed over
   the kept ids. Statistics always describe the batch before dropping.
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
from sc_framework.preprocessing._dropping import _drop, _locate_within_limits
from sc_framework.preprocessing._locate import (_device_bounds, _locate_rows, _one_pass_drop,
                                                _Rows)
from sc_framework.preprocessing._stats import PartitionOverflowError, StackCapacity, StackStats
from sc_framework.stacking import StackLayout


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
  with np.errstate(over="ignore"):
    narrow = factor.astype(np.float32)
  # Weights below about 1e-19 (sqrtn) or 1e-38 (mean) give factors beyond float32's
  # range, and weights above about 1e19 (sqrtn) or 1e38 (mean) subnormal ones, although
  # every gain w * factor is well within it: keep such factors in float64.
  limits = np.finfo(np.float32)
  magnitude = np.abs(narrow)
  if ((magnitude <= limits.max) & ((magnitude >= limits.tiny) | (narrow == 0))).all():
    return narrow
  return factor


def _overflow_error(stack: StackLayout, counts, unique_counts,
                    capacity: StackCapacity, first_device: int = 0) -> PartitionOverflowError:
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
  finding = (
      f"partition overflow in stack {stack.name!r} (tables {list(stack.table_names)}): "
      + "; ".join(worst)
      + f". The batch needs at least {needed}; the limits are the maxima over the stack's"
      " tables."
  )
  return PartitionOverflowError(finding, stack.name, needed, (
      "Raise the tables' max_ids_per_partition / max_unique_ids_per_partition"
      " (size_limits_from_stats computes them from a few batches), pass"
      f" capacities={{{stack.name!r}: {needed}}}, or pass allow_id_dropping=True to drop the"
      " excess ids deterministically."
  ))


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
    elif weights is None:
      denominators = np.bincount(samples, entry_weights, minlength=total)  # kept ids
    else:
      # Over the kept ids themselves, in the order and precision of the branch
      # above: a sample that lost no id gets the factor it has without dropping,
      # bit for bit (also when another device overflowed, or when a process
      # preprocesses only its devices).
      ids_kept = keep if merged.first is None else keep[np.cumsum(merged.first) - 1]
      mass = weights if combiner == "mean" else np.square(weights, dtype=np.float64)
      denominators = np.bincount(stack_keys.samples[ids_kept], mass[ids_kept], minlength=total)
    owners, masses = samples, entry_weights
  if sequence_samples is not None and combiner != "sum":
    denominators = np.where(sequence_samples, 1, denominators)
  factor = _factors(combiner, denominators, owners, masses, describe_sample)
  batch = _write_buffers(stack, capacity, local_batch, bounds, samples, located, factor,
                         entry_weights)
  if weights is not None:  # without weights every gain is 1, 1/n or 1/sqrt(n)
    _check_finite_gains(batch, combiner, local_batch, describe_sample)
  return batch, stats


def _check_finite_gains(batch: StackBatch, combiner: str, local_batch: int,
                        describe: Callable[[int], str]) -> None:
  """Every gain is a finite float32: weights whose sums overflow it are an error."""
  gains = batch.entry_gains
  if np.isfinite(gains).all():
    return
  g, e = np.argwhere(~np.isfinite(gains))[0]
  sample = int(g) * local_batch + int(batch.entry_samples[g, e])
  raise ValueError(
      f"{describe(sample)}: an id's weight under the {combiner!r} combiner gives the gain"
      f" {gains[g, e]}, which float32 cannot hold: the sample's weights are too large (or"
      " cancel too closely under 'mean'). Scale the weights down."
  )


_ALIGNMENT_BYTES = 64


def _aligned_arrays(sizes: list[int]) -> list[np.ndarray]:
  """Fresh int32 arrays of the given sizes, each starting at a 64-byte boundary.

  One allocation holds them all: the allocator recycles one large block from
  call to call, where several smaller ones often come back as fresh pages (a
  page fault per 4 KiB costs about as much as the rest of the work). On the
  CPU, `jax.device_put` (and `make_array_from_process_local_data`) alias a
  64-byte aligned host array instead of copying it: about 5 ms saved per
  batch of ~1M entries.
  """
  per_line = _ALIGNMENT_BYTES // 4
  padded = [-(-size // per_line) * per_line for size in sizes]
  block = np.empty(sum(padded) + per_line, np.int32)
  start = (-block.ctypes.data % _ALIGNMENT_BYTES) // 4
  arrays = []
  for size, span in zip(sizes, padded):
    arrays.append(block[start:start + size])
    start += span
  return arrays


def _write_buffers(stack: StackLayout, capacity: StackCapacity, local_batch: int, bounds,
                   samples, located: _Rows, factor, entry_weights) -> StackBatch:
  """Step 4: the fixed-shape buffers; gain = entry weight (1) * factor[sample] (1)."""
  g_count, n_count, r = len(bounds) - 1, stack.num_shards, stack.rows_per_shard
  u_cap = capacity.max_unique_ids_per_partition
  e_cap = capacity.entries_per_device(n_count)
  size, entries = g_count * n_count * u_cap, g_count * e_cap
  unique_rows, entry_samples, entry_unique_index, entry_gains = _aligned_arrays(
      [size, entries, entries, entries])
  unique_rows = unique_rows.reshape(g_count, n_count, u_cap)
  entry_samples = entry_samples.reshape(g_count, e_cap)
  entry_unique_index = entry_unique_index.reshape(g_count, e_cap)
  entry_gains = entry_gains.view(np.float32).reshape(g_count, e_cap)
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
    if factor is not None and factor.dtype != np.float32:
      product = factor[samples[lo:hi]]  # float64 (`_factors`)
      if entry_weights is not None:
        product *= entry_weights[lo:hi]
      with np.errstate(over="ignore"):
        gains[...] = product
    elif factor is not None:
      np.take(factor, samples[lo:hi], out=gains)
      if entry_weights is not None:
        gains *= entry_weights[lo:hi]
    elif entry_weights is not None:
      gains[...] = entry_weights[lo:hi]
    else:
      gains.fill(1.0)
    entry_gains[g, count:] = 0.0
  return StackBatch(unique_rows, entry_samples, entry_unique_index, entry_gains)
