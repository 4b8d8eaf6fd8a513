"""The manifest of an embedding checkpoint: what is stored where, as JSON.

An embedding checkpoint item is a directory:

  manifest.json                   this module's `Manifest` (written last)
  layout.json                     the EmbeddingLayout (kind 'stacked' only)
  stacks/<name>/table             zarr v3 array [V_s, D']        (kind 'stacked')
  stacks/<name>/slots/<slot>      zarr v3 array [V_s, D' or w]
  tables/<name>/table             zarr v3 array [V, D]           (kind 'unstacked')
  tables/<name>/slots/<slot>      zarr v3 array [V, D or w]

where <name> and <slot> are encoded with `_names.encode_name`. A group is a
stack (stacked kind) or a table (unstacked kind); every group holds its table
array and one array per slot variable of its optimizer. Array paths are always
recomputed from the names, never read from the file.

A group's "optimizer" names the optimizer that wrote its slots
(`_optimizers.optimizer_name`, e.g. 'adam'); it is optional, absent from
checkpoints written before it existed or saved without knowing it. Being
optional, it leaves the format version at 1: a reader of version 1 that
predates the field ignores it and restores as it always did, and this
reader restores a manifest without it as before (slots matched by name and
width only).

"save_id" (optional likewise) identifies the saved state: a random id given
by each save, kept by a conversion that keeps the values (another layout or
device count; a compaction). A delta records its parent's id, so a parent
step replaced by another state of the same step number is refused rather
than read as the delta's base (`_chain.walk_chain`).

"item_integrity" (optional, true or absent) marks an item written outside any
step by `convert`, which holds a manifest of its own files
(`item_integrity.json`, see `checkpoint._integrity`): an item saying so
without that file lost it, and is not read as an item written before items
carried one. "step_integrity" (likewise) marks an item saved into a step that
gets an integrity manifest (by a `CheckpointManager`, or `convert`): such an
item in a step directory without `integrity.json` is in a step that lost it,
not in one written by Orbax's own managers, and is not read unchecked.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any, Literal

import ml_dtypes
import numpy as np
from etils import epath

from checkpoint._errors import CheckpointError, NotACheckpointError, read_text
from checkpoint._names import encode_name
from checkpoint._storage import StorageOptions
from sc_framework.optimizers import SlotSpec
from sc_framework.stacking import EmbeddingLayout

FORMAT_NAME = "sc_framework.embedding_checkpoint"
FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
LAYOUT_FILE = "layout.json"
Kind = Literal["stacked", "unstacked"]


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
  """One stored array: shape, dtype (numpy name) and rows per chunk."""

  shape: tuple[int, int]
  dtype: str
  chunk_rows: int

  @property
  def nbytes(self) -> int:
    return self.shape[0] * self.shape[1] * np.dtype(_numpy_dtype(self.dtype)).itemsize


@dataclasses.dataclass(frozen=True)
class GroupInfo:
  """A stack (stacked kind) or a table (unstacked kind) and its arrays.

  Attributes:
    optimizer: the name of the optimizer that wrote the slots
      (`_optimizers.optimizer_name`), or None where unknown.
  """

  name: str
  table: ArrayInfo
  slot_specs: tuple[SlotSpec, ...]
  slots: dict[str, ArrayInfo]
  optimizer: str | None = None

  @property
  def nbytes(self) -> int:
    return self.table.nbytes + sum(info.nbytes for info in self.slots.values())


@dataclasses.dataclass(frozen=True)
class Manifest:
  """Everything about an embedding checkpoint except the array data and layout."""

  kind: Kind
  groups: tuple[GroupInfo, ...]
  storage: StorageOptions
  # Which save, not what is stored: manifests of the same arrays compare equal.
  save_id: str | None = dataclasses.field(default=None, compare=False)
  # Whether the item holds its own integrity manifest, or its step does (the module doc).
  item_integrity: bool = dataclasses.field(default=False, compare=False)
  step_integrity: bool = dataclasses.field(default=False, compare=False)

  def group(self, name: str) -> GroupInfo:
    for group in self.groups:
      if group.name == name:
        return group
    raise KeyError(name)

  @property
  def nbytes(self) -> int:
    return sum(group.nbytes for group in self.groups)

  def to_dict(self) -> dict[str, Any]:
    out = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "kind": self.kind,
        "storage": self.storage.to_dict(),
        "groups": [_group_to_dict(group) for group in self.groups],
    }
    if self.save_id is not None:  # Absent where unknown, as in older checkpoints.
      out["save_id"] = self.save_id
    for key in ("item_integrity", "step_integrity"):
      if getattr(self, key):
        out[key] = True
    return out

  @classmethod
  def from_dict(cls, data: Any, where: str) -> "Manifest":
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
      raise NotACheckpointError(
          f"{where} is not an embedding checkpoint manifest (no format {FORMAT_NAME!r})."
      )
    if data.get("format_version") != FORMAT_VERSION:
      raise NotACheckpointError(
          f"{where}: format_version {data.get('format_version')!r} is not supported; this library"
          f" reads version {FORMAT_VERSION}. Upgrade the library."
      )
    try:
      kind = data["kind"]
      if kind not in ("stacked", "unstacked"):
        raise ValueError(f"unknown kind {kind!r}")
      groups = []
      for group in data["groups"]:
        specs, slots = [], {}
        for slot in group["slots"]:
          width = slot["width"]
          spec = SlotSpec(
              str(slot["name"]), None if width is None else int(width), float(slot["initial_value"])
          )
          specs.append(spec)
          slots[spec.name] = _array_from_dict(slot["array"])
        if len(slots) != len(specs):
          raise ValueError(f"group {group['name']!r} names a slot twice")
        optimizer = group.get("optimizer")
        if optimizer is not None and (not isinstance(optimizer, str) or not optimizer):
          raise ValueError(f"group {group['name']!r} has optimizer {optimizer!r}, not a name")
        groups.append(
            GroupInfo(
                str(group["name"]),
                _array_from_dict(group["table"]),
                tuple(specs),
                slots,
                optimizer,
            )
        )
      names = [group.name for group in groups]
      if len(set(names)) != len(names):
        raise ValueError(f"duplicate group names in {names}")
      storage = StorageOptions.from_dict(data["storage"])
      save_id = read_save_id(data)
      flags = [declared_flag(data, key) for key in ("item_integrity", "step_integrity")]
    except (KeyError, TypeError, ValueError) as error:
      raise NotACheckpointError(f"{where}: malformed manifest ({error!r}).") from error
    return cls(kind, tuple(groups), storage, save_id, *flags)

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), indent=1, sort_keys=True)


def read_layout(path: epath.Path,
                error: type[CheckpointError] = NotACheckpointError) -> EmbeddingLayout:
  """The stacking layout of an item's `layout.json` at `path`.

  Raises:
    error: naming the file, where it is missing, unreadable or holds no
      valid layout (NotACheckpointError by default; a file that a step's
      manifest lists is damage, CorruptCheckpointError).
    CheckpointReadError: the storage refused or did not answer the read.
  """
  try:
    text = read_text(path)
  except (OSError, UnicodeDecodeError) as cause:
    raise error(f"{path} cannot be read: {cause}.") from cause
  try:
    return EmbeddingLayout.from_json(text)
  except ValueError as cause:
    raise error(f"{path}: invalid layout: {cause}") from cause


def declared_flag(data: dict[str, Any], key: str) -> bool:
  """A parsed manifest's "item_integrity" or "step_integrity" (see the module doc)."""
  value = data.get(key, False)
  if not isinstance(value, bool):
    raise ValueError(f"{key} {value!r} is not true or false")
  return value


