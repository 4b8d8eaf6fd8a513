"""Which step directories are complete, and how a save becomes complete.

A step is complete when it is a real directory (not a symbolic link) holding
a valid integrity manifest (`_integrity`), which `committing_manifest` writes
inside Orbax's commit, after every item and before the rename (or commit
file) that makes the step visible. `CompleteSteps` wraps Orbax's step naming
so that Orbax itself (latest step, retention, deletion) never sees anything
else: a linked step, an empty or partial copy, a directory without manifest
are invisible to it, hence never deleted, and named once in a warning.

`remove_unfinished_saves` deletes only the temporary directories of
interrupted saves (real directories named `<step>.orbax-checkpoint-tmp-<n>`);
any other entry of the root, a link named like one included, is left alone
and named in a warning.

`check_dense_tree` compares the stored arrays and shapes of an Orbax PyTree
item with the abstract tree a restore asks for, before Orbax reads anything.

`DamagedSteps` remembers the steps a restore found damaged (a chunk failing
its checksum, which listing a step cannot see).
"""

from __future__ import annotations

import asyncio
import errno
import re
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import path as ocp_path

from checkpoint import _integrity
from checkpoint._storage import orbax_path
from checkpoint._errors import IncompatibleCheckpointError

TMP_SUFFIX = ocp.path.atomicity.TMP_DIR_SUFFIX
_UNFINISHED = re.compile(r"^\d+" + re.escape(TMP_SUFFIX) + r"-?\d*$")
_OURS = re.compile(r"^\d+(" + re.escape(TMP_SUFFIX) + r".*|\.incomplete-\d+)?$")


def manifest_problem(step_dir: epath.Path) -> str | None:
  """Why a committed-looking step directory is not complete, or None.

  Complete: a real directory whose integrity manifest is valid and whose
  listed files are all present, reached through no link, of their recorded
  sizes, the small ones (metadata, JSON) with their recorded checksums
  (`_integrity.check_step(depth="structure")`); large files are checksummed
  when restored, and a step holding another step's save is refused then
  (`_integrity.StepMismatch`). Entries the manifest does not list are named
  in a warning.
  """
  if _integrity.is_link(step_dir):
    return "it is a symbolic link"
  if not step_dir.is_dir():
    return "it is not a directory"
  problems = _integrity.check_step(step_dir, depth="structure")
  for problem in problems:
    if problem.severity == "foreign":
      warnings.warn(str(problem), RuntimeWarning, stacklevel=4)
  # A step holding another step's save is complete; its restore refuses it.
  found = [problem for problem in _integrity.errors(problems)
           if not isinstance(problem, _integrity.StepMismatch)]
  return _integrity.summarize(found) if found else None


def unmanifested_steps(directory: epath.Path) -> list[epath.Path]:
  """Step directories Orbax committed that have no integrity manifest.

  Real directories named by a step number, holding Orbax's step metadata
  (`_CHECKPOINT_METADATA`) but no `integrity.json`: written before
  checkpoints carried manifests, or copied without theirs. They are never
  restored unverified; `adopt_step` checks one and writes its manifest.
  """
  if not directory.is_dir():
    return []
  found = []
  for child in directory.iterdir():
    if (child.name.isdigit() and not _integrity.is_link(child) and child.is_dir()
        and (child / _integrity.ORBAX_STEP_METADATA).exists()
        and not (child / _integrity.INTEGRITY_FILE).exists()):
      found.append(child)
  return sorted(found, key=lambda path: int(path.name))


def unverified_steps_error(directory: epath.Path, steps: list[epath.Path]) -> str:
  """The message for a root whose only steps have no manifest."""
  names = ", ".join(str(step) for step in steps)
  return (
      f"{directory} holds no complete checkpoint step, but {len(steps)} step(s) without an"
      f" integrity manifest: {names} (written by a version without integrity checks, or copied"
      " without their integrity.json). They are not restored unverified, and training does not"
      " start over beside them. Check and adopt the newest with `sc-checkpoint verify --adopt"
      f" {steps[-1]}` (every file must read back; writes its manifest), or move them out of"
      f" {directory} to start from scratch."
  )


