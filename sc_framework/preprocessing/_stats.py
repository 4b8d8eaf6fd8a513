"""Partition capacities, the statistics of preprocessed batches, and sizing.

A stack's static capacities are C (entries, i.e. deduplicated (sample, row)
pairs, one device may send one shard per step) and U (distinct rows one device
may request from one shard per step); E = N * C entries per device. By
default they are the maxima over the stack's tables:

  C = max_k table_k.max_ids_per_partition
  U = max_k table_k.max_unique_ids_per_partition

Every preprocessed batch reports, per stack, the largest partition it saw;
`size_limits_from_stats` turns statistics of a few representative batches into
table limits (feature-distribution-optimized sizing):

  limit = ceil(observed maximum * headroom).

The partitions, and so these figures, depend on the layout (G, S, which tables
share a stack, the tables' and features' sizes): statistics record the layout
they were collected on, are not merged with statistics of another, and
`size_limits_from_stats` refuses them for another layout it is given.
"""

from __future__ import annotations

import dataclasses
import fractions
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal, NamedTuple

from sc_framework._scalars import python_scalar
from sc_framework.specs import FeatureSpec, TableSpec, check_partition_limit, tables_of
from sc_framework.stacking import EmbeddingLayout


class StackCapacity(NamedTuple):
  """The static partition capacities (C, U) of one stack."""

  max_ids_per_partition: int
  max_unique_ids_per_partition: int

  def entries_per_device(self, num_shards: int) -> int:
    """E = N * C."""
    return num_shards * self.max_ids_per_partition


class PartitionOverflowError(ValueError):
  """A batch needs more entries or distinct rows in a partition than its stack's capacity.

  Attributes:
    stack: the stack's name.
    needed: the capacity the batch needs (its largest partition).
    finding: the message without its advice: which device sends how many
      ids or rows to which shard, against which limit.
  """

  def __init__(self, finding: str, stack: str, needed: StackCapacity, advice: str):
    super().__init__(f"{finding} {advice}")
    self.finding, self.stack, self.needed, self.advice = finding, stack, needed, advice

  def __reduce__(self):  # pickle and copy (e.g. from a data loader's worker process)
    return type(self), (self.finding, self.stack, self.needed, self.advice)

  def with_advice(self, advice: str) -> PartitionOverflowError:
    """The same finding with other advice (for a caller with other options)."""
    return PartitionOverflowError(self.finding, self.stack, self.needed, advice)


def _check_capacity(stack: str, capacity) -> StackCapacity:
  try:
    ids, unique = capacity
  except (TypeError, ValueError):
    raise TypeError(
        f"stack {stack!r}: a capacity must be a StackCapacity(max_ids_per_partition,"
        f" max_unique_ids_per_partition) or a pair of ints, got {capacity!r}."
    ) from None
  ids, unique = python_scalar(ids), python_scalar(unique)  # numpy ints are ints
  for name, value in (("max_ids_per_partition", ids), ("max_unique_ids_per_partition", unique)):
    check_partition_limit(f"stack {stack!r}", name, value)
  return StackCapacity(ids, unique)


def stack_capacities(
    feature_specs: Sequence[FeatureSpec],
    layout: EmbeddingLayout,
    overrides: Mapping[str, StackCapacity | tuple[int, int]] | None = None,
) -> dict[str, StackCapacity]:
  """The capacities (C, U) of every stack: table maxima, or an override.

  Args:
    feature_specs: the model's features; their tables carry the limits.
    layout: the layout whose stacks are sized.
    overrides: stack name -> (C, U), replacing the table maxima.

  Returns:
    Stack name -> StackCapacity, in the layout's stack order.

  Raises:
    ValueError: an override names an unknown stack or holds a non-positive
      value; a stack's table is read by none of `feature_specs`.
  """
  tables = {table.name: table for table in tables_of(feature_specs)}
  overrides = dict(overrides or {})
  unknown = sorted(set(overrides) - set(layout.stack_names))
  if unknown:
    raise ValueError(
        f"capacities name unknown stacks {unknown}; the layout's stacks are"
        f" {list(layout.stack_names)}."
    )
  result = {}
  for stack in layout.stacks:
    if stack.name in overrides:
      result[stack.name] = _check_capacity(stack.name, overrides[stack.name])
      continue
    missing = [name for name in stack.table_names if name not in tables]
    if missing:
      raise ValueError(
          f"stack {stack.name!r}: tables {missing} are read by no feature in feature_specs;"
          " pass the feature specs the layout was built from."
      )
    specs = [tables[name] for name in stack.table_names]
    result[stack.name] = StackCapacity(
        max(t.max_ids_per_partition for t in specs),
        max(t.max_unique_ids_per_partition for t in specs),
    )
  return result


