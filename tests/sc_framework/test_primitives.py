"""The device primitives (lookup, fused sparse update) against dense references.

Every expected value here is computed without the code under test: lookups
are numpy gathers of the logical tables (read back with `unstack`), combined
per sample; the gradient of each row comes from `jax.grad` of a dense jnp
lookup over the full logical tables; the optimizer steps are textbook numpy
formulas applied to exactly the rows the batch touches. Batches go through
the real host preprocessing, in every accepted input form.

One conformance body runs optimizers x device geometries (1 device; 8
devices with S = 1, 2, 4 shards each) over several steps; a covering subset
of that product keeps the file fast.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

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
from sc_framework.preprocessing import DenseIds, RaggedIds, RaggedRows, SparseIds, preprocess
from sc_framework.primitives import (
    EmbeddingBackend,
    EmbeddingPlan,
    EmbeddingVariables,
    apply_embedding_gradients,
    apply_stacked_gradients,
    available_backends,
    embedding_lookup,
    embedding_variable_shapes,
    get_backend,
    init_embedding_variables,
    split_stacked_activations,
    stack_activations,
    stacked_lookup,
)
from sc_framework.primitives._row_ops import cpu_kernels_available
from sc_framework.stacking import logical_to_global_rows, unstack
from tests.compiles import count_compiles
from tests.numerics import assert_close, assert_same_bits

PADDING_ID = -1
RAGGED_WIDTH = {"a_ragged": 7, "d_ragged": 5}  # widths of the dense copies of ragged features
GEOMETRIES = {"1x1": (1, 1), "8x1": (8, 1), "8x2": (8, 2), "8x4": (8, 4)}


# --- textbook optimizer references (float64 numpy, on the touched rows) -----
# (w [K, D], g [K, D], state, step, lr, d) -> (w, state); d the logical dim.


def _schedule(step):
  return 0.2 / (1.0 + step)


def _ref_sgd(w, g, s, step, lr, d):
  return w - lr * g, s


def _ref_adagrad(w, g, s, step, lr, d):
  a = s["accumulator"] + g**2
  return w - lr * g / np.sqrt(a), {"accumulator": a}


def _ref_rowwise_adagrad(w, g, s, step, lr, d):
  a = s["accumulator"] + (g**2).sum(axis=1, keepdims=True) / d
  return w - lr * g / (np.sqrt(a) + 1e-8), {"accumulator": a}


def _ref_nesterov(w, g, s, step, lr, d):
  a = s["accumulator"] + g**2
  u = g / (np.sqrt(a) + 1e-10)
  m = 0.9 * s["momentum"] + u
  return w - lr * (0.9 * m + u), {"accumulator": a, "momentum": m}


def _ref_adam(w, g, s, step, lr, d):
  t = step + 1
  m = 0.9 * s["mu"] + 0.1 * g
  v = 0.999 * s["nu"] + 0.001 * g**2
  return w - lr * (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.999**t)) + 1e-8), {"mu": m, "nu": v}


def _ref_laprop(w, g, s, step, lr, d):
  t = step + 1
  v = 0.95 * s["nu"] + 0.05 * g**2
  m = 0.9 * s["mu"] + 0.1 * g / (np.sqrt(v / (1 - 0.95**t)) + 1e-8)
  return w - lr * m / (1 - 0.9**t), {"mu": m, "nu": v}


def _ref_ftrl_scaled(w, g, s, step, lr, d):
  """FTRL-Proximal with the linear term kept multiplied by lr (l1, l2, beta)."""
  l1, l2, beta = 0.001, 0.01, 0.1
  n, z = s["accumulator"], s["linear"]
  n_new = n + g**2
  z = z + lr * g - (np.sqrt(n_new) - np.sqrt(n)) * w
  w = np.where(
      np.abs(z) > l1 * lr,
      (np.sign(z) * l1 * lr - z) / (beta + np.sqrt(n_new) + 2 * l2 * lr),
      0.0,
  )
  return w, {"accumulator": n_new, "linear": z}


def _custom_rule(rows, grads, slots, step):
  velocity = 0.5 * slots["velocity"] + grads
  return rows - 0.1 / (1.0 + step) * velocity, {
      "velocity": velocity,
      "count": slots["count"] + 1.0,
  }


def _ref_custom(w, g, s, step, lr, d):
  v = 0.5 * s["velocity"] + g
  return w - 0.1 / (1.0 + step) * v, {"velocity": v, "count": s["count"] + 1.0}


@dataclasses.dataclass(frozen=True)
class Opt:
  """An optimizer under test, its reference and its slots' initial values."""

  name: str
  spec: OptimizerSpec
  reference: Callable
  initial: dict[str, tuple[int | None, float]]  # slot -> (width, None = per column)


OPTIMIZERS = {
    opt.name: opt
    for opt in (
        Opt("sgd", SGD(0.5), _ref_sgd, {}),
        Opt("adagrad", Adagrad(_schedule, initial_accumulator=0.1), _ref_adagrad,
            {"accumulator": (None, 0.1)}),
        Opt("rowwise_adagrad", RowWiseAdagrad(0.3, initial_accumulator=0.1),
            _ref_rowwise_adagrad, {"accumulator": (1, 0.1)}),
        Opt("adagrad_momentum", AdagradMomentum(0.1, momentum=0.9, use_nesterov=True),
            _ref_nesterov, {"accumulator": (None, 0.1), "momentum": (None, 0.0)}),
        Opt("adam", Adam(_schedule), _ref_adam, {"mu": (None, 0.0), "nu": (None, 0.0)}),
        Opt("laprop", LaProp(0.05), _ref_laprop, {"mu": (None, 0.0), "nu": (None, 0.0)}),
        Opt("ftrl", FTRL(0.2, l1=0.001, l2=0.01, beta=0.1, multiply_linear_by_learning_rate=True),
            _ref_ftrl_scaled, {"accumulator": (None, 0.1), "linear": (None, 0.0)}),
        Opt("custom", CustomOptimizer(
            "momentum_with_count", _custom_rule,
            (SlotSpec("velocity", None, 0.0), SlotSpec("count", 1, 0.0))),
            _ref_custom, {"velocity": (None, 0.0), "count": (1, 0.0)}),
    )
}


