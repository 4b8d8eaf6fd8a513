"""A user-written row-wise rule with declared slots."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp

from sc_framework.optimizers._base import OptimizerSpec, SlotSpec, check_learning_rate

RowUpdateFn = Callable[
    [jax.Array, jax.Array, dict[str, jax.Array], jax.Array],
    tuple[jax.Array, dict[str, jax.Array]],
]


@dataclasses.dataclass(frozen=True, repr=False)
class CustomOptimizer(OptimizerSpec):
  r"""A sparse optimizer defined by a user function.

  The function receives only the touched rows:

    update_fn(rows [K, D'], grads [K, D'], slots {name: [K, width]}, step)
      -> (new_rows [K, D'], new_slots {name: [K, width]})

  and must be traceable by JAX and row-wise (row k's result depends only on
  row k's inputs). Columns beyond a table's logical dimension carry zero
  gradients. What the function writes there is discarded in the rows, which
  keep zeros there (a lookup gathers whole D' rows: `stacked_lookup`'s
  padding columns stay zero), and has no meaning in the slots.

  Example:

    def signsgd(rows, grads, slots, step):
      return rows - 0.01 * jnp.sign(grads), slots

    CustomOptimizer("signsgd", signsgd)

  Args:
    name: a name for the rule; part of the optimizer's identity.
    update_fn: the row-wise rule above.
    slot_specs: the slot variables it keeps.
    learning_rate: not used by the rule (it owns its step size); it is the
      lr of `multiply_weight_decay_factor_by_learning_rate`.

  The shared options of `OptimizerSpec` (gradient clipping, weight decay,
  weight clipping) apply around `update_fn` as for every optimizer: it
  receives the clipped gradients.
  """

  name: str
  update_fn: RowUpdateFn
  slot_specs: tuple[SlotSpec, ...] = ()
  learning_rate: float = 1.0
  kind = "custom"

  def __post_init__(self):
    super().__post_init__()
    if not isinstance(self.name, str) or not self.name:
      raise ValueError(f"CustomOptimizer: name must be a non-empty string, got {self.name!r}.")
    if not callable(self.update_fn):
      raise TypeError(
          f"CustomOptimizer {self.name!r}: update_fn must be callable"
          " (rows, grads, slots, step) -> (rows, slots)."
      )
    slot_specs = tuple(self.slot_specs)
    for slot in slot_specs:
      if not isinstance(slot, SlotSpec):
        raise TypeError(f"CustomOptimizer {self.name!r}: slot_specs must hold SlotSpec, got {slot!r}.")
    names = [slot.name for slot in slot_specs]
    if len(set(names)) != len(names):
      raise ValueError(f"CustomOptimizer {self.name!r}: duplicate slot names in {names}.")
    object.__setattr__(self, "slot_specs", slot_specs)
    check_learning_rate(self.owner_name(), self.learning_rate)

  def owner_name(self) -> str:
    return f"CustomOptimizer {self.name!r}"

  def slots(self) -> tuple[SlotSpec, ...]:
    return self.slot_specs

  def update_rule(self, rows, grads, slots, step, row_dims):
    returned = self.update_fn(rows, grads, dict(slots), step)
    if not isinstance(returned, (tuple, list)) or len(returned) != 2:
      got = (f"{len(returned)} values" if isinstance(returned, (tuple, list))
             else f"a single value ({type(returned).__name__})")
      raise ValueError(
          f"CustomOptimizer {self.name!r}: update_fn returned {got}; it must return the pair"
          " (new_rows, new_slots), new_slots a dict of the declared slots ({} for none)."
      )
    new_rows, new_slots = returned
    if not isinstance(new_slots, Mapping):
      raise ValueError(
          f"CustomOptimizer {self.name!r}: update_fn returned new_slots as a"
          f" {type(new_slots).__name__}; it must be a dict of the declared slots"
          f" {sorted(slots)} ({{}} for none)."
      )
    if set(new_slots) != set(slots):
      raise ValueError(
          f"CustomOptimizer {self.name!r}: update_fn returned slots {sorted(new_slots)}"
          f" but the optimizer declares {sorted(slots)}."
      )
    self._check_output("rows", new_rows, rows)
    for name, value in new_slots.items():
      self._check_output(f"slot {name!r}", value, slots[name])
    logical = jnp.arange(rows.shape[1])[None, :] < row_dims[:, None]
    return jnp.where(logical, new_rows, jnp.zeros((), new_rows.dtype)), new_slots

  def _check_output(self, what: str, value, given) -> None:
    """update_fn must return each array in the shape it was given, as floats at least as
    wide: a broadcast or a cast would change every touched row silently."""
    shape, dtype = jnp.shape(value), jnp.result_type(value)
    if (shape != given.shape or not jnp.issubdtype(dtype, jnp.floating)
        or jnp.finfo(dtype).bits < jnp.finfo(given.dtype).bits):
      raise ValueError(
          f"CustomOptimizer {self.name!r}: update_fn returned {what} of shape {shape} and dtype"
          f" {dtype}, but was given {given.shape} {given.dtype} (one row per touched row): return"
          f" an array of that shape, in {given.dtype} or a wider float."
      )
