"""Integrity of a checkpoint step: a manifest of every file, written inside the commit.

A step directory written by `CheckpointManager` holds `integrity.json`:

  {"format": "sc_framework.step_integrity", "format_version": 2,
   "step": the step whose save the files are (absent where unknown),
   "step_digest": CRC32C of the step's decimal digits (with "step"),
   "files": {relative path: {"size": bytes, "crc32c": int, "tail": int}
                          | {"size": bytes, "zarr_crc32c": true, "trailer": int}},
   "digest": CRC32C of the canonical JSON of "files"}

("step" has a digest of its own so that readers of the format before it,
which check "digest" over "files", still read these manifests.)

"step" ties the files to their place in the root: a step directory named
`<n>` whose manifest records another step is refused wherever it is read,
naming both numbers; files alone cannot tell one step's complete save from
another's. Where the files match that manifest, the directory holds the
other step's whole save (two steps' directories swapped by a botched rename,
copy or sync: `StepMismatch`); like a chunk that fails its checksum, that
does not make the step incomplete: a listing lists it, and a restore of it
fails (a Trainer refuses to resume it, as it refuses a step its meta item
says was renamed). Where they do not (a partial copy of another step, or
its integrity.json put in this one's place), the step is incomplete. A
directory not named by digits alone (a conversion written outside any root)
is not compared, and manifests written before the field was recorded are
read as before. A conversion records its source's step.

A bare embedding item (written by `convert` outside any step) holds the same
manifest of its files as `item_integrity.json`, with no step; named apart so
that nothing takes the item for a step.

A file's "crc32c" is the CRC32C of its bytes before the last 4 and "tail"
those 4 bytes (little endian); a file under 4 bytes has the CRC32C of all of
it and no "tail". Not the CRC32C of the whole file: many files end with the
CRC32C of the bytes before it (OCDBT's manifests and data files do), and the
CRC32C of such a file is the same constant for every content, so it could not
tell one step's file from another's. (Manifests of format 1 hold whole-file
CRC32Cs; they are still read and checked as written.)

It is written after every item is on disk and before Orbax's commit (the
rename of the temporary directory, or its commit file), so a step without a
valid manifest is incomplete. Every file of every item is listed except
Orbax's own commit bookkeeping (`_CHECKPOINT_METADATA`, `commit_success.txt`
at the step root, updated by the commit itself). A chunk file of a zarr v3
array whose codec chain ends in the `crc32c` codec carries its own checksum
(the last 4 bytes are the little-endian CRC32C of the bytes before them):
the manifest records its size and that trailer (4 bytes read, not the
chunk), TensorStore (or the reader's direct path) checks the checksum on
every read, and `verify_step` checks it directly. The recorded trailer ties
each chunk to its place: a chunk copied from another step, or two chunks of
one array swapped, carry valid checksums of their own but other trailers.
(Manifests written before the trailer was recorded hold sizes only.)

Checks, cheapest first (each returns `Problem`s, never raises):
  check_structure  manifest valid; every listed file present as a regular
                   file (reached through no symbolic link) of its size; the
                   manifest's small JSON-like files (< 1 MiB) checksummed.
  check_items      the files of some items: sizes and full checksums, and
                   each zarr chunk's trailer against the manifest (what a
                   restore verifies before handing those items to Orbax).
  verify_step      everything: every file's checksum and every zarr chunk's.
Symbolic links anywhere in a step are errors: nothing is read through one.
Files not in the manifest are reported as foreign and never read or deleted.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

import google_crc32c
from etils import epath

from checkpoint._errors import CorruptCheckpointError, read_error, storage_failure

INTEGRITY_FILE = "integrity.json"
# The same manifest in a bare embedding item (written by `convert` outside any step),
# the item directory in place of the step's: named apart, so that no listing or check
# of steps takes such an item for a step.
ITEM_INTEGRITY_FILE = "item_integrity.json"
INTEGRITY_FORMAT_NAME = "sc_framework.step_integrity"
INTEGRITY_FORMAT_VERSION = 2
_READABLE_FORMAT_VERSIONS = (1, 2)  # 1: whole-file CRC32Cs (see the module doc)
# Written or rewritten by Orbax's commit after the manifest; never read as data.
ORBAX_STEP_METADATA = "_CHECKPOINT_METADATA"  # Orbax's step metadata: items, their handlers
COMMIT_FILES = frozenset({ORBAX_STEP_METADATA, "commit_success.txt"})
_READ_BYTES = 16 << 20
_SMALL_FILE = 1 << 20
# Files of a cloud step sized, read or checksummed at once: a step has one file per
# chunk, and there each file's size and trailer is a request of its own. (Local
# files go one after the other: threads only add their overhead to a stat.)
_IO_THREADS = 16

Severity = Literal["error", "foreign"]


@dataclasses.dataclass(frozen=True)
class Problem:
  """One finding about a step: an error (data cannot be trusted) or a foreign entry."""

  severity: Severity
  path: epath.Path
  message: str

  def __str__(self) -> str:
    return f"{self.path}: {self.message}"


@dataclasses.dataclass(frozen=True)
class FileEntry:
  """One file of the manifest: its size and CRC32C (None: a zarr chunk with its own).

  `trailer` is the file's last 4 bytes (little endian): a zarr chunk's own
  checksum, or beside `crc32c` (then of the bytes before them) the rest of
  the file. With `crc32c` and no trailer, `crc32c` covers the whole file (a
  file under 4 bytes, or a manifest of format 1). A chunk's trailer is None
  where an older manifest did not record it.
  """

  size: int
  crc32c: int | None
  trailer: int | None = None


# ----------------------------------------------------------------------------- checksums


def crc32c_of_file(path: epath.Path, *, skip_tail: int = 0) -> tuple[int, bytes]:
  """CRC32C of a file's bytes except its last `skip_tail` bytes, and those bytes."""
  path = epath.Path(path)
  size = path.stat().length
  crc, remaining = 0, size - skip_tail
  with path.open("rb") as f:
    while remaining > 0:
      block = f.read(min(_READ_BYTES, remaining))
      if not block:
        break
      crc = google_crc32c.extend(crc, block)
      remaining -= len(block)
    tail = f.read(skip_tail) if skip_tail else b""
  return crc, tail


