"""`LinenSparseEmbed` and the Linen train step against independent references.

A small Linen model (embedding layer -> MLP) trains a few steps with
`make_linen_train_step`, on 1 device and on 8 devices with 2 shards each.
Every step is replayed by `flax_reference.Reference`: numpy lookups of the
logical tables, `jax.grad` of a hand-written jnp MLP at those activations with
the same optax transformation, and the primitives called directly for the
tables (plus a numpy SGD reference for one table).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import flax_reference as ref
from tests.compiles import count_compiles
from tests.numerics import assert_close
from sc_framework.flax import (
    EMBEDDING_COLLECTION,
    LinenSparseEmbed,
    init_linen_train_state,
    make_linen_train_step,
)
from sc_framework.primitives import EmbeddingVariables, embedding_lookup

GEOMETRIES = {"1x1": (1, 1), "8x2": (8, 2)}
SEEDS = (0, 1)
STEPS = 3


class Model(nn.Module):
  """Embedding layer -> relu(x W1 + b1) W2 + b2; returns (prediction, activations)."""

  num_devices: int
  shards_per_device: int

  @nn.compact
  def __call__(self, batch):
    activations = LinenSparseEmbed(
        ref.FEATURES,
        mesh=ref.mesh(self.num_devices),
        shards_per_device=self.shards_per_device,
        name="embed",
    )(batch)
    x = jnp.concatenate([activations[f.name] for f in ref.FEATURES], axis=-1)
    random_bias = nn.initializers.normal(1.0)
    hidden = nn.relu(nn.Dense(ref.HIDDEN, bias_init=random_bias, name="hidden")(x))
    return nn.Dense(1, bias_init=random_bias, name="out")(hidden)[:, 0], activations


def loss_fn(apply, batch, labels):
  prediction, activations = apply(batch)
  return jnp.mean((prediction - labels) ** 2), activations


def mlp_params(params) -> dict:
  return {
      "w1": params["hidden"]["kernel"],
      "b1": params["hidden"]["bias"],
      "w2": params["out"]["kernel"],
      "b2": params["out"]["bias"],
  }


def embedding_variables(state) -> EmbeddingVariables:
  layer = state.embedding["embed"]
  return EmbeddingVariables(layer["tables"], layer["slots"])


def placement(embedding) -> dict:
  """Each embedding array's sharding and the row counts of its device blocks."""
  return {
      name: (array.sharding, sorted(shard.data.shape[0] for shard in array.addressable_shards))
      for name, array in jax.tree_util.tree_leaves_with_path(embedding["embed"])
      if array.ndim == 2
  }


def copy_tree(tree):
  return jax.tree.map(jnp.copy, tree)


@functools.cache
def trained(geometry: str) -> dict:
  """Trains the model per seed; records actual and expected values per step."""
  num_devices, shards = GEOMETRIES[geometry]
  model = Model(num_devices, shards)
  plan = LinenSparseEmbed(ref.FEATURES, mesh=ref.mesh(num_devices), shards_per_device=shards).plan
  step = make_linen_train_step(model, ref.DENSE_TX, loss_fn)
  records = {}
  with count_compiles("jit(step)") as compiled:
    for seed in SEEDS:
      raw, _ = ref.raw_batch(1000 * seed)
      state = init_linen_train_state(
          model, ref.DENSE_TX, jax.random.key(seed), ref.preprocessed(raw, plan.layout)
      )
      initial_placement = placement(state.embedding)
      reference = ref.Reference(plan, copy_tree(embedding_variables(state)), mlp_params(state.params))
      trace = []
      for k in range(STEPS):
        raw, labels = ref.raw_batch(1000 * seed + k + 1)
        batch = ref.preprocessed(raw, plan.layout)
        expected = reference.train_step(raw, batch, labels)
        state, (loss, activations) = step(state, batch, labels)
        trace.append(
            {
                "expected": expected,
                "loss": float(loss),
                "activations": jax.tree.map(np.asarray, activations),
                "params": jax.tree.map(np.asarray, mlp_params(state.params)),
                "variables": jax.tree.map(np.asarray, embedding_variables(state)),
                "step": int(state.embedding["embed"]["step"]),
            }
        )
      records[seed] = {"trace": trace, "state": state, "initial_placement": initial_placement}
  return {"plan": plan, "step": step, "records": records, "compiles": len(compiled)}


@pytest.fixture(params=list(GEOMETRIES))
def run(request):
  return trained(request.param)


def _each_step(run):
  for seed, record in run["records"].items():
    for k, entry in enumerate(record["trace"]):
      yield seed, k, entry


def test_activations_match_numpy_and_primitives(run):
  for seed, k, entry in _each_step(run):
    expected = entry["expected"]
    for name, act in entry["activations"].items():
      # Tables after k reordered updates; a combiner sum of a few ids.
      assert_close(act, expected["numpy_activations"][name], terms=ref.TERMS, steps=k + 1,
                   err_msg=f"seed {seed} step {k} feature {name}")
      assert_close(act, expected["primitive_activations"][name], terms=ref.TERMS, steps=k + 1)
    assert_close(entry["loss"], expected["loss"], terms=ref.TERMS, steps=k + 1)


def test_dense_params_match_optax_reference(run):
  for _, k, entry in _each_step(run):
    ref.assert_trees_close(entry["params"], entry["expected"]["params"], steps=k + 1)


