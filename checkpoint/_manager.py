"""A thin CheckpointManager: embedding item + ordinary Orbax items, retention, cadence.

Wraps `orbax.checkpoint.CheckpointManager`: one step directory per
checkpoint, asynchronous saves by default (the caller blocks only for the
device-to-host copy), atomic commit (an unfinished save never looks
complete, so `latest_step` is always a restorable step), and leftover
temporary directories of interrupted saves removed on construction.

Integrity (on by default, `checkpoint._integrity`): every save writes a
manifest of the CRC32C and size of every file of every item, inside Orbax's
commit; a step without a valid manifest is incomplete and invisible (never
deleted either). `restore` verifies the files of the items it restores
before reading them (the embedding arrays' chunks carry their own zarr
crc32c checksums, verified as they are read) and raises
CorruptCheckpointError naming the file. `latest_step` skips, with a
warning, a newest step whose files are missing, truncated or linked, and
`restore(None)` falls back to the previous step when the newest one is
corrupt; a step asked for by number is never replaced, but once a restore
found it damaged, `latest_step` skips it too. Entries of the root
or of a step that the manager did not write are named in a warning and left
alone.

Retention keeps the union of the latest `keep_latest` steps and the best
`keep_best` steps by `best_metric`. Orbax's own `best_fn` + `max_to_keep`
keeps only the best, so it may delete the newest checkpoint; here the newest
step is always kept (keep_latest >= 1).
"""

from __future__ import annotations

import dataclasses
import errno
import fnmatch
import json
import logging
import math
import os
from collections.abc import Callable, Mapping
from typing import Any, Literal

import jax
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import checkpoint_managers as policies

from checkpoint import _exit, _integrity, _steps, _storage
from checkpoint._compact import finish_interrupted_compactions
from checkpoint._errors import (
    CheckpointError,
    CheckpointReadError,
    CorruptCheckpointError,
    MissingItemError,
    NotACheckpointError,
)
from checkpoint._delta import DELTA_FORMAT
from checkpoint._format import FORMAT_NAME, MANIFEST_FILE
from checkpoint._handler import (
    EmbeddingCheckpointHandler,
    EmbeddingRestore,
    EmbeddingSave,
    TableRestore,
)
from checkpoint._incremental import (
    ChainPreservation,
    IncrementalPolicy,
    IncrementalSaves,
    SaveKind,
)
from checkpoint._orbax_metrics import stop_raw_byte_queries
from checkpoint._rows_tracker import UpdatedRows
from checkpoint._steps import remove_unfinished_saves
from sc_framework._scalars import python_scalar
from sc_framework.primitives import check_devices_per_process

_RESERVED = ("metrics", "descriptor")
_LOG = logging.getLogger(__name__)