def new_save_id() -> str:
  """A fresh id for a saved state (random, 32 hex digits)."""
  return uuid.uuid4().hex


def read_save_id(data: dict[str, Any]) -> str | None:
  """The "save_id" of a parsed manifest (full or delta), or None where it has none.

  Raises:
    ValueError: the entry is there but not a non-empty string.
  """
  save_id = data.get("save_id")
  if save_id is not None and (not isinstance(save_id, str) or not save_id):
    raise ValueError(f"save_id {save_id!r} is not an id")
  return save_id


def _group_to_dict(group: GroupInfo) -> dict[str, Any]:
  out: dict[str, Any] = {
      "name": group.name,
      "table": _array_to_dict(group.table),
      "slots": [
          {
              "name": spec.name,
              "width": spec.width,
              "initial_value": spec.initial_value,
              "array": _array_to_dict(group.slots[spec.name]),
          }
          for spec in group.slot_specs
      ],
  }
  if group.optimizer is not None:  # Absent where unknown, as in older checkpoints.
    out["optimizer"] = group.optimizer
  return out


def _array_to_dict(info: ArrayInfo) -> dict[str, Any]:
  return {"shape": list(info.shape), "dtype": info.dtype, "chunk_rows": info.chunk_rows}


def _array_from_dict(data: dict[str, Any]) -> ArrayInfo:
  shape = tuple(int(x) for x in data["shape"])
  chunk_rows = int(data["chunk_rows"])
  if len(shape) != 2 or min(shape) < 0 or chunk_rows <= 0:
    raise ValueError(f"invalid array entry {data!r}")
  _numpy_dtype(str(data["dtype"]))
  return ArrayInfo(shape, str(data["dtype"]), chunk_rows)  # type: ignore[arg-type]


def _numpy_dtype(name: str) -> np.dtype:
  return np.dtype(getattr(ml_dtypes, name, name))


def numpy_dtype(name: str) -> np.dtype:
  """The numpy dtype of a stored dtype name (bfloat16 included)."""
  return _numpy_dtype(name)


def group_dir(directory: epath.Path, kind: Kind, name: str) -> epath.Path:
  return directory / ("stacks" if kind == "stacked" else "tables") / encode_name(name)


def array_dir(directory: epath.Path, kind: Kind, group: str, slot: str | None) -> epath.Path:
  """The directory of a group's table array (slot None) or of one of its slots."""
  base = group_dir(directory, kind, group)
  return base / "table" if slot is None else base / "slots" / encode_name(slot)
