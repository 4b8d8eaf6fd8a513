"""Per-table host arrays out of and into the stacked, sharded embedding variables.

The variables hold each stack as one [V_s, D'] array sharded by rows over the
plan's devices (the layout of `sc_framework.stacking`); a user thinks in
tables. `table_values` and `slot_values` give a table's [V, D] rows (and its
optimizer slots, [V, D] or [V, w]) as numpy arrays, padding removed;
`replace_tables` starts a table from given rows (pretrained embeddings, a
table of another model), each device taking only the rows it holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from sc_framework.optimizers import SlotSpec
from sc_framework.primitives._plan import EmbeddingPlan
from sc_framework.primitives._state import EmbeddingVariables
from sc_framework.stacking import EmbeddingLayout, table_rows_in_block, unstack


def _table_names(layout: EmbeddingLayout, tables: Iterable[str] | None, what: str) -> list[str]:
  """The requested table names (default all), each checked to be a table of the layout."""
  if tables is None:
    return list(layout.table_names)
  if isinstance(tables, str):
    raise TypeError(f"{what}: tables must be a list of table names, got the string {tables!r}.")
  names = list(tables)
  unknown = [name for name in names if name not in layout.table_names]
  if unknown:
    raise KeyError(
        f"{what}: no table named {unknown} in the plan; its tables are {list(layout.table_names)}."
    )
  return names


def _host(array: jax.Array, stack: str, what: str) -> np.ndarray:
  if not array.is_fully_addressable:
    raise ValueError(
        f"{what}: stack {stack!r} is sharded over several processes, and this process holds"
        " only its devices' rows. Read tables of a multi-process job from a checkpoint"
        " (checkpoint.TableRestore reads chosen tables as numpy arrays)."
    )
  return np.asarray(array)


def table_values(
    plan: EmbeddingPlan, variables: EmbeddingVariables, tables: Iterable[str] | None = None
) -> dict[str, np.ndarray]:
  """The rows of tables as numpy arrays: table name -> [V, D], padding removed.

  Args:
    plan: the plan the variables are laid out by.
    variables: the embedding variables (a Trainer's `state.embeddings`).
    tables: the table names (default every table of the plan).

  Raises:
    KeyError: a name is not a table of the plan.
    ValueError: the variables are sharded over several processes.
  """
  layout = plan.layout
  names = _table_names(layout, tables, "table_values")
  out = {}
  for stack in layout.stacks:
    wanted = [table.name for table in stack.tables if table.name in names]
    if wanted:
      host = {stack.name: _host(variables.tables[stack.name], stack.name, "table_values")}
      out.update(unstack(host, layout, tables=wanted))
  return {name: out[name] for name in names}


def slot_values(
    plan: EmbeddingPlan, variables: EmbeddingVariables, tables: Iterable[str] | None = None
) -> dict[str, dict[str, np.ndarray]]:
  """The optimizer slots of tables: table name -> slot name -> [V, D] or [V, w] array.

  A slot declared with width None has one value per embedding column ([V, D]),
  one of width w has w per row ([V, w]); see `SlotSpec`.

  Raises:
    KeyError: a name is not a table of the plan.
    ValueError: the variables are sharded over several processes.
  """
  layout = plan.layout
  names = _table_names(layout, tables, "slot_values")
  out: dict[str, dict[str, np.ndarray]] = {name: {} for name in names}
  for stack in layout.stacks:
    wanted = [table.name for table in stack.tables if table.name in names]
    if not wanted:
      continue
    for slot in plan.optimizer(stack.name).slots():
      host = {stack.name: _host(variables.slots[stack.name][slot.name], stack.name, "slot_values")}
      for name, array in unstack(host, layout, row_width=slot.width, tables=wanted).items():
        out[name][slot.name] = array
  return out


def replace_tables(
    plan: EmbeddingPlan,
    variables: EmbeddingVariables,
    tables: Mapping[str, np.ndarray],
    slots: Mapping[str, Mapping[str, np.ndarray]] | None = None,
) -> EmbeddingVariables:
  """The variables with the rows of some tables replaced by host arrays.

  For each table t in `tables`, logical row i of the result is tables[t][i]
  (cast to the variables' dtype as numpy casts: to bfloat16, to nearest), in
  whatever layout the plan has. Its slots become slots[t][name] where given,
  else the slot's initial value (the optimizer state of other rows does not
  apply to new ones). Other tables, and every padding row and column, are
  unchanged. Each device takes only its own rows, read from the arrays by
  row index, so memory-mapped arrays (np.load(..., mmap_mode="r")) load a
  table larger than the host's memory; with several processes, each reads
  the rows of its own devices.

  Args:
    plan: the plan the variables are laid out by.
    variables: the current variables (a Trainer's `state.embeddings`).
    tables: table name -> [V, D] array.
    slots: table name -> slot name -> [V, D] or [V, w] array, for tables in
      `tables`; a table may give some of its slots.

  Returns:
    New EmbeddingVariables (the arrays of untouched stacks are the same objects).

  Raises:
    KeyError: a name is not a table of the plan, a slot not one of the
      table's optimizer, or `slots` names a table not in `tables`.
    ValueError: an array has another shape than the table or slot, or a value
      that is not finite in the variables' dtype (NaN, an infinity, or too
      large: 1e300 for float32), naming its row.
    TypeError: `tables` or a table's `slots` is not a mapping, or an array
      holds neither floats nor integers.
  """
  layout = plan.layout
  if not isinstance(tables, Mapping):
    raise TypeError(
        f"replace_tables: tables must map table names to arrays, got {type(tables).__name__}.")
  _table_names(layout, tables, "replace_tables")
  if slots is not None and not isinstance(slots, Mapping):
    raise TypeError(
        "replace_tables: slots must map table names to {slot name: array}, got"
        f" {type(slots).__name__}.")
  slots = dict(slots or {})
  for name, given in slots.items():
    if not isinstance(given, Mapping):
      raise TypeError(
          f"replace_tables: slots[{name!r}] must map slot names to arrays, got"
          f" {type(given).__name__}.")
  outside = [name for name in slots if name not in tables]
  if outside:
    raise KeyError(
        f"replace_tables: slots are given for {outside}, which are not in tables; slots"
        " are replaced with their tables' rows."
    )
  new_tables, new_slots = dict(variables.tables), {k: dict(v) for k, v in variables.slots.items()}
  for stack in layout.stacks:
    replaced = {index: table for index, table in enumerate(stack.tables) if table.name in tables}
    if not replaced:
      continue
    specs = {slot.name: slot for slot in plan.optimizer(stack.name).slots()}
    for table in replaced.values():
      unknown = [name for name in slots.get(table.name, {}) if name not in specs]
      if unknown:
        raise KeyError(
            f"replace_tables: table {table.name!r} has no slot {unknown}; its optimizer's"
            f" slots are {list(specs)}."
        )
    table_arrays = {index: (tables[table.name], table.embedding_dim, f"table {table.name!r}")
                    for index, table in replaced.items()}
    new_tables[stack.name] = _with_rows(variables.tables[stack.name], stack, table_arrays, None)
    for name, spec in specs.items():
      slot_arrays = {
          index: (slots.get(table.name, {}).get(name), _slot_width(spec, table.embedding_dim),
                  f"slot {name!r} of table {table.name!r}")
          for index, table in replaced.items()
      }
      new_slots[stack.name][name] = _with_rows(
          variables.slots[stack.name][name], stack, slot_arrays, spec.initial_value,
          minimum=spec.minimum)
  return EmbeddingVariables(new_tables, new_slots)


def _slot_width(spec: SlotSpec, embedding_dim: int) -> int:
  return embedding_dim if spec.width is None else spec.width


def _with_rows(array: jax.Array, stack, arrays: dict, fill: float | None, *,
               minimum: float | None = None) -> jax.Array:
  """`array` (a sharded [V_s, W] stack array) with some tables' rows replaced.

  arrays: table index in the stack -> (host array [V, width] or None, width,
  what): None sets the table's rows to `fill`. Columns past `width` keep
  their values (padding). Every value must be finite and, with a `minimum`,
  at least that.
  """
  arrays = {index: (_checked_values(values, (stack.tables[index].vocabulary_size, width), what),
                    width, what) for index, (values, width, what) in arrays.items()}
  shards = []
  for shard in array.addressable_shards:
    start, stop, _ = shard.index[0].indices(array.shape[0])
    host = np.array(shard.data)
    for index, (values, width, what) in arrays.items():
      global_rows, logical_rows = table_rows_in_block(stack, index, start, stop)
      if values is None:
        host[global_rows - start, :width] = fill
        continue
      rows = np.asarray(values[logical_rows])
      with np.errstate(over="ignore"):  # Checked after the cast: 1e300 is no float32.
        cast = rows.astype(host.dtype)
      finite = np.isfinite(cast).all(axis=1)
      if not finite.all():
        position = int(np.flatnonzero(~finite)[0])
        raise ValueError(
            f"replace_tables: {what}: row {int(logical_rows[position])} holds a value that is"
            f" not finite in {host.dtype}: {rows[position].tolist()[:8]}."
        )
      if minimum is not None and (cast < minimum).any():
        position = int(np.flatnonzero((cast < minimum).any(axis=1))[0])
        raise ValueError(
            f"replace_tables: {what}: row {int(logical_rows[position])} holds a value below"
            f" {minimum:g}, the least this slot holds (its optimizer keeps sums of squares"
            f" there; the next update would make the row NaN): {rows[position].tolist()[:8]}."
        )
      host[global_rows - start, :width] = cast
    shards.append(jax.device_put(host, shard.device))
  return jax.make_array_from_single_device_arrays(array.shape, array.sharding, shards)


def _checked_values(values, shape: tuple[int, int], what: str):
  """`values` (None, or an array of `shape` and a float or integer dtype; nested lists become
  one), else an error naming `what`."""
  if values is None:
    return None
  if not hasattr(values, "shape"):
    try:
      values = np.asarray(values)
    except ValueError as error:  # e.g. rows of different lengths
      raise ValueError(f"replace_tables: {what}: not an array of rows: {error}") from None
  if tuple(values.shape) != shape:
    raise ValueError(
        f"replace_tables: {what}: expected an array of shape {shape}, got {tuple(values.shape)}."
    )
  dtype = np.dtype(values.dtype)
  if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
    raise TypeError(f"replace_tables: {what}: expected a float or integer array, got {dtype}.")
  return values