class CheckpointManager:
  """Saves and restores training checkpoints holding an embedding item.

  Example:

    with CheckpointManager(directory, keep_latest=2, keep_best=1, best_metric="loss") as mngr:
      for step in range(num_steps):
        ...
        mngr.save(step, EmbeddingSave(tables, slots, layout, optimizers=optimizers),
                  items={"params": ocp.args.StandardSave(params),
                         "data": ocp.args.JsonSave({"position": position})},
                  metrics={"loss": loss})
      restored = mngr.restore(None, EmbeddingRestore(layout, mesh, "table"),
                              items={"params": ocp.args.StandardRestore(abstract_params)})

  Args:
    directory: the root directory; step k lives in directory/k.
    keep_latest: keep the latest N steps (>= 1, so the newest always stays).
    keep_best: also keep the best N steps by `best_metric` (0: none).
    best_metric: a metrics key, or a function metrics -> float.
    best_mode: 'min' (lower is better) or 'max'. A NaN metric (a diverged
      step) ranks worst, never best.
    save_interval_steps: `save` without force writes the steps divisible by K
      (and, on a multi-host preemption notice, the current step).
    async_save: write in the background (default) or block until written.
    embedding_item: the item name of the embedding tables.
    read_only: open for restoring only, e.g. an evaluator beside a running
      job: nothing in the directory is written or deleted (unfinished saves,
      which may be the job's save in progress, are left alone) and `save`
      raises.
    incremental: an `IncrementalPolicy` turns on delta saves: `save` with
      `updated_rows` writes only those rows when the policy says so, and
      retention keeps every step a kept delta's chain needs. None (default):
      every save is full.
  """

  def __init__(
      self,
      directory: epath.PathLike,
      *,
      keep_latest: int = 3,
      keep_best: int = 0,
      best_metric: str | Callable[[Mapping[str, Any]], float] | None = None,
      best_mode: Literal["min", "max"] = "min",
      save_interval_steps: int = 1,
      async_save: bool = True,
      embedding_item: str = "embedding",
      read_only: bool = False,
      incremental: IncrementalPolicy | None = None,
  ):
    keep_latest, keep_best, save_interval_steps = (
        python_scalar(value) for value in (keep_latest, keep_best, save_interval_steps))
    if isinstance(keep_latest, bool) or not isinstance(keep_latest, int) or keep_latest < 1:
      raise ValueError(
          "keep_latest must be an int >= 1 (the newest checkpoint is always kept), got"
          f" {keep_latest!r}."
      )
    if isinstance(keep_best, bool) or not isinstance(keep_best, int) or keep_best < 0:
      raise ValueError(f"keep_best must be an int >= 0, got {keep_best!r}.")
    if keep_best and best_metric is None:
      raise ValueError(f"keep_best={keep_best} needs best_metric (a metrics key or a function).")
    check_devices_per_process()  # Orbax's constructor reshapes the devices per process
    if best_mode not in ("min", "max"):
      raise ValueError(f"best_mode must be 'min' or 'max', got {best_mode!r}.")
    if (
        isinstance(save_interval_steps, bool)
        or not isinstance(save_interval_steps, int)
        or save_interval_steps < 1
    ):
      raise ValueError(f"save_interval_steps must be an int >= 1, got {save_interval_steps!r}.")
    _check_item_name(embedding_item, "embedding_item")
    async_save, read_only = python_scalar(async_save), python_scalar(read_only)
    for name, flag in (("async_save", async_save), ("read_only", read_only)):
      if not isinstance(flag, bool):
        raise TypeError(f"{name} must be True or False, got {flag!r}.")
    stop_raw_byte_queries()  # Orbax's metrics query leaks on every save (_orbax_metrics)
    self._embedding_item = embedding_item
    self._directory = _storage.as_path(directory, "CheckpointManager directory")
    if not self._directory.is_absolute():  # Orbax needs absolute paths with several processes
      self._directory = self._directory.resolve()
    _storage.check_local_path(self._directory)  # Before anything is written there.
    if self._directory.exists() and not self._directory.is_dir():
      raise NotADirectoryError(
          f"{self._directory} is a file; a CheckpointManager takes the directory that holds"
          " (or will hold) the checkpoint steps.")
    _refuse_a_step_or_item(self._directory)
    if not read_only:
      glob_like_item = [embedding_item] if _glob_misreads(embedding_item) else []
      check_can_save_under(self._directory, glob_like_item)
    metric_fn = None
    if best_metric is not None:
      metric_fn = _nan_ranks_worst(
          best_metric if callable(best_metric) else _metric_getter(best_metric), best_mode)
    preserve: list[Any] = [policies.LatestN(n=keep_latest)]
    if keep_best:
      preserve.append(
          policies.BestN(
              get_metric_fn=metric_fn,
              reverse=best_mode == "min",
              n=keep_best,
              keep_checkpoints_without_metrics=False,
          )
      )
    if incremental is not None and not isinstance(incremental, IncrementalPolicy):
      raise TypeError(f"incremental must be an IncrementalPolicy or None, got {incremental!r}.")
    self._incremental = IncrementalSaves(incremental, self._directory, embedding_item)
    self._damaged = _steps.DamagedSteps(self._directory)
    self._warn_skipped = _steps.SkipWarnings()
    self._read_only = read_only
    if not read_only:
      # A save this process still writes there is not an unfinished one to remove.
      _exit.finish_saves_into(self._directory)
      # Compactions first: a killed one leaves `<step>.compacting` plus a temporary
      # suffix, which it removes, and which would otherwise be warned about as foreign.
      finish_interrupted_compactions(self._directory)
      remove_unfinished_saves(self._directory)
    _steps.warn_foreign_entries(self._directory)
    save_policy = policies.AnySavePolicy(
        [
            policies.FixedIntervalPolicy(save_interval_steps),
            policies.PreemptionCheckpointingPolicy(),
        ]
    )
    options = ocp.CheckpointManagerOptions(
        save_decision_policy=save_policy,
        preservation_policy=ChainPreservation(
            _steps.KeepStepsWithForeignEntries(
                policies.AnyPreservationPolicy(preserve), self._directory
            ),
            self._incremental.parent_of,
        ),
        best_fn=metric_fn,
        best_mode=best_mode,
        # Orbax's own cleanup deletes anything named like a temporary directory,
        # links included; `remove_unfinished_saves` deletes only what a save wrote.
        cleanup_tmp_directories=False,
        enable_async_checkpointing=async_save,
        **_directories_made_before_the_save_returns(),
        create=not read_only,
        read_only=read_only,
        step_name_format=_steps.CompleteSteps(ocp.step.standard_name_format(), self._warn_skipped),
        temporary_path_class=_steps.committing_manifest(self._directory),
    )
    try:
      self._manager = ocp.CheckpointManager(
          self._directory, options=options, handler_registry=_embedding_registry(embedding_item)
      )
    except OSError as error:  # making the directory
      if error.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        raise PermissionError(_not_writable(self._directory, error)) from error
      raise
    if async_save and not read_only:
      _exit.finish_at_exit(self)  # A save still running at exit is finished (_exit).

  @property
  def directory(self) -> epath.Path:
    return self._directory

  @property
  def embedding_item(self) -> str:
    """The item name of the embedding tables in each step directory."""
    return self._embedding_item

  @property
  def orbax_manager(self) -> ocp.CheckpointManager:
    """The wrapped Orbax manager (for what this wrapper does not expose)."""
    return self._manager

  def should_save(self, step: int) -> bool:
    """Whether `save(step)` without force would write (the save interval)."""
    return self._manager.should_save(step_number(step))

  def save(
      self,
      step: int,
      embedding: EmbeddingSave | None = None,
      *,
      items: Mapping[str, ocp.args.CheckpointArgs] | None = None,
      metrics: Mapping[str, Any] | None = None,
      force: bool = False,
      updated_rows: UpdatedRows | Mapping[str, Any] | None = None,
      save_kind: SaveKind = "auto",
  ) -> bool:
    """Saves step `step` if the interval says so, or always with force=True.

    Args:
      step: the step number (directory name).
      embedding: the embedding tables and slots.
      items: other Orbax items by name, with their save args (dense params,
        optax state, RNG keys, JSON such as the data position).
      metrics: numbers for `best_metric`.
      force: save regardless of the interval (save on demand).
      updated_rows: the rows updated since the previous save (an
        `UpdatedRows` tracker, whose rows the save takes in one locked step
        and forgets once it started, keeping those added meanwhile; or stack
        -> global rows); with `incremental`, the save may then be a delta.
      save_kind: 'auto' (the incremental policy decides), 'full' (a full
        save now, starting a new chain) or 'delta'.

    Returns:
      Whether a save was started. With async_save the write continues in the
      background; its errors surface on the next save or `wait_until_finished`.
    """
    if self._read_only:
      raise ValueError(
          f"this CheckpointManager of {self._directory} was opened with read_only=True and"
          " cannot save; open another one without it to write checkpoints."
      )
    step = step_number(step)
    tracker = updated_rows if isinstance(updated_rows, UpdatedRows) else None
    if embedding is not None and isinstance(embedding, EmbeddingSave):
      if self._incremental.policy is not None:
        self.wait_until_finished()  # A delta's parent must be committed.
    if tracker is not None:
      tracker.hand_over()  # Rows added from now on are the next save's.
    try:
      if embedding is not None and isinstance(embedding, EmbeddingSave):
        embedding = self._incremental.args_for(step, embedding, updated_rows, save_kind)
      args = self._composite(embedding, items, EmbeddingSave)
      check_can_save_under(self._directory, list(args.keys()))
      if force or self._manager.should_save(step):
        self._set_aside_an_unrestorable_step(step)
        self._damaged.forget(step)
        self._warn_skipped.forget(self._directory / str(step))
      if (force or self._manager.should_save(step)) and step not in self.all_steps():
        self._refuse_a_step_saved_by_another_writer(step)
        self._refuse_a_step_later_deltas_read(step)
        if jax.process_index() == 0:
          _steps.set_aside(self._directory / str(step))
      self._incremental.starting(step, embedding)
      try:
        started = self._manager.save(
            step, args=args, metrics=dict(metrics) if metrics else None, force=force
        )
      except OSError as error:
        self._incremental.failed(step)
        if error.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
          raise PermissionError(_not_writable(self._directory, error)) from error
        raise
      except BaseException:
        self._incremental.failed(step)
        raise
    except BaseException:
      if tracker is not None:
        tracker.take_back()
      raise
    if not started:
      self._incremental.not_started(step)
    elif embedding is not None:
      self._incremental.saved(step, embedding)
    if tracker is not None:
      if started and embedding is not None:
        tracker.forget_handed()
      else:
        tracker.take_back()
    return started

  def _set_aside_an_unrestorable_step(self, step: int) -> None:
    """A complete step `step` whose delta chain no longer restores is moved aside, kept.

    E.g. a delta on a step that was damaged and saved again after a fall
    back: every restore refuses it, and left in place it would stop every
    later save of its number. It is renamed `<step>.incomplete-<k>`, with a
    warning, as an incomplete step in the way of a save is.
    """
    if step not in self.all_steps():
      return
    why = self.why_unrestorable(step)
    if why is None:
      return
    if jax.process_index() == 0:
      _steps.set_aside(self._directory / str(step), reason=why)
    self._manager.reload()

  def _refuse_a_step_saved_by_another_writer(self, step: int) -> None:
    """Raises if a complete step `step` appeared on disk since this manager listed its steps.

    Another manager (another job, or another Trainer on the same workdir)
    saved it: it is a checkpoint, not an unfinished save to move aside.
    """
    step_dir = self._directory / str(step)
    if not (step_dir / _integrity.INTEGRITY_FILE).exists() or _steps.manifest_problem(step_dir):
      return
    self._manager.reload()
    raise FileExistsError(
        f"checkpoint step {step} already exists in {self._directory}: another writer saved it"
        f" after this manager listed the steps (now {self.all_steps()}). Two jobs or Trainers"
        " that write one directory overwrite each other's checkpoints: give each its own"
        " directory, or restore the newest step before training on."
    )

  def _refuse_a_step_later_deltas_read(self, step: int) -> None:
    """Raises if delta steps after `step` name it as a link of their chains.

    They were saved after another step of that number (deleted, or never
    completed): a new one would become part of their chains, and they would
    restore a mix of two runs.
    """
    later = self._incremental.later_deltas_reading(step)
    if later:
      raise ValueError(
          f"cannot save step {step} in {self._directory}: the delta steps {later} name step"
          f" {step} in their chains (a step {step} saved before, now gone), so they would"
          " read the new one as theirs and restore a mix of two runs. Delete those steps, or"
          " save under a step number after them."
      )

  def restore(
      self,
      step: int | None = None,
      embedding: EmbeddingRestore | TableRestore | None = None,
      *,
      items: Mapping[str, ocp.args.CheckpointArgs] | None = None,
  ) -> dict[str, Any]:
    """Restores the requested items of `step` (default: the latest step).

    First waits for this manager's own saves in progress, so the step saved
    last is restored, not the one before it (a failed save raises here). A
    read-only manager first lists the steps again: a job writing the
    directory may have saved newer ones and deleted older ones since.

    Returns:
      item name -> restored value (the embedding item under `embedding_item`).

    Raises:
      TypeError, ValueError: `step` is not an int >= 0 (a numpy or 0-d integer
        array is taken).
      NotACheckpointError: no complete step exists, or `step` is not one, or
        was deleted while it was being restored (by the retention of a job
        writing the directory; with step None the newest step left is
        restored instead).
      MissingItemError: the step (with step None: the latest) never saved a
        requested item; the message names the steps that hold it.
      CorruptCheckpointError: a file of a requested item is missing, truncated,
        a link or fails its checksum (with step None: in every complete step).
      IncompatibleCheckpointError: a dense (PyTree) item stores another shape
        than the requested tree (naming the parameter, both shapes, the step).
    """
    if step is not None:
      step = step_number(step)
    args = self._composite(embedding, items, (EmbeddingRestore, TableRestore))
    if self._read_only:
      # A job may be writing this directory: see the steps it saved since,
      # and not those its retention deleted.
      self._manager.reload()
    else:
      # This manager's own saves still being written are not complete steps
      # yet: the newest would be missed (or taken for a damaged one).
      self.wait_until_finished()
    if step is None:
      return self._restore_latest(args, embedding)
    if step not in self.all_steps():
      raise NotACheckpointError(
          f"{self._directory} has no complete checkpoint for step {step}; its steps are"
          f" {self.all_steps()}.{self._why_not_complete(step)}"
      )
    fingerprint = self._damaged.fingerprint(step)
    try:
      return self._restore_verified(step, args, embedding)
    except Exception as error:
      if not self._step_exists(step):
        raise self._deleted_while_restoring(step) from error
      if isinstance(error, CorruptCheckpointError):
        self._damaged.add(step, str(error), fingerprint)
      raise

  def _restore_latest(self, args: ocp.args.Composite, embedding) -> dict[str, Any]:
    """Restores the newest complete step that restores, skipping damaged ones (warned).

    A step deleted while it was read (another job's retention) is not
    damage: the steps are listed again and the newest one left is tried.
    """
    last_error: CorruptCheckpointError | None = None
    tried: set[int] = set()
    candidates = list(reversed(self.all_steps()))
    while candidates:
      candidate = candidates.pop(0)
      tried.add(candidate)
      broken = self.why_unrestorable(candidate)
      if broken is not None:
        self._warn_skipped(self._directory / str(candidate), broken)
        continue
      fingerprint = self._damaged.fingerprint(candidate)
      try:
        return self._restore_verified(candidate, args, embedding)
      except Exception as error:
        if not self._step_exists(candidate):
          self._manager.reload()
          candidates = [s for s in reversed(self.all_steps()) if s not in tried]
          continue
        if not isinstance(error, CorruptCheckpointError):
          raise
        self._damaged.add(candidate, str(error), fingerprint)
        last_error = error
        self._warn_skipped(self._directory / str(candidate),
                           self.why_unrestorable(candidate) or str(error))
    if last_error is not None:
      raise last_error
    absent = "" if self._directory.exists() else " (it does not exist yet)"
    raise NotACheckpointError(
        f"{self._directory} holds no complete checkpoint to restore{absent}.")

  def why_unrestorable(self, step: int) -> str | None:
    """Why a listed step cannot restore, or None (reads manifests only).

    A restore found it damaged (`mark_damaged`), or its delta chain lacks a
    link, holds a replaced one, or needs a step that is incomplete or
    damaged (skipped itself). `latest_step` and `restore(None)` skip such a
    step, and a save of its number moves it aside (`save`), where a
    restorable step of that number is kept.
    """
    damaged = self._damaged.why(step)
    if damaged is not None:
      return f"a restore found it damaged: {damaged.rstrip('.')}"
    try:
      links = self._incremental.chain_steps(step)
    except CheckpointReadError:
      raise  # The storage refused or did not answer: nothing says a link is broken.
    except CheckpointError as error:  # A link is missing, unreadable or replaced.
      return str(error)
    complete = set(self.all_steps())
    skipped = [link for link in links[:-1]
               if link not in complete or self._damaged.why(link) is not None]
    if skipped:
      return (f"its delta chain needs step {skipped[0]}, which is incomplete or damaged"
              " (skipped itself)")
    return None

  def mark_damaged(self, step: int, why: str) -> None:
    """Treats step `step` as damaged from now on, in this manager: it no longer restores.

    A restore that finds a file of a step failing its checks (a chunk whose
    checksum fails, which listing a step cannot see) marks the step itself.
    Mark one yourself when another process found it damaged, so that every
    process skips it alike. A marked step is skipped by `latest_step` and
    `restore(None)` (with a warning), as are the deltas whose chains need
    it, and a save of its number moves it aside to `<step>.incomplete-<k>`
    (kept). A step saved again under that number is not marked.
    """
    step = step_number(step)
    self._damaged.add(step, why, self._damaged.fingerprint(step))

  def _step_exists(self, step: int) -> bool:
    step_dir = self._directory / str(step)
    return step_dir.exists() or _integrity.is_link(step_dir)

  def _deleted_while_restoring(self, step: int) -> NotACheckpointError:
    self._manager.reload()
    return NotACheckpointError(
        f"checkpoint step {step} ({self._directory / str(step)}) was deleted while it was being"
        f" restored: the job writing {self._directory} removed it (its retention, keep_latest"
        f" and keep_best). Restore a step it keeps: its steps are now {self.all_steps()}"
        " (restore(None) takes the newest)."
    )

  def _restore_verified(self, step: int, args: ocp.args.Composite, embedding) -> dict[str, Any]:
    """Verifies the files of the requested items, checks dense shapes, then restores.

    The embedding item (and its delta chain) is verified by its handler's
    restore (`checkpoint._chain.verify_item`), which every way of restoring
    it goes through; the other items here.
    """
    step_dir = self._directory / str(step)
    self._check_items_saved(step, list(args.keys()))
    others = [name for name in args.keys() if embedding is None or name != self._embedding_item]
    if others:
      _integrity.raise_for(_integrity.check_step(step_dir, depth="items", items=others),
                           f"checkpoint step {step} ({step_dir})")
    for name, value in args.items():
      requested = getattr(value, "item", None)
      restores_tree = isinstance(value, (ocp.args.StandardRestore, ocp.args.PyTreeRestore))
      if restores_tree and requested is not None:
        _steps.check_dense_tree(step_dir / name, name, requested)
    try:
      restored = self._manager.restore(step, args=args)
    except ValueError as error:
      other_tree = _steps.other_tree_error(error, f"checkpoint step {step} ({step_dir})")
      if other_tree is None:
        raise
      raise other_tree from error
    if isinstance(embedding, EmbeddingRestore):
      self._incremental.restored(step)
    return {name: restored[name] for name in args.keys()}

  def _check_items_saved(self, step: int, names: list[str]) -> None:
    """Raises MissingItemError for a requested item the step never saved.

    Never saved: absent from the step's manifest and from its directory. An
    item on disk but not in the manifest is left to the integrity check (it
    was added or damaged after the commit).
    """
    step_dir = self._directory / str(step)
    try:
      listed = {rel.split("/", 1)[0] for rel in _integrity.read_manifest(step_dir)}
    except CorruptCheckpointError:
      return  # The integrity check names what is wrong with the manifest.
    for name in names:
      path = step_dir / name
      if name in listed or path.exists() or _integrity.is_link(path):
        continue
      holding = [other for other in self.all_steps()
                 if (self._directory / str(other) / name).exists()]
      raise MissingItemError(
          f"checkpoint step {step} ({step_dir}) holds no item {name!r}: it saved"
          f" {sorted(listed)}. Restore without {name!r}"
          + (f", or restore a step that saved it (steps holding it: {holding})." if holding
             else f"; no step of {self._directory} holds it.")
      )

  def _why_not_complete(self, step: int) -> str:
    step_dir = self._directory / str(step)
    if not step_dir.exists() and not _integrity.is_link(step_dir):
      return ""
    problem = _steps.manifest_problem(step_dir) or "unknown"
    return f" {step_dir} is not complete: {problem.rstrip('.')}."

  def _composite(self, embedding, items, kinds) -> ocp.args.Composite:
    if items is not None and not isinstance(items, Mapping):
      raise TypeError(
          f"items must map item names to Orbax args (e.g. {{'params':"
          f" ocp.args.StandardSave(params)}}), got {type(items).__name__}.")
    entries = dict(items or {})
    if embedding is not None:
      if not isinstance(embedding, kinds):
        names = (
            kinds.__name__ if isinstance(kinds, type) else " or ".join(k.__name__ for k in kinds)
        )
        raise TypeError(f"embedding must be {names}, got {type(embedding).__name__}.")
      if self._embedding_item in entries:
        raise ValueError(f"items also names the embedding item {self._embedding_item!r}.")
      entries[self._embedding_item] = embedding
    for name, value in entries.items():
      _check_item_name(name, "item name")
      if not isinstance(value, ocp.args.CheckpointArgs):
        raise TypeError(
            f"item {name!r} must be Orbax args such as ocp.args.StandardSave(...), got"
            f" {type(value).__name__}."
        )
    if not entries:
      raise ValueError("nothing to save or restore: pass embedding and/or items.")
    return ocp.args.Composite(**entries)

  def latest_step(self) -> int | None:
    """The newest complete step, or None.

    A newer step that is not complete (no valid integrity manifest, files
    missing, truncated or linked, metadata files corrupt; see
    `_steps.manifest_problem`) is named in a warning and skipped, so a
    Trainer resumes from the previous complete step. So is a delta step
    whose chain lacks a link (`BrokenChainError` names it on restore), and
    a step a restore found damaged (`mark_damaged`).

    Raises:
      NotACheckpointError: no step is complete but some steps have no
        integrity manifest (`_steps.unmanifested_steps`: written before
        manifests existed); the message says how to adopt them.
    """
    for step in reversed(self.all_steps()):
      broken = self.why_unrestorable(step)
      if broken is None:
        return step
      self._warn_skipped(self._directory / str(step), broken)
    unverified = _steps.unmanifested_steps(self._directory)
    if unverified:
      raise NotACheckpointError(_steps.unverified_steps_error(self._directory, unverified))
    return None

  def unrestorable_steps(self) -> dict[int, str]:
    """Step -> why, for every step directory of the root that does not restore.

    Real directories named by a step number, holding what a save writes
    (Orbax's `_CHECKPOINT_METADATA` or an integrity manifest), that are not
    complete (`_steps.manifest_problem`; a step without any integrity
    manifest is named as such) or that `why_unrestorable` refuses (found
    damaged, a broken delta chain). Steps set aside
    (`<step>.incomplete-<k>`), unfinished saves, and numbered directories
    that hold neither (empty, or a folder of the user's) are not listed.
    """
    complete = set(self.all_steps())
    found = {}
    if not self._directory.is_dir():
      return found
    for child in self._directory.iterdir():
      if not child.name.isdigit() or _integrity.is_link(child) or not child.is_dir():
        continue
      if not _integrity.holds_a_save(child):
        continue
      step = int(child.name)
      if step in complete:
        why = self.why_unrestorable(step)
      elif not (child / _integrity.INTEGRITY_FILE).exists():
        why = f"it has no {_integrity.INTEGRITY_FILE} (not a complete save of this library)"
      else:
        why = _steps.manifest_problem(child)
      if why is not None:
        found[step] = why
    return dict(sorted(found.items()))

  def best_step(self) -> int | None:
    """The best step by `best_metric` (the latest step if there is no metric)."""
    return self._manager.best_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def item_names(self, step: int) -> list[str]:
    """The items stored in a step."""
    directory = self._directory / str(step_number(step))
    return sorted(
        child.name
        for child in directory.iterdir()
        if child.is_dir() and not _integrity.is_link(child)
    )

  def reload(self) -> None:
    """Rereads the steps on disk (after another process saved)."""
    self._manager.reload()

  def wait_until_finished(self) -> None:
    """Blocks until the background save is written; raises its error if it failed."""
    try:
      self._manager.wait_until_finished()
    except BaseException:
      self._incremental.failed()  # The failed step cannot be a delta's parent.
      raise

  def close(self) -> None:
    """Waits for a save still being written, then releases the manager. (At
    interpreter exit a manager left open is waited for too; see `_exit`.)"""
    _exit.forget(self)
    self._manager.close()

  def __enter__(self) -> "CheckpointManager":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def step_number(step: Any) -> int:
  """`step` as the int that names its directory: an int >= 0, or a numpy or 0-d
  JAX integer (a step counter; `python_scalar`). Anything else is refused by
  value: a float step would be saved under a directory name (`7.0`) that no
  listing reads as a step, and a negative or bool one is never saved."""
  value = python_scalar(step)
  if isinstance(value, bool) or not isinstance(value, int):
    raise TypeError(
        f"a checkpoint step must be an int >= 0, got {step!r} ({type(step).__name__}); pass the"
        " step number as an int (e.g. int(step)).")
  if value < 0:
    raise ValueError(f"a checkpoint step must be an int >= 0, got {value}.")
  return value