def warn_skipped(step_dir: epath.Path, why: str, *, stacklevel: int = 3) -> None:
  warnings.warn(
      f"checkpoint step {step_dir} is skipped: {why.rstrip('.')}. Restores take the newest"
      " older step that restores, if there is one; this one is left as it is (never deleted):"
      " remove or repair it yourself.",
      RuntimeWarning,
      stacklevel=stacklevel,
  )


class SkipWarnings:
  """`warn_skipped`, once per step directory and reason.

  A manager lists its steps on every `latest_step`, restore and save (and a
  Trainer asks for the newest step several times as a fit starts): each would
  name the same skipped step again.
  """

  def __init__(self):
    self._warned: set[tuple[str, str]] = set()

  def __call__(self, step_dir: epath.Path, why: str) -> None:
    key = (str(step_dir), why)
    if key not in self._warned:
      self._warned.add(key)
      warn_skipped(step_dir, why, stacklevel=4)

  def forget(self, step_dir: epath.Path) -> None:
    """`step_dir` is being saved again: what it holds next is named anew."""
    self._warned = {key for key in self._warned if key[0] != str(step_dir)}


class DamagedSteps:
  """Steps a restore found damaged (a file failing its checksum), as this process last saw them.

  Listing a step reads its manifests and file sizes, not its contents: a
  flipped byte in a chunk shows only when the chunk is read. Once a restore
  has met it, the step is recorded here, so that the manager skips it as it
  skips an incomplete step. A record holds the CRC32C of the step's
  `integrity.json`: a step saved again under that number (by this or another
  writer) is another save, and the record no longer applies to it.
  """

  def __init__(self, directory: epath.Path):
    self._directory = directory
    self._why: dict[int, tuple[str, int | None]] = {}

  def fingerprint(self, step: int) -> int | None:
    """The CRC32C of the step's `integrity.json` (None: unreadable): which save it holds."""
    try:
      return _integrity.crc32c_of_file(self._directory / str(step) / _integrity.INTEGRITY_FILE)[0]
    except OSError:
      return None

  def add(self, step: int, why: str, fingerprint: int | None) -> None:
    """Records `step` as damaged; `fingerprint` is the save found damaged (taken before
    reading it: another writer may save the step again meanwhile)."""
    self._why[step] = (why, fingerprint)

  def why(self, step: int) -> str | None:
    """Why `step` was found damaged, or None (never, or saved again since)."""
    if step not in self._why:
      return None
    why, fingerprint = self._why[step]
    if fingerprint is not None and fingerprint != self.fingerprint(step):
      del self._why[step]  # Another save of that number.
      return None
    return why

  def forget(self, step: int) -> None:
    """`step` is being saved again."""
    self._why.pop(step, None)


class CompleteSteps:
  """An Orbax step NameFormat that sees complete steps only (see the module doc)."""

  def __init__(self, base: Any, warn_skipped: Callable[[epath.Path, str], None] = warn_skipped):
    self._base = base
    self._warn_skipped = warn_skipped

  def build_name(self, step: int) -> str:
    return self._base.build_name(step)

  def find_all(self, base_path: epath.PathLike) -> Iterator[Any]:
    for metadata in self._base.find_all(base_path):
      why = manifest_problem(epath.Path(metadata.path))
      if why is None:
        yield metadata
      else:
        self._warn_skipped(epath.Path(metadata.path), why)

  def find_step(self, base_path: epath.PathLike, step: int) -> Any:
    metadata = self._base.find_step(base_path, step)
    why = manifest_problem(epath.Path(metadata.path))
    if why is not None:
      raise ValueError(f"step {step} at {metadata.path} is not complete: {why}")
    return metadata

  def __getattr__(self, name: str) -> Any:
    return getattr(self._base, name)


