"""Host preprocessing: one step's raw ids -> a fixed-shape `StackBatch` per stack.

For every stack of the layout, the ids of its features are checked
(`_inputs`), mapped to the stack's global rows in device-major sample order
(`_assemble`), deduplicated, weighted by the combiner and grouped by the
owning shard (`_partition`). The output shapes depend only on the layout and
the capacities (C, U) (`_stats.stack_capacities`), never on the batch's
content, so a jitted step that consumes them compiles once:

  unique_rows [G, N, U], entry_samples / entry_unique_index / entry_gains [G, N * C].
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from sc_framework._error_place import name_the_place
from sc_framework.preprocessing._assemble import assemble_stack, locate_sample, sequence_samples
from sc_framework.preprocessing._batch import PreprocessedBatch, StackBatch, stack_signature
from sc_framework.preprocessing._inputs import FeatureInput, flatten_input
from sc_framework.preprocessing._partition import partition_stack, partition_stats
from sc_framework.preprocessing._stats import (
    PreprocessStats,
    StackCapacity,
    merge_stats,
    stack_capacities,
)
from sc_framework.specs import FeatureSpec, validate_feature_specs
from sc_framework.stacking import EmbeddingLayout, check_rows_addressable

PaddingId = int | None | Mapping[str, int | None]


def _check_names(features: Mapping[str, FeatureInput], specs: Sequence[FeatureSpec]) -> None:
  known = [spec.name for spec in specs]
  missing = [name for name in known if name not in features]
  unknown = sorted(str(name) for name in features if name not in set(known))
  if missing or unknown:
    parts = []
    if missing:
      parts.append(f"features {missing} are missing from the input")
    if unknown:
      parts.append(f"the input has unknown features {unknown}")
    raise ValueError(
        "; ".join(parts) + f". Expected exactly the features of feature_specs: {known}."
    )


def _check_layout(specs: Sequence[FeatureSpec], layout: EmbeddingLayout) -> None:
  if not isinstance(layout, EmbeddingLayout):
    raise TypeError(
        "layout must be the EmbeddingLayout the ids are preprocessed for (plan.layout, or"
        f" auto_stack_tables / stack_tables of the feature specs), got {type(layout).__name__}."
    )
  by_name = {spec.name: spec for spec in specs}
  placed = set()
  for stack in layout.stacks:
    for feature in stack.features:
      spec = by_name.get(feature.name)
      if (spec is None or spec.table.name != feature.table
          or spec.stacked_batch_size != feature.batch_size):
        raise ValueError(
            f"the layout places feature {feature.name!r} (table {feature.table!r}, batch"
            f" {feature.batch_size}) but feature_specs "
            + ("lack it" if spec is None else
               f"have table {spec.table.name!r}, batch {spec.stacked_batch_size} (stacked"
               " samples: the batch, times L for a sequence feature; output_shape"
               f" {spec.output_shape})")
            + ". Build the layout from these feature specs."
        )
      vocabulary = stack.table(feature.table).vocabulary_size
      if vocabulary != spec.table.vocabulary_size:
        raise ValueError(
            f"table {feature.table!r} has vocabulary_size {spec.table.vocabulary_size} in"
            f" feature_specs but {vocabulary} in the layout. Build the layout from these"
            " feature specs."
        )
      if spec.batch_size % layout.num_devices:
        raise ValueError(
            f"feature {feature.name!r}: batch size {spec.batch_size} is not divisible by the"
            f" {layout.num_devices} devices of the layout; samples are split evenly over the"
            " devices. Use a batch size that is a multiple of the device count."
        )
      placed.add(feature.name)
  unplaced = [name for name in by_name if name not in placed]
  if unplaced:
    raise ValueError(f"features {unplaced} are in no stack of the layout.")
  check_rows_addressable(layout)


def _device_range(devices: range | None, num_devices: int) -> range:
  """The layout devices whose samples the input holds (all G by default)."""
  if devices is None:
    return range(num_devices)
  if (not isinstance(devices, range) or devices.step != 1 or not devices
      or devices.start < 0 or devices.stop > num_devices):
    raise ValueError(
        f"devices must be a non-empty range of consecutive devices within the layout's"
        f" G={num_devices} devices, e.g. range(4, 8), got {devices!r}. A process passes the"
        " positions its local devices hold on the mesh axis."
    )
  return devices


def padding_id_of(padding_id: PaddingId, name: str) -> int | None:
  """The padding id of feature `name`: padding_id's entry for it (None when absent), or
  padding_id itself when it is one id (or None) for every feature."""
  if isinstance(padding_id, Mapping):
    return padding_id.get(name)
  return padding_id


@dataclasses.dataclass(frozen=True)
class _StackWork:
  """One stack's assembled keys and what partitioning them needs (`_stacks`)."""

  stack: Any
  flats: tuple  # One FlatIds per feature of the stack, in its order.
  keys: Any
  capacity: StackCapacity
  combiner: str
  describe: Callable[[int], str]
  devices: range
  sequence_samples: Any
  signature: Any


