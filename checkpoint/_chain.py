"""Chains of checkpoints: a full base and the deltas after it, read as one state.

Step k of a root is `root/<k>/<item>`. A delta item names its parent step
(the previous save); following parents from a delta reaches a full item, the
chain's base. The state of a delta step is

  T = base, then for each delta d of the chain, oldest first: T[rows_d] = values_d

`ChainReader` is a `CheckpointReader` of the base whose reads apply the
deltas, so every restore path (`EmbeddingRestore` into any layout,
`TableRestore` of tables and row ranges, `convert`) reads a chain exactly as
it reads a full checkpoint. It indexes, per table, the logical rows the
deltas hold and, for each, the newest delta that holds it (the ids of every
delta are read once, on construction); values are read only for the rows a
request asks for. A delta's ids are global rows of its own layout, mapped to
logical rows of its tables, so base and deltas may use different layouts.

A chain keeps its tables' shapes, slots and dtypes (`table_states`) and the
optimizer owning each table's slots where its links record one
(`_optimizers`); a delta that changes any of them is refused, and a
manager does not write one (`continues_chain`).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence

import numpy as np
from etils import epath

from checkpoint import _integrity, _storage
from checkpoint._delta import DeltaItem, DeltaManifest, is_delta_manifest
from checkpoint._direct import ChunkCache
from checkpoint._errors import (
    CheckpointError,
    CheckpointReadError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    NotACheckpointError,
    read_error,
    storage_failure,
)
from checkpoint._format import (
    LAYOUT_FILE,
    MANIFEST_FILE,
    Manifest,
    declared_flag,
    read_layout,
    read_save_id,
)
from checkpoint._reader import CheckpointReader
from sc_framework.stacking import EmbeddingLayout, global_to_logical_rows, logical_to_global_rows


# A source's run of positions is read whole when at least 1 in _DENSE of it is needed.
_DENSE = 4


class BrokenChainError(CorruptCheckpointError):
  """A delta step's chain lacks a link (a missing, unfinished or damaged step)."""


def read_item_manifest(item: epath.Path) -> dict:
  """The raw manifest.json of an item (full or delta)."""
  path = item / MANIFEST_FILE
  try:
    return json.loads(path.read_text())
  except (OSError, json.JSONDecodeError, UnicodeDecodeError) as error:
    if storage_failure(error) is not None:  # refused or not answered: not a broken chain
      raise read_error(error, f"reading {path} failed") from error
    raise BrokenChainError(f"{path} cannot be read: {error}.") from error


def delta_manifest(item: epath.Path) -> DeltaManifest | None:
  """The delta manifest of an item, or None for a full item."""
  return _delta_manifest(item, read_item_manifest(item))


def _delta_manifest(item: epath.Path, data: dict) -> DeltaManifest | None:
  if not is_delta_manifest(data):
    return None
  return DeltaManifest.from_dict(data, str(item / MANIFEST_FILE))


def save_id_of(item: epath.Path) -> str | None:
  """The "save_id" of an item's manifest (full or delta), or None where it has none.

  Raises:
    BrokenChainError: the manifest cannot be read.
    NotACheckpointError: its save_id is malformed.
  """
  return _save_id(item, read_item_manifest(item))


def _save_id(item: epath.Path, data: dict) -> str | None:
  try:
    return read_save_id(data)
  except ValueError as error:
    raise NotACheckpointError(f"{item / MANIFEST_FILE}: malformed manifest ({error}).") from None


def step_item(item: epath.Path, step: int) -> epath.Path:
  """The same item in another step of the same root (root/<step>/<item>)."""
  return item.parent.parent / str(step) / item.name


def chain_problems(item: epath.PathLike, depth: _integrity.Depth) -> list[_integrity.Problem]:
  """The integrity problems of the earlier steps of a delta item's chain.

  Every earlier link (base and earlier deltas, which a restore or conversion
  of `item` reads too) is checked against the integrity manifest of its own
  step at `depth`. An edited link is caught here: its step's manifest no
  longer matches. (Whether each parent still holds the save its delta was
  written on is checked by the readers and `check_chain_states`, after
  this.) Empty for a full item (a chain of one).

  Raises:
    BrokenChainError: a link is missing or unreadable (from `walk_chain`).
  """
  problems: list[_integrity.Problem] = []
  for link, _ in walk_chain(item, check_ids=False)[:-1]:
    problems.extend(_integrity.check_step(link.parent, depth=depth, items=[link.name]))
  return problems


