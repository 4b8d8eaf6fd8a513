"""The stacked, sharded table layout: a persisted value object.

Notation: G devices on the table axis, S shards per device,
N = G * S shards. For a table with vocabulary V and dimension D:

  V' = ceil(V / (8 N)) * 8 N        (padded vocabulary)
  D' = ceil(D / 8) * 8              (padded dimension)

Within a stack, table k (in the user's order) has

  o_k = sum_{j<k} V'_j / N          (row offset inside every shard)
  r_k = (k * S) mod N               (shard rotation)

and the stack has V_s = sum_k V'_k rows, R = V_s / N rows per shard. Logical
row i of table k lives in shard s = ((i mod N) + r_k) mod N at local row
l = floor(i / N) + o_k, i.e. at global row s * R + l of the [V_s, D'] array.
Shard s lives on device floor(s / S), which holds the contiguous rows
[d * S * R, (d + 1) * S * R).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from sc_framework._scalars import python_scalar

LAYOUT_FORMAT_VERSION = 1


def round_up(value: int, multiple: int) -> int:
  """The smallest multiple of `multiple` (a positive int) that is >= value."""
  multiple = python_scalar(multiple)
  if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
    raise ValueError(f"round_up: multiple must be a positive int, got {multiple!r}.")
  return -(-value // multiple) * multiple


def _json_int(data: dict[str, Any], key: str) -> int:
  """An int field of layout JSON, taken exactly: no truncation of 64.5, "64" or true."""
  value = data[key]
  if isinstance(value, bool) or not isinstance(value, int):
    raise TypeError(f"field {key!r} must be an integer, got {value!r}")
  return value


def _json_str(data: dict[str, Any], key: str) -> str:
  """A name field of layout JSON: a string, never a converted number or null."""
  value = data[key]
  if not isinstance(value, str):
    raise TypeError(f"field {key!r} must be a string, got {value!r}")
  return value


@dataclasses.dataclass(frozen=True)
class FeaturePlacement:
  """A feature that reads a stack: its samples start at `sample_offset`.

  Within one step, the samples of the features of a stack are concatenated in
  this order; `sample_offset` counts the samples of the features before it
  (global batch sizes). `batch_size` is the feature's stacked batch size
  (`FeatureSpec.stacked_batch_size`): B, or B * L for a sequence feature
  (one sample per position). Only the sample layout of a step depends on it;
  where rows live never does.
  """

  name: str
  table: str
  batch_size: int
  sample_offset: int


@dataclasses.dataclass(frozen=True)
class TablePlacement:
  """Where one table lives inside its stack."""

  name: str
  vocabulary_size: int
  embedding_dim: int
  padded_vocabulary_size: int
  padded_embedding_dim: int
  row_offset: int
  shard_rotation: int

  def shard_rows(self, num_shards: int) -> int:
    """V'/N: the rows (padding included) this table has in each of N shards."""
    return self.padded_vocabulary_size // num_shards


@dataclasses.dataclass(frozen=True)
class StackLayout:
  """One stack: tables sharing a [V_s, D'] array, in the user's order."""

  name: str
  tables: tuple[TablePlacement, ...]
  features: tuple[FeaturePlacement, ...]
  padded_embedding_dim: int
  num_shards: int
  rows_per_shard: int

  @property
  def vocabulary_size(self) -> int:
    """V_s: the rows of the stacked array."""
    return self.rows_per_shard * self.num_shards

  @property
  def shape(self) -> tuple[int, int]:
    return (self.vocabulary_size, self.padded_embedding_dim)

  @property
  def table_names(self) -> tuple[str, ...]:
    return tuple(table.name for table in self.tables)

  @property
  def total_batch_size(self) -> int:
    """The samples of all features of the stack, concatenated."""
    return sum(feature.batch_size for feature in self.features)

  def table(self, name: str) -> TablePlacement:
    for table in self.tables:
      if table.name == name:
        return table
    raise KeyError(f"stack {self.name!r} has no table {name!r}; it holds {list(self.table_names)}.")