def _lr(spec: OptimizerSpec, step: int) -> float:
  rate = spec.learning_rate
  return float(rate(step)) if callable(rate) else float(rate)


# --- the model: 3 tables, 6 features, 2 stacks, every input form ------------

# The combiners of (the stack of tables a and b, the stack of table d); rotated
# across cases so every combiner meets every input form and both stacks.
COMBINERS = {
    "sum-mean": ("sum", "mean"),
    "mean-sqrtn": ("mean", "sqrtn"),
    "sqrtn-sum": ("sqrtn", "sum"),
}


@functools.lru_cache(maxsize=None)
def _features(optimizer: OptimizerSpec, combiners: tuple[str, str]) -> tuple[FeatureSpec, ...]:
  ab, d = combiners
  limits = dict(max_ids_per_partition=320, max_unique_ids_per_partition=320)
  # t_a and t_b share a stack (D' = 16) with different logical dims; t_d is
  # a stack of its own (D' = 24). No vocabulary is a multiple of 8 N, so every
  # stack has padding rows.
  t_a = TableSpec("t_a", 50, 12, optimizer=optimizer, combiner=ab, **limits)
  t_b = TableSpec("t_b", 120, 10, optimizer=optimizer, combiner=ab, **limits)
  t_d = TableSpec("t_d", 170, 20, optimizer=optimizer, combiner=d, **limits)
  return (
      FeatureSpec("a_dense", t_a, (32, 4)),  # dense, padding ids, duplicates
      FeatureSpec("a_ragged", t_a, (16, None)),  # ragged rows with weights
      FeatureSpec("b_coo", t_b, (16, 5)),  # COO, shuffled, with weights
      FeatureSpec("d_dense_weighted", t_d, (32, 3)),  # DenseIds with weights
      FeatureSpec("d_ragged", t_d, (16, None)),  # RaggedIds or a list, empty samples
      FeatureSpec("d_dense", t_d, (32, 2)),  # a third feature on table d
  )


@functools.lru_cache(maxsize=None)
def _plan(features: tuple[FeatureSpec, ...], num_devices: int, shards: int) -> EmbeddingPlan:
  if jax.device_count() < num_devices:
    pytest.skip(f"needs {num_devices} devices, have {jax.device_count()}")
  mesh = Mesh(np.array(jax.devices()[:num_devices]), ("devices",))
  return EmbeddingPlan.create(features, mesh=mesh, shards_per_device=shards)


@functools.lru_cache(maxsize=None)
def _jitted(plan: EmbeddingPlan):
  lookup = jax.jit(lambda tables, batch: embedding_lookup(plan, tables, batch))
  update = jax.jit(
      lambda variables, batch, grads, step: apply_embedding_gradients(
          plan, variables, batch, grads, step
      ),
      donate_argnums=0,
  )
  return lookup, update


@dataclasses.dataclass
class RawBatch:
  """One step's ids: what preprocess gets, and the same data as dense arrays.

  Attributes:
    inputs: feature name -> ids in the feature's input form.
    ids: feature name -> [B, L] int ids, PADDING_ID in unused places.
    weights: feature name -> [B, L] float weights, 0 in unused places.
  """

  inputs: dict
  ids: dict[str, np.ndarray]
  weights: dict[str, np.ndarray]


def _dense_rows(rows: list[np.ndarray], weights: list[np.ndarray], width: int):
  ids = np.full((len(rows), width), PADDING_ID, np.int64)
  w = np.zeros((len(rows), width), np.float32)
  for b, (r, wr) in enumerate(zip(rows, weights)):
    ids[b, : len(r)] = r
    w[b, : len(r)] = wr
  return ids, w


def _random_batch(rng: np.random.Generator, features: tuple[FeatureSpec, ...]) -> RawBatch:
  spec = {f.name: f for f in features}
  inputs, ids, weights = {}, {}, {}

  def vocab(name):
    return spec[name].table.vocabulary_size

  # a_dense: plain int array, no weights, padding ids and forced duplicates.
  x = rng.integers(0, vocab("a_dense"), (32, 4))
  x[rng.random((32, 4)) < 0.2] = PADDING_ID
  x[::3, 1] = x[::3, 0]  # duplicate ids inside a sample (padding duplicated too)
  x[5] = PADDING_ID  # a sample without ids
  inputs["a_dense"], ids["a_dense"] = x, x
  weights["a_dense"] = (x != PADDING_ID).astype(np.float32)

  # a_ragged: per-sample arrays with weights (and a padding id).
  rows = [rng.integers(0, vocab("a_ragged"), rng.integers(0, 6)) for _ in range(16)]
  rows[2] = np.array([7, 7, 7, 3])  # the same id three times
  rows[4] = np.array([PADDING_ID, 11])
  row_weights = [rng.uniform(0.5, 2.0, len(r)).astype(np.float32) for r in rows]
  inputs["a_ragged"] = RaggedRows(rows, row_weights)
  dense_ids, dense_w = _dense_rows(rows, row_weights, RAGGED_WIDTH["a_ragged"])
  ids["a_ragged"], weights["a_ragged"] = dense_ids, np.where(dense_ids == PADDING_ID, 0, dense_w)

  # b_coo: COO with weights, entries in shuffled order, some positions empty.
  present = rng.random((16, 5)) < 0.7
  present[0, :2] = True
  positions = np.argwhere(present)
  values = rng.integers(0, vocab("b_coo"), len(positions))
  values[1] = values[0]  # a duplicate in sample 0
  w = rng.uniform(0.5, 2.0, len(positions)).astype(np.float32)
  order = rng.permutation(len(positions))
  inputs["b_coo"] = SparseIds(positions[order], values[order], (16, 5), w[order])
  dense_ids = np.full((16, 5), PADDING_ID, np.int64)
  dense_w = np.zeros((16, 5), np.float32)
  dense_ids[positions[:, 0], positions[:, 1]] = values
  dense_w[positions[:, 0], positions[:, 1]] = w
  ids["b_coo"], weights["b_coo"] = dense_ids, dense_w

  # d_dense_weighted: DenseIds with weights, padding ids (their weights ignored).
  x = rng.integers(0, vocab("d_dense_weighted"), (32, 3))
  x[rng.random((32, 3)) < 0.25] = PADDING_ID
  x[1, :] = [9, 9, 9]
  w = rng.uniform(0.5, 2.0, (32, 3)).astype(np.float32)
  inputs["d_dense_weighted"] = DenseIds(x, w)
  ids["d_dense_weighted"], weights["d_dense_weighted"] = x, np.where(x == PADDING_ID, 0, w)

  # d_ragged: RaggedIds from lengths or a plain list of rows; no weights, empty samples.
  lengths = rng.integers(0, RAGGED_WIDTH["d_ragged"] + 1, 16)
  lengths[:2] = 0
  flat = rng.integers(0, vocab("d_ragged"), int(lengths.sum()))
  splits = np.concatenate([[0], np.cumsum(lengths)])
  rows = [flat[splits[b] : splits[b + 1]] for b in range(16)]
  inputs["d_ragged"] = RaggedIds.from_lengths(flat, lengths) if rng.random() < 0.5 else rows
  ones = [np.ones(len(r), np.float32) for r in rows]
  dense_ids, dense_w = _dense_rows(rows, ones, RAGGED_WIDTH["d_ragged"])
  ids["d_ragged"], weights["d_ragged"] = dense_ids, dense_w

  # d_dense: a one-column-wider dense feature on the same table.
  x = rng.integers(0, vocab("d_dense"), (32, 2))
  inputs["d_dense"], ids["d_dense"] = x, x
  weights["d_dense"] = np.ones((32, 2), np.float32)
  return RawBatch(inputs, ids, weights)