@dataclasses.dataclass(frozen=True)
class StackStats:
  """What one stack's batch (or batches, merged) needed.

  Attributes:
    tables: the stack's tables, in layout order.
    max_ids_per_partition: the largest entry count (deduplicated (sample,
      row) pairs) of any (device, shard) partition, before any dropping.
    max_unique_ids_per_partition: the largest distinct-row count of any
      partition, before any dropping.
    num_ids: the ids seen (padding excluded, duplicates included).
    num_entries: the deduplicated (sample, row) entries, before dropping.
    num_dropped_ids: ids (duplicates included) dropped to fit the capacity.
    capacity: the capacities (C, U) the batch was preprocessed with.
    num_batches: how many batches these statistics cover.
  """

  tables: tuple[str, ...]
  max_ids_per_partition: int
  max_unique_ids_per_partition: int
  num_ids: int
  num_entries: int
  num_dropped_ids: int
  capacity: StackCapacity
  num_batches: int = 1

  @property
  def required_capacity(self) -> StackCapacity:
    """The smallest (C, U) that would have dropped nothing (at least 1 each)."""
    return StackCapacity(
        max(self.max_ids_per_partition, 1), max(self.max_unique_ids_per_partition, 1)
    )

  def merge(self, other: "StackStats") -> "StackStats":
    """Statistics of both: maxima of the maxima, sums of the counts."""
    return StackStats(
        tables=self.tables,
        max_ids_per_partition=max(self.max_ids_per_partition, other.max_ids_per_partition),
        max_unique_ids_per_partition=max(
            self.max_unique_ids_per_partition, other.max_unique_ids_per_partition
        ),
        num_ids=self.num_ids + other.num_ids,
        num_entries=self.num_entries + other.num_entries,
        num_dropped_ids=self.num_dropped_ids + other.num_dropped_ids,
        capacity=StackCapacity(*map(max, self.capacity, other.capacity)),
        num_batches=self.num_batches + other.num_batches,
    )


@dataclasses.dataclass(frozen=True)
class PreprocessStats:
  """Per-stack statistics of one preprocessed batch (or merged batches).

  Attributes:
    stacks: stack name -> its statistics.
    layout: the layout the batches were preprocessed with; None where unknown
      (statistics built by hand, or kept from a version that did not record
      it: such objects, e.g. unpickled, read as None).
  """

  stacks: Mapping[str, StackStats]
  layout: EmbeddingLayout | None = None

  def __getitem__(self, stack_name: str) -> StackStats:
    return self.stacks[stack_name]

  @property
  def num_dropped_ids(self) -> int:
    """Ids dropped over all stacks."""
    return sum(stats.num_dropped_ids for stats in self.stacks.values())

  def merge(self, other: "PreprocessStats") -> "PreprocessStats":
    """Per stack, `StackStats.merge`; a stack present in one side is kept.

    The result records the layout both sides record, None if either side
    with statistics records none.

    Raises:
      ValueError: the two sides were collected on different layouts, whose
        per-partition figures do not compare.
    """
    if not self.stacks or not other.stacks:
      layout = other.layout if not self.stacks else self.layout
    else:
      difference = _layout_difference(self.layout, other.layout)
      if difference is not None:
        raise ValueError(
            f"cannot merge statistics collected on different layouts ({difference}): the"
            " per-partition figures of one layout say nothing about another's. Collect the"
            " statistics of every batch on the layout to be sized."
        )
      layout = self.layout if other.layout is not None else None
    merged = dict(self.stacks)
    for name, stats in other.stacks.items():
      merged[name] = merged[name].merge(stats) if name in merged else stats
    return PreprocessStats(merged, layout)


def _layout_difference(first: EmbeddingLayout | None,
                       second: EmbeddingLayout | None) -> str | None:
  """How two known layouts differ, in words ('first' vs 'second'); None if equal or unknown."""
  if first is None or second is None or first == second:
    return None
  for what, one, other in (
      ("G", first.num_devices, second.num_devices),
      ("S", first.shards_per_device, second.shards_per_device),
      ("stacks", {stack.name: list(stack.table_names) for stack in first.stacks},
       {stack.name: list(stack.table_names) for stack in second.stacks}),
  ):
    if one != other:
      return f"{what}={one} vs {what}={other}"
  return ("the same G, S and stacks, but other table or feature sizes (vocabulary sizes,"
          " dimensions or batch sizes)")


def merge_stats(stats: Iterable[PreprocessStats]) -> PreprocessStats:
  """The statistics of several batches as one (see `PreprocessStats.merge`)."""
  if isinstance(stats, (str, bytes, Mapping)) or not isinstance(stats, Iterable):
    raise TypeError(
        "stats must be a PreprocessStats (of collect_stats or preprocess) or an iterable of"
        f" them, got {type(stats).__name__}."
    )
  result = PreprocessStats({})
  for item in stats:
    if not isinstance(item, PreprocessStats):
      raise TypeError(
          "stats must be a PreprocessStats (of collect_stats or preprocess) or an iterable of"
          f" them, got an iterable holding {type(item).__name__} values."
      )
    result = result.merge(item)
  return result


