"""The compiled steps: the pipelined step updates the tables in place; the Trainer's
steps and the Flax layers' train step are one composition with one loss convention."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import linen as nn
from flax import nnx

from pipelining import Trainer
from sc_framework import FeatureSpec, TableSpec
from sc_framework.flax import (
    LinenSparseEmbed,
    LinenTrainState,
    NnxSparseEmbed,
    make_linen_train_step,
    make_nnx_train_step,
)
from sc_framework.optimizers import SGD, Adagrad, RowWiseAdagrad
from test_trainer import BATCH, LinearHead, make_batches, make_specs, mesh_of, mse
from tests.numerics import assert_close

VOCAB = 100_000


def large_table_trainer(optimizer, devices):
  a = TableSpec("a", VOCAB, 4, optimizer=optimizer, max_ids_per_partition=64,
                max_unique_ids_per_partition=64)
  # Dimension 12 pads to 16, so b gets a stack of its own: two stacks.
  b = TableSpec("b", VOCAB, 12, optimizer=optimizer, max_ids_per_partition=64,
                max_unique_ids_per_partition=64)
  specs = [FeatureSpec("fa", a, (BATCH, 3)), FeatureSpec("fb", b, (BATCH, 2)),
           FeatureSpec("fa2", a, (BATCH, 1))]
  return Trainer(LinearHead(), specs, mse, optax.sgd(0.1), mesh=mesh_of(devices),
                 progress="off", padding_id=-1)


# The three update paths (fused SGD, fused row-wise Adagrad, the generic rule) on
# 8 devices, where the exchange adds buffers; one of them on a single device.
@pytest.mark.parametrize("optimizer, devices", [
    (SGD(0.1), 1), (SGD(0.1), 8), (RowWiseAdagrad(0.1), 8), (Adagrad(0.1), 8)],
    ids=["sgd-1", "sgd-8", "rowwise_adagrad-8", "adagrad-8"])
def test_pipelined_step_keeps_no_copy_of_the_tables(optimizer, devices):
  """The lookup of batch k+1 reads the tables that the update of batch k then
  writes in place; the program must order the two instead of copying tables."""
  trainer = large_table_trainer(optimizer, devices)
  batches = make_batches(2, seed=50)
  trainer.initialize(batches[0])
  first, second = trainer.prepare(batches[0]), trainer.prepare(batches[1])
  in_flight = trainer._steps.prime(trainer.state, first)
  table_bytes = sum(
      shard.data.nbytes
      for table in trainer.state.embeddings.tables.values()
      for shard in table.addressable_shards[:1])
  assert len(trainer.plan.layout.stacks) == 2
  assert table_bytes >= VOCAB * (8 + 16) * 4 // devices  # padded dims 8 and 16, float32
  for name, step, args in (
      ("pipelined", trainer._steps.pipelined_jit,
       (trainer.state, in_flight.stacked_activations, first, second)),
      ("sync", trainer._steps.sync, (trainer.state, first)),
  ):
    temp = step.lower(*args).compile().memory_analysis().temp_size_in_bytes
    smallest_table = min(
        table.addressable_shards[0].data.nbytes
        for table in trainer.state.embeddings.tables.values())
    assert temp < smallest_table, (name, temp, smallest_table)  # a copy needs a whole table



def test_pipelined_step_copies_no_in_flight_activation():
  """The in-flight activations are read by the dense step while the lookup of
  the next batch writes new ones: they must not be donated to the step, or XLA
  copies every one of them each step before reusing its buffer."""
  trainer = large_table_trainer(SGD(0.1), 1)
  batches = make_batches(2, seed=51)
  trainer.initialize(batches[0])
  first, second = trainer.prepare(batches[0]), trainer.prepare(batches[1])
  in_flight = trainer._steps.prime(trainer.state, first)
  text = trainer._steps.pipelined_jit.lower(
      trainer.state, in_flight.stacked_activations, first, second).compile().as_text()
  parameters = {line.split(" = ")[0].strip().lstrip("%") for line in text.splitlines()
                if " parameter(" in line and "activations" in line.split(" = ")[0]}
  assert len(parameters) == len(in_flight.stacked_activations) == len(trainer.plan.layout.stacks)
  copied = [line.strip() for line in text.splitlines()
            if " copy(" in line and any(f"copy(%{name})" in line for name in parameters)]
  assert not copied, copied


# --- one composition: the Trainer and the Flax layers' train step ------------------


class Composed(nn.Module):
  """The Trainer's dense model under the embedding layer, as one Linen model."""

  specs: tuple
  mesh: jax.sharding.Mesh

  @nn.compact
  def __call__(self, sparse, dense):
    activations = LinenSparseEmbed(self.specs, mesh=self.mesh, name="embed")(sparse)
    return LinearHead(name="head")(activations, dense)


def mse_and_mae(predictions, labels):
  return mse(predictions, labels), {"mae": jnp.mean(jnp.abs(predictions - labels))}


def copied(tree):
  return jax.tree.map(jnp.copy, tree)


