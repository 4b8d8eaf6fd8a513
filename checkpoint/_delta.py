"""Delta (incremental) embedding items: the rows updated since the previous save.

A delta item is a directory, written through TensorStore like a full one:

  manifest.json                  `DeltaManifest` (written last, by the primary)
  layout.json                    the layout the row ids refer to
  parts/<p>.json                 {"rows": {stack: k_p}}: process p's part is complete
  stacks/<name>/parts/<p>/ids    zarr v3 int64 [k_p, 1]: global rows of the stacked array
  stacks/<name>/parts/<p>/table  zarr v3 [k_p, D']: those rows of the table
  stacks/<name>/parts/<p>/slots/<slot>  zarr v3 [k_p, D' or w]

Each process passes the rows its own batches updated; the save first takes
their union over the processes (an allgather of the row ids, only with
several processes). Process p then writes the updated rows that its devices
hold (replica 0 of each block, as a full save does), so every row is written
once, by its owner. The values are gathered when the write runs, in the
background: the caller blocks for the bookkeeping only. The ids are global rows of `layout.json`'s
stacks, so a reader maps them to (table, logical row) with
`global_to_logical_rows` and from there to any other layout.

The manifest names the previous save (`parent_step`, whose state this delta
updates) and the full save the chain starts from (`base_step`); it also holds
the full manifest of the state (`state`: stacks, slots, dtypes, storage),
which is what a restore of the chain checks the base against. Its
`save_id` identifies this save and `parent_id` the parent's (`_format`'s
"save_id"; both absent from deltas written before they existed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import tensorstore as ts
from etils import epath

from checkpoint import _save, _storage
from checkpoint._errors import CorruptCheckpointError, NotACheckpointError, read_error, read_text
from checkpoint._format import (
    LAYOUT_FILE,
    MANIFEST_FILE,
    Manifest,
    group_dir,
    new_save_id,
    read_layout,
    read_save_id,
)
from checkpoint._names import encode_name
from checkpoint._storage import StorageOptions
from sc_framework.stacking import EmbeddingLayout

DELTA_FORMAT = "sc_framework.embedding_delta"
DELTA_FORMAT_VERSION = 1
PARTS_DIR = "parts"
IDS = "/ids"
"""The array name of a part's row ids (a slash never appears in a slot name)."""


@dataclasses.dataclass(frozen=True)
class Delta:
  """Makes an `EmbeddingSave` a delta: only these rows are written.

  `EmbeddingSave(tables, slots, layout, slot_specs, delta=Delta(rows, parent_step=p,
  base_step=b))` holds the whole state, as a full save does, but writes only
  the rows in `rows`. A restore of this step reads the full step `base_step`
  and applies every delta of the chain up to this one, oldest first.

  `CheckpointManager(..., incremental=IncrementalPolicy())` builds this
  itself and decides between full and delta saves; build it directly only
  with a plain Orbax checkpointer.

  Attributes:
    rows: stack name -> the global rows of the stacked array updated since
      `parent_step` (any order, repeats allowed; stacks left out had none):
      an `UpdatedRows` tracker's `rows()`.
    parent_step: the previous save, whose state these rows update.
    base_step: the full save the chain starts from.
    parent_id: the "save_id" in `parent_step`'s manifest, or None if it has
      none; a restore then refuses a step `parent_step` holding another save.
  """

  rows: Mapping[str, np.ndarray]
  parent_step: int
  base_step: int
  parent_id: str | None = None

  def __post_init__(self):
    for what, value in (("parent_step", self.parent_step), ("base_step", self.base_step)):
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"Delta: {what} must be a step number >= 0, got {value!r}.")
    if self.parent_id is not None and (not isinstance(self.parent_id, str) or not self.parent_id):
      raise ValueError(f"Delta: parent_id must be the parent's save id or None, got"
                       f" {self.parent_id!r}.")
    if self.base_step > self.parent_step:
      raise ValueError(
          f"Delta: base_step {self.base_step} comes after parent_step {self.parent_step}; a"
          " chain starts at its base."
      )