def verify_item(item: epath.PathLike) -> None:
  """Checks an embedding item, and the earlier links of its chain, before a restore reads them.

  An item inside a step with an integrity manifest (every step a
  `CheckpointManager` writes) is checked at depth 'items': every file of
  the item against the manifest, so also chunks saved without the crc32c
  codec (`StorageOptions(checksum="none")`); then the earlier steps of its
  delta chain against theirs. A bare item written by `convert` is checked
  against its own manifest (`bare_item_problems`). An item in a step without
  a manifest is refused where its manifest.json says it was saved into a
  step that got one ("step_integrity": the step lost it); otherwise (a step
  written by Orbax's own managers, or an item written before items carried
  either record) it has nothing to be checked against: its chunks' crc32c
  codec is checked as they are read.

  A step named through a symbolic link to it (a `latest` link beside the
  steps, say) is checked where the link points; links inside the step are
  errors, as everywhere.

  Raises:
    CorruptCheckpointError: naming every damaged, missing or linked file.
    BrokenChainError: a link of the chain is missing or unreadable.
  """
  item = epath.Path(item)
  if "://" not in str(item):  # a local path: absolute, so messages name the step
    item = epath.Path(os.path.abspath(item))
  step = item.parent
  if _integrity.is_link(step):
    step = epath.Path(os.path.realpath(step))
    item = step / item.name
  manifest = step / _integrity.INTEGRITY_FILE
  if not (_integrity.is_link(manifest) or manifest.exists()):
    raise_if_step_lost_its_manifest(item)
    _integrity.raise_for(bare_item_problems(item, "items"), f"embedding item {item}",
                         _integrity.ITEM_ADVICE)
    return
  what = f"checkpoint step {step.name} ({step})"
  _integrity.raise_for(_integrity.check_step(step, depth="items", items=[item.name]), what)
  _integrity.raise_for(
      chain_problems(item, "items"),
      f"the delta chain of checkpoint step {step.name} (its earlier steps; {step})")


def raise_if_step_lost_its_manifest(item: epath.Path) -> None:
  """Raises CorruptCheckpointError when `item` lies in a step directory without an
  integrity manifest although its manifest.json says its step was given one
  ("step_integrity", `_format`): the step lost it, and its files cannot be checked."""
  step = item.parent
  if (not (step / _integrity.INTEGRITY_FILE).exists()
      and (step / _integrity.ORBAX_STEP_METADATA).exists() and _declared(item, "step_integrity")):
    raise CorruptCheckpointError(
        f"{step} has no {_integrity.INTEGRITY_FILE}, but its item {item} was saved by a"
        " CheckpointManager, which writes one into every step it commits: the step lost it"
        " (a partial copy, or a deletion), so its files cannot be verified. Restore another"
        " step, or copy this one again from its source.")


def bare_item_problems(item: epath.Path, depth: _integrity.Depth) -> list[_integrity.Problem]:
  """The problems of a bare embedding item against its own integrity manifest.

  `convert` writes an item outside any step (a bare item) with an
  `item_integrity.json`, the item directory taking the place of a step's
  (see `checkpoint._integrity`): its files' sizes and CRC32Cs, and each
  chunk's trailer, so that chunks swapped within an array or taken from
  another item are refused although each holds a valid checksum of its own,
  and chunks stored without checksums are checked too. Its manifest.json
  says so ("item_integrity"), so a lost one is an error. An item without
  either (written before bare items carried one, or by Orbax's own
  `Checkpointer`) has nothing to be checked against: [].
  """
  manifest = item / _integrity.ITEM_INTEGRITY_FILE
  if _integrity.is_link(manifest) or manifest.exists():
    return _integrity.check_step(item, depth=depth, manifest=_integrity.ITEM_INTEGRITY_FILE)
  if _declared(item, "item_integrity"):
    return [_integrity.Problem(
        "error", manifest,
        f"is missing, but the item's {MANIFEST_FILE} says it was written with one: the item"
        " is incomplete (a partial copy), and its files cannot be verified")]
  return []


def _declared(item: epath.Path, flag: str) -> bool:
  """An item's manifest.json's "item_integrity" or "step_integrity" (`_format`; a
  delta's in the state it records); False where the manifest cannot be read (opening
  the item reports that)."""
  try:
    data = json.loads((item / MANIFEST_FILE).read_text())
    if is_delta_manifest(data):
      data = data.get("state")
    return isinstance(data, dict) and declared_flag(data, flag)
  except (OSError, ValueError):
    return False


