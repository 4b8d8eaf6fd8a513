"""Offline conversion of a checkpoint to another layout, streamed with bounded memory.

  any stacked layout -> any other layout of the same tables (groups, G, S)
  stacked            -> unstacked (one [V, D] array per table and slot)
  unstacked          -> stacked

The output is a normal checkpoint that the restore path reads. It is built
array by array and, inside an array, block by block: a block is a run of rows
of the output (at most `block_bytes`; whole chunks where TensorStore writes
it), assembled from exactly the logical rows it holds
(`_assembly.build_block`), then written while the next one is assembled.
Peak memory is the chunk cache and a few blocks, whatever the table size.

Reads are chunk-granular and each source chunk file is read (and its CRC32C
checked) once: a stacked target's blocks are visited band by band, a band
being the same rows [u, u + b) of every shard, and target shard s' holds the
logical rows i = s' (mod N'), so one band of all N' shards holds the logical
rows [u N', (u + b) N') of each table in it, a contiguous run of every source
shard; the source chunks of a band are kept in a `_direct.ChunkCache` until
the next band (which continues in the same chunks) has used them. Visiting
the shards one after the other instead would read every source chunk
N' / gcd(N, N') times.

Bands are small, and the cache is sized array by array to a band plus two
edge chunks per source shard and table (`_cache_bytes`), at most
`_CACHE_BLOCKS * block_bytes`: a small cache and few blocks in flight reuse
their buffers, and paging in fresh memory costs more than the copies. A
directly written array (`_direct.ChunkWriter`) takes its chunks in pieces,
so its band is the fewest rows whose output reaches block_bytes; an
array written by TensorStore, or read in place from a stack of the same
placement, takes whole chunks, so its band holds at least one chunk per
shard (and reaches 2 x block_bytes). Reads stay once per chunk while that
cache fits the limit (256 MiB by default: a band of 32 MiB and, for 4 MiB
chunks, up to 28 source shards x tables); beyond, chunks are read again. A
chunk shared by two tables of a stack is read at most once per table (the
target arrays reading one source array follow each other, `_arrays`, so it
mostly stays cached). Compressed or
remote sources are read through TensorStore, chunk by chunk per block.

Inside a block, a table's rows are one run per target shard whose logical
rows advance by N' (`table_row_runs_in_block`); each is a few strided slice
copies per source chunk (`CheckpointReader.fill_strided_rows`), with no
per-row index arrays.

Slots follow their tables, with the optimizer recorded as owning them
(`_optimizers`). Tables of different optimizers cannot share a target stack,
nor can a table whose optimizer is recorded share one with a table whose
optimizer is not: the stack would lose the record, or claim the other table's
slots for that optimizer unchecked (see `convert`).
A conversion A -> B -> A reproduces every logical row and slot bit for bit;
padding rows and columns are 0 (tables) or the slot's initial value (slots).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import errno
import json
import os
import shutil
import socket
import warnings
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
from etils import epath

from checkpoint import _direct, _integrity, _optimizers, _save, _steps, _storage
from checkpoint._direct import ChunkCache
from checkpoint._format import MANIFEST_FILE, Manifest, array_dir, new_save_id, numpy_dtype
from checkpoint._assembly import assemble_stacked, build_block
from checkpoint._chain import (
    check_deltas_keep_base,
    dependent_deltas,
    open_reader,
    save_id_of,
    table_states,
)
from checkpoint._errors import CheckpointError, IncompatibleCheckpointError, SlotMismatchError
from checkpoint._reader import find_item
from checkpoint._source import verify_source
from checkpoint._storage import StorageOptions, host_buffer
from sc_framework.host_allocator import return_freed_memory
from sc_framework.stacking import EmbeddingLayout

ConversionProgress = Callable[[int, int, str], None]
"""progress(bytes_done, bytes_total, what): called after every block written."""

# Written first into a conversion's temporary directory (the host and process
# id of the conversion) and removed just before it is renamed into place. A
# temporary directory holding it whose process has ended was left by an
# interrupted conversion and may be deleted; one without it is not ours.
_IN_PROGRESS_MARKER = "CONVERSION_IN_PROGRESS"
# A directory being replaced (by `convert` with overwrite, or `compact`) is set aside as
# `<name>.replaced` until its replacement is in place.
REPLACED_SUFFIX = ".replaced"
_DEFAULT_BLOCK_BYTES = 32 << 20
_CACHE_BLOCKS = 8  # The source chunk cache holds this many blocks' bytes.
# Threads writing blocks. Writing (the kernel's copy into the page cache and
# its file creation) is the longest stage; two writers measured up to 1.6x
# faster than one (never slower), with three blocks in flight at most.
_WRITERS = 2


def convert(
    src: epath.PathLike,
    dst: epath.PathLike,
    target: EmbeddingLayout | Literal["unstacked"],
    *,
    storage: StorageOptions | None = None,
    table_dtype=None,
    block_bytes: int = _DEFAULT_BLOCK_BYTES,
    progress: ConversionProgress | None = None,
    overwrite: bool = False,
    host_memory: Literal["system", "return"] = "system",
) -> epath.Path:
  """Converts the checkpoint at `src` into `target`, writing it at `dst`.

  `src` is an embedding item directory, or an Orbax step directory holding
  one; in the second case `dst` becomes a step directory too, with the
  embedding item converted and every other item (dense parameters, optimizer
  state, metadata) copied unchanged. The result appears at `dst` only when
  complete (it is written under a temporary name and renamed).

  Nothing unverified reaches the output, whose step gets a fresh integrity
  manifest: every file read is first checked against the manifest of the
  step holding it (`_source.verify_source`: the JSON files and copied items
  by size and CRC32C, chunks by size, their own CRC32C being checked as they
  are read); a step without a manifest is refused (`sc-checkpoint verify
  --adopt` gives it one), and files its manifest does not list are not
  copied (a RuntimeWarning names them). A bare item (no step around it) is
  checked against its own integrity manifest, which a bare output gets too
  (one written before bare items carried one has only its chunks'
  checksums).

  Args:
    src: the source checkpoint.
    dst: where to write; must not exist unless `overwrite`.
    target: an EmbeddingLayout of the same tables, or 'unstacked'.
    storage: codecs and chunk size of the output (default: the source's).
    table_dtype: the dtype of the output's tables, "float32" or "bfloat16"
      (default: the source's). Each value is rounded to nearest (ties to
      even), as a bfloat16 Trainer rounds its updated rows; slots are copied
      as they are (a Trainer keeps them in float32 either way).
    block_bytes: the most bytes of output assembled at once; source chunks
      are kept in a cache of at most 8 x block_bytes (see the module
      docstring).
    progress: see `ConversionProgress`.
    overwrite: replace an existing `dst`.
    host_memory: "system" (default) leaves the process's malloc alone;
      "return" fixes glibc's mmap threshold (`return_freed_memory`, a
      process-wide setting) so that freed blocks go back to the kernel at
      once and the peak resident memory stays flat. `sc-checkpoint convert`,
      a process of its own, asks for it.

  Returns:
    The embedding item directory written.

  Memory: the source chunk cache and a few reused blocks, whatever the
  checkpoint's size (see `host_memory` for the allocator's share).

  Raises:
    NotACheckpointError, MissingTableError, IncompatibleCheckpointError,
    SlotMismatchError, CorruptCheckpointError: as for restore.
    SlotMismatchError: a target stack puts together tables whose slots the
      checkpoint records for different optimizers, or a table whose optimizer
      it records with one whose optimizer it does not (older checkpoints, or
      stacks saved with slot_specs alone): the stack's one record would be
      lost or claim slots of an optimizer unknown. Slot names and widths do
      not tell (Adam's and LaProp's look alike), so the converter does not
      guess. Stack such tables apart, or restore the checkpoint into the new
      layout with the optimizer trained (EmbeddingRestore(..., optimizers=)),
      which checks the recorded tables; its next save records every table.
    NotACheckpointError: `src` is (or lies in) a step without an integrity
      manifest.
    CorruptCheckpointError: a file of the source fails its step's manifest
      (naming every such file) or a chunk its checksum.
    IncompatibleCheckpointError: `target` lacks tables of the checkpoint.
    FileExistsError: `dst` exists and overwrite is False.
    ValueError: `dst` is a step that later delta steps of its root read
      (their base or an earlier delta), and the conversion would change
      what their chain keeps (a table dtype of bfloat16 under float32
      deltas); nothing is written.
    ValueError: the step's other items (those copied as they are) contain a
      symbolic link.
  """
  if host_memory not in ("system", "return"):
    raise ValueError(f"host_memory must be 'system' or 'return', got {host_memory!r}.")
  if host_memory == "return":
    return_freed_memory()
  src = _storage.as_path(src, "convert source")
  dst = _storage.as_path(dst, "convert destination")
  _storage.check_local_path(dst)
  if _integrity.is_link(dst):
    raise ValueError(
        f"{dst} is a symbolic link (to {os.readlink(os.fspath(dst))}): convert writes a real"
        " directory and never writes through or replaces a link. Pass the directory it"
        " points to, or another destination."
    )
  check_destination(src, dst)
  _check_no_interrupted_replacement(dst)
  item = src if (src / MANIFEST_FILE).exists() else find_item(src)
  if dst.exists() and not overwrite:
    raise FileExistsError(f"{dst} already exists; choose another destination or pass overwrite.")
  if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes <= 0:
    raise ValueError(f"block_bytes must be a positive int, got {block_bytes!r}.")
  if target != "unstacked" and not isinstance(target, EmbeddingLayout):
    raise TypeError(f"target must be an EmbeddingLayout or 'unstacked', got {target!r}.")
  table_dtype = _table_dtype(table_dtype)
  # Every file read below is checked against its step's manifest first: the
  # output gets a fresh manifest, so nothing unverified may reach it.
  foreign = verify_source(src, item)
  cache = ChunkCache(_CACHE_BLOCKS * block_bytes)
  # A delta step converts as its chain (base + deltas).
  reader = open_reader(src if item is None else item, chunk_cache=cache)
  if target != "unstacked":
    _check_every_table_placed(reader, target)
  storage = storage or reader.manifest.storage
  save_id = _converted_save_id(reader, src if item is None else item, table_dtype)
  if item is not None and item != src:
    _check_dependent_deltas(dst, item.name, _converted_states(reader, table_dtype), save_id)
  tmp = _fresh_temporary_directory(dst)
  try:
    if item is not None and item != src:
      _warn_left_out(foreign)
      _copy_other_items(src, tmp, skip=item.name, leave={os.fspath(p.path) for p in foreign})
      out = tmp / item.name
      out.mkdir()
    else:
      out = tmp
    # What the output's manifest.json says of the save besides its arrays.
    stamp = {"save_id": save_id, "item_integrity": out == tmp, "step_integrity": out != tmp}
    if target == "unstacked":
      _write_unstacked(reader, out, storage, block_bytes, cache.max_bytes, progress, table_dtype,
                       stamp)
    else:
      _write_stacked(reader, out, target, storage, block_bytes, cache.max_bytes, progress,
                     table_dtype, stamp)
    (tmp / _IN_PROGRESS_MARKER).unlink()
    if out == tmp:  # A bare item: a manifest of its own (`_chain.bare_item_problems`).
      _integrity.write_manifest(tmp, step=None, manifest=_integrity.ITEM_INTEGRITY_FILE)
    else:  # The converted step is complete; it holds the source step's save.
      _integrity.write_manifest(tmp, step=_source_step(src))
  except BaseException:
    tmp.rmtree(missing_ok=True)
    raise
  _put_in_place(tmp, dst)
  return dst if item is None or item == src else dst / item.name


def _check_room(out: epath.Path, manifest: Manifest, layout: EmbeddingLayout) -> None:
  """Raises OSError (ENOSPC) before the first block is written when the stacked
  tables and slots of `manifest` (in `layout`), stored uncompressed, exceed the
  free space at `out` (a local directory); compressed or cloud outputs are not
  checked.

  Each table is padded to a multiple of 8 N rows (N = G * S shards), so a
  target of many devices or shards can be far larger than its source.
  """
  if "://" in os.fspath(out) or manifest.storage.compression != "none":
    return
  free = shutil.disk_usage(os.fspath(out)).free
  if manifest.nbytes > free:
    raise OSError(
        errno.ENOSPC,
        f"the target's stacked tables and slots need {manifest.nbytes / 2**30:,.1f} GiB, more"
        f" than the {free / 2**30:,.1f} GiB free there: nothing was kept. The target has"
        f" {layout.num_devices:,} devices x {layout.shards_per_device:,} shards, and every table"
        f" is padded to a multiple of 8 x {layout.num_shards:,} rows; check the device and shard"
        " counts, or free space."
    )


def _converted_states(reader, table_dtype: np.dtype | None) -> dict:
  """`_chain.table_states` of the conversion's output, before it is written.

  A conversion keeps every table's shape, slots and optimizer (a chain is
  read as its base's tables); only `table_dtype` changes the tables' dtype.
  """
  states = table_states(reader.manifest, reader.layout)
  if table_dtype is None:
    return states
  return {table: ({**kept, "dtype": table_dtype.name}, optimizer)
          for table, (kept, optimizer) in states.items()}


def _converted_save_id(reader, source: epath.Path, table_dtype: np.dtype | None) -> str:
  """The output's save id: the source's while the values stay, else a new one.

  Another layout, device count or stacking holds the same state, so deltas
  saved on top of the source still read the output as their parent (an
  in-place conversion of a chain's base, a compaction). Another table dtype
  rounds the values: a new state.
  """
  same = _converted_states(reader, table_dtype) == table_states(reader.manifest, reader.layout)
  kept = save_id_of(source) if same else None
  return new_save_id() if kept is None else kept


def _check_dependent_deltas(dst: epath.Path, item_name: str, states: dict,
                            save_id: str) -> None:
  """Raises if the converted item, replacing step `dst`'s, would break later deltas that read it.

  A later step of `dst`'s root may be a delta whose chain reads `dst` (its
  base or an earlier delta): its rows go on top of the item found there,
  which must be the save it was written on (`save_id`, the output's, as
  the delta records it) and keep the tables as the chain has them
  (`states`, the `_chain.table_states` of the conversion's output: shapes,
  slots, dtypes). A conversion of `dst` itself into another layout,
  stacking or storage keeps both; a table dtype of bfloat16 under float32
  deltas, or another step converted into `dst`'s place, does not, and every
  later step of the chain would no longer restore. Checked before anything
  is written.
  """
  if not dst.exists():
    return
  chains = dependent_deltas(dst, item_name)
  # Every later delta whose chain reads dst, not only the chain found failing.
  steps = sorted({int(delta.directory.parent.name) for deltas in chains for delta in deltas})
  for deltas in chains:
    advice = (" Convert into another directory instead (or convert the newest step, which"
              " reads as its whole chain).")
    try:
      check_deltas_keep_base(dst / item_name, states, deltas)
    except IncompatibleCheckpointError as error:
      raise ValueError(
          f"converting {dst} in place would break the delta steps {steps} of its root, which"
          f" read it as part of their chain: {error}{advice}"
      ) from error
    recorded = deltas[0].manifest.parent_id
    if recorded is not None and recorded != save_id:
      raise ValueError(
          f"converting into {dst} would break the delta steps {steps} of its root, which read"
          f" it as part of their chain: they were saved on top of save {recorded}, and the"
          f" conversion writes save {save_id} (another state) in its place.{advice}")


def _fresh_temporary_directory(dst: epath.Path) -> epath.Path:
  """Creates `<dst>.orbax-checkpoint-tmp`, marked as this process's conversion.

  A leftover of an interrupted conversion (marked by a process of this host
  that has ended) is deleted first; any other directory of that name -- a
  conversion still running, one of another host, another writer's
  unfinished step -- is refused, never deleted.
  """
  tmp = dst.parent / (dst.name + _steps.TMP_SUFFIX)
  if _integrity.is_link(tmp) or tmp.exists():
    owner = _conversion_owner(tmp)
    if owner is None or owner["host"] != socket.gethostname() or _process_alive(owner["pid"]):
      whose = ("it lacks " + _IN_PROGRESS_MARKER + "; it may be another writer's unfinished step"
               if owner is None else
               f"a conversion by process {owner['pid']} on host {owner['host']!r} writes it"
               " or was interrupted there")
      raise FileExistsError(
          f"{tmp} is in the way of the conversion ({whose}). Remove or move it if nothing is"
          " writing it, then convert again."
      )
    tmp.rmtree()
  tmp.mkdir(parents=True)
  owner = {"host": socket.gethostname(), "pid": os.getpid()}
  (tmp / _IN_PROGRESS_MARKER).write_text(json.dumps(owner))
  return tmp


def _conversion_owner(tmp: epath.Path) -> dict[str, Any] | None:
  """The host and pid in a conversion's marker; None without a readable one."""
  if _integrity.is_link(tmp) or _integrity.is_link(tmp / _IN_PROGRESS_MARKER):
    return None
  try:
    owner = json.loads((tmp / _IN_PROGRESS_MARKER).read_text())
  except (OSError, ValueError):
    return None
  if not (isinstance(owner, dict) and isinstance(owner.get("host"), str)
          and isinstance(owner.get("pid"), int)):
    return None
  return owner


