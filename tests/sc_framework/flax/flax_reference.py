"""Shared model, data and independent references for the Flax layer tests.

The test model: three features over three tables (two stacks: users + items
share Adam and the mean combiner; tags uses SGD and the sum combiner), their
activations concatenated into a two-layer MLP, squared error against labels.

References, all computed without the layers under test:
  * activations: numpy gathers of the logical tables (read back with
    `unstack`) combined per sample;
  * dense parameters: `jax.grad` of a jnp MLP written out here, at the
    reference activations, then the same optax transformation;
  * tables: the primitives called directly (`apply_embedding_gradients` with
    the reference activation gradients), and for the SGD table a numpy
    scatter-add of the gradients.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from sc_framework import FeatureSpec, TableSpec
from sc_framework.optimizers import SGD, Adam
from sc_framework.preprocessing import DenseIds, preprocess
from sc_framework.primitives import EmbeddingPlan, apply_embedding_gradients, embedding_lookup
from sc_framework.stacking import unstack
from tests.numerics import assert_close

BATCH = 16
HIDDEN = 8
TAGS_LR = 0.3
DENSE_TX = optax.adam(0.02)

USERS = TableSpec("users", 50, 8, optimizer=Adam(0.05), combiner="mean")
ITEMS = TableSpec("items", 40, 6, optimizer=Adam(0.05), combiner="mean")
TAGS = TableSpec("tags", 30, 4, optimizer=SGD(TAGS_LR), combiner="sum")
FEATURES = (
    FeatureSpec("user", USERS, (BATCH, 3)),
    FeatureSpec("item", ITEMS, (BATCH, 2)),
    FeatureSpec("tag", TAGS, (BATCH, 4)),
)
WIDTH = sum(f.table.embedding_dim for f in FEATURES)
# The longest float32 sum behind one value: a table row's gradient sums every
# (sample, id) occurrence of a batch, BATCH * 4 terms (more than the MLP's
# fan-in WIDTH or the batch mean of the loss). Comparisons of another device
# count, layer or reference reorder such sums (tests/numerics.py).
TERMS = BATCH * max(f.input_shape[1] for f in FEATURES)


def mesh(num_devices: int) -> Mesh:
  return Mesh(np.array(jax.devices()[:num_devices]), ("devices",))


def raw_batch(seed: int):
  """Random ids (with repeats) and positive weights per feature, and labels."""
  rng = np.random.default_rng(seed)
  raw = {}
  for f in FEATURES:
    ids = rng.integers(0, f.table.vocabulary_size, size=f.input_shape)
    weights = rng.uniform(0.5, 2.0, size=f.input_shape).astype(np.float32)
    raw[f.name] = (ids, weights)
  labels = rng.normal(size=BATCH).astype(np.float32)
  return raw, labels


def preprocessed(raw, layout):
  batch, _ = preprocess({n: DenseIds(i, w) for n, (i, w) in raw.items()}, FEATURES, layout)
  return batch


def numpy_activations(logical: Mapping[str, np.ndarray], raw) -> dict[str, np.ndarray]:
  """a_f[b] = sum_j w_j T[i_j] (sum) or that over sum_j w_j (mean)."""
  out = {}
  for f in FEATURES:
    ids, weights = raw[f.name]
    rows = logical[f.table.name][ids].astype(np.float64)  # [B, L, D]
    act = (weights[..., None] * rows).sum(axis=1)
    if f.table.combiner == "mean":
      act = act / weights.sum(axis=1, keepdims=True)
    out[f.name] = act
  return out


def mlp(params: Mapping[str, jax.Array], activations: Mapping[str, jax.Array]) -> jax.Array:
  """relu(x W1 + b1) W2 + b2 with x the features' activations side by side."""
  x = jnp.concatenate([activations[f.name] for f in FEATURES], axis=-1)
  hidden = jax.nn.relu(x @ params["w1"] + params["b1"])
  return (hidden @ params["w2"] + params["b2"])[:, 0]


def _reference_loss(params, activations, labels):
  return jnp.mean((mlp(params, activations) - labels) ** 2)


@jax.jit
def _reference_dense_step(params, opt_state, activations, labels):
  """The loss, dL/da, and the optax update of the MLP at given activations."""
  loss, (param_grads, act_grads) = jax.value_and_grad(_reference_loss, argnums=(0, 1))(
      params, activations, labels
  )
  updates, opt_state = DENSE_TX.update(param_grads, opt_state, params)
  return loss, optax.apply_updates(params, updates), opt_state, act_grads


