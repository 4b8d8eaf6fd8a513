"""Target layouts for a checkpoint: the same tables on other G, S or groups.

A layout is derived from table geometry alone (V and D per table), so a
checkpoint's own layout (or, for an unstacked checkpoint, its table shapes)
is enough to build any other layout of the same tables. Features are kept
from the source layout (their batch sizes only affect the sample layout,
never where rows live); an unstacked checkpoint has none, so one placeholder
feature per table (named after it, batch size G) is made.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sc_framework import FeatureSpec, TableSpec, stack_tables
from sc_framework.stacking import EmbeddingLayout, round_up


def relayout(
    layout: EmbeddingLayout,
    *,
    num_devices: int | None = None,
    shards_per_device: int | None = None,
    groups: Sequence[Sequence[str]] | None = None,
) -> EmbeddingLayout:
  """`layout`'s tables and features on other devices, shards or stacking groups.

  Args:
    layout: the source layout.
    num_devices: G of the result (default: unchanged).
    shards_per_device: S of the result (default: unchanged).
    groups: stacking groups, lists of table names (default: unchanged).

  Raises:
    ValueError: as `sc_framework.stack_tables` (unknown table, a table in
      two groups, tables of different padded dimension in one group).
  """
  tables = {}
  for stack in layout.stacks:
    for table in stack.tables:
      tables[table.name] = TableSpec(table.name, table.vocabulary_size, table.embedding_dim)
  if groups is None:
    groups = [list(stack.table_names) for stack in layout.stacks]
  groups = [[group] if isinstance(group, str) else list(group) for group in groups]
  # Features in the order of the target's tables, each table's features in
  # their old sample order: A -> B -> A gives back A's feature placements.
  by_table: dict[str, list] = {}
  for stack in layout.stacks:
    for feature in sorted(stack.features, key=lambda f: f.sample_offset):
      by_table.setdefault(feature.table, []).append(feature)
  # A table named twice keeps its first place here; `stack_tables` names both groups.
  order = list(dict.fromkeys(name for group in groups for name in group if name in tables))
  order += [name for name in tables if name not in order]
  features: list[FeatureSpec] = []
  for name in order:
    for feature in by_table.get(name, ()):
      features.append(FeatureSpec(feature.name, tables[name], (feature.batch_size,)))
    if name not in by_table:  # A table no feature reads still needs a place.
      features.append(
          FeatureSpec(_placeholder_name(name, features), tables[name], (layout.num_devices,))
      )
  _check_dims(groups, {name: spec.embedding_dim for name, spec in tables.items()})
  return stack_tables(
      features,
      groups,
      layout.num_devices if num_devices is None else num_devices,
      layout.shards_per_device if shards_per_device is None else shards_per_device,
  )


def layout_for_tables(
    tables: Mapping[str, tuple[int, int]],
    *,
    num_devices: int,
    shards_per_device: int = 1,
    groups: Sequence[Sequence[str]] | None = None,
) -> EmbeddingLayout:
  """A layout for tables known only by shape (V, D), e.g. an unstacked checkpoint.

  Args:
    tables: table name -> (V, D), in stacking order.
    num_devices, shards_per_device: G and S.
    groups: stacking groups (default: every table alone).
  """
  for name, shape in tables.items():
    if not isinstance(shape, (tuple, list)) or len(shape) != 2:
      raise ValueError(f"table {name!r}: expected its shape (vocabulary_size, embedding_dim),"
                       f" got {shape!r}.")
  specs = {name: TableSpec(name, vocab, dim) for name, (vocab, dim) in tables.items()}
  features = [FeatureSpec(name, spec, (num_devices,)) for name, spec in specs.items()]
  if groups is None:
    groups = [[name] for name in specs]
  _check_dims(groups, {name: dim for name, (_, dim) in tables.items()})
  return stack_tables(features, groups, num_devices, shards_per_device)


def parse_groups(text: str) -> list[list[str]]:
  """'a,b;c' -> [['a', 'b'], ['c']] (the CLI's --groups)."""
  groups = [
      [name.strip() for name in group.split(",") if name.strip()] for group in text.split(";")
  ]
  groups = [group for group in groups if group]
  if not groups:
    raise ValueError(f"--groups {text!r} names no table; write groups as 'a,b;c'.")
  return groups


def _check_dims(groups, dims: Mapping[str, int]) -> None:
  """Tables of one group need the same padded dimension D' = ceil(D / 8) * 8."""
  for group in groups:
    group = [group] if isinstance(group, str) else list(group)
    known = [name for name in group if name in dims]
    for name in known[1:]:
      first = known[0]
      if round_up(dims[name], 8) != round_up(dims[first], 8):
        raise ValueError(
            f"tables {first!r} (D'={round_up(dims[first], 8)}) and {name!r}"
            f" (D'={round_up(dims[name], 8)}) cannot share a stack: the tables of a stack need"
            " the same padded dimension."
        )


def _placeholder_name(table: str, features: list[FeatureSpec]) -> str:
  names = {feature.name for feature in features}
  name = table
  while name in names:
    name += "_"
  return name