def test_tables_and_slots_match_primitives(run):
  plan = run["plan"]
  for seed, k, entry in _each_step(run):
    ref.assert_trees_close(entry["variables"], entry["expected"]["variables"], steps=k + 1)
    assert entry["step"] == entry["expected"]["step"] == k + 1
    tags = ref.logical_tables(plan, entry["variables"].tables)["tags"]
    assert_close(tags, entry["expected"]["tags_sgd"], terms=ref.TERMS, steps=k + 1)
    initial = ref.logical_tables(plan, run["records"][seed]["trace"][0]["expected"]["variables"].tables)
    assert all(np.abs(t).max() > 0 for t in initial.values())  # random, never zero


def test_tables_are_sharded_by_rows(run):
  plan = run["plan"]
  rows = {stack.vocabulary_size // plan.num_devices for stack in plan.layout.stacks}
  for record in run["records"].values():
    for arrays in (record["initial_placement"], placement(record["state"].embedding)):
      assert len(arrays) == 4  # two tables, Adam's two slots
      for sharding, blocks in arrays.values():
        assert sharding.is_equivalent_to(plan.row_sharding(), 2)
        assert len(blocks) == plan.num_devices and len(set(blocks)) == 1 and blocks[0] in rows


def test_step_compiles_once(run):
  """Two models (seeds) x three batches of different content: one compilation."""
  assert run["compiles"] == 1


def test_eight_devices_equal_one_device():
  run, one = trained("8x2"), trained("1x1")
  for seed, record in run["records"].items():
    final, other = record["trace"][-1], one["records"][seed]["trace"][-1]
    # Another device count reorders the sums of every step.
    assert_close(final["loss"], other["loss"], terms=ref.TERMS, steps=STEPS)
    ref.assert_trees_close(final["params"], other["params"], steps=STEPS)
    ref.assert_trees_close(
        ref.logical_tables(run["plan"], final["variables"].tables),
        ref.logical_tables(one["plan"], other["variables"].tables),
        steps=STEPS,
    )


def _final_state_and_batch():
  run = trained("1x1")
  raw, labels = ref.raw_batch(99)
  return run["records"][0]["state"], ref.preprocessed(raw, run["plan"].layout), labels


def test_calling_a_layer_twice_in_one_step_is_an_error():
  state, batch, labels = _final_state_and_batch()

  def twice(apply, batch, labels):
    return loss_fn(apply, batch, labels)[0] + loss_fn(apply, batch, labels)[0]

  step = make_linen_train_step(Model(1, 1), ref.DENSE_TX, twice)
  with pytest.raises(ValueError, match="'embed' was called twice"):
    step(state, batch, labels)


def test_batch_of_another_layout_is_an_error():
  state, batch, _ = _final_state_and_batch()
  variables = {"params": state.params, EMBEDDING_COLLECTION: state.embedding}
  partial = dict(list(batch.items())[:1])
  with pytest.raises(ValueError, match=r"missing \['tags'\]"):
    Model(1, 1).apply(variables, partial)


def test_layer_takes_shards_per_device_from_its_layout():
  layout = LinenSparseEmbed(ref.FEATURES, mesh=ref.mesh(2), shards_per_device=4).plan.layout
  assert LinenSparseEmbed(ref.FEATURES, mesh=ref.mesh(2), layout=layout).plan.layout == layout
  with pytest.raises(ValueError, match=r"shards_per_device=1 disagrees.*S=4"):
    LinenSparseEmbed(ref.FEATURES, mesh=ref.mesh(2), shards_per_device=1, layout=layout).plan


def test_apply_without_the_embedding_collection_is_an_error():
  state, batch, _ = _final_state_and_batch()
  with pytest.raises(ValueError, match="no 'embedding' variables"):
    Model(1, 1).apply({"params": state.params}, batch)


class BigModel(nn.Module):
  @nn.compact
  def __call__(self, batch):
    activations = LinenSparseEmbed(ref.BIG_FEATURES, mesh=ref.mesh(1), name="embed")(batch)
    return nn.Dense(1)(activations["big_ids"])[:, 0]


def test_train_step_forms_no_table_sized_gradient():
  model = BigModel()
  plan = LinenSparseEmbed(ref.BIG_FEATURES, mesh=ref.mesh(1)).plan
  batch, labels = ref.big_batch(plan.layout)
  tx = optax.sgd(0.1)
  state = init_linen_train_state(model, tx, jax.random.key(0), batch)

  def mse(apply, batch, labels):
    return jnp.mean((apply(batch) - labels) ** 2)

  step = make_linen_train_step(model, tx, mse)
  ref.assert_no_table_sized_buffers(step.lower(state, batch, labels).compile())

  # The measurement does see a table-sized gradient when there is one.
  def table_gradient_step(tables, batch):
    loss = lambda t: jnp.sum(embedding_lookup(plan, t, batch)["big_ids"] ** 2)
    return jax.tree.map(lambda t, g: t - g, tables, jax.grad(loss)(tables))

  tables = state.embedding["embed"]["tables"]
  naive = jax.jit(table_gradient_step, donate_argnums=0).lower(tables, batch).compile()
  assert naive.memory_analysis().temp_size_in_bytes >= ref.BIG_TABLE_BYTES