@dataclasses.dataclass(frozen=True)
class EmbeddingLayout:
  """Every stack of a model on G devices with S shards per device.

  Comparable and hashable; `to_json` / `from_json` round-trip exactly.
  """

  num_devices: int
  shards_per_device: int
  stacks: tuple[StackLayout, ...]

  @property
  def num_shards(self) -> int:
    """N = G * S."""
    return self.num_devices * self.shards_per_device

  @property
  def stack_names(self) -> tuple[str, ...]:
    return tuple(stack.name for stack in self.stacks)

  @property
  def table_names(self) -> tuple[str, ...]:
    return tuple(table.name for stack in self.stacks for table in stack.tables)

  @property
  def feature_names(self) -> tuple[str, ...]:
    return tuple(feature.name for stack in self.stacks for feature in stack.features)

  def stack(self, name: str) -> StackLayout:
    for stack in self.stacks:
      if stack.name == name:
        return stack
    raise KeyError(f"the layout has no stack {name!r}; its stacks are {list(self.stack_names)}.")

  def stack_of_table(self, table_name: str) -> StackLayout:
    for stack in self.stacks:
      if table_name in stack.table_names:
        return stack
    raise KeyError(
        f"the layout has no table {table_name!r}; its tables are {list(self.table_names)}."
    )

  def table(self, table_name: str) -> TablePlacement:
    return self.stack_of_table(table_name).table(table_name)

  def stack_of_feature(self, feature_name: str) -> StackLayout:
    for stack in self.stacks:
      for feature in stack.features:
        if feature.name == feature_name:
          return stack
    raise KeyError(
        f"the layout has no feature {feature_name!r}; its features are {list(self.feature_names)}."
    )

  def feature(self, feature_name: str) -> FeaturePlacement:
    for feature in self.stack_of_feature(feature_name).features:
      if feature.name == feature_name:
        return feature
    raise AssertionError("unreachable")

  def table_geometry(self) -> dict[str, tuple[str, int, int, int, int, int, int]]:
    """Per table: (stack, V, D, V', D', o, r): what a checkpoint must match."""
    return {
        table.name: (
            stack.name,
            table.vocabulary_size,
            table.embedding_dim,
            table.padded_vocabulary_size,
            table.padded_embedding_dim,
            table.row_offset,
            table.shard_rotation,
        )
        for stack in self.stacks
        for table in stack.tables
    }

  # --- JSON ---------------------------------------------------------------

  def to_dict(self) -> dict[str, Any]:
    return {
        "format_version": LAYOUT_FORMAT_VERSION,
        "num_devices": self.num_devices,
        "shards_per_device": self.shards_per_device,
        "stacks": [
            {
                "name": stack.name,
                "padded_embedding_dim": stack.padded_embedding_dim,
                "num_shards": stack.num_shards,
                "rows_per_shard": stack.rows_per_shard,
                "tables": [
                    {
                        "name": t.name,
                        "vocabulary_size": t.vocabulary_size,
                        "embedding_dim": t.embedding_dim,
                        "padded_vocabulary_size": t.padded_vocabulary_size,
                        "padded_embedding_dim": t.padded_embedding_dim,
                        "row_offset": t.row_offset,
                        "shard_rotation": t.shard_rotation,
                    }
                    for t in stack.tables
                ],
                "features": [dataclasses.asdict(f) for f in stack.features],
            }
            for stack in self.stacks
        ],
    }

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), indent=1, sort_keys=True)

  @classmethod
  def from_dict(cls, data: dict[str, Any]) -> "EmbeddingLayout":
    if not isinstance(data, dict):
      raise ValueError(f"malformed layout JSON: expected an object, got {type(data).__name__}.")
    try:
      version = data.get("format_version")
      if version != LAYOUT_FORMAT_VERSION:
        raise ValueError(
            f"layout format_version {version!r} is not supported; this library reads version"
            f" {LAYOUT_FORMAT_VERSION}."
        )
      num_devices = _json_int(data, "num_devices")
      shards_per_device = _json_int(data, "shards_per_device")
      stacks = []
      for stack in data["stacks"]:
        num_shards = _json_int(stack, "num_shards")
        tables = tuple(
            TablePlacement(
                name=_json_str(t, "name"),
                vocabulary_size=_json_int(t, "vocabulary_size"),
                embedding_dim=_json_int(t, "embedding_dim"),
                padded_vocabulary_size=_json_int(t, "padded_vocabulary_size"),
                padded_embedding_dim=_json_int(t, "padded_embedding_dim"),
                row_offset=_json_int(t, "row_offset"),
                shard_rotation=_json_int(t, "shard_rotation"),
            )
            for t in stack["tables"]
        )
        features = tuple(
            FeaturePlacement(
                name=_json_str(f, "name"),
                table=_json_str(f, "table"),
                batch_size=_json_int(f, "batch_size"),
                sample_offset=_json_int(f, "sample_offset"),
            )
            for f in stack["features"]
        )
        stacks.append(
            StackLayout(
                name=_json_str(stack, "name"),
                tables=tables,
                features=features,
                padded_embedding_dim=_json_int(stack, "padded_embedding_dim"),
                num_shards=num_shards,
                rows_per_shard=_json_int(stack, "rows_per_shard"),
            )
        )
    except (KeyError, TypeError) as error:
      raise ValueError(f"malformed layout JSON: missing or invalid field ({error!r}).") from error
    layout = cls(num_devices, shards_per_device, tuple(stacks))
    check_layout(layout)
    return layout

  @classmethod
  def from_json(cls, text: str) -> "EmbeddingLayout":
    try:
      data = json.loads(text)
    except json.JSONDecodeError as error:
      raise ValueError(f"layout is not valid JSON: {error}") from error
    return cls.from_dict(data)


MAX_ROWS_PER_DEVICE = 2**31 - 1
# S is the SparseCores of one chip (4 on v5p, 2 on v6e; 1 on CPU/GPU). The
# programs and checkpoints hold one block per shard, and every table is padded
# to 8 N rows: a mistyped S of millions compiles for hours or fills a disk.
# Checked where a layout is built from arguments, not where one is read (a
# stored layout of more shards still opens, to be converted).
MAX_SHARDS_PER_DEVICE = 64


