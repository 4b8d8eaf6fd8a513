"""Host (numpy) stacking and unstacking of tables and slot variables.

Arrays follow the layout of `_layout`: a per-table array has shape [V, D]
(a table, or a slot with one value per column) or [V, w] (a slot with w values
per row); its stacked form has shape [V_s, D'] or [V_s, w]. `row_width=None`
selects the first kind, an int w the second.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from sc_framework.stacking._layout import EmbeddingLayout, StackLayout
from sc_framework.stacking._rows import (
    device_row_range,
    logical_to_global_rows,
    table_rows_in_block,
)


def _logical_width(table, row_width: int | None) -> int:
  return table.embedding_dim if row_width is None else row_width


def _stacked_width(stack: StackLayout, row_width: int | None) -> int:
  return stack.padded_embedding_dim if row_width is None else row_width


def _check_table_array(name: str, array: np.ndarray, rows: int, width: int) -> None:
  if array.ndim != 2 or array.shape != (rows, width):
    raise ValueError(
        f"table {name!r}: expected an array of shape ({rows}, {width}), got {tuple(array.shape)}."
    )


def _stack_dtype(stack: StackLayout, arrays: Mapping[str, np.ndarray], dtype):
  """The stacked array's dtype: `dtype`, or by default the first table's array's.

  Raises:
    KeyError: a table of the stack has no array.
  """
  missing = [t.name for t in stack.tables if t.name not in arrays]
  if missing:
    raise KeyError(f"stack {stack.name!r}: no array given for tables {missing}.")
  if dtype is not None:
    return np.dtype(dtype)
  return np.asarray(arrays[stack.tables[0].name][:0]).dtype  # they may be lazily loaded


def _cast(values: np.ndarray, dtype, table_name: str, stack: StackLayout) -> np.ndarray:
  """`values` in `dtype`; a finite value the cast makes infinite (1e5 in float16) is refused.

  Raises:
    ValueError: naming the table, the value and the dtype.
  """
  if values.dtype == dtype:
    return values
  with np.errstate(over="ignore", invalid="ignore"):
    cast = values.astype(dtype)
  floats = "fV"  # numpy's floats and ml_dtypes' (bfloat16)
  if values.dtype.kind in floats and cast.dtype.kind in floats:
    infinite = ~np.isfinite(cast)  # no copy of the block: only where the cast gave inf
    lost = infinite & np.isfinite(values) if infinite.any() else infinite
    if lost.any():
      value = values[np.unravel_index(int(np.flatnonzero(lost)[0]), values.shape)]
      raise ValueError(
          f"stack {stack.name!r}: table {table_name!r} holds {value!r}, which is not finite in"
          f" the stacked array's dtype {np.dtype(dtype).name} (the first table's, by default)."
          " Pass dtype= the dtype that holds every table (e.g. np.float32).")
  return cast


def _check_fill(fill: float, dtype) -> None:
  if np.issubdtype(dtype, np.integer) and not (np.isfinite(fill) and float(fill).is_integer()):
    raise ValueError(f"fill={fill!r} is no value of the arrays' dtype {dtype}: pass an integer.")


def stack_block(
    arrays: Mapping[str, np.ndarray],
    layout: EmbeddingLayout,
    stack_name: str,
    start: int,
    stop: int,
    *,
    row_width: int | None = None,
    fill: float = 0.0,
    dtype=None,
) -> np.ndarray:
  """Rows [start, stop) of one stacked array, built from per-table arrays.

  Only the needed rows of each table array are read, so the arrays may be
  lazily loaded (memory-mapped, TensorStore-backed with numpy indexing).

  Args:
    arrays: table name -> [V, D] (row_width None) or [V, w] array, for every
      table of the stack.
    layout: the layout.
    stack_name: the stack to build.
    start, stop: the global row range.
    row_width: None for table-shaped arrays, w for [V, w] slots.
    fill: the value of padding rows and padding columns.
    dtype: output dtype; default that of the first table's array. A value
      the cast makes infinite (float32 1e5 in float16) is an error.

  Returns:
    A [stop - start, D' or w] array.
  """
  stack = layout.stack(stack_name)
  if not 0 <= start <= stop <= stack.vocabulary_size:
    raise ValueError(
        f"stack {stack_name!r}: row range [{start}, {stop}) is outside [0, {stack.vocabulary_size})."
    )
  dtype = _stack_dtype(stack, arrays, dtype)
  _check_fill(fill, dtype)
  out = np.full((stop - start, _stacked_width(stack, row_width)), fill, dtype=dtype)
  for index, table in enumerate(stack.tables):
    array = arrays[table.name]
    width = _logical_width(table, row_width)
    _check_table_array(table.name, array, table.vocabulary_size, width)
    global_rows, logical_rows = table_rows_in_block(stack, index, start, stop)
    if global_rows.size:
      out[global_rows - start, :width] = _cast(np.asarray(array[logical_rows]), dtype,
                                               table.name, stack)
  return out


def stack(
    arrays: Mapping[str, np.ndarray],
    layout: EmbeddingLayout,
    *,
    row_width: int | None = None,
    fill: float = 0.0,
    dtype=None,
) -> dict[str, np.ndarray]:
  """Per-table arrays -> one stacked array per stack (`stack_block` of all its rows)."""
  return {stack_layout.name: stack_block(arrays, layout, stack_layout.name, 0,
                                         stack_layout.vocabulary_size, row_width=row_width,
                                         fill=fill, dtype=dtype)
          for stack_layout in layout.stacks}


def unstack(
    stacked: Mapping[str, np.ndarray],
    layout: EmbeddingLayout,
    *,
    row_width: int | None = None,
    tables: Iterable[str] | None = None,
) -> dict[str, np.ndarray]:
  """Stacked arrays -> per-table arrays with padding rows and columns removed.

  Args:
    stacked: stack name -> [V_s, D'] (row_width None) or [V_s, w] array.
    layout: the layout the arrays are in.
    row_width: None for table-shaped arrays, w for [V_s, w] slots.
    tables: the tables to return (default all).

  Returns:
    table name -> [V, D] or [V, w] array.
  """
  if isinstance(tables, str):
    raise TypeError(f"unstack: tables must be a list of table names, got the string {tables!r}"
                    f" (for one table: tables=[{tables!r}]).")
  names = layout.table_names if tables is None else tuple(tables)
  out = {}
  for name in names:
    stack_layout = layout.stack_of_table(name)
    table = stack_layout.table(name)
    array = np.asarray(stacked[stack_layout.name])
    expected = (stack_layout.vocabulary_size, _stacked_width(stack_layout, row_width))
    if array.shape != expected:
      raise ValueError(
          f"stack {stack_layout.name!r}: expected a stacked array of shape {expected},"
          f" got {tuple(array.shape)}."
      )
    rows = logical_to_global_rows(layout, name, np.arange(table.vocabulary_size))
    out[name] = array[rows, : _logical_width(table, row_width)]
  return out


def device_block(
    arrays: Mapping[str, np.ndarray],
    layout: EmbeddingLayout,
    stack_name: str,
    device: int,
    *,
    row_width: int | None = None,
    fill: float = 0.0,
    dtype=None,
) -> np.ndarray:
  """The [S * R, D' or w] block of a stacked array held by one device (see `stack_block`)."""
  start, stop = device_row_range(layout, layout.stack(stack_name), device)
  return stack_block(arrays, layout, stack_name, start, stop, row_width=row_width, fill=fill,
                     dtype=dtype)