# --- dense references ---------------------------------------------------------


def _combiner_scale(combiner: str, weights: np.ndarray, xp=np):
  """c_b per sample: 1 (sum), 1 / sum w (mean), 1 / sqrt(sum w^2) (sqrtn); 0 if empty."""
  if combiner == "sum":
    return xp.ones(weights.shape[0], weights.dtype)
  if combiner == "mean":
    denominator = weights.sum(axis=1)
  else:
    denominator = xp.sqrt((weights**2).sum(axis=1))
  return xp.where(denominator > 0, 1.0 / xp.where(denominator > 0, denominator, 1.0), 0.0)


def _dense_activations(tables: dict[str, np.ndarray], raw: RawBatch, features) -> dict:
  """a_f[b] = c_b * sum_j w_j T[i_j] over the raw (not deduplicated) ids; numpy."""
  out = {}
  for feature in features:
    ids, w = raw.ids[feature.name], raw.weights[feature.name].astype(np.float64)
    valid = ids != PADDING_ID
    rows = tables[feature.table.name][np.where(valid, ids, 0)].astype(np.float64)  # [B, L, D]
    w = np.where(valid, w, 0.0)
    scale = _combiner_scale(feature.table.combiner, w)
    out[feature.name] = scale[:, None] * np.einsum("bl,bld->bd", w, rows)
  return out


@functools.lru_cache(maxsize=None)
def _dense_grad_fn(readers: tuple[tuple[str, str, str], ...]):
  """jit(grad) of L = sum_f <A_f, a_f> over the full logical tables (a dense jnp lookup).

  Args:
    readers: (feature, table, combiner) of every feature.
  """
  table_of = {feature: table for feature, table, _ in readers}
  combiners = {feature: combiner for feature, _, combiner in readers}

  def loss(tables, ids, weights, act_grads):
    total = 0.0
    for name, feature_ids in ids.items():
      valid = feature_ids != PADDING_ID
      w = jnp.where(valid, weights[name], 0.0)
      rows = jnp.take(tables[table_of[name]], jnp.where(valid, feature_ids, 0), axis=0)
      scale = _combiner_scale(combiners[name], w, jnp)
      activations = scale[:, None] * jnp.einsum("bl,bld->bd", w, rows)
      total = total + jnp.vdot(act_grads[name], activations)
    return total

  return jax.jit(jax.grad(loss))


def _dense_table_grads(tables: dict, raw: RawBatch, features, act_grads: dict) -> dict:
  """dL/dT for L = sum_f <A_f, a_f>, over the full logical tables."""
  readers = tuple((f.name, f.table.name, f.table.combiner) for f in features)
  grads = _dense_grad_fn(readers)(
      {k: np.asarray(v, np.float32) for k, v in tables.items()},
      {k: v.astype(np.int32) for k, v in raw.ids.items()},
      raw.weights,
      act_grads,
  )
  return {k: np.asarray(v, np.float64) for k, v in grads.items()}


def _touched_rows(raw: RawBatch, features) -> dict[str, np.ndarray]:
  touched: dict[str, set] = {}
  for feature in features:
    ids = raw.ids[feature.name]
    touched.setdefault(feature.table.name, set()).update(ids[ids != PADDING_ID].tolist())
  return {k: np.array(sorted(v), np.int64) for k, v in touched.items()}


# --- reading the library's state ---------------------------------------------


@dataclasses.dataclass
class Snapshot:
  """Host copies of the variables: stacked and logical (per table)."""

  stacked_tables: dict[str, np.ndarray]
  stacked_slots: dict[str, dict[str, np.ndarray]]
  tables: dict[str, np.ndarray]
  slots: dict[str, dict[str, np.ndarray]]  # slot name -> table name -> array