class KeepStepsWithForeignEntries:
  """An Orbax preservation policy: `inner`'s kept steps, and every step holding foreign entries.

  Retention would delete a step whole, entries no save wrote included; such
  a step is preserved instead (it stays a complete, restorable step) and
  named once per manager in a warning, until the entries are moved out.

  Args:
    inner: the retention policy (latest N, best N, chains, ...).
    directory: the manager's root.
  """

  def __init__(self, inner: Any, directory: epath.Path):
    self._inner = inner
    self._directory = directory
    self._warned: set[int] = set()

  def should_preserve(self, checkpoints, *, context) -> list[bool]:
    kept = self._inner.should_preserve(checkpoints, context=context)
    return [keep or self._holds_foreign(info.step) for keep, info in zip(kept, checkpoints)]

  def _holds_foreign(self, step: int) -> bool:
    step_dir = self._directory / str(step)
    if not step_dir.is_dir() or _integrity.is_link(step_dir):
      return False
    problems = _integrity.check_step(step_dir, depth="structure")
    foreign = [problem for problem in problems if problem.severity == "foreign"]
    if foreign and step not in self._warned:
      self._warned.add(step)
      warnings.warn(
          f"checkpoint step {step_dir} is past retention but holds entries no save wrote"
          f" ({', '.join(str(p.path) for p in foreign)}); it is kept, not deleted."
          " Move those entries out and the step goes at the next retention.",
          RuntimeWarning,
          stacklevel=3,
      )
    return bool(foreign)


def committing_manifest(directory: epath.Path) -> type:
  """Orbax's temporary-path class for `directory`, writing the manifest before the commit."""
  base = ocp_path.atomicity_defaults.get_default_temporary_path_class(directory)

  class WithIntegrityManifest(base):  # type: ignore[misc, valid-type]
    async def finalize(self, *args, **kwargs):
      # Orbax also finalizes each item with this class: only the step itself
      # (a child of the root) gets the manifest, after all of its items.
      final = self.get_final()
      if jax.process_index() == 0 and final.parent == directory:
        await asyncio.to_thread(_integrity.write_manifest, self.get(),
                                step=_integrity.step_of(final))
      await super().finalize(*args, **kwargs)

  WithIntegrityManifest.__name__ = f"{base.__name__}WithIntegrityManifest"
  return WithIntegrityManifest


def warn_foreign_entries(directory: epath.Path) -> list[epath.Path]:
  """Names, in one warning, the root's entries that no save wrote (left alone).

  A save writes step directories (`<step>`), their temporary directories
  (`<step>.orbax-checkpoint-tmp-<n>`, reported by `remove_unfinished_saves`)
  and steps set aside (`<step>.incomplete-<k>`, reported when moved).
  """
  if jax.process_index() != 0 or not directory.is_dir():
    return []
  foreign = [
      child
      for child in sorted(directory.iterdir(), key=lambda p: p.name)
      if not _OURS.match(child.name)
  ]
  if foreign:
    warnings.warn(
        f"checkpoint root {directory} holds entries no save wrote:"
        f" {', '.join(str(child) for child in foreign)}; they are left alone (never deleted"
        " or read).",
        RuntimeWarning,
        stacklevel=3,
    )
  return foreign


def _remove_tree(path: epath.Path, *, patience_s: float = 30.0) -> None:
  """Deletes a directory whose files may change meanwhile: a save this process
  abandoned (a second Ctrl-C) may still be finishing in a background thread,
  writing, renaming or deleting its own files, for a few seconds. The walk is
  tried again (a file vanished, or one was added after the walk had emptied
  its directory) until the directory is gone or `patience_s` has passed. What
  such a save still renames into place is a step without its integrity
  manifest, which restores skip."""
  deadline = time.monotonic() + patience_s
  while True:
    try:
      path.rmtree()
      return
    except OSError as error:  # FileNotFoundError, or ENOTEMPTY from a file added meanwhile
      if not path.exists():
        return
      if not isinstance(error, FileNotFoundError) and error.errno != errno.ENOTEMPTY:
        raise
      if time.monotonic() > deadline:
        raise
      time.sleep(0.2)