# ----------------------------------------------------------------------------- walking


def walk(directory: epath.Path) -> Iterator[tuple[str, epath.Path, Literal["file", "link"]]]:
  """(relative path, path, kind) of every file and symbolic link below a directory.

  Links are reported, never followed (cloud paths have none).
  """

  def visit(folder: epath.Path, prefix: str):
    for child in sorted(folder.iterdir(), key=lambda p: p.name):
      rel = prefix + child.name
      if is_link(child):
        yield rel, child, "link"
      elif child.is_dir():
        yield from visit(child, rel + "/")
      else:
        yield rel, child, "file"

  yield from visit(directory, "")


def links_below(directory: epath.Path) -> list[epath.Path]:
  """The symbolic links below a directory (none on cloud paths, which have no links).

  `walk`'s answer restricted to links, from the directory entries' types
  alone (one listing per folder, no call per file): opening a checkpoint
  checks this on every read.
  """
  if "://" in os.fspath(directory):
    return []
  links, folders = [], [os.fspath(directory)]
  while folders:
    with os.scandir(folders.pop()) as entries:
      for entry in entries:
        if entry.is_symlink():
          links.append(epath.Path(entry.path))
        elif entry.is_dir(follow_symlinks=False):
          folders.append(entry.path)
  return sorted(links, key=os.fspath)


def holds_a_save(directory: epath.Path) -> bool:
  """Whether `directory` holds what a save writes first (Orbax's step metadata) or last
  (the integrity manifest): a step directory, complete or not."""
  return any((directory / name).exists() for name in (INTEGRITY_FILE, ORBAX_STEP_METADATA))


def is_link(path: epath.Path) -> bool:
  """Whether a path is a symbolic link (always False for cloud paths)."""
  return os.path.islink(os.fspath(path)) if "://" not in os.fspath(path) else False


def link_in_path(root: epath.Path, rel: str) -> epath.Path | None:
  """The first symbolic link among root/<components of rel> (root included), or None."""
  path = root
  if is_link(path):
    return path
  for part in rel.split("/"):
    path = path / part
    if is_link(path):
      return path
  return None