def _scaled_up(observed: int, headroom: float) -> int:
  """ceil(observed * headroom), headroom taken as the decimal it is written as.

  In binary floating point 100 * 1.1 is 110.00000000000001, whose ceiling
  would be 111; the shortest decimal of 1.1 (11/10) gives 110, as written.
  """
  return math.ceil(observed * fractions.Fraction(repr(float(headroom))))


def size_limits_from_stats(
    feature_specs: Sequence[FeatureSpec],
    stats: PreprocessStats | Iterable[PreprocessStats],
    *,
    layout: EmbeddingLayout | None = None,
    headroom: float = 1.2,
    policy: Literal["raise", "fit"] = "raise",
) -> tuple[FeatureSpec, ...]:
  r"""Feature specs whose tables' limits fit the observed batches.

  For every stack in `stats` and every table k of the stack (all tables of a
  stack share its partitions, so they get the stack's figures):

    C_k = ceil(max_ids_per_partition * headroom)
    U_k = ceil(max_unique_ids_per_partition * headroom)

  With policy "raise" a limit only grows: max(current, new). With "fit" it
  becomes the new value (at least 1), which may shrink an oversized table.
  Tables of stacks absent from `stats` keep their limits. Stacking does not
  depend on the limits, so the layout stays valid.

  The limits hold for the layout the statistics were collected on: another
  G, S or stacking partitions the ids otherwise. Pass that `layout` to have
  it checked.

  Args:
    feature_specs: the model's features.
    stats: one PreprocessStats or several (merged by taking maxima), e.g.
      from `collect_stats` over a few representative batches.
    layout: the layout the sized specs will run on; statistics recorded on
      another are refused. Statistics that record no layout (built by hand or
      by an older version) are checked by their stacks' names and tables
      only. None: not checked.
    headroom: factor >= 1 applied to the observed maxima.
    policy: "raise" or "fit" (see above).

  Returns:
    The features, in order, reading new TableSpecs (features that shared a
    table share the new one).

  Raises:
    ValueError: a headroom or policy out of range; statistics of different
      layouts (when merged), or of another layout than `layout`.
    TypeError: a layout that is not an EmbeddingLayout.

  Example:
    stats = collect_stats(batches[:20], features, layout, padding_id=-1)
    features = size_limits_from_stats(features, stats, layout=layout, headroom=1.2)
  """
  headroom = python_scalar(headroom)
  if (isinstance(headroom, bool) or not isinstance(headroom, (int, float))
      or not headroom >= 1.0 or not math.isfinite(headroom)):
    raise ValueError(f"headroom must be a finite number >= 1, got {headroom!r}.")
  if policy not in ("raise", "fit"):
    raise ValueError(f"policy must be 'raise' or 'fit', got {policy!r}.")
  if not isinstance(stats, PreprocessStats):
    stats = merge_stats(stats)
  if layout is not None:
    _check_stats_layout(stats, layout)
  needed: dict[str, tuple[int, int]] = {}
  for stack_stats in stats.stacks.values():
    ids = max(1, _scaled_up(stack_stats.max_ids_per_partition, headroom))
    unique = max(1, _scaled_up(stack_stats.max_unique_ids_per_partition, headroom))
    for name in stack_stats.tables:
      needed[name] = (ids, unique)
  new_tables: dict[str, TableSpec] = {}
  for table in tables_of(feature_specs):
    if table.name not in needed:
      new_tables[table.name] = table
      continue
    ids, unique = needed[table.name]
    if policy == "raise":
      ids = max(ids, table.max_ids_per_partition)
      unique = max(unique, table.max_unique_ids_per_partition)
    new_tables[table.name] = dataclasses.replace(
        table, max_ids_per_partition=ids, max_unique_ids_per_partition=unique
    )
  return tuple(
      dataclasses.replace(feature, table=new_tables[feature.table.name])
      for feature in feature_specs
  )


def _check_stats_layout(stats: PreprocessStats, layout: EmbeddingLayout) -> None:
  """Raises unless `stats` may have been collected on `layout` (see size_limits_from_stats)."""
  if not isinstance(layout, EmbeddingLayout):
    raise TypeError(f"layout must be an EmbeddingLayout or None, got {type(layout).__name__}.")
  advice = (" Per-partition figures depend on G, S and the stacking: collect the statistics on"
            " this layout (collect_stats(batches, feature_specs, layout)), or size the layout"
            " they were collected on.")
  difference = _layout_difference(stats.layout, layout)
  if difference is not None:
    raise ValueError(
        f"the statistics were collected on another layout than the one to size"
        f" ({difference}, statistics vs layout).{advice}"
    )
  stacks = {stack.name: stack.table_names for stack in layout.stacks}
  for name, stack_stats in stats.stacks.items():
    if stacks.get(name) != tuple(stack_stats.tables):
      held = "no such stack" if name not in stacks else f"tables {list(stacks[name])}"
      raise ValueError(
          f"the statistics hold stack {name!r} with tables {list(stack_stats.tables)}, but the"
          f" layout to size has {held}.{advice}"
      )
