"""Row arithmetic on a layout: logical (table, row) <-> global stacked row.

These functions use only integer arithmetic, so they accept numpy arrays and
jax arrays (under `jit` too) alike. See `_layout` for the formulas.
"""

from __future__ import annotations

import numpy as np

from sc_framework._scalars import python_scalar
from sc_framework.stacking._layout import EmbeddingLayout, StackLayout


def logical_to_global_rows(layout: EmbeddingLayout, table_name: str, rows):
  """Global rows of the stacked array that hold logical rows of a table.

    s = ((i mod N) + r) mod N,   l = floor(i / N) + o,   global = s * R + l

  Args:
    layout: the layout.
    table_name: the table's name.
    rows: integer array of logical row ids in [0, V') (padding rows allowed).

  Returns:
    An array of the same shape with global rows in [0, V_s).

  Raises:
    ValueError: (numpy or Python rows; jax values are not inspected, so that
      this runs under `jit`) a row outside [0, V') or not an integer.
  """
  stack = layout.stack_of_table(table_name)
  table = stack.table(table_name)
  if not hasattr(rows, "aval"):  # numpy / Python values: checked; jax values: traced
    _check_rows(rows, table.padded_vocabulary_size, f"table {table_name!r}: logical rows",
                "its padded vocabulary")
  n = stack.num_shards
  shard = (rows % n + table.shard_rotation) % n
  return shard * stack.rows_per_shard + rows // n + table.row_offset


def _check_rows(rows, stop: int, what: str, bound: str) -> None:
  """Raises ValueError unless every row is an integer in [0, stop) (compared in the rows'
  own dtype: a uint64 row past int64 is named as it is)."""
  array = np.asarray(rows)
  if array.size and (array.dtype == bool or not np.issubdtype(array.dtype, np.integer)):
    raise ValueError(f"{what} must be integers, got dtype {array.dtype}.")
  if array.size:
    low, high = int(array.min()), int(array.max())
    if low < 0 or high >= stop:
      raise ValueError(f"{what} must lie in [0, {stop}) ({bound}), got {low if low < 0 else high}.")


def _index(value, name: str, stack: StackLayout) -> int:
  """`value` (a Python, numpy or concrete jax integer) as an int, else a TypeError."""
  value = python_scalar(value)
  if isinstance(value, bool) or not isinstance(value, int):
    raise TypeError(f"stack {stack.name!r}: {name} must be an int, got {value!r}.")
  return value


def logical_rows_in_shard(local_rows, shard, shard_rotation, num_shards: int):
  """The inverse of the layout inside one shard (numpy or jax values).

    i = local * N + ((shard - r) mod N)

  Args:
    local_rows: positions inside a table's part of the shard (global row
      minus shard * R minus the table's offset o).
    shard: the shard, 0..N-1.
    shard_rotation: the table's rotation r (broadcasts with the rows).
    num_shards: N.

  Returns:
    The logical rows (>= V for the table's padding rows).
  """
  return local_rows * num_shards + (shard - shard_rotation) % num_shards


def global_to_logical_rows(stack: StackLayout, global_rows) -> tuple[np.ndarray, np.ndarray]:
  """Inverse of `logical_to_global_rows` for one stack (numpy).

  Args:
    stack: the stack.
    global_rows: integer array of rows in [0, V_s).

  Returns:
    (table_index, logical_row): arrays of the input's shape. table_index is
    the table's position in `stack.tables`; logical_row is in [0, V') and is
    >= V for the table's padding rows (see `is_padding_row`).

  Raises:
    ValueError: a row outside [0, V_s) or not an integer.
  """
  _check_rows(global_rows, stack.vocabulary_size, f"stack {stack.name!r}: global rows",
              "the stacked rows V_s")
  global_rows = np.asarray(global_rows, dtype=np.int64)
  n = stack.num_shards
  shard, local = np.divmod(global_rows, stack.rows_per_shard)
  offsets = np.array([t.row_offset for t in stack.tables], dtype=np.int64)
  rotations = np.array([t.shard_rotation for t in stack.tables], dtype=np.int64)
  table_index = np.searchsorted(offsets, local, side="right") - 1
  logical = logical_rows_in_shard(local - offsets[table_index], shard, rotations[table_index], n)
  return table_index, logical


def is_padding_row(stack: StackLayout, global_rows) -> np.ndarray:
  """True where a global row holds no logical row of any table."""
  table_index, logical = global_to_logical_rows(stack, global_rows)
  vocab = np.array([t.vocabulary_size for t in stack.tables], dtype=np.int64)
  return logical >= vocab[table_index]


def shard_of_global_row(stack: StackLayout, global_rows):
  """The shard (0..N-1) holding each global row."""
  return global_rows // stack.rows_per_shard


def device_of_global_row(layout: EmbeddingLayout, stack: StackLayout, global_rows):
  """The device (0..G-1) holding each global row."""
  return global_rows // (stack.rows_per_shard * layout.shards_per_device)


