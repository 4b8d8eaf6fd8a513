"""Where each block of a target layout's arrays comes from in a checkpoint.

Restoring into a layout (on a mesh) and converting to a layout (offline) share
this assembly. For every target stack it fixes the dtypes, the slot variables
(those stored with its tables, or the caller's, which must match unless they
are reset: the same names and widths, and the same optimizer where both the
checkpoint and the caller name it, see `_optimizers`) and whether the fast
path applies: when the target stack places its tables exactly as a stored
stack does (same N, R, D' and, per table, the same V, D, V', o, r; G and S
may differ), global row g of the target is global row g of the stored stack,
so a device block is one contiguous read.
Otherwise each block is assembled table by table: for table k the logical
rows in target rows [start, stop) (`table_row_runs_in_block`: one run of
logical rows i0, i0 + N, ... per shard) are copied from the checkpoint
straight into the block (`CheckpointReader.fill_strided_rows`: a few strided
copies per source chunk, no per-row index arrays); padding
rows and columns are 0 for tables and the slot's initial value for slots.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np

from checkpoint import _optimizers
from checkpoint._errors import IncompatibleCheckpointError, MissingTableError, SlotMismatchError
from checkpoint._reader import CheckpointReader
from checkpoint._storage import host_buffer
from sc_framework.optimizers import SlotSpec
from sc_framework.stacking import EmbeddingLayout, StackLayout, table_row_runs_in_block

OnSlotMismatch = Literal["error", "reset"]


@dataclasses.dataclass(frozen=True)
class StackAssembly:
  """How to fill one target stack's table and slot arrays.

  Attributes:
    stack: the target stack.
    dtype: the table dtype.
    slot_specs: the target slots, in order.
    slot_dtypes: slot name -> dtype.
    reset_slots: the slots start from their initial values (nothing is read).
    same_placement_group: the stored stack whose global rows equal the
      target's (the fast path), or None.
    optimizer: the name of the optimizer owning the slots (`_optimizers`):
      the caller's, else the one recorded for every table; None if unknown.
  """

  stack: StackLayout
  dtype: np.dtype
  slot_specs: tuple[SlotSpec, ...]
  slot_dtypes: dict[str, np.dtype]
  reset_slots: bool
  same_placement_group: str | None
  optimizer: str | None = None

  def slot_spec(self, name: str) -> SlotSpec:
    return next(spec for spec in self.slot_specs if spec.name == name)

  def width(self, slot: str | None) -> int:
    d_padded = self.stack.padded_embedding_dim
    return d_padded if slot is None else self.slot_spec(slot).stacked_width(d_padded)

  def array_dtype(self, slot: str | None) -> np.dtype:
    return self.dtype if slot is None else self.slot_dtypes[slot]


def check_tables(reader: CheckpointReader, layout: EmbeddingLayout) -> None:
  """Every table of `layout` is in the checkpoint with the same V and D."""
  missing = [name for name in layout.table_names if name not in reader.table_names]
  if missing:
    raise MissingTableError(
        f"the target layout needs tables {missing}, which are not in the checkpoint"
        f" {reader.item}; it holds {sorted(reader.table_names)}. Restore into a layout"
        " built from the checkpoint's tables, or initialise the new tables separately."
    )
  for stack in layout.stacks:
    for table in stack.tables:
      stored = reader.table_shape(table.name)
      wanted = (table.vocabulary_size, table.embedding_dim)
      if stored != wanted:
        raise IncompatibleCheckpointError(
            f"table {table.name!r}: the checkpoint {reader.item} stores vocabulary_size="
            f"{stored[0]}, embedding_dim={stored[1]} but the target layout has vocabulary_size="
            f"{wanted[0]}, embedding_dim={wanted[1]}. A table keeps its shape across layouts;"
            " fix the TableSpec or restore the old shape and migrate the rows yourself."
        )


def assemble_stacked(
    reader: CheckpointReader,
    layout: EmbeddingLayout,
    *,
    slot_specs: Mapping[str, Sequence[SlotSpec]] | None = None,
    optimizer_names: Mapping[str, str] | None = None,
    on_slot_mismatch: OnSlotMismatch = "error",
    dtype=None,
) -> dict[str, StackAssembly]:
  """The assembly of every stack of `layout` (see the module docstring).

  Args:
    reader: the checkpoint.
    layout: the target layout.
    slot_specs: target stack -> slot declarations; None keeps the slots stored
      with the tables.
    optimizer_names: target stack -> the name of its optimizer
      (`_optimizers.optimizer_name`); stacks left out, or None, are unknown.
    on_slot_mismatch: 'error' raises SlotMismatchError when `slot_specs`
      differ (by slot names and widths) from the stored ones, or when a
      stack's optimizer name differs from the one the checkpoint records for
      one of its tables; 'reset' starts every slot of such a stack from its
      initial value instead.
    dtype: the table dtype expected; None accepts the stored one.

  Raises:
    MissingTableError, IncompatibleCheckpointError, SlotMismatchError.
  """
  if on_slot_mismatch not in ("error", "reset"):
    raise ValueError(f"on_slot_mismatch must be 'error' or 'reset', got {on_slot_mismatch!r}.")
  check_tables(reader, layout)
  optimizer_names = dict(optimizer_names or {})
  for what, keys in (("slot_specs", slot_specs or {}), ("optimizer_names", optimizer_names)):
    unknown = sorted(set(keys) - set(layout.stack_names))
    if unknown:
      raise ValueError(f"{what} names stacks {unknown} that the target layout does not have.")
  assemblies = {}
  for stack in layout.stacks:
    names = stack.table_names
    table_dtype = _common_dtype(reader, stack, names, None, dtype)
    stored = {name: reader.slot_specs(name) for name in names}
    stored_optimizers = {name: reader.optimizer_name(name) for name in names}
    target = optimizer_names.get(stack.name)
    reset = False
    if slot_specs is None:
      specs = _common_slots(reader, stack, stored, stored_optimizers)
    else:
      specs = tuple(slot_specs.get(stack.name, ()))
      problem = _slot_problem(reader, stack, specs, target, stored, stored_optimizers)
      if problem is not None:
        if on_slot_mismatch == "error":
          raise SlotMismatchError(problem)
        reset = True
    slot_dtypes = {}
    for spec in specs:
      slot_dtypes[spec.name] = (
          np.dtype(np.float32) if reset else _common_dtype(reader, stack, names, spec.name, None)
      )
    if target is None and not reset:
      target = _optimizers.common_name(stored_optimizers)
    assemblies[stack.name] = StackAssembly(
        stack, table_dtype, specs, slot_dtypes, reset, _same_placement_group(reader, stack), target
    )
  return assemblies


def _signature(specs: Sequence[SlotSpec]) -> list[tuple[str, int | None]]:
  return sorted((spec.name, spec.width) for spec in specs)


def _slot_problem(
    reader,
    stack: StackLayout,
    specs: tuple[SlotSpec, ...],
    target: str | None,
    stored: dict[str, tuple[SlotSpec, ...]],
    stored_optimizers: dict[str, str | None],
) -> str | None:
  """Why the stored slots cannot become the target stack's `specs` (the error), or None."""
  advice = (
      " Restore with the optimizer the checkpoint was trained with, or pass"
      " on_slot_mismatch='reset' to start this stack's slots from their initial values."
  )
  for name in stack.table_names:
    if _signature(stored[name]) != _signature(specs):
      return (
          f"stack {stack.name!r}: the target optimizer{_named(target)} keeps slots"
          f" {_signature(specs)} but the checkpoint {reader.item} stores table {name!r}"
          f"{_trained_with(stored_optimizers[name])} with slots {_signature(stored[name])}"
          f" (name, width).{advice}"
      )
  for name in stack.table_names:
    if target is not None and stored_optimizers[name] not in (None, target):
      return (
          f"stack {stack.name!r}: the target optimizer is {target!r} but the checkpoint"
          f" {reader.item} stores table {name!r} with the slots of optimizer"
          f" {stored_optimizers[name]!r}. Both keep slots {_signature(specs)} (name, width), but"
          f" not the same quantities in them.{advice}"
      )
  conflict = None if target is not None else _optimizers.conflict(stored_optimizers)
  if conflict is not None:
    return (
        f"{_mixed_optimizers(reader, stack, conflict)} Stack them apart, or pass"
        " on_slot_mismatch='reset' to start this stack's slots from their initial values."
    )
  return None


