"""The Trainer's checkpoints: what a step directory holds and how it resumes.

Items of one step (an Orbax step directory, written asynchronously, committed
atomically):
  embedding   the stacked tables and slots (checkpoint.EmbeddingSave), with
              the layout, so they restore into any layout;
  dense       {"params", "opt_state", "step"} (Orbax PyTree);
  in_flight   present only for a pipelined checkpoint taken mid-run: the
              activations looked up early and the batch they belong to, in
              the layout-free form of `pipelining._in_flight` (activations,
              dense features, labels and the raw ids);
  meta        JSON: format, step, data position, mode, whether in_flight
              exists and its ids' widths ("in_flight_ids": feature ->
              {"width", "weights", "table", "combiner", "batch_size",
              "sequence_length"}: table and combiner say how its activations
              were looked up, the last two give their shape (global batch;
              null for a pooled feature); older checkpoints lack them).

Formats. "sc_framework.trainer/2" (written now) resumes on any device count,
shards per device, stacking and process count. "sc_framework.trainer/1"
stored the in-flight batch as preprocessed, layout-specific buffers: such a
checkpoint still resumes, on the layout it was written with (a resumed
batch of that kind, saved again while still in flight, is written in the
same format). A checkpoint without an in-flight batch is the same in both.
No RNG state is saved: the Trainer draws random numbers only when it
initialises (tables and dense parameters from `seed`), and applies the dense
model without RNG streams (models with dropout are not supported yet).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from checkpoint import (
    CheckpointManager,
    EmbeddingRestore,
    EmbeddingSave,
    IncompatibleCheckpointError,
    IncrementalPolicy,
    MissingItemError,
    SlotMismatchError,
    UpdatedRows,
    batch_rows,
    stored_table_names,
    stored_table_shapes,
)
from pipelining._in_flight import FeatureInFlight, SavedInFlight, rows_shapes
from pipelining._steps import DeviceBatch, TrainState
from sc_framework.preprocessing import PreprocessedBatch, StackBatch
from sc_framework.primitives import EmbeddingPlan, EmbeddingVariables
from sc_framework.stacking import logical_to_global_rows

FORMAT = "sc_framework.trainer/2"
LAYOUT_SPECIFIC_FORMAT = "sc_framework.trainer/1"
_FORMATS = (FORMAT, LAYOUT_SPECIFIC_FORMAT)


def _abstract(tree):
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree
  )


# StackBatch field -> its key in a trainer/1 item (the names of when that
# format was written; the field has been renamed since).
_LAYOUT_SPECIFIC_KEYS = {
    "unique_rows": "unique_rows",
    "entry_samples": "entry_samples",
    "entry_unique_index": "entry_slots",
    "entry_gains": "entry_gains",
}


def _in_flight_to_tree(in_flight: FeatureInFlight) -> dict[str, Any]:
  """The trainer/1 in-flight item: the preprocessed buffers of one layout."""
  batch = in_flight.batch
  return {
      "activations": dict(in_flight.activations),
      "sparse": {
          name: {_LAYOUT_SPECIFIC_KEYS[field]: value for field, value in stack._asdict().items()}
          for name, stack in batch.sparse.items()
      },
      "dense": batch.dense,
      "labels": batch.labels,
  }


def _in_flight_from_tree(tree: dict[str, Any], plan: EmbeddingPlan) -> FeatureInFlight:
  """The restored trainer/1 item; its buffers were preprocessed for `plan`'s layout (checked)."""
  sparse = {
      name: StackBatch(**{field: arrays[key] for field, key in _LAYOUT_SPECIFIC_KEYS.items()},
                       signature=plan.batch_signature(name))
      for name, arrays in tree["sparse"].items()
  }
  return FeatureInFlight(tree["activations"], DeviceBatch(sparse, tree["dense"], tree["labels"]))


