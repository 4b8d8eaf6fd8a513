"""Checking a whole checkpoint without restoring it (`sc-checkpoint verify`).

`verify` accepts a CheckpointManager root (every step is checked, and every
entry the manager did not write is named), one step directory, or a bare
embedding item (as `convert` writes when given one). Every byte is read
once: each file's CRC32C against the step's integrity manifest, each zarr
chunk's against its own crc32c trailer.

`adopt_step` gives a step written without a manifest (by a version before
integrity checks) one, after checking what can be checked without it: no
links, every JSON file parses, every embedding chunk present, of its size
and (where stored with checksums) matching them.
"""

from __future__ import annotations

import ast
import json
import re

import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath

from checkpoint import _errors, _integrity, _storage
from checkpoint._chain import bare_item_problems, chain_problems, check_chain_states, delta_manifest
from checkpoint._delta import IDS, DeltaItem, DeltaManifest
from checkpoint._direct import chunk_file
from checkpoint._errors import CheckpointError, CheckpointReadError
from checkpoint._format import MANIFEST_FILE, array_dir, numpy_dtype
from checkpoint._integrity import Problem
from checkpoint._reader import CheckpointReader
from checkpoint._source import step_of_item
from checkpoint._steps import is_unfinished_save

_STEP = re.compile(r"^\d+$")
_ROOT_FILES = frozenset({_integrity.ORBAX_STEP_METADATA, "descriptor", "metadata"})


def verify(path: epath.PathLike) -> list[Problem]:
  """Every problem of a checkpoint root, step or embedding item (empty: all verified).

  An embedding item inside a step (full or delta) is checked against that
  step's integrity manifest, as a restore or conversion of it is, and so are
  the earlier steps of its delta chain; a bare item (written by `convert`
  outside any step) against its own manifest (`bare_item_problems`), and
  then each of its chunks' checksums (`verify_item`).

  Raises:
    CheckpointError: the path does not exist.
  """
  path = _storage.as_path(path, "verify path")
  if _integrity.is_link(path) and _is_step_or_item(path):
    # A root may be reached through a link (a folder on another disk); the
    # steps and items inside a checkpoint may not: restores refuse them.
    return [Problem("error", path, "is a symbolic link; nothing is read through one")]
  if not path.exists():
    raise CheckpointError(f"{path} does not exist.")
  if not path.is_dir():
    raise CheckpointError(f"{path} is a file, not a checkpoint directory.")
  if (path / MANIFEST_FILE).exists():
    step = step_of_item(path)
    if step is not None:  # An item of a step: against that step's manifest, and its chain.
      return _integrity.check_step(step, depth="full", items=[path.name]) + item_chain_problems(
          path, "full"
      )
    # A bare item: against its own manifest (files, chunks' places), then
    # each array's metadata and every chunk's checksum.
    own = bare_item_problems(path, "items")
    if _integrity.errors(own):
      return own
    has_manifest = (path / _integrity.ITEM_INTEGRITY_FILE).exists()
    return own + verify_item(path, checked_by_manifest=has_manifest)
  if (path / _integrity.INTEGRITY_FILE).exists() or _STEP.match(path.name):
    return (_integrity.check_step(path, depth="full") + _step_metadata_problems(path)
            + step_chain_problems(path, "full"))
  return verify_root(path)


def _step_metadata_problems(step_dir: epath.Path) -> list[Problem]:
  """A warning for Orbax's step metadata (`_CHECKPOINT_METADATA`) that does not parse.

  The integrity manifest leaves it out (Orbax's commit updates it after the
  manifest is written), and no restore needs it: they read every item
  without it, while Orbax logs "Failed to json parse" errors. So it is named
  here, as a warning. (A step without a manifest has it checked as JSON
  with its other files, as an error.)
  """
  path = step_dir / _integrity.ORBAX_STEP_METADATA
  if not (step_dir / _integrity.INTEGRITY_FILE).exists() or not path.is_file():
    return []
  try:
    json.loads(path.read_text())
  except (OSError, ValueError) as error:
    return [Problem("warning", path, f"Orbax's step metadata does not parse ({error}): no"
                    " restore needs it (every item is verified without it), but Orbax logs"
                    " errors for it on each restore. Copy the step again from its source to"
                    " repair it.")]
  return []