def _snapshot(plan: EmbeddingPlan, variables: EmbeddingVariables) -> Snapshot:
  stacked_tables = {k: np.asarray(v) for k, v in variables.tables.items()}
  stacked_slots = {
      stack: {name: np.asarray(v) for name, v in slots.items()}
      for stack, slots in variables.slots.items()
  }
  tables = unstack(stacked_tables, plan.layout)
  slots = {}
  for slot in plan.optimizer(plan.layout.stacks[0].name).slots():
    per_stack = {stack: stacked_slots[stack][slot.name] for stack in stacked_slots}
    slots[slot.name] = unstack(per_stack, plan.layout, row_width=slot.width)
  return Snapshot(stacked_tables, stacked_slots, tables, slots)


def _padding_rows(plan: EmbeddingPlan) -> dict[str, np.ndarray]:
  """Stack -> bool [V_s]: rows that hold no logical row of any table."""
  out = {}
  for stack in plan.layout.stacks:
    used = np.zeros(stack.vocabulary_size, bool)
    for table in stack.tables:
      used[logical_to_global_rows(plan.layout, table.name, np.arange(table.vocabulary_size))] = True
    out[stack.name] = ~used
  return out


def _activation_grads(rng: np.random.Generator, features) -> dict[str, np.ndarray]:
  """Random A_f; every 5th sample's is zero, so some touched rows get a zero gradient
  (they are still updated: their slots move, as in the references)."""
  grads = {f.name: rng.normal(size=f.output_shape).astype(np.float32) for f in features}
  for value in grads.values():
    value[::5] = 0.0
  return grads


# --- one run of the library ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Trajectory:
  """A few steps of lookup + update on the library, recorded on the host.

  Attributes:
    batches: the raw batch of every step (step EMPTY_STEP has no ids at all).
    grads: the activation gradients A_f of every step.
    activations: the lookup of every step, before its update.
    snapshots: the state before the first step, then after every step.
  """

  plan: EmbeddingPlan
  features: tuple[FeatureSpec, ...]
  batches: tuple[RawBatch, ...]
  grads: tuple[dict, ...]
  activations: tuple[dict, ...]
  snapshots: tuple[Snapshot, ...]


NUM_STEPS = 4
EMPTY_STEP = 2


@functools.lru_cache(maxsize=None)
def _trajectory(opt_name: str, geometry: str, combiners: str) -> Trajectory:
  """Runs NUM_STEPS steps; the batches depend on the optimizer and combiners
  only, so runs on different device geometries see the same data."""
  features = _features(OPTIMIZERS[opt_name].spec, COMBINERS[combiners])
  plan = _plan(features, *GEOMETRIES[geometry])
  lookup, update = _jitted(plan)
  rng = np.random.default_rng(zlib.crc32(f"{opt_name}/{combiners}".encode()))
  variables = init_embedding_variables(plan, jax.random.key(7))
  snapshots = [_snapshot(plan, variables)]
  batches, grads, activations = [], [], []
  for step in range(NUM_STEPS):
    raw = _empty_batch(features) if step == EMPTY_STEP else _random_batch(rng, features)
    batch, stats = preprocess(raw.inputs, features, plan.layout, padding_id=PADDING_ID)
    assert stats.num_dropped_ids == 0
    acts = lookup(variables.tables, batch)
    activations.append({k: np.asarray(v) for k, v in acts.items()})
    act_grads = _activation_grads(rng, features)
    variables = update(variables, batch, act_grads, step)
    snapshots.append(_snapshot(plan, variables))
    batches.append(raw)
    grads.append(act_grads)
  return Trajectory(
      plan, features, tuple(batches), tuple(grads), tuple(activations), tuple(snapshots)
  )


def _empty_batch(features) -> RawBatch:
  """Every feature in its input form, without a single id."""
  inputs, ids, weights = {}, {}, {}
  for feature in features:
    batch = feature.batch_size
    width = feature.input_shape[1] or RAGGED_WIDTH[feature.name]
    dense = np.full((batch, width), PADDING_ID, np.int64)
    ids[feature.name], weights[feature.name] = dense, np.zeros((batch, width), np.float32)
    if feature.name == "b_coo":
      inputs[feature.name] = SparseIds(
          np.zeros((0, 2), np.int64), np.zeros(0, np.int64), (batch, width), np.zeros(0, np.float32)
      )
    elif feature.input_shape[1] is None:
      inputs[feature.name] = RaggedIds.from_lengths(
          np.zeros(0, np.int64), np.zeros(batch, np.int64)
      )
    else:
      inputs[feature.name] = dense
  return RawBatch(inputs, ids, weights)


# --- the conformance test -------------------------------------------------------

CONFORMANCE = [
    ("sgd", "8x4", "sum-mean"),
    ("adagrad", "8x2", "sqrtn-sum"),
    ("rowwise_adagrad", "1x1", "mean-sqrtn"),
    ("rowwise_adagrad", "8x2", "mean-sqrtn"),
    ("adagrad_momentum", "8x4", "sqrtn-sum"),
    ("adam", "1x1", "sqrtn-sum"),
    ("adam", "8x1", "sqrtn-sum"),
    ("laprop", "8x1", "mean-sqrtn"),
    ("ftrl", "1x1", "mean-sqrtn"),
    ("ftrl", "8x4", "mean-sqrtn"),
    ("custom", "8x2", "sum-mean"),
]


def _assert_rows_equal(actual: np.ndarray, expected: np.ndarray, rows: np.ndarray, what: str):
  assert_same_bits(actual[rows], expected[rows], err_msg=what)


def _sum_terms(features) -> int:
  """The longest float32 sum behind a value: all ids of a batch on one table
  (each may add to the same row's gradient)."""
  per_table: dict[str, int] = {}
  for f in features:
    width = f.input_shape[1] or RAGGED_WIDTH[f.name]
    per_table[f.table.name] = per_table.get(f.table.name, 0) + f.batch_size * width
  return max(per_table.values())