@pytest.mark.parametrize("devices", [1, 8])
@pytest.mark.parametrize("optimizer", [SGD(0.3), Adagrad(0.3)], ids=["sgd", "adagrad"])
def test_trainer_and_linen_train_step_agree(optimizer, devices):
  """The same dense model, tables, data and loss (with aux) trained by the
  Trainer (synchronous) and by make_linen_train_step on a model that contains
  LinenSparseEmbed: both are built from one step core and must agree."""
  specs, tx, batches = tuple(make_specs(optimizer)), optax.adam(0.05), make_batches(4, seed=60)
  mesh = mesh_of(devices)
  trainer = Trainer(LinearHead(), specs, mse_and_mae, tx, mesh=mesh, pipelining=False,
                    progress="off", padding_id=-1)
  trainer.initialize(batches[0])
  model = Composed(specs, mesh)
  layer_plan = LinenSparseEmbed(specs, mesh=mesh).plan
  assert layer_plan.layout == trainer.plan.layout
  start = trainer.state
  params = {"head": copied(start.params)}
  state = LinenTrainState(params, jax.jit(tx.init)(params), {"embed": {
      "tables": copied(start.embeddings.tables), "slots": copied(start.embeddings.slots),
      "step": jnp.copy(start.step)}})
  step = make_linen_train_step(
      model, tx, lambda apply, sparse, dense, labels: mse_and_mae(apply(sparse, dense), labels))
  flax_metrics = []
  for raw in batches:
    batch = trainer.prepare(raw)
    state, (loss, aux) = step(state, batch.sparse, batch.dense, batch.labels)
    flax_metrics.append({"loss": float(loss), **{k: float(v) for k, v in aux.items()}})
  history = trainer.fit(batches)

  # Longest sum behind an element: a row's gradient gathers every occurrence
  # of its id in the batch (4 ids per sample of table a, 8 samples).
  terms, steps = 4 * BATCH, len(batches)
  assert [sorted(m) for m in history.metrics] == [["loss", "mae"]] * len(batches)
  for mine, theirs in zip(history.metrics, flax_metrics):
    for name in ("loss", "mae"):
      assert_close(mine[name], theirs[name], terms=terms, steps=steps, err_msg=name)
  layer = state.embedding["embed"]
  for name in trainer.state.embeddings.tables:
    assert_close(trainer.state.embeddings.tables[name], layer["tables"][name],
                 terms=terms, steps=steps, err_msg=name)
  slots = jax.tree_util.tree_leaves_with_path(trainer.state.embeddings.slots)
  for (path, mine), theirs in zip(slots, jax.tree.leaves(layer["slots"])):
    assert_close(mine, theirs, terms=terms, steps=steps, err_msg=jax.tree_util.keystr(path))
  for (path, mine), theirs in zip(jax.tree_util.tree_leaves_with_path(trainer.state.params),
                                  jax.tree.leaves(state.params["head"])):
    assert_close(mine, theirs, terms=terms, steps=steps, err_msg=jax.tree_util.keystr(path))
  assert int(trainer.state.step) == int(layer["step"]) == len(batches)


@pytest.mark.parametrize(
    ("loss_fn", "error", "match"),
    [
        (lambda p, y: (mse(p, y), {"mae": 0.0}, 1), TypeError,
         r"a tuple of 3 .*expected a floating-point scalar"),
        (lambda p, y: (p - y) ** 2, TypeError,
         r"loss_fn returned an array of shape \(8,\) float32; expected a floating-point"
         r" scalar loss"),
        (lambda p, y: (mse(p, y), [mse(p, y)]), TypeError, r"\(loss, aux\) with aux a dict"),
        (lambda p, y: (mse(p, y), {"loss": mse(p, y)}), ValueError, r"'loss' entry in aux"),
        (lambda p, y: (mse(p, y), {"err": p - y}), ValueError,
         r"\{'err': \(8,\)\} are not scalars"),
    ],
    ids=["three-tuple", "vector-loss", "list-aux", "loss-in-aux", "vector-aux"],
)
def test_trainer_names_a_loss_outside_the_convention(loss_fn, error, match):
  trainer = Trainer(LinearHead(), make_specs(SGD(0.1)), loss_fn, optax.sgd(0.1),
                    mesh=mesh_of(1), progress="off", padding_id=-1)
  with pytest.raises(error, match=match):
    trainer.fit(make_batches(1, seed=61))