def _is_step_or_item(path: epath.Path) -> bool:
  """Whether `path` (a link, perhaps dangling) leads to a step or an item, not a root."""
  try:
    return (_STEP.match(path.name) is not None or (path / MANIFEST_FILE).exists()
            or (path / _integrity.INTEGRITY_FILE).exists())
  except OSError:
    return True


def step_chain_problems(step_dir: epath.Path,
                        depth: _integrity.Depth | None) -> list[Problem]:
  """The problems of the delta chains of a step's embedding items.

  A chain that lacks a step or names an unreadable one is an error on the
  item: a restore, conversion or compaction of the step would fail. With a
  `depth`, every earlier step of the chain is also checked against its own
  manifest (`_chain.chain_problems`); None checks the chain's links only (as
  `verify_root` does, which checks every step itself).
  """
  problems: list[Problem] = []
  if _integrity.is_link(step_dir) or not step_dir.is_dir():
    return problems
  for item in sorted(step_dir.iterdir(), key=lambda p: p.name):
    if _integrity.is_link(item) or not (item / MANIFEST_FILE).exists():
      continue
    problems.extend(item_chain_problems(item, depth))
  return problems


def item_chain_problems(item: epath.Path, depth: _integrity.Depth | None) -> list[Problem]:
  """The problems of one embedding item's delta chain (see `step_chain_problems`).

  Besides its links, the chain's deltas must keep the base's tables (shapes,
  slots, dtypes, optimizer; `_chain.check_chain_states`): a base converted in
  place to bfloat16 under float32 deltas no longer restores.
  """
  problems: list[Problem] = []
  try:
    problems = [] if depth is None else chain_problems(item, depth)
    if not _integrity.errors(problems):  # Damaged links first; their states may be anything.
      check_chain_states(item)
  except CheckpointReadError:
    raise  # The storage refused or did not answer: nothing says the chain is broken.
  except CheckpointError as error:
    problems.append(Problem("error", item, f"its delta chain is broken: {error}"))
  return problems


def verify_root(root: epath.Path) -> list[Problem]:
  """The problems of every step under a CheckpointManager root, and its foreign entries."""
  problems: list[Problem] = []
  steps = 0
  for child in sorted(root.iterdir(), key=lambda p: (len(p.name), p.name)):
    if _STEP.match(child.name):
      steps += 1
      if _integrity.is_link(child):
        problems.append(
            Problem("error", child, "a symbolic link named like a step; the manager ignores it")
        )
      else:
        problems.extend(_integrity.check_step(child, depth="full"))
        problems.extend(_step_metadata_problems(child))
        problems.extend(step_chain_problems(child, None))
    elif is_unfinished_save(child):
      problems.append(Problem("foreign", child, "an unfinished save, never a step; a"
                              " CheckpointManager opened for writing removes it"))
    elif child.name not in _ROOT_FILES:
      problems.append(
          Problem("foreign", child, "not a step written by the checkpoint manager; left alone")
      )
  if not steps:
    problems.append(Problem("error", root, "holds no checkpoint step (nor is it a step or item)"))
  return problems


def _links(directory: epath.Path) -> list[Problem]:
  """An error per symbolic link below `directory` (never followed)."""
  return [
      Problem("error", path, "is a symbolic link; nothing is read through one")
      for _, path, kind in _integrity.walk(directory)
      if kind == "link"
  ]


