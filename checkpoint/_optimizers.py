"""Which optimizer a checkpoint's slot variables belong to.

A slot is a named array whose meaning is its optimizer's: Adam and LaProp both
keep 'mu' and 'nu' as wide as the table, but LaProp's 'mu' averages gradients
already divided by sqrt(nu), Adam's the raw gradients; a custom rule may name
its slots like any built-in one. Names and widths alone therefore cannot tell
whether a checkpoint's slots fit an optimizer. So the manifest records, per
group, the optimizer that wrote its slots (`optimizer_name`: its `kind`, plus
the name of a `CustomOptimizer`), and a restore into an optimizer of another
name raises `SlotMismatchError` (unless its slots are reset). Hyperparameters
are not part of the name: the same optimizer with another learning rate or
initial accumulator restores as it is, a normal fine-tuning change.

The name is optional: checkpoints written before it was recorded, or saved with
`slot_specs` alone, have none (None), and restore as before, their slots
matched by name and width only. A restore that passes `slot_specs` alone is
not checked either.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sc_framework.optimizers import CustomOptimizer, OptimizerSpec, SlotSpec


def optimizer_name(optimizer: OptimizerSpec) -> str:
  """The name a checkpoint records for the optimizer owning its slots.

  `optimizer.kind` ('adam', 'laprop', ...); for a `CustomOptimizer`,
  'custom:<name>', its name being part of the rule's identity.
  """
  if isinstance(optimizer, CustomOptimizer):
    return f"{optimizer.kind}:{optimizer.name}"
  return optimizer.kind


def resolve(
    what: str,
    stacks: Sequence[str],
    slot_specs: Mapping[str, Sequence[SlotSpec]] | None,
    optimizers: Mapping[str, OptimizerSpec] | None,
) -> tuple[dict[str, tuple[SlotSpec, ...]] | None, dict[str, str]]:
  """The slot declarations and optimizer names that save or restore args give.

  Args:
    what: how errors name the args ('EmbeddingSave', 'EmbeddingRestore').
    stacks: the stacks of the args' layout.
    slot_specs: stack -> slot declarations, or None.
    optimizers: stack -> optimizer, or None. A stack it names gets the
      optimizer's slots() (slot_specs may name it too, with the same slots)
      and its `optimizer_name`.

  Returns:
    (stack -> slots, None when both arguments are None; stack -> name, for
    the stacks of `optimizers`).

  Raises:
    TypeError: an optimizer is not an OptimizerSpec.
    ValueError: optimizers names a stack the layout lacks, or slot_specs
      declares other slots for a stack than its optimizer keeps.
  """
  if optimizers is None:
    return (None if slot_specs is None else dict(slot_specs)), {}
  unknown = sorted(set(optimizers) - set(stacks))
  if unknown:
    raise ValueError(
        f"{what}: optimizers names stacks {unknown} that the layout does not have; its stacks"
        f" are {sorted(stacks)}."
    )
  specs = dict(slot_specs or {})
  names = {}
  for stack, optimizer in optimizers.items():
    if not isinstance(optimizer, OptimizerSpec):
      raise TypeError(
          f"{what}: optimizers[{stack!r}] must be a sparse optimizer spec (an OptimizerSpec such"
          f" as Adagrad(...)), got {type(optimizer).__name__} {optimizer!r}."
      )
    slots = optimizer.slots()
    if stack in specs and tuple(specs[stack]) != slots:
      raise ValueError(
          f"{what}: slot_specs[{stack!r}] declares {list(specs[stack])} but optimizers[{stack!r}]"
          f" ({optimizer!r}) keeps {list(slots)}. Pass optimizers alone: the slots are its"
          " slots()."
      )
    specs[stack] = slots
    names[stack] = optimizer_name(optimizer)
  return specs, names


def common_name(names: Mapping[str, str | None]) -> str | None:
  """The optimizer name shared by tables: None unless every one is known and equal."""
  values = set(names.values())
  return values.pop() if len(values) == 1 and None not in values else None


def conflict(names: Mapping[str, str | None]) -> tuple[tuple[str, str], tuple[str, str]] | None:
  """Two (table, name) pairs whose known names differ, or None (unknown names agree with all)."""
  known = [(table, name) for table, name in names.items() if name is not None]
  for table, name in known[1:]:
    if name != known[0][1]:
      return known[0], (table, name)
  return None


def unrecorded_beside(names: Mapping[str, str | None]) -> tuple[tuple[str, str], str] | None:
  """A (table, name) pair with a known name and a table without one, or None.

  Tables in both sets cannot be merged into one stack with a faithful record:
  dropping the name loses the check of the known table's slots, keeping it
  claims the other table's slots for an optimizer that may not have written
  them (`_convert.convert` refuses such a stack).
  """
  known = next(((table, name) for table, name in names.items() if name is not None), None)
  unknown = next((table for table, name in names.items() if name is None), None)
  return None if known is None or unknown is None else (known, unknown)