def _stacks(features, feature_specs, layout, padding_id, capacities, devices
            ) -> Iterator[_StackWork]:
  """Checks every feature's input, then yields each stack's assembled keys in order."""
  specs = validate_feature_specs(feature_specs)
  if not isinstance(features, Mapping):
    raise TypeError(
        f"features must map feature names to ids, got {type(features).__name__}."
    )
  _check_names(features, specs)
  _check_layout(specs, layout)
  if isinstance(padding_id, Mapping):
    unknown = sorted(set(padding_id) - {spec.name for spec in specs})
    if unknown:
      raise ValueError(f"padding_id names unknown features {unknown}; the features are"
                       f" {sorted(spec.name for spec in specs)}.")
  by_name = {spec.name: spec for spec in specs}
  sizes = stack_capacities(specs, layout, capacities)
  g_count = layout.num_devices
  local = _device_range(devices, g_count)
  # Check every feature before the work on any stack starts.
  flat = {
      spec.name: flatten_input(
          features[spec.name], spec, padding_id=padding_id_of(padding_id, spec.name),
          batch_size=spec.batch_size // g_count * len(local),
      )
      for spec in specs
  }
  sequence = {spec.name for spec in specs if spec.sequence_length is not None}
  for stack in layout.stacks:
    flats = [flat[feature.name] for feature in stack.features]

    def describe(sample: int, stack=stack) -> str:
      name, index = locate_sample(stack, g_count, sample)
      spec = by_name[name]
      place = f"sample {index}"
      if spec.sequence_length is not None:
        place = f"sample {index // spec.sequence_length} position {index % spec.sequence_length}"
      return f"feature {name!r} (table {spec.table.name!r}) {place}"

    yield _StackWork(
        stack=stack,
        flats=tuple(flats),
        keys=assemble_stack(stack, flats, g_count, local_devices=len(local)),
        capacity=sizes[stack.name],
        combiner=by_name[stack.features[0].name].table.combiner,
        describe=describe,
        devices=local,
        sequence_samples=lambda stack=stack: sequence_samples(
            stack, sequence, g_count, local_devices=len(local)),
        signature=stack_signature(stack, g_count, by_name[stack.features[0].name].table.combiner,
                                  sequence),
    )


def preprocess(
    features: Mapping[str, FeatureInput],
    feature_specs: Sequence[FeatureSpec],
    layout: EmbeddingLayout,
    *,
    padding_id: PaddingId = None,
    allow_id_dropping: bool = False,
    capacities: Mapping[str, StackCapacity | tuple[int, int]] | None = None,
    devices: range | None = None,
) -> tuple[PreprocessedBatch, PreprocessStats]:
  r"""Turns one step's raw ids into device-ready buffers, one StackBatch per stack.

  For every feature f and sample b with ids i_j and weights w_j (1 if none),
  the activation the buffers describe is

    a_{f,b} = sum_j gain_j * T_k[i_j],   gain_j = w_j * c_{f,b},

  c = 1 (sum), 1 / sum_j w_j (mean), 1 / sqrt(sum_j w_j^2) (sqrtn), with T_k
  the feature's table (the combiner of the stack). A sequence feature (output
  (B, L, D)) has B * L samples, position l of sample b being sample b * L + l
  with at most one id and c = 1 (no combiner): a_{f,b,l} = w_{b,l} T_k[i_{b,l}].
  Repeated (b, i) pairs become one entry with the summed gain; a sample without
  ids gets no entries. The samples are split over the layout's G devices (device
  g takes samples [g B_f / G, (g + 1) B_f / G) of every feature) and the rows
  are grouped by their shard; see `_batch` for the exact format.

  Args:
    features: feature name -> its ids: a dense int array [B, L] or [B], a
      list of per-sample arrays, or DenseIds / RaggedIds / SparseIds (which
      also carry weights). Exactly the features of `feature_specs`.
    feature_specs: the model's features (tables, batch sizes, limits).
    layout: the layout built from `feature_specs`.
    padding_id: an id that means "no id" and is skipped (e.g. -1), for every
      feature, or a mapping feature name -> padding id; None: no padding.
    allow_id_dropping: on partition overflow, drop ids deterministically
      (later samples first; see `_dropping`) and count them in the stats,
      instead of raising.
    capacities: stack name -> (C, U), overriding the maxima of the stack's
      tables' max_ids_per_partition / max_unique_ids_per_partition.
    devices: process-local preprocessing: the consecutive layout devices
      [first, stop) whose samples `features` hold, P = len(devices) of the
      G. Every feature then holds P * B_f / G samples, its global samples
      [first * B_f / G, stop * B_f / G), and the output covers those P
      devices only (leading axis P), each device's buffers identical to the
      global call's; the stats describe those devices. Feature specs and
      layout keep the global batch sizes. None: all G devices.

  Returns:
    (stack name -> StackBatch, PreprocessStats). Shapes: unique_rows
    [G, N, U], the entry arrays [G, N * C] (P instead of G with `devices`).
    Every StackBatch carries the `StackSignature` of its stack (`signature`,
    static metadata), by which the primitives refuse it for another plan.

  Raises:
    ValueError: a missing or unknown feature, a batch size that differs from
      the spec or is not divisible by G, an id outside [0, V) that is not the
      padding id, weights that do not match the ids or are not finite, a mean
      over weights that cancel to a sum of 0 (a sample whose weights are all
      0 gets zero activations under 'mean' and 'sqrtn', as one without ids),
      weights that float32 cannot hold or so large that a gain overflows
      float32, or (without dropping) a partition overflow; each message names
      the feature or stack, the value and a fix. Gains are checked one by
      one: an activation sums gain * row over a sample's ids in float32, so
      finite gains near float32's largest value (3.4e38) can still sum to
      infinity; keep weights in a range where sums of them stay finite.
    TypeError: ids that are not integers, a malformed input (a numpy masked
      array included: its mask would be dropped), or an allow_id_dropping that
      is not a bool.

  Example:
    layout = auto_stack_tables(features, num_devices=jax.device_count())
    batch, stats = preprocess({"user": user_ids, "item": RaggedIds(v, splits)},
                              features, layout, padding_id=-1)
    # Process p of several, feeding the mesh positions of its P devices:
    local_batch, _ = preprocess(local_features, features, layout,
                                devices=range(p * P, (p + 1) * P))
  """
  if not isinstance(allow_id_dropping, (bool, np.bool_)):
    raise TypeError(
        f"allow_id_dropping must be True or False, got {allow_id_dropping!r}"
        f" ({type(allow_id_dropping).__name__})."
    )
  batches: dict[str, StackBatch] = {}
  stats = {}
  for work in _stacks(features, feature_specs, layout, padding_id, capacities, devices):
    try:
      batch, stats[work.stack.name] = partition_stack(
          work.stack,
          work.keys,
          num_devices=len(work.devices),
          combiner=work.combiner,
          capacity=work.capacity,
          allow_id_dropping=allow_id_dropping,
          describe_sample=work.describe,
          first_device=work.devices.start,
          sequence_samples=work.sequence_samples(),
      )
    except MemoryError as error:  # Buffers of (C, U) entries per partition.
      error.add_note(
          f"(the buffers of stack {work.stack.name!r}, tables {list(work.stack.table_names)},"
          f" for max_ids_per_partition {work.capacity.max_ids_per_partition} and"
          f" max_unique_ids_per_partition {work.capacity.max_unique_ids_per_partition} over"
          f" {work.stack.num_shards} shards: lower the limits, e.g. with size_limits_from_stats)")
      raise
    batches[work.stack.name] = batch._replace(signature=work.signature)
  return batches, PreprocessStats(stats, layout)


