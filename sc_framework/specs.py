"""Table and feature specs, and their validation.

A `TableSpec` describes one embedding table (its vocabulary, dimension,
initializer, sparse optimizer and combiner); a `FeatureSpec` describes one
sparse input feature that reads a table. Several features may share a table.
Specs are frozen, hashable dataclasses so they can be static under `jit`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Literal

import jax
import jax.numpy as jnp

from sc_framework._renamed import refusing_renamed, use_instead
from sc_framework._scalars import python_scalar, python_scalar_fields
from sc_framework.optimizers import SGD, OptimizerSpec

Combiner = Literal["sum", "mean", "sqrtn"]
COMBINERS: tuple[str, ...] = ("sum", "mean", "sqrtn")
Initializer = Callable[[jax.Array, tuple[int, ...], jnp.dtype], jax.Array]


def default_initializer(key: jax.Array, shape: tuple[int, ...], dtype=jnp.float32) -> jax.Array:
  """Normal of standard deviation sigma = 1/sqrt(D), truncated to [-2 sigma, 2 sigma].

  D = shape[-1]. The truncation narrows the values' own standard deviation to about
  0.88 sigma (that of a standard normal cut at +-2 is 0.8796).
  """
  stddev = 1.0 / max(shape[-1], 1) ** 0.5
  return jax.nn.initializers.truncated_normal(stddev)(key, shape, dtype)


# The partition limits size int32-indexed buffers: larger ones can never be allocated.
MAX_PARTITION_CAPACITY = 2**31 - 1


def _check_positive_int(owner: str, name: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
    raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}.")


def _check_shape_tuple(owner: str, name: str, value, examples: str) -> None:
  """Raises TypeError for a shape that is no sequence of sizes (a string, a number)."""
  if isinstance(value, (str, bytes)) or not (
      isinstance(value, Sequence) or hasattr(value, "__array__")):
    raise TypeError(f"{owner}: {name} must be a tuple such as {examples}, got {value!r}.")


def check_partition_limit(owner: str, name: str, value) -> None:
  """A positive int of at most MAX_PARTITION_CAPACITY (the buffers' int32 indices)."""
  _check_positive_int(owner, name, value)
  if value > MAX_PARTITION_CAPACITY:
    digits = str(value)
    shown = value if value < 10**15 else f"about {digits[0]}e{len(digits) - 1}"
    raise ValueError(
        f"{owner}: {name} is {shown}, more than the {MAX_PARTITION_CAPACITY} entries int32"
        " buffers index; limits are ids per step and partition (size_limits_from_stats"
        " computes them from a few batches)."
    )


_TABLE_RENAMED = {
    "suggested_coo_buffer_size": (
        "not needed here: preprocessing sizes its buffers from max_ids_per_partition and"
        " max_unique_ids_per_partition (size_limits_from_stats computes them from batches)."),
    "quantization_config": (
        "quantized tables are not supported; tables are float32, or bfloat16 with the"
        " Trainer's table_dtype=\"bfloat16\"."),
}


def _refuse_sparsecore_order(args: tuple) -> None:
  """TableSpec(1000, 16, ...): jax-tpu-embedding's order (vocabulary_size first)."""
  if args and isinstance(args[0], int) and not isinstance(args[0], bool):
    raise ValueError(
        f"TableSpec: name must be a non-empty string, got {args[0]!r}. TableSpec's fields"
        " start with name, vocabulary_size, embedding_dim (jax-tpu-embedding's start with"
        " vocabulary_size): pass them by keyword."
    )


@refusing_renamed(_TABLE_RENAMED, _refuse_sparsecore_order)
@dataclasses.dataclass(frozen=True)
class TableSpec:
  """One embedding table.

  Attributes:
    name: unique among the tables of a model.
    vocabulary_size: V, the number of logical rows; ids must be in [0, V).
    embedding_dim: D, the number of logical columns.
    initializer: `(key, shape, dtype) -> array`, called once per logical row
      with shape (1, D) and a key of the row's own (from the table's name
      and the row index), so a row's initial values do not depend on the
      stacking or the device count. Initializers that scale by the fans of
      `shape` see fan_in = 1 and fan_out = D: glorot_*, he_*, lecun_* and
      orthogonal (a unit row) do not give the scale they give a (V, D)
      array. The default scales by D (a normal of sigma 1/sqrt(D), cut at
      2 sigma); `jax.nn.initializers.variance_scaling(1.0, "fan_out",
      "normal")` gives a standard deviation of 1/sqrt(D), uncut.
    optimizer: the sparse optimizer applied to this table's touched rows.
    combiner: how a sample's rows are combined: 'sum' (sum of w_j x_j),
      'mean' (sum of w_j x_j / sum of w_j) or 'sqrtn'
      (sum of w_j x_j / sqrt(sum of w_j^2)).
    max_ids_per_partition: static capacity for the ids one device sends to one
      shard of the table's stack per step (see preprocessing).
    max_unique_ids_per_partition: static capacity for the distinct rows one
      device requests from one shard per step.
  """

  name: str
  vocabulary_size: int
  embedding_dim: int
  initializer: Initializer = default_initializer
  optimizer: OptimizerSpec = dataclasses.field(default_factory=SGD)
  combiner: Combiner = "sum"
  max_ids_per_partition: int = 256
  max_unique_ids_per_partition: int = 256

  def __post_init__(self):
    python_scalar_fields(self)
    if not isinstance(self.name, str) or not self.name:
      raise ValueError(f"TableSpec: name must be a non-empty string, got {self.name!r}.")
    owner = f"table {self.name!r}"
    _check_positive_int(owner, "vocabulary_size", self.vocabulary_size)
    _check_positive_int(owner, "embedding_dim", self.embedding_dim)
    check_partition_limit(owner, "max_ids_per_partition", self.max_ids_per_partition)
    check_partition_limit(owner, "max_unique_ids_per_partition", self.max_unique_ids_per_partition)
    if self.combiner not in COMBINERS:
      raise ValueError(f"{owner}: unknown combiner {self.combiner!r}; expected one of {COMBINERS}.")
    if not isinstance(self.optimizer, OptimizerSpec):
      raise TypeError(
          f"{owner}: optimizer must be an optimizer spec such as"
          f" sc_framework.optimizers.SGD(...), got {type(self.optimizer).__name__}."
      )
    if not callable(self.initializer):
      raise TypeError(f"{owner}: initializer must be callable (key, shape, dtype) -> array.")


@refusing_renamed({"table_spec": use_instead("table", "table_spec")})
@dataclasses.dataclass(frozen=True)
class FeatureSpec:
  """One sparse input feature, read through a table.

  A feature is either combined or a sequence feature:

  * combined, output (B, D): the ids of sample b are combined by the table's
    combiner, a[b] = sum_j gain_j * T[i_j] (see `TableSpec.combiner`);
  * sequence, output (B, L, D): no combiner, one row per position,
    a[b, l] = w_{b,l} * T[i_{b,l}] (w = 1 without weights); a position
    without an id (a padding id, past the end of a shorter ragged sample, or
    absent from a COO input) gives a zero vector and no gradient. The
    table's combiner is ignored for such a feature, so it may share a table
    and a stack with combined features.

  Attributes:
    name: unique among the features of a model.
    table: the table the feature reads.
    input_shape: (batch, max ids per sample), or (batch,) / (batch, None) for
      any number of ids per sample. Preprocessing refuses a sample with more
      ids than the maximum (padding ids do not count, so a dense array may
      be wider). A sequence feature needs (batch, sequence length L).
    output_shape: (batch, embedding_dim) for a combined feature (the
      default), or (batch, L, embedding_dim) for a sequence feature.
  """

  name: str
  table: TableSpec
  input_shape: tuple[int, ...]
  output_shape: tuple[int, ...] | None = None

  def __post_init__(self):
    python_scalar_fields(self)
    if not isinstance(self.name, str) or not self.name:
      raise ValueError(f"FeatureSpec: name must be a non-empty string, got {self.name!r}.")
    owner = f"feature {self.name!r}"
    if not isinstance(self.table, TableSpec):
      raise TypeError(f"{owner}: table must be a TableSpec, got {type(self.table).__name__}.")
    _check_shape_tuple(owner, "input_shape", self.input_shape,
                       "(batch, max ids per sample) or (batch, None)")
    input_shape = tuple(python_scalar(size) for size in self.input_shape)
    if len(input_shape) not in (1, 2):
      raise ValueError(
          f"{owner}: input_shape must be (batch,) or (batch, max_ids_per_sample), got {input_shape}."
      )
    _check_positive_int(owner, "input_shape[0] (batch size)", input_shape[0])
    if len(input_shape) == 2 and input_shape[1] is not None:
      _check_positive_int(owner, "input_shape[1] (max ids per sample)", input_shape[1])
    object.__setattr__(self, "input_shape", input_shape)
    output_shape = self.output_shape
    if output_shape is None:
      output_shape = (input_shape[0], self.table.embedding_dim)
    _check_shape_tuple(owner, "output_shape", output_shape,
                       "(batch, dim) or (batch, sequence_length, dim)")
    output_shape = tuple(python_scalar(size) for size in output_shape)
    object.__setattr__(self, "output_shape", output_shape)
    dim = self.table.embedding_dim
    if len(output_shape) not in (2, 3):
      raise ValueError(
          f"{owner}: output_shape must be (batch, dim) for a combined feature or (batch,"
          f" sequence_length, dim) for a sequence feature, got {output_shape}."
      )
    for position, size in enumerate(output_shape):
      _check_positive_int(owner, f"output_shape[{position}]", size)
    if len(output_shape) == 3:
      self._check_sequence_shapes(owner)
    if output_shape[-1] != dim:
      expected = output_shape[:-1] + (dim,)
      raise ValueError(
          f"{owner}: output dim {output_shape[-1]} differs from table {self.table.name!r}"
          f" (embedding_dim {dim}). Set output_shape={expected} or change the table."
      )
    if output_shape[0] != input_shape[0]:
      flattened = (len(output_shape) == 2 and len(input_shape) == 2 and input_shape[1] is not None
                   and output_shape[0] == input_shape[0] * input_shape[1])
      hint = (f" For one embedding per position (a sequence feature), set output_shape="
              f"{(input_shape[0], input_shape[1], dim)} and flatten the activations in the"
              " model." if flattened else "")
      raise ValueError(
          f"{owner}: output batch {output_shape[0]} differs from input batch {input_shape[0]}."
          + hint
      )

  def _check_sequence_shapes(self, owner: str) -> None:
    """Output (B, L, D) needs input (B, L) with the same, fixed L."""
    batch, length, dim = self.output_shape
    if len(self.input_shape) != 2 or self.input_shape[1] is None:
      raise ValueError(
          f"{owner}: a sequence feature (output_shape {self.output_shape}) needs input_shape"
          f" (batch, sequence_length) = ({batch}, {length}), got {self.input_shape}."
      )
    if length != self.input_shape[1]:
      raise ValueError(
          f"{owner}: output_shape {self.output_shape} has sequence length {length} but"
          f" input_shape {self.input_shape} has {self.input_shape[1]}; a sequence feature looks"
          f" up one row per input position. Use input_shape=({self.input_shape[0]}, {length})."
      )

  @property
  def batch_size(self) -> int:
    """B, the samples of one (global) batch."""
    return self.input_shape[0]

  @property
  def sequence_length(self) -> int | None:
    """L of a sequence feature (output (B, L, D)); None for a combined feature."""
    return self.output_shape[1] if len(self.output_shape) == 3 else None

  @property
  def stacked_batch_size(self) -> int:
    """The rows the feature adds to its stack's sample dimension in one step.

    B for a combined feature; B * L for a sequence feature, whose position l
    of sample b is stack sample b * L + l (within the feature's block): a bag
    of at most one id. It sizes the samples of a step (the layout's feature
    placements record it); where table rows live never depends on it, so the
    stored tables are the same for either kind of feature.
    """
    return self.batch_size * (self.sequence_length or 1)


def tables_of(feature_specs: Sequence[FeatureSpec]) -> tuple[TableSpec, ...]:
  """The distinct tables read by `feature_specs`, in order of first use."""
  tables: dict[str, TableSpec] = {}
  for feature in feature_specs:
    tables.setdefault(feature.table.name, feature.table)
  return tuple(tables.values())


def validate_feature_specs(feature_specs: Sequence[FeatureSpec]) -> tuple[FeatureSpec, ...]:
  """Checks a model's features as a whole and returns them as a tuple.

  Raises:
    TypeError: a nested structure (a dict) or a single FeatureSpec, or a value
      that is no FeatureSpec.
    ValueError: no features, duplicate feature names, or two different tables
      with the same name.
  """
  if isinstance(feature_specs, (Mapping, FeatureSpec)):
    given = "a FeatureSpec" if isinstance(feature_specs, FeatureSpec) else (
        f"a {type(feature_specs).__name__} (keys {list(feature_specs)[:5]})")
    raise TypeError(
        f"feature_specs must be a flat sequence of FeatureSpecs, got {given}. Pass"
        " jax.tree.leaves(specs) for a nested structure (the Trainer takes one as it is), or"
        " [spec] for one feature.")
  if isinstance(feature_specs, (str, bytes)) or not isinstance(feature_specs, Iterable):
    raise TypeError(
        f"feature_specs must be a sequence of FeatureSpecs, got {feature_specs!r}.")
  features = tuple(feature_specs)
  if not features:
    raise ValueError("feature_specs is empty: a model needs at least one FeatureSpec.")
  seen_features: set[str] = set()
  seen_tables: dict[str, tuple[TableSpec, str]] = {}
  for feature in features:
    if not isinstance(feature, FeatureSpec):
      raise TypeError(f"feature_specs must hold FeatureSpec values, got {type(feature).__name__}.")
    if feature.name in seen_features:
      raise ValueError(f"duplicate feature name {feature.name!r}: feature names must be unique.")
    seen_features.add(feature.name)
    table = feature.table
    previous, first_reader = seen_tables.setdefault(table.name, (table, feature.name))
    if previous != table:
      raise ValueError(
          f"duplicate table name {table.name!r}: features {first_reader!r} and"
          f" {feature.name!r} read two different TableSpecs with this name. Give each table a"
          " unique name, or pass the same TableSpec object to every feature that shares it."
      )
  return features