def verify_item(item: epath.Path, *, checked_by_manifest: bool = False) -> list[Problem]:
  """The problems of a bare embedding item: links, each array's metadata, and every chunk.

  Each array's zarr.json must describe what the manifest says (shape, dtype,
  rows per chunk, the storage's codecs), as a restore opens it.

  A delta item's arrays (every process's part) are read in full, which
  checks their chunks' checksums; its chain is not followed.
  `checked_by_manifest`: the item's own manifest checked every file's
  checksum (`bare_item_problems`), chunks stored without one included.
  """
  problems = _links(item)
  if problems:
    return problems
  try:
    delta = delta_manifest(item)
    if delta is not None:
      return _verify_delta(item, delta)
    reader = CheckpointReader(item)
  except CheckpointError as error:
    return [Problem("error", item, str(error))]
  if reader.manifest.storage.checksum != "crc32c" and not checked_by_manifest:
    problems.append(
        Problem("foreign", item, "stored without chunk checksums: only sizes can be checked")
    )
  for group in reader.manifest.groups:
    for slot, info in [(None, group.table)] + list(group.slots.items()):
      path = array_dir(item, reader.manifest.kind, group.name, slot)
      metadata = _array_metadata_problems(reader, group.name, slot, info, path)
      if metadata:
        problems.extend(metadata)
        continue
      chunk_bytes = info.chunk_rows * info.shape[1] * numpy_dtype(info.dtype).itemsize
      for chunk in range(-(-info.shape[0] // info.chunk_rows)):
        problems.extend(_check_chunk(chunk_file(path, chunk), chunk_bytes, reader))
  return problems


def _array_metadata_problems(reader: CheckpointReader, group: str, slot: str | None, info,
                             path: epath.Path) -> list[Problem]:
  """An array's zarr.json against the manifest: opens, shape and dtype, chunk rows, codecs."""
  try:
    store = reader.store(group, slot)  # Opening reads zarr.json and checks shape and dtype.
  except CheckpointError as error:
    return [Problem("error", path / "zarr.json", str(error))]
  itemsize = numpy_dtype(info.dtype).itemsize
  codecs = _codec_names(store.codec.to_json().get("codecs", []))
  expected = _codec_names(reader.manifest.storage.codecs(itemsize))
  found = []
  if codecs != expected:
    found.append(f"codecs {codecs}, but the manifest's storage writes {expected}")
  chunk_rows = store.chunk_layout.read_chunk.shape[0]
  if chunk_rows != info.chunk_rows:
    found.append(f"{chunk_rows} rows per chunk, but the manifest says {info.chunk_rows}")
  if not found:
    return []
  return [Problem("error", path / "zarr.json",
                  f"describes {'; '.join(found)}: its chunks would not read back as saved")]


def _verify_delta(item: epath.Path, manifest: DeltaManifest) -> list[Problem]:
  problems = []
  if manifest.state.storage.checksum != "crc32c":
    problems.append(
        Problem("foreign", item, "stored without chunk checksums: only shapes can be checked")
    )
  try:
    delta = DeltaItem(item, manifest)
    for stack in delta.layout.stack_names:
      arrays = [IDS, None, *manifest.state.group(stack).slots]
      for process in range(manifest.num_processes):
        if delta.counts[process][stack]:
          for array in arrays:
            delta.store(stack, process, array).read().result()
  except CheckpointReadError:  # the storage refused: nothing says the delta is damaged
    raise
  except (CheckpointError, ValueError) as error:
    problems.append(Problem("error", item, str(error)))
  return problems


def _check_chunk(file: epath.Path, payload: int, reader: CheckpointReader) -> list[Problem]:
  if not file.exists():
    return [Problem("error", file, "chunk file is missing")]
  checksummed = reader.manifest.storage.checksum == "crc32c"
  compressed = reader.manifest.storage.compression != "none"
  size = file.stat().length
  if not compressed and size != payload + 4 * checksummed:
    return [Problem("error", file, f"has {size} bytes, expected {payload + 4 * checksummed}")]
  if checksummed:
    crc, trailer = _integrity.crc32c_of_file(file, skip_tail=4)
    if int.from_bytes(trailer, "little") != crc:
      return [Problem("error", file, "chunk checksum mismatch (the zarr crc32c codec's trailer)")]
  return []


def _codec_names(codecs: list[dict]) -> list[str]:
  """Each codec's name, the byte order with it for `bytes` (what decoding depends on)."""
  names = []
  for codec in codecs:
    name = str(codec.get("name"))
    if name == "bytes":
      name += f" ({(codec.get('configuration') or {}).get('endian', 'little')} endian)"
    names.append(name)
  return names


def adopt_step(step_dir: epath.PathLike) -> list[Problem]:
  """Checks a step without an integrity manifest and, if sound, writes one.

  Returns the problems found; the manifest is written only when none is an
  error. A step that already has a manifest is verified as usual instead.

  Raises:
    CheckpointError: the path is not a step directory.
  """
  step_dir = _storage.as_path(step_dir, "adopt step directory")
  if _integrity.is_link(step_dir) or not step_dir.is_dir() or not _STEP.match(step_dir.name):
    raise CheckpointError(
        f"{step_dir} is not a step directory (a real directory named by its step number);"
        " --adopt takes one step, e.g. runs/exp1/checkpoints/5000."
    )
  if (step_dir / _integrity.INTEGRITY_FILE).exists():
    return _integrity.check_step(step_dir, depth="full")
  problems = _links(step_dir)
  if problems:
    return problems
  for rel, path, kind in _integrity.walk(step_dir):
    if kind == "file" and _is_json_file(path):
      try:
        value = json.loads(path.read_text())
        if path.name == _SHARDINGS:  # each value is a sharding, itself as JSON text
          for sharding in value.values():
            json.loads(sharding)
      except (OSError, ValueError, AttributeError, TypeError) as error:
        problems.append(Problem("error", path, f"is not readable JSON ({error})"))
  problems.extend(_item_problems(step_dir))
  if not _integrity.errors(problems):
    _integrity.write_manifest(step_dir, step=int(step_dir.name))
  return problems


# Orbax's JSON files without a .json suffix: a step's and a PyTree item's metadata, the
# item's shardings and its per-process array metadata.
_SHARDINGS = "_sharding"
_ORBAX_JSON_FILES = frozenset({_integrity.ORBAX_STEP_METADATA, "_METADATA", _SHARDINGS})


def _is_json_file(path: epath.Path) -> bool:
  return (path.name.endswith(".json") or path.name in _ORBAX_JSON_FILES
          or path.parent.name == "array_metadatas")


def _item_problems(step_dir: epath.Path) -> list[Problem]:
  """Every item of a step without a manifest, as its handler would restore it.

  The items Orbax's step metadata (`_CHECKPOINT_METADATA`) lists must be
  there (a copy that lost one would otherwise be adopted); an embedding item
  is verified in full (`verify_item`), a PyTree item (dense parameters,
  optimizer state) must hold every array its `_METADATA` names, each read
  back, and a JSON item its value.
  """
  handlers = _listed_handlers(step_dir)
  problems = []
  for name, handler in sorted(handlers.items()):
    if not (step_dir / name).is_dir():
      problems.append(Problem("error", step_dir / name,
                              f"is missing: {_integrity.ORBAX_STEP_METADATA} lists item {name!r}"
                              f" ({handler}), so the step is a partial copy"))
  for item in _integrity.unmerged_ocdbt_items(rel for rel, _, _ in _integrity.walk(step_dir)):
    problems.append(Problem("error", step_dir / item, "holds per-process OCDBT parts but no"
                            " merged manifest.ocdbt: Orbax never finished it; it does not restore"))
  if (step_dir / _PYTREE_METADATA).exists():  # A step that is one PyTree item itself.
    problems.extend(_pytree_item_problems(step_dir))
  for child in sorted(step_dir.iterdir(), key=lambda p: p.name):
    if not child.is_dir():
      continue
    handler = handlers.get(child.name, "")
    if "EmbeddingCheckpointHandler" in handler or (child / MANIFEST_FILE).exists():
      problems.extend(verify_item(child))
    elif "PyTreeCheckpointHandler" in handler or "StandardCheckpointHandler" in handler or (
        child / _PYTREE_METADATA).exists():
      problems.extend(_pytree_item_problems(child))
    elif "JsonCheckpointHandler" in handler:
      problems.extend(_json_item_problems(child))
  return problems


def _listed_handlers(step_dir: epath.Path) -> dict[str, str]:
  """Item name -> handler name, as `_CHECKPOINT_METADATA` lists them; {} when it lists
  none (a step of one item, whose handler is a plain string) or is missing or unreadable
  (which the JSON check reports)."""
  try:
    handlers = json.loads((step_dir / _integrity.ORBAX_STEP_METADATA).read_text())
    handlers = handlers.get("item_handlers") if isinstance(handlers, dict) else None
  except (OSError, ValueError):
    return {}
  if not isinstance(handlers, dict):
    return {}
  return {str(name): str(handler) for name, handler in handlers.items()}


_PYTREE_METADATA = "_METADATA"  # A PyTree item's tree: every leaf and how it is stored.


def _pytree_item_problems(item: epath.Path) -> list[Problem]:
  """A PyTree item (Orbax's `PyTreeCheckpointHandler`, `StandardCheckpointHandler`): its
  `_METADATA` parses, every array leaf it names is stored and reads back, and Orbax
  reads the tree (every key type and leaf type one it knows).

  OCDBT items (the default) are read key by key through TensorStore, so a
  data file that is missing or truncated fails; other items must hold each
  array's directory.
  """
  path = item / _PYTREE_METADATA
  if not path.exists():
    return [Problem("error", path, "is missing: a PyTree item without it does not restore")]
  try:
    metadata = json.loads(path.read_text())
  except (OSError, ValueError) as error:
    return [Problem("error", path, f"is not readable JSON ({error})")]
  if not isinstance(metadata, dict):
    return [Problem("error", path, f"holds a {type(metadata).__name__}, not a tree's metadata")]
  problems = _pytree_arrays_problems(item, metadata)
  if problems:
    return problems
  try:  # Orbax's own reading: every key type and leaf type it must know
    ocp.PyTreeCheckpointHandler().metadata(_storage.orbax_path(item))
  except Exception as error:  # noqa: BLE001 - Orbax raises ValueError, KeyError and others
    if _errors.storage_failure(error) is not None:
      raise _errors.read_error(error, f"reading {path} failed") from error
    return [Problem("error", path, f"is not a tree Orbax restores ({error})")]
  return []


def _pytree_arrays_problems(item: epath.Path, metadata: dict) -> list[Problem]:
  """Every array leaf of a PyTree item's `metadata` stored, and its OCDBT store read back."""
  use_ocdbt = bool(metadata.get("use_ocdbt", True))
  arrays = _stored_arrays(metadata)
  if not use_ocdbt:
    return [Problem("error", item / array, "is missing: the tree's array is not stored")
            for array in arrays or () if not (item / array).is_dir()]
  if not (item / "manifest.ocdbt").exists():
    if arrays == []:
      return []  # No array leaf (strings, None): nothing is stored in an OCDBT store.
    return [Problem("error", item / "manifest.ocdbt", "is missing: the item's OCDBT store"
                    " (its arrays) does not restore")]
  try:
    store = ts.KvStore.open({"driver": "ocdbt", "base": _storage.kvstore_spec(item)}).result()
    keys = {key.decode() for key in store.list().result()}
    for key in sorted(keys):
      store.read(key).result()
  except Exception as error:  # noqa: BLE001 - TensorStore raises ValueError and others
    if _errors.storage_failure(error) is not None:
      raise _errors.read_error(error, f"reading {item} failed") from error
    return [Problem("error", item, f"does not read back: {error}")]
  return [Problem("error", item, f"does not store the array {array!r} its tree names")
          for array in arrays or ()
          if f"{array}/.zarray" not in keys and f"{array}/zarr.json" not in keys]


# The leaf types a PyTree item stores as arrays (others: strings in _strings.json, None).
_ARRAY_LEAF_TYPES = ("jax.Array", "np.ndarray", "scalar")


def _stored_arrays(metadata: dict) -> list[str] | None:
  """The stored names of a PyTree item's array leaves, or None for an unknown format.

  `_METADATA` keys each leaf by its path's repr, e.g. "('opt_state', '0',
  'count')", stored as 'opt_state.0.count' (a zarr array: '<name>/.zarray' or
  '<name>/zarr.json'); leaves of other types (strings, None, empty nodes)
  store no array.
  """
  try:
    names = []
    for leaf, value in metadata["tree_metadata"].items():
      value = value.get("value_metadata") or {}
      if value.get("skip_deserialize") or value.get("value_type") not in _ARRAY_LEAF_TYPES:
        continue
      path = ast.literal_eval(leaf)
      names.append(".".join(str(part) for part in (path if isinstance(path, tuple) else (path,))))
    return names
  except (KeyError, TypeError, AttributeError, ValueError, SyntaxError):
    return None


def _json_item_problems(item: epath.Path) -> list[Problem]:
  """A JSON item (Orbax's `JsonCheckpointHandler`) holds its value in a file of its own
  (`metadata` by default, `metrics` for a manager's metrics), which must parse."""
  files = [child for child in item.iterdir()
           if child.name not in _integrity.COMMIT_FILES and not child.is_dir()]
  if not files:
    return [Problem("error", item, "holds no file: the JSON item's value is missing")]
  problems = []
  for path in files:
    try:
      json.loads(path.read_text())
    except (OSError, ValueError) as error:
      problems.append(Problem("error", path, f"is not readable JSON ({error})"))
  return problems