def batch_stats(
    features: Mapping[str, FeatureInput],
    feature_specs: Sequence[FeatureSpec],
    layout: EmbeddingLayout,
    *,
    padding_id: PaddingId = None,
    capacities: Mapping[str, StackCapacity | tuple[int, int]] | None = None,
    devices: range | None = None,
) -> PreprocessStats:
  """The statistics `preprocess` would report, without building buffers.

  Never raises on partition overflow: the stats say what the batch needs.
  Bad input raises as in `preprocess`; `devices` as there.
  """
  return PreprocessStats({
      work.stack.name: partition_stats(work.stack, work.keys, num_devices=len(work.devices),
                                       capacity=work.capacity)
      for work in _stacks(features, feature_specs, layout, padding_id, capacities, devices)
  }, layout)


def collect_stats(
    batches: Iterable[Mapping[str, FeatureInput]],
    feature_specs: Sequence[FeatureSpec],
    layout: EmbeddingLayout,
    *,
    padding_id: PaddingId = None,
    devices: range | None = None,
) -> PreprocessStats:
  """Merged statistics of several batches, e.g. to size the tables' limits.

  `devices` as in `preprocess`: statistics of a process's own devices, from
  batches of its samples. With several processes, every process must use the
  same limits (the Trainer checks that they agree): size them from every
  process's statistics merged (`merge_stats`; the statistics pickle), or from
  global batches (devices=None) on one process, and share the result.

  Example:
    stats = collect_stats(itertools.islice(dataset, 20), features, layout)
    features = size_limits_from_stats(features, stats, layout=layout, headroom=1.2)
  """
  if isinstance(batches, Mapping):
    raise TypeError(
        "collect_stats takes an iterable of batches, got a mapping (one batch?). Pass a list"
        " of batches, e.g. collect_stats([batch], ...), or an iterator over a dataset."
    )
  stats = merge_stats(
      _batch_stats_named(index, batch, feature_specs, layout, padding_id, devices)
      for index, batch in enumerate(batches)
  )
  return stats if stats.stacks else PreprocessStats({}, layout)


def _batch_stats_named(index: int, batch: Mapping[str, FeatureInput],
                       feature_specs: Sequence[FeatureSpec], layout: EmbeddingLayout,
                       padding_id: PaddingId, devices: range | None) -> PreprocessStats:
  """`batch_stats` of the index-th batch of collect_stats; its errors name the batch."""
  try:
    return batch_stats(batch, feature_specs, layout, padding_id=padding_id, devices=devices)
  except (ValueError, TypeError) as error:
    name_the_place(error, f"batch {index} of the batches given to collect_stats")
    raise
