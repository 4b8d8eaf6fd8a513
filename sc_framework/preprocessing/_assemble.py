"""One stack's features -> one flat array of (sample, global row) keys.

Notation as in `_batch`: G devices, N shards of R rows, V_s = N * R rows in
the stack. Feature f (batch B_f, table k with row offset o_k and rotation
r_k) contributes its samples in device-major order: device g's block of f is
samples [g * B_f / G, (g + 1) * B_f / G), and the stack's samples are

  for g in 0..G-1: for f in the layout's feature order: f's block g,

so stack sample b = g * B_loc + f.sample_offset / G + (local sample in the
block), B_loc = total batch / G, exactly the local order of `_batch`. Every
id i becomes the int64 key

  key = b * V_s + global_row(i),
  global_row(i) = ((i mod N + r_k) mod N) * R + floor(i / N) + o_k

(the layout of `sc_framework.stacking._layout`). The keys come out grouped by sample (ascending b),
each sample's ids in input order. This is the only pass over the ids that
depends on the layout; everything downstream works on keys.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NamedTuple

import numpy as np

from sc_framework.preprocessing import _native
from sc_framework.preprocessing._inputs import FlatIds
from sc_framework.preprocessing._scratch import scratch
from sc_framework.stacking import StackLayout


class StackKeys(NamedTuple):
  """A stack's ids as keys; see the module docstring.

  Attributes:
    keys: int64 [nnz] b * V_s + global row, grouped by ascending sample b (a
      scratch array, see `_scratch`).
    samples: int32 [nnz] the sample b of every key (may be a scratch array).
    lengths: int64 [B_total] ids per stack sample (device-major order).
    weights: float32 [nnz] aligned with keys (scratch), or None when no
      feature of the stack has weights (every weight 1).
  """

  keys: np.ndarray
  samples: np.ndarray
  lengths: np.ndarray
  weights: np.ndarray | None


def _global_rows(ids: np.ndarray, num_shards: int, rows_per_shard: int, offset: int,
                 rotation: int) -> np.ndarray:
  """int64 global_row(ids) for the ids of one table (offset o_k, rotation r_k)."""
  ids = ids.astype(np.int64, copy=False)
  if num_shards & (num_shards - 1) == 0:  # a power of two: shifts and masks
    shift = num_shards.bit_length() - 1
    shard = ids & (num_shards - 1)
    rows = ids >> shift
    if rotation:
      shard += rotation
      shard &= num_shards - 1
  else:
    rows, shard = np.divmod(ids, num_shards)
    if rotation:
      shard += rotation
      shard[shard >= num_shards] -= num_shards
  shard *= rows_per_shard
  rows += shard
  if offset:
    rows += offset
  return rows


def _blocks(stack: StackLayout, num_devices: int, local_devices: int | None):
  """(feature index, first sample, end sample) of every block, device-major."""
  blocks = []
  for g in range(num_devices if local_devices is None else local_devices):
    for index, feature in enumerate(stack.features):
      per_device = feature.batch_size // num_devices
      blocks.append((index, g * per_device, (g + 1) * per_device))
  return blocks


def sequence_samples(
    stack: StackLayout,
    sequence_features: Collection[str],
    num_devices: int,
    *,
    local_devices: int | None = None,
) -> np.ndarray | None:
  """bool [B_total]: the stack samples that are positions of sequence features.

  Such a sample holds at most one id and takes no combiner factor (its gain
  is the id's weight). None when the stack has no sequence feature.
  """
  if not any(feature.name in sequence_features for feature in stack.features):
    return None
  pieces = [
      np.full(hi - lo, stack.features[f].name in sequence_features, np.bool_)
      for f, lo, hi in _blocks(stack, num_devices, local_devices)
  ]
  return np.concatenate(pieces)


def assemble_stack(
    stack: StackLayout,
    flats: Sequence[FlatIds],
    num_devices: int,
    *,
    local_devices: int | None = None,
) -> StackKeys:
  """Keys of one stack's ids, samples in device-major order.

  Args:
    stack: the stack's layout.
    flats: one FlatIds per feature of the stack, in `stack.features` order,
      ids already checked to lie in [0, V) of the feature's table.
    num_devices: G; every feature's batch size is divisible by G.
    local_devices: P, when `flats` hold the blocks of P consecutive devices
      only (P * B_f / G samples per feature, as one process of several
      feeds); None: all G devices.

  Returns:
    StackKeys, samples numbered over the P (or G) devices.
  """
  tables = {table.name: table for table in stack.tables}
  blocks = _blocks(stack, num_devices, local_devices)
  lengths = np.concatenate([np.diff(flats[f].row_splits[lo:hi + 1]) for f, lo, hi in blocks])
  any_weights = any(flat.weights is not None for flat in flats)
  weights = scratch("weights", int(lengths.sum()), np.float32) if any_weights else None
  kernels = _native.host_kernels()
  if kernels is None:
    keys, samples = _numpy_keys(stack, flats, blocks, lengths, tables, weights)
  else:
    keys, samples = _native_keys(kernels, stack, flats, blocks, lengths, tables, weights)
  return StackKeys(keys, samples, lengths, weights)


def _block_ids(flat: FlatIds, lo: int, hi: int) -> tuple[slice, np.ndarray | None]:
  """(the ids' range of samples [lo, hi) of `flat`, their weights or None)."""
  a, b = int(flat.row_splits[lo]), int(flat.row_splits[hi])
  return slice(a, b), None if flat.weights is None else flat.weights[a:b]


def _native_keys(kernels, stack: StackLayout, flats, blocks, lengths, tables, weights):
  """Keys and samples of `assemble_stack` in one C++ pass per block (`_native`)."""
  lengths64 = lengths.astype(np.int64, copy=False)
  keys = scratch("keys", int(lengths64.sum()), np.int64)
  samples = scratch("samples", keys.size, np.int32)
  start = first = 0
  for f, lo, hi in blocks:
    flat = flats[f]
    ids, block_weights = _block_ids(flat, lo, hi)
    values = flat.values[ids]
    if values.dtype not in (np.int32, np.int64):
      values = values.astype(np.int64)
    stop = start + values.size
    table = tables[stack.features[f].table]
    kernels.fill_keys(keys[start:stop], samples[start:stop], np.ascontiguousarray(values),
                      lengths64[first:first + hi - lo], first, stack.vocabulary_size,
                      stack.num_shards, stack.rows_per_shard, table.row_offset,
                      table.shard_rotation)
    if weights is not None:
      weights[start:stop] = 1.0 if block_weights is None else block_weights
    start, first = stop, first + hi - lo
  return keys, samples


def _numpy_keys(stack: StackLayout, flats, blocks, lengths, tables, weights):
  """Keys and samples of `assemble_stack` with numpy."""
  n_count = stack.num_shards
  samples = np.repeat(np.arange(lengths.size, dtype=np.int32), lengths)
  keys = scratch("keys", samples.size, np.int64)
  np.multiply(samples, stack.vocabulary_size, out=keys, dtype=np.int64)
  rows = []
  for feature, flat in zip(stack.features, flats):
    table = tables[feature.table]
    if n_count == 1:  # global row = id + o_k, added block by block below
      rows.append((flat.values, table.row_offset))
    else:
      rows.append((_global_rows(flat.values, n_count, stack.rows_per_shard, table.row_offset,
                                table.shard_rotation), 0))
  start = 0
  for f, lo, hi in blocks:
    ids, block_weights = _block_ids(flats[f], lo, hi)
    stop = start + (ids.stop - ids.start)
    if stop > start:
      block = keys[start:stop]
      values, offset = rows[f]
      np.add(block, values[ids], out=block, casting="unsafe")
      if offset:
        block += offset
      if weights is not None:
        weights[start:stop] = 1.0 if block_weights is None else block_weights
    start = stop
  return keys, samples


def locate_sample(stack: StackLayout, num_devices: int, sample: int) -> tuple[str, int]:
  """(feature name, sample within the feature's batch) of stack sample b."""
  local_batch = stack.total_batch_size // num_devices
  g, local = divmod(int(sample), local_batch)
  for feature in stack.features:
    per_device = feature.batch_size // num_devices
    start = feature.sample_offset // num_devices
    if start <= local < start + per_device:
      return feature.name, g * per_device + local - start
  raise AssertionError("unreachable: sample outside the stack's batch")
