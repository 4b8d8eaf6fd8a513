"""The Flax layers in training steps users write themselves, against numpy references.

Users who do not take `make_linen_train_step` as it is build their own jitted
step from `linen_value_and_grad` and `apply_linen_embedding_grads` (the
helpers' own advice for a model with other variable collections), or feed
the helper batches of their own making. Each case here once went wrong
without an error.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import flax_reference as ref
from sc_framework import FeatureSpec, TableSpec
from sc_framework.flax import _grads
from sc_framework.flax import (
    LinenSparseEmbed,
    NnxSparseEmbed,
    apply_linen_embedding_grads,
    init_linen_train_state,
    linen_value_and_grad,
    make_linen_train_step,
    make_nnx_train_step,
)
from sc_framework.optimizers import SGD
from sc_framework.preprocessing import DenseIds, preprocess
from sc_framework.stacking import auto_stack_tables
from tests.numerics import assert_close

MOMENTUM = 0.75


class NormalizedModel(nn.Module):
  """Embedding layer -> BatchNorm (collection "batch_stats") -> Dense."""

  num_devices: int

  @nn.compact
  def __call__(self, batch, train: bool):
    activations = LinenSparseEmbed(ref.FEATURES, mesh=ref.mesh(self.num_devices), name="embed")(
        batch)
    x = jnp.concatenate([activations[f.name] for f in ref.FEATURES], axis=-1)
    x = nn.BatchNorm(use_running_average=not train, momentum=MOMENTUM, name="norm")(x)
    return nn.Dense(1, name="out")(x)[:, 0]


def _normalized_loss(apply, batch, labels):
  prediction, updates = apply(batch, train=True, mutable=["batch_stats"])
  return jnp.mean((prediction - labels) ** 2), dict(updates)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("num_devices", [1, 8])
def test_linen_value_and_grad_carries_the_models_other_collections(num_devices, seed):
  """BatchNorm's running statistics follow their momentum from step to step.

  `linen_value_and_grad` gave `model.apply` only "params" and "embedding": a
  loss updating "batch_stats" got statistics re-created from their initial
  values at every step, so the running averages never accumulated (silently).
  """
  model = NormalizedModel(num_devices)
  plan = LinenSparseEmbed(ref.FEATURES, mesh=ref.mesh(num_devices)).plan
  layout = plan.layout
  raw, _ = ref.raw_batch(10 * seed)
  variables = model.init(jax.random.key(seed), ref.preprocessed(raw, layout), train=False)
  rng = np.random.default_rng(seed)
  stats = jax.tree.map(lambda x: jnp.asarray(rng.uniform(0.5, 2.0, x.shape), x.dtype),
                       variables["batch_stats"])
  params, embedding = variables["params"], variables["embedding"]
  value_and_grad = linen_value_and_grad(model, _normalized_loss)

  @functools.partial(jax.jit, donate_argnums=(1, 2))
  def step(params, embedding, stats, batch, labels):
    (loss, updates), _, embedding_grads = value_and_grad(
        params, embedding, batch, labels, collections={"batch_stats": stats})
    return loss, apply_linen_embedding_grads(embedding, embedding_grads), updates["batch_stats"]

  for k in range(2):
    raw, labels = ref.raw_batch(10 * seed + k + 1)
    logical = ref.logical_tables(plan, embedding["embed"]["tables"])
    x = np.concatenate([ref.numpy_activations(logical, raw)[f.name] for f in ref.FEATURES], -1)
    expected_mean = MOMENTUM * np.asarray(stats["norm"]["mean"]) + (1 - MOMENTUM) * x.mean(0)
    expected_var = MOMENTUM * np.asarray(stats["norm"]["var"]) + (1 - MOMENTUM) * x.var(0)
    _, embedding, stats = step(params, embedding, stats, ref.preprocessed(raw, layout), labels)
    assert_close(stats["norm"]["mean"], expected_mean, terms=ref.TERMS)
    assert_close(stats["norm"]["var"], expected_var, terms=2 * ref.TERMS)


def test_linen_value_and_grad_refuses_params_or_embedding_as_collections():
  model = NormalizedModel(1)
  value_and_grad = linen_value_and_grad(model, _normalized_loss)
  with pytest.raises(ValueError, match=r"collections= holds \['params'\], which are given as"):
    value_and_grad({}, {}, None, None, collections={"params": {}, "batch_stats": {}})


def test_the_linen_step_refuses_a_batch_of_another_plan_with_the_same_shapes():
  """Another vocabulary, same G, N and capacities: the jitted step once trained nothing."""
  users = TableSpec("users", 64, 8, optimizer=SGD(0.1))
  features = (FeatureSpec("user", users, (ref.BATCH, 2)),)
  other_users = TableSpec("users", 4000, 8, optimizer=SGD(0.1))
  other = (FeatureSpec("user", other_users, (ref.BATCH, 2)),)
  mesh = ref.mesh(8)

  class Model(nn.Module):
    @nn.compact
    def __call__(self, batch):
      return nn.Dense(1)(LinenSparseEmbed(features, mesh=mesh)(batch)["user"])[:, 0]

  def loss_fn(apply, batch):
    return jnp.mean(apply(batch) ** 2)

  ids = {"user": DenseIds(np.arange(2 * ref.BATCH).reshape(ref.BATCH, 2) % 64)}
  batch, _ = preprocess(ids, features, auto_stack_tables(features, num_devices=8))
  theirs, _ = preprocess(ids, other, auto_stack_tables(other, num_devices=8))
  model, tx = Model(), optax.sgd(0.1)
  state = init_linen_train_state(model, tx, jax.random.key(0), batch)
  step = make_linen_train_step(model, tx, loss_fn)
  state, _ = step(state, batch)
  with pytest.raises(ValueError, match=r"LinenSparseEmbed 'LinenSparseEmbed_0': batch\['users'\]"
                                       r" was preprocessed for another layout.*table 'users'"
                                       r" vocabulary_size 4000 \(batch\) vs 64 \(plan\)"):
    step(state, theirs)


class _NnxModel(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    self.embed = NnxSparseEmbed(ref.FEATURES, mesh=ref.mesh(1), rngs=rngs)
    self.out = nnx.Linear(ref.WIDTH, 1, rngs=rngs)

  def __call__(self, batch):
    activations = self.embed(batch)
    return self.out(jnp.concatenate([activations[f.name] for f in ref.FEATURES], -1))[:, 0]


@pytest.mark.parametrize("wrt", [nnx.Variable, ...], ids=["Variable", "everything"])
def test_the_nnx_step_refuses_an_optimizer_that_holds_the_tables(wrt):
  """An optimizer over every variable kept optax state as large as the tables, and the
  step then failed inside optax with a pytree structure error naming neither."""
  model = _NnxModel(rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=wrt)
  step = make_nnx_train_step(lambda model, batch: jnp.mean(model(batch) ** 2))
  raw, _ = ref.raw_batch(0)
  batch = ref.preprocessed(raw, model.embed.plan.layout)
  with pytest.raises(ValueError, match=r"nnx.Optimizer's wrt=.* selects the EmbeddingVariables"
                                       r" .* of the embedding layers \['embed'\].*"
                                       r" wrt=nnx.Param\)"):
    step(model, optimizer, batch)
  model = _NnxModel(rngs=nnx.Rngs(0))
  step(model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param), batch)


class _EmbedBlock(nn.Module):
  @nn.compact
  def __call__(self, batch):
    return LinenSparseEmbed(ref.FEATURES, mesh=ref.mesh(1), name="embed")(batch)


class _DenseBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(1, name="out")(nn.tanh(nn.Dense(ref.HIDDEN, name="hidden")(x)))[:, 0]


class _Ranker(nn.Module):
  """The embedding block, then the dense block (rematerialised if `remat_dense`)."""

  remat_dense: bool = False

  @nn.compact
  def __call__(self, batch):
    dense = nn.remat(_DenseBlock) if self.remat_dense else _DenseBlock
    activations = _EmbedBlock(name="block")(batch)
    return dense(name="head")(jnp.concatenate([activations[f.name] for f in ref.FEATURES], -1))


def _squared_loss(apply, batch, labels):
  return jnp.mean((apply(batch) - labels) ** 2)


def _tracer_traces_readable() -> bool:
  """Whether this JAX exposes the private trace identity the refusal below reads (where
  it does not, the refusal stands aside and JAX's own error is raised)."""
  seen = []

  def probe(x):
    state = _grads._trace_state()
    seen.append(getattr(state, "_trace_ref", None) is not None
                and getattr(getattr(x, "_trace", None), "_weakref", None) is not None)
    return x

  jax.jit(probe)(1.0)
  return seen == [True]


needs_trace_identity = pytest.mark.skipif(
    not _tracer_traces_readable(), reason="this JAX does not expose a tracer's trace")


@needs_trace_identity
@pytest.mark.parametrize("transform", ["remat", "jit"])
def test_a_linen_layer_inside_a_transform_of_the_loss_is_refused_by_name(transform):
  """Under nn.remat the layer handed the step its transform's tracers: JAX then failed
  when the step ran, with an UnexpectedTracerError naming neither the layer nor why."""
  raw, labels = ref.raw_batch(3)

  class Wrapped(nn.Module):
    @nn.compact
    def __call__(self, batch):
      lifted = {"remat": nn.remat, "jit": nn.jit}[transform](_EmbedBlock)
      activations = lifted(name="block")(batch)
      return jnp.concatenate([activations[f.name] for f in ref.FEATURES], -1).sum(-1)

  model, tx = Wrapped(), optax.sgd(0.1)
  batch = ref.preprocessed(raw, LinenSparseEmbed(ref.FEATURES, mesh=ref.mesh(1)).plan.layout)
  state = init_linen_train_state(model, tx, jax.random.key(0), batch)
  step = make_linen_train_step(model, tx, _squared_loss)
  with pytest.raises(ValueError, match=r"embedding layer 'block/embed' was called inside a"
                                       r" transform of the loss .* dense part of the model only"):
    step(state, batch, labels)


def _checkpointed_loss(apply, batch, labels):
  """The whole loss under jax.checkpoint, which closes over the batch (worked before the
  refusal above, and must still)."""
  return jax.checkpoint(lambda: _squared_loss(apply, batch, labels))()


@pytest.mark.parametrize("seed", [0, 1])
def test_remat_of_the_dense_part_trains_as_without_it(seed):
  """The advice of the refusal above works: the same steps, the same values; so does a
  checkpoint of the whole loss that closes over the batch."""
  raw_batches = [ref.raw_batch(10 * seed + k) for k in range(3)]
  layout = LinenSparseEmbed(ref.FEATURES, mesh=ref.mesh(1)).plan.layout
  batches = [(ref.preprocessed(raw, layout), labels) for raw, labels in raw_batches]
  results = []
  for remat_dense, loss_fn in ((False, _squared_loss), (True, _squared_loss),
                               (False, _checkpointed_loss)):
    model, tx = _Ranker(remat_dense), optax.adam(0.01)
    state = init_linen_train_state(model, tx, jax.random.key(seed), batches[0][0])
    step = make_linen_train_step(model, tx, loss_fn)
    losses = []
    for batch, labels in batches:
      state, loss = step(state, batch, labels)
      losses.append(loss)
    results.append((losses, state.embedding))
  (plain_losses, plain_tables), *others = results
  for losses, tables in others:
    assert_close(np.array(losses), np.array(plain_losses), terms=ref.TERMS, steps=3)
    ref.assert_trees_close(tables, plain_tables, steps=3)


@needs_trace_identity
def test_an_nnx_layer_inside_nnx_remat_is_refused_by_name():
  model = _NnxModel(rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  raw, labels = ref.raw_batch(0)
  batch = ref.preprocessed(raw, model.embed.plan.layout)

  def loss_fn(model, batch, labels):
    activations = nnx.remat(lambda embed, batch: embed(batch))(model.embed, batch)
    x = jnp.concatenate([activations[f.name] for f in ref.FEATURES], -1)
    return jnp.mean((model.out(x)[:, 0] - labels) ** 2)

  step = make_nnx_train_step(loss_fn)
  with pytest.raises(ValueError, match=r"embedding layer NnxSparseEmbed \(a copy an NNX"
                                       r" transform made\) was called inside a transform"):
    step(model, optimizer, batch, labels)


def test_a_loss_closing_over_the_steps_batch_may_checkpoint_the_whole_loss():
  """A user's step whose loss closes over the step's batch (not passed as data): its
  tracers belong to the step's trace, not to the checkpoint's, and the step may use them.
  (A first version of the refusal above refused it.)"""
  raw, labels = ref.raw_batch(5)
  layout = LinenSparseEmbed(ref.FEATURES, mesh=ref.mesh(1)).plan.layout
  batch = ref.preprocessed(raw, layout)
  model = _Ranker()
  state = init_linen_train_state(model, optax.sgd(0.1), jax.random.key(5), batch)

  @functools.partial(jax.jit, static_argnums=4)
  def gradients(params, embedding, batch, labels, checkpoint):
    def loss_fn(apply, labels):
      def loss():
        return _squared_loss(apply, batch, labels)
      return jax.checkpoint(loss)() if checkpoint else loss()

    loss, param_grads, embedding_grads = linen_value_and_grad(model, loss_fn)(
        params, embedding, labels)
    return loss, param_grads, {k: g.activation_grads for k, g in embedding_grads.items()}

  plain, checkpointed = (gradients(state.params, state.embedding, batch, labels, checkpoint)
                         for checkpoint in (False, True))
  ref.assert_trees_close(checkpointed, plain, steps=1)


def test_a_top_level_layer_is_named_as_such_in_its_errors():
  """A layer applied on its own has the empty key: errors read "LinenSparseEmbed ''"."""
  users = TableSpec("users", 64, 8, optimizer=SGD(0.1))
  features = (FeatureSpec("user", users, (ref.BATCH, 2)),)
  layer = LinenSparseEmbed(features, mesh=ref.mesh(8))
  ids = np.arange(2 * ref.BATCH).reshape(ref.BATCH, 2) % 64
  batch, _ = preprocess({"user": DenseIds(ids)}, features, layer.plan.layout)
  variables = layer.init(jax.random.key(0), batch)
  with pytest.raises(TypeError, match=r"^LinenSparseEmbed \(the top-level module\): batch must"):
    layer.apply(variables, {"user": ids})
