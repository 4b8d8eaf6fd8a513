"""The Adagrad family: element-wise, row-wise and with momentum."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from sc_framework.optimizers._base import (
    INITIAL_ACCUMULATOR_RENAMED,
    LearningRate,
    OptimizerSpec,
    SlotSpec,
    check_learning_rate,
    check_range,
)


def _check_denominator(owner: str, initial_accumulator: float, eps: float) -> None:
  """Adagrad's sqrt(a) + eps must be > 0 for a row whose gradient is still zero."""
  check_range(owner, "initial_accumulator", initial_accumulator, low=0.0)
  check_range(owner, "eps", eps, low=0.0)
  if initial_accumulator == 0 and eps == 0:
    raise ValueError(
        f"{owner}: initial_accumulator ({initial_accumulator!r}) and eps ({eps!r}) are both 0,"
        " so a row whose first gradient is zero divides by zero. Set eps > 0 (e.g. 1e-8)."
    )


@dataclasses.dataclass(frozen=True, repr=False)
class Adagrad(OptimizerSpec):
  r"""Adagrad with one accumulator per table element.

  For each touched row i with summed gradient g_i (element-wise operations):

    a_i <- a_i + g_i^2
    w_i <- w_i - lr(step) * g_i / (sqrt(a_i) + eps)

  With initial_accumulator=0 and eps > 0 this is FBGEMM's / TorchRec's exact
  (element-wise) Adagrad; with eps=0 (the default) it is the original
  algorithm of Duchi et al. and TensorFlow's, whose first denominator is
  sqrt(initial_accumulator).

  Args:
    learning_rate: a float > 0 or a function of the step.
    initial_accumulator: initial a_i, >= 0.
    eps: added to the denominator, >= 0; initial_accumulator and eps may not
      both be 0 (a zero gradient would divide 0 by 0).
  """

  learning_rate: LearningRate = 0.01
  initial_accumulator: float = 0.1
  eps: float = 0.0
  kind = "adagrad"
  renamed_arguments = INITIAL_ACCUMULATOR_RENAMED

  def __post_init__(self):
    super().__post_init__()
    check_learning_rate("Adagrad", self.learning_rate)
    _check_denominator("Adagrad", self.initial_accumulator, self.eps)

  def slots(self) -> tuple[SlotSpec, ...]:
    return (SlotSpec("accumulator", None, self.initial_accumulator, minimum=0.0),)

  def update_rule(self, rows, grads, slots, step, row_dims):
    del row_dims
    lr = self.learning_rate_at(step)
    accumulator = slots["accumulator"] + grads * grads
    new_rows = rows - lr * grads / (jnp.sqrt(accumulator) + self.eps)
    return new_rows, {"accumulator": accumulator}


@dataclasses.dataclass(frozen=True, repr=False)
class RowWiseAdagrad(OptimizerSpec):
  r"""Adagrad with one accumulator scalar per embedding row.

  One scalar per row instead of per element cuts optimizer memory by a factor
  of the embedding dimension. For each touched row i with summed gradient
  g_i in R^d (d the table's logical dimension):

    a_i <- a_i + ||g_i||^2 / d
    w_i <- w_i - lr(step) * g_i / (sqrt(a_i) + eps)

  Args:
    learning_rate: a float > 0 or a function of the step.
    initial_accumulator: initial a_i, >= 0 (0 with eps > 0 is FBGEMM's /
      TorchRec's row-wise Adagrad).
    eps: added to the denominator for stability, >= 0; initial_accumulator
      and eps may not both be 0.
  """

  learning_rate: LearningRate = 0.01
  initial_accumulator: float = 0.1
  eps: float = 1e-8
  kind = "rowwise_adagrad"
  renamed_arguments = INITIAL_ACCUMULATOR_RENAMED

  def __post_init__(self):
    super().__post_init__()
    check_learning_rate("RowWiseAdagrad", self.learning_rate)
    _check_denominator("RowWiseAdagrad", self.initial_accumulator, self.eps)

  def slots(self) -> tuple[SlotSpec, ...]:
    return (SlotSpec("accumulator", 1, self.initial_accumulator, minimum=0.0),)

  def update_rule(self, rows, grads, slots, step, row_dims):
    lr = self.learning_rate_at(step)
    mean_square = jnp.sum(grads * grads, axis=1, keepdims=True) / row_dims[:, None].astype(grads.dtype)
    accumulator = slots["accumulator"] + mean_square
    new_rows = rows - lr * grads / (jnp.sqrt(accumulator) + self.eps)
    return new_rows, {"accumulator": accumulator}