def _refuse_a_step_or_item(directory: epath.Path) -> None:
  """Raises ValueError when `directory` is, or lies inside, a checkpoint step or
  an embedding item: a manager there would list no steps of its own and write
  new ones inside an existing checkpoint. Looks at the directory and the three
  above it (a step's item and a folder inside it), which on cloud storage
  costs a few requests only."""
  for path in [directory, *list(directory.parents)[:3]]:
    if (path / _integrity.ORBAX_STEP_METADATA).exists() or _has_format(
        path / _integrity.INTEGRITY_FILE, _integrity.INTEGRITY_FORMAT_NAME):
      article, kind, root = "a", "checkpoint step", path.parent
    elif _has_format(path / MANIFEST_FILE, FORMAT_NAME, DELTA_FORMAT):
      article, kind, root = "an", "embedding item", path.parent.parent
    else:
      continue
    place = f"is {article} {kind}" if path == directory else f"lies inside the {kind} {path}"
    raise ValueError(
        f"{directory} {place}: a CheckpointManager takes the directory that holds the steps"
        f" (here {root}), not a step or an item inside one."
    )


def _has_format(manifest_file: epath.Path, *formats: str) -> bool:
  """Whether the file is a JSON manifest of one of `formats` (this library's step
  integrity manifest, or an item's manifest), not any file of that name."""
  try:
    manifest = json.loads(manifest_file.read_text())
  except (OSError, ValueError):
    return False
  return isinstance(manifest, dict) and manifest.get("format") in formats