@pytest.mark.parametrize("opt_name, geometry, combiners", CONFORMANCE)
def test_lookup_and_update_match_dense_reference(opt_name, geometry, combiners):
  opt = OPTIMIZERS[opt_name]
  run = _trajectory(opt_name, geometry, combiners)
  plan, features = run.plan, run.features
  assert [len(stack.tables) for stack in plan.layout.stacks] == [2, 1]
  padding = _padding_rows(plan)

  initial = run.snapshots[0]
  # Real random tables (never all zeros), zero padding rows, slots at their
  # declared initial values.
  for name, table in initial.tables.items():
    assert table.std() > 0.01, name
  for stack, rows in padding.items():
    assert rows.any() and np.all(initial.stacked_tables[stack][rows] == 0)
  assert set(initial.slots) == set(opt.initial)
  for slot, (width, value) in opt.initial.items():
    for name, array in initial.slots[slot].items():
      assert np.all(array == np.float32(value)), (slot, name)
      assert array.shape[1] == (initial.tables[name].shape[1] if width is None else width)

  terms = _sum_terms(features)
  ref_tables = {k: v.astype(np.float64) for k, v in initial.tables.items()}
  ref_slots = {
      slot: {k: v.astype(np.float64) for k, v in per_table.items()}
      for slot, per_table in initial.slots.items()
  }
  for step, raw in enumerate(run.batches):
    before, after = run.snapshots[step], run.snapshots[step + 1]

    # Lookup: numpy gathers of the current logical tables, combined per sample.
    expected = _dense_activations(before.tables, raw, features)
    assert set(run.activations[step]) == {f.name for f in features}
    for feature in features:
      got = run.activations[step][feature.name]
      assert got.shape == feature.output_shape and got.dtype == np.float32
      assert_close(
          got, expected[feature.name], terms=terms, steps=step + 1,
          err_msg=f"lookup of {feature.name!r} at step {step}",
      )

    # Update: dense autodiff gradient, textbook rule on exactly the touched rows.
    dense_grads = _dense_table_grads(ref_tables, raw, features, run.grads[step])
    touched = _touched_rows(raw, features)
    lr = _lr(opt.spec, step)
    for name in ref_tables:
      rows = touched.get(name, np.zeros(0, np.int64))
      if rows.size:
        state = {slot: ref_slots[slot][name][rows] for slot in ref_slots}
        new_rows, new_state = opt.reference(
            ref_tables[name][rows], dense_grads[name][rows], state, step, lr,
            ref_tables[name].shape[1],
        )
        ref_tables[name][rows] = new_rows
        for slot in ref_slots:
          ref_slots[slot][name][rows] = new_state[slot]
      context = f"table {name!r} after step {step}"
      # Untouched rows and their slots: bit for bit.
      untouched = np.ones(ref_tables[name].shape[0], bool)
      untouched[rows] = False
      _assert_rows_equal(after.tables[name], before.tables[name], untouched, context)
      for slot in ref_slots:
        _assert_rows_equal(
            after.slots[slot][name], before.slots[slot][name], untouched, f"{slot}, {context}"
        )
      assert_close(after.tables[name], ref_tables[name], terms=terms, steps=step + 1,
                   err_msg=context)
      for slot in ref_slots:
        assert_close(
            after.slots[slot][name], ref_slots[slot][name], terms=terms, steps=step + 1,
            err_msg=f"slot {slot!r} of {context}",
        )
    # Padding rows of the stacked arrays are never written.
    for stack, rows in padding.items():
      _assert_rows_equal(after.stacked_tables[stack], before.stacked_tables[stack], rows, stack)
      for slot, value in after.stacked_slots[stack].items():
        _assert_rows_equal(value, before.stacked_slots[stack][slot], rows, f"{slot} of {stack}")

  # The empty step changed nothing at all, and looked up zeros.
  empty_before, empty_after = run.snapshots[EMPTY_STEP], run.snapshots[EMPTY_STEP + 1]
  for stack, table in empty_after.stacked_tables.items():
    assert_same_bits(table, empty_before.stacked_tables[stack])
    for slot, value in empty_after.stacked_slots[stack].items():
      assert_same_bits(value, empty_before.stacked_slots[stack][slot])
  assert all(np.all(a == 0) for a in run.activations[EMPTY_STEP].values())
  # The other steps really moved every table (the comparisons are not vacuous).
  for name, table in run.snapshots[-1].tables.items():
    assert np.abs(table - initial.tables[name]).max() > 1e-3, name


# --- 8 devices equal 1 device -------------------------------------------------


@pytest.mark.parametrize(
    "opt_name, geometry, combiners",
    [
        (opt_name, geometry, combiners)
        for opt_name, geometry, combiners in CONFORMANCE
        if geometry != "1x1" and (opt_name, "1x1", combiners) in CONFORMANCE
    ],
)
def test_eight_devices_equal_one_device(opt_name, geometry, combiners):
  one = _trajectory(opt_name, "1x1", combiners)
  eight = _trajectory(opt_name, geometry, combiners)
  # The same logical initial values, whatever the layout.
  for name, table in one.snapshots[0].tables.items():
    assert_same_bits(eight.snapshots[0].tables[name], table)
  # Another device count and shard count sum each row's gradient in another order.
  terms = _sum_terms(one.features)
  for step in range(NUM_STEPS):
    for name, value in one.activations[step].items():
      assert_close(eight.activations[step][name], value, terms=terms, steps=step + 1)
    a, b = one.snapshots[step + 1], eight.snapshots[step + 1]
    for name in a.tables:
      assert_close(b.tables[name], a.tables[name], terms=terms, steps=step + 1)
      for slot in a.slots:
        assert_close(b.slots[slot][name], a.slots[slot][name], terms=terms, steps=step + 1)


# --- the lookup's per-stack form (what the pipelined Trainer carries) --------------


