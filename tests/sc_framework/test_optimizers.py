"""The sparse optimizers' update rules against textbook numpy references.

Every reference below is written from the published formulas (Duchi et al.
for Adagrad, Kingma & Ba for Adam, Ziyin et al. for LaProp, McMahan et al. and
the TensorFlow FTRL op for FTRL, the TPU embedding docs for row-wise Adagrad
and Adagrad with momentum), in float64 numpy, and never calls the code under
test. One conformance body runs every optimizer over several steps, seeds and
learning-rate kinds (a float and a function of the step), with and without
the options every optimizer shares (gradient clipping by value and by row
norm, decoupled weight decay, weight clipping), whose references are written
from the same formulas; then the real sparse update runs on 1 and 8 devices,
on every backend, against a numpy reference that sums duplicate ids first and
leaves untouched rows alone, and through a checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import checkpoint as ck
from sc_framework import FeatureSpec, TableSpec
from sc_framework.optimizers import (
    FTRL,
    SGD,
    Adagrad,
    AdagradMomentum,
    Adam,
    CustomOptimizer,
    LaProp,
    OptimizerSpec,
    RowWiseAdagrad,
    SlotSpec,
)
from sc_framework.preprocessing import preprocess
from sc_framework.primitives import (
    EmbeddingPlan,
    EmbeddingVariables,
    apply_embedding_gradients,
    apply_stacked_gradients,
    embedding_lookup,
    init_embedding_variables,
    stack_activations,
    stacked_lookup,
)
from sc_framework.primitives._row_ops import cpu_kernels_available
from sc_framework.stacking import unstack
from tests.numerics import assert_close, assert_same_bits

PADDED_DIM = 16
NUM_ROWS = 12
NUM_STEPS = 4
LOGICAL_DIMS = (16, 10, 3)  # tables of one stack may differ in their logical dim

State = dict[str, np.ndarray]
# (w [K, D'], g [K, D'], state, step, lr, d [K]) -> (w, state), all float64.
ReferenceStep = Callable[[np.ndarray, np.ndarray, State, int, float, np.ndarray], tuple]


def _schedule(step):
  """A learning rate that changes every step (traceable and plain-Python)."""
  return 0.05 / (1.0 + 0.5 * step)


def _lr_value(learning_rate, step: int) -> float:
  return float(learning_rate(step)) if callable(learning_rate) else float(learning_rate)


# --- textbook references ----------------------------------------------------


def _ref_sgd(w, g, state, step, lr, d):
  return w - lr * g, state


def _ref_adagrad(eps: float) -> ReferenceStep:
  def step_fn(w, g, state, step, lr, d):
    a = state["accumulator"] + g**2
    return w - lr * g / (np.sqrt(a) + eps), {"accumulator": a}

  return step_fn


def _ref_rowwise_adagrad(eps: float) -> ReferenceStep:
  def step_fn(w, g, state, step, lr, d):
    # One accumulator per row: the mean of g^2 over the table's logical columns.
    a = state["accumulator"] + (g**2).sum(axis=1, keepdims=True) / d[:, None]
    return w - lr * g / (np.sqrt(a) + eps), {"accumulator": a}

  return step_fn


def _ref_adagrad_momentum(momentum, beta2, epsilon, exponent, nesterov) -> ReferenceStep:
  def step_fn(w, g, state, step, lr, d):
    if beta2 == 1.0:
      a = state["accumulator"] + g**2
    else:
      a = beta2 * state["accumulator"] + (1 - beta2) * g**2
    u = g / (a + epsilon) ** (1.0 / exponent)  # epsilon inside the root
    m = momentum * state["momentum"] + u
    if nesterov:
      w = w - lr * (momentum * m + u)
    else:
      w = w - lr * m
    return w, {"accumulator": a, "momentum": m}

  return step_fn


def _ref_adam(beta1, beta2, epsilon, sum_inside_sqrt=False) -> ReferenceStep:
  def step_fn(w, g, state, step, lr, d):
    t = step + 1
    m = beta1 * state["mu"] + (1 - beta1) * g
    v = beta2 * state["nu"] + (1 - beta2) * g**2
    m_hat = m / (1 - beta1**t)
    v_hat = v / (1 - beta2**t)
    if sum_inside_sqrt:  # TPUEmbedding's use_sum_inside_sqrt: m / sqrt(v + eps^2)
      return w - lr * m_hat / np.sqrt(v_hat + epsilon**2), {"mu": m, "nu": v}
    return w - lr * m_hat / (np.sqrt(v_hat) + epsilon), {"mu": m, "nu": v}

  return step_fn


def _ref_laprop(beta1, beta2, epsilon) -> ReferenceStep:
  def step_fn(w, g, state, step, lr, d):
    t = step + 1
    v = beta2 * state["nu"] + (1 - beta2) * g**2
    m = beta1 * state["mu"] + (1 - beta1) * g / (np.sqrt(v / (1 - beta2**t)) + epsilon)
    return w - lr * m / (1 - beta1**t), {"mu": m, "nu": v}

  return step_fn


def _ref_ftrl(power, l1, l2, beta, multiply_linear) -> ReferenceStep:
  """FTRL-Proximal per coordinate (TensorFlow's ApplyFtrlV2 conventions: 2*l2)."""

  def step_fn(w, g, state, step, lr, d):
    n, z = state["accumulator"], state["linear"]
    n_new = n + g**2
    if multiply_linear:
      z = z + lr * g - (n_new**power - n**power) * w
      w = np.where(
          np.abs(z) > l1 * lr,
          (np.clip(z, -l1 * lr, l1 * lr) - z) / (beta + n_new**power + 2 * l2 * lr),
          0.0,
      )
    else:
      sigma = (n_new**power - n**power) / lr
      z = z + g - sigma * w
      w = np.where(
          np.abs(z) > l1, -(z - np.sign(z) * l1) / ((beta + n_new**power) / lr + 2 * l2), 0.0
      )
    return w, {"accumulator": n_new, "linear": z}

  return step_fn


# The custom rule: momentum SGD with a per-row update counter and a step decay.
def _custom_rule(rows, grads, slots, step):
  velocity = 0.5 * slots["velocity"] + grads
  count = slots["count"] + 1.0
  new_rows = rows - 0.1 / (1.0 + step) * velocity
  return new_rows, {"velocity": velocity, "count": count}


def _ref_custom(w, g, state, step, lr, d):
  v = 0.5 * state["velocity"] + g
  return w - 0.1 / (1.0 + step) * v, {"velocity": v, "count": state["count"] + 1.0}


_CUSTOM = CustomOptimizer(
    "momentum_with_count",
    _custom_rule,
    (SlotSpec("velocity", None, 0.0), SlotSpec("count", 1, 0.0)),
)


@dataclasses.dataclass(frozen=True)
class Case:
  """One optimizer configuration and its reference.

  Attributes:
    name: the test id.
    make: learning rate -> the optimizer under test.
    initial: slot name -> (width or None for per-column, initial value), stated
      from the hyperparameters (not read from the optimizer).
    reference: the textbook step.
    schedules: whether a function-of-step learning rate applies.
  """

  name: str
  make: Callable[[object], OptimizerSpec]
  initial: dict[str, tuple[int | None, float]]
  reference: ReferenceStep
  schedules: bool = True


CASES = (
    Case("sgd", lambda lr: SGD(lr), {}, _ref_sgd),
    Case(
        "adagrad",
        lambda lr: Adagrad(lr, initial_accumulator=0.1),
        {"accumulator": (None, 0.1)},
        _ref_adagrad(0.0),
    ),
    Case(
        "adagrad_eps",
        lambda lr: Adagrad(lr, initial_accumulator=0.1, eps=1e-2),
        {"accumulator": (None, 0.1)},
        _ref_adagrad(1e-2),
    ),
    Case(  # FBGEMM's / TorchRec's exact Adagrad: the accumulator starts at 0
        "adagrad_zero_init",
        lambda lr: Adagrad(lr, initial_accumulator=0.0, eps=1e-8),
        {"accumulator": (None, 0.0)},
        _ref_adagrad(1e-8),
    ),
    Case(
        "rowwise_adagrad",
        lambda lr: RowWiseAdagrad(lr, initial_accumulator=0.1, eps=1e-8),
        {"accumulator": (1, 0.1)},
        _ref_rowwise_adagrad(1e-8),
    ),
    Case(
        "rowwise_adagrad_zero_init",
        lambda lr: RowWiseAdagrad(lr, initial_accumulator=0.0, eps=1e-3),
        {"accumulator": (1, 0.0)},
        _ref_rowwise_adagrad(1e-3),
    ),
    Case(
        "adagrad_momentum",
        lambda lr: AdagradMomentum(lr, momentum=0.9),
        {"accumulator": (None, 0.1), "momentum": (None, 0.0)},
        _ref_adagrad_momentum(0.9, 1.0, 1e-10, 2.0, False),
    ),
    Case(
        "adagrad_momentum_nesterov",
        lambda lr: AdagradMomentum(lr, momentum=0.8, use_nesterov=True, initial_accumulator=0.3),
        {"accumulator": (None, 0.3), "momentum": (None, 0.0)},
        _ref_adagrad_momentum(0.8, 1.0, 1e-10, 2.0, True),
    ),
    Case(
        "adagrad_momentum_decay_exponent",
        lambda lr: AdagradMomentum(
            lr, momentum=0.5, beta2=0.9, epsilon=1e-6, exponent=4.0, initial_accumulator=0.05
        ),
        {"accumulator": (None, 0.05), "momentum": (None, 0.0)},
        _ref_adagrad_momentum(0.5, 0.9, 1e-6, 4.0, False),
    ),
    Case(
        "adam",
        lambda lr: Adam(lr, beta1=0.9, beta2=0.999, epsilon=1e-8),
        {"mu": (None, 0.0), "nu": (None, 0.0)},
        _ref_adam(0.9, 0.999, 1e-8),
    ),
    Case(
        "adam_other_betas",
        lambda lr: Adam(lr, beta1=0.5, beta2=0.9, epsilon=1e-3),
        {"mu": (None, 0.0), "nu": (None, 0.0)},
        _ref_adam(0.5, 0.9, 1e-3),
    ),
    Case(
        "adam_sum_inside_sqrt",
        lambda lr: Adam(lr, beta1=0.5, beta2=0.9, epsilon=1e-2, sum_inside_sqrt=True),
        {"mu": (None, 0.0), "nu": (None, 0.0)},
        _ref_adam(0.5, 0.9, 1e-2, sum_inside_sqrt=True),
    ),
    Case(
        "laprop",
        lambda lr: LaProp(lr, beta1=0.9, beta2=0.95, epsilon=1e-8),
        {"mu": (None, 0.0), "nu": (None, 0.0)},
        _ref_laprop(0.9, 0.95, 1e-8),
    ),
    Case(
        "ftrl",
        lambda lr: FTRL(lr, l1=0.01, l2=0.02, beta=0.1),
        {"accumulator": (None, 0.1), "linear": (None, 0.0)},
        _ref_ftrl(0.5, 0.01, 0.02, 0.1, False),
    ),
    Case(
        "ftrl_power",
        lambda lr: FTRL(lr, learning_rate_power=-0.25, l1=0.005, initial_accumulator=0.5),
        {"accumulator": (None, 0.5), "linear": (None, 0.0)},
        _ref_ftrl(0.25, 0.005, 0.0, 0.0, False),
    ),
    Case(
        "ftrl_multiply_linear",
        lambda lr: FTRL(lr, l1=0.01, l2=0.02, beta=0.1, multiply_linear_by_learning_rate=True),
        {"accumulator": (None, 0.1), "linear": (None, 0.0)},
        _ref_ftrl(0.5, 0.01, 0.02, 0.1, True),
    ),
    Case(  # TPUEmbedding's allow_zero_accumulator
        "ftrl_zero_init",
        lambda lr: FTRL(lr, l1=0.01, l2=0.02, initial_accumulator=0.0),
        {"accumulator": (None, 0.0), "linear": (None, 0.0)},
        _ref_ftrl(0.5, 0.01, 0.02, 0.0, False),
    ),
    Case(
        "custom",
        lambda lr: _CUSTOM,
        {"velocity": (None, 0.0), "count": (1, 0.0)},
        _ref_custom,
        schedules=False,  # the rule owns its step size (a function of the step)
    ),
)

_PARAMS = [
    pytest.param(case, lr, seed, id=f"{case.name}-{'schedule' if callable(lr) else 'float'}-{seed}")
    for case in CASES
    for lr in ((0.05, _schedule) if case.schedules else (0.05,))
    for seed in (0, 1, 2)
]


# --- the shared options: textbook references around any rule ----------------


def _ref_with_options(
    rule: ReferenceStep,
    *,
    clipvalue=None,
    row_clipnorm=None,
    weight_decay_factor=0.0,
    multiply_weight_decay_factor_by_learning_rate=False,
    clip_weight_min=None,
    clip_weight_max=None,
) -> ReferenceStep:
  """clip ||g_i|| to c, clip g to [lo, hi], rule, w -= lambda * w_before, clip w."""

  def step_fn(w, g, state, step, lr, d):
    if row_clipnorm is not None:
      norm = np.sqrt((g * g).sum(axis=1, keepdims=True))
      g = np.where(norm > row_clipnorm, g * row_clipnorm / np.where(norm > 0, norm, 1.0), g)
    if clipvalue is not None:
      lo, hi = (-clipvalue, clipvalue) if np.isscalar(clipvalue) else clipvalue
      g = np.clip(g, -np.inf if lo is None else lo, np.inf if hi is None else hi)
    new_w, state = rule(w, g, state, step, lr, d)
    if weight_decay_factor:
      decay = weight_decay_factor * (lr if multiply_weight_decay_factor_by_learning_rate else 1.0)
      new_w = new_w - decay * w
    if clip_weight_min is not None or clip_weight_max is not None:
      logical = np.arange(w.shape[1])[None, :] < d[:, None]
      low = -np.inf if clip_weight_min is None else clip_weight_min
      high = np.inf if clip_weight_max is None else clip_weight_max
      new_w = np.where(logical, np.clip(new_w, low, high), new_w)
    return new_w, state

  return step_fn


# Each binds on the random problem below (gradient scales 0.1 to 3, rows ~ N(0, 1)).
OPTION_SETS = {
    "clipvalue_decay": dict(clipvalue=0.5, weight_decay_factor=0.01),
    "rownorm_clipweights": dict(row_clipnorm=1.0, clip_weight_min=-0.8, clip_weight_max=0.9),
    "onesided_decay_by_lr": dict(
        clipvalue=(None, 0.3), weight_decay_factor=0.3,
        multiply_weight_decay_factor_by_learning_rate=True, clip_weight_max=1.2,
    ),
    "all": dict(
        clipvalue=(-0.7, 1.2), row_clipnorm=2.0, weight_decay_factor=0.05,
        multiply_weight_decay_factor_by_learning_rate=True, clip_weight_min=-1.0,
        clip_weight_max=1.1,
    ),
}

# Every rule (one case of each kind) meets a rotating option set and "all".
_OPTION_RULES = ("sgd", "adagrad_zero_init", "rowwise_adagrad", "adagrad_momentum_nesterov",
                 "adam_sum_inside_sqrt", "laprop", "ftrl", "custom")
_OPTION_PARAMS = [
    pytest.param(case, options, seed, id=f"{case.name}+{options}-{seed}")
    for index, case in enumerate(c for c in CASES if c.name in _OPTION_RULES)
    for options in (list(OPTION_SETS)[index % 3], "all")
    for seed in (0, 1, 2)
]


@functools.lru_cache(maxsize=None)
def _jitted_apply(optimizer: OptimizerSpec):
  return jax.jit(optimizer.apply)


def _random_problem(seed: int, initial: dict[str, tuple[int | None, float]]):
  """Rows, per-step gradients (with zero rows) and the initial reference state."""
  rng = np.random.default_rng(seed)
  row_dims = rng.choice(LOGICAL_DIMS, size=NUM_ROWS).astype(np.int32)
  mask = np.arange(PADDED_DIM)[None, :] < row_dims[:, None]
  rows = np.where(mask, rng.normal(size=(NUM_ROWS, PADDED_DIM)), 0.0).astype(np.float32)
  grads = []
  for _ in range(NUM_STEPS):
    g = rng.normal(scale=rng.choice([0.1, 1.0, 3.0]), size=(NUM_ROWS, PADDED_DIM))
    g[rng.random(NUM_ROWS) < 0.25] = 0.0  # touched rows whose summed gradient is zero
    grads.append(np.where(mask, g, 0.0).astype(np.float32))
  grads[0][0] = 0.0  # a row whose first gradient is zero (0 / 0 hazards)
  state = {
      name: np.full((NUM_ROWS, PADDED_DIM if width is None else width), value, np.float32)
      for name, (width, value) in initial.items()
  }
  return rows, grads, state, row_dims, mask


def _masked(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
  """Zeroes the padding columns (whose content carries no meaning)."""
  return np.where(mask, x, 0.0) if x.shape == mask.shape else x


def _reference_walk(reference: ReferenceStep, learning_rate, seed: int, initial) -> list:
  """The reference's (rows, state) after every step of the random problem of `seed`."""
  rows, grads, state, row_dims, _ = _random_problem(seed, initial)
  w, state = rows.astype(np.float64), {k: v.astype(np.float64) for k, v in state.items()}
  out = []
  for k, g in enumerate(grads):
    step = 3 * seed + k  # bias corrections and schedules at several step values
    with np.errstate(divide="ignore", invalid="ignore"):  # np.where evaluates both branches
      w, state = reference(
          w, g.astype(np.float64), state, step, _lr_value(learning_rate, step),
          row_dims.astype(np.float64),
      )
    out.append((w, state))
  return out


def _check_against_reference(
    optimizer: OptimizerSpec, reference: ReferenceStep, initial, learning_rate, seed: int, name: str
) -> None:
  """Runs `optimizer.apply` over the random problem and compares every step."""
  rows, grads, state, row_dims, mask = _random_problem(seed, initial)
  apply = _jitted_apply(optimizer)
  got_w, got_state = jnp.asarray(rows), {k: jnp.asarray(v) for k, v in state.items()}
  expected = _reference_walk(reference, learning_rate, seed, initial)
  for k, (g, (ref_w, ref_state)) in enumerate(zip(grads, expected)):
    step = 3 * seed + k
    got_w, got_state = apply(
        got_w, jnp.asarray(g), got_state, jnp.int32(step), jnp.asarray(row_dims)
    )
    assert got_w.dtype == jnp.float32 and got_w.shape == rows.shape
    assert set(got_state) == set(initial)
    for slot, value in got_state.items():
      assert value.dtype == jnp.float32 and value.shape == state[slot].shape, slot
    context = f"{name} step {step}"
    # Row sums (row norms, row-wise means) have D' terms; errors compound over steps.
    assert_close(_masked(np.asarray(got_w), mask), _masked(ref_w, mask),
                 terms=PADDED_DIM, steps=k + 1, err_msg=f"rows, {context}")
    for slot in initial:
      assert_close(_masked(np.asarray(got_state[slot]), mask), _masked(ref_state[slot], mask),
                   terms=PADDED_DIM, steps=k + 1, err_msg=f"slot {slot!r}, {context}")
  assert np.all(np.isfinite(np.asarray(got_w)))
  # The walk really moved the rows (the test would be vacuous otherwise).
  assert np.abs(_masked(np.asarray(got_w), mask) - rows).max() > 1e-3


@pytest.mark.parametrize("case, learning_rate, seed", _PARAMS)
def test_apply_matches_textbook_reference(case: Case, learning_rate, seed: int):
  _check_against_reference(
      case.make(learning_rate), case.reference, case.initial, learning_rate, seed, case.name
  )


@pytest.mark.parametrize("case, options, seed", _OPTION_PARAMS)
def test_shared_options_match_textbook_reference(case: Case, options: str, seed: int):
  """Clipping, decay and weight clipping around every rule, against the formulas."""
  learning_rate = _schedule if case.schedules else 0.05
  base = case.make(learning_rate)
  if not case.schedules:  # the custom rule: lr only scales the decay
    base = dataclasses.replace(base, learning_rate=learning_rate)
  optimizer = dataclasses.replace(base, **OPTION_SETS[options])
  assert optimizer.options_set() and optimizer != base
  reference = _ref_with_options(case.reference, **OPTION_SETS[options])
  _check_against_reference(optimizer, reference, case.initial, learning_rate, seed,
                           f"{case.name}+{options}")
  # The options bind on this problem: the reference without them ends elsewhere.
  _, _, _, _, mask = _random_problem(seed, case.initial)
  plain = _reference_walk(case.reference, learning_rate, seed, case.initial)[-1][0]
  with_options = _reference_walk(reference, learning_rate, seed, case.initial)[-1][0]
  assert np.abs(_masked(plain - with_options, mask)).max() > 1e-3


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_apply_keeps_dtypes(case: Case):
  """bfloat16 rows stay bfloat16; float32 slots stay float32."""
  optimizer = case.make(0.05)
  rows, grads, state, row_dims, _ = _random_problem(7, case.initial)
  new_rows, new_slots = _jitted_apply(optimizer)(
      jnp.asarray(rows, jnp.bfloat16), jnp.asarray(grads[1], jnp.bfloat16),
      {k: jnp.asarray(v) for k, v in state.items()}, jnp.int32(0), jnp.asarray(row_dims),
  )
  assert new_rows.dtype == jnp.bfloat16
  assert {k: v.dtype for k, v in new_slots.items()} == {k: jnp.float32 for k in state}


def test_rowwise_adagrad_averages_over_the_logical_dim():
  """Two rows with the same gradient but different logical dims differ."""
  optimizer = RowWiseAdagrad(1.0, initial_accumulator=0.0, eps=1e-12)
  g = np.zeros((2, 8), np.float32)
  g[:, :2] = 3.0  # ||g||^2 = 18
  rows = np.zeros((2, 8), np.float32)
  state = {"accumulator": np.zeros((2, 1), np.float32)}
  new_rows, new_state = optimizer.apply(rows, g, state, jnp.int32(0), jnp.asarray([2, 8]))
  assert_close(np.asarray(new_state["accumulator"])[:, 0], [9.0, 18.0 / 8], terms=8)
  assert_close(np.asarray(new_rows)[:, 0], [-1.0, -3.0 / 1.5], terms=8)


def test_adagrad_momentum_without_momentum_is_adagrad():
  rows, grads, state, row_dims, _ = _random_problem(3, {"accumulator": (None, 0.2)})
  adagrad = Adagrad(0.1, initial_accumulator=0.2)
  plain = AdagradMomentum(0.1, momentum=0.0, beta2=1.0, exponent=2.0, initial_accumulator=0.2)
  a_rows, a_state = jnp.asarray(rows), dict(state)
  b_rows, b_state = jnp.asarray(rows), dict(state, momentum=np.zeros_like(rows))
  for k, g in enumerate(grads):
    a_rows, a_state = adagrad.apply(a_rows, g, a_state, jnp.int32(k), row_dims)
    b_rows, b_state = plain.apply(b_rows, g, b_state, jnp.int32(k), row_dims)
  # Two formulas of one update: the same sums, rounded in another order.
  assert_close(np.asarray(a_rows), np.asarray(b_rows), terms=PADDED_DIM, steps=len(grads))
  assert_close(a_state["accumulator"], b_state["accumulator"], terms=PADDED_DIM, steps=len(grads))


def test_ftrl_linear_scaling_is_equivalent_under_a_constant_rate():
  """With a constant rate, keeping z scaled by lr changes nothing but z."""
  initial = {"accumulator": (None, 0.1), "linear": (None, 0.0)}
  rows, grads, state, row_dims, _ = _random_problem(4, initial)
  lr = 0.07
  plain = FTRL(lr, l1=0.01, l2=0.03, beta=0.2)
  scaled = FTRL(lr, l1=0.01, l2=0.03, beta=0.2, multiply_linear_by_learning_rate=True)
  a_rows, a_state = jnp.asarray(rows), dict(state)
  b_rows, b_state = jnp.asarray(rows), dict(state)
  for k, g in enumerate(grads):
    a_rows, a_state = plain.apply(a_rows, g, a_state, jnp.int32(k), row_dims)
    b_rows, b_state = scaled.apply(b_rows, g, b_state, jnp.int32(k), row_dims)
  assert_close(np.asarray(a_rows), np.asarray(b_rows), terms=PADDED_DIM, steps=len(grads))
  assert_close(lr * np.asarray(a_state["linear"]), np.asarray(b_state["linear"]),
               terms=PADDED_DIM, steps=len(grads))


def test_ftrl_l1_zeroes_small_linear_terms():
  """|z| <= l1 gives an exact zero weight (the sparsity FTRL is used for)."""
  optimizer = FTRL(0.1, l1=10.0)
  rows = np.ones((3, 8), np.float32)
  g = np.full((3, 8), 0.5, np.float32)
  state = {"accumulator": np.full((3, 8), 0.1, np.float32), "linear": np.zeros((3, 8), np.float32)}
  new_rows, _ = optimizer.apply(rows, g, state, jnp.int32(0), jnp.full((3,), 8))
  assert np.all(np.asarray(new_rows) == 0.0)


def test_schedule_is_evaluated_at_the_step():
  """The rate used for the update after `step` updates is lr(step)."""
  optimizer = SGD(lambda step: 0.5 ** (step + 1.0))
  rows = np.zeros((1, 8), np.float32)
  g = np.ones((1, 8), np.float32)
  for step in (0, 3):
    new_rows, _ = jax.jit(optimizer.apply)(rows, g, {}, jnp.int32(step), jnp.full((1,), 8))
    assert_close(np.asarray(new_rows), np.full((1, 8), -(0.5 ** (step + 1))), terms=1)


def test_adam_bias_correction_reads_the_global_step():
  """A row first touched at step t gets the bias correction of t, not of 0."""
  optimizer = Adam(0.1, beta1=0.9, beta2=0.999, epsilon=1e-8)
  rows = np.zeros((1, 8), np.float32)
  g = np.full((1, 8), 2.0, np.float32)
  state = {"mu": np.zeros((1, 8), np.float32), "nu": np.zeros((1, 8), np.float32)}
  step = 9
  new_rows, _ = optimizer.apply(rows, g, state, jnp.int32(step), jnp.full((1,), 8))
  t = step + 1
  m_hat = 0.1 * 2.0 / (1 - 0.9**t)
  v_hat = 0.001 * 4.0 / (1 - 0.999**t)
  expected = -0.1 * m_hat / (np.sqrt(v_hat) + 1e-8)
  # 1 - beta**t cancels: its float32 rounding is 1 / (1 - beta2**t) eps relative,
  # as much as a sum of that many terms.
  assert_close(np.asarray(new_rows), np.full((1, 8), expected), terms=int(1 / (1 - 0.999**t)) + 1)


def test_custom_optimizer_must_return_its_declared_slots():
  def drops_slot(rows, grads, slots, step):
    return rows - grads, {}

  optimizer = CustomOptimizer("drops", drops_slot, (SlotSpec("velocity"),))
  rows = np.zeros((2, 8), np.float32)
  with pytest.raises(ValueError, match="returned slots"):
    optimizer.apply(rows, rows, {"velocity": rows}, jnp.int32(0), jnp.full((2,), 8))


# --- the real sparse update, on 1 and 8 devices and every backend -----------

_SHARDED_BATCH, _SHARDED_STEPS = 16, 3
# Two tables of one stack (D' = 16) with different logical dims.
_SHARDED_TABLES = (("t_a", 40, 12, 4), ("t_b", 30, 5, 3))  # name, V, D, ids per sample

# (optimizer, the slots' initial values stated from its hyperparameters, reference).
_SHARDED_CASES = {
    # RowWiseAdagrad and SGD run in fused C++ kernels on the CPU backend, options included.
    "rowwise_adagrad+all": (
        RowWiseAdagrad(0.2, initial_accumulator=0.0, eps=1e-3, **OPTION_SETS["all"]),
        {"accumulator": (1, 0.0)},
        _ref_with_options(_ref_rowwise_adagrad(1e-3), **OPTION_SETS["all"]),
    ),
    "sgd+rownorm_clipweights": (
        SGD(0.3, **OPTION_SETS["rownorm_clipweights"]),
        {},
        _ref_with_options(_ref_sgd, **OPTION_SETS["rownorm_clipweights"]),
    ),
    "adam_sum_inside_sqrt+decay": (
        Adam(0.05, beta1=0.5, beta2=0.9, epsilon=1e-2, sum_inside_sqrt=True,
             **OPTION_SETS["onesided_decay_by_lr"]),
        {"mu": (None, 0.0), "nu": (None, 0.0)},
        _ref_with_options(_ref_adam(0.5, 0.9, 1e-2, sum_inside_sqrt=True),
                          **OPTION_SETS["onesided_decay_by_lr"]),
    ),
    "adagrad_zero_init": (
        Adagrad(0.1, initial_accumulator=0.0, eps=1e-8, clipvalue=0.5),
        {"accumulator": (None, 0.0)},
        _ref_with_options(_ref_adagrad(1e-8), clipvalue=0.5),
    ),
}


def _sharded_model(optimizer: OptimizerSpec, num_devices: int):
  if jax.device_count() < num_devices:
    pytest.skip(f"needs {num_devices} devices, have {jax.device_count()}")
  features = tuple(
      FeatureSpec(f"f_{name}", TableSpec(name, vocab, dim, optimizer=optimizer, combiner="sum",
                                          max_ids_per_partition=256,
                                          max_unique_ids_per_partition=256),
                  (_SHARDED_BATCH, ids))
      for name, vocab, dim, ids in _SHARDED_TABLES
  )
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:num_devices]), ("devices",))
  return features, EmbeddingPlan.create(features, mesh=mesh, shards_per_device=2 if num_devices > 1 else 1)