# What storage says when it refuses a removal for good (read-only, no permission):
# reading needs no removal, so a manager opened there goes on without it.
REFUSED_FOR_GOOD = (errno.EROFS, errno.EACCES, errno.EPERM)


def is_unfinished_save(path: epath.Path) -> bool:
  """Whether `path` is what an interrupted or failed save leaves: a real directory named
  `<step>.orbax-checkpoint-tmp[-<n>]` (never a step; `remove_unfinished_saves` removes it)."""
  return bool(_UNFINISHED.match(path.name)) and not _integrity.is_link(path) and path.is_dir()


def remove_unfinished_saves(directory: epath.PathLike) -> list[epath.Path]:
  """Deletes the temporary directories of interrupted saves under a root.

  Only the primary process deletes, and only real directories named
  `<step>.orbax-checkpoint-tmp-<n>` (what an interrupted save leaves);
  completed steps are never touched. A link, a file or any other entry whose
  name carries the temporary suffix is left alone and named in a warning, as
  is a directory the storage refuses to delete (read-only, no permission).

  Returns:
    The directories removed.
  """
  directory = epath.Path(directory)
  if jax.process_index() != 0 or not directory.is_dir():
    return []
  removed = []
  for child in sorted(directory.iterdir(), key=lambda p: p.name):
    if TMP_SUFFIX not in child.name:
      continue
    if is_unfinished_save(child):
      try:
        _remove_tree(child)
      except OSError as error:
        if error.errno not in REFUSED_FOR_GOOD:  # a writer still at work in it, a failing disk
          raise
        warnings.warn(
            f"{child}: an unfinished save could not be removed ({error}); it is left as it is."
            " It never counts as a step, and a manager opened where it can be removed"
            " removes it.", RuntimeWarning, stacklevel=2)
        continue
      removed.append(child)
    else:
      warnings.warn(
          f"{child} looks like an unfinished save but is "
          f"{'a symbolic link' if _integrity.is_link(child) else 'not one written by a save'};"
          " it is left alone (never deleted). Remove it yourself if it is stale.",
          RuntimeWarning,
          stacklevel=2,
      )
  return removed


def set_aside(step_dir: epath.Path, reason: str | None = None) -> epath.Path | None:
  """Renames an entry that occupies a step's name but is not a complete step.

  A save of that step would otherwise fail (or, for an empty directory,
  silently replace it). The entry is kept, under `<name>.incomplete-<k>`, and
  named in a warning; nothing is deleted.

  Returns:
    The new path, or None when there was nothing in the way.
  """
  if not step_dir.exists() and not _integrity.is_link(step_dir):
    return None
  k = 0
  while (step_dir.parent / f"{step_dir.name}.incomplete-{k}").exists():
    k += 1
  target = step_dir.parent / f"{step_dir.name}.incomplete-{k}"
  step_dir.rename(target)
  warnings.warn(
      f"{step_dir} was in the way of saving step {step_dir.name} and is not a complete step"
      f" ({reason or manifest_problem(target) or 'unknown'}); it was moved, unchanged, to"
      f" {target}."
      " Remove it yourself if it is not needed.",
      RuntimeWarning,
      stacklevel=3,
  )
  return target


