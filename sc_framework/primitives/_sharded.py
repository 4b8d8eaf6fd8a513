"""The sharded lookup and fused update, written against the row ops of `_row_ops`.

With `XLA_OPS` this is the portable implementation that runs on every
platform; the "cpu" backend passes `CPU_KERNEL_OPS`. Each function body below
runs per device inside
`shard_map` over the table axis (G devices, S shards each, N = G * S), on the
device's block of rows [S * R, D'] and its slice of the `StackBatch`
(see `sc_framework.preprocessing._batch`).

Lookup, on device g:
  1. all_to_all the requested rows `unique_rows[g]` [G, S, U] to their owners;
  2. each owner gathers the rows [G, S, U, D'] and all_to_all's them back;
  3. activations[b] = sum_{e: sample_e = b} gain_e * rows[unique_index_e]  (segment sum).

Update, on device g:
  1. per-entry gradients gain_e * dL/da[sample_e], summed per requested row
     (segment sum into [N * U, D']);
  2. all_to_all to the owners, which sum the gradients of rows requested by
     several devices (sort-based dedup; not needed when G = 1);
  3. gather the touched rows and their optimizer slots, apply the optimizer's row rule,
     scatter them back in place. Untouched rows are never written.

No array of the size of a table is created: temporaries are O(N * U * D').
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from sc_framework.preprocessing._batch import StackBatch
from sc_framework.primitives._plan import EmbeddingPlan
from sc_framework.primitives._row_ops import XLA_OPS, RowOps, update_rows
from sc_framework.primitives._state import EmbeddingVariables
from sc_framework.stacking import StackLayout


def _exchange(x: jax.Array, plan: EmbeddingPlan) -> jax.Array:
  """Sends x[h] to device h and returns [G, ...] with the block from each device."""
  if plan.num_devices == 1:
    return x
  return jax.lax.all_to_all(x, plan.axis_name, split_axis=0, concat_axis=0)


def _run(make: Callable[..., Callable[..., Any]], key: tuple, *args):
  """Calls the shard_map'd program `make(*key)`: compiled once per key when called eagerly.

  Outside any trace, shard_map runs its body op by op, compiling each op (a
  lookup or update took seconds, an update of a small table about 8 s on
  two cores); jitted, it is one compilation, and the jitted program is kept
  per (make, key), so later eager calls with the same shapes reuse it, also
  under an eager grad or vmap (which ran the body op by op too: seconds per
  call). Under a user's jit it is a nested jit, which XLA inlines.
  """
  try:
    hash(key)
  except TypeError:  # a spec holds something unhashable: compile for this call only
    return jax.jit(make(*key))(*args)
  return _jitted(make, key)(*args)


@functools.lru_cache(maxsize=64)
def _jitted(make: Callable[..., Callable[..., Any]], key: tuple) -> Callable[..., Any]:
  """jax.jit(make(*key)), one per (make, key) (a plan, its row ops and a stack)."""
  return jax.jit(make(*key))


def _owned_rows(unique_rows: jax.Array, plan: EmbeddingPlan, stack: StackLayout) -> jax.Array:
  """Device-local row indices [G * S * U] requested from this device.

  Unused capacity (-1) maps to S * R, one past the device's block, so
  gathers fill zeros there and scatters drop them.
  """
  shards_per_device = plan.layout.shards_per_device
  rows_per_shard = stack.rows_per_shard
  unique_capacity = unique_rows.shape[-1]
  requests = unique_rows.reshape(plan.num_devices, shards_per_device, unique_capacity)
  received = _exchange(requests, plan)
  base = (jnp.arange(shards_per_device, dtype=jnp.int32) * rows_per_shard)[None, :, None]
  local = jnp.where(received >= 0, base + received, shards_per_device * rows_per_shard)
  return local.reshape(-1)


def _local_lookup(plan: EmbeddingPlan, ops: RowOps, stack: StackLayout, table, unique_rows, samples,
                  unique_index, gains):
  """Per-device lookup body: returns [B_loc, D'] stacked activations."""
  unique_rows, samples, unique_index, gains = (
      unique_rows[0], samples[0], unique_index[0], gains[0])
  num_shards, unique_capacity = unique_rows.shape
  dim = table.shape[1]
  owned = _owned_rows(unique_rows, plan, stack)
  if plan.num_devices == 1:
    # Every row is local: combine each entry's row straight from the table
    # instead of materialising the [N * U, D'] unique rows first.
    source, entry_rows = table, jnp.take(owned, unique_index, mode="clip")
  else:
    rows = ops.gather_rows(table, owned).reshape(plan.num_devices, -1, dim)
    source = _exchange(rows, plan).reshape(num_shards * unique_capacity, dim)
    entry_rows = unique_index
  local_batch = stack.total_batch_size // plan.num_devices
  return ops.combine_entries(source, entry_rows, samples, gains, local_batch)


def _split_features(plan: EmbeddingPlan, stack: StackLayout, activations) -> dict[str, jax.Array]:
  out = {}
  for feature in stack.features:
    start = feature.sample_offset // plan.num_devices
    size = feature.batch_size // plan.num_devices
    dim = plan.feature(feature.name).table.embedding_dim
    out[feature.name] = activations[start : start + size, :dim]
  return out


def _join_features(plan: EmbeddingPlan, stack: StackLayout, grads: dict[str, jax.Array]):
  del plan  # the per-device program's signature; the stack says it all
  parts = []
  for feature in stack.features:
    grad = grads[feature.name]
    pad = stack.padded_embedding_dim - grad.shape[1]
    parts.append(jnp.pad(grad, ((0, 0), (0, pad))))
  return jnp.concatenate(parts, axis=0)


def _logical_columns(plan: EmbeddingPlan, stack: StackLayout, grads: jax.Array) -> jax.Array:
  """A device's stacked gradients [B_loc, D'] with the padding columns zeroed.

  Feature f's rows keep their first D_f columns; the columns beyond carry no
  meaning (the lookup leaves them 0), so they must not reach the update. A
  stack whose features all have D_f = D' is returned as it is.
  """
  width = stack.padded_embedding_dim
  dims = []
  for feature in stack.features:
    size = feature.batch_size // plan.num_devices
    dims.append(np.full(size, plan.feature(feature.name).table.embedding_dim, np.int32))
  dims = np.concatenate(dims)
  if (dims == width).all():
    return grads
  columns = np.arange(width, dtype=np.int32)
  return jnp.where(jnp.asarray(columns[None, :] < dims[:, None]), grads, 0)


def _row_dims(stack: StackLayout, owned: jax.Array) -> jax.Array:
  """The logical dimension of each owned row's table."""
  offsets = np.array([t.row_offset for t in stack.tables], np.int32)
  dims = np.array([t.embedding_dim for t in stack.tables], np.int32)
  if (dims == dims[0]).all():
    return jnp.full(owned.shape, dims[0], jnp.int32)
  row_in_shard = owned % stack.rows_per_shard
  table_index = jnp.searchsorted(jnp.asarray(offsets), row_in_shard, side="right") - 1
  return jnp.asarray(dims)[table_index]


def _local_update(
    plan: EmbeddingPlan, ops: RowOps, stack: StackLayout, table, slot_arrays, grads, unique_rows,
    samples, unique_index, gains, step,
):
  """Per-device fused gradient + optimizer update of the touched rows."""
  unique_rows, samples, unique_index, gains = unique_rows[0], samples[0], unique_index[0], gains[0]
  num_shards, unique_capacity = unique_rows.shape
  dim = table.shape[1]
  optimizer = plan.optimizer(stack.name)
  fused = ops.fused_update(optimizer, table, slot_arrays)
  if fused is not None and plan.num_devices == 1:
    # Every requested row is local and distinct: sum each row's gradient
    # from the batch entries inside the update, with no [N * U, D'] buffer.
    owned = _owned_rows(unique_rows, plan, stack)
    return fused(table, slot_arrays, owned, step, _row_dims(stack, owned),
                 entries=(grads, samples, unique_index, gains))
  row_grads = ops.segment_grads(grads, samples, unique_index, gains, num_shards * unique_capacity)
  row_grads = _exchange(row_grads.reshape(plan.num_devices, -1, dim), plan).reshape(-1, dim)
  owned = _owned_rows(unique_rows, plan, stack)
  if plan.num_devices > 1:
    # Several devices may request the same row: sum their gradients first.
    sentinel = plan.layout.shards_per_device * stack.rows_per_shard
    owned, inverse = jnp.unique(
        owned, size=owned.shape[0], fill_value=sentinel, return_inverse=True
    )
    row_grads = jax.ops.segment_sum(row_grads, inverse.reshape(-1), num_segments=owned.shape[0])
  if fused is not None:
    return fused(table, slot_arrays, owned, step, _row_dims(stack, owned), row_grads=row_grads)
  # Unused capacity holds the sentinel S * R, outside the device's rows: their
  # gathers read zeros and their writes are dropped. Real rows are distinct.
  return update_rows(ops, optimizer, table, slot_arrays, owned, step, _row_dims(stack, owned),
                     row_grads)


def _lookup_program(plan: EmbeddingPlan, ops: RowOps, stack: StackLayout,
                    per_device: Callable[..., Any]) -> Callable[..., Any]:
  """One stack's lookup over the mesh; `per_device(plan, stack, [B_loc, D'])`
  shapes each device's result (the stacked activations or their features)."""
  rows = PartitionSpec(plan.axis_name)

  def body(table, unique_rows, samples, unique_index, gains):
    return per_device(plan, stack, _local_lookup(
        plan, ops, stack, table, unique_rows, samples, unique_index, gains
    ))

  return jax.shard_map(body, mesh=plan.mesh, in_specs=(rows,) * 5, out_specs=rows,
                       check_vma=False)


def _stacked(plan: EmbeddingPlan, stack: StackLayout, activations: jax.Array) -> jax.Array:
  """A device's stacked activations [B_loc, D'] as they are (`lookup_stacks`)."""
  del plan, stack
  return activations


def _lookup(plan: EmbeddingPlan, tables: dict[str, jax.Array], batch: dict[str, StackBatch],
            ops: RowOps, per_device: Callable[..., Any]) -> dict[str, Any]:
  """Runs each stack's lookup on every device (see `_lookup_program`)."""
  return {
      stack.name: _run(_lookup_program, (plan, ops, stack, per_device), tables[stack.name],
                       *batch[stack.name])
      for stack in plan.layout.stacks
  }


def lookup(
    plan: EmbeddingPlan, tables: dict[str, jax.Array], batch: dict[str, StackBatch],
    *, ops: RowOps = XLA_OPS,
) -> dict[str, jax.Array]:
  """Activations per feature; see `sc_framework.primitives.embedding_lookup`."""
  by_stack = _lookup(plan, tables, batch, ops, _split_features)
  return {name: value for features in by_stack.values() for name, value in features.items()}


def lookup_stacks(
    plan: EmbeddingPlan, tables: dict[str, jax.Array], batch: dict[str, StackBatch],
    *, ops: RowOps = XLA_OPS,
) -> dict[str, jax.Array]:
  """Stacked activations per stack; see `sc_framework.primitives.stacked_lookup`."""
  return _lookup(plan, tables, batch, ops, _stacked)


def _per_device_program(plan: EmbeddingPlan, stack: StackLayout,
                        per_device: Callable[..., Any]) -> Callable[..., Any]:
  """`per_device(plan, stack, x)` on every device's block of x."""
  rows = PartitionSpec(plan.axis_name)
  return jax.shard_map(functools.partial(per_device, plan, stack), mesh=plan.mesh,
                       in_specs=rows, out_specs=rows, check_vma=False)


def split_stacks(plan: EmbeddingPlan, stacked: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """Stack name -> [G * B_s, D'] stacked activations -> feature -> [S_f, D_f]."""
  out = {}
  for stack in plan.layout.stacks:
    out.update(_run(_per_device_program, (plan, stack, _split_features), stacked[stack.name]))
  return out


def join_stacks(plan: EmbeddingPlan, features: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """Feature -> [S_f, D_f] -> stack name -> [G * B_s, D'] (the inverse of `split_stacks`)."""
  return {
      stack.name: _run(_per_device_program, (plan, stack, _join_features),
                       {f.name: features[f.name] for f in stack.features})
      for stack in plan.layout.stacks
  }


def _update_program(plan: EmbeddingPlan, ops: RowOps, stack: StackLayout,
                    per_device: Callable[..., Any]) -> Callable[..., Any]:
  """One stack's fused update over the mesh: (table, slots, grads, *batch, step) -> (table, slots).

  `per_device(plan, stack, grads)` turns each device's part of `grads` into
  its stacked gradients [B_loc, D'] (joins the features' gradients, or
  zeroes the padding columns of stacked ones).
  """
  rows = PartitionSpec(plan.axis_name)

  def body(table, slot_arrays, grads, unique_rows, samples, unique_index, gains, step):
    stacked = per_device(plan, stack, grads)
    return _local_update(
        plan, ops, stack, table, slot_arrays, stacked, unique_rows, samples, unique_index, gains,
        step
    )

  return jax.shard_map(
      body,
      mesh=plan.mesh,
      in_specs=(rows, rows, rows, rows, rows, rows, rows, PartitionSpec()),
      out_specs=(rows, rows),
      check_vma=False,
  )


def _apply(plan: EmbeddingPlan, variables: EmbeddingVariables, batch: dict[str, StackBatch],
           grads_of: Callable[[StackLayout], Any], step, ops: RowOps,
           per_device: Callable[..., Any]) -> EmbeddingVariables:
  """Runs each stack's update on every device (see `_update_program`)."""
  tables, slots = dict(variables.tables), dict(variables.slots)
  step = jnp.asarray(step, jnp.int32)
  for stack in plan.layout.stacks:
    tables[stack.name], slots[stack.name] = _run(
        _update_program, (plan, ops, stack, per_device), tables[stack.name], slots[stack.name],
        grads_of(stack), *batch[stack.name], step
    )
  return EmbeddingVariables(tables, slots)


def apply_gradients(
    plan: EmbeddingPlan,
    variables: EmbeddingVariables,
    batch: dict[str, StackBatch],
    activation_grads: dict[str, jax.Array],
    step: jax.Array,
    *,
    ops: RowOps = XLA_OPS,
) -> EmbeddingVariables:
  """Fused update; see `sc_framework.primitives.apply_embedding_gradients`."""
  return _apply(plan, variables, batch,
                lambda stack: {f.name: activation_grads[f.name] for f in stack.features},
                step, ops, _join_features)


def apply_stacked_gradients(
    plan: EmbeddingPlan,
    variables: EmbeddingVariables,
    batch: dict[str, StackBatch],
    stacked_grads: dict[str, jax.Array],
    step: jax.Array,
    *,
    ops: RowOps = XLA_OPS,
) -> EmbeddingVariables:
  """Fused update from per-stack gradients (`primitives.apply_stacked_gradients`)."""
  return _apply(plan, variables, batch, lambda stack: stacked_grads[stack.name], step, ops,
                _logical_columns)