def walk_chain(item: epath.PathLike, *,
               check_ids: bool = True) -> list[tuple[epath.Path, DeltaManifest | None]]:
  """The chain of an item, base first: (item directory, its delta manifest or None).

  Reads manifests only. A full item is a chain of one. A delta that records
  its parent's save id (`DeltaManifest.parent_id`) needs the parent step to
  hold that save: a step replaced by another state of the same number (by
  hand, or copied from another run) is refused, not read as its base
  (`check_ids=False` skips that, to name a damaged link or another dtype
  first).

  Raises:
    BrokenChainError: naming the missing, unreadable or replaced link and
      the step that needs it.
  """
  item = epath.Path(item)
  links: list[tuple[epath.Path, DeltaManifest | None]] = []
  seen: set[str] = set()
  current, needed_by = item, None
  while True:
    if not (current / MANIFEST_FILE).exists():
      if needed_by is None:
        items = sorted(child.name for child in current.iterdir()
                       if (child / MANIFEST_FILE).exists()) if current.is_dir() else []
        hint = (f" It is a step: pass its embedding item, {current / items[0]}." if items
                else "")
        raise BrokenChainError(
            f"{current} holds no complete embedding item ({MANIFEST_FILE}).{hint}")
      _raise_if_damaged(needed_by)
      raise BrokenChainError(
          f"step {current.parent.name} is missing or incomplete ({current} has no"
          f" {MANIFEST_FILE}), but delta step {needed_by.parent.name} needs it: its chain is"
          f" {current.parent.name} <- {' <- '.join(p.parent.name for p, _ in reversed(links))}"
          " (base first)."
          " Restore an older complete step, or a full one."
      )
    data = read_item_manifest(current)
    if needed_by is not None and check_ids:
      try:
        _check_parent_id(current, _save_id(current, data), links[-1][1], needed_by)
      except BrokenChainError:
        _raise_if_damaged(needed_by)
        raise
    manifest = _delta_manifest(current, data)
    links.append((current, manifest))
    if manifest is None:
      return links[::-1]
    seen.add(current.parent.name)
    parent = step_item(current, manifest.parent_step)
    if parent.parent.name in seen or (
        current.parent.name.isdigit() and manifest.parent_step >= int(current.parent.name)
    ):
      _raise_if_damaged(current)
      raise BrokenChainError(
          f"delta step {current.parent.name} names parent step {manifest.parent_step}, which is"
          " not an earlier step; the chain is damaged."
      )
    current, needed_by = parent, current


def _raise_if_damaged(delta_item: epath.Path) -> None:
  """Raises BrokenChainError naming the damaged files of a delta item whose chain broke.

  A delta's manifest names its parent step: edited or swapped, it sends the
  chain to a step that is missing or holds another save. Where the delta's
  step has an integrity manifest, its files are checked (sizes, and the
  checksums of the small ones such as manifest.json) before the missing or
  replaced parent is blamed. A no-op where they check or nothing records them.
  """
  step = delta_item.parent
  if not (step / _integrity.INTEGRITY_FILE).exists():
    return
  problems = _integrity.errors(
      _integrity.check_step(step, depth="structure", items=[delta_item.name]))
  if problems:
    raise BrokenChainError(
        f"the delta chain of step {step.name} cannot be followed: its item {delta_item} failed its"
        f" integrity check ({_integrity.summarize(problems)}); its manifest names the step"
        " before it. Restore another complete step, or copy this one again from a good source."
    )


def _check_parent_id(parent: epath.Path, found: str | None, delta: DeltaManifest,
                     delta_item: epath.Path) -> None:
  """Raises unless `parent` holds the save `delta` was written on (when it recorded one)."""
  if delta.parent_id is None or delta.parent_id == found:
    return
  holds = "a save without an id" if found is None else f"save {found}"
  raise BrokenChainError(
      f"delta step {delta_item.parent.name} was saved on top of save {delta.parent_id} of"
      f" step {parent.parent.name}, but {parent} holds {holds}: step {parent.parent.name} was"
      " replaced after the delta was written (copied from another run, or saved again), or"
      f" the delta's manifest was edited. Its rows would go on top of another state. Put the"
      f" original step {parent.parent.name} back, or restore step {parent.parent.name} or"
      " another complete step instead."
  )


