"""The device-ready form of one step's sparse input: one `StackBatch` per stack.

This is the contract between host preprocessing and the device primitives.
Notation: G devices on the table axis, S shards per device, N = G * S shards;
a stack with R rows per shard; per-partition capacities C (ids, i.e.
deduplicated (sample, row) entries) and U (distinct rows); E = N * C entries
per device. A "partition" is the pair (source device g, target shard n): the
ids that device g's samples send to shard n.

Samples: the batch is split data-parallel, device g taking samples
[g * B_f / G, (g + 1) * B_f / G) of every feature f. Inside a stack, device g's
local samples are the concatenation, in the layout's feature order, of its
block of each feature: feature f's local samples start at
`feature.sample_offset // G`, and B_loc = total_batch_size // G. B_f is the
feature's stacked batch size: B for a combined feature, B * L for a sequence
feature (output (B, L, D)), whose position l of sample b is its sample
b * L + l, so device g holds whole sequences (B is divisible by G).

Fields (leading axis G, sharded over the table mesh axis):
  unique_rows         int32   [G, N, U]  distinct local rows (in [0, R)) of
                                         shard n requested by device g,
                                         ascending; -1 marks unused capacity
                                         (after the used ones).
  entry_samples       int32   [G, E]     local sample (in [0, B_loc)) of each
                                         entry, ascending; B_loc marks a
                                         padding entry (after the real ones).
  entry_unique_index  int32   [G, E]     the entry's row as an index n * U + u
                                         into device g's flattened [N * U]
                                         unique rows; 0 for padding entries.
  entry_gains         float32 [G, E]     the entry's combiner gain: its summed
                                         weight w times 1 (sum), 1 / sum w
                                         (mean) or 1 / sqrt(sum w^2) (sqrtn),
                                         sums over the entry's sample and
                                         feature, taken over the sample's raw
                                         ids before repeated ids merge (as
                                         TensorFlow's combiners do); 0 for
                                         padding.

The activation of local sample b is sum over entries e with sample b of
gain_e * row(unique_index_e), where row(n * U + u) is local row
unique_rows[g, n, u] of shard n.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class StackBatch(NamedTuple):
  """One stack's preprocessed ids for one step; see the module docstring."""

  unique_rows: np.ndarray
  entry_samples: np.ndarray
  entry_unique_index: np.ndarray
  entry_gains: np.ndarray

  @property
  def num_devices(self) -> int:
    return self.unique_rows.shape[0]

  @property
  def num_shards(self) -> int:
    return self.unique_rows.shape[1]

  @property
  def unique_capacity(self) -> int:
    """U: the distinct rows one device may request from one shard."""
    return self.unique_rows.shape[2]

  @property
  def entry_capacity(self) -> int:
    """E: the entries one device may hold."""
    return self.entry_samples.shape[1]


PreprocessedBatch = dict[str, StackBatch]
"""Stack name -> StackBatch."""
