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

The buffers mean nothing without the layout they were made for: a batch of
another layout with equal G, N and capacities has the same shapes but other
rows, samples or gains. So a StackBatch carries, besides its four arrays, the
`StackSignature` of the stack and features it was preprocessed for, as static
pytree metadata: under jit it is part of the batch's tree structure, which the
primitives compare with their plan's while tracing (no value is read, no
device synchronises), and a jitted step compiles once per signature.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterator
from typing import Any, ClassVar

import jax

from sc_framework.stacking import StackLayout


class StackSignature:
  """What a StackBatch's buffers mean: the stack and sample layout they were made for.

  Two batches of equal signatures index the same rows and samples with the
  same gains; equal signatures are what a plan's stack requires of a batch
  (`sc_framework.primitives` checks it while tracing). Signatures are
  interned: equal values give the same object, so jit, which compares a
  batch's metadata on every call, compares and hashes them by identity, at
  C speed. Unpickling (a batch made in a data loader's worker process) gives
  the interned object too.

  Attributes:
    stack: the stack's name.
    num_devices: G, the devices of the table axis.
    num_shards: N = G * S.
    rows_per_shard: R.
    tables: per table of the stack, in order: (name, vocabulary_size,
      row_offset, shard_rotation).
    features: per feature of the stack, in order: (name, table, stacked batch
      size, sample_offset).
    combiner: the stack's combiner ("sum", "mean", "sqrtn").
    sequence_features: the stack's features with an output (B, L, D) (no
      combiner), in order.
  """

  _FIELDS = ("stack", "num_devices", "num_shards", "rows_per_shard", "tables", "features",
             "combiner", "sequence_features")
  __slots__ = _FIELDS + ("__weakref__",)
  _interned: ClassVar[dict[tuple, StackSignature]] = {}

  stack: str
  num_devices: int
  num_shards: int
  rows_per_shard: int
  tables: tuple[tuple[str, int, int, int], ...]
  features: tuple[tuple[str, str, int, int], ...]
  combiner: str
  sequence_features: tuple[str, ...]

  def __new__(cls, stack: str, num_devices: int, num_shards: int, rows_per_shard: int,
              tables, features, combiner: str, sequence_features) -> StackSignature:
    values = (str(stack), int(num_devices), int(num_shards), int(rows_per_shard),
              tuple((str(n), int(v), int(o), int(r)) for n, v, o, r in tables),
              tuple((str(n), str(t), int(b), int(o)) for n, t, b, o in features),
              str(combiner), tuple(str(name) for name in sequence_features))
    interned = cls._interned.get(values)
    if interned is None:
      candidate = object.__new__(cls)
      for field, value in zip(cls._FIELDS, values):
        object.__setattr__(candidate, field, value)
      interned = cls._interned.setdefault(values, candidate)  # atomic: one object per value
    return interned

  def __setattr__(self, name: str, value: Any) -> None:
    raise AttributeError(f"StackSignature is immutable; cannot set {name!r}.")

  def __reduce__(self):
    return (StackSignature, tuple(getattr(self, field) for field in self._FIELDS))

  def __repr__(self) -> str:
    fields = ", ".join(f"{field}={getattr(self, field)!r}" for field in self._FIELDS)
    return f"StackSignature({fields})"


def stack_signature(stack: StackLayout, num_devices: int, combiner: str,
                    sequence_features: Collection[str] = ()) -> StackSignature:
  """The signature of the batches of `stack` on G = `num_devices` devices.

  Args:
    stack: the stack's layout.
    num_devices: G.
    combiner: the combiner of the stack's tables.
    sequence_features: names of sequence features (others of the model may
      be included; only the stack's count).
  """
  return StackSignature(
      stack=stack.name,
      num_devices=int(num_devices),
      num_shards=stack.num_shards,
      rows_per_shard=stack.rows_per_shard,
      tables=tuple((t.name, t.vocabulary_size, t.row_offset, t.shard_rotation)
                   for t in stack.tables),
      features=tuple((f.name, f.table, f.batch_size, f.sample_offset) for f in stack.features),
      combiner=combiner,
      sequence_features=tuple(f.name for f in stack.features if f.name in sequence_features),
  )


@dataclasses.dataclass(frozen=True, eq=False)
class StackBatch:
  """One stack's preprocessed ids for one step; see the module docstring.

  A pytree whose leaves are the four arrays (in the order of `_fields`) and
  whose static metadata is `signature`. It keeps the interface of the named
  tuple it once was: iterating gives the four arrays, and `_fields`,
  `_replace` and `_asdict` work as on a NamedTuple.

  Attributes:
    unique_rows, entry_samples, entry_unique_index, entry_gains: the buffers.
    signature: the layout the buffers were preprocessed for (`preprocess`
      sets it); None for buffers built by hand, which the primitives can only
      check by their shapes (and, outside jit, by their largest row and sample).
  """

  _fields: ClassVar[tuple[str, ...]] = (
      "unique_rows", "entry_samples", "entry_unique_index", "entry_gains")

  unique_rows: Any
  entry_samples: Any
  entry_unique_index: Any
  entry_gains: Any
  signature: StackSignature | None = dataclasses.field(default=None, kw_only=True)

  def __iter__(self) -> Iterator[Any]:
    return iter((self.unique_rows, self.entry_samples, self.entry_unique_index, self.entry_gains))

  def _replace(self, **changes) -> "StackBatch":
    return dataclasses.replace(self, **changes)

  def _asdict(self) -> dict[str, Any]:
    return {field: getattr(self, field) for field in self._fields}

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


jax.tree_util.register_dataclass(
    StackBatch, data_fields=list(StackBatch._fields), meta_fields=["signature"])

PreprocessedBatch = dict[str, StackBatch]
"""Stack name -> StackBatch."""