def table_states(
    manifest: Manifest, layout: EmbeddingLayout | None
) -> dict[str, tuple[dict, str | None]]:
  """Table -> (what a chain keeps of it, its recorded optimizer name or None).

  What a chain keeps: the table's shape (V, D), its slot declarations, and the
  dtypes of its table and slot arrays.
  """
  out = {}
  for group in manifest.groups:
    if layout is None:
      tables = [(group.name, tuple(group.table.shape))]
    else:
      tables = [
          (t.name, (t.vocabulary_size, t.embedding_dim)) for t in layout.stack(group.name).tables
      ]
    for name, shape in tables:
      kept = {
          "shape": shape,
          "slots": group.slot_specs,
          "dtype": group.table.dtype,
          "slot dtypes": {slot: info.dtype for slot, info in group.slots.items()},
      }
      out[name] = (kept, group.optimizer)
  return out


def _link_states(item: epath.Path, manifest: DeltaManifest | None):
  """`table_states` of one link of a chain (a full item or a delta)."""
  if manifest is not None:
    state = manifest.state
  else:
    state = Manifest.from_dict(read_item_manifest(item), str(item / MANIFEST_FILE))
  layout = None
  if state.kind == "stacked":
    layout = read_layout(item / LAYOUT_FILE, CorruptCheckpointError)
  return table_states(state, layout)


def check_deltas_keep_base(base_directory: epath.Path, base_states: dict,
                           deltas: Sequence[DeltaItem]) -> dict[str, str | None]:
  """Raises unless every delta keeps its tables as the base has them (`table_states`).

  Args:
    base_directory: the chain's base item (named in messages).
    base_states: `table_states` of the base.
    deltas: the chain's deltas, oldest first.

  Returns:
    Table -> the optimizer the chain records for its slots (None: none).

  Raises:
    IncompatibleCheckpointError: a delta updates a table the base lacks,
      stores one with another shape, slots or dtypes, or records another
      optimizer than an earlier link.
  """
  optimizer_names = {table: name for table, (_, name) in base_states.items()}
  for delta in deltas:
    for table, (found, optimizer) in table_states(delta.manifest.state, delta.layout).items():
      if table not in base_states:
        raise IncompatibleCheckpointError(
            f"delta {delta.directory} updates table {table!r}, which its base"
            f" {base_directory} does not hold (it holds {sorted(base_states)})."
        )
      wanted = base_states[table][0]
      for key in found:
        if found[key] != wanted[key]:
          raise IncompatibleCheckpointError(
              f"delta {delta.directory} stores table {table!r} with {key}"
              f" {found[key]} but its base {base_directory} has {wanted[key]}; a chain"
              " keeps its tables. Save a full checkpoint after changing tables or optimizer."
          )
      known = optimizer_names.get(table)
      if optimizer is not None and known not in (None, optimizer):
        raise IncompatibleCheckpointError(
            f"delta {delta.directory} stores table {table!r} with the slots of optimizer"
            f" {optimizer!r}, but the steps before it in its chain (base"
            f" {base_directory}) hold them for optimizer {known!r}; a chain keeps its"
            " optimizer. Restore a step before this delta; after changing the optimizer,"
            " save a full checkpoint."
        )
      if optimizer is not None:
        optimizer_names[table] = optimizer
  return optimizer_names


def check_chain_states(item: epath.PathLike) -> None:
  """Raises unless the deltas of an item's chain keep the base's tables (reads manifests only).

  Then, that each delta's parent still holds the save it was written on.

  Raises:
    BrokenChainError: a link is missing, unreadable or replaced.
    IncompatibleCheckpointError: as `check_deltas_keep_base`.
    CorruptCheckpointError: a delta's layout or part markers are missing.
  """
  links = walk_chain(item, check_ids=False)
  if len(links) > 1:
    check_deltas_keep_base(links[0][0], _link_states(*links[0]),
                           [DeltaItem(path, manifest) for path, manifest in links[1:]])
    walk_chain(item)