def _sharded_batches(seed: int):
  """Per step: ids [B, L] per table (many duplicates, -1 padding) and dL/da [B, D]."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(_SHARDED_STEPS):
    ids, act_grads = {}, {}
    for name, vocab, dim, per_sample in _SHARDED_TABLES:
      # Ids from a third of the vocabulary: duplicates, and rows never touched.
      ids[name] = rng.integers(-1, vocab // 3, (_SHARDED_BATCH, per_sample))
      act_grads[name] = rng.normal(scale=rng.choice([0.3, 2.0]), size=(_SHARDED_BATCH, dim))
    out.append((ids, act_grads))
  return out


def _logical_state(plan, variables, optimizer):
  tables = unstack({k: np.asarray(v) for k, v in variables.tables.items()}, plan.layout)
  slots = {}
  for slot in optimizer.slots():
    stacked = {stack: np.asarray(value[slot.name]) for stack, value in variables.slots.items()}
    slots[slot.name] = unstack(stacked, plan.layout, row_width=slot.width)
  return tables, slots


def _sharded_run(optimizer, num_devices: int, backend: str, steps, variables=None, first_step=0):
  """Runs the real sparse update for `steps`; returns (plan, [variables before, after each])."""
  features, plan = _sharded_model(optimizer, num_devices)
  update = jax.jit(lambda v, batch, grads, step: apply_embedding_gradients(
      plan, v, batch, grads, step, backend=backend))
  if variables is None:
    variables = init_embedding_variables(plan, jax.random.key(11))
  history = [variables]
  for k, (ids, act_grads) in enumerate(steps):
    raw = {f"f_{name}": value for name, value in ids.items()}
    batch, stats = preprocess(raw, features, plan.layout, padding_id=-1)
    assert stats.num_dropped_ids == 0
    grads = {f"f_{name}": jnp.asarray(g, jnp.float32) for name, g in act_grads.items()}
    variables = update(variables, batch, grads, first_step + k)
    history.append(variables)
  return plan, history


def _sharded_params() -> list:
  """Every case on the C++ CPU backend (when built), one on the portable XLA backend.

  "cpu" is registered whether or not the kernels were built: ask whether they were.
  """
  native = "cpu" if cpu_kernels_available() else "xla"
  params = [(name, devices, native) for name in _SHARDED_CASES for devices in (1, 8)]
  if native != "xla":
    params += [("rowwise_adagrad+all", devices, "xla") for devices in (1, 8)]
  return [pytest.param(*p, id="-".join(map(str, p))) for p in params]


@pytest.mark.parametrize("name, num_devices, backend", _sharded_params())
def test_sparse_update_with_options_matches_reference(name, num_devices, backend):
  """Duplicate ids summed first, options on the summed row, untouched rows unchanged."""
  optimizer, initial, reference = _SHARDED_CASES[name]
  steps = _sharded_batches(seed=num_devices)
  plan, history = _sharded_run(optimizer, num_devices, backend, steps)
  tables, slots = _logical_state(plan, history[0], optimizer)
  dims = {name_: dim for name_, _, dim, _ in _SHARDED_TABLES}
  ref = {t: (tables[t].astype(np.float64),
             {s: np.full((tables[t].shape[0], dims[t] if w is None else w), v) for s, (w, v)
              in initial.items()}) for t in tables}
  for k, (ids, act_grads) in enumerate(steps):
    got_tables, got_slots = _logical_state(plan, history[k + 1], optimizer)
    before, _ = _logical_state(plan, history[k], optimizer)
    for table, (w, state) in list(ref.items()):
      # dL/dT[i] = sum over the occurrences (b, l) of id i of dL/da[b] (sum combiner).
      occurrences = ids[table]
      valid = occurrences >= 0
      per_entry = np.broadcast_to(act_grads[table][:, None, :], (*occurrences.shape, dims[table]))
      row_grads = np.zeros_like(w)
      np.add.at(row_grads, occurrences[valid], per_entry[valid])
      touched = np.unique(occurrences[valid])
      d = np.full(len(touched), dims[table], np.float64)
      new_rows, new_state = reference(w[touched], row_grads[touched],
                                      {s: v[touched] for s, v in state.items()}, k,
                                      _lr_value(optimizer.learning_rate, k), d)
      w = w.copy()
      w[touched] = new_rows
      for s in state:
        state[s] = state[s].copy()
        state[s][touched] = new_state[s]
      ref[table] = (w, state)
      terms = ids[table].size  # the longest sum behind a row's gradient
      context = f"{name}, {num_devices} devices, {backend}, step {k}, table {table}"
      assert_close(got_tables[table], w, terms=terms, steps=k + 1, err_msg=context)
      for s in state:
        assert_close(got_slots[s][table], state[s], terms=terms, steps=k + 1,
                     err_msg=f"slot {s}, {context}")
      untouched = np.setdiff1d(np.arange(w.shape[0]), touched)
      assert len(untouched) > 0
      assert_same_bits(got_tables[table][untouched], before[table][untouched],
                       err_msg=f"untouched rows, {context}")


# --- checkpoints: the options are hyperparameters, not state -----------------


def _save(path, plan, variables, optimizer):
  slot_specs = {stack: optimizer.slots() for stack in plan.layout.stack_names}
  with ocp.AsyncCheckpointer(ck.EmbeddingCheckpointHandler()) as checkpointer:
    checkpointer.save(path, args=ck.EmbeddingSave(variables.tables, variables.slots, plan.layout,
                                                  slot_specs))
    checkpointer.wait_until_finished()


def _restore(path, plan, slot_specs=None):
  with ocp.Checkpointer(ck.EmbeddingCheckpointHandler()) as checkpointer:
    state = checkpointer.restore(path, args=ck.EmbeddingRestore(
        plan.layout, plan.mesh, plan.axis_name, slot_specs=slot_specs))
  return EmbeddingVariables(state.tables, state.slots)


def test_checkpoint_resume_with_options_is_bit_exact(tmp_path):
  """Save after one step, restore into a fresh plan, train on: the same bits."""
  optimizer = _SHARDED_CASES["rowwise_adagrad+all"][0]
  backend = _sharded_params()[0].values[2]
  steps = _sharded_batches(seed=5)
  plan, straight = _sharded_run(optimizer, 8, backend, steps)
  _save(tmp_path / "ckpt", plan, straight[1], optimizer)
  restored = _restore(tmp_path / "ckpt", plan)
  _, resumed = _sharded_run(optimizer, 8, backend, steps[1:], variables=restored, first_step=1)
  jax.tree.map(lambda a, b: assert_same_bits(np.asarray(a), np.asarray(b)), resumed[-1],
               straight[-1])
  # Restoring into an optimizer that keeps other slots is still a clear error.
  with pytest.raises(ck.SlotMismatchError, match=r"keeps slots \[\(.mu.*stores table .t_a. with slots \[\(.accumulator., 1\)"):
    _restore(tmp_path / "ckpt", plan,
             slot_specs={stack: Adam().slots() for stack in plan.layout.stack_names})


def test_checkpoint_files_do_not_depend_on_the_options(tmp_path):
  """The checkpoint's JSON (manifest, layout) holds slots, not hyperparameters, so a
  checkpoint written before the options existed, or without them, is the same
  file and restores into a spec that sets them, and vice versa."""
  with_options = _SHARDED_CASES["rowwise_adagrad+all"][0]
  plain = RowWiseAdagrad(0.2, initial_accumulator=0.0, eps=1e-3)
  assert plain.slots() == with_options.slots() and plain != with_options
  plan, history = _sharded_run(plain, 1, "xla", [])
  _save(tmp_path / "plain", plan, history[0], plain)
  plan_options, _ = _sharded_run(with_options, 1, "xla", [])
  _save(tmp_path / "options", plan_options, history[0], with_options)
  for name in ("manifest.json", "layout.json"):
    plain_json, options_json = (json.loads((tmp_path / run / name).read_text())
                                for run in ("plain", "options"))
    plain_json.pop("save_id", None), options_json.pop("save_id", None)  # each save's own id
    assert plain_json == options_json, name
  restored = _restore(tmp_path / "plain", plan_options)
  jax.tree.map(lambda a, b: assert_same_bits(np.asarray(a), np.asarray(b)), restored, history[0])


@pytest.mark.parametrize("beta2", [0.999, 0.9999])
@pytest.mark.parametrize("spec_of", [
    lambda b2: Adam(0.05, beta2=b2), lambda b2: Adam(0.05, beta2=b2, sum_inside_sqrt=True),
    lambda b2: LaProp(0.05, beta2=b2),
], ids=["adam", "adam_sum_inside_sqrt", "laprop"])
def test_the_bias_corrections_keep_a_single_update_to_a_few_ulps(spec_of, beta2):
  """At step 1, m_hat = g and v_hat = g^2 exactly in real arithmetic, so the
  update is -lr * g / (|g| + eps): 1 - beta2^t must not cancel in float32."""
  spec = spec_of(beta2)
  rng = np.random.default_rng(11)
  grads = rng.uniform(0.5, 2.0, (4, 8)).astype(np.float32) * rng.choice([-1, 1], (4, 8))
  # Small rows, so new_rows - rows is exact to far below the bound.
  rows = rng.uniform(-0.01, 0.01, (4, 8)).astype(np.float32)
  slots = {name: jnp.zeros((4, 8), jnp.float32) for name in ("mu", "nu")}
  new_rows, _ = spec.apply(jnp.asarray(rows), jnp.asarray(grads), slots, jnp.asarray(0),
                           jnp.full((4,), 8))
  g = grads.astype(np.float64)
  eps = spec.epsilon
  denominator = np.sqrt(g * g + eps * eps) if getattr(spec, "sum_inside_sqrt", False) else (
      np.abs(g) + eps)
  expected_step = -0.05 * g / denominator
  assert_close(np.asarray(new_rows, np.float64) - rows, expected_step, terms=4)


@pytest.mark.parametrize("backend", ["xla"] + (["cpu"] if cpu_kernels_available() else []))
@pytest.mark.parametrize("scale, clipnorm, lr", [
    (1e3, 1.0, 0.5), (2e19, 1.0, 0.5), (1e30, 1.0, 0.5),
    # c / ||g|| below the smallest normal float32, which the CPU flushes to zero: the
    # step was dropped (C++ kernels), or the row was not clipped at all (XLA).
    (1e38, 1.0, 0.5), (3e38, 1.0, 0.5), (1e10, 1e-30, 1e30),
])
def test_row_clipnorm_clips_rows_whose_squared_norm_overflows_float32(backend, scale, clipnorm,
                                                                      lr):
  """||g||^2 of a row of 2e19s overflows float32 though ||g|| does not: c / inf = 0 dropped
  the step silently. Every row must move by lr * c * g / ||g||."""
  table = TableSpec("t", 24, 8, optimizer=SGD(lr, row_clipnorm=clipnorm))
  feature = FeatureSpec("f", table, (8, 1))
  plan = EmbeddingPlan.create([feature])  # on every device
  rng = np.random.default_rng(int(scale) % 1000)
  ids = rng.permutation(24)[:8].reshape(8, 1)  # one distinct row per sample
  grads = (rng.choice([-1.0, 1.0], (8, 8)) * rng.uniform(0.5, 1.0, (8, 8)) * scale)
  variables = init_embedding_variables(plan, jax.random.key(3))
  before = _logical_state(plan, variables, table.optimizer)[0]["t"]
  batch, _ = preprocess({"f": ids}, [feature], plan.layout)
  after = apply_embedding_gradients(plan, variables, batch,
                                    {"f": jnp.asarray(grads, jnp.float32)}, 0, backend=backend)
  after = _logical_state(plan, after, table.optimizer)[0]["t"]
  wide = grads.astype(np.float32).astype(np.float64)
  assert np.all(np.linalg.norm(wide, axis=1) > clipnorm)  # every row is clipped
  step = lr * clipnorm * wide / np.linalg.norm(wide, axis=1, keepdims=True)
  expected = before.astype(np.float64).copy()
  expected[ids[:, 0]] -= step
  assert_close(after, expected, terms=8)


@pytest.mark.parametrize("backend", ["xla"] + (["cpu"] if cpu_kernels_available() else []))
@pytest.mark.parametrize("optimizer", [
    SGD(0.1), Adagrad(0.1), RowWiseAdagrad(0.1), Adam(0.1),
    # l1 so large that every finite linear term is zeroed: a NaN one was zeroed too.
    FTRL(0.1, l1=100.0), FTRL(0.1, l1=100.0, multiply_linear_by_learning_rate=True),
], ids=["sgd", "adagrad", "rowwise_adagrad", "adam", "ftrl", "ftrl_multiply_linear"])
def test_a_nan_gradient_makes_the_values_it_updates_nan_in_every_rule(backend, optimizer):
  """FTRL wrote a clean 0 for a NaN gradient (|NaN| > l1 is false) while its slots held NaN:
  the table passed an isfinite check and the weight stayed 0 for good."""
  table = TableSpec("t", 24, 8, optimizer=optimizer)
  feature = FeatureSpec("f", table, (8, 1))
  plan = EmbeddingPlan.create([feature])
  ids = np.arange(8).reshape(8, 1) * 3
  grads = np.random.default_rng(2).normal(size=(8, 8)).astype(np.float32)
  grads[0, 2] = np.nan
  variables = init_embedding_variables(plan, jax.random.key(4))
  before = _logical_state(plan, variables, optimizer)[0]["t"]
  batch, _ = preprocess({"f": ids}, [feature], plan.layout)
  after = apply_embedding_gradients(plan, variables, batch, {"f": jnp.asarray(grads)}, 0,
                                    backend=backend)
  after = _logical_state(plan, after, optimizer)[0]["t"]
  assert np.isnan(after[0, 2])
  untouched = np.setdiff1d(np.arange(24), ids[:, 0])
  assert_same_bits(after[untouched], before[untouched])
  assert np.isfinite(after[ids[1:, 0]]).all()  # the other rows of the batch


@pytest.mark.parametrize("backend", ["xla"] + (["cpu"] if cpu_kernels_available() else []))
@pytest.mark.parametrize("num_devices", [1, 8])
def test_a_custom_rule_leaves_the_tables_padding_columns_zero(backend, num_devices):
  """A rule's values in the padding columns (here 0 / 0 of a textbook Adagrad without eps)
  reached stacked_lookup, which gathers whole rows: a loss over it became NaN."""

  def adagrad_without_eps(rows, grads, slots, step):
    accumulator = slots["accumulator"] + grads * grads
    return rows - 0.1 * grads / jnp.sqrt(accumulator), {"accumulator": accumulator}

  optimizer = CustomOptimizer("adagrad_without_eps", adagrad_without_eps,
                              (SlotSpec("accumulator", None, 0.0),))
  features = [FeatureSpec("f", TableSpec("t", 40, 12, optimizer=optimizer), (16, 2)),
              FeatureSpec("g", TableSpec("u", 30, 10, optimizer=optimizer), (16, 3))]
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:num_devices]), ("devices",))
  plan = EmbeddingPlan.create(features, mesh=mesh)
  assert len(plan.layout.stacks) == 1  # both tables padded to D' = 16 in one stack
  rng = np.random.default_rng(num_devices)
  variables = init_embedding_variables(plan, jax.random.key(5))
  for step in range(2):
    raw = {f.name: rng.integers(0, f.table.vocabulary_size, f.input_shape) for f in features}
    batch, _ = preprocess(raw, features, plan.layout)
    stacked = stacked_lookup(plan, variables.tables, batch, backend=backend)
    grads = {name: jnp.asarray(rng.normal(size=a.shape), jnp.float32)
             for name, a in stacked.items()}
    variables = apply_stacked_gradients(plan, variables, batch, grads, step, backend=backend)
  stacked = stacked_lookup(plan, variables.tables, batch, backend=backend)
  per_feature = embedding_lookup(plan, variables.tables, batch, backend=backend)
  assert all(np.isfinite(np.asarray(a)).all() for a in per_feature.values())
  joined = stack_activations(plan, per_feature)  # zeros beyond each feature's dimension
  for name, value in stacked.items():
    assert_same_bits(np.asarray(value), np.asarray(joined[name]))


@pytest.mark.parametrize("backend", ["xla"] + (["cpu"] if cpu_kernels_available() else []))
def test_ftrl_skips_a_step_whose_learning_rate_is_zero(backend):
  """The default form divides by lr: a warmup schedule starting at 0 turned every touched
  row into NaN and its linear slot into inf. A rate of 0 skips the rule; later steps follow
  the textbook from the untouched state."""

  def warmup(step):
    return jnp.minimum(step, 4) * 0.1

  optimizer = FTRL(warmup, l1=0.01, l2=0.02, beta=0.1)
  feature = FeatureSpec("f", TableSpec("t", 24, 8, optimizer=optimizer), (8, 2))
  plan = EmbeddingPlan.create([feature])
  rng = np.random.default_rng(7)
  variables = init_embedding_variables(plan, jax.random.key(4))
  reference = _ref_ftrl(0.5, 0.01, 0.02, 0.1, False)
  for step in range(3):
    ids = rng.integers(0, 24, (8, 2))
    grads = rng.normal(size=(8, 8)).astype(np.float32)
    batch, _ = preprocess({"f": ids}, [feature], plan.layout)
    tables, slots = _logical_state(plan, variables, optimizer)
    variables = apply_embedding_gradients(plan, variables, batch, {"f": jnp.asarray(grads)}, step,
                                          backend=backend)
    got_tables, got_slots = _logical_state(plan, variables, optimizer)
    if step == 0:
      assert_same_bits(got_tables["t"], tables["t"])
      for name in slots:
        assert_same_bits(got_slots[name]["t"], slots[name]["t"])
      continue
    summed = np.zeros((24, 8))
    np.add.at(summed, ids.reshape(-1), np.repeat(grads.astype(np.float64), 2, axis=0))
    touched = np.unique(ids)
    state = {name: slots[name]["t"][touched].astype(np.float64) for name in slots}
    w, state = reference(tables["t"][touched].astype(np.float64), summed[touched], state, step,
                         float(warmup(step)), None)
    assert_close(got_tables["t"][touched], w, terms=3)
    assert_close(got_slots["linear"]["t"][touched], state["linear"], terms=3)
    assert np.abs(got_tables["t"][touched] - tables["t"][touched]).max() > 1e-3


@pytest.mark.parametrize("backend", ["xla"] + (["cpu"] if cpu_kernels_available() else []))
def test_row_clipnorm_of_a_row_holding_an_inf_spoils_only_that_element(backend):
  """Its norm is inf, so its scale c / inf is 0: inf * 0 is NaN there and the row's other
  elements do not move, on both backends; the other rows are clipped as usual."""
  table = TableSpec("t", 24, 8, optimizer=SGD(0.5, row_clipnorm=1.0))
  feature = FeatureSpec("f", table, (8, 1))
  plan = EmbeddingPlan.create([feature])
  ids = np.arange(8).reshape(8, 1) * 3
  grads = np.random.default_rng(9).normal(size=(8, 8)).astype(np.float32) * 10
  grads[2, 5] = np.inf
  variables = init_embedding_variables(plan, jax.random.key(3))
  before = _logical_state(plan, variables, table.optimizer)[0]["t"]
  batch, _ = preprocess({"f": ids}, [feature], plan.layout)
  after = apply_embedding_gradients(plan, variables, batch, {"f": jnp.asarray(grads)}, 0,
                                    backend=backend)
  after = _logical_state(plan, after, table.optimizer)[0]["t"]
  assert np.argwhere(~np.isfinite(after)).tolist() == [[6, 5]]
  assert_same_bits(np.delete(after[6], 5), np.delete(before[6], 5))
  others = [row for row in range(8) if row != 2]
  wide = grads[others].astype(np.float64)
  expected = before[ids[others, 0]] - 0.5 * wide / np.linalg.norm(wide, axis=1, keepdims=True)
  assert_close(after[ids[others, 0]], expected, terms=8)


@pytest.mark.parametrize("backend", ["xla"] + (["cpu"] if cpu_kernels_available() else []))
def test_an_infinite_gradient_is_bounded_only_by_the_clipping_options(backend):
  """The README said every rule made it non-finite: clipvalue and clip_weight_* bound it,
  and row-wise Adagrad's accumulator turns infinite, freezing the rest of the row."""
  ids = np.arange(8).reshape(8, 1) * 3
  grads = np.random.default_rng(11).normal(size=(8, 8)).astype(np.float32)
  grads[1, 4] = np.inf  # row 3, column 4

  def step(optimizer, times=1):
    feature = FeatureSpec("f", TableSpec("t", 24, 8, optimizer=optimizer), (8, 1))
    plan = EmbeddingPlan.create([feature])
    variables = init_embedding_variables(plan, jax.random.key(6))
    before = _logical_state(plan, variables, optimizer)[0]["t"]
    batch, _ = preprocess({"f": ids}, [feature], plan.layout)
    after = variables
    for count in range(times):
      after = apply_embedding_gradients(plan, after, batch, {"f": jnp.asarray(grads)}, count,
                                        backend=backend)
    tables, slots = _logical_state(plan, after, optimizer)
    return before, tables["t"], {name: value["t"] for name, value in slots.items()}

  table, clipped, _ = step(SGD(0.5, clipvalue=1.0))
  np.testing.assert_array_equal(clipped[3, 4], table[3, 4] - np.float32(0.5))
  _, bounded, _ = step(SGD(0.5, clip_weight_min=-2.0, clip_weight_max=2.0))
  assert bounded[3, 4] == -2.0 and np.isfinite(bounded).all()
  _, plain, _ = step(SGD(0.5))
  assert plain[3, 4] == -np.inf
  table, rowwise, slots = step(RowWiseAdagrad(0.5), times=2)
  assert np.argwhere(~np.isfinite(rowwise)).tolist() == [[3, 4]] and np.isnan(rowwise[3, 4])
  assert_same_bits(np.delete(rowwise[3], 4), np.delete(table[3], 4))  # frozen
  assert slots["accumulator"][3, 0] == np.inf
