"""The Orbax handler for stacked embedding tables and their slot variables.

Register-free use inside any Orbax composite:

  mngr = ocp.CheckpointManager(directory)
  optimizers = {stack: plan.optimizer(stack) for stack in layout.stack_names}
  mngr.save(step, args=ocp.args.Composite(
      embedding=EmbeddingSave(state.tables, state.slots, layout, optimizers=optimizers),
      params=ocp.args.StandardSave(params)))
  restored = mngr.restore(step, args=ocp.args.Composite(
      embedding=EmbeddingRestore(new_layout, mesh, "table", optimizers=new_optimizers)))

`async_save` blocks only for the device-to-host copy of the shards this
process owns; the TensorStore write runs in Orbax's background commit thread,
and its errors surface on the next save or on `wait_until_finished`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import Mesh

from checkpoint import _delta, _optimizers, _save, _storage
from checkpoint._assembly import OnSlotMismatch
from checkpoint._chain import open_reader, verify_item
from checkpoint._format import MANIFEST_FILE, new_save_id
from checkpoint._inspect import describe_item
from checkpoint._restore import TableArrays, read_tables, restore_to_mesh
from checkpoint._storage import StorageOptions
from sc_framework.primitives import EmbeddingVariables
from sc_framework.optimizers import OptimizerSpec, SlotSpec
from sc_framework.stacking import EmbeddingLayout


class EmbeddingCheckpointHandler(ocp.AsyncCheckpointHandler):
  """Saves `EmbeddingSave` and restores `EmbeddingRestore` / `TableRestore`.

  Storage: one zarr v3 array per stacked table and per slot, written through
  TensorStore with chunks inside one shard's rows, plus layout.json and
  manifest.json (see `checkpoint._format`).

  Args:
    primary_host: the process that writes the JSON metadata (None: every one).
  """

  def __init__(self, *, primary_host: int | None = 0):
    self._primary_host = primary_host

  def _is_primary(self) -> bool:
    return self._primary_host is None or jax.process_index() == self._primary_host

  def _prepare_save(
      self, directory: epath.Path, args: "EmbeddingSave"
  ) -> Coroutine[Any, Any, None]:
    """Validates, snapshots the arrays to host (blocking) and returns the write."""
    if not isinstance(args, EmbeddingSave):
      raise TypeError(
          f"EmbeddingCheckpointHandler saves EmbeddingSave args, got {type(args).__name__}."
      )
    _storage.check_local_path(directory)  # Raised here, not by the background write.
    if args.delta is not None:  # Only the updated rows (checkpoint._delta).
      return _delta.prepare_save(epath.Path(directory), args, primary=self._is_primary())
    manifest = dataclasses.replace(_save.state_manifest(args),
                                   save_id=args.save_id or new_save_id())
    blocks = _save.snapshot(args.tables, args.slots)
    return _save.write(
        epath.Path(directory), manifest, args.layout, blocks, primary=self._is_primary()
    )

  async def async_save(self, directory: epath.Path, args: "EmbeddingSave") -> list[Any]:
    """Snapshots the arrays to host (blocking) and returns the background write."""
    write = self._prepare_save(directory, args)
    return [ocp.future.CommitFutureAwaitingContractedSignals(write, name="embedding_save")]

  def save(self, directory: epath.Path, args: "EmbeddingSave") -> None:
    """Saves synchronously (the same files as `async_save`)."""
    _save.run_sync(self._prepare_save(directory, args))

  def restore(
      self, directory: epath.Path, args: "EmbeddingRestore | TableRestore | None" = None
  ) -> EmbeddingVariables | TableArrays:
    """Restores into a layout on a mesh (`EmbeddingRestore`) or per table (`TableRestore`).

    An item of a step with an integrity manifest is verified against it
    first (`checkpoint._chain.verify_item`), whoever calls the restore.
    """
    if not isinstance(args, (EmbeddingRestore, TableRestore)):
      raise TypeError(
          "EmbeddingCheckpointHandler.restore needs args=EmbeddingRestore(layout, mesh,"
          f" axis_name) or args=TableRestore(...), got {type(args).__name__}."
      )
    verify_item(directory)
    reader = open_reader(directory)  # A delta item reads as its chain.
    if isinstance(args, EmbeddingRestore):
      slot_specs, optimizers = _optimizers.resolve(
          "EmbeddingRestore", args.layout.stack_names, args.slot_specs, args.optimizers
      )
      return restore_to_mesh(
          reader,
          args.layout,
          args.mesh,
          args.axis_name,
          slot_specs=slot_specs,
          optimizer_names=optimizers,
          on_slot_mismatch=args.on_slot_mismatch,
          dtype=args.dtype,
      )
    return read_tables(reader, args.tables, args.rows)

  def metadata(self, directory: epath.Path) -> dict[str, Any] | None:
    """A JSON-friendly summary of the item (see `checkpoint.inspect`), or None."""
    if not (epath.Path(directory) / MANIFEST_FILE).exists():
      return None
    return describe_item(directory)

  def finalize(self, directory: epath.Path) -> None:
    del directory

  def close(self) -> None:
    pass


@ocp.args.register_with_handler(EmbeddingCheckpointHandler, for_save=True)
@dataclasses.dataclass
class EmbeddingSave(ocp.args.CheckpointArgs):
  """Save stacked tables and their slots.

  Attributes:
    tables: stack name -> [V_s, D'] array (any sharding; row-sharded
      NamedSharding(mesh, PartitionSpec(axis, None)) is the fast case).
    slots: stack name -> slot name -> [V_s, D'] or [V_s, w] array.
    layout: the layout of the arrays.
    slot_specs: stack name -> the slot declarations of its optimizer
      (optimizer.slots()); stacks without slots may be left out.
    storage: codecs and chunk size (`StorageOptions`).
    delta: None (default) saves every row; a `Delta` saves only the rows
      updated since its parent step (see `checkpoint._delta`).
    optimizers: stack name -> its sparse optimizer, instead of `slot_specs`:
      the slots are its slots(), and the checkpoint records which optimizer
      they belong to, so that a restore into another optimizer with slots
      of the same names (Adam's into LaProp) is refused
      (`checkpoint._optimizers`). Stacks without slots may be left out.
    save_id: the id this save records in its manifest (`_format`'s
      "save_id"); None (default) draws a new one. A `CheckpointManager`
      sets it, to remember which save its next delta goes on top of.
    step_integrity: whether the step the item is saved into gets an
      integrity manifest (`_format`'s "step_integrity"). A
      `CheckpointManager` sets it: a restore of the item then refuses a step
      that lost its integrity.json, which one written by Orbax's own managers
      never had.
  """

  tables: Mapping[str, jax.Array]
  slots: Mapping[str, Mapping[str, jax.Array]]
  layout: EmbeddingLayout
  slot_specs: Mapping[str, Sequence[SlotSpec]] = dataclasses.field(default_factory=dict)
  storage: StorageOptions = dataclasses.field(default_factory=StorageOptions)
  delta: _delta.Delta | None = None
  optimizers: Mapping[str, OptimizerSpec] | None = None
  save_id: str | None = None
  step_integrity: bool = False


@ocp.args.register_with_handler(EmbeddingCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class EmbeddingRestore(ocp.args.CheckpointArgs):
  """Restore into `layout`, row-sharded over `axis_name` of `mesh`.

  The layout may differ from the saved one in any way that keeps each table's
  vocabulary and dimension: other stacking groups, other G (the mesh axis
  size), other S. When it places a stack exactly as saved, each device reads
  its block with one contiguous read; otherwise each device reads exactly the
  logical rows it will hold. Slots follow their tables.

  Attributes:
    layout: the target layout; its num_devices must equal the axis size.
    mesh: the caller's mesh.
    axis_name: the table axis of `mesh`.
    slot_specs: target stack -> the slots its optimizer keeps; None (default)
      restores the slots stored with the tables.
    on_slot_mismatch: 'error' (default) raises SlotMismatchError when the
      target slots differ from the stored ones (by names and widths), or
      belong to another optimizer than the one that wrote them (both known,
      see `optimizers`); 'reset' starts such a stack's slots from their
      initial values (float32).
    dtype: the expected table dtype; a different stored dtype is an error.
    optimizers: target stack -> its sparse optimizer, instead of
      `slot_specs` (the slots are its slots()). A stack whose tables the
      checkpoint records as trained with another optimizer (another kind,
      or another CustomOptimizer name) is a slot mismatch even where the
      slots have the same names and widths; the same optimizer with other
      hyperparameters restores. Checkpoints that record no optimizer
      (written before it was recorded, or saved with `slot_specs`) are
      matched by names and widths only, as with `slot_specs`.

  Returns (from restore): EmbeddingVariables(tables, slots).
  """

  layout: EmbeddingLayout
  mesh: Mesh
  axis_name: str
  slot_specs: Mapping[str, Sequence[SlotSpec]] | None = None
  on_slot_mismatch: OnSlotMismatch = "error"
  dtype: Any = None
  optimizers: Mapping[str, OptimizerSpec] | None = None

  def __post_init__(self):
    for name, value, kind, described in (
        ("layout", self.layout, EmbeddingLayout, "an EmbeddingLayout"),
        ("mesh", self.mesh, Mesh, "a jax.sharding.Mesh"),
        ("axis_name", self.axis_name, str, "a str")):
      if not isinstance(value, kind):
        raise TypeError(
            f"EmbeddingRestore: {name} must be {described}, got {value!r}. Pass"
            " EmbeddingRestore(layout, mesh, axis_name), e.g. (plan.layout, plan.mesh,"
            " plan.axis_name).")


@ocp.args.register_with_handler(EmbeddingCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class TableRestore(ocp.args.CheckpointArgs):
  """Restore per-table host arrays (tables and slots), padding stripped.

  Attributes:
    tables: the tables to read; None for all (or, when `rows` is given, the
      tables it names).
    rows: table -> (start, stop): read only logical rows [start, stop).

  Returns (from restore): TableArrays(tables, slots), numpy arrays.
  """

  tables: Sequence[str] | None = None
  rows: Mapping[str, tuple[int, int]] | None = None