def _glob_misreads(path: str) -> list[str]:
  """The parts of `path` that, read as glob patterns, match other names than themselves
  or not themselves: with '*' or '?', or a '[...]' character class ('a[1]'); an
  unmatched bracket ('exp[', 'runs]') reads literally."""
  return [part for part in path.split("/")
          if part and ("*" in part or "?" in part or not fnmatch.fnmatchcase(part, part))]


def check_can_save_under(directory: epath.PathLike, item_names=()) -> None:
  """Raises ValueError for a root or item name that Orbax's saves would never finish.

  A CheckpointManager checks its directory so when it is made; a program can
  check a directory it is given the same way first (examples/dlrm.py checks
  its --workdir flag).

  Orbax finds the per-process parts of a dense (OCDBT) item with a glob
  pattern below the item's path; a name like 'exp[1]' reads as a pattern
  that does not match itself, so the parts are never merged and the item
  never restores, and one like 'exp*' also matches other directories (whose
  parts a save could take). Steps saved elsewhere and moved there restore.
  """
  wrong = _glob_misreads(os.fspath(directory)) + [
      name for name in item_names if _glob_misreads(name)]
  if wrong:
    where = f"under {os.fspath(directory)!r}" + (
        f" with items {sorted(item_names)}" if item_names else "")
    raise ValueError(
        f"cannot save checkpoints {where}: {wrong} contain '*', '?' or '[...]', which Orbax's"
        " saves read as a glob pattern (it looks up the parts of a saved item with one), so"
        " they would miss their dense items' parts (never complete them: they would not"
        " restore) or take another directory's. Rename them without these characters (e.g."
        " 'exp-1' for 'exp[1]'). Steps saved elsewhere and copied there can be read by a"
        " CheckpointManager with read_only=True."
    )