def _named(optimizer: str | None) -> str:
  return "" if optimizer is None else f" {optimizer!r}"


def _trained_with(optimizer: str | None) -> str:
  return "" if optimizer is None else f" (trained with {optimizer!r})"


def _mixed_optimizers(reader, stack: StackLayout, conflict) -> str:
  (first, first_optimizer), (other, other_optimizer) = conflict
  return (
      f"stack {stack.name!r} puts tables {first!r} and {other!r} together, but the checkpoint"
      f" {reader.item} stores them with the slots of different optimizers"
      f" ({first_optimizer!r} vs {other_optimizer!r}): tables of one stack share one optimizer."
  )


def _common_slots(
    reader,
    stack: StackLayout,
    stored: dict[str, tuple[SlotSpec, ...]],
    stored_optimizers: dict[str, str | None],
) -> tuple[SlotSpec, ...]:
  first_name, first = next(iter(stored.items()))
  for name, specs in stored.items():
    if tuple(specs) != tuple(first):
      raise SlotMismatchError(
          f"stack {stack.name!r} puts tables {first_name!r} and {name!r} together, but the"
          f" checkpoint {reader.item} stores them with different optimizer slots:"
          f" {first_name!r}{_trained_with(stored_optimizers[first_name])} keeps"
          f" {_signature(first)}, {name!r}{_trained_with(stored_optimizers[name])} keeps"
          f" {_signature(specs)} (name, width; None: the table's dimension). Tables of one"
          f" stack share one optimizer. {_MIXED_ADVICE}"
      )
  conflict = _optimizers.conflict(stored_optimizers)
  if conflict is not None:
    raise SlotMismatchError(f"{_mixed_optimizers(reader, stack, conflict)} {_MIXED_ADVICE}")
  return tuple(first)


