"""Checkpoints of stacked embedding tables: save fast, resume exactly, move anywhere.

Save (inside any Orbax checkpointer or manager; asynchronous by default):

  mngr = checkpoint.CheckpointManager(directory, keep_latest=3)
  mngr.save(step, checkpoint.EmbeddingSave(tables, slots, layout, optimizers=optimizers),
            items={"params": ocp.args.StandardSave(params)})

(`optimizers`: stack -> its sparse optimizer; the checkpoint records which
optimizer owns the slots, and a restore into another one is a
SlotMismatchError even where the slots have the same names, as Adam's and
LaProp's do. `slot_specs` instead saves the slots without that record.)

Restore into the same layout, or any other layout of the same tables (other
stacking groups, device count G or shards per device S) on the caller's mesh,
each device reading only the rows it will hold; or per-table host arrays,
optionally some tables or a row range:

  state = mngr.restore(
      None, checkpoint.EmbeddingRestore(layout, mesh, "table", optimizers=optimizers)
  )["embedding"]
  arrays = mngr.restore(None, checkpoint.TableRestore(rows={"users": (0, 1000)}))["embedding"]

Incremental saves: `CheckpointManager(..., incremental=IncrementalPolicy())`
with `save(..., updated_rows=UpdatedRows(...))` writes a delta (the rows
updated since the previous save) when the policy says so; every restore path
reads a delta step as its base plus its deltas (`ChainReader`).

Convert offline with bounded memory (`convert`, or the `sc-checkpoint convert`
command), describe a checkpoint (`inspect`, `sc-checkpoint inspect`) and
check every byte of one without restoring it (`verify`, `sc-checkpoint verify`).
Integrity is on by default: chunks carry zarr crc32c checksums and every step
written by `CheckpointManager` carries a manifest of its files' CRC32C
(`checkpoint._integrity`), both verified on restore.
Storage: one zarr v3 array per stacked table and slot, through TensorStore,
chunked inside shard boundaries, with the layout as JSON (`checkpoint._format`).
"""

from checkpoint._errors import (
    CheckpointError,
    CheckpointReadError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    MissingItemError,
    MissingTableError,
    NotACheckpointError,
    SlotMismatchError,
)
from checkpoint._chain import (
    BrokenChainError,
    ChainReader,
    open_reader,
    stored_table_names,
    stored_table_shapes,
)
from checkpoint._convert import ConversionProgress, convert
from checkpoint._delta import Delta
from checkpoint._handler import (
    EmbeddingCheckpointHandler,
    EmbeddingRestore,
    EmbeddingSave,
    TableRestore,
)
from checkpoint._incremental import IncrementalPolicy, SaveKind
from checkpoint._inspect import format_description, inspect
from checkpoint._layouts import layout_for_tables, relayout
from checkpoint._manager import CheckpointManager, check_can_save_under
from checkpoint._reader import CheckpointReader
from checkpoint._restore import TableArrays
from checkpoint._rows_tracker import UpdatedRows, batch_rows
from checkpoint._steps import remove_unfinished_saves
from checkpoint._storage import StorageOptions
from checkpoint._verify import verify

__all__ = [
    "EmbeddingCheckpointHandler",
    "EmbeddingSave",
    "EmbeddingRestore",
    "TableRestore",
    "TableArrays",
    "StorageOptions",
    "CheckpointManager",
    "check_can_save_under",
    "remove_unfinished_saves",
    "CheckpointReader",
    "convert",
    "ConversionProgress",
    "relayout",
    "layout_for_tables",
    "inspect",
    "format_description",
    "verify",
    "CheckpointError",
    "NotACheckpointError",
    "MissingItemError",
    "MissingTableError",
    "IncompatibleCheckpointError",
    "SlotMismatchError",
    "CorruptCheckpointError",
    "CheckpointReadError",
    # Incremental (delta) checkpoints.
    "Delta",
    "IncrementalPolicy",
    "SaveKind",
    "UpdatedRows",
    "batch_rows",
    "ChainReader",
    "open_reader",
    "stored_table_names",
    "stored_table_shapes",
    "BrokenChainError",
]