def _check_item_name(name: Any, what: str) -> None:
  """An item is one directory inside each step: its name must be one plain path component.

  Raises:
    TypeError, ValueError: naming the value (a path such as '../x' would be
      written outside the step, past its atomic commit).
  """
  if not isinstance(name, str):
    raise TypeError(f"{what} must be a str, got {name!r}.")
  if name in _RESERVED:
    raise ValueError(f"{what} {name!r} is reserved by Orbax; pick another name.")
  if (name in ("", ".", "..") or "/" in name or "\\" in name or name != name.strip()
      or name.startswith(".") or not name.isprintable()):
    raise ValueError(
        f"{what} {name!r} is not a plain directory name: an item is one directory inside each"
        " step. Use letters, digits, '_' and '-' (e.g. 'embedding', 'params')."
    )


def _not_writable(directory: epath.Path, error: OSError) -> str:
  """The message of a save the storage refused to write (read-only, no permission).

  A writable manager opens without writing (a Trainer that only evaluates a
  read-only workdir never saves); its first save then names the problem.
  """
  return (
      f"cannot save checkpoints under {directory}: the storage refused to write there"
      f" ({error.strerror or error}: {error.filename or directory}; a read-only file system,"
      " or no write permission). To restore its steps, a CheckpointManager(...,"
      " read_only=True) is enough; to save, choose a writable directory."
  )