def _zarr_checksummed_dirs(directory: epath.Path, rels: Iterable[str]) -> set[str]:
  """Relative dirs of zarr v3 arrays whose codec chain ends with `crc32c`."""
  found = set()
  for rel in rels:
    if rel == "zarr.json" or rel.endswith("/zarr.json"):
      try:
        meta = json.loads((directory / rel).read_text())
      except (OSError, ValueError):
        continue
      codecs = meta.get("codecs") if isinstance(meta, dict) else None
      if meta.get("node_type") == "array" and codecs and codecs[-1].get("name") == "crc32c":
        found.add(rel[: -len("zarr.json")])
  return found


def _is_zarr_chunk(rel: str, array_dirs: set[str]) -> bool:
  return any(rel.startswith(prefix + "c/") for prefix in array_dirs)


# ----------------------------------------------------------------------------- the manifest


def build_manifest(step_dir: epath.Path, manifest: str = INTEGRITY_FILE) -> dict[str, FileEntry]:
  """Lists and checksums every file of a step being written (see the module doc);
  `manifest`: the manifest's own name (ITEM_INTEGRITY_FILE in a bare item), not listed."""
  found = list(walk(step_dir))
  links = [path for _, path, kind in found if kind == "link"]
  if links:
    raise CorruptCheckpointError(
        f"the checkpoint being written at {step_dir} contains symbolic links {links}; a"
        " checkpoint is plain files. Save the items as files, not links."
    )
  rels = [rel for rel, _, _ in found if rel not in COMMIT_FILES and rel != manifest]
  unmerged = unmerged_ocdbt_items(rels)
  if unmerged:
    raise CorruptCheckpointError(
        f"the checkpoint being written at {step_dir} is not complete: {_UNMERGED}"
        f" {', '.join(unmerged)}. It is not marked complete."
    )
  checksummed = _zarr_checksummed_dirs(step_dir, rels)

  def entry(rel: str) -> FileEntry:
    path = step_dir / rel
    size = path.stat().length
    if _is_zarr_chunk(rel, checksummed):
      return FileEntry(size, None, read_trailer(path))
    if size < 4:
      return FileEntry(size, crc32c_of_file(path)[0])
    crc, tail = crc32c_of_file(path, skip_tail=4)
    return FileEntry(size, crc, int.from_bytes(tail, "little"))

  return dict(zip(rels, _concurrently(step_dir, entry, rels)))


_OCDBT_PART = re.compile(r"^(.*?)/?ocdbt\.process_\d+/")
_UNMERGED = ("Orbax never merged the per-process parts of its OCDBT items (a part without"
             " the item's own manifest.ocdbt, which a restore reads):")


def unmerged_ocdbt_items(rels: Iterable[str]) -> list[str]:
  """The OCDBT items among a step's files `rels` that hold per-process parts
  (`<item>/ocdbt.process_<n>/...`) but not the merged `<item>/manifest.ocdbt`.

  Orbax writes every process's part, then merges them into the item's own
  manifest; an item left unmerged does not restore.
  """
  rels = set(rels)
  items = {match.group(1) for rel in rels if (match := _OCDBT_PART.match(rel))}
  return sorted(item for item in items
                if (f"{item}/manifest.ocdbt" if item else "manifest.ocdbt") not in rels)


def _concurrently(step_dir: epath.Path, fn: Callable, items: list) -> list:
  """[fn(item) for item in items] for the files of a step; on threads for a cloud path."""
  if len(items) < 2 or "://" not in os.fspath(step_dir):
    return [fn(item) for item in items]
  with concurrent.futures.ThreadPoolExecutor(min(_IO_THREADS, len(items))) as pool:
    return list(pool.map(fn, items))


def step_of(directory: epath.PathLike) -> int | None:
  """The step number a directory's name gives (a name of digits only), or None."""
  name = epath.Path(directory).name
  return int(name) if name.isdecimal() and name.isascii() else None


def manifest_json(files: dict[str, FileEntry], *, step: int | None) -> str:
  entries = {rel: _entry_to_dict(entry) for rel, entry in sorted(files.items())}
  manifest: dict[str, Any] = {
      "format": INTEGRITY_FORMAT_NAME,
      "format_version": INTEGRITY_FORMAT_VERSION,
      "files": entries,
      "digest": _digest(entries),
  }
  if step is not None:
    manifest["step"] = step
    manifest["step_digest"] = _step_digest(step)
  return json.dumps(manifest, indent=0, sort_keys=True)