def check_dense_tree(item_dir: epath.Path, item: str, requested: Any) -> None:
  """Raises if an Orbax PyTree item stores other shapes or arrays than `requested` asks for.

  Args:
    item_dir: the item directory inside a step.
    item: the item name (for the message).
    requested: the abstract (or concrete) tree passed to the restore.

  Raises:
    IncompatibleCheckpointError: naming the parameter's key path, both
      shapes and the step directory.
  """
  try:
    stored = ocp.PyTreeCheckpointHandler().metadata(orbax_path(item_dir))
  except (OSError, ValueError, KeyError, TypeError):
    return  # Not a PyTree item (or no metadata): Orbax reports it.
  stored_tree = getattr(stored, "tree", stored)
  stored_flat = ocp.tree.to_flat_dict(stored_tree)
  wanted_flat = ocp.tree.to_flat_dict(ocp.tree.serialize_tree(requested, keep_empty_nodes=True))
  mismatches = []
  for key, leaf in wanted_flat.items():
    shape = getattr(leaf, "shape", None)
    if shape is None or key not in stored_flat:
      continue
    stored_shape = getattr(stored_flat[key], "shape", None)
    if stored_shape is not None and tuple(stored_shape) != tuple(shape):
      mismatches.append(
          f"{'/'.join(map(str, key))} is stored with shape {tuple(stored_shape)} but the model"
          f" asks for {tuple(shape)}"
      )
  if mismatches:
    raise IncompatibleCheckpointError(
        f"checkpoint {item_dir.parent}: item {item!r}: {_first_five(mismatches)}. The model's"
        " configuration (an embedding or layer size) differs from the one that wrote the"
        " checkpoint: restore with the original configuration, or start without this"
        " checkpoint (the embedding tables can still start the new model: read them with"
        " checkpoint.TableRestore and start it from them with replace_tables)."
    )
  _check_same_arrays(item_dir, item, stored_flat, wanted_flat)


_OTHER_TREE = "tree structures do not match"
_OTHER_TREE_ADVICE = (
    "The model or its optimizer differs in structure from the ones that wrote the checkpoint"
    " (another optax optimizer or chain of transformations, layers added or removed): restore"
    " with those, or start without this checkpoint."
)
_PARTIAL_RESTORE_ADVICE = "If this mismatch is intentional, pass `partial_restore=True`"


def other_tree_error(error: ValueError, where: str) -> IncompatibleCheckpointError | None:
  """Orbax's error for a tree of another structure (e.g. another optax optimizer's state,
  which differs only in empty nodes) as an IncompatibleCheckpointError; None for others.

  `check_dense_tree` names differing arrays before anything is read; this
  catches what it cannot see. Orbax's advice of `partial_restore` is dropped:
  it would restore part of an optimizer's state.
  """
  message = str(error)
  if _OTHER_TREE not in message:
    return None
  detail = message.split(_PARTIAL_RESTORE_ADVICE, 1)[0].strip()
  return IncompatibleCheckpointError(
      f"{where}: an item holds a tree of another structure than the restore asks for."
      f" {_OTHER_TREE_ADVICE} Orbax: {detail}"
  )


def _first_five(entries: list[str]) -> str:
  shown = "; ".join(entries[:5])
  return shown + (f"; and {len(entries) - 5} more" if len(entries) > 5 else "")


def _check_same_arrays(item_dir: epath.Path, item: str, stored_flat: dict, wanted_flat: dict):
  """Raises if the requested tree lacks arrays the item stores, or asks for ones it lacks.

  Orbax raises then too, advising `partial_restore`; this names the arrays
  and the likely cause (another optimizer: its state is another tree).
  """
  def arrays(flat):
    return {key for key, leaf in flat.items() if getattr(leaf, "shape", None) is not None}

  def names(keys):
    return _first_five(sorted("/".join(map(str, key)) for key in keys))

  unread = arrays(stored_flat) - set(wanted_flat)
  absent = arrays(wanted_flat) - set(stored_flat)
  if not unread and not absent:
    return
  differences = []
  if unread:
    differences.append(f"it stores {len(unread)} arrays the restore does not ask for"
                       f" ({names(unread)})")
  if absent:
    differences.append(f"the restore asks for {len(absent)} arrays it does not store"
                       f" ({names(absent)})")
  raise IncompatibleCheckpointError(
      f"checkpoint {item_dir.parent}: item {item!r} holds another tree than the restore asks"
      f" for: {'; '.join(differences)}. {_OTHER_TREE_ADVICE}"
  )