def dependent_deltas(step_dir: epath.PathLike, item_name: str) -> list[list[DeltaItem]]:
  """The chains of the later steps of a root that read `step_dir`'s item.

  For every step of `step_dir`'s root numbered after it whose item
  `item_name` is a delta whose chain passes through `step_dir`: the deltas
  of that chain after it, oldest first. Chains that cannot be read are left
  out (verify names them).
  """
  step_dir = epath.Path(step_dir)
  if not step_dir.name.isdigit() or not step_dir.parent.is_dir():
    return []
  out = []
  for sibling in step_dir.parent.iterdir():
    item = sibling / item_name
    if (not sibling.name.isdigit() or int(sibling.name) <= int(step_dir.name)
        or _integrity.is_link(sibling) or not (item / MANIFEST_FILE).exists()):
      continue
    try:
      links = walk_chain(item)
    except CheckpointReadError:
      raise
    except CheckpointError:
      continue
    parents = [path.parent.name for path, _ in links]
    if step_dir.name in parents:
      after = links[parents.index(step_dir.name) + 1:]
      out.append([DeltaItem(path, manifest) for path, manifest in after])
  return out


def continues_chain(parent: epath.PathLike, state: Manifest, layout: EmbeddingLayout) -> bool:
  """Whether a delta of `state` (in `layout`) saved after item `parent` would read back.

  It would if its tables are the chain's base tables with the same shapes,
  slots and dtypes, and no link records another optimizer for them (see
  `ChainReader`). Not so, for instance, after a restore that reset the slots
  of another optimizer: a full save must start a new chain. False also when
  the chain cannot be read.
  """
  try:
    links = [_link_states(item, manifest) for item, manifest in walk_chain(parent)]
  except (CorruptCheckpointError, NotACheckpointError, OSError, ValueError):
    return False
  for table, (kept, optimizer) in table_states(state, layout).items():
    if table not in links[0] or links[0][table][0] != kept:
      return False
    if optimizer is not None and any(
        link[table][1] not in (None, optimizer) for link in links if table in link
    ):
      return False
  return True


def stored_table_names(item: epath.PathLike) -> tuple[str, ...]:
  """The tables of an embedding item, read from manifests only (a delta's are its
  chain's, which keeps its base's tables)."""
  return tuple(stored_table_shapes(item))


def stored_table_shapes(item: epath.PathLike) -> dict[str, tuple[int, int]]:
  """Table name -> (vocabulary_size, embedding_dim) of an embedding item, from manifests
  only (a delta's are its chain's base's)."""
  reader = CheckpointReader(walk_chain(item, check_ids=False)[0][0])
  return {name: tuple(reader.table_shape(name)) for name in reader.table_names}


def open_reader(item: epath.PathLike, *,
                chunk_cache: ChunkCache | None = None) -> CheckpointReader:
  """A reader of any embedding item: `CheckpointReader` if full, `ChainReader` if a delta.

  `chunk_cache` as for `CheckpointReader` (for a chain: the base's chunks).
  """
  item = epath.Path(item)
  if (item / MANIFEST_FILE).exists() and delta_manifest(item) is not None:
    return ChainReader(item, chunk_cache=chunk_cache)
  return CheckpointReader(item, chunk_cache=chunk_cache)