def write_manifest(step_dir: epath.Path, *, step: int | None,
                   manifest: str = INTEGRITY_FILE) -> None:
  """Writes integrity.json into a step directory whose items are all written
  (`manifest`=ITEM_INTEGRITY_FILE: the item_integrity.json of a bare item).

  `step`: the step whose save the directory holds (see the module doc), None
  for a bare item or a step of unknown number.
  """
  files = build_manifest(step_dir, manifest)
  (step_dir / manifest).write_text(manifest_json(files, step=step))


def read_manifest(step_dir: epath.Path) -> dict[str, FileEntry]:
  """The files of a committed step's manifest (see `read_manifest_and_step`)."""
  return read_manifest_and_step(step_dir)[0]


def read_manifest_and_step(step_dir: epath.Path, manifest: str = INTEGRITY_FILE
                           ) -> tuple[dict[str, FileEntry], int | None]:
  """The manifest of a committed step (or, `manifest`=ITEM_INTEGRITY_FILE, of a bare
  item): its files, and the step it records (None: none).

  Raises:
    CorruptCheckpointError: naming the step and what is wrong (missing,
      a link, unreadable, not valid JSON, digest mismatch).
  """
  path = step_dir / manifest
  advice = (
      " The step is incomplete or damaged (a partial copy, or not written by this library's"
      " CheckpointManager); restore another step, or copy the step again from its source."
      if manifest == INTEGRITY_FILE else
      " The embedding item is incomplete or damaged (a partial copy); copy it again, or"
      " convert it again from its source."
  )
  link = link_in_path(step_dir, manifest)
  if link is not None:
    raise CorruptCheckpointError(f"{link} is a symbolic link; nothing is read through one.{advice}")
  if not path.exists():
    raise CorruptCheckpointError(f"{step_dir} has no {manifest}.{advice}")
  try:
    data = json.loads(path.read_text())
    entries = data["files"]
    version = data.get("format_version")
    if data.get("format") != INTEGRITY_FORMAT_NAME:
      raise ValueError(f"format {data.get('format')!r} version {version!r}")
    if version not in _READABLE_FORMAT_VERSIONS:
      newer = isinstance(version, int) and version > INTEGRITY_FORMAT_VERSION
      raise ValueError(
          f"format version {version!r}, which this version of the library does not read"
          f" ({', '.join(map(str, _READABLE_FORMAT_VERSIONS))})"
          + ("; a newer version wrote it: upgrade sc-framework to read it" if newer else ""))
    if data.get("digest") != _digest(entries):
      raise ValueError("its digest does not match its entries")
    recorded = data.get("step")
    if recorded is not None and (isinstance(recorded, bool) or not isinstance(recorded, int)
                                 or recorded < 0):
      raise ValueError(f"its step {recorded!r} is not a step number")
    if recorded is not None and data.get("step_digest") != _step_digest(recorded):
      raise ValueError(f"the digest of its step ({recorded}) does not match it")
    if recorded is None and "step_digest" in data:
      raise ValueError("it has the digest of a step but no step")
    files = {rel: _entry_from_dict(entry) for rel, entry in entries.items()}
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
    if storage_failure(error) is not None:
      raise read_error(error, f"reading {path} failed", advice) from error
    raise CorruptCheckpointError(f"{path} is unreadable or damaged ({error}).{advice}") from error
  return files, recorded


@dataclasses.dataclass(frozen=True)
class StepMismatch(Problem):
  """A step directory holding another step's whole save (see the module doc): an error
  wherever the step is read, which a listing does not count against it."""


def step_mismatch(step_dir: epath.Path, recorded: int | None,
                  files_match: bool) -> Problem | None:
  """The error of a step directory whose manifest records another step, or None.

  `files_match`: whether the directory's files match that manifest, which
  makes the directory that step's whole save (`StepMismatch`: the directories
  were renamed or swapped); if not, the step is incomplete as well.
  """
  named = step_of(step_dir)
  if recorded is None or named is None or recorded == named:
    return None
  if files_match:
    return StepMismatch(
        "error", step_dir / INTEGRITY_FILE,
        f"is the integrity manifest of step {recorded}, but its directory is step {named}: its"
        f" files are step {recorded}'s save (the step directories were renamed or swapped, by a"
        f" botched rename, copy or sync). Put it back as step {recorded}, or restore another"
        f" step; it is not read as step {named}.")
  return Problem(
      "error", step_dir / INTEGRITY_FILE,
      f"is the integrity manifest of step {recorded}, but its directory is step {named}, and"
      f" its files do not match it (a partial copy of step {recorded}, or step {recorded}'s"
      f" {INTEGRITY_FILE} put in this one's place). Copy step {named} again from its source,"
      " or restore another step.")