@pytest.mark.parametrize("geometry", ["1x1", "8x2"])
@pytest.mark.parametrize("seed", [3, 4])
def test_stacked_lookup_holds_each_features_activations_in_its_rows(geometry, seed):
  """stacked_lookup is embedding_lookup before the cut into features: split,
  it gives the same activations (another program, so within the tolerance of
  its sums: XLA may fuse and order them otherwise, as on GPU), and it puts
  feature f's samples of device g at the rows the layout says; splitting and
  joining move data only, so they restore the stacked array bit for bit
  (padding columns are zeros)."""
  features = _features(SGD(0.5), ("sum", "mean"))
  plan = _plan(features, *GEOMETRIES[geometry])
  rng = np.random.default_rng(seed)
  variables = init_embedding_variables(plan, jax.random.key(seed))
  raw = _random_batch(rng, features)
  batch, _ = preprocess(raw.inputs, features, plan.layout, padding_id=PADDING_ID)
  tables = _snapshot(plan, variables).tables
  expected = _dense_activations(tables, raw, features)
  devices = plan.num_devices
  checked = []
  for name in available_backends(plan):
    backend = get_backend(name, plan)
    checked.append(name)
    # The same backend without its own per-stack lookup: joined from `lookup`.
    joined_backend = EmbeddingBackend(f"{name}-joined", backend.lookup, backend.apply_gradients)
    per_feature = jax.jit(lambda t, b: embedding_lookup(plan, t, b, backend=backend))(
        variables.tables, batch)
    for chosen in (backend, joined_backend):
      stacked = jax.jit(lambda t, b: stacked_lookup(plan, t, b, backend=chosen))(
          variables.tables, batch)
      split = jax.jit(lambda s: split_stacked_activations(plan, s))(stacked)
      assert set(split) == set(per_feature)
      for feature in features:
        assert_close(split[feature.name], per_feature[feature.name],
                     terms=_sum_terms(features))
        assert_close(split[feature.name], expected[feature.name],
                     terms=_sum_terms(features))
      for stack in plan.layout.stacks:
        array = np.asarray(stacked[stack.name])
        width = stack.padded_embedding_dim
        blocks = array.reshape(devices, -1, width)
        for feature in stack.features:
          spec = plan.feature(feature.name)
          per_device = feature.batch_size // devices
          start = feature.sample_offset // devices
          dim = spec.table.embedding_dim
          rows = blocks[:, start:start + per_device]
          assert_same_bits(rows[..., :dim].reshape(-1, dim),
                           np.asarray(split[feature.name]).reshape(-1, dim))
          assert not rows[..., dim:].any(), (stack.name, feature.name)
      again = jax.jit(lambda a: stack_activations(plan, a))(split)
      for stack_name, array in stacked.items():
        assert_same_bits(again[stack_name], array)
        assert again[stack_name].sharding.is_equivalent_to(array.sharding, array.ndim)
  assert checked == (["xla", "cpu"] if cpu_kernels_available() else ["xla"]), checked


@pytest.mark.parametrize("geometry", ["1x1", "8x2"])
@pytest.mark.parametrize("seed", [5, 6])
def test_apply_stacked_gradients_applies_the_gradients_of_each_features_rows(geometry, seed):
  """apply_stacked_gradients(G) applies split_stacked_activations(G): feature f's
  rows of G are its gradient and the columns beyond its D_f are ignored (here
  random, and row-wise Adagrad's squared norm would see them). Checked
  against the dense autodiff gradient with the textbook rule, and against
  apply_embedding_gradients of the split gradients: bit for bit on the C++
  kernels (the same inputs reach the same kernel), within the tolerance on
  the portable ops (XLA may fuse the masking into the sums). A backend
  without its own stacked update gets the split one."""
  opt = OPTIMIZERS["rowwise_adagrad"]
  features = _features(opt.spec, ("sum", "sqrtn"))
  plan = _plan(features, *GEOMETRIES[geometry])
  rng = np.random.default_rng(seed)
  raw = _random_batch(rng, features)
  batch, _ = preprocess(raw.inputs, features, plan.layout, padding_id=PADDING_ID)
  variables = init_embedding_variables(plan, jax.random.key(seed))
  initial = _snapshot(plan, variables)
  stacked_grads = {
      stack.name: rng.normal(size=(stack.total_batch_size, stack.padded_embedding_dim))
      .astype(np.float32)
      for stack in plan.layout.stacks
  }
  split = {k: np.asarray(v) for k, v in
           jax.jit(lambda g: split_stacked_activations(plan, g))(stacked_grads).items()}
  assert any(split[f.name].shape[-1] < s.padded_embedding_dim
             for s in plan.layout.stacks for f in s.features)  # padding columns exist

  dense_grads = _dense_table_grads(initial.tables, raw, features, split)
  touched = _touched_rows(raw, features)
  expected = {}
  for name, table in initial.tables.items():
    w, rows = table.astype(np.float64), touched[name]
    state = {slot: initial.slots[slot][name][rows].astype(np.float64) for slot in initial.slots}
    w[rows], _ = opt.reference(w[rows], dense_grads[name][rows], state, 0, _lr(opt.spec, 0),
                               w.shape[1])
    expected[name] = w
  terms = _sum_terms(features)

  def update(fn, backend):
    return jax.jit(lambda v, b, g: fn(plan, v, b, g, 0, backend=backend))(
        variables, batch, stacked_grads if fn is apply_stacked_gradients else split)

  checked = []
  for name in available_backends(plan):
    backend = get_backend(name, plan)
    assert backend.apply_stacked_gradients is not None, name
    per_feature = _snapshot(plan, update(apply_embedding_gradients, backend))
    without = EmbeddingBackend(f"{name}-split", backend.lookup, backend.apply_gradients)
    for chosen in (backend, without):
      got = _snapshot(plan, update(apply_stacked_gradients, chosen))
      for table, value in got.tables.items():
        assert_close(value, expected[table], terms=terms, err_msg=f"{chosen.name} {table}")
        assert np.abs(value - initial.tables[table]).max() > 1e-3, table
      compare = assert_same_bits if name == "cpu" else functools.partial(assert_close, terms=terms)
      for stack, value in got.stacked_tables.items():
        compare(value, per_feature.stacked_tables[stack], err_msg=f"{chosen.name} {stack}")
        for slot, array in got.stacked_slots[stack].items():
          compare(array, per_feature.stacked_slots[stack][slot], err_msg=f"{chosen.name} {slot}")
    checked.append(name)
  assert checked == (["xla", "cpu"] if cpu_kernels_available() else ["xla"]), checked