@dataclasses.dataclass(frozen=True)
class DeltaManifest:
  """What a delta item is: its links, its process count and the state's manifest.

  `save_id` identifies this save, `parent_id` the parent's (None where
  unknown: written before ids existed, or the parent had none).
  """

  parent_step: int
  base_step: int
  num_processes: int
  state: Manifest
  save_id: str | None = None
  parent_id: str | None = None

  def to_json(self) -> str:
    data = {
        "format": DELTA_FORMAT,
        "format_version": DELTA_FORMAT_VERSION,
        "parent_step": self.parent_step,
        "base_step": self.base_step,
        "num_processes": self.num_processes,
        "state": self.state.to_dict(),
    }
    for key, value in (("save_id", self.save_id), ("parent_id", self.parent_id)):
      if value is not None:
        data[key] = value
    return json.dumps(data, indent=1, sort_keys=True)

  @classmethod
  def from_dict(cls, data: Any, where: str) -> "DeltaManifest":
    if data.get("format_version") != DELTA_FORMAT_VERSION:
      raise NotACheckpointError(
          f"{where}: delta format_version {data.get('format_version')!r} is not supported; this"
          f" library reads version {DELTA_FORMAT_VERSION}. Upgrade the library."
      )
    try:
      links = [int(data[key]) for key in ("parent_step", "base_step", "num_processes")]
      ids = (read_save_id(data), read_save_id({"save_id": data.get("parent_id")}))
    except (KeyError, TypeError, ValueError) as error:
      raise NotACheckpointError(f"{where}: malformed delta manifest ({error!r}).") from error
    state = Manifest.from_dict(data.get("state"), f"{where} (state)")
    return cls(*links, state, *ids)


def is_delta_manifest(data: Any) -> bool:
  return isinstance(data, dict) and data.get("format") == DELTA_FORMAT


def part_dir(directory: epath.Path, stack: str, process: int) -> epath.Path:
  return group_dir(directory, "stacked", stack) / PARTS_DIR / str(process)


def part_array_dir(
    directory: epath.Path, stack: str, process: int, array: str | None
) -> epath.Path:
  """A part's arrays: the row ids (`IDS`), the table (None) or a slot."""
  base = part_dir(directory, stack, process)
  if array == IDS:
    return base / "ids"
  return base / "table" if array is None else base / "slots" / encode_name(array)


def _row_count(value, stack: str) -> int:
  """A part marker's row count of `stack`: a non-negative integer, else ValueError."""
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise ValueError(f"stack {stack!r} has {value!r} rows, not a count")
  return value


def part_marker(directory: epath.Path, process: int) -> epath.Path:
  return directory / PARTS_DIR / f"{process}.json"


# ---------------------------------------------------------------------------
# Save.


def check_rows(layout: EmbeddingLayout, rows: Mapping[str, Any]) -> dict[str, np.ndarray]:
  """Stack -> sorted distinct int64 global rows, checked against the layout."""
  sizes = {stack.name: stack.vocabulary_size for stack in layout.stacks}
  unknown = sorted(set(rows) - set(sizes))
  if unknown:
    raise ValueError(
        f"EmbeddingSave (delta): rows names stacks {unknown} that the layout does not have; its"
        f" stacks are {sorted(sizes)}."
    )
  out = {}
  for name, size in sizes.items():
    array = np.asarray(rows.get(name, np.zeros((0,), np.int64))).reshape(-1)
    if array.size and not np.issubdtype(array.dtype, np.integer):
      raise TypeError(f"EmbeddingSave (delta): rows[{name!r}] must be integers, got {array.dtype}.")
    array = sorted_unique(array.astype(np.int64, copy=False))
    if array.size and (array[0] < 0 or array[-1] >= size):
      raise ValueError(
          f"EmbeddingSave (delta): rows[{name!r}] must be global rows in [0, {size}) of the stacked"
          f" array, got rows in [{array[0]}, {array[-1]}]."
      )
    out[name] = array
  return out