def read_trailer(path: epath.Path) -> int | None:
  """A zarr chunk's crc32c trailer (its last 4 bytes, little endian); None if shorter."""
  with epath.Path(path).open("rb") as f:
    f.seek(0, os.SEEK_END)
    if f.tell() < 4:
      return None
    f.seek(-4, os.SEEK_END)
    return int.from_bytes(f.read(4), "little")


def _entry_to_dict(entry: FileEntry) -> dict[str, Any]:
  if entry.crc32c is None:
    out: dict[str, Any] = {"size": entry.size, "zarr_crc32c": True}
    if entry.trailer is not None:
      out["trailer"] = entry.trailer
    return out
  if entry.trailer is None:
    return {"size": entry.size, "crc32c": entry.crc32c}
  return {"size": entry.size, "crc32c": entry.crc32c, "tail": entry.trailer}


def _entry_from_dict(data: dict[str, Any]) -> FileEntry:
  if data.get("zarr_crc32c"):
    trailer = data.get("trailer")
    return FileEntry(int(data["size"]), None, None if trailer is None else int(trailer))
  tail = data.get("tail")
  return FileEntry(int(data["size"]), int(data["crc32c"]), None if tail is None else int(tail))


def _step_digest(step: int) -> int:
  return google_crc32c.value(str(step).encode())


def _digest(entries: dict[str, Any]) -> int:
  return google_crc32c.value(json.dumps(entries, sort_keys=True).encode())


# ----------------------------------------------------------------------------- checks

Depth = Literal["structure", "items", "full"]


def check_step(
    step_dir: epath.Path, *, depth: Depth, items: Iterable[str] | None = None,
    manifest: str = INTEGRITY_FILE,
) -> list[Problem]:
  """The problems of a step; an empty list means the checked data can be trusted.

  Args:
    step_dir: the step directory.
    depth: 'structure' (sizes, links, small files' checksums), 'items' (also
      every listed file's checksum) or 'full' (also every zarr chunk's).
    items: the items (top-level entries) to check; None for all.
  """
  if is_link(step_dir):
    return [Problem("error", step_dir, "the step is a symbolic link; nothing is read through one")]
  try:
    files, recorded_step = read_manifest_and_step(step_dir, manifest)
  except CorruptCheckpointError as error:
    return [Problem("error", step_dir / manifest, str(error))]
  wanted = None if items is None else set(items)

  def selected(rel: str) -> bool:
    return wanted is None or rel.split("/", 1)[0] in wanted

  problems: list[Problem] = []
  roots = {rel.split("/", 1)[0] for rel in files if selected(rel)}
  if wanted is not None:
    for item in sorted(wanted - roots):
      problems.append(Problem("error", step_dir / item, "the manifest lists no such item"))
  on_disk = {}
  for root in sorted(roots):
    top = step_dir / root
    if is_link(top):
      problems.append(Problem("error", top, "is a symbolic link; nothing is read through one"))
      continue
    if not top.exists():
      continue  # Reported per file below.
    entries = [(root, top, "file")] if not top.is_dir() else [
        (f"{root}/{rel}", path, kind) for rel, path, kind in walk(top)
    ]
    for rel, path, kind in entries:
      if kind == "link":
        problems.append(Problem("error", path, "is a symbolic link; nothing is read through one"))
      else:
        on_disk[rel] = path
  checksummed = _zarr_checksummed_dirs(step_dir, [rel for rel in files if rel in on_disk])
  # Not asked for, or below a link (reported above): not checked.
  checked = [(rel, entry) for rel, entry in sorted(files.items()) if selected(rel) and not (
      rel not in on_disk and link_in_path(step_dir, rel) is not None)]
  for found in _concurrently(
      step_dir, lambda check: _check_file(step_dir / check[0], check[0] in on_disk, check[1], depth,
                                check[0], checksummed), checked):
    problems.extend(found)
  if wanted is None:
    listed = roots | COMMIT_FILES | {manifest}
    for child in sorted(step_dir.iterdir(), key=lambda p: p.name):
      if child.name in COMMIT_FILES and is_link(child):  # the items' links are named above
        problems.append(Problem("error", child, "is a symbolic link; nothing is read through one"))
      elif child.name not in listed:
        problems.append(
            Problem("foreign", child, "not written by the checkpoint manager; left alone")
        )
  for rel in sorted(set(on_disk) - set(files)):
    problems.append(
        Problem("foreign", on_disk[rel], "not written by the checkpoint manager; left alone")
    )
  for item in unmerged_ocdbt_items(rel for rel in files if selected(rel)):
    problems.append(Problem("error", step_dir / item, f"{_UNMERGED} this one does not restore"))
  # Whose save the files are: a manifest of another step is the one cause to name,
  # whether the files match it (directories swapped) or not (the manifest replaced).
  mismatch = step_mismatch(step_dir, recorded_step, files_match=not errors(problems))
  return problems if mismatch is None else [mismatch]