@dataclasses.dataclass(frozen=True, repr=False)
class AdagradMomentum(OptimizerSpec):
  r"""Adagrad (or RMSProp-style decay) with heavy-ball or Nesterov momentum.

  For each touched row i with summed gradient g_i (element-wise operations):

    a_i <- a_i + g_i^2                              if beta2 == 1
    a_i <- beta2 * a_i + (1 - beta2) * g_i^2        otherwise
    u_i <- g_i * (a_i + epsilon)^(-1/exponent)
    m_i <- momentum * m_i + u_i
    w_i <- w_i - lr(step) * (momentum * m_i + u_i)  if use_nesterov
    w_i <- w_i - lr(step) * m_i                     otherwise

  Args:
    learning_rate: a float > 0 or a function of the step.
    momentum: the momentum coefficient, in [0, 1).
    beta2: accumulator decay, in (0, 1]; 1 gives Adagrad's running sum.
    epsilon: added to the accumulator inside the root, > 0 (as in the
      SparseCore stack's and TensorFlow's TPU embedding AdagradMomentum, so
      their tables and slots train on identically here).
    exponent: the root taken of the accumulator, > 0 (2 is a square root).
    use_nesterov: Nesterov momentum instead of heavy-ball.
    initial_accumulator: initial a_i, >= 0.
  """

  learning_rate: LearningRate = 0.01
  momentum: float = 0.9
  beta2: float = 1.0
  epsilon: float = 1e-10
  exponent: float = 2.0
  use_nesterov: bool = False
  initial_accumulator: float = 0.1
  kind = "adagrad_momentum"
  renamed_arguments = INITIAL_ACCUMULATOR_RENAMED

  def __post_init__(self):
    super().__post_init__()
    owner = "AdagradMomentum"
    check_learning_rate(owner, self.learning_rate)
    check_range(owner, "momentum", self.momentum, low=0.0, high=1.0, high_inclusive=False)
    check_range(owner, "beta2", self.beta2, low=0.0, high=1.0, low_inclusive=False)
    check_range(owner, "epsilon", self.epsilon, low=0.0, low_inclusive=False)
    check_range(owner, "exponent", self.exponent, low=0.0, low_inclusive=False)
    check_range(owner, "initial_accumulator", self.initial_accumulator, low=0.0)
    if not isinstance(self.use_nesterov, bool):
      raise TypeError(f"{owner}: use_nesterov must be a bool, got {self.use_nesterov!r}.")

  def slots(self) -> tuple[SlotSpec, ...]:
    return (
        SlotSpec("accumulator", None, self.initial_accumulator, minimum=0.0),
        SlotSpec("momentum", None, 0.0),
    )

  def update_rule(self, rows, grads, slots, step, row_dims):
    del row_dims
    lr = self.learning_rate_at(step)
    if self.beta2 == 1.0:
      accumulator = slots["accumulator"] + grads * grads
    else:
      accumulator = self.beta2 * slots["accumulator"] + (1.0 - self.beta2) * grads * grads
    scaled = grads * jnp.power(accumulator + self.epsilon, -1.0 / self.exponent)
    momentum = self.momentum * slots["momentum"] + scaled
    update = self.momentum * momentum + scaled if self.use_nesterov else momentum
    new_rows = rows - lr * update
    return new_rows, {"accumulator": accumulator, "momentum": momentum}