def _embedding_registry(embedding_item: str) -> ocp.handlers.DefaultCheckpointHandlerRegistry:
  """One handler for the embedding item, for its save and both of its restores.

  Orbax binds an item to the first restore args it sees; registering the
  three kinds up front lets one manager restore with `EmbeddingRestore` and
  `TableRestore` in any order. Other items register on first use, as usual.
  """
  registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
  handler = EmbeddingCheckpointHandler()
  for args in (EmbeddingSave, EmbeddingRestore, TableRestore):
    registry.add(embedding_item, args, handler)
  return registry


def _metric_getter(key: str) -> Callable[[Mapping[str, Any]], float]:
  def get(metrics: Mapping[str, Any]) -> float:
    if key not in metrics:
      raise KeyError(f"best_metric {key!r} is not in the checkpoint's metrics {sorted(metrics)}.")
    return float(metrics[key])

  return get


def _nan_ranks_worst(metric_fn: Callable[[Mapping[str, Any]], float],
                     best_mode: str) -> Callable[[Mapping[str, Any]], float]:
  """`metric_fn` with NaN mapped to the worst value of `best_mode` (+inf for 'min').

  Orbax sorts the metrics to keep the best steps, and NaN compares false
  with everything: a step whose loss diverged would land anywhere in that
  order and could push out the best step.
  """
  worst = math.inf if best_mode == "min" else -math.inf

  def get(metrics: Mapping[str, Any]) -> float:
    value = float(metric_fn(metrics))
    return worst if math.isnan(value) else value

  return get


def _directories_made_before_the_save_returns() -> dict[str, Any]:
  """Orbax options that create a step's temporary directory inside `save`, not in a thread.

  Made in a background thread (Orbax's default), a directory that cannot be
  made (read-only or full storage) leaves the save's other threads waiting
  for it until Orbax's async timeout (10-20 min): the process hangs after the
  save failed. Made inside `save`, the error is raised there and nothing
  waits. Orbax versions without the option keep their own way.
  """
  fields = {field.name for field in dataclasses.fields(ocp.options.AsyncOptions)}
  if "create_directories_asynchronously" not in fields:
    return {}
  return {"async_options": ocp.options.AsyncOptions(create_directories_asynchronously=False)}
