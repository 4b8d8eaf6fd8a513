"""Adam and LaProp, lazily applied to the touched rows only."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from sc_framework._renamed import use_instead
from sc_framework.optimizers._base import (
    BETAS_RENAMED,
    LearningRate,
    OptimizerSpec,
    SlotSpec,
    check_learning_rate,
    check_range,
)


def bias_correction(beta: float, t: jax.Array) -> jax.Array:
  """1 - beta^t in float32, as -expm1(t ln beta) with ln beta taken in float64.

  For beta near 1, 1 - beta**t in float32 cancels: with beta2 = 0.999 it is
  off by about 1.3e-5 relative at t = 1, while the moment update's 1 - beta2
  is exact, so v_hat = v / (1 - beta2^t) missed g^2 by about 90 ulps. This
  form is accurate to a few ulps for every t (beta = 0 gives 1).
  """
  t = jnp.asarray(t, jnp.float32)
  if beta == 0.0:
    return jnp.ones_like(t)
  return -jnp.expm1(t * jnp.float32(math.log(beta)))


def _check_betas(owner: str, beta1: float, beta2: float, epsilon: float) -> None:
  check_range(owner, "beta1", beta1, low=0.0, high=1.0, high_inclusive=False)
  check_range(owner, "beta2", beta2, low=0.0, high=1.0, high_inclusive=False)
  check_range(owner, "epsilon", epsilon, low=0.0, low_inclusive=False)


@dataclasses.dataclass(frozen=True, repr=False)
class Adam(OptimizerSpec):
  r"""Lazy Adam: moments of touched rows only, bias correction from the step.

  With t = step + 1 (the global number of updates including this one), for
  each touched row i with summed gradient g_i (element-wise operations):

    m_i <- beta1 * m_i + (1 - beta1) * g_i
    v_i <- beta2 * v_i + (1 - beta2) * g_i^2
    m_hat = m_i / (1 - beta1^t),   v_hat = v_i / (1 - beta2^t)
    w_i <- w_i - lr(step) * m_hat / (sqrt(v_hat) + epsilon)        (default)
    w_i <- w_i - lr(step) * m_hat / sqrt(v_hat + epsilon^2)        sum_inside_sqrt

  Rows absent from a batch keep their moments (no decay): the "lazy" Adam of
  sparse embedding libraries.

  Both forms take epsilon relative to the bias-corrected v_hat. TPUEmbedding
  applies epsilon to the uncorrected v and folds the bias correction into
  the rate, lr * sqrt(1 - beta2^t) / (1 - beta1^t): its update is the one
  above with epsilon / sqrt(1 - beta2^t) in place of epsilon (and
  epsilon^2 / (1 - beta2^t) in place of epsilon^2), which differs only while
  beta2^t is not negligible and only by a term of the order of epsilon.

  Args:
    learning_rate: a float > 0 or a function of the step.
    beta1, beta2: moment decays in [0, 1).
    epsilon: added to the denominator (or, squared, inside the root), > 0.
    sum_inside_sqrt: take epsilon inside the square root as above (as
      TPUEmbedding v3's `use_sum_inside_sqrt`).
  """

  learning_rate: LearningRate = 0.001
  beta1: float = 0.9
  beta2: float = 0.999
  epsilon: float = 1e-8
  sum_inside_sqrt: bool = False
  kind = "adam"
  renamed_arguments = {
      **BETAS_RENAMED,
      "use_sum_inside_sqrt": use_instead("sum_inside_sqrt", "use_sum_inside_sqrt"),
  }

  def __post_init__(self):
    super().__post_init__()
    check_learning_rate("Adam", self.learning_rate)
    _check_betas("Adam", self.beta1, self.beta2, self.epsilon)
    if not isinstance(self.sum_inside_sqrt, bool):
      raise TypeError(f"Adam: sum_inside_sqrt must be a bool, got {self.sum_inside_sqrt!r}.")

  def slots(self) -> tuple[SlotSpec, ...]:
    return (SlotSpec("mu", None, 0.0), SlotSpec("nu", None, 0.0, minimum=0.0))

  def update_rule(self, rows, grads, slots, step, row_dims):
    del row_dims
    lr = self.learning_rate_at(step)
    t = (jnp.asarray(step) + 1).astype(jnp.float32)
    mu = self.beta1 * slots["mu"] + (1.0 - self.beta1) * grads
    nu = self.beta2 * slots["nu"] + (1.0 - self.beta2) * grads * grads
    mu_hat = mu / bias_correction(self.beta1, t)
    nu_hat = nu / bias_correction(self.beta2, t)
    if self.sum_inside_sqrt:
      denominator = jnp.sqrt(nu_hat + self.epsilon * self.epsilon)
    else:
      denominator = jnp.sqrt(nu_hat) + self.epsilon
    new_rows = rows - lr * mu_hat / denominator
    return new_rows, {"mu": mu, "nu": nu}


@dataclasses.dataclass(frozen=True, repr=False)
class LaProp(OptimizerSpec):
  r"""LaProp: momentum over the RMS-normalised gradient (Ziyin et al., 2020).

  With t = step + 1, for each touched row i with summed gradient g_i:

    v_i <- beta2 * v_i + (1 - beta2) * g_i^2
    m_i <- beta1 * m_i + (1 - beta1) * g_i / (sqrt(v_i / (1 - beta2^t)) + epsilon)
    w_i <- w_i - lr(step) * m_i / (1 - beta1^t)

  Args:
    learning_rate: a float > 0 or a function of the step.
    beta1, beta2: decays in [0, 1).
    epsilon: added to the denominator, > 0.

  References:
    Ziyin, Wang, Ueda: "LaProp: Separating Momentum and Adaptivity in Adam",
    arXiv:2002.04839.
  """

  learning_rate: LearningRate = 0.001
  beta1: float = 0.9
  beta2: float = 0.95
  epsilon: float = 1e-8
  kind = "laprop"
  renamed_arguments = BETAS_RENAMED

  def __post_init__(self):
    super().__post_init__()
    check_learning_rate("LaProp", self.learning_rate)
    _check_betas("LaProp", self.beta1, self.beta2, self.epsilon)

  def slots(self) -> tuple[SlotSpec, ...]:
    return (SlotSpec("mu", None, 0.0), SlotSpec("nu", None, 0.0, minimum=0.0))

  def update_rule(self, rows, grads, slots, step, row_dims):
    del row_dims
    lr = self.learning_rate_at(step)
    t = (jnp.asarray(step) + 1).astype(jnp.float32)
    nu = self.beta2 * slots["nu"] + (1.0 - self.beta2) * grads * grads
    nu_hat = nu / bias_correction(self.beta2, t)
    mu = self.beta1 * slots["mu"] + (1.0 - self.beta1) * grads / (jnp.sqrt(nu_hat) + self.epsilon)
    new_rows = rows - lr * mu / bias_correction(self.beta1, t)
    return new_rows, {"mu": mu, "nu": nu}