def _process_alive(pid: int) -> bool:
  """Whether a process of this host has id `pid` (signal 0 checks, sends nothing)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except (PermissionError, OverflowError, ValueError):
    return True  # Exists under another user, or cannot be checked: assume alive.
  return True


def _interrupted_replacement_error(replaced: epath.Path, dst: epath.Path,
                                   then: str) -> FileExistsError:
  return FileExistsError(
      f"{replaced} is left by an interrupted replacement of {dst} (the step replaced, or part"
      f" of it); {then} Where {dst} is a step of a checkpoints root, opening that root with a"
      " writable CheckpointManager resolves it (the old step is put back, or the leftover"
      f" removed beside a complete new one); otherwise remove {replaced} once"
      f" `sc-checkpoint verify {dst}` passes."
  )


def _check_no_interrupted_replacement(dst: epath.Path) -> None:
  """Raises before any work when an interrupted replacement of `dst` left `<dst>.replaced`."""
  replaced = dst.parent / (dst.name + REPLACED_SUFFIX)
  if _integrity.is_link(replaced) or replaced.exists():
    raise _interrupted_replacement_error(replaced, dst, "nothing was converted.")


def _put_in_place(tmp: epath.Path, dst: epath.Path) -> None:
  """Renames the complete conversion `tmp` to `dst`, replacing what is there by renames.

  The old `dst` is renamed `<dst>.replaced` before the new one takes its
  place, and only then deleted: a crash at any point leaves the old or the
  new one complete under `dst` or `<dst>.replaced`, never a half-deleted
  step. Under a CheckpointManager root (a step converted in place), the next
  writable manager resolves what is left as for an interrupted compaction
  (`checkpoint._compact`): the old step is renamed back, or the leftover
  removed beside the new one.
  """
  if not dst.exists():
    tmp.rename(dst)
    return
  replaced = dst.parent / (dst.name + REPLACED_SUFFIX)
  if _integrity.is_link(replaced) or replaced.exists():  # made while converting
    raise _interrupted_replacement_error(
        replaced, dst, f"the conversion is complete at {tmp}, and {dst} is left as it was.")
  dst.rename(replaced)
  tmp.rename(dst)
  replaced.rmtree()


def _absolute(path: epath.Path) -> tuple[str, ...]:
  """The components of a path, absolute and with links resolved where local."""
  text = os.fspath(path)
  if "://" not in text:
    text = os.path.realpath(text)
  return tuple(part for part in text.rstrip("/").split("/") if part)


def check_destination(src: epath.Path, dst: epath.Path) -> None:
  """Raises if writing `dst` would write into, or delete, a checkpoint it must not touch.

  `dst` may be `src` itself (a conversion in place, with overwrite), but not
  a directory inside the source (the copy of the step would copy itself),
  nor one holding it (replacing it deletes the source and everything beside
  it), nor one inside a step directory: a step's files are listed in its
  integrity manifest, which a conversion written there would no longer
  match (convert the whole step instead).
  """
  source, target = _absolute(src), _absolute(dst)
  if target != source and target[: len(source)] == source:
    raise ValueError(
        f"the destination {dst} lies inside the source {src}; write the conversion elsewhere."
    )
  if target != source and source[: len(target)] == target:
    raise ValueError(
        f"the destination {dst} holds the source {src}: replacing it would delete the source"
        " and everything beside it. Write the conversion elsewhere."
    )
  for parent in dst.absolute().parents:
    if (parent / _integrity.INTEGRITY_FILE).exists():
      raise ValueError(
          f"the destination {dst} lies inside the checkpoint step {parent}, whose integrity"
          " manifest would no longer match its files (the step would no longer restore)."
          f" Convert the whole step instead: with {parent} as both source and destination"
          " (and overwrite) it is converted in place."
      )
  _check_step_name(src, dst)
  _check_replaceable(src, dst)


def _check_replaceable(src: epath.Path, dst: epath.Path) -> None:
  """Raises unless an existing `dst` is what a conversion may replace: the
  source itself, an empty directory, or a checkpoint of the output's kind (a
  step directory for a step's conversion, an embedding item for an item's).
  Anything else -- a checkpoints root, another folder, a file -- would be
  deleted whole by the replacement.
  """
  if not dst.exists() or _absolute(dst) == _absolute(src):
    return
  if dst.is_dir() and not any(dst.iterdir()):
    return
  output_is_item = (src / MANIFEST_FILE).exists()
  if dst.is_dir() and ((dst / MANIFEST_FILE).exists() if output_is_item
                       else _integrity.holds_a_save(dst)):
    return
  kind = "an embedding item" if output_is_item else "a checkpoint step directory"
  found = ("a file" if not dst.is_dir() else
           "a directory holding " + ", ".join(sorted(p.name for p in dst.iterdir())[:5]))
  raise FileExistsError(
      f"{dst} is {found}, not {kind}: a conversion replaces only a checkpoint of the kind it"
      f" writes ({kind}, as the source {src} is) or an empty directory, and would delete"
      " everything there. Choose another destination, or remove it yourself if it is meant to"
      " go."
  )


def _check_step_name(src: epath.Path, dst: epath.Path) -> None:
  """Raises if `dst` is named as another step than the source's: a CheckpointManager
  (a Trainer's resume) would list it as that step while it holds the source's state,
  which a resume refuses as a renamed step.
  """
  dst = dst.absolute()
  source_step = _source_step(src)
  if not dst.name.isdigit() or source_step is None or source_step == int(dst.name):
    return  # Not named as a step; a bare item; or the source's step (here or in a root).
  raise ValueError(
      f"the destination {dst} is named as step {dst.name}, but the source is step"
      f" {source_step}: a checkpoints root would list it as step {dst.name} while it holds"
      f" step {source_step}'s state (a resume refuses it as renamed). Name it {source_step}"
      " (in another root), or give it a name that is not a number."
  )


def _source_step(src: epath.Path) -> int | None:
  """The step whose save a conversion's source (a step, or an item in one) holds: the
  step its integrity manifest records, else the number its directory is named by; None
  for a bare item (or a step of neither)."""
  for step in (src, src.parent):
    if _integrity.holds_a_save(step):
      recorded = None
      if (step / _integrity.INTEGRITY_FILE).exists():
        try:
          recorded = _integrity.read_manifest_and_step(step)[1]
        except CheckpointError:
          pass  # Damaged: verify_source names it before anything is read.
      return recorded if recorded is not None else _integrity.step_of(step)
  return None


_TABLE_DTYPES = ("float32", "bfloat16")


def _table_dtype(value) -> np.dtype | None:
  """The output table dtype asked for (None: the source's), checked."""
  if value is None:
    return None
  try:
    dtype = numpy_dtype(value) if isinstance(value, str) else np.dtype(value)
  except TypeError:
    dtype = None
  if dtype is None or dtype.name not in _TABLE_DTYPES:
    raise ValueError(f"table_dtype must be one of {list(_TABLE_DTYPES)} or None, got {value!r}.")
  return dtype


def _cast_block(writer, data: np.ndarray, dtype: np.dtype) -> np.ndarray:
  """`data` in `dtype` (rounded to nearest, ties to even), in a block buffer of the writer."""
  cast = writer.buffer(data.shape, dtype)
  cast[...] = data.astype(dtype)
  return cast


def _check_one_record(reader, stack) -> None:
  """Raises if `stack` mixes tables with and without a recorded optimizer (see `convert`)."""
  names = {table: reader.optimizer_name(table) for table in stack.table_names}
  mixed = _optimizers.unrecorded_beside(names)
  if mixed is None:
    return
  (recorded, optimizer), unrecorded = mixed
  raise SlotMismatchError(
      f"stack {stack.name!r} puts tables {recorded!r} and {unrecorded!r} together, but the"
      f" checkpoint {reader.item} records the optimizer of the slots of table"
      f" {recorded!r} ({optimizer!r}) and not that of table {unrecorded!r}. The stack has one"
      f" record: dropping it would stop checking the slots of {recorded!r}, keeping it would"
      f" claim those of {unrecorded!r} for {optimizer!r} unchecked (slots of the same names and"
      " widths may be another optimizer's). Stack them apart, or restore the checkpoint into"
      " this layout with the optimizer you train with (EmbeddingRestore(...,"
      " optimizers=...)); its next save records the optimizer of every table."
  )


def _check_every_table_placed(reader, target: EmbeddingLayout) -> None:
  """Raises if the target layout lacks tables of the checkpoint (they would be dropped).

  A target naming tables the checkpoint lacks is left to `assemble_stacked`,
  whose MissingTableError names them.
  """
  missing = [name for name in reader.table_names if name not in target.table_names]
  extra = [name for name in target.table_names if name not in reader.table_names]
  if missing and not extra:
    raise IncompatibleCheckpointError(
        f"the target layout has no place for tables {missing} of the checkpoint"
        f" {reader.directory} (the layout holds {sorted(target.table_names)}, the checkpoint"
        f" {sorted(reader.table_names)}); a conversion keeps every table. Give a layout built"
        " for all of them."
    )


def _warn_left_out(foreign) -> None:
  """Names the entries of the source step its manifest does not list: they are not copied."""
  for problem in foreign:
    warnings.warn(
        f"{problem.path} is not in the integrity manifest of the step being converted (not"
        " written by the checkpoint manager): it is not copied into the output.",
        RuntimeWarning,
        stacklevel=3,
    )


def _copy_other_items(src: epath.Path, dst: epath.Path, *, skip: str, leave: set[str]) -> None:
  """Copies the step's other items (dense state, metadata) file by file.

  Entries in `leave` (paths the step's manifest does not list) are not
  copied: the output's manifest lists only files verified here. A symbolic
  link is refused, not followed: following it could copy files from outside
  the checkpoint into the output, or recurse without end (the source check
  already refuses links; this guards the copy itself). The step's integrity
  manifest is not copied: the converted step gets its own.
  """
  for child in src.iterdir():
    if child.name in (skip, _integrity.INTEGRITY_FILE) or os.fspath(child) in leave:
      continue
    if _integrity.is_link(child):
      raise ValueError(
          f"the checkpoint contains a symbolic link {child}; a checkpoint is plain files and"
          " directories, so it is not followed. Replace the link by a copy of its target (or"
          " remove it) and convert again."
      )
    if child.is_dir():
      (dst / child.name).mkdir()
      _copy_other_items(child, dst / child.name, skip="", leave=leave)
    else:
      child.copy(dst / child.name)


class _Writer:
  """Writes blocks into the arrays of a manifest, a bounded number in flight.

  In flight are up to `_WRITERS` + 1 blocks, or more while they hold at most
  `max_pending_bytes` (small blocks, written as they come).

  Arrays of the default encoding on a local path (raw bytes + crc32c) get
  their chunk files written directly (`_direct.ChunkWriter`), piece by
  piece: a block is cut at chunk boundaries and each piece goes to the lane
  (one of `_WRITERS` threads) of its chunk, so the pieces of one chunk are
  written in order while writing overlaps assembling the next blocks.
  TensorStore creates every array and writes the others.
  """

  def __init__(
      self, directory: epath.Path, manifest: Manifest, progress: ConversionProgress | None,
      max_pending_bytes: int,
  ):
    self._stores = _save.run_sync(_save.create_arrays(directory, manifest))
    self._direct: dict[tuple[str, str | None], _direct.ChunkWriter] = {}
    for group in manifest.groups:
      for slot, info in [(None, group.table)] + list(group.slots.items()):
        path = array_dir(directory, manifest.kind, group.name, slot)
        dtype = numpy_dtype(info.dtype)
        if manifest.storage.direct_readable and _direct.direct_writable(path, dtype):
          self._direct[(group.name, slot)] = _direct.ChunkWriter(
              path, info.chunk_rows, info.shape[0]
          )
    self._lanes = [
        concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="convert-write")
        for _ in range(_WRITERS)
    ]
    # (futures, bytes, buffer to reuse or None), oldest first.
    self._pending: collections.deque = collections.deque()
    self._pending_bytes = 0
    self._max_pending_bytes = max_pending_bytes
    self._spare: list[np.ndarray] = []
    self._progress = progress
    self._total = manifest.nbytes
    self._done = 0

  def direct(self, group: str, slot: str | None) -> bool:
    """Whether the array's chunk files are written directly (pieces of chunks allowed)."""
    return (group, slot) in self._direct

  def buffer(self, shape: tuple[int, int], dtype) -> np.ndarray:
    """A block buffer (contents undefined): one whose direct write is done, or a new one.

    Reusing buffers keeps the conversion from paging in fresh memory for
    every block, which costs more than the copy into it.
    """
    nbytes = shape[0] * shape[1] * np.dtype(dtype).itemsize
    for index, raw in enumerate(self._spare):
      if raw.nbytes == nbytes:
        del self._spare[index]
        return raw.view(dtype).reshape(shape)
    return host_buffer(shape, dtype)

  def write(self, group: str, slot: str | None, start: int, data: np.ndarray, what: str) -> None:
    reuse = None
    if (group, slot) in self._direct:
      chunks = self._direct[(group, slot)]
      futures = [
          self._lanes[chunk % _WRITERS].submit(chunks.write, a, data[a - start : b - start])
          for chunk, a, b in chunks.pieces(start, start + data.shape[0])
      ]
      reuse = data.reshape(-1).view(np.uint8) if data.flags.c_contiguous else None
    else:  # TensorStore may keep referencing `data`: it is not reused.
      rows = slice(start, start + data.shape[0])
      store = self._stores[(group, slot)]
      futures = [store[rows].write(data, can_reference_source_data_indefinitely=True)]
    self._pending.append((futures, data.nbytes, reuse))
    self._pending_bytes += data.nbytes
    # In flight: up to _WRITERS + 1 blocks, more while they are small.
    while len(self._pending) > _WRITERS + 1 and self._pending_bytes > self._max_pending_bytes:
      self._wait_oldest()
    self._done += data.nbytes
    if self._progress is not None:
      self._progress(self._done, self._total, what)

  def _wait_oldest(self) -> None:
    futures, nbytes, reuse = self._pending.popleft()
    self._pending_bytes -= nbytes
    for future in futures:
      future.result()
    # Buffers are kept for reuse up to the bytes that may be in flight.
    spare_bytes = sum(b.nbytes for b in self._spare)
    keep = len(self._spare) <= _WRITERS or spare_bytes + nbytes <= self._max_pending_bytes
    if reuse is not None and keep:
      self._spare.append(reuse)

  def finish(self) -> None:
    """Waits for every write; every chunk must be complete."""
    try:
      while self._pending:
        self._wait_oldest()
    finally:
      self._shutdown()
    for (group, slot), chunks in self._direct.items():
      if chunks.unfinished():
        raise RuntimeError(
            f"conversion bug: chunks {chunks.unfinished()[:5]} of group {group!r}"
            f" {'table' if slot is None else 'slot ' + repr(slot)} were not completed."
        )

  def abort(self) -> None:
    """After a failure: lets the writes in flight end (their errors dropped), writes no more."""
    for futures, _, _ in self._pending:
      for future in futures:
        try:
          future.result()
        except Exception:  # noqa: BLE001 - the failure being raised is the one to report.
          pass
    self._pending.clear()
    self._shutdown()

  def _shutdown(self) -> None:
    for lane in self._lanes:
      lane.shutdown()


def _written(writer: _Writer, blocks) -> None:
  """Writes (group, slot, start, data, what) blocks as they come, then waits for all."""
  try:
    for block in blocks:
      writer.write(*block)
  except BaseException:
    writer.abort()
    raise
  writer.finish()


# Row bookkeeping on the row-by-row path (TensorStore or chained sources: int64
# row ids and their run analysis) costs about this many bytes per row of a
# block, more than the data itself for a [V, 1] slot.
_INDEX_BYTES_PER_ROW = 80


def _blocks(rows: int, unit: int, row_bytes: int, block_bytes: int):
  """[start, stop) blocks of at most `block_bytes` (data and row ids), cut at multiples of unit."""
  per_block = max(unit, (block_bytes // (row_bytes + _INDEX_BYTES_PER_ROW)) // unit * unit)
  for start in range(0, rows, per_block):
    yield start, min(rows, start + per_block)


def _band_rows(num_shards: int, rows_per_shard: int, unit: int, row_bytes: int,
               band_bytes: int) -> int:
  """Rows b of a band: the fewest multiples of `unit` whose band output reaches `band_bytes`.

  A small band keeps the chunk cache small (`_cache_bytes`), so that its
  buffers are reused rather than paged in anew: touching fresh memory costs
  more than the copies. Arrays written by TensorStore take whole chunks
  (unit: the chunk rows), so a band holds at least one chunk per shard;
  directly written ones take pieces of chunks (unit 1). At most R.
  """
  per_row = num_shards * (row_bytes + _INDEX_BYTES_PER_ROW)
  band = -(-band_bytes // per_row)
  return min(rows_per_shard, max(unit, -(-band // unit) * unit))


def _band_blocks(
    num_shards: int, rows_per_shard: int, unit: int, row_bytes: int, block_bytes: int, band: int
):
  """The blocks of a stacked array, band by band (see the module docstring).

  A band is rows [u, u + band) of every shard (`_band_rows`); inside a band,
  shard by shard, each shard's part cut by `_blocks`.
  """
  for u in range(0, rows_per_shard, band):
    width = min(band, rows_per_shard - u)
    for shard in range(num_shards):
      base = shard * rows_per_shard + u
      for start, stop in _blocks(width, unit, row_bytes, block_bytes):
        yield base + start, base + stop


def _cache_bytes(reader, tables, slot: str | None, span_bytes: int, limit: int) -> int:
  """The chunk cache that keeps every source chunk read once over blocks of `span_bytes`.

  The source rows of a band (or block) of `span_bytes` output bytes lie in at
  most span_bytes of chunks plus, per table and source shard, two partly
  used chunks at its two ends (the next band continues in them), so that
  many bytes hold every chunk from its first use to its last; capped at
  `limit`.
  """
  edges = 0
  for table in tables:
    info = reader.array_info(table, slot)
    shards = 1 if reader.layout is None else reader.layout.stack_of_table(table).num_shards
    edges += 2 * shards * info.chunk_rows * info.shape[1] * numpy_dtype(info.dtype).itemsize
  return min(limit, span_bytes + edges)


def _write_stacked(
    reader, out, layout, storage, block_bytes, cache_limit, progress, table_dtype, stamp
) -> None:
  assemblies = assemble_stacked(reader, layout)
  for assembly in assemblies.values():
    _check_one_record(reader, assembly.stack)
  dtypes = {}
  for name, assembly in assemblies.items():
    dtypes[(name, None)] = assembly.dtype if table_dtype is None else table_dtype
    dtypes.update({(name, spec.name): assembly.slot_dtypes[spec.name] for spec in assembly.slot_specs})
  slot_specs = {name: assembly.slot_specs for name, assembly in assemblies.items()}
  optimizers = {name: assembly.optimizer for name, assembly in assemblies.items()}
  manifest = dataclasses.replace(
      _save.stacked_manifest(layout, dtypes, slot_specs, storage, optimizers), **stamp)
  _check_room(out, manifest, layout)
  writer = _Writer(out, manifest, progress, block_bytes // 2)

  def blocks():
    for group, slot, info in _arrays(manifest):
      assembly = assemblies[group.name]
      dtype = dtypes[(group.name, slot)]
      row_bytes = info.shape[1] * np.dtype(dtype).itemsize
      stack = assembly.stack
      if assembly.same_placement_group is not None:  # Whole source chunks, read in place.
        source = reader.manifest.group(assembly.same_placement_group)
        source_rows = (source.table if slot is None else source.slots[slot]).chunk_rows
        unit, band_bytes = int(np.lcm(info.chunk_rows, source_rows)), 2 * block_bytes
      elif writer.direct(group.name, slot):
        unit, band_bytes = 1, block_bytes
      else:
        unit, band_bytes = info.chunk_rows, 2 * block_bytes
      band = _band_rows(stack.num_shards, stack.rows_per_shard, unit, row_bytes, band_bytes)
      if slot is None or not assembly.reset_slots:
        reader.chunk_cache.resize(
            _cache_bytes(
                reader, stack.table_names, slot, stack.num_shards * band * row_bytes, cache_limit
            )
        )
      ranges = _band_blocks(
          stack.num_shards, stack.rows_per_shard, unit, row_bytes, block_bytes, band
      )
      for start, stop in ranges:
        if dtype == assembly.array_dtype(slot):
          data = writer.buffer((stop - start, info.shape[1]), dtype)
          data = build_block(reader, assembly, slot, start, stop, out=data)
        else:  # Another table dtype: assembled as stored, then rounded.
          data = _cast_block(writer, build_block(reader, assembly, slot, start, stop), dtype)
        yield group.name, slot, start, data, _what(group.name, slot, start, stop)

  _written(writer, blocks())
  _save.write_metadata(out, manifest, layout)


def _write_unstacked(
    reader, out, storage, block_bytes, cache_limit, progress, table_dtype, stamp
) -> None:
  tables = {name: reader.table_shape(name) for name in reader.table_names}
  dtypes, slot_specs = {}, {}
  optimizers = {name: reader.optimizer_name(name) for name in tables}
  for name in tables:
    slot_specs[name] = reader.slot_specs(name)
    dtypes[(name, None)] = reader.dtype(name) if table_dtype is None else table_dtype
    dtypes.update({(name, spec.name): reader.dtype(name, spec.name) for spec in slot_specs[name]})
  manifest = dataclasses.replace(
      _save.unstacked_manifest(tables, dtypes, slot_specs, storage, optimizers), **stamp)
  writer = _Writer(out, manifest, progress, block_bytes // 2)

  def blocks():
    for group, slot, info in _arrays(manifest):
      dtype = dtypes[(group.name, slot)]
      row_bytes = info.shape[1] * np.dtype(dtype).itemsize
      ranges = list(_blocks(info.shape[0], info.chunk_rows, row_bytes, block_bytes))
      span = max(stop - start for start, stop in ranges) * row_bytes
      reader.chunk_cache.resize(_cache_bytes(reader, [group.name], slot, span, cache_limit))
      stored = reader.dtype(group.name, slot)
      for start, stop in ranges:
        shape = (stop - start, info.shape[1])
        data = writer.buffer(shape, dtype) if dtype == stored else host_buffer(shape, stored)
        reader.fill_strided_rows(data, [(group.name, slot, start, 1, stop - start, 0)])
        if dtype != stored:  # Another table dtype: read as stored, then rounded.
          data = _cast_block(writer, data, dtype)
        yield group.name, slot, start, data, _what(group.name, slot, start, stop)

  _written(writer, blocks())
  _save.write_metadata(out, manifest, None)


def _arrays(manifest: Manifest):
  """(group, slot, info) of every array: the tables of all groups, then each slot's arrays.

  Target arrays that read the same source array come one after the other, so
  a source chunk holding rows of two of them (two tables stacked together in
  the source) is still in the chunk cache for the second.
  """
  arrays = [(group, None, group.table) for group in manifest.groups]
  names = list(dict.fromkeys(name for group in manifest.groups for name in group.slots))
  for name in names:
    arrays += [(group, name, group.slots[name]) for group in manifest.groups if name in group.slots]
  return arrays


def _what(group: str, slot: str | None, start: int, stop: int) -> str:
  array = "table" if slot is None else f"slot {slot}"
  return f"{group} {array} rows [{start}, {stop})"
