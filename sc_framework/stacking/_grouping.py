"""Which tables share a stack, and the layout that results.

Tables may share a stack only if they have the same padded dimension D', the
same optimizer (kind and hyperparameters) and the same combiner. Inside a
stack, tables keep the order in which the user first gave them.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

from sc_framework._renamed import SHARDS_RENAMED, refusing_renamed_keywords
from sc_framework._scalars import python_scalar
from sc_framework.specs import FeatureSpec, TableSpec, tables_of, validate_feature_specs
from sc_framework.stacking._layout import (
    EmbeddingLayout,
    FeaturePlacement,
    StackLayout,
    TablePlacement,
    check_layout,
    check_shards_per_device,
    round_up,
)

MAX_STACK_NAME_LENGTH = 64


def stack_name(table_names: Sequence[str], *, max_length: int = MAX_STACK_NAME_LENGTH) -> str:
  """A deterministic, readable stack name: the table names joined by '__'.

  A joined name longer than `max_length` is cut and suffixed with 10 hex
  digits of the SHA-256 of the full name, so it stays unique.
  """
  joined = "__".join(table_names)
  if len(joined) <= max_length:
    return joined
  digest = hashlib.sha256(joined.encode("utf-8")).hexdigest()[:10]
  return f"{joined[: max_length - 12]}__{digest}"


def stacking_key(table: TableSpec) -> tuple:
  """Tables with equal keys may share a stack (the stacking rule)."""
  return (round_up(table.embedding_dim, 8), table.optimizer, table.combiner)


def _check_stackable(first: TableSpec, other: TableSpec, where: str) -> None:
  """Raises ValueError (prefixed by `where`) unless the two tables may share a stack."""
  if stacking_key(other) == stacking_key(first):
    return
  raise ValueError(
      f"{where}tables {first.name!r} and {other.name!r} cannot share a stack: they need the"
      " same padded dimension, optimizer and combiner, got"
      f" (D'={round_up(first.embedding_dim, 8)}, {first.optimizer}, {first.combiner!r}) and"
      f" (D'={round_up(other.embedding_dim, 8)}, {other.optimizer}, {other.combiner!r})."
      f"{_functions_hint(first.optimizer, other.optimizer)}"
      " Stack only tables with equal keys (auto_stack_tables does)."
  )


def _functions_hint(first: Any, other: Any) -> str:
  """Why two optimizers equal but for their functions (schedules, update_fn) differ."""
  if type(first) is not type(other) or not dataclasses.is_dataclass(first) or first == other:
    return ""
  differing = [field.name for field in dataclasses.fields(first)
               if getattr(first, field.name) != getattr(other, field.name)]
  if not differing or not all(callable(getattr(first, name)) and callable(getattr(other, name))
                             for name in differing):
    return ""
  return (
      f" Their optimizers differ only in {', '.join(differing)}: functions compare by"
      " identity, so two equal lambdas differ. Give both tables the same function (define it"
      " once) or the same optimizer object."
  )


def _checked_devices(num_devices: int, shards_per_device: int) -> tuple[int, int]:
  """(G, S) as Python ints; ValueError unless both are positive integers."""
  checked = []
  for name, value in (("num_devices", num_devices), ("shards_per_device", shards_per_device)):
    value = python_scalar(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
      raise ValueError(f"{name} must be a positive int, got {value!r}.")
    checked.append(value)
  check_shards_per_device(checked[1])
  return checked[0], checked[1]


def _build_layout(
    features: tuple[FeatureSpec, ...],
    groups: Sequence[Sequence[TableSpec]],
    num_devices: int,
    shards_per_device: int,
) -> EmbeddingLayout:
  num_shards = num_devices * shards_per_device
  stacks = []
  for group in groups:
    placements = []
    offset = 0
    for k, table in enumerate(group):
      padded_vocab = round_up(table.vocabulary_size, 8 * num_shards)
      placements.append(
          TablePlacement(
              name=table.name,
              vocabulary_size=table.vocabulary_size,
              embedding_dim=table.embedding_dim,
              padded_vocabulary_size=padded_vocab,
              padded_embedding_dim=round_up(table.embedding_dim, 8),
              row_offset=offset,
              shard_rotation=(k * shards_per_device) % num_shards,
          )
      )
      offset += padded_vocab // num_shards
    names = {table.name for table in group}
    feature_placements = []
    sample_offset = 0
    for feature in features:
      if feature.table.name in names:
        feature_placements.append(
            FeaturePlacement(
                feature.name, feature.table.name, feature.stacked_batch_size, sample_offset
            )
        )
        sample_offset += feature.stacked_batch_size
    stacks.append(
        StackLayout(
            name=stack_name([table.name for table in group]),
            tables=tuple(placements),
            features=tuple(feature_placements),
            padded_embedding_dim=placements[0].padded_embedding_dim,
            num_shards=num_shards,
            rows_per_shard=offset,
        )
    )
  stack_names = [stack.name for stack in stacks]
  if len(set(stack_names)) != len(stack_names):
    raise ValueError(f"stack names collide: {stack_names}. Rename the tables involved.")
  layout = EmbeddingLayout(num_devices, shards_per_device, tuple(stacks))
  check_layout(layout)
  return layout


@refusing_renamed_keywords(SHARDS_RENAMED)
def stack_tables(
    feature_specs: Sequence[FeatureSpec],
    groups: Sequence[Sequence[str]],
    num_devices: int,
    shards_per_device: int = 1,
) -> EmbeddingLayout:
  """Stacks tables by an explicit list of groups of table names.

  Every table read by `feature_specs` must appear in exactly one group; a
  table alone in its group is a stack of one. Inside a group, tables keep the
  order given in the group.

  Raises:
    ValueError: an unknown or missing table, a table in two groups, an empty
      group, or a group whose tables may not share a stack (different padded
      dimension, optimizer or combiner).
  """
  features = validate_feature_specs(feature_specs)
  num_devices, shards_per_device = _checked_devices(num_devices, shards_per_device)
  tables = {table.name: table for table in tables_of(features)}
  seen: dict[str, int] = {}
  table_groups = []
  for index, group in enumerate(groups):
    group = [group] if isinstance(group, str) else list(group)
    if not group:
      raise ValueError(f"stacking group {index} is empty.")
    for name in group:
      if name not in tables:
        raise ValueError(
            f"stacking group {index} names table {name!r}, which no feature reads; known"
            f" tables: {sorted(tables)}."
        )
      if name in seen:
        where = (f"twice in stacking group {index}" if seen[name] == index
                 else f"in stacking groups {seen[name]} and {index}")
        raise ValueError(f"table {name!r} is {where}: name each table in one group, once.")
      seen[name] = index
    for name in group[1:]:
      _check_stackable(tables[group[0]], tables[name], "")
    table_groups.append([tables[name] for name in group])
  missing = [name for name in tables if name not in seen]
  if missing:
    raise ValueError(
        f"tables {missing} are in no stacking group; put each in a group (alone if need be)."
    )
  return _build_layout(features, table_groups, num_devices, shards_per_device)


@refusing_renamed_keywords(SHARDS_RENAMED)
def auto_stack_tables(
    feature_specs: Sequence[FeatureSpec],
    num_devices: int,
    shards_per_device: int = 1,
) -> EmbeddingLayout:
  """Stacks every group of compatible tables together.

  Tables are grouped by (padded dimension, optimizer, combiner); groups are
  ordered by their first table, and tables keep the order in which the
  features first read them.
  """
  features = validate_feature_specs(feature_specs)
  num_devices, shards_per_device = _checked_devices(num_devices, shards_per_device)
  groups: dict[tuple, list[TableSpec]] = {}
  for table in tables_of(features):
    groups.setdefault(stacking_key(table), []).append(table)
  return _build_layout(features, list(groups.values()), num_devices, shards_per_device)


def unstacked_layout(
    feature_specs: Sequence[FeatureSpec],
    num_devices: int,
    shards_per_device: int = 1,
) -> EmbeddingLayout:
  """Every table in a stack of its own."""
  features = validate_feature_specs(feature_specs)
  num_devices, shards_per_device = _checked_devices(num_devices, shards_per_device)
  return _build_layout(features, [[t] for t in tables_of(features)], num_devices, shards_per_device)


def check_layout_fits_specs(layout: EmbeddingLayout, feature_specs: Sequence[FeatureSpec]) -> None:
  """Verifies that a layout (built elsewhere, or read from JSON) fits the specs.

  The layout must hold exactly the specs' tables and features; every table
  must have its spec's vocabulary_size and embedding_dim; every feature must
  read its spec's table with its spec's batch size; and the tables of one
  stack must share a stacking key (padded dimension, optimizer, combiner),
  since a stack is trained with one optimizer and one combiner.

  Raises:
    ValueError: naming the stack, table or feature and both values.
  """
  features = validate_feature_specs(feature_specs)
  tables = {table.name: table for table in tables_of(features)}
  if set(layout.table_names) != set(tables):
    raise ValueError(
        f"the layout's tables {sorted(layout.table_names)} differ from the features' tables"
        f" {sorted(tables)}."
    )
  placed = {f.name: f for stack in layout.stacks for f in stack.features}
  if set(placed) != {f.name for f in features}:
    raise ValueError(
        f"the layout's features {sorted(placed)} differ from the specs' features"
        f" {sorted(f.name for f in features)}."
    )
  for feature in features:
    placement = placed[feature.name]
    expected = (feature.table.name, feature.stacked_batch_size)
    if (placement.table, placement.batch_size) != expected:
      raise ValueError(
          f"feature {feature.name!r}: the layout has it read table {placement.table!r} with"
          f" batch size {placement.batch_size}, but its spec reads {feature.table.name!r} with"
          f" batch size {feature.stacked_batch_size} (stacked samples: the batch, times L for a"
          f" sequence feature; output_shape {feature.output_shape}). Build the layout from"
          " these specs."
      )
  for stack in layout.stacks:
    first = tables[stack.tables[0].name]
    for placement in stack.tables:
      spec = tables[placement.name]
      stored = (placement.vocabulary_size, placement.embedding_dim)
      if stored != (spec.vocabulary_size, spec.embedding_dim):
        raise ValueError(
            f"layout stack {stack.name!r} table {spec.name!r}: (vocabulary_size, embedding_dim)"
            f" is {stored} in the layout but {(spec.vocabulary_size, spec.embedding_dim)} in"
            " its spec. Build the layout from these specs."
        )
      _check_stackable(first, spec, f"layout stack {stack.name!r}: ")