def test_apply_stacked_gradients_refuses_missing_or_misshapen_stacks():
  features = _features(SGD(0.5), ("sum", "mean"))
  plan = _plan(features, 1, 1)
  variables = init_embedding_variables(plan, jax.random.key(0))
  batch, _ = preprocess(_random_batch(np.random.default_rng(0), features).inputs, features,
                        plan.layout, padding_id=PADDING_ID)
  good = {s.name: jnp.ones((s.total_batch_size, s.padded_embedding_dim))
          for s in plan.layout.stacks}
  first, second = plan.layout.stack_names[:2]
  with pytest.raises(ValueError, match=rf"stacked_grads has stacks .*\(missing \['{second}'\]"):
    apply_stacked_gradients(plan, variables, batch, {first: good[first]}, 0)
  wrong = jnp.ones((3, 4))
  with pytest.raises(ValueError, match=rf"stacked_grads\['{first}'\] has shape \(3, 4\)"):
    apply_stacked_gradients(plan, variables, batch, {**good, first: wrong}, 0)
  with pytest.raises(ValueError, match=rf"stacked activations\['{first}'\] has shape \(3, 4\)"):
    split_stacked_activations(plan, {**good, first: wrong})


def test_stack_activations_refuses_missing_or_misshapen_features():
  features = _features(SGD(0.5), ("sum", "mean"))
  plan = _plan(features, 1, 1)
  good = {f.name: jnp.ones(f.output_shape) for f in features}
  with pytest.raises(ValueError, match=r"activations has features .*\(missing \['b_coo'\]"):
    stack_activations(plan, {k: v for k, v in good.items() if k != "b_coo"})
  with pytest.raises(ValueError, match=r"activations\['a_dense'\] has shape \(32, 3\)"):
    stack_activations(plan, {**good, "a_dense": jnp.ones((32, 3))})


# --- memory: the update is in place, temporaries O(batch), not O(table) ------------


@pytest.mark.parametrize("optimizer", [SGD(0.1), RowWiseAdagrad(0.1)], ids=lambda o: o.kind)
@pytest.mark.parametrize("num_devices", [1, 8])
def test_update_with_donation_needs_no_table_sized_temporaries(optimizer, num_devices):
  vocab, dim, batch_size = 200_000, 64, 16
  table = TableSpec(
      "big", vocab, dim, optimizer=optimizer,
      max_ids_per_partition=64, max_unique_ids_per_partition=64,
  )
  feature = FeatureSpec("ids", table, (batch_size, 4))
  plan = _plan((feature,), num_devices, 1)
  (stack,) = plan.layout.stacks
  ids = np.random.default_rng(0).integers(0, vocab, (batch_size, 4))
  batch, _ = preprocess({"ids": ids}, (feature,), plan.layout)
  sharding = plan.row_sharding()
  variables = EmbeddingVariables(
      {stack.name: jax.ShapeDtypeStruct(stack.shape, jnp.float32, sharding=sharding)},
      {stack.name: {
          slot.name: jax.ShapeDtypeStruct(
              (stack.vocabulary_size, slot.stacked_width(stack.padded_embedding_dim)),
              jnp.float32, sharding=sharding,
          )
          for slot in optimizer.slots()
      }},
  )
  grads = {"ids": jax.ShapeDtypeStruct((batch_size, dim), jnp.float32)}
  _, update = _jitted(plan)
  memory = update.lower(variables, batch, grads, jnp.int32(0)).compile().memory_analysis()
  assert memory is not None
  # Bytes of the table (and slots) held by one device.
  table_bytes = stack.vocabulary_size * stack.padded_embedding_dim * 4 // num_devices
  state_bytes = table_bytes + sum(
      stack.vocabulary_size * slot.stacked_width(stack.padded_embedding_dim) * 4 // num_devices
      for slot in optimizer.slots()
  )
  assert table_bytes > 6_000_000
  # Donated state is updated in place: every output aliases its input ...
  assert memory.alias_size_in_bytes >= state_bytes
  # ... and no temporary is anywhere near the size of the table.
  assert memory.temp_size_in_bytes < 0.1 * table_bytes, (
      f"temp {memory.temp_size_in_bytes} bytes vs {table_bytes} bytes of table per device"
  )


# --- compilation: the training step compiles once ------------------------------------


def test_training_step_compiles_once():
  run = _trajectory("adam", "8x1", "sqrtn-sum")  # reuses its plan and initial state
  plan, features = run.plan, run.features

  @functools.partial(jax.jit, donate_argnums=0)
  def train_step(variables, batch, step):
    def loss(activations):
      return sum(jnp.sum(a**2) for a in activations.values())

    activations = embedding_lookup(plan, variables.tables, batch)
    act_grads = jax.grad(loss)(activations)
    return apply_embedding_gradients(plan, variables, batch, act_grads, step), loss(activations)

  initial = run.snapshots[0]
  variables = jax.device_put(
      EmbeddingVariables(initial.stacked_tables, initial.stacked_slots), plan.row_sharding()
  )
  rng = np.random.default_rng(5)
  losses = []
  for step in range(3):
    raw = _random_batch(rng, features)
    batch, _ = preprocess(raw.inputs, features, plan.layout, padding_id=PADDING_ID)
    variables, value = train_step(variables, batch, jnp.int32(step))
    losses.append(float(value))
    assert train_step._cache_size() == 1, f"recompiled at step {step}"
  assert len(set(losses)) == 3  # different content, same executable


