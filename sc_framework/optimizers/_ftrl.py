"""Follow-the-regularized-leader (FTRL-Proximal) on the touched rows."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from sc_framework._renamed import use_instead
from sc_framework.optimizers._base import (
    INITIAL_ACCUMULATOR_RENAMED,
    LearningRate,
    OptimizerSpec,
    SlotSpec,
    check_learning_rate,
    check_range,
)


@dataclasses.dataclass(frozen=True, repr=False)
class FTRL(OptimizerSpec):
  r"""FTRL-Proximal with L1/L2 regularisation (McMahan et al., 2013).

  Let p = -learning_rate_power (so p = 0.5 gives square roots), lr = lr(step).
  For each touched row i with summed gradient g_i (element-wise operations),
  accumulator n and linear term z:

    n' = n + g^2
    sigma = (n'^p - n^p) / lr
    z <- z + g - sigma * w
    w <- (sign(z) * l1 - z) / ((beta + n'^p) / lr + 2 * l2)   if |z| > l1
    w <- 0                                                   otherwise
    n <- n'

  These formulas divide by lr: a step whose rate is 0 (a schedule's warmup
  start or decayed end) skips the rule, leaving w, n and z as they are.

  With multiply_linear_by_learning_rate the linear term is kept scaled by lr
  (robust to a changing learning rate):

    z <- z + lr * g - (n'^p - n^p) * w
    w <- (sign(z) * l1 * lr - z) / (beta + n'^p + 2 * l2 * lr)   if |z| > l1 * lr
    w <- 0                                                       otherwise

  Args:
    learning_rate: a float > 0 or a function of the step.
    learning_rate_power: <= 0; -0.5 is the usual choice.
    l1, l2: regularisation strengths, >= 0.
    beta: added to the accumulator term of the denominator, >= 0.
    initial_accumulator: initial n, >= 0 (0 is TPUEmbedding's
      `allow_zero_accumulator`: an element whose n is still 0 has had only
      zero gradients, so z = 0 and its weight is the l1 branch's 0).
    multiply_linear_by_learning_rate: see above.

  References:
    McMahan et al.: "Ad Click Prediction: a View from the Trenches", KDD 2013.
  """

  learning_rate: LearningRate = 0.01
  learning_rate_power: float = -0.5
  l1: float = 0.0
  l2: float = 0.0
  beta: float = 0.0
  initial_accumulator: float = 0.1
  multiply_linear_by_learning_rate: bool = False
  kind = "ftrl"
  renamed_arguments = {
      **INITIAL_ACCUMULATOR_RENAMED,
      "l1_regularization_strength": use_instead("l1", "l1_regularization_strength"),
      "l2_regularization_strength": use_instead("l2", "l2_regularization_strength"),
      "initial_linear_value": "not an option here: the linear slot z starts at 0.",
  }

  def __post_init__(self):
    super().__post_init__()
    check_learning_rate("FTRL", self.learning_rate)
    check_range("FTRL", "learning_rate_power", self.learning_rate_power, high=0.0)
    check_range("FTRL", "l1", self.l1, low=0.0)
    check_range("FTRL", "l2", self.l2, low=0.0)
    check_range("FTRL", "beta", self.beta, low=0.0)
    check_range("FTRL", "initial_accumulator", self.initial_accumulator, low=0.0)
    if not isinstance(self.multiply_linear_by_learning_rate, bool):
      raise TypeError(
          "FTRL: multiply_linear_by_learning_rate must be a bool, got"
          f" {self.multiply_linear_by_learning_rate!r}."
      )

  def slots(self) -> tuple[SlotSpec, ...]:
    return (
        SlotSpec("accumulator", None, self.initial_accumulator, minimum=0.0),
        SlotSpec("linear", None, 0.0),
    )

  def update_rule(self, rows, grads, slots, step, row_dims):
    del row_dims
    lr = self.learning_rate_at(step)
    power = -self.learning_rate_power
    accumulator = slots["accumulator"]
    new_accumulator = accumulator + grads * grads
    root_new = jnp.power(new_accumulator, power)
    root_old = jnp.power(accumulator, power)
    if self.multiply_linear_by_learning_rate:
      linear = slots["linear"] + lr * grads - (root_new - root_old) * rows
      threshold = self.l1 * lr
      quadratic = self.beta + root_new + 2.0 * self.l2 * lr
    else:
      divisor = jnp.where(lr == 0, 1.0, lr)  # a rate of 0 skips the rule (below)
      linear = slots["linear"] + grads - (root_new - root_old) / divisor * rows
      threshold = self.l1
      quadratic = (self.beta + root_new) / divisor + 2.0 * self.l2
    # Tested as |z| <= threshold, so a NaN z (from a NaN gradient) gives a NaN weight,
    # as in every other rule, not a weight of 0 that hides it.
    new_rows = jnp.where(
        jnp.abs(linear) <= threshold,
        jnp.zeros_like(linear),
        (jnp.sign(linear) * threshold - linear) / quadratic,
    )
    if not self.multiply_linear_by_learning_rate:
      skip = lr == 0
      new_rows = jnp.where(skip, rows, new_rows)
      new_accumulator = jnp.where(skip, accumulator, new_accumulator)
      linear = jnp.where(skip, slots["linear"], linear)
    return new_rows, {"accumulator": new_accumulator, "linear": linear}
