"""Folding a delta chain into one full step, in place.

`compact(step_dir)` writes the state of a delta step (its base with every
delta of its chain applied) as a full step in the layout the base was saved
in, with the step's other items copied unchanged, then puts it in place of
the delta step. Later deltas whose chain passes through the step read the
same state from it, and no longer need the steps before it.

The new step is complete on disk before the old one moves: it is written as
`<step>.compacting` (by `convert`, itself atomic), then the delta step is
renamed `<step>.replaced`, the new one renamed `<step>`, and the old one
deleted. A crash in between leaves one of these states, which
`finish_interrupted_compactions` (run by every writable `CheckpointManager`
when it opens a root, and by `compact` itself) resolves without losing a
step:

  on disk after the crash              resolved to
  <step>, <step>.compacting[.tmp]      <step> (the delta; the copy is removed)
  <step>.replaced, <step>.compacting   <step> = the complete full copy
  <step>.replaced only                 <step> = the delta, renamed back
  <step>, <step>.replaced              <step> (the full step; the old removed)

A staged copy is used only if its integrity manifest checks; links are
never followed, renamed or removed.
"""

from __future__ import annotations

import re
import warnings

import jax
from etils import epath

from checkpoint import _integrity, _steps, _storage
from checkpoint._chain import ChainReader, open_reader
from checkpoint._convert import REPLACED_SUFFIX, ConversionProgress, convert
from checkpoint._errors import NotACheckpointError
from checkpoint._format import MANIFEST_FILE
from checkpoint._reader import find_item

COMPACTING_SUFFIX = ".compacting"
_LEFT_BEHIND = re.compile(
    r"^(\d+)(" + re.escape(COMPACTING_SUFFIX) + "|" + re.escape(REPLACED_SUFFIX) + r")"
)


def compact(step_dir: epath.PathLike, *, progress: ConversionProgress | None = None) -> bool:
  """Replaces a delta step by a full step holding the same state.

  Args:
    step_dir: an Orbax step directory (root/<step>) whose embedding item is
      a delta.
    progress: see `checkpoint.ConversionProgress`.

  Returns:
    True if the step was compacted, False if it already was a full step.

  Raises:
    NotACheckpointError: `step_dir` holds no embedding item.
    CorruptCheckpointError: a file of the step's embedding item is damaged or
      missing (against the step's integrity manifest).
    BrokenChainError: a link of its chain is missing or damaged.
  """
  step_dir = _storage.as_path(step_dir, "compact step directory")
  _finish(step_dir)
  if not step_dir.exists():
    raise NotACheckpointError(f"{step_dir} does not exist; compact takes a step directory"
                              " (root/<step>).")
  usage = NotACheckpointError(
      f"{step_dir} is not an Orbax step directory holding one embedding item; compact takes a"
      " step directory (root/<step>)."
  )
  if (step_dir / MANIFEST_FILE).exists():
    raise usage  # An embedding item, not a step.
  if (step_dir / _integrity.INTEGRITY_FILE).exists():
    # Whether the item is a delta is read from its manifest: a damaged one must not
    # answer "already full", nor a lost one "no embedding item", nor a step holding
    # another's save be compacted as this one (a full conversion checks every file
    # as it reads).
    _integrity.raise_for(_integrity.check_step(step_dir, depth="structure"),
                         f"checkpoint step {step_dir.name} ({step_dir})")
  item = find_item(step_dir)
  if item is None:
    raise usage
  reader = open_reader(item)
  if not isinstance(reader, ChainReader):
    return False
  target = reader.layout if reader.layout is not None else "unstacked"
  staged = step_dir.parent / (step_dir.name + COMPACTING_SUFFIX)
  replaced = step_dir.parent / (step_dir.name + REPLACED_SUFFIX)
  convert(step_dir, staged, target, progress=progress, overwrite=True)
  step_dir.rename(replaced)
  staged.rename(step_dir)
  replaced.rmtree()
  return True


def finish_interrupted_compactions(directory: epath.PathLike) -> list[epath.Path]:
  """Completes or undoes every compaction a crash interrupted under a root.

  See the module docstring for the states and how each is resolved. Only the
  primary process changes the root (as `remove_unfinished_saves` does).

  Returns:
    The step directories that were put back in place.
  """
  directory = epath.Path(directory)
  if jax.process_index() != 0 or not directory.is_dir():
    return []
  steps = sorted({
      match.group(1) for child in directory.iterdir()
      if (match := _LEFT_BEHIND.match(child.name)) is not None
  }, key=int)
  return [directory / step for step in steps if _finish_where_allowed(directory / step)]


def _finish_where_allowed(step_dir: epath.Path) -> bool:
  """`_finish`, or on storage that refuses the renames for good (read-only, no
  permission) nothing but a warning: reading needs no repair, and the step's
  parts stay as they are until a manager that can write finishes them."""
  try:
    return _finish(step_dir)
  except OSError as error:
    if error.errno not in _steps.REFUSED_FOR_GOOD:
      raise
    warnings.warn(
        f"{step_dir}: a compaction interrupted there could not be finished ({error}); its"
        " parts are left as they are, and restores see the steps before it. A manager"
        " opened where it can write finishes it.", RuntimeWarning, stacklevel=3)
    return False


def _finish(step_dir: epath.Path) -> bool:
  """Resolves what an interrupted compaction of `step_dir` left; True if it put a step back."""
  staged = step_dir.parent / (step_dir.name + COMPACTING_SUFFIX)
  replaced = step_dir.parent / (step_dir.name + REPLACED_SUFFIX)
  restored = None
  if not _occupied(step_dir):
    if _is_real_dir(staged) and _steps.manifest_problem(staged) is None:
      staged.rename(step_dir)
      restored = "the compacted full step"
    elif _is_real_dir(replaced):
      replaced.rename(step_dir)
      restored = "the delta step, as it was before"
  if restored is not None:
    warnings.warn(
        f"an interrupted compaction of {step_dir} was resolved: {step_dir} is {restored}.",
        RuntimeWarning,
        stacklevel=3,
    )
  if _is_real_dir(step_dir):
    # The step is in place: what a compaction left beside it is a stale copy.
    # (Beside a link at <step>, nothing is removed: the link is no step.)
    prefix = step_dir.name + COMPACTING_SUFFIX
    for leftover in step_dir.parent.iterdir():
      if (leftover == replaced or leftover.name.startswith(prefix)) and _is_real_dir(leftover):
        leftover.rmtree()
  return restored is not None


def _occupied(path: epath.Path) -> bool:
  return _integrity.is_link(path) or path.exists()


def _is_real_dir(path: epath.Path) -> bool:
  return not _integrity.is_link(path) and path.is_dir()
