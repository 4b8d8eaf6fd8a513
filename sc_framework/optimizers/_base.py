"""The optimizer interface: slot declarations and the row-wise update contract.

A sparse optimizer updates only the rows touched by a batch. Every optimizer is
a frozen dataclass that carries its hyperparameters (so two tables with equal
optimizers can share a stack) and the options shared by all optimizers
(gradient clipping, weight decay, weight clipping; see `_options`). Its
subclass implements the rule alone,

  update_rule(rows, grads, slots, step, row_dims) -> (new_rows, new_slots)

and the base class composes it with the options into

  apply(rows, grads, slots, step, row_dims) -> (new_rows, new_slots)

on a gathered block of K rows:
  rows:     [K, D'] the current rows (D' is the padded dimension of the stack);
  grads:    [K, D'] the gradient summed over every occurrence of the row in the
            batch (padding columns carry zeros);
  slots:    dict slot name -> [K, width] the rows' slot variables;
  step:     int32 scalar, the number of updates applied before this one;
  row_dims: [K] int32, the logical embedding dimension of each row's table
            (needed by rules that average over the row, e.g. row-wise Adagrad).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar, Union

import jax
import jax.numpy as jnp
import numpy as np

from sc_framework._renamed import refuse_renamed, use_instead
from sc_framework._scalars import python_scalar_fields
from sc_framework.optimizers import _options

LearningRate = Union[float, Callable[[jax.Array], jax.Array]]
"""A float, or a function of the step (int32 scalar) returning the rate."""


@dataclasses.dataclass(frozen=True)
class SlotSpec:
  """Declares one slot variable of a sparse optimizer.

  Attributes:
    name: the slot's name, unique within its optimizer.
    width: the number of values the slot keeps per embedding row: `None`
      means one per embedding column (the slot is shaped like the table,
      [V, D], padded to [V_s, D'] when stacked); an int w means [V, w].
    initial_value: the value every entry starts with.
    minimum: the smallest value an entry may hold, or None: 0.0 for a sum of
      squared gradients (an accumulator), whose negative values the update
      would turn into NaN. `replace_tables` refuses a value below it. Not
      part of the slot's identity (equality, checkpoints).
  """

  name: str
  width: int | None = None
  initial_value: float = 0.0
  minimum: float | None = dataclasses.field(default=None, compare=False)

  def __post_init__(self):
    python_scalar_fields(self)
    if not self.name or not isinstance(self.name, str):
      raise ValueError(f"slot name must be a non-empty string, got {self.name!r}.")
    if self.width is not None and (
        isinstance(self.width, bool) or not isinstance(self.width, int) or self.width <= 0
    ):
      raise ValueError(
          f"slot {self.name!r}: width must be None (one value per embedding column)"
          f" or a positive int, got {self.width!r}."
      )
    if (
        isinstance(self.initial_value, bool)
        or not isinstance(self.initial_value, (int, float))
        or not math.isfinite(self.initial_value)
    ):
      raise ValueError(
          f"slot {self.name!r}: initial_value must be finite, got {self.initial_value!r}."
      )
    if self.minimum is not None and not (
        isinstance(self.minimum, (int, float)) and not isinstance(self.minimum, bool)
        and math.isfinite(self.minimum) and self.minimum <= self.initial_value):
      raise ValueError(
          f"slot {self.name!r}: minimum must be None or a finite number no greater than"
          f" initial_value {self.initial_value!r}, got {self.minimum!r}."
      )

  def stacked_width(self, padded_embedding_dim: int) -> int:
    """Columns of this slot in a stack whose padded dimension is D'."""
    return padded_embedding_dim if self.width is None else self.width


_RENAMED_OPTIONS = {
    "clip_gradient_min": "pass clipvalue=(min, max) (None for an unbounded side).",
    "clip_gradient_max": "pass clipvalue=(min, max) (None for an unbounded side).",
    "lazy_adam": ("every optimizer here updates only the rows a batch touches (as"
                  " lazy_adam=True does); updating every row each step is not offered."),
    "use_gradient_accumulation": ("not an option here: a row's update takes the sum of"
                                  " its gradients over the batch, once per step."),
}
INITIAL_ACCUMULATOR_RENAMED = {
    "initial_accumulator_value": use_instead("initial_accumulator", "initial_accumulator_value"),
}
BETAS_RENAMED = {
    "beta_1": use_instead("beta1", "beta_1"),
    "beta_2": use_instead("beta2", "beta_2"),
}


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class OptimizerSpec:
  """Base class of the sparse optimizer specs (frozen dataclasses).

  Subclasses define `kind`, `slots()` and `update_rule()`; `learning_rate` is
  a field of every subclass. The keyword-only fields below are shared by every
  optimizer and applied around its rule, in the order of the `apply`
  docstring. Their names are those of TPUEmbedding v3 where it has the option.

  Attributes:
    clipvalue: clip each element of the summed row gradient to [-c, c] (a
      float c > 0) or to [min, max] (a pair, None for an unbounded side; the
      range must contain 0). None (default): no clipping.
    row_clipnorm: rescale each summed row gradient g_i whose L2 norm exceeds
      c > 0 to norm c: g_i * min(1, c / ||g_i||). None (default): no clipping.
    weight_decay_factor: decoupled weight decay f >= 0 of the touched rows,
      w <- w - lambda * w_before, after the rule. 0 (default): no decay.
    multiply_weight_decay_factor_by_learning_rate: lambda = f * lr(step)
      instead of f.
    clip_weight_min, clip_weight_max: clip the updated rows' elements to
      [clip_weight_min, clip_weight_max] after the update; None (default)
      leaves that side unbounded.
  """

  kind: ClassVar[str] = "abstract"
  # Other libraries' names of this optimizer's arguments -> what to pass here.
  renamed_arguments: ClassVar[dict[str, str]] = {}

  clipvalue: _options.ClipValue = None
  row_clipnorm: float | None = None
  weight_decay_factor: float = 0.0
  multiply_weight_decay_factor_by_learning_rate: bool = False
  clip_weight_min: float | None = None
  clip_weight_max: float | None = None

  def __new__(cls, *args, **kwargs):
    del args  # The dataclass __init__ takes them.
    own = {field.name for field in dataclasses.fields(cls)}  # A subclass may have such a field.
    renamed = {**_RENAMED_OPTIONS, **cls.renamed_arguments}
    refuse_renamed(cls.__name__, kwargs, {k: v for k, v in renamed.items() if k not in own})
    return super().__new__(cls)

  def __post_init__(self):
    python_scalar_fields(self)
    owner = self.owner_name()
    object.__setattr__(self, "clipvalue", _options.normalize_clipvalue(owner, self.clipvalue))
    _options.check_options(
        owner,
        row_clipnorm=self.row_clipnorm,
        weight_decay_factor=self.weight_decay_factor,
        multiply_weight_decay_factor_by_learning_rate=self.multiply_weight_decay_factor_by_learning_rate,
        clip_weight_min=self.clip_weight_min,
        clip_weight_max=self.clip_weight_max,
    )

  def __repr__(self) -> str:
    """The optimizer's own fields, then only the shared options that are set."""
    shared = {field.name for field in dataclasses.fields(OptimizerSpec)}
    own = [field.name for field in dataclasses.fields(self) if field.repr and field.name not in shared]
    names = own + list(self.options_set())
    return f"{type(self).__name__}({', '.join(f'{name}={getattr(self, name)!r}' for name in names)})"

  def owner_name(self) -> str:
    """How error messages name this optimizer."""
    return type(self).__name__

  def slots(self) -> tuple[SlotSpec, ...]:
    """The slot variables this optimizer keeps, in a fixed order."""
    raise NotImplementedError

  def update_rule(
      self,
      rows: jax.Array,
      grads: jax.Array,
      slots: dict[str, jax.Array],
      step: jax.Array,
      row_dims: jax.Array,
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The optimizer's own rule on already clipped gradients; see the module docstring.

    May return rows and slots in a wider dtype; `apply` casts them back.
    """
    raise NotImplementedError

  def apply(
      self,
      rows: jax.Array,
      grads: jax.Array,
      slots: dict[str, jax.Array],
      step: jax.Array,
      row_dims: jax.Array,
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The full row-wise update: clip the gradients, rule, decay, clip the weights.

    See `sc_framework.optimizers._options` for the exact order and formulas.
    Rows and slots keep their dtypes.
    """
    grads = _options.clip_gradients(grads, self.clipvalue, self.row_clipnorm)
    new_rows, new_slots = self.update_rule(rows, grads, slots, step, row_dims)
    new_rows = _options.decay_and_clip_weights(
        new_rows,
        rows,
        self.learning_rate_at(step),
        row_dims,
        weight_decay_factor=self.weight_decay_factor,
        multiply_weight_decay_factor_by_learning_rate=self.multiply_weight_decay_factor_by_learning_rate,
        clip_weight_min=self.clip_weight_min,
        clip_weight_max=self.clip_weight_max,
    )
    return new_rows.astype(rows.dtype), {k: v.astype(slots[k].dtype) for k, v in new_slots.items()}

  def options_set(self) -> tuple[str, ...]:
    """The names of the shared options that differ from their defaults.

    A backend whose fused update implements the rule alone may use it only
    when this is empty.
    """
    return tuple(
        field.name
        for field in dataclasses.fields(OptimizerSpec)
        if getattr(self, field.name) != field.default
    )

  def learning_rate_at(self, step: jax.Array) -> jax.Array:
    """The learning rate for the update applied after `step` updates."""
    return resolve_learning_rate(self.learning_rate, step, self.owner_name())

  def hyperparameters(self) -> dict[str, Any]:
    """The hyperparameters as a JSON-friendly dict (callables by name)."""
    out: dict[str, Any] = {"kind": self.kind}
    for field in dataclasses.fields(self):  # type: ignore[arg-type]
      value = getattr(self, field.name)
      if callable(value):
        value = f"<function {getattr(value, '__qualname__', repr(value))}>"
      out[field.name] = value
    return out


def resolve_learning_rate(learning_rate: LearningRate, step: jax.Array,
                          owner: str = "optimizer") -> jax.Array:
  """Evaluates a float or step-function learning rate at `step` as a float32 scalar.

  Raises:
    ValueError: a schedule returned something other than a scalar (one rate
      for every row of the step).
  """
  if callable(learning_rate):
    try:
      rate = jnp.asarray(learning_rate(step), jnp.float32)
    except Exception as error:
      error.add_note(f"(in {owner}'s learning-rate schedule, called with the step: the number"
                     " of updates applied so far, an integer scalar)")
      if isinstance(error, jax.errors.ConcretizationTypeError):  # a Python `if step < ...`
        error.add_note("The step is a traced array inside the jitted update, so the schedule"
                       " cannot branch on it in Python: use jnp.where(step < n, a, b) or an"
                       " optax schedule (optax.linear_schedule, optax.join_schedules).")
      raise
    if rate.shape != ():
      raise ValueError(
          f"{owner}: the learning-rate schedule returned shape {rate.shape}; it"
          " must return a scalar (one rate for every row of the step)."
      )
    return rate
  return jnp.asarray(learning_rate, jnp.float32)


def check_learning_rate(owner: str, learning_rate: LearningRate) -> None:
  """Raises ValueError unless the rate is a callable or a finite float > 0."""
  if callable(learning_rate):
    return
  if isinstance(learning_rate, bool) or not isinstance(learning_rate, (int, float)):
    raise TypeError(
        f"{owner}: learning_rate must be a float or a function of the step,"
        f" got {type(learning_rate).__name__} {learning_rate!r}."
    )
  if not (math.isfinite(learning_rate) and learning_rate > 0):
    raise ValueError(f"{owner}: learning_rate must be finite and > 0, got {learning_rate!r}.")


def check_schedule_at_start(owner: str, learning_rate: LearningRate) -> None:
  """Raises ValueError unless a schedule's rate at step 0 is a finite float >= 0.

  A schedule runs inside the jitted update, where its values cannot be
  checked; a plan evaluates it once on the host (also when made under a
  trace), so a schedule that returns NaN or a negative rate (gradient ascent)
  from the start is refused by name before any table is written. A schedule
  whose rate depends on traced values (a rate swept under vmap, or passed
  into a jitted step) has no value here and is not checked. A float rate is
  checked where it is given.
  """
  if not callable(learning_rate):
    return
  with jax.ensure_compile_time_eval():  # a value also where a plan is made under jit
    try:
      rate = resolve_learning_rate(learning_rate, jnp.asarray(0, jnp.int32), owner)
    except jax.errors.ConcretizationTypeError:  # it branches on a traced value
      return
    if isinstance(rate, jax.core.Tracer):  # it computes with traced values
      return
    value = np.float32(rate)
  if not (np.isfinite(value) and value >= 0):
    raise ValueError(
        f"{owner}: the learning-rate schedule returns {value!s} at step 0; a rate must be"
        " finite and >= 0 (0 only where a warm-up starts)."
    )


def check_range(
    owner: str,
    name: str,
    value: float,
    *,
    low: float | None = None,
    high: float | None = None,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
) -> None:
  """Raises ValueError naming the hyperparameter when `value` is out of range."""
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
    raise ValueError(f"{owner}: {name} must be a finite number, got {value!r}.")
  ok = True
  if low is not None:
    ok &= value >= low if low_inclusive else value > low
  if high is not None:
    ok &= value <= high if high_inclusive else value < high
  if not ok:
    if low is not None and high is not None:
      left = "[" if low_inclusive else "("
      right = "]" if high_inclusive else ")"
      allowed = f"in {left}{low!r}, {high!r}{right}"
    elif low is not None:
      allowed = f"a finite number {'>=' if low_inclusive else '>'} {low!r}"
    else:
      allowed = f"a finite number {'<=' if high_inclusive else '<'} {high!r}"
    raise ValueError(f"{owner}: {name} must be {allowed}, got {value!r}.")