# Tables of two optimizers in one target stack: what a conversion or a restore can do.
_MIXED_ADVICE = (
    "Stack them apart (other stacking groups: `--groups` of `sc-checkpoint convert`). Only a"
    " restore can instead start the stack's slots anew, dropping the stored ones"
    " (EmbeddingRestore with the target's optimizers and on_slot_mismatch='reset')."
)


def _common_dtype(reader, stack: StackLayout, names, slot: str | None, wanted) -> np.dtype:
  dtypes = {name: reader.dtype(name, slot) for name in names}
  what = "tables" if slot is None else f"slot {slot!r}"
  if len(set(dtypes.values())) > 1:
    found = ", ".join(f"{name}: {dtype.name}" for name, dtype in dtypes.items())
    raise IncompatibleCheckpointError(
        f"stack {stack.name!r} puts together {what} stored with different dtypes ({found}); one"
        " stacked array has one dtype. Stack them apart or cast them before saving."
    )
  dtype = next(iter(dtypes.values()))
  if wanted is not None and np.dtype(wanted) != dtype:
    raise IncompatibleCheckpointError(
        f"stack {stack.name!r}: the checkpoint {reader.item} stores its {what} as"
        f" {dtype.name}, but {np.dtype(wanted).name} was requested. Convert the checkpoint"
        f" first (`sc-checkpoint convert SRC DST --table-dtype {np.dtype(wanted).name}`, or"
        " checkpoint.convert(..., table_dtype=...)), or restore with dtype=None and cast the"
        " arrays."
    )
  return dtype


def _placement(stack: StackLayout) -> tuple:
  return (
      stack.num_shards,
      stack.rows_per_shard,
      stack.padded_embedding_dim,
      tuple(
          (
              t.name,
              t.vocabulary_size,
              t.embedding_dim,
              t.padded_vocabulary_size,
              t.row_offset,
              t.shard_rotation,
          )
          for t in stack.tables
      ),
  )


def _same_placement_group(reader: CheckpointReader, stack: StackLayout) -> str | None:
  if reader.layout is None:
    return None
  source = reader.layout.stack_of_table(stack.tables[0].name)
  return source.name if _placement(source) == _placement(stack) else None


def build_block(
    reader: CheckpointReader,
    assembly: StackAssembly,
    slot: str | None,
    start: int,
    stop: int,
    out: np.ndarray | None = None,
) -> np.ndarray:
  """Rows [start, stop) of a target stack's table (slot None) or slot array.

  Written into `out` ([stop - start, width] of the array's dtype, contents
  ignored) when given, so that a caller can reuse its buffers; else into a
  new `host_buffer`.
  """
  width, dtype = assembly.width(slot), assembly.array_dtype(slot)
  shape = (stop - start, width)
  if out is None:
    out = host_buffer(shape, dtype)
  elif out.shape != shape or out.dtype != dtype:
    raise ValueError(
        f"build_block: out is {out.dtype}{list(out.shape)}, expected {dtype}{list(shape)}."
    )
  fill = 0.0 if slot is None else assembly.slot_spec(slot).initial_value
  if slot is not None and assembly.reset_slots:
    out.fill(fill)
    return out
  if assembly.same_placement_group is not None:
    return reader.read_block(assembly.same_placement_group, slot, start, stop, out=out)
  requests = []
  for index, table in enumerate(assembly.stack.tables):
    logical_width = reader.row_width(table.name, slot)
    for row, first, count in table_row_runs_in_block(assembly.stack, index, start, stop):
      requests.append((table.name, slot, first, assembly.stack.num_shards, count, row - start))
      if logical_width < width:  # Padding columns.
        out[row - start : row - start + count, logical_width:] = fill
  # Padding rows: those between the tables' runs (which do not overlap).
  runs = sorted((request[5], request[5] + request[4]) for request in requests)
  for gap_start, gap_stop in zip([0] + [b for _, b in runs], [a for a, _ in runs] + [stop - start]):
    if gap_start < gap_stop:
      out[gap_start:gap_stop] = fill
  reader.fill_strided_rows(out, requests)
  return out
