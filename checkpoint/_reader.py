"""Read access to one embedding checkpoint: its manifest, layout and any rows.

`CheckpointReader` hides the difference between the two kinds of checkpoint:
in a stacked checkpoint logical row i of table t lives at global row
`logical_to_global_rows(layout, t, i)` of its stack's arrays; in an unstacked
one, at row i of the table's own arrays. `read_rows` takes logical rows and
reads only the chunks that hold them.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import tensorstore as ts
from etils import epath

from checkpoint import _direct, _storage
from checkpoint._errors import (
    CorruptCheckpointError,
    MissingTableError,
    NotACheckpointError,
    read_error,
    read_text,
)
from checkpoint._format import (
    LAYOUT_FILE,
    MANIFEST_FILE,
    ArrayInfo,
    GroupInfo,
    Manifest,
    array_dir,
    numpy_dtype,
    read_layout,
)
from checkpoint._integrity import is_link, links_below
from sc_framework.optimizers import SlotSpec
from sc_framework.stacking import (
    EmbeddingLayout,
    logical_progression_to_global,
    logical_to_global_rows,
)


def embedding_items(directory: epath.Path) -> list[epath.Path]:
  """The embedding items inside an Orbax step directory (those holding a manifest), by name.

  A step usually holds one; a model with several embedding layers saves one
  per layer (`items={"embedding2": EmbeddingSave(...)}`).
  """
  if not directory.is_dir():
    return []
  return sorted((child for child in directory.iterdir() if (child / MANIFEST_FILE).exists()),
                key=lambda child: child.name)


def find_item(directory: epath.Path) -> epath.Path | None:
  """The embedding item inside an Orbax step directory, if there is exactly one."""
  found = embedding_items(directory)
  return found[0] if len(found) == 1 else None


def several_items_hint(items: list[epath.Path]) -> str:
  """Says that a step holds several embedding items, and to name one."""
  names = ", ".join(item.name for item in items)
  return (f" It is an Orbax step directory holding {len(items)} embedding items ({names}):"
          f" give one of them, e.g. {items[-1]}.")


class CheckpointReader:
  """An open embedding checkpoint item (a directory holding manifest.json).

  Raises (on construction):
    NotACheckpointError: the directory does not exist, has no manifest (for
      instance an unfinished save, or an Orbax step directory rather than the
      embedding item inside it), or its manifest or layout is malformed or
      inconsistent with itself.

  Args:
    directory: the item directory.
    chunk_cache: keeps checked chunks between `fill_rows` calls, so that
      blocks read one after another from the same chunks read each chunk file
      once (see `_direct.ChunkCache`); None reads the chunks of every call.
  """

  def __init__(self, directory: epath.PathLike, *, chunk_cache: _direct.ChunkCache | None = None):
    self.directory = epath.Path(directory)
    # The item a restore names (a chain's: its delta step, `directory` being its base).
    self.item = self.directory
    self.chunk_cache = chunk_cache
    _refuse_links(self.directory)
    self.manifest = _read_manifest(self.directory)
    self.layout: EmbeddingLayout | None = None
    if self.manifest.kind == "stacked":
      self.layout = _read_layout(self.directory)
    self._tables = _index_tables(self.directory, self.manifest, self.layout)
    self._stores: dict[tuple[str, str | None], ts.TensorStore] = {}
    self._direct_arrays: dict[tuple[str, str | None], bool] = {}
    self._lock = threading.Lock()

  @property
  def kind(self) -> str:
    return self.manifest.kind

  @property
  def table_names(self) -> tuple[str, ...]:
    return tuple(self._tables)

  def group_of(self, table: str) -> GroupInfo:
    """The group (stack, or the table itself when unstacked) that stores a table."""
    return self.manifest.group(self._table(table)[0])

  def table_shape(self, table: str) -> tuple[int, int]:
    """(V, D): the logical vocabulary and dimension of a table."""
    _, vocab, dim = self._table(table)
    return vocab, dim

  def slot_specs(self, table: str) -> tuple[SlotSpec, ...]:
    """The slot variables stored with a table (those of its stack's optimizer)."""
    return self.group_of(table).slot_specs

  def optimizer_name(self, table: str) -> str | None:
    """The optimizer recorded as owning a table's slots (`_optimizers`), None where unknown."""
    return self.group_of(table).optimizer

  def array_info(self, table: str, slot: str | None = None) -> ArrayInfo:
    """Shape, dtype and chunking of the array that stores a table (or one of its slots)."""
    group = self.group_of(table)
    if slot is None:
      return group.table
    if slot not in group.slots:
      raise MissingTableError(
          f"table {table!r} has no slot {slot!r} in the checkpoint {self.item}; its slots"
          f" are {sorted(group.slots)}."
      )
    return group.slots[slot]

  def dtype(self, table: str, slot: str | None = None) -> np.dtype:
    return numpy_dtype(self.array_info(table, slot).dtype)

  def row_width(self, table: str, slot: str | None = None) -> int:
    """Logical columns of a table's array or slot: D, or w for a [V, w] slot."""
    if slot is None:
      return self.table_shape(table)[1]
    self.array_info(table, slot)  # Raises for an unknown slot.
    spec = next(spec for spec in self.slot_specs(table) if spec.name == slot)
    return self.table_shape(table)[1] if spec.width is None else spec.width

  def store(self, group: str, slot: str | None = None) -> ts.TensorStore:
    """The opened TensorStore of a group's table (slot None) or slot array."""
    key = (group, slot)
    with self._lock:
      if key not in self._stores:
        info = self.manifest.group(group)
        expected = info.table if slot is None else info.slots[slot]
        path = array_dir(self.directory, self.manifest.kind, group, slot)
        what = _describe(self.manifest.kind, group, slot)
        _storage.check_local_path(path)
        try:
          store = _storage.open_for_read(path).result()
        except ValueError as error:
          raise read_error(
              error, f"checkpoint {self.directory}: cannot open {what} at {path}",
              "The checkpoint is incomplete or damaged; restore another step.",
          ) from error
        if tuple(store.shape) != expected.shape or store.dtype.numpy_dtype != numpy_dtype(
            expected.dtype
        ):
          raise CorruptCheckpointError(
              f"checkpoint {self.directory}: {what} is stored as"
              f" {store.dtype.name}{list(store.shape)}"
              f" but the manifest says {expected.dtype}{list(expected.shape)}."
          )
        self._stores[key] = store
      return self._stores[key]

  def read_rows(self, table: str, slot: str | None, rows) -> np.ndarray:
    """Logical rows of a table (slot None) or of one of its slots.

    Args:
      table: the table.
      slot: None for the table itself, else a slot name.
      rows: integer array (1-D) of logical rows in [0, V), any order.

    Returns:
      [len(rows), D] (table, or slot of width None) or [len(rows), w].

    Raises:
      ValueError: rows that are not a 1-D integer array, or outside [0, V).
    """
    given = np.asarray(rows)
    if given.ndim > 1 or given.size and (
        given.dtype == bool or not np.issubdtype(given.dtype, np.integer)):
      raise ValueError(
          f"table {table!r}: rows must be a 1-D array of integer logical rows, got"
          f" {'dtype ' + str(given.dtype) if given.ndim <= 1 else f'shape {given.shape}'}"
          " (a float row would be truncated to another row).")
    rows = given.astype(np.int64).reshape(-1)
    out = _storage.host_buffer((rows.size, self.row_width(table, slot)), self.dtype(table, slot))
    self.fill_rows(out, [(table, slot, rows, np.arange(rows.size))])
    return out

  def fill_rows(self, out: np.ndarray, requests) -> None:
    """Copies logical rows of tables into rows of `out`, all requests at once.

    Args:
      out: the destination, [rows, >= width].
      requests: (table, slot, logical_rows, out_rows) tuples: logical rows
        of the table's array (slot None) or slot go to `out[out_rows, :width]`.
    """
    started = []
    for table, slot, rows, out_rows in requests:
      rows = np.asarray(rows, dtype=np.int64)
      vocab, _ = self.table_shape(table)
      if rows.size and (rows.min() < 0 or rows.max() >= vocab):
        raise ValueError(
            f"table {table!r}: rows must be in [0, {vocab}), got rows in"
            f" [{rows.min()}, {rows.max()}]."
        )
      group = self.group_of(table).name
      physical = rows if self.layout is None else logical_to_global_rows(self.layout, table, rows)
      columns = self.row_width(table, slot)
      if self._read_direct(
          group,
          slot,
          lambda path, info, physical=physical, out_rows=out_rows, columns=columns: (
              out.dtype == numpy_dtype(info.dtype)
              and _direct.gather_rows_direct(
                  path,
                  info.shape,
                  info.chunk_rows,
                  physical,
                  out,
                  out_rows,
                  columns,
                  self.chunk_cache,
              )
          ),
      ):
        continue
      futures = self._read(
          group,
          slot,
          lambda store: _storage.copy_rows(
              store, physical, out, out_rows, self.row_width(table, slot)
          ),
      )
      started.append((group, slot, futures))
    for group, slot, futures in started:
      self._read(group, slot, lambda _: [future.result() for future in futures])

  def fill_strided_rows(self, out: np.ndarray, requests) -> None:
    """`fill_rows` of rows given as progressions, without per-row arrays.

    Args:
      out: the destination, [rows, >= width].
      requests: (table, slot, first, step, count, out_row) tuples: logical
        rows first + step j (j < count) of the table's array (slot None) or
        slot go to `out[out_row + j, :width]`.

    Where the array is direct-readable, each request is a few strided copies
    per source chunk (`logical_progression_to_global`,
    `_direct.copy_strided_direct`); else the rows are listed and read by
    `fill_rows`.
    """
    listed = []
    for table, slot, first, step, count, out_row in requests:
      vocab, _ = self.table_shape(table)
      if count and (first < 0 or step < 1 or first + step * (count - 1) >= vocab):
        raise ValueError(
            f"table {table!r}: rows must be in [0, {vocab}), got {count} rows from {first} by"
            f" step {step}."
        )
      if count <= 0:
        continue
      if self.layout is None:
        runs = [(0, 1, count, first, step)]
      else:
        runs = logical_progression_to_global(self.layout, table, first, step, count)
      runs = [
          (row, row_step, length, out_row + j0, j_step)
          for j0, j_step, length, row, row_step in runs
      ]
      columns = self.row_width(table, slot)
      if not self._read_direct(
          self.group_of(table).name,
          slot,
          lambda path, info, runs=runs, columns=columns: (
              out.dtype == numpy_dtype(info.dtype)
              and _direct.copy_strided_direct(
                  path, info.shape, info.chunk_rows, runs, out, columns, self.chunk_cache
              )
          ),
      ):
        positions = np.arange(count, dtype=np.int64)
        listed.append((table, slot, first + step * positions, out_row + positions))
    if listed:
      self.fill_rows(out, listed)

  def read_block(
      self, group: str, slot: str | None, start: int, stop: int, *, out: np.ndarray | None = None
  ) -> np.ndarray:
    """Stored rows [start, stop) of a group's array, all columns (padding included).

    Read into `out` (C-contiguous, of that shape and the array's dtype) when
    given, else into a new host buffer.
    """
    info = self.manifest.group(group)
    info = info.table if slot is None else info.slots[slot]
    shape, dtype = (stop - start, info.shape[1]), numpy_dtype(info.dtype)
    if out is None:
      out = _storage.host_buffer(shape, dtype)
    elif out.shape != shape or out.dtype != dtype or not out.flags.c_contiguous:
      raise ValueError(
          f"read_block: out is {out.dtype}{list(out.shape)}, expected a C-contiguous"
          f" {dtype}{list(shape)}."
      )
    direct = self._read_direct(
        group,
        slot,
        lambda path, info: _direct.read_chunks_direct(
            path, info.chunk_rows, start, stop, info.shape[0], out
        ),
    )
    if not direct:
      self._read(group, slot, lambda store: ts.array(out).write(store[start:stop]).result())
    return out

  def _read_direct(self, group: str, slot: str | None, read) -> bool:
    """Runs `read(path, info) -> bool`, a `_storage` direct read, where the encoding allows.

    Returns False (nothing read) when the array is not stored as raw bytes +
    crc32c (its zarr.json is checked, not only the manifest) or `read`
    declines; corrupt chunks raise CorruptCheckpointError naming the array.
    """
    if not self.manifest.storage.direct_readable or not self._raw_with_crc32c(group, slot):
      return False
    info = self.manifest.group(group)
    info = info.table if slot is None else info.slots[slot]
    try:
      return read(array_dir(self.directory, self.manifest.kind, group, slot), info)
    except CorruptCheckpointError as error:
      raise CorruptCheckpointError(
          f"checkpoint {self.directory}: reading {_describe(self.manifest.kind, group, slot)}"
          f" failed: {error}"
      ) from error

  def _raw_with_crc32c(self, group: str, slot: str | None) -> bool:
    """Whether the array's zarr.json says [bytes, crc32c] (opening it checks its metadata).

    Asked once per array: TensorStore's codec description allocates, and
    keeps, memory on every call.
    """
    key = (group, slot)
    with self._lock:
      known = self._direct_arrays.get(key)
    if known is None:
      store = self.store(group, slot)
      codecs = [codec.get("name") for codec in store.codec.to_json().get("codecs", [])]
      known = codecs == ["bytes", "crc32c"]
      with self._lock:
        self._direct_arrays[key] = known
    return known

  def _read(self, group: str, slot: str | None, fn):
    store = self.store(group, slot)
    try:
      return fn(store)
    except ValueError as error:
      what = _describe(self.manifest.kind, group, slot)
      raise read_error(
          error, f"checkpoint {self.directory}: reading {what} failed",
          "The array is corrupt, truncated or missing; restore another step or re-save it.",
      ) from error

  def _table(self, table: str) -> tuple[str, int, int]:
    if table not in self._tables:
      raise MissingTableError(
          f"table {table!r} is not in the checkpoint {self.item}; it holds tables"
          f" {sorted(self._tables)}."
      )
    return self._tables[table]


def _refuse_links(directory: epath.Path) -> None:
  """Raises if the item, or anything inside it, is a symbolic link."""
  links = [directory] if is_link(directory) else []
  if not links and directory.is_dir():
    links = links_below(directory)
  if links:
    shown = ", ".join(str(link) for link in links[:5]) + (" ..." if len(links) > 5 else "")
    raise CorruptCheckpointError(
        f"checkpoint {directory} contains symbolic links ({shown}); a checkpoint is plain files"
        " and nothing in it is read through a link, which could bring in data from another"
        " step or place. Replace each link by a copy of its target (or restore another step)."
    )


def _describe(kind: str, group: str, slot: str | None) -> str:
  owner = f"{'stack' if kind == 'stacked' else 'table'} {group!r}"
  return f"{owner} table array" if slot is None else f"{owner} slot {slot!r}"


def _read_manifest(directory: epath.Path) -> Manifest:
  path = directory / MANIFEST_FILE
  if not directory.exists():
    raise NotACheckpointError(f"checkpoint directory {directory} does not exist.")
  if not path.exists():
    hint = ""
    items = embedding_items(directory)
    if len(items) == 1:
      hint = f" It looks like an Orbax step directory; its embedding item is {items[0]}."
    elif len(items) > 1:
      hint = several_items_hint(items)
    elif ".orbax-checkpoint-tmp" in directory.name or any(
        ".orbax-checkpoint-tmp" in part for part in directory.parts
    ):
      hint = " It is the temporary directory of an unfinished save."
    why = "" if items else " (an unfinished or interrupted save never writes one)"
    raise NotACheckpointError(
        f"{directory} is not an embedding checkpoint: it has no {MANIFEST_FILE}{why}.{hint}"
    )
  try:
    data = json.loads(read_text(path))
  except (json.JSONDecodeError, UnicodeDecodeError) as error:
    raise NotACheckpointError(f"{path} is not valid JSON: {error}.") from error
  return Manifest.from_dict(data, str(path))


def _read_layout(directory: epath.Path) -> EmbeddingLayout:
  path = directory / LAYOUT_FILE
  if not path.exists():
    raise NotACheckpointError(f"stacked checkpoint {directory} has no {LAYOUT_FILE}.")
  return read_layout(path)


def _index_tables(
    directory: epath.Path, manifest: Manifest, layout: EmbeddingLayout | None
) -> dict[str, tuple[str, int, int]]:
  """table -> (group, V, D), after checking the manifest against the layout."""
  tables: dict[str, tuple[str, int, int]] = {}

  def check(group: GroupInfo, rows: int, padded_dim: int) -> None:
    expected = [("table", group.table.shape, (rows, padded_dim))]
    for spec in group.slot_specs:
      expected.append(
          (
              f"slot {spec.name!r}",
              group.slots[spec.name].shape,
              (rows, spec.stacked_width(padded_dim)),
          )
      )
    for what, actual, wanted in expected:
      if tuple(actual) != wanted:
        raise NotACheckpointError(
            f"checkpoint {directory}: group {group.name!r} {what} has shape {list(actual)} in the"
            f" manifest, but its layout gives {list(wanted)}; the checkpoint is inconsistent."
        )

  if layout is None:
    for group in manifest.groups:
      vocab, dim = group.table.shape
      check(group, vocab, dim)
      tables[group.name] = (group.name, vocab, dim)
    return tables
  if sorted(layout.stack_names) != sorted(group.name for group in manifest.groups):
    raise NotACheckpointError(
        f"checkpoint {directory}: the manifest stores stacks"
        f" {sorted(g.name for g in manifest.groups)}"
        f" but layout.json has stacks {sorted(layout.stack_names)}."
    )
  for stack in layout.stacks:
    group = manifest.group(stack.name)
    check(group, stack.vocabulary_size, stack.padded_embedding_dim)
    for table in stack.tables:
      tables[table.name] = (stack.name, table.vocabulary_size, table.embedding_dim)
  return tables