class NnxHead(nnx.Module):
  """LinearHead in NNX."""

  def __init__(self, width: int, *, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(width, 6, rngs=rngs)
    self.out = nnx.Linear(6, 1, rngs=rngs)

  def __call__(self, activations, dense):
    x = jnp.concatenate([activations["fa"], activations["fb"], activations["fa2"], dense], axis=1)
    return self.out(jnp.tanh(self.hidden(x)))[:, 0]


class NnxComposed(nnx.Module):
  def __init__(self, specs, mesh, head: NnxHead, *, rngs: nnx.Rngs):
    self.embed = NnxSparseEmbed(specs, mesh=mesh, rngs=rngs)
    self.head = head

  def __call__(self, sparse, dense):
    return self.head(self.embed(sparse), dense)


def test_trainer_and_nnx_train_step_agree():
  """The NNX twin of the Linen comparison, on 8 devices: the Trainer's dense
  model, as the head of a model with NnxSparseEmbed, trained by
  make_nnx_train_step from the Trainer's initial values."""
  specs, tx, batches = tuple(make_specs(Adagrad(0.3))), optax.adam(0.05), make_batches(3, seed=62)
  mesh = mesh_of(8)
  trainer = Trainer(NnxHead(15, rngs=nnx.Rngs(0)), specs, mse_and_mae, tx, mesh=mesh,
                    pipelining=False, progress="off", padding_id=-1)
  trainer.initialize(batches[0])
  start = trainer.state
  model = NnxComposed(specs, mesh, NnxHead(15, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(1))
  assert model.embed.plan.layout == trainer.plan.layout
  nnx.update(model.head, copied(start.params))
  model.embed.set_embedding_state({"tables": copied(start.embeddings.tables),
                                   "slots": copied(start.embeddings.slots),
                                   "step": jnp.copy(start.step)})
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  step = make_nnx_train_step(
      lambda model, sparse, dense, labels: mse_and_mae(model(sparse, dense), labels))
  flax_metrics = []
  for raw in batches:
    batch = trainer.prepare(raw)
    loss, aux = step(model, optimizer, batch.sparse, batch.dense, batch.labels)
    flax_metrics.append({"loss": float(loss), "mae": float(aux["mae"])})
  history = trainer.fit(batches)

  terms, steps = 4 * BATCH, len(batches)  # as in the Linen comparison
  for mine, theirs in zip(history.metrics, flax_metrics):
    for name in ("loss", "mae"):
      assert_close(mine[name], theirs[name], terms=terms, steps=steps, err_msg=name)
  layer = model.embed.embedding_state()
  for name in trainer.state.embeddings.tables:
    assert_close(trainer.state.embeddings.tables[name], layer["tables"][name],
                 terms=terms, steps=steps, err_msg=name)
  params = nnx.state(model.head, nnx.Param)
  for (path, mine), theirs in zip(jax.tree_util.tree_leaves_with_path(trainer.state.params),
                                  jax.tree.leaves(params)):
    assert_close(mine, theirs, terms=terms, steps=steps, err_msg=jax.tree_util.keystr(path))
  assert int(layer["step"]) == int(trainer.state.step) == len(batches)


def test_trainer_refuses_a_model_that_holds_the_embedding_layers():
  specs, mesh = tuple(make_specs(SGD(0.1))), mesh_of(1)
  batches = make_batches(1, seed=63)
  linen = Trainer(Composed(specs, mesh), specs, mse, optax.sgd(0.1), mesh=mesh,
                  progress="off", padding_id=-1)
  with pytest.raises(TypeError, match=r"The Trainer looks the tables up itself"):
    linen.initialize(batches[0])
  held = NnxComposed(specs, mesh, NnxHead(15, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(1))
  trainer = Trainer(held, specs, mse, optax.sgd(0.1), mesh=mesh, progress="off", padding_id=-1)
  with pytest.raises(ValueError, match=r"NnxSparseEmbed at \['embed'\].*make_nnx_train_step"):
    trainer.initialize(batches[0])


class _NnxWith(nnx.Module):
  """NnxHead with one more layer after its hidden one (BatchNorm, Dropout, ...)."""

  def __init__(self, layer, *, rngs: nnx.Rngs):
    self.head, self.layer = NnxHead(15, rngs=rngs), layer

  def __call__(self, activations, dense):
    x = jnp.concatenate([activations["fa"], activations["fb"], activations["fa2"], dense], axis=1)
    return self.head.out(self.layer(jnp.tanh(self.head.hidden(x))))[:, 0]


@pytest.mark.parametrize("layer, state", [
    (lambda rngs: nnx.BatchNorm(6, rngs=rngs), r"layer/mean \(BatchStat\)"),
    (lambda rngs: nnx.Dropout(0.5, rngs=rngs), r"layer/rngs/count \(RngCount\)"),
])
def test_an_nnx_model_that_changes_its_state_is_refused_naming_it(layer, state):
  """It failed deep inside Flax (TraceContextError) at the first step; Linen's
  BatchNorm already got a clear error. State the call leaves alone is fine."""
  specs, batches = tuple(make_specs(SGD(0.1))), make_batches(2, seed=64)
  model = _NnxWith(layer(nnx.Rngs(0)), rngs=nnx.Rngs(1))
  trainer = Trainer(model, specs, mse, optax.sgd(0.1), mesh=mesh_of(1), progress="off",
                    padding_id=-1)
  with pytest.raises(ValueError, match=rf"the NNX model changes state besides its nnx.Param"
                     rf" variables when called .*{state}.*LayerNorm"):
    trainer.initialize(batches[0])
  still = _NnxWith(nnx.Dropout(0.5, deterministic=True, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(1))
  trainer = Trainer(still, specs, mse, optax.sgd(0.1), mesh=mesh_of(1), progress="off",
                    padding_id=-1)
  assert trainer.fit(batches).final_step == 2
