"""`NnxSparseEmbed` and the NNX train step against independent references.

The NNX twin of `test_linen`: the same model (embedding layer -> MLP) trains a
few steps with `make_nnx_train_step` and an `nnx.Optimizer`, on 1 device and
on 8 devices with 2 shards each, replayed step by step by
`flax_reference.Reference`. The Linen layer, started from the NNX model's
values, must follow the same trajectory.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import flax_reference as ref
from tests.compiles import count_compiles
from tests.numerics import assert_close, assert_same_bits
from sc_framework.flax import (
    EmbeddingVariable,
    LinenTrainState,
    NnxSparseEmbed,
    make_linen_train_step,
    make_nnx_train_step,
)

GEOMETRIES = {"1x1": (1, 1), "8x2": (8, 2)}
SEEDS = (0, 1)
STEPS = 3


class Model(nnx.Module):
  """Embedding layer -> relu(x W1 + b1) W2 + b2; returns (prediction, activations)."""

  def __init__(self, num_devices: int, shards_per_device: int, *, rngs: nnx.Rngs):
    self.embed = NnxSparseEmbed(
        ref.FEATURES, mesh=ref.mesh(num_devices), shards_per_device=shards_per_device, rngs=rngs
    )
    self.hidden = nnx.Linear(ref.WIDTH, ref.HIDDEN, bias_init=nnx.initializers.normal(1.0), rngs=rngs)
    self.out = nnx.Linear(ref.HIDDEN, 1, bias_init=nnx.initializers.normal(1.0), rngs=rngs)

  def __call__(self, batch):
    activations = self.embed(batch)
    x = jnp.concatenate([activations[f.name] for f in ref.FEATURES], axis=-1)
    return self.out(nnx.relu(self.hidden(x)))[:, 0], activations


def loss_fn(model, batch, labels):
  prediction, activations = model(batch)
  return jnp.mean((prediction - labels) ** 2), activations


def mlp_params(model: Model) -> dict:
  return {
      "w1": np.asarray(model.hidden.kernel.get_value()),
      "b1": np.asarray(model.hidden.bias.get_value()),
      "w2": np.asarray(model.out.kernel.get_value()),
      "b2": np.asarray(model.out.bias.get_value()),
  }


def copy_tree(tree):
  return jax.tree.map(jnp.copy, tree)


@functools.cache
def trained(geometry: str) -> dict:
  """Trains the model per seed; records actual and expected values per step."""
  num_devices, shards = GEOMETRIES[geometry]
  step = make_nnx_train_step(loss_fn)
  records, plan = {}, None
  with count_compiles("jit(_pure_step)") as compiled:
    for seed in SEEDS:
      model = Model(num_devices, shards, rngs=nnx.Rngs(seed))
      plan = model.embed.plan
      optimizer = nnx.Optimizer(model, ref.DENSE_TX, wrt=nnx.Param)
      initial = {
          "params": mlp_params(model),
          "embedding": jax.tree.map(np.asarray, model.embed.embedding_state()),
      }
      reference = ref.Reference(plan, copy_tree(model.embed.embedding_variables()), initial["params"])
      trace = []
      for k in range(STEPS):
        raw, labels = ref.raw_batch(1000 * seed + k + 1)
        batch = ref.preprocessed(raw, plan.layout)
        expected = reference.train_step(raw, batch, labels)
        loss, activations = step(model, optimizer, batch, labels)
        trace.append(
            {
                "expected": expected,
                "loss": float(loss),
                "activations": jax.tree.map(np.asarray, activations),
                "params": mlp_params(model),
                "variables": jax.tree.map(np.asarray, model.embed.embedding_variables()),
                "step": int(model.embed.step.get_value()),
            }
        )
      records[seed] = {"trace": trace, "initial": initial, "model": model}
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
  for _, k, entry in _each_step(run):
    ref.assert_trees_close(entry["variables"], entry["expected"]["variables"], steps=k + 1)
    assert entry["step"] == entry["expected"]["step"] == k + 1
    tags = ref.logical_tables(plan, entry["variables"].tables)["tags"]
    assert_close(tags, entry["expected"]["tags_sgd"], terms=ref.TERMS, steps=k + 1)


def test_embedding_variables_are_apart_from_params(run):
  model = run["records"][0]["model"]
  params = nnx.state(model, nnx.Param)
  embedding = nnx.state(model, EmbeddingVariable)
  assert set(params.keys()) == {"hidden", "out"}
  assert set(embedding.keys()) == {"embed"}
  plan = run["plan"]
  for stack in plan.layout.stacks:
    table = model.embed.tables[stack.name].get_value()
    assert table.sharding.is_equivalent_to(plan.row_sharding(), 2)
    rows = {shard.data.shape[0] for shard in table.addressable_shards}
    assert rows == {stack.vocabulary_size // plan.num_devices}


def test_step_compiles_once(run):
  """Two models (seeds) x three batches of different content: one compilation."""
  assert run["compiles"] == 1


def test_eight_devices_equal_one_device():
  run, one = trained("8x2"), trained("1x1")
  for seed, record in run["records"].items():
    # The dense initialisation sums nothing: the same bits on any device count.
    jax.tree.map(assert_same_bits, record["initial"]["params"],
                 one["records"][seed]["initial"]["params"])
    final, other = record["trace"][-1], one["records"][seed]["trace"][-1]
    # Another device count reorders the sums of every step.
    assert_close(final["loss"], other["loss"], terms=ref.TERMS, steps=STEPS)
    ref.assert_trees_close(final["params"], other["params"], steps=STEPS)
    ref.assert_trees_close(
        ref.logical_tables(run["plan"], final["variables"].tables),
        ref.logical_tables(one["plan"], other["variables"].tables),
        steps=STEPS,
    )


def test_linen_layer_follows_the_same_trajectory():
  """LinenSparseEmbed, started from the NNX model's values, gives the same steps."""
  from test_linen import Model as LinenModel
  from test_linen import loss_fn as linen_loss_fn

  run = trained("1x1")
  record = run["records"][0]
  initial = record["initial"]
  params = {
      "hidden": {"kernel": initial["params"]["w1"], "bias": initial["params"]["b1"]},
      "out": {"kernel": initial["params"]["w2"], "bias": initial["params"]["b2"]},
  }
  state = LinenTrainState(
      jax.tree.map(jnp.asarray, params),
      ref.DENSE_TX.init(params),
      {"embed": jax.tree.map(jnp.asarray, initial["embedding"])},
  )
  step = make_linen_train_step(LinenModel(1, 1), ref.DENSE_TX, linen_loss_fn)
  for k, entry in enumerate(record["trace"]):
    raw, labels = ref.raw_batch(k + 1)
    state, (loss, activations) = step(state, ref.preprocessed(raw, run["plan"].layout), labels)
    # Another program (Linen, not NNX) on the same layout: XLA may fuse the sums differently.
    assert_close(float(loss), entry["loss"], terms=ref.TERMS, steps=k + 1)
    ref.assert_trees_close(jax.tree.map(np.asarray, activations), entry["activations"], steps=k + 1)
    layer = state.embedding["embed"]
    ref.assert_trees_close((layer["tables"], layer["slots"]), tuple(entry["variables"]), steps=k + 1)