def test_eager_calls_compile_one_program_per_stack():
  """Outside jit each primitive is one compiled program per stack, not one per op.

  (Eager shard_map compiles every op of its body: one update took seconds.)
  The eager results equal the jitted ones.
  """
  run = _trajectory("adam", "8x1", "sqrtn-sum")
  plan, features = run.plan, run.features
  initial = run.snapshots[0]
  variables = jax.device_put(
      EmbeddingVariables(initial.stacked_tables, initial.stacked_slots), plan.row_sharding())
  raw = _random_batch(np.random.default_rng(11), features)
  batch, _ = preprocess(raw.inputs, features, plan.layout, padding_id=PADDING_ID)
  grads = {name: jnp.asarray(g)
           for name, g in _activation_grads(np.random.default_rng(12), features).items()}

  def eager_calls(step):
    return (embedding_lookup(plan, variables.tables, batch),
            apply_embedding_gradients(plan, variables, batch, grads, step))

  with count_compiles() as compiles:
    eager_activations, eager_update = eager_calls(3)
    first_call = len(compiles)
    # The same plan and shapes again (another step): every program is reused.
    repeated = jax.tree.map(np.asarray, eager_calls(4))
  # One program per stack and primitive, plus a few small ones (reshapes, the step's cast).
  assert first_call <= 2 * len(plan.layout.stacks) + 6, first_call
  assert len(compiles) == first_call, f"{len(compiles) - first_call} compilations on the second call"
  jax.tree.map(assert_same_bits, repeated[0], jax.tree.map(np.asarray, eager_activations))
  jitted_activations = jax.jit(lambda t, b: embedding_lookup(plan, t, b))(variables.tables, batch)
  jitted_update = jax.jit(lambda v, b, g: apply_embedding_gradients(plan, v, b, g, 3))(
      variables, batch, grads)
  jax.tree.map(lambda a, b: assert_close(a, b, terms=_sum_terms(features)),
               (eager_activations, eager_update), (jitted_activations, jitted_update))


def test_an_eager_grad_through_the_lookup_compiles_once_and_gives_the_jitted_gradient():
  """Under an eager jax.grad the lookup ran its shard_map op by op, compiling every op at
  every call (seconds per call); it now reuses one program, as eager calls do."""
  run = _trajectory("adam", "8x1", "sqrtn-sum")
  plan, features = run.plan, run.features
  initial = run.snapshots[0]
  tables = jax.device_put(initial.stacked_tables, plan.row_sharding())
  raw = _random_batch(np.random.default_rng(13), features)
  batch, _ = preprocess(raw.inputs, features, plan.layout, padding_id=PADDING_ID)

  def loss(tables):
    return sum(jnp.sum(jnp.tanh(a)) for a in embedding_lookup(plan, tables, batch).values())

  jax.grad(loss)(tables)  # compiles
  with count_compiles() as compiles:
    eager = jax.grad(loss)(tables)
  assert len(compiles) <= 2 * len(plan.layout.stacks), compiles
  jitted = jax.jit(jax.grad(loss))(tables)
  jax.tree.map(lambda a, b: assert_close(a, b, terms=_sum_terms(features)), eager, jitted)


@pytest.mark.parametrize("opt_name, geometry, dtype", [
    ("sgd", "1x1", jnp.float32),  # no slots
    ("rowwise_adagrad", "8x2", jnp.bfloat16),  # a slot one value wide
    ("ftrl", "8x2", jnp.float32),  # two slots of the table's width
    ("custom", "1x1", jnp.bfloat16),  # slots of both widths
])
def test_variable_shapes_are_those_of_the_initialised_variables(opt_name, geometry, dtype):
  """The restore template describes exactly what initialisation creates: every table and
  slot, with its shape, dtype and sharding."""
  plan = _plan(_features(OPTIMIZERS[opt_name].spec, COMBINERS["sum-mean"]), *GEOMETRIES[geometry])
  created = init_embedding_variables(plan, jax.random.key(3), dtype=dtype)
  shapes = embedding_variable_shapes(plan, dtype=dtype)
  assert jax.tree.structure(shapes) == jax.tree.structure(created)

  def same(template, array):
    assert (template.shape, template.dtype) == (array.shape, array.dtype)
    assert template.sharding.is_equivalent_to(array.sharding, array.ndim)

  jax.tree.map(same, shapes, created)


def test_a_plan_refuses_a_layout_that_contradicts_its_specs():
  from sc_framework.stacking import stack_tables

  def specs(optimizer_b):
    a = TableSpec("a", 50, 8, optimizer=Adagrad(0.1))
    b = TableSpec("b", 60, 8, optimizer=optimizer_b)
    return [FeatureSpec("fa", a, (8, 2)), FeatureSpec("fb", b, (8, 2))]

  mesh = Mesh(np.array(jax.devices()[:2]), ("devices",))
  layout = stack_tables(specs(Adagrad(0.1)), [["a", "b"]], num_devices=2)
  EmbeddingPlan.create(specs(Adagrad(0.1)), mesh=mesh, layout=layout)  # fits
  with pytest.raises(ValueError, match="tables 'a' and 'b' cannot share a stack"):
    EmbeddingPlan.create(specs(Adagrad(0.5)), mesh=mesh, layout=layout)


def test_a_plan_refuses_shards_per_device_that_disagrees_with_its_layout():
  from sc_framework.stacking import auto_stack_tables

  table = TableSpec("a", 50, 8, optimizer=Adagrad(0.1))
  specs = [FeatureSpec("fa", table, (8, 2))]
  mesh = Mesh(np.array(jax.devices()[:2]), ("devices",))
  layout = auto_stack_tables(specs, num_devices=2, shards_per_device=4)
  for agreeing in ({}, {"shards_per_device": 4}):
    plan = EmbeddingPlan.create(specs, mesh=mesh, layout=layout, **agreeing)
    assert plan.layout.shards_per_device == 4
  with pytest.raises(ValueError, match=r"shards_per_device=1 disagrees.*S=4"):
    EmbeddingPlan.create(specs, mesh=mesh, shards_per_device=1, layout=layout)
  assert EmbeddingPlan.create(specs, mesh=mesh).layout.shards_per_device == 1
