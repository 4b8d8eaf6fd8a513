"""Embedding variables (stacked tables and slots) and their sharded creation."""

from __future__ import annotations

import inspect
import zlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from sc_framework.primitives._memory import check_fits_host_memory
from sc_framework.primitives._plan import EmbeddingPlan
from sc_framework.stacking import StackLayout, logical_rows_in_shard


class EmbeddingVariables(NamedTuple):
  """The trainable embedding state, a pytree.

  Attributes:
    tables: stack name -> [V_s, D'] stacked table, sharded over the table axis.
    slots: stack name -> slot name -> [V_s, D'] or [V_s, w] slot variable,
      in the same layout and sharding as its table.
  """

  tables: dict[str, jax.Array]
  slots: dict[str, dict[str, jax.Array]]


def table_seed(table_name: str) -> int:
  """A stable 31-bit integer for a table name (independent of the layout)."""
  if not isinstance(table_name, str):
    raise TypeError(f"table_seed takes a table name (a str), got {table_name!r}.")
  return zlib.crc32(table_name.encode("utf-8")) & 0x7FFFFFFF


def _init_local_block(plan: EmbeddingPlan, stack: StackLayout, key: jax.Array, dtype) -> jax.Array:
  """The [S * R, D'] rows of one device, inside shard_map.

  Logical row i of table t gets initializer(fold_in(key_t, i), (1, D))[0],
  with key_t = fold_in(key, crc32(t)), drawn in float32 (float64 for a
  float64 table) and rounded to the table's dtype; so values do not depend on
  the layout (stacking, G or S), a bfloat16 table starts from the float32
  table rounded, and no device ever materialises more than its rows. Padding
  rows and columns are zero.
  """
  layout = plan.layout
  num_shards = layout.num_shards
  draw_dtype = jnp.promote_types(dtype, jnp.float32)
  device = jax.lax.axis_index(plan.axis_name)
  specs = plan.tables()
  shards = []
  for local_shard in range(layout.shards_per_device):
    shard = device * layout.shards_per_device + local_shard
    parts = []
    for table in stack.tables:
      spec = specs[table.name]
      shard_rows = table.padded_vocabulary_size // num_shards
      logical = logical_rows_in_shard(jnp.arange(shard_rows, dtype=jnp.int32), shard,
                                      table.shard_rotation, num_shards)
      table_key = jax.random.fold_in(key, table_seed(table.name))

      def one_row(row, spec=spec, table_key=table_key):
        row_key = jax.random.fold_in(table_key, row)
        shape = (1, spec.embedding_dim)
        value = spec.initializer(row_key, shape, draw_dtype)
        if jnp.shape(value) != shape:
          # Broadcasting would otherwise turn it into a table of another shape.
          raise ValueError(
              f"table {spec.name!r}: its initializer returned an array of shape"
              f" {jnp.shape(value)} when asked for shape {shape}; an initializer"
              " (key, shape, dtype) -> array must return the shape it is given. To start"
              " a table from given rows (pretrained embeddings), initialise it, then pass"
              " the rows to replace_tables (Trainer.replace_tables)."
          )
        return jnp.asarray(value)[0]

      rows = jax.vmap(one_row)(logical).astype(dtype)
      rows = jnp.where((logical < table.vocabulary_size)[:, None], rows, jnp.zeros_like(rows))
      pad = stack.padded_embedding_dim - spec.embedding_dim
      parts.append(jnp.pad(rows, ((0, 0), (0, pad))))
    shards.append(jnp.concatenate(parts, axis=0))
  return jnp.concatenate(shards, axis=0)


def _probe_key(key: jax.Array) -> jax.Array:
  """A concrete key of the kind of `key` (typed, of its implementation, or raw data)."""
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    return jax.random.key(0, impl=jax.random.key_impl(key))
  return jnp.zeros(key.shape, key.dtype)


def _signature_error(initializer: Any, key: jax.Array, shape, dtype) -> TypeError | None:
  """The TypeError of calling `initializer(key, shape, dtype)` by its signature, if any."""
  try:
    signature = inspect.signature(initializer)
  except (TypeError, ValueError):  # no signature to read (a builtin): left to the call
    return None
  try:
    signature.bind(key, shape, dtype)
  except TypeError as error:
    return error
  return None


def _probe_initializers(plan: EmbeddingPlan, key: jax.Array, dtype) -> None:
  """Checks each table's initializer by its signature, and calls it once for one row
  eagerly (also while a caller traces), so that a wrong signature or non-finite values
  are named with the table."""
  draw_dtype = jnp.promote_types(dtype, jnp.float32)
  for spec in plan.tables().values():
    shape = (1, spec.embedding_dim)
    with jax.ensure_compile_time_eval():
      probe_key = _probe_key(key)
      error = _signature_error(spec.initializer, probe_key, shape, draw_dtype)
      if error is not None:
        raise TypeError(
            f"table {spec.name!r}: its initializer cannot be called as initializer(key,"
            f" shape, dtype): {error}. An initializer takes (key, shape, dtype) and returns"
            " an array of that shape, as jax.nn.initializers do."
        ) from error
      value = spec.initializer(probe_key, shape, draw_dtype)
      if jnp.shape(value) != shape:
        continue  # named with the table by the initialisation itself
      row = np.asarray(jnp.asarray(value, jnp.float32))[0]
    if not np.isfinite(row).all():
      raise ValueError(
          f"table {spec.name!r}: its initializer returned non-finite values (NaN or inf) for"
          f" a row, e.g. {row[:4].tolist()}: check its scale or parameters. Every value must"
          " be finite."
      )