class NoisyModel(nnx.Module):
  """Embedding layer -> BatchNorm -> Dropout -> Linear: the loss updates non-parameter state."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.embed = NnxSparseEmbed(ref.FEATURES, mesh=ref.mesh(1), rngs=rngs)
    self.norm = nnx.BatchNorm(ref.WIDTH, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)
    self.out = nnx.Linear(ref.WIDTH, 1, rngs=rngs)

  def __call__(self, batch):
    activations = self.embed(batch)
    x = jnp.concatenate([activations[f.name] for f in ref.FEATURES], axis=-1)
    return self.out(self.drop(self.norm(x)))[:, 0]


def test_state_updated_by_the_loss_is_kept():
  model = NoisyModel(rngs=nnx.Rngs(0, dropout=1))
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  step = make_nnx_train_step(lambda m, batch, labels: jnp.mean((m(batch) - labels) ** 2))
  mean_before = np.asarray(model.norm.mean.get_value())
  with count_compiles("jit(_pure_step)") as compiled:
    for k in range(STEPS):
      raw, labels = ref.raw_batch(k)
      assert np.isfinite(float(step(model, optimizer, ref.preprocessed(raw, model.embed.plan.layout), labels)))
  assert len(compiled) == 1
  assert np.any(np.asarray(model.norm.mean.get_value()) != mean_before)  # the batch stats moved
  assert int(model.drop.rngs.count.get_value()) == STEPS
  assert int(model.embed.step.get_value()) == STEPS


def test_layer_takes_shards_per_device_from_its_layout():
  layout = NnxSparseEmbed(ref.FEATURES, mesh=ref.mesh(2), shards_per_device=4,
                          rngs=nnx.Rngs(0)).plan.layout
  embed = NnxSparseEmbed(ref.FEATURES, mesh=ref.mesh(2), layout=layout, rngs=nnx.Rngs(0))
  assert embed.plan.layout == layout
  with pytest.raises(ValueError, match=r"shards_per_device=1 disagrees.*S=4"):
    NnxSparseEmbed(ref.FEATURES, mesh=ref.mesh(2), shards_per_device=1, layout=layout,
                   rngs=nnx.Rngs(0))


def test_layer_outside_the_model_is_an_error():
  run = trained("1x1")
  model = run["records"][0]["model"]
  stray = NnxSparseEmbed(ref.FEATURES, mesh=ref.mesh(1), rngs=nnx.Rngs(3))
  raw, labels = ref.raw_batch(99)
  batch = ref.preprocessed(raw, run["plan"].layout)

  def loss_with_stray(m, batch, labels):
    return loss_fn(m, batch, labels)[0] + jnp.sum(stray(batch)["user"])

  optimizer = nnx.Optimizer(model, ref.DENSE_TX, wrt=nnx.Param)
  with pytest.raises(ValueError, match="not part of the model"):
    make_nnx_train_step(loss_with_stray)(model, optimizer, batch, labels)


def test_calling_a_layer_twice_in_one_step_is_an_error():
  run = trained("1x1")
  model = run["records"][0]["model"]
  raw, labels = ref.raw_batch(99)
  batch = ref.preprocessed(raw, run["plan"].layout)

  def twice(m, batch, labels):
    return loss_fn(m, batch, labels)[0] + loss_fn(m, batch, labels)[0]

  optimizer = nnx.Optimizer(model, ref.DENSE_TX, wrt=nnx.Param)
  with pytest.raises(ValueError, match="'embed' was called twice"):
    make_nnx_train_step(twice)(model, optimizer, batch, labels)


class BigModel(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    self.embed = NnxSparseEmbed(ref.BIG_FEATURES, mesh=ref.mesh(1), rngs=rngs)
    self.out = nnx.Linear(ref.BIG.embedding_dim, 1, rngs=rngs)

  def __call__(self, batch):
    return self.out(self.embed(batch)["big_ids"])[:, 0]


def test_train_step_forms_no_table_sized_gradient():
  model = BigModel(rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  batch, labels = ref.big_batch(model.embed.plan.layout)
  step = make_nnx_train_step(lambda m, batch, labels: jnp.mean((m(batch) - labels) ** 2))
  ref.assert_no_table_sized_buffers(step.lower(model, optimizer, batch, labels).compile())