@functools.partial(jax.jit, static_argnums=0)
def primitive_lookup(plan: EmbeddingPlan, tables, batch):
  return embedding_lookup(plan, tables, batch)


@functools.partial(jax.jit, static_argnums=0)
def primitive_update(plan: EmbeddingPlan, variables, batch, grads, step):
  return apply_embedding_gradients(plan, variables, batch, grads, step)


def logical_tables(plan: EmbeddingPlan, tables: Mapping[str, jax.Array]) -> dict[str, np.ndarray]:
  return unstack({k: np.asarray(v) for k, v in tables.items()}, plan.layout)


def sgd_tags_reference(logical_tags: np.ndarray, raw, tag_grads: np.ndarray) -> np.ndarray:
  """T[i] -= lr * sum over (b, j) with i_bj = i of w_bj * dL/da[b] (sum combiner)."""
  ids, weights = raw["tag"]
  grads = np.zeros_like(logical_tags, dtype=np.float64)
  np.add.at(grads, ids.reshape(-1), (weights[..., None] * tag_grads[:, None, :]).reshape(-1, tag_grads.shape[1]))
  return logical_tags - TAGS_LR * grads


class Reference:
  """Trains the same model by calling the primitives and jnp/optax directly."""

  def __init__(self, plan: EmbeddingPlan, variables, params: Mapping[str, jax.Array]):
    self.plan = plan
    self.variables = variables
    self.params = {k: np.asarray(v) for k, v in params.items()}
    self.opt_state = jax.tree.map(np.asarray, DENSE_TX.init(self.params))
    self.step = 0

  def train_step(self, raw, batch, labels) -> dict:
    """One step. Returns what the step should produce, and cross-checks.

    Returns a dict with the reference loss, the numpy and the primitives'
    activations (before the step), the dense parameters, embedding variables
    and step after it, and the numpy SGD reference of the "tags" table.
    """
    logical = logical_tables(self.plan, self.variables.tables)
    numpy_acts = numpy_activations(logical, raw)
    primitive_acts = primitive_lookup(self.plan, self.variables.tables, batch)
    acts32 = {k: v.astype(np.float32) for k, v in numpy_acts.items()}
    loss, self.params, self.opt_state, act_grads = jax.tree.map(
        np.asarray, _reference_dense_step(self.params, self.opt_state, acts32, labels)
    )
    tags_sgd = sgd_tags_reference(logical["tags"], raw, np.asarray(act_grads["tag"]))
    self.variables = primitive_update(self.plan, self.variables, batch, act_grads, self.step)
    self.step += 1
    return {
        "loss": float(loss),
        "numpy_activations": numpy_acts,
        "primitive_activations": jax.tree.map(np.asarray, primitive_acts),
        "params": self.params,
        "variables": jax.tree.map(np.asarray, self.variables),
        "step": self.step,
        "tags_sgd": tags_sgd,
    }


def assert_trees_close(actual, expected, *, steps: int, terms: int = TERMS):
  """Leaf by leaf `assert_close`: the same values up to reordered float32 sums."""
  jax.tree.map(
      lambda a, e: assert_close(np.asarray(a), np.asarray(e), terms=terms, steps=steps),
      actual,
      expected,
  )


# --- a model whose table dwarfs every per-step buffer (memory tests) --------

BIG = TableSpec(
    "big", 1 << 16, 32, optimizer=Adam(0.01), max_ids_per_partition=128,
    max_unique_ids_per_partition=128,
)
BIG_FEATURES = (FeatureSpec("big_ids", BIG, (32, 4)),)
BIG_TABLE_BYTES = BIG.vocabulary_size * BIG.embedding_dim * 4


def big_batch(layout):
  rng = np.random.default_rng(7)
  ids = rng.integers(0, BIG.vocabulary_size, size=BIG_FEATURES[0].input_shape)
  batch, _ = preprocess({"big_ids": ids}, BIG_FEATURES, layout)
  return batch, rng.normal(size=BIG_FEATURES[0].batch_size).astype(np.float32)


def assert_no_table_sized_buffers(compiled) -> None:
  """The step's temporaries are far below one table; tables and slots update in place."""
  stats = compiled.memory_analysis()
  assert stats.temp_size_in_bytes < BIG_TABLE_BYTES / 16, stats
  # The table and Adam's two slots are donated and written in place.
  assert stats.alias_size_in_bytes >= 3 * BIG_TABLE_BYTES, stats