def _check_file(
    path: epath.Path, present: bool, entry: FileEntry, depth: Depth, rel: str, checksummed: set[str]
) -> list[Problem]:
  try:
    return _file_problems(path, present, entry, depth, rel, checksummed)
  except OSError as error:  # e.g. removed while checked
    if storage_failure(error) is not None:  # refused or not answered: not the step's fault
      raise read_error(error, f"reading {path} failed") from error
    return [Problem("error", path, f"cannot be read ({error})")]


def _file_problems(
    path: epath.Path, present: bool, entry: FileEntry, depth: Depth, rel: str, checksummed: set[str]
) -> list[Problem]:
  if not present:
    return [Problem("error", path, "is missing (listed in the step's integrity manifest)")]
  size = path.stat().length
  if size != entry.size:
    message = f"has {size} bytes, the manifest says {entry.size} (truncated or changed)"
    return [Problem("error", path, message)]
  if entry.crc32c is None:
    if depth == "structure":
      return []
    if entry.trailer is not None and read_trailer(path) != entry.trailer:
      return [Problem("error", path, "chunk differs from the one saved here (its crc32c trailer"
                      " is not the manifest's: a chunk of another step or position)")]
    if depth != "full" or not _is_zarr_chunk(rel, checksummed):
      return []
    crc, trailer = crc32c_of_file(path, skip_tail=4)
    if int.from_bytes(trailer, "little") != crc:
      return [Problem("error", path, "chunk checksum mismatch (the zarr crc32c codec's trailer)")]
    return []
  if depth == "structure" and entry.size > _SMALL_FILE:
    return []
  crc, tail = crc32c_of_file(path, skip_tail=0 if entry.trailer is None else 4)
  if crc != entry.crc32c or (entry.trailer is not None
                             and int.from_bytes(tail, "little") != entry.trailer):
    return [Problem("error", path, "checksum mismatch (CRC32C differs from the manifest)")]
  return []


def summarize(problems: list[Problem], *, limit: int = 5) -> str:
  """The first `limit` problems, '; '-separated, and how many more there are."""
  text = "; ".join(str(problem) for problem in problems[:limit])
  if len(problems) > limit:
    text += f"; and {len(problems) - limit} more (run `sc-checkpoint verify` for all)"
  return text


def errors(problems: Iterable[Problem]) -> list[Problem]:
  return [problem for problem in problems if problem.severity == "error"]


STEP_ADVICE = "restore another step (or copy this one again from a good source)"
ITEM_ADVICE = "copy the item again, or convert it again from its source"


def raise_for(problems: Iterable[Problem], what: str, advice: str = STEP_ADVICE) -> None:
  """Raises CorruptCheckpointError naming every error of `problems` (no-op if none);
  `advice`: what to do (ITEM_ADVICE for a bare item)."""
  found = errors(problems)
  if found:
    lines = "\n  ".join(str(problem) for problem in found[:20])
    if len(found) > 20:
      lines += f"\n  and {len(found) - 20} more (run `sc-checkpoint verify` for all)"
    raise CorruptCheckpointError(
        f"{what} failed its integrity check:\n  {lines}\nThe files listed are damaged, missing or"
        f" links; {advice}."
    )