def union_across_processes(rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """The union of every process's rows (each process tracks its own batches)."""
  if jax.process_count() == 1:
    return rows
  from jax.experimental import multihost_utils  # Only needed with several processes.

  out = {}
  for name in sorted(rows):
    local = rows[name]
    sizes = multihost_utils.process_allgather(np.array([local.size], np.int64))
    padded = np.full((int(np.max(sizes)),), -1, np.int64)
    padded[: local.size] = local
    gathered = np.asarray(multihost_utils.process_allgather(padded)).reshape(-1)
    out[name] = sorted_unique(gathered[gathered >= 0])
  return out


def sorted_unique(rows: np.ndarray) -> np.ndarray:
  """Sorted distinct values of an int array (no work when already strictly increasing)."""
  if rows.size < 2 or bool(np.all(rows[1:] > rows[:-1])):
    return rows
  rows = np.sort(rows)
  keep = np.ones(rows.shape, bool)
  keep[1:] = rows[1:] != rows[:-1]
  return rows[keep]


@dataclasses.dataclass(frozen=True)
class _Part:
  """This process's rows of one stack and, per array, a function that returns their values."""

  ids: np.ndarray
  values: dict[str | None, Callable[[], np.ndarray]]


def _shard_ranges(array: jax.Array, *, replica_zero: bool):
  """(start, stop, shard) of this process's shards, by start; one shard per row range."""
  found = {}
  for shard in array.addressable_shards:
    if replica_zero and shard.replica_id != 0:
      continue
    start, stop, _ = shard.index[0].indices(array.shape[0])
    found.setdefault((start, stop), shard)
  return [(start, stop, shard) for (start, stop), shard in sorted(found.items())]


def _owned_rows(array: jax.Array, rows: np.ndarray) -> np.ndarray:
  """The rows held by this process's replica-0 shards of `array` (sorted)."""
  owned = [
      rows[np.searchsorted(rows, start) : np.searchsorted(rows, stop)]
      for start, stop, _ in _shard_ranges(array, replica_zero=True)
  ]
  return sorted_unique(np.concatenate(owned)) if owned else np.zeros((0,), np.int64)


def _start_take(shard, local: np.ndarray, out: np.ndarray) -> Callable[[], None]:
  """Starts copying rows `local` of one shard's buffer into `out`; returns the finish.

  On CPU the buffer is viewed without a copy (JAX does not donate a buffer
  while such a view lives, so later steps cannot overwrite it) and the rows
  are gathered by numpy when the write runs, in the background. On an
  accelerator the gather is dispatched on the device now (the index padded to
  a power of two, so few programs are compiled) with its transfer to the
  host; only the rows travel.
  """
  data = shard.data
  if shard.device.platform == "cpu":
    view = np.asarray(data)
    return lambda: np.take(view, local, axis=0, out=out, mode="clip")
  size = 1 << max(0, int(local.size - 1).bit_length())
  index = np.zeros((size,), np.int32)
  index[: local.size] = local
  rows = jax.numpy.take(data, jax.device_put(index, shard.device), axis=0)
  rows.copy_to_host_async()
  return lambda: np.copyto(out, np.asarray(rows)[: local.size])


def _gather(array: jax.Array, ids: np.ndarray, what: str) -> Callable[[], np.ndarray]:
  """Starts gathering rows `ids` of `array` from this process's shards: [len(ids), width]."""
  out = np.empty((ids.size, array.shape[1]), array.dtype)
  finishes, covered = [], 0
  for start, stop, shard in _shard_ranges(array, replica_zero=False):
    lo, hi = np.searchsorted(ids, start), np.searchsorted(ids, stop)
    if hi > lo:
      finishes.append(_start_take(shard, ids[lo:hi] - start, out[lo:hi]))
      covered += hi - lo
  if covered != ids.size:
    raise ValueError(
        f"EmbeddingSave (delta): {what} does not hold all of this process's updated rows on"
        " this process, but its table does; give tables and slots the same sharding."
    )

  def finish() -> np.ndarray:
    for step in finishes:
      step()
    return out

  return finish


def snapshot(args, rows: dict[str, np.ndarray]) -> dict[str, _Part]:
  """Starts copying this process's updated rows of every table and slot to the host.

  Blocks only for the bookkeeping (and, on accelerators, the dispatch of the
  device gathers); the rows are gathered when the write runs.
  """
  parts = {}
  for name, table in args.tables.items():
    ids = _owned_rows(table, rows[name])
    values = {None: _gather(table, ids, f"stack {name!r} table")}
    for slot, array in args.slots.get(name, {}).items():
      values[slot] = _gather(array, ids, f"stack {name!r} slot {slot!r}")
    parts[name] = _Part(ids, values)
  return parts


def _array_spec(path: epath.Path, data: np.ndarray, storage: StorageOptions) -> dict:
  row_bytes = max(1, data.shape[1] * data.dtype.itemsize)
  chunk_rows = max(1, min(max(data.shape[0], 1), storage.chunk_bytes // row_bytes))
  return _storage.create_spec(path, data.shape, data.dtype, chunk_rows, storage)


async def write(
    directory: epath.Path,
    manifest: DeltaManifest,
    layout: EmbeddingLayout,
    parts: dict[str, _Part],
    *,
    process: int,
    primary: bool,
) -> None:
  """Writes this process's part, its marker and (primary) the layout and manifest."""
  jobs = []
  for name, part in parts.items():
    arrays = [(IDS, part.ids.reshape(-1, 1))]
    arrays += [(array, value()) for array, value in part.values.items()]
    for array, data in arrays:
      path = part_array_dir(directory, name, process, array)
      jobs.append((_storage.open_for_write(_array_spec(path, data, manifest.state.storage)), data))
  stores = [(await future, data) for future, data in jobs]
  writes = [
      store.write(data, can_reference_source_data_indefinitely=True)
      for store, data in stores
      if data.size
  ]
  await asyncio.gather(*(_commit(future) for future in writes))
  marker = part_marker(directory, process)
  marker.parent.mkdir(parents=True, exist_ok=True)
  marker.write_text(json.dumps({"rows": {name: int(p.ids.size) for name, p in parts.items()}}))
  if primary:
    (directory / LAYOUT_FILE).write_text(layout.to_json())
    (directory / MANIFEST_FILE).write_text(manifest.to_json())


async def _commit(future) -> None:
  await future.commit


def prepare_save(directory: epath.Path, args, *, primary: bool):
  """Validates, snapshots the updated rows to host (blocking) and returns the write.

  Args:
    args: an `EmbeddingSave` whose `delta` is set.
  """
  delta: Delta = args.delta
  if not isinstance(delta, Delta):
    raise TypeError(f"EmbeddingSave.delta must be a checkpoint.Delta or None, got {delta!r}.")
  state = _save.state_manifest(args)
  rows = union_across_processes(check_rows(args.layout, delta.rows))
  manifest = DeltaManifest(int(delta.parent_step), int(delta.base_step), jax.process_count(),
                           state, args.save_id or new_save_id(), delta.parent_id)
  parts = snapshot(args, rows)
  return write(
      epath.Path(directory),
      manifest,
      args.layout,
      parts,
      process=jax.process_index(),
      primary=primary,
  )


# ---------------------------------------------------------------------------
# Read.


class DeltaItem:
  """One delta item opened for reading: its manifest, layout and parts.

  Raises (on construction):
    CorruptCheckpointError: a part's marker or array is missing or does not
      match the manifest.
  """

  def __init__(self, directory: epath.PathLike, manifest: DeltaManifest):
    self.directory = epath.Path(directory)
    self.manifest = manifest
    path = self.directory / LAYOUT_FILE
    if not path.exists():
      raise CorruptCheckpointError(f"delta checkpoint {self.directory} has no {LAYOUT_FILE}.")
    self.layout = read_layout(path, CorruptCheckpointError)
    self.counts: list[dict[str, int]] = []
    for process in range(manifest.num_processes):
      marker = part_marker(self.directory, process)
      if not marker.exists():
        raise CorruptCheckpointError(
            f"delta checkpoint {self.directory}: the part of process {process} is missing"
            f" ({marker} does not exist); the save did not complete. Restore another step."
        )
      try:
        counts = json.loads(read_text(marker))["rows"]
        self.counts.append({name: _row_count(counts.get(name, 0), name)
                            for name in self.layout.stack_names})
      except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise CorruptCheckpointError(
            f"delta checkpoint {self.directory}: the part marker {marker} is damaged ({error})."
            " Restore another step."
        ) from error
    self._stores: dict[tuple[str, int, str | None], ts.TensorStore] = {}

  @property
  def step(self) -> int | None:
    name = self.directory.parent.name
    return int(name) if name.isdigit() else None

  @property
  def num_rows(self) -> dict[str, int]:
    """Stack -> the rows this delta holds."""
    return {name: sum(c[name] for c in self.counts) for name in self.layout.stack_names}

  def store(self, stack: str, process: int, array: str | None) -> ts.TensorStore:
    """The opened row ids (`IDS`), table (None) or slot array of one process's part."""
    key = (stack, process, array)
    if key not in self._stores:
      path = part_array_dir(self.directory, stack, process, array)
      try:
        store = _storage.open_for_read(path).result()
      except ValueError as error:
        raise read_error(
            error, f"delta checkpoint {self.directory}: cannot open stack {stack!r} part"
            f" {process} array {array or 'table'!r} at {path}", "Restore another step.",
        ) from error
      rows = self.counts[process][stack]
      if store.shape[0] != rows:
        raise CorruptCheckpointError(
            f"delta checkpoint {self.directory}: stack {stack!r} part {process} array"
            f" {array or 'table'!r} has {store.shape[0]} rows, its marker says {rows}."
        )
      self._stores[key] = store
    return self._stores[key]

  def ids(self, stack: str, process: int) -> np.ndarray:
    """The global rows (of this delta's layout) in one process's part."""
    if not self.counts[process][stack]:
      return np.zeros((0,), np.int64)
    try:
      return self.store(stack, process, IDS).read().result().reshape(-1).astype(np.int64)
    except ValueError as error:
      raise read_error(
          error, f"delta checkpoint {self.directory}: reading the row ids of stack {stack!r}"
          f" part {process} failed", "Restore another step.",
      ) from error