class TrainerCheckpoints:
  """Saves and restores Trainer state under workdir/checkpoints.

  Incremental saves: every prepared batch's rows are recorded (`track`). A
  save happens between batches prepared and batches applied (the prefetch
  queue, the in-flight lookup), so after a save the rows of the last
  `unapplied_batches` batches prepared are recorded again: they may be
  applied after it. The delta thus holds a superset of the rows updated
  since the previous save, which is exact (a row's current value is written).

  Args:
    workdir: the Trainer's work directory.
    plan: the embedding plan (layout, mesh, slots).
    keep: the newest checkpoints to retain.
    incremental: the delta policy (None: every save is full).
    unapplied_batches: the most batches prepared but not yet applied at once.
  """

  def __init__(self, workdir: epath.PathLike, plan: EmbeddingPlan, *, keep: int,
               incremental: IncrementalPolicy | None = None, unapplied_batches: int = 8):
    self._plan = plan
    self._manager = CheckpointManager(
        epath.Path(workdir) / "checkpoints", keep_latest=keep, save_interval_steps=1,
        incremental=incremental,
    )
    self._rows = UpdatedRows(plan.layout) if incremental is not None else None
    # (number of the batch among those tracked, its rows) of the latest batches.
    self._recent: collections.deque = collections.deque(maxlen=unapplied_batches)
    self._tracked = 0
    self._recent_lock = threading.Lock()  # `track` runs on the prefetching thread.

  def track(self, batch: PreprocessedBatch | dict[str, StackBatch]) -> None:
    """Records the rows a training batch (host or placed) will update (incremental only)."""
    if self._rows is None:
      return
    rows = batch_rows(batch, self._plan.layout)
    with self._recent_lock:
      self._recent.append((self._tracked, rows))
      self._tracked += 1
    for stack, stack_rows in rows.items():
      self._rows.add(stack, stack_rows)

  def track_tables(self, tables: Iterable[str]) -> None:
    """Records every row of `tables` as updated (incremental only): their rows were
    replaced (`Trainer.replace_tables`), so the next save writes them all."""
    if self._rows is None:
      return
    layout = self._plan.layout
    for name in tables:
      stack = layout.stack_of_table(name)
      rows = logical_to_global_rows(layout, name, np.arange(stack.table(name).vocabulary_size))
      self._rows.add(stack.name, np.asarray(rows, np.int64))

  def tracked(self) -> int:
    """How many batches were tracked so far (a mark for `forget_tracked_since`)."""
    with self._recent_lock:
      return self._tracked

  def forget_tracked_since(self, mark: int) -> None:
    """The batches tracked since `mark` will never be applied (their stream was dropped).

    They leave the latest batches, whose rows each save records again: else
    they could push out batches still to apply. (Their rows stay recorded for
    the next save, a superset.)
    """
    with self._recent_lock:
      kept = [entry for entry in self._recent if entry[0] < mark]
      self._recent.clear()
      self._recent.extend(kept)

  @property
  def directory(self) -> epath.Path:
    return self._manager.directory

  def latest_step(self) -> int | None:
    """The newest complete step on disk, also one another Trainer saved since this one started.

    Waits for this Trainer's own save in progress first (raising its error
    if it failed), so that rereading the directory cannot miss it.
    """
    self._manager.wait_until_finished()
    self._manager.reload()
    return self._manager.latest_step()

  def why_unrestorable(self, step: int) -> str | None:
    return self._manager.why_unrestorable(step)

  def unrestorable_steps(self) -> dict[int, str]:
    """Step -> why, for the workdir's step directories that do not restore."""
    return self._manager.unrestorable_steps()

  def mark_damaged(self, step: int, why: str) -> None:
    """`step` no longer restores: `latest_step` skips it, a save of its number replaces it."""
    self._manager.mark_damaged(step, why)

  def read_meta(self, step: int) -> dict[str, Any]:
    try:
      meta = self._manager.restore(step, items={"meta": ocp.args.JsonRestore()})["meta"]
    except MissingItemError as error:  # saved by a CheckpointManager of the user's own
      raise IncompatibleCheckpointError(
          f"{self.directory / str(step)} is not a Trainer checkpoint: it has no 'meta' item"
          f" ({error}). A Trainer resumes the checkpoints a Trainer wrote; start one from"
          " another checkpoint's tables with trainer.replace_tables(...) (checkpoint.TableRestore"
          " reads them by name), or give it another workdir."
      ) from None
    if not isinstance(meta, dict) or meta.get("format") not in _FORMATS:
      raise IncompatibleCheckpointError(
          f"{self.directory / str(step)} is not a Trainer checkpoint (meta format"
          f" {meta.get('format') if isinstance(meta, dict) else meta!r}, expected one of"
          f" {list(_FORMATS)})."
      )
    stored_step = meta.get("step", step)
    if stored_step != step:
      raise IncompatibleCheckpointError(
          f"{self.directory / str(step)} holds the state after {stored_step!r} updates, not"
          f" {step}: the step folder was renamed or copied by hand (its meta item says"
          f" {stored_step!r}). Resuming it would count the steps wrongly or mix two steps;"
          f" rename it back to {stored_step!r} if it was renamed, or remove it."
      )
    return meta

  def save(
      self,
      step: int,
      state: TrainState,
      in_flight: SavedInFlight | FeatureInFlight | None,
      data_state: dict[str, Any],
      *,
      pipelining: bool,
  ) -> bool:
    """Starts an asynchronous save of `step` (skipped if that step exists).

    Args:
      in_flight: the layout-free in-flight batch; a `FeatureInFlight`
        (preprocessed buffers) only for a batch restored from a layout-specific checkpoint,
        which is then written in that format again.
    """
    if step in self._manager.all_steps() and self.why_unrestorable(step) is None:
      return False  # Saved already (a delta step that no longer restores is saved again).
    meta = {
        "format": FORMAT,
        "step": step,
        "data": data_state,
        "pipelining": pipelining,
        "has_in_flight": in_flight is not None,
        "layout": self._plan.layout.to_dict(),
    }
    items: dict[str, Any] = {
        "dense": ocp.args.StandardSave(
            {"params": state.params, "opt_state": state.opt_state, "step": state.step}
        ),
    }
    if isinstance(in_flight, SavedInFlight):
      specs = {spec.name: spec for spec in self._plan.feature_specs}
      meta["in_flight_ids"] = {
          name: {"width": int(entry["ids"].shape[1]), "weights": "weights" in entry,
                 "batch_size": int(entry["ids"].shape[0]),
                 "sequence_length": specs[name].sequence_length, **_looked_up_as(specs[name])}
          for name, entry in in_flight.ids.items()}
      items["in_flight"] = ocp.args.StandardSave(in_flight._asdict())
    elif in_flight is not None:
      meta["format"] = LAYOUT_SPECIFIC_FORMAT
      items["in_flight"] = ocp.args.StandardSave(_in_flight_to_tree(in_flight))
    items["meta"] = ocp.args.JsonSave(meta)
    embedding = EmbeddingSave(
        state.embeddings.tables, state.embeddings.slots, self._plan.layout,
        optimizers=self._plan.optimizers(),
    )
    saved = self._manager.save(step, embedding, items=items, force=True,
                               updated_rows=self._rows)
    if self._rows is not None:
      self._readd_recent()
    return saved

  def _readd_recent(self) -> None:
    """Records again the rows of the latest batches prepared: they may not be applied yet."""
    with self._recent_lock:
      recent = list(self._recent)
    for _, rows in recent:
      for stack, stack_rows in rows.items():
        self._rows.add(stack, stack_rows)

  def restore(
      self, step: int, state_template: TrainState, in_flight_template: FeatureInFlight
  ) -> tuple[TrainState, SavedInFlight | FeatureInFlight | None, dict[str, Any]]:
    """Restores step `step` into the plan's layout and mesh.

    Args:
      state_template: the state to restore into (shapes and shardings).
      in_flight_template: activations and an example batch of this layout
        (shapes and shardings of an in-flight batch).

    Returns:
      The state, the in-flight batch (a SavedInFlight with the whole global
      batch's raw ids on the host; a FeatureInFlight from a layout-specific
      checkpoint; None) and the data position.

    Raises:
      IncompatibleCheckpointError and other checkpoint errors naming the
      table and the difference when the checkpoint does not fit the specs,
      or a layout-specific in-flight batch written for another layout.
    """
    meta = self.read_meta(step)
    template = self._in_flight_template(step, meta, in_flight_template)
    state, restored = self._restore_items(step, state_template, template)
    self._check_no_table_left_out(step)  # once the step read as sound
    in_flight = None
    if template is not None and meta["format"] == FORMAT:
      tree = restored["in_flight"]
      ids = jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree["ids"])
      in_flight = SavedInFlight(tree["activations"], tree["dense"], tree["labels"], ids)
    elif template is not None:
      in_flight = _in_flight_from_tree(restored["in_flight"], self._plan)
    if self._rows is not None:  # The state is `step`'s: rows since, and those still to apply.
      self._rows.clear()
      self._readd_recent()
      # A SavedInFlight is tracked once preprocessed again.
      if isinstance(in_flight, FeatureInFlight):
        self.track(in_flight.batch.sparse)
    return state, in_flight, meta.get("data") or {}

  def _check_table_shapes(self, step: int) -> None:
    """Refuses tables whose specs changed shape, naming them, before the dense items
    restore: a changed embedding_dim would otherwise first show as a dense layer's
    kernel of another shape."""
    stored = stored_table_shapes(self.directory / str(step) / self._manager.embedding_item)
    changed = {name: (stored[name], (table.vocabulary_size, table.embedding_dim))
               for name, table in self._plan.tables().items()
               if name in stored and stored[name] != (table.vocabulary_size,
                                                     table.embedding_dim)}
    if changed:
      described = "; ".join(
          f"table {name!r} is stored with vocabulary_size={old[0]}, embedding_dim={old[1]} but"
          f" its TableSpec now has {new[0]}, {new[1]}" for name, (old, new) in changed.items())
      raise IncompatibleCheckpointError(
          f"checkpoint step {step} in {self.directory} does not fit the Trainer's feature specs:"
          f" {described}. A table keeps its shape across resumes: restore the old shape, or"
          " train in a new workdir started from this one's rows (Trainer.table_values and"
          " replace_tables) migrated to the new shape."
      )

  def _check_no_table_left_out(self, step: int) -> None:
    """Refuses to resume training without tables the checkpoint holds: the saves that
    follow would not keep them, and once the older steps are removed their trained rows
    would be lost. (A table the checkpoint lacks is refused by the restore itself.)"""
    stored = stored_table_names(self.directory / str(step) / self._manager.embedding_item)
    left_out = sorted(set(stored) - set(self._plan.layout.table_names))
    if left_out:
      raise IncompatibleCheckpointError(
          f"checkpoint step {step} in {self.directory} holds the tables {left_out}, which the"
          " Trainer's feature specs do not use: training on would save checkpoints without"
          " them, and their trained rows would be lost once the older steps are removed."
          " Give the Trainer the feature specs of every table of the checkpoint (evaluate"
          " and predict read it without them). To drop tables on purpose, train in a new"
          " workdir started from this one's rows (Trainer.table_values, slot_values and"
          " replace_tables)."
      )

  def restore_state(self, step: int, state_template: TrainState) -> TrainState:
    """Only the train state of step `step` (for evaluate and predict), in the plan's layout."""
    self.read_meta(step)  # a Trainer checkpoint
    return self._restore_items(step, state_template, None)[0]

  def _restore_items(self, step: int, state_template: TrainState,
                     in_flight_template: dict[str, Any] | None) -> tuple[TrainState, dict]:
    """The train state of `step` and the restored items (the in-flight one if templated)."""
    self._check_table_shapes(step)
    items = {
        "dense": ocp.args.StandardRestore(_abstract({
            "params": state_template.params,
            "opt_state": state_template.opt_state,
            "step": state_template.step,
        })),
    }
    if in_flight_template is not None:
      items["in_flight"] = ocp.args.StandardRestore(_abstract(in_flight_template))
    embedding = EmbeddingRestore(
        self._plan.layout, self._plan.mesh, self._plan.axis_name,
        # Slots of another optimizer (also one with slots of the same names) are refused.
        optimizers=self._plan.optimizers(),
        # The tables in the state's dtype; another stored dtype is refused.
        dtype=next(iter(state_template.embeddings.tables.values())).dtype,
    )
    try:
      restored = self._manager.restore(step, embedding, items=items)
    except SlotMismatchError as error:
      # The checkpoint's hint names a restore option the Trainer does not offer.
      message = str(error).split(" Restore with ", 1)[0]
      raise SlotMismatchError(
          f"{message} The Trainer resumes optimizer state as it is: give the tables the"
          " optimizer the checkpoint was trained with, or train in another workdir."
      ) from error
    dense = restored["dense"]
    stored_step = int(np.asarray(dense["step"].addressable_data(0)))
    if stored_step != step:
      raise IncompatibleCheckpointError(
          f"{self.directory / str(step)} holds the state after {stored_step} updates, not"
          f" {step}: the step folder was renamed or copied by hand. Resuming it would count"
          f" the steps wrongly; rename it back to {stored_step} or remove it."
      )
    tables = restored["embedding"]
    state = TrainState(
        dense["params"], dense["opt_state"], EmbeddingVariables(dict(tables.tables), {
            k: dict(v) for k, v in tables.slots.items()}), dense["step"],
    )
    return state, restored

  def _in_flight_template(self, step: int, meta: dict[str, Any],
                          example: FeatureInFlight) -> dict[str, Any] | None:
    """The in-flight item's shapes in this layout, or None without one."""
    if not meta["has_in_flight"]:
      return None
    if meta["format"] == FORMAT:
      saved = sorted(meta["in_flight_ids"])
      expected = sorted(f.name for f in self._plan.feature_specs)
      if saved != expected:
        raise IncompatibleCheckpointError(
            f"checkpoint step {step} in {self.directory} holds an in-flight batch of the"
            f" features {saved}, but the Trainer has the features {expected}. Resume with the"
            " feature specs the checkpoint was written with."
        )
      _check_same_batch_shape(step, self.directory, meta["in_flight_ids"],
                              self._plan.feature_specs)
      _check_looked_up_alike(step, self.directory, meta["in_flight_ids"],
                             self._plan.feature_specs)
      replicated = self._plan.replicated_sharding()
      return SavedInFlight(
          example.activations, example.batch.dense, example.batch.labels,
          rows_shapes(self._plan.feature_specs, meta["in_flight_ids"], replicated),
      )._asdict()
    if meta.get("layout") != self._plan.layout.to_dict():
      raise IncompatibleCheckpointError(
          f"checkpoint step {step} in {self.directory} (format {LAYOUT_SPECIFIC_FORMAT!r})"
          " holds a pipelined in-flight batch preprocessed for another layout (device count,"
          " shards per device or stacking), which cannot be replayed here. Resume it with the"
          " layout it was written with; checkpoints written now"
          f" ({FORMAT!r}) resume on any layout."
      )
    return _in_flight_to_tree(example)

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()