def shard_row_range(stack: StackLayout, shard: int) -> tuple[int, int]:
  """[start, stop) global rows of shard `shard`."""
  shard = _index(shard, "shard", stack)
  if not 0 <= shard < stack.num_shards:
    raise ValueError(f"stack {stack.name!r}: shard {shard} is not in [0, {stack.num_shards}).")
  return shard * stack.rows_per_shard, (shard + 1) * stack.rows_per_shard


def device_row_range(layout: EmbeddingLayout, stack: StackLayout, device: int) -> tuple[int, int]:
  """[start, stop) global rows held by device `device` (S * R contiguous rows)."""
  device = _index(device, "device", stack)
  if not 0 <= device < layout.num_devices:
    raise ValueError(f"stack {stack.name!r}: device {device} is not in [0, {layout.num_devices}).")
  rows_per_device = stack.rows_per_shard * layout.shards_per_device
  return device * rows_per_device, (device + 1) * rows_per_device


def table_rows_in_block(
    stack: StackLayout, table_index: int, start: int, stop: int
) -> tuple[np.ndarray, np.ndarray]:
  """The logical rows of one table that lie in global rows [start, stop).

  Returns:
    (global_rows, logical_rows), both sorted by global row, padding rows of
    the table (logical row >= V) excluded. Work is proportional to the rows of
    the block, not to the table.

  Raises:
    ValueError: table_index not in [0, tables) or a range outside [0, V_s).
  """
  runs = table_row_runs_in_block(stack, table_index, start, stop)
  if not runs:
    empty = np.zeros((0,), np.int64)
    return empty, empty
  steps = [np.arange(count, dtype=np.int64) for _, _, count in runs]
  return (np.concatenate([first_global + j for (first_global, _, _), j in zip(runs, steps)]),
          np.concatenate([first + stack.num_shards * j for (_, first, _), j in zip(runs, steps)]))


def table_row_runs_in_block(
    stack: StackLayout, table_index: int, start: int, stop: int
) -> list[tuple[int, int, int]]:
  """`table_rows_in_block` as runs, without a per-row array.

  Inside one shard a table's logical rows advance by N per global row
  (i = local * N + c), so its rows in [start, stop) are, shard by shard, one
  run of consecutive global rows holding the logical rows i0, i0 + N, ...

  Returns:
    (global_row, first_logical_row, count) per shard touched, in global row
    order: global rows global_row + j hold logical rows first + N j for
    j < count; the table's padding rows (logical row >= V) are left out.
  """
  table_index, start, stop = _check_block(stack, table_index, start, stop)
  table = stack.tables[table_index]
  n = stack.num_shards
  shard_rows = table.padded_vocabulary_size // n
  runs = []
  for shard in range(start // stack.rows_per_shard, -(-stop // stack.rows_per_shard)):
    base = shard * stack.rows_per_shard + table.row_offset
    lo, hi = max(base, start), min(base + shard_rows, stop)
    if lo >= hi:
      continue
    residue = (shard - table.shard_rotation) % n
    first_local = lo - base
    # Logical rows local * N + residue < V, i.e. local < ceil((V - residue) / N).
    count = min(hi - lo, -(-(table.vocabulary_size - residue) // n) - first_local)
    if count > 0:
      runs.append((lo, first_local * n + residue, count))
  return runs


def _check_block(stack: StackLayout, table_index: int, start: int,
                 stop: int) -> tuple[int, int, int]:
  """(table_index, start, stop) as ints; raises for a table position or global row range
  the stack does not have."""
  table_index, start, stop = (_index(value, name, stack) for name, value in (
      ("table_index", table_index), ("start", start), ("stop", stop)))
  if not 0 <= table_index < len(stack.tables):
    raise ValueError(
        f"stack {stack.name!r}: table_index {table_index} is not in [0, {len(stack.tables)})"
        f" (its tables: {[t.name for t in stack.tables]}).")
  if not 0 <= start <= stop <= stack.vocabulary_size:
    raise ValueError(
        f"stack {stack.name!r}: row range [{start}, {stop}) is outside [0,"
        f" {stack.vocabulary_size}).")
  return table_index, start, stop


def logical_progression_to_global(
    layout: EmbeddingLayout, table_name: str, first: int, step: int, count: int
) -> list[tuple[int, int, int, int, int]]:
  """`logical_to_global_rows` of the logical rows first + step j (j < count), as runs.

  With P = N / gcd(N, step), the rows j = q + P m (one residue q < P) share
  i mod N, hence their shard, and floor(i / N) advances by step P / N per m,
  so their global rows advance by that constant: at most P runs.

  Returns:
    (j0, j_step, length, global_row, global_step) per run: the positions
    j = j0 + j_step m (m < length) hold global rows global_row + global_step m.
  """
  if step < 1 or count < 0:
    raise ValueError(f"a row progression needs step >= 1 and count >= 0, got {step}, {count}.")
  stack = layout.stack_of_table(table_name)
  n = stack.num_shards
  period = n // np.gcd(n, step)
  runs = []
  for q in range(min(period, count)):
    row = int(logical_to_global_rows(layout, table_name, np.int64(first + step * q)))
    runs.append((q, period, -(-(count - q) // period), row, step * period // n))
  return runs
