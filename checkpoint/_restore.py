"""Restoring: into a layout on the caller's mesh, or as per-table host arrays.

Into a layout: every stack's table and slot arrays are built as
NamedSharding(mesh, PartitionSpec(axis_name, None)) arrays; for each distinct
block of rows held by this process's devices, the block is assembled from the
checkpoint by `_assembly.build_block` (one contiguous read on the fast path, a
read of exactly the block's logical rows otherwise) and placed on the devices
that hold it. No host ever holds more than one device block per array.

Per table: the logical rows [0, V) (or a range) of each requested table and of
its slots, padding stripped, as numpy arrays; only the chunks holding those
rows are read.
"""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from checkpoint._assembly import OnSlotMismatch, assemble_stacked, build_block
from checkpoint._reader import CheckpointReader
from sc_framework.optimizers import SlotSpec
from sc_framework.primitives import EmbeddingVariables, mesh_axis_size
from sc_framework.stacking import EmbeddingLayout


class TableArrays(NamedTuple):
  """Per-table host arrays, padding stripped.

  Attributes:
    tables: table name -> [V, D] (or [stop - start, D] for a row range).
    slots: table name -> slot name -> [V, D] or [V, w] (same rows).
  """

  tables: dict[str, np.ndarray]
  slots: dict[str, dict[str, np.ndarray]]


def restore_to_mesh(
    reader: CheckpointReader,
    layout: EmbeddingLayout,
    mesh: Mesh,
    axis_name: str,
    *,
    slot_specs: Mapping[str, Sequence[SlotSpec]] | None = None,
    optimizer_names: Mapping[str, str] | None = None,
    on_slot_mismatch: OnSlotMismatch = "error",
    dtype=None,
) -> EmbeddingVariables:
  """Restores a checkpoint into `layout`, sharded over `axis_name` of `mesh`.

  See `EmbeddingRestore` for the arguments and errors; `optimizer_names` are
  the target stacks' optimizer names (`_optimizers.resolve`).
  """
  num_devices = mesh_axis_size(mesh, axis_name)
  if num_devices != layout.num_devices:
    raise ValueError(
        f"mesh axis {axis_name!r} has {num_devices} devices but the target layout is"
        f" for G={layout.num_devices}; build the layout for the mesh (num_devices ="
        f" {num_devices})."
    )
  assemblies = assemble_stacked(
      reader,
      layout,
      slot_specs=slot_specs,
      optimizer_names=optimizer_names,
      on_slot_mismatch=on_slot_mismatch,
      dtype=dtype,
  )
  sharding = NamedSharding(mesh, PartitionSpec(axis_name, None))
  keys, arrays = [], []
  for name, assembly in assemblies.items():
    for slot in [None] + [spec.name for spec in assembly.slot_specs]:

      def block(start, stop, assembly=assembly, slot=slot):
        return build_block(reader, assembly, slot, start, stop)

      keys.append((name, slot))
      arrays.append(((assembly.stack.vocabulary_size, assembly.width(slot)), block))
  tables, slots = {}, {name: {} for name in assemblies}
  for (name, slot), array in zip(keys, make_sharded(arrays, sharding)):
    if slot is None:
      tables[name] = array
    else:
      slots[name][slot] = array
  return EmbeddingVariables(tables, slots)


def make_sharded(
    arrays: Sequence[tuple[tuple[int, int], Callable[[int, int], np.ndarray]]],
    sharding: NamedSharding,
    *,
    window: int = 4,
) -> list[jax.Array]:
  """Row-sharded arrays whose rows [start, stop) are `block(start, stop)`.

  Args:
    arrays: (shape, block) per array.
    sharding: the sharding of every array.
    window: the most blocks in flight at once.

  Each distinct block held by an addressable device is built once, by a
  worker thread that also puts it on every device holding it (replicas over
  other mesh axes included). At most `window` blocks, of any array, are in
  flight, so host memory holds at most `window` blocks at a time while reads
  and transfers overlap.
  """
  tasks = []
  for position, (shape, block) in enumerate(arrays):
    holders: dict[tuple[int, int], list[jax.Device]] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
      start, stop, _ = index[0].indices(shape[0])
      holders.setdefault((start, stop), []).append(device)
    tasks.extend(
        (position, block, start, stop, devices)
        for (start, stop), devices in sorted(holders.items())
    )

  def run(block, start, stop, devices) -> list[jax.Array]:
    host = block(start, stop)
    return [jax.device_put(host, device) for device in devices]

  pieces: list[list[jax.Array]] = [[] for _ in arrays]
  with concurrent.futures.ThreadPoolExecutor(max_workers=window) as pool:
    pending: collections.deque = collections.deque()
    for position, *task in tasks:
      pending.append((position, pool.submit(run, *task)))
      if len(pending) >= window:
        position, future = pending.popleft()
        pieces[position].extend(future.result())
    for position, future in pending:
      pieces[position].extend(future.result())
  return [
      jax.make_array_from_single_device_arrays(shape, sharding, parts)
      for (shape, _), parts in zip(arrays, pieces)
  ]


def read_tables(
    reader: CheckpointReader,
    tables: Sequence[str] | None = None,
    rows: Mapping[str, tuple[int, int]] | None = None,
) -> TableArrays:
  """Per-table arrays of a checkpoint (see `TableRestore`)."""
  if rows is not None and not isinstance(rows, Mapping):
    raise TypeError(
        f"rows must map table names to (start, stop) pairs, e.g. {{'users': (0, 1000)}}, got"
        f" {rows!r}."
    )
  rows = dict(rows or {})
  if isinstance(tables, str):
    tables = [tables]
  if tables is not None and (isinstance(tables, (bytes, Mapping))
                             or not isinstance(tables, Iterable)):
    raise TypeError(f"tables must be table names (a list, or one name), got {tables!r}.")
  names = list(tables) if tables is not None else (list(rows) if rows else list(reader.table_names))
  for name in names + list(rows):
    reader.table_shape(name)  # Raises MissingTableError naming the table.
  stray = sorted(set(rows) - set(names))
  if stray:
    raise ValueError(f"rows names tables {stray} that are not in tables={names}.")
  out_tables, out_slots = {}, {}
  for name in names:
    vocab, _ = reader.table_shape(name)
    start, stop = _check_range(name, rows.get(name, (0, vocab)), vocab)
    logical = np.arange(start, stop, dtype=np.int64)
    out_tables[name] = reader.read_rows(name, None, logical)
    out_slots[name] = {
        spec.name: reader.read_rows(name, spec.name, logical) for spec in reader.slot_specs(name)
    }
  return TableArrays(out_tables, out_slots)


def _check_range(name: str, row_range, vocab: int) -> tuple[int, int]:
  try:
    bounds = tuple(row_range)
  except TypeError:
    bounds = ()
  if len(bounds) != 2 or any(isinstance(x, (bool, np.bool_))
                             or not isinstance(x, (int, np.integer)) for x in bounds):
    raise ValueError(
        f"rows[{name!r}] must be a (start, stop) pair of ints, got {row_range!r}; a bound is"
        " never rounded."
    )
  start, stop = (int(x) for x in bounds)
  if not 0 <= start <= stop <= vocab:
    raise ValueError(
        f"rows[{name!r}] = ({start}, {stop}) is not a range inside the vocabulary of table"
        f" {name!r}, [0, {vocab})."
    )
  return start, stop