class _Overlay:
  """Sorted rows and, for each, where its newest value lives: (source, position).

  A source is one stack of one process's part of one delta (`ChainReader`
  numbers them oldest delta first); position is the row's index in it.
  """

  def __init__(self, rows: np.ndarray, source: np.ndarray, position: np.ndarray):
    order = np.argsort(rows, kind="stable")
    self.rows, self.source, self.position = rows[order], source[order], position[order]

  @classmethod
  def newest(cls, rows, source, position) -> "_Overlay":
    """Keeps, per row, the entry of the newest source (the largest number)."""
    order = np.lexsort((source, rows))
    rows, source, position = rows[order], source[order], position[order]
    last = np.ones(rows.shape, bool)
    last[:-1] = rows[1:] != rows[:-1]
    return cls(rows[last], source[last], position[last])

  @classmethod
  def empty(cls) -> "_Overlay":
    none = np.zeros((0,), np.int64)
    return cls(none, none, none)

  def find(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(positions in `rows` that a delta overrides, their entries in this overlay)."""
    if not self.rows.size:
      return np.zeros((0,), np.int64), np.zeros((0,), np.int64)
    index = np.minimum(np.searchsorted(self.rows, rows), self.rows.size - 1)
    hit = np.flatnonzero(self.rows[index] == rows)
    return hit, index[hit]


class ChainReader(CheckpointReader):
  """A base checkpoint with the deltas of a chain applied (see the module docstring).

  Args:
    item: a delta item directory (root/<step>/<item>).

  Raises:
    BrokenChainError: a link of the chain is missing, damaged or replaced.
    IncompatibleCheckpointError: a delta stores other tables, slots or
      dtypes than its base.
  """

  def __init__(self, item: epath.PathLike, *, chunk_cache: ChunkCache | None = None):
    links = walk_chain(item, check_ids=False)
    super().__init__(links[0][0], chunk_cache=chunk_cache)
    self.item = epath.Path(item)
    self.base_directory = links[0][0]
    self.deltas = [DeltaItem(path, manifest) for path, manifest in links[1:]]
    self._optimizer_names = check_deltas_keep_base(
        self.base_directory, table_states(self.manifest, self.layout), self.deltas)
    walk_chain(item)  # Every parent still holds the save its delta was written on.
    self._sources: list[tuple[DeltaItem, int, str]] = []  # (delta, part, its stack)
    self._by_table = self._index()
    self._by_group: dict[str, _Overlay] = {}
    self._group_lock = threading.Lock()

  def optimizer_name(self, table: str) -> str | None:
    """As `CheckpointReader.optimizer_name`: the base's, else the one a delta records."""
    self._table(table)  # Raises MissingTableError naming the table.
    return self._optimizer_names.get(table)

  def _index(self) -> dict[str, _Overlay]:
    """Table -> the overlay of its logical rows that the deltas hold."""
    entries: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
    for delta in self.deltas:
      for stack in delta.layout.stacks:
        for part in range(delta.manifest.num_processes):
          ids = delta.ids(stack.name, part)
          if ids.size and (ids.min() < 0 or ids.max() >= stack.vocabulary_size):
            raise CorruptCheckpointError(
                f"delta {delta.directory}: stack {stack.name!r} part {part} holds row ids"
                f" outside [0, {stack.vocabulary_size})."
            )
          source = len(self._sources)
          self._sources.append((delta, part, stack.name))
          table_index, logical = global_to_logical_rows(stack, ids)
          for k, table in enumerate(stack.tables):
            chosen = np.flatnonzero((table_index == k) & (logical < table.vocabulary_size))
            entries.setdefault(table.name, []).append(
                (logical[chosen], np.full(chosen.shape, source, np.int64), chosen)
            )
    return {
        name: _Overlay.newest(*(np.concatenate(column) for column in zip(*columns)))
        for name, columns in entries.items()
    }

  def fill_rows(self, out: np.ndarray, requests) -> None:
    """As `CheckpointReader.fill_rows`, with the newest delta value of each row."""
    super().fill_rows(out, requests)
    overlays = []
    for table, slot, rows, out_rows in requests:
      overlay = self._by_table.get(table)
      if overlay is not None:
        hit, entries = overlay.find(np.asarray(rows, dtype=np.int64))
        out_rows = np.asarray(out_rows, dtype=np.int64)[hit]
        overlays.append((overlay, entries, out_rows, self.row_width(table, slot), slot))
    self._apply(out, overlays)

  def fill_strided_rows(self, out: np.ndarray, requests) -> None:
    """As `CheckpointReader.fill_strided_rows`, with the newest delta value of each row."""
    positions = [np.arange(count, dtype=np.int64) for *_, count, _ in requests]
    self.fill_rows(
        out,
        [
            (table, slot, first + step * j, out_row + j)
            for (table, slot, first, step, _, out_row), j in zip(requests, positions)
        ],
    )

  def read_block(self, group: str, slot: str | None, start: int, stop: int, *,
                 out: np.ndarray | None = None) -> np.ndarray:
    """Stored rows [start, stop) of a base group's array, with the deltas applied."""
    overlay = self._group_overlay(group)
    lo, hi = np.searchsorted(overlay.rows, [start, stop])
    info = self.manifest.group(group)
    width = (info.table if slot is None else info.slots[slot]).shape[1]
    entries = np.arange(lo, hi)
    started = self._start([(overlay, entries, overlay.rows[lo:hi] - start, width, slot)])
    out = super().read_block(group, slot, start, stop, out=out)  # While the deltas are read.
    self._finish(out, started)
    return out

  def _group_overlay(self, group: str) -> _Overlay:
    """The overlay of a base stack in its global rows (for `read_block`), built once."""
    with self._group_lock:  # Blocks of one stack are built by several threads.
      return self._build_group_overlay(group)

  def _build_group_overlay(self, group: str) -> _Overlay:
    if group not in self._by_group:
      columns = []
      for table in self.layout.stack(group).tables:
        overlay = self._by_table.get(table.name)
        if overlay is not None:
          rows = np.asarray(logical_to_global_rows(self.layout, table.name, overlay.rows))
          columns.append((rows.astype(np.int64), overlay.source, overlay.position))
      self._by_group[group] = (
          _Overlay(*(np.concatenate(c) for c in zip(*columns))) if columns else _Overlay.empty()
      )
    return self._by_group[group]

  def _apply(self, out: np.ndarray, overlays) -> None:
    """Copies delta values into `out[out_rows, :width]` (see `_start`)."""
    self._finish(out, self._start(overlays))

  def _start(self, overlays) -> list:
    """Starts the reads of delta values; `_finish` puts them into the output.

    A source's rows for one request usually form a dense run of its
    positions (a delta stores its rows sorted, and a block is a run of
    rows): then the run is read with one contiguous read, started here, and
    scattered by numpy in `_finish`, much faster than an index-array read.
    Sparse positions (less than 1 in `_DENSE` of the run needed) are copied
    row by row into the output (`copy_rows`), started in `_finish`.

    Args:
      overlays: (overlay, entries, out_rows, width, slot): the values of
        `overlay`'s entries go to `out[out_rows, :width]`.
    """
    started = []
    for overlay, entries, out_rows, width, slot in overlays:
      sources = overlay.source[entries]
      for source in np.unique(sources):
        chosen = np.flatnonzero(sources == source)
        delta, part, stack = self._sources[source]
        store = delta.store(stack, part, slot)
        positions, dest = overlay.position[entries[chosen]], out_rows[chosen]
        columns = min(width, store.shape[1])
        first, stop = int(positions.min()), int(positions.max()) + 1
        run = None
        if stop - first <= _DENSE * positions.size:
          try:
            run = store[first:stop, :columns].read()
          except ValueError as error:
            raise _corrupt(delta, stack, slot, error) from error
        started.append((delta, stack, slot, store, run, positions, first, dest, columns))
    return started

  def _finish(self, out: np.ndarray, started: list) -> None:
    copies = []
    for delta, stack, slot, store, run, positions, first, dest, columns in started:
      try:
        if run is None:
          futures = _storage.copy_rows(store, positions, out, dest, columns)
          copies.append((delta, stack, slot, futures))
        else:
          out[dest, :columns] = run.result()[positions - first]
      except ValueError as error:
        raise _corrupt(delta, stack, slot, error) from error
    for delta, stack, slot, futures in copies:
      try:
        for future in futures:
          future.result()
      except ValueError as error:
        raise _corrupt(delta, stack, slot, error) from error


def _corrupt(delta: DeltaItem, stack: str, slot: str | None, error) -> CheckpointError:
  """A CorruptCheckpointError for a failed read of a delta's array (or a
  CheckpointReadError where the storage refused or did not answer: `read_error`)."""
  what = "table" if slot is None else f"slot {slot!r}"
  return read_error(
      error, f"delta checkpoint {delta.directory}: reading stack {stack!r} {what} failed",
      "The delta is corrupt or truncated; restore a step before it.",
  )


def chain_summary(item: epath.PathLike) -> list[dict]:
  """The chain of an item, base first: step, kind, save id and, for deltas, the parent's
  step and id, rows per stack and layout (ids None where a checkpoint has none).

  A delta's layout is the one its job ran on (its rows are global rows of
  it); after an elastic restore it differs from its base's. It is given as
  {"num_devices", "shards_per_device", "stacks": stack -> table names}.
  """
  out = []
  for path, manifest in walk_chain(item):
    step = path.parent.name
    entry: dict = {"step": int(step) if step.isdigit() else step, "path": str(path)}
    if manifest is None:
      entry.update(kind="full", save_id=save_id_of(path))
    else:
      delta = DeltaItem(path, manifest)
      layout = {"num_devices": delta.layout.num_devices,
                "shards_per_device": delta.layout.shards_per_device,
                "stacks": {stack.name: list(stack.table_names) for stack in delta.layout.stacks}}
      entry.update(kind="delta", save_id=manifest.save_id, parent_step=manifest.parent_step,
                   parent_id=manifest.parent_id, rows=delta.num_rows, layout=layout)
    out.append(entry)
  return out