def check_rows_addressable(layout: EmbeddingLayout) -> None:
  """Verifies that every stack's rows on one device, S * R, fit int32 indices.

  The device computations and the preprocessed batches index a device's
  block of a stack with int32 (local rows in [0, R), and S * R as the
  "no row" marker), so S * R must not exceed 2^31 - 1.

  Raises:
    ValueError: naming the stack, its S * R and how many devices would do.
  """
  for stack in layout.stacks:
    per_device = layout.shards_per_device * stack.rows_per_shard
    if per_device > MAX_ROWS_PER_DEVICE:
      needed = -(-stack.vocabulary_size // MAX_ROWS_PER_DEVICE)
      raise ValueError(
          f"layout stack {stack.name!r} (tables {list(stack.table_names)}) puts"
          f" {per_device:,} rows on each of its {layout.num_devices} devices; row indices are"
          f" int32, so at most {MAX_ROWS_PER_DEVICE:,} fit one device. Shard it over at least"
          f" {needed} devices, or stack fewer tables together."
      )


def check_shards_per_device(shards_per_device: int, what: str = "shards_per_device") -> None:
  """Raises ValueError when S exceeds MAX_SHARDS_PER_DEVICE (see there), naming `what`."""
  if shards_per_device > MAX_SHARDS_PER_DEVICE:
    raise ValueError(
        f"{what} is {shards_per_device:,}; at most {MAX_SHARDS_PER_DEVICE} are supported. S is"
        " the number of shards each device holds, the SparseCores of one TPU chip (4 on v5p,"
        " 2 on v6e) and 1 on CPU and GPU."
    )


def check_layout(layout: EmbeddingLayout) -> None:
  """Verifies every derived quantity of a layout against the formulas above.

  Raises:
    ValueError: naming the stack, table or feature whose stored value is
      inconsistent (as from a hand-edited or corrupt layout JSON).
  """
  g, s = layout.num_devices, layout.shards_per_device
  if g <= 0 or s <= 0:
    raise ValueError(f"layout: num_devices and shards_per_device must be > 0, got {g} and {s}.")
  n = g * s
  names: set[str] = set()
  stack_names: set[str] = set()
  feature_names: set[str] = set()
  for stack in layout.stacks:
    if stack.name in stack_names:
      raise ValueError(f"layout: stack name {stack.name!r} appears twice.")
    stack_names.add(stack.name)
    if stack.num_shards != n:
      raise ValueError(f"layout stack {stack.name!r}: num_shards {stack.num_shards} != G*S = {n}.")
    if not stack.tables:
      raise ValueError(f"layout stack {stack.name!r} holds no tables.")
    offset = 0
    for k, table in enumerate(stack.tables):
      if table.name in names:
        raise ValueError(f"layout: table {table.name!r} appears twice.")
      names.add(table.name)
      if table.vocabulary_size <= 0 or table.embedding_dim <= 0:
        raise ValueError(
            f"layout stack {stack.name!r} table {table.name!r}: vocabulary_size and embedding_dim"
            f" must be > 0, got {table.vocabulary_size} and {table.embedding_dim}."
        )
      expected = (
          round_up(table.vocabulary_size, 8 * n),
          round_up(table.embedding_dim, 8),
          offset,
          (k * s) % n,
      )
      actual = (
          table.padded_vocabulary_size,
          table.padded_embedding_dim,
          table.row_offset,
          table.shard_rotation,
      )
      if expected != actual or table.padded_embedding_dim != stack.padded_embedding_dim:
        raise ValueError(
            f"layout stack {stack.name!r} table {table.name!r}: stored (V', D', o, r) = {actual}"
            f" but the layout rules give {expected} with D' = {stack.padded_embedding_dim}."
        )
      offset += table.padded_vocabulary_size // n
    if offset != stack.rows_per_shard:
      raise ValueError(
          f"layout stack {stack.name!r}: rows_per_shard {stack.rows_per_shard} != {offset}."
      )
    sample_offset = 0
    for feature in stack.features:
      if feature.name in feature_names:
        raise ValueError(f"layout: feature {feature.name!r} appears twice.")
      feature_names.add(feature.name)
      if feature.table not in stack.table_names:
        raise ValueError(
            f"layout stack {stack.name!r} feature {feature.name!r}: reads table {feature.table!r},"
            f" which is not in the stack ({list(stack.table_names)})."
        )
      if feature.batch_size <= 0 or feature.sample_offset != sample_offset:
        raise ValueError(
            f"layout stack {stack.name!r} feature {feature.name!r}: stored (batch_size,"
            f" sample_offset) = ({feature.batch_size}, {feature.sample_offset}); expected a"
            f" batch_size > 0 and sample_offset {sample_offset} (the batch sizes of the"
            " features before it)."
        )
      sample_offset += feature.batch_size
