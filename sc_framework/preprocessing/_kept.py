"""Which ids of a batch `preprocess` kept, when it dropped some (`allow_id_dropping`).

Dropping depends on the layout's partitions (device x shard): another layout
drops other ids of the same batch. A batch that is stored to be preprocessed
again elsewhere (a pipelined checkpoint's in-flight batch, whose lookup ran
with the kept ids) must therefore store the ids it kept, not its raw ids.

An id is kept when its (stack sample, global row) pair has an entry in the
preprocessed batch: with the keys of `_assemble` (b * V_s + global row), the
entries of device g are

  b = g * B_loc + entry_samples[g, e]                 (entry_samples < B_loc),
  row = n * R + unique_rows[g, n, u],  n * U + u = entry_unique_index[g, e],

and every id of a feature (in `FlatIds` order) is kept iff its key is one of
them. Duplicates of a (sample, id) pair are one entry: kept or dropped together.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from sc_framework.preprocessing._assemble import _blocks
from sc_framework.preprocessing._batch import PreprocessedBatch, StackBatch
from sc_framework.preprocessing._inputs import FeatureInput
from sc_framework.preprocessing._preprocess import PaddingId, _stacks
from sc_framework.specs import FeatureSpec
from sc_framework.stacking import EmbeddingLayout, StackLayout


def kept_id_masks(
    features: Mapping[str, FeatureInput],
    feature_specs: Sequence[FeatureSpec],
    layout: EmbeddingLayout,
    batch: PreprocessedBatch,
    *,
    padding_id: PaddingId = None,
    devices: range | None = None,
) -> dict[str, np.ndarray]:
  """Feature -> bool [nnz]: which of its ids `batch` (`preprocess`'s output for these
  arguments) kept, over the feature's ids in normal form (`flatten_input(...).values`:
  padding ids removed, samples in order)."""
  masks = {}
  for work in _stacks(features, feature_specs, layout, padding_id, None, devices):
    num_devices = len(work.devices)
    local_batch = work.keys.lengths.size // num_devices
    kept = _members(work.keys.keys, _entry_keys(work.stack, batch[work.stack.name], local_batch))
    start = 0
    for f, lo, hi in _blocks(work.stack, layout.num_devices, num_devices):
      name, splits = work.stack.features[f].name, work.flats[f].row_splits
      mask = masks.setdefault(name, np.zeros(int(splits[-1]), np.bool_))
      first, last = int(splits[lo]), int(splits[hi])
      mask[first:last] = kept[start:start + last - first]
      start += last - first
  return masks


def _members(keys: np.ndarray, sorted_keys: np.ndarray) -> np.ndarray:
  """bool: keys[i] in sorted_keys. A binary search: the keys come in ascending sample
  order (unsorted only within a sample), so its probes stay in cache (np.isin hashes
  both arrays: 40x slower on a batch of 1M ids)."""
  if not sorted_keys.size:
    return np.zeros(keys.shape, np.bool_)
  at = np.minimum(np.searchsorted(sorted_keys, keys), sorted_keys.size - 1)
  return sorted_keys[at] == keys


def _entry_keys(stack: StackLayout, batch: StackBatch, local_batch: int) -> np.ndarray:
  """b * V_s + global row of every entry of `batch` (see the module docstring)."""
  unique_capacity = batch.unique_capacity
  keys = []
  for g in range(batch.num_devices):
    samples = np.asarray(batch.entry_samples[g])
    valid = samples < local_batch
    shard, rank = np.divmod(np.asarray(batch.entry_unique_index[g])[valid], unique_capacity)
    rows = shard.astype(np.int64) * stack.rows_per_shard + np.asarray(
        batch.unique_rows[g])[shard, rank]
    keys.append((g * local_batch + samples[valid].astype(np.int64)) * stack.vocabulary_size
                + rows)
  keys = np.concatenate(keys) if keys else np.zeros(0, np.int64)
  if keys.size > 1 and (keys[1:] < keys[:-1]).any():  # (sample, row) order: already sorted
    keys = np.sort(keys)
  return keys