def _create(plan: EmbeddingPlan, key: jax.Array, dtype) -> EmbeddingVariables:
  _probe_initializers(plan, key, dtype)
  row_spec = PartitionSpec(plan.axis_name)
  sharding = plan.row_sharding()
  tables, slots = {}, {}
  for stack in plan.layout.stacks:

    def init_block(key, stack=stack):
      return _init_local_block(plan, stack, key, dtype)

    block = jax.shard_map(
        init_block, mesh=plan.mesh, in_specs=PartitionSpec(), out_specs=row_spec, check_vma=False
    )(key)
    tables[stack.name] = jax.lax.with_sharding_constraint(block, sharding)
    stack_slots = {}
    for slot in plan.optimizer(stack.name).slots():
      shape = (stack.vocabulary_size, slot.stacked_width(stack.padded_embedding_dim))
      stack_slots[slot.name] = jax.lax.with_sharding_constraint(
          jnp.full(shape, slot.initial_value, jnp.float32), sharding
      )
    slots[stack.name] = stack_slots
  return EmbeddingVariables(tables, slots)


_create_jit = jax.jit(_create, static_argnums=(0, 2))


def embedding_variable_shapes(plan: EmbeddingPlan, *, dtype=jnp.float32) -> EmbeddingVariables:
  """The shapes, dtypes and shardings `init_embedding_variables` gives, without creating them.

  A template to restore a checkpoint into (a resumed job never computes the
  initial rows it would replace): every stack's table is [V_s, D'] of `dtype`
  and each slot [V_s, D'] or [V_s, w] float32, all sharded
  PartitionSpec(axis, None).

  Args:
    plan: the embedding plan.
    dtype: the tables' dtype (slots are float32).

  Returns:
    EmbeddingVariables of jax.ShapeDtypeStruct.
  """
  dtype = _table_dtype(dtype)
  sharding = plan.row_sharding()
  tables, slots = {}, {}
  for stack in plan.layout.stacks:
    tables[stack.name] = jax.ShapeDtypeStruct(
        (stack.vocabulary_size, stack.padded_embedding_dim), jnp.dtype(dtype), sharding=sharding)
    slots[stack.name] = {
        slot.name: jax.ShapeDtypeStruct(
            (stack.vocabulary_size, slot.stacked_width(stack.padded_embedding_dim)), jnp.float32,
            sharding=sharding)
        for slot in plan.optimizer(stack.name).slots()
    }
  return EmbeddingVariables(tables, slots)


def init_embedding_variables(
    plan: EmbeddingPlan, key: jax.Array, *, dtype=jnp.float32
) -> EmbeddingVariables:
  """Creates every stacked table and slot directly in its sharded layout.

  Each device computes only its own S * R rows of every stack (see
  `_init_local_block`); slots are filled with their declared initial values.
  Compiled once per (plan, dtype).

  Args:
    plan: the embedding plan.
    key: a PRNG key.
    dtype: the tables' dtype (slots are float32).

  Returns:
    EmbeddingVariables sharded PartitionSpec(axis, None).

  Raises:
    MemoryError: on CPU devices, tables and slots larger than the host's
      memory, naming the largest stack (`_memory.check_fits_host_memory`).
  """
  dtype = _table_dtype(dtype)
  _check_key(key)
  if not isinstance(key, jax.core.Tracer):  # under eval_shape nothing is allocated
    check_fits_host_memory(plan, embedding_variable_shapes(plan, dtype=dtype))
  return _create_jit(plan, key, dtype)


def _table_dtype(dtype) -> jnp.dtype:
  """`dtype` as a floating-point dtype, else a TypeError naming it."""
  try:
    dtype = jnp.dtype(dtype)
  except TypeError:
    raise TypeError(f"dtype must be a floating-point dtype such as jnp.float32, got {dtype!r}."
                    ) from None
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
        f"dtype must be floating point (float32, or bfloat16 tables), got {dtype.name}: integer"
        " or boolean tables would have every activation and update truncated."
    )
  return dtype


def _check_key(key) -> None:
  """A PRNG key: a typed key array (jax.random.key) or a raw uint32 key (PRNGKey), whose
  shape JAX checks against its PRNG implementation (2 words for threefry, 4 for rbg)."""
  dtype = getattr(key, "dtype", None)
  typed = dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)
  raw = dtype is not None and dtype == jnp.uint32  # its shape is the PRNG implementation's
  if not (typed or raw or isinstance(key, jax.core.Tracer)):
    raise TypeError(
        f"key must be a PRNG key such as jax.random.key(0), got {key!r}.")