def _looked_up_as(spec) -> dict[str, str]:
  """What an in-flight feature's saved activations depend on besides the rows: its
  table, and the table's combiner unless it is a sequence feature (which has none)."""
  if spec.sequence_length is not None:
    return {"table": spec.table.name}
  return {"table": spec.table.name, "combiner": spec.table.combiner}


def _check_same_batch_shape(step: int, directory: epath.Path,
                            saved: dict[str, dict[str, Any]], specs) -> None:
  """Refuses an in-flight batch of another (global) batch size, or a sequence
  feature's of another sequence length, than the specs give.

  The first resumed step applies it with the step compiled for the specs'
  shapes; its activations, dense features and labels have the shapes it was
  written with. (Older checkpoints record neither: Orbax's shape check refuses.)
  """
  recorded = [(spec, {"batch_size": spec.batch_size, "sequence_length": spec.sequence_length,
                      **saved[spec.name]}) for spec in specs]
  changed = [f"{entry['batch_size']} samples then, {spec.batch_size} now (feature {spec.name!r})"
             for spec, entry in recorded if entry["batch_size"] != spec.batch_size][:1]
  changed += [f"feature {spec.name!r}: {_shape_kind(entry['sequence_length'])} then,"
              f" {_shape_kind(spec.sequence_length)} now"
              for spec, entry in recorded if entry["sequence_length"] != spec.sequence_length]
  if changed:
    raise IncompatibleCheckpointError(
        f"checkpoint step {step} in {directory} holds an in-flight batch of other shapes than"
        f" the Trainer's ({'; '.join(changed)}): the first resumed step would apply it as it"
        " is. Resume with the batch size and sequence lengths it was written with; change"
        " them at a checkpoint without a batch in flight: resume once with the shapes it was"
        " written with and pipelining off, for one step (its checkpoint holds no batch in"
        " flight), or use one written by a fit that ran to the end of its data."
    )


def _shape_kind(sequence_length: int | None) -> str:
  return "a combined feature" if sequence_length is None else f"sequence length {sequence_length}"


def _check_looked_up_alike(step: int, directory: epath.Path,
                           saved: dict[str, dict[str, Any]], specs) -> None:
  """Refuses an in-flight batch whose activations another table or combiner gave.

  Its activations were looked up before the checkpoint and are applied as they
  are by the first resumed step, whose update then follows the new specs: that
  step would mix the two silently.
  """
  changed = []
  for spec in specs:
    now = _looked_up_as(spec)
    recorded = {key: saved[spec.name][key] for key in now if key in saved[spec.name]}
    now = {key: value for key, value in now.items() if key in recorded}
    if recorded != now:
      changed.append(f"feature {spec.name!r}: {recorded} then, {now} now")
  if changed:
    raise IncompatibleCheckpointError(
        f"checkpoint step {step} in {directory} holds an in-flight batch whose activations"
        f" were looked up otherwise ({'; '.join(changed)}); the first resumed step would apply"
        " them under the new specs. Resume with the feature specs the checkpoint was written"
        " with; change them at a checkpoint without a batch in flight (one written with"
        " pipelining off, or by a fit that ran to the end of its data)."
    )
