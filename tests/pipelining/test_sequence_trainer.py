"""The Trainer with a sequence feature ([B, L, D]) next to a combined one.

(Elastic resume of pipelined checkpoints, whose in-flight batch keeps every
sequence id at its position, is tested in test_elastic_resume.py.)

A dense reference (numpy gathers per position, jax.grad of the same Linen
head, numpy SGD on the rows) replays the pipelined (one step stale) and the
synchronous trajectories; 8 devices equal 1; a run stopped and resumed from
its checkpoint (the pipelined one carries [B, L, D] in-flight activations)
equals the uninterrupted run bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from etils import epath
from flax import linen as nn

from pipelining import Callback, Trainer
from sc_framework import FeatureSpec, TableSpec
from sc_framework.optimizers import SGD
from sc_framework.stacking import unstack
from tests.numerics import assert_close, assert_same_bits

BATCH, LENGTH, DIM, VOCAB = 8, 5, 4, 30
DENSE_LR, SPARSE_LR = 0.05, 0.3
PAD = -1


class SequenceHead(nn.Module):
  @nn.compact
  def __call__(self, activations, dense):
    tokens = activations["tokens"]
    assert tokens.shape[1:] == (LENGTH, DIM)
    x = jnp.concatenate([tokens.reshape(tokens.shape[0], -1), activations["topic"], dense], 1)
    return nn.Dense(1)(jnp.tanh(nn.Dense(6)(x)))[:, 0]


def mse(predictions, labels):
  return jnp.mean((predictions - labels) ** 2)


def make_specs():
  words = TableSpec("words", VOCAB, DIM, optimizer=SGD(SPARSE_LR), max_ids_per_partition=64,
                    max_unique_ids_per_partition=64)
  return [FeatureSpec("tokens", words, (BATCH, LENGTH), (BATCH, LENGTH, DIM)),
          FeatureSpec("topic", words, (BATCH, 2))]


def make_batches(count, seed):
  rng = np.random.default_rng(seed)
  batches = []
  for _ in range(count):
    tokens = rng.integers(0, VOCAB, (BATCH, LENGTH))
    lengths = rng.integers(0, LENGTH + 1, BATCH)
    tokens[np.arange(LENGTH)[None] >= lengths[:, None]] = PAD  # shorter sequences
    batches.append({
        "sparse": {"tokens": tokens, "topic": rng.integers(0, VOCAB, (BATCH, 2))},
        "dense": rng.normal(size=(BATCH, 3)).astype(np.float32),
        "labels": rng.normal(size=BATCH).astype(np.float32),
    })
  return batches


def reference_lookup(table, sparse):
  tokens = sparse["tokens"]
  return {"tokens": table[np.maximum(tokens, 0)] * (tokens >= 0)[..., None],
          "topic": table[sparse["topic"]].sum(axis=1)}


def reference_update(table, sparse, grads):
  tokens = sparse["tokens"]
  row_grads = np.zeros_like(table)
  valid = tokens >= 0
  np.add.at(row_grads, tokens[valid], grads["tokens"][valid])
  for j in range(sparse["topic"].shape[1]):
    np.add.at(row_grads, sparse["topic"][:, j], grads["topic"])
  table -= SPARSE_LR * row_grads  # SGD: rows without gradient are unchanged


def reference_run(params, table, batches, *, pipelined):
  model, optimizer = SequenceHead(), optax.sgd(DENSE_LR)
  table = np.array(table, np.float64)
  opt_state = optimizer.init(params)

  def objective(p, activations, batch):
    return mse(model.apply({"params": p}, activations, batch["dense"]), batch["labels"])

  grad_fn = jax.jit(jax.grad(objective, argnums=(0, 1)))
  in_flight = reference_lookup(table, batches[0]["sparse"])
  for k, batch in enumerate(batches):
    if pipelined:
      activations = in_flight
      if k + 1 < len(batches):
        in_flight = reference_lookup(table, batches[k + 1]["sparse"])  # reads T_k
    else:
      activations = reference_lookup(table, batch["sparse"])
    as32 = {name: jnp.asarray(v, jnp.float32) for name, v in activations.items()}
    param_grads, act_grads = grad_fn(params, as32, batch)
    updates, opt_state = optimizer.update(param_grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    reference_update(table, batch["sparse"], {n: np.asarray(g, np.float64)
                                              for n, g in act_grads.items()})
  return params, table


def logical_table(trainer):
  stacked = {k: np.asarray(jax.device_get(v)) for k, v in trainer.state.embeddings.tables.items()}
  return unstack(stacked, trainer.plan.layout)["words"]


def make_trainer(pipelining, devices=1, workdir=None):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("devices",))
  return Trainer(SequenceHead(), make_specs(), mse, optax.sgd(DENSE_LR), mesh=mesh,
                 pipelining=pipelining, progress="off", padding_id=PAD, workdir=workdir,
                 save_every=1 if workdir else None)


@pytest.mark.parametrize("pipelining", [True, False])
def test_trajectory_matches_dense_reference(pipelining):
  batches = make_batches(4, seed=1 + pipelining)
  trainer = make_trainer(pipelining)
  trainer.initialize(batches[0])
  table0, params0 = logical_table(trainer), jax.device_get(trainer.state.params)
  trainer.fit(batches)
  params, table = reference_run(params0, table0, batches, pipelined=pipelining)
  steps = len(batches)
  assert_close(logical_table(trainer), table, terms=BATCH * (LENGTH + 2), steps=steps)
  jax.tree.map(lambda a, b: assert_close(a, b, terms=LENGTH * DIM + DIM + 3, steps=steps),
               jax.device_get(trainer.state.params), params)


def test_eight_devices_equal_one():
  batches = make_batches(3, seed=7)
  one, eight = make_trainer(True, 1), make_trainer(True, 8)
  one.fit(batches)
  eight.fit(batches)
  assert_close(logical_table(eight), logical_table(one), terms=BATCH * (LENGTH + 2), steps=3)


class StopAt(Callback):
  def __init__(self, step):
    self.step = step

  def on_step_end(self, trainer, step, metrics):
    if step == self.step:
      trainer.request_stop()


@pytest.mark.parametrize("pipelining, devices", [(True, 2), (False, 1)])
def test_save_and_resume_is_bit_exact(tmp_path, pipelining, devices):
  batches = make_batches(5, seed=11)
  first = make_trainer(pipelining, devices, tmp_path)
  assert first.fit(batches, callbacks=[StopAt(2)]).interrupted
  resumed = make_trainer(pipelining, devices, tmp_path)  # as a new process would
  history = resumed.fit(batches)
  assert history.resumed_from == 2 and history.final_step == 5
  reference = make_trainer(pipelining, devices)
  reference.fit(batches)
  assert_same_bits(logical_table(resumed), logical_table(reference))
  jax.tree.map(assert_same_bits, jax.device_get(resumed.state.params),
               jax.device_get(reference.state.params))


def test_resume_on_another_device_count(tmp_path):
  """A synchronous checkpoint of 8 devices resumes on 1 device (elastic restore)."""
  batches = make_batches(4, seed=12)
  first = make_trainer(False, 8, tmp_path)
  assert first.fit(batches, callbacks=[StopAt(2)]).interrupted
  resumed = make_trainer(False, 1, tmp_path)
  assert resumed.fit(batches).resumed_from == 2
  reference = make_trainer(False, 8)
  reference.fit(batches)
  assert_close(logical_table(resumed), logical_table(reference), terms=BATCH * (LENGTH + 2),
               steps=4)


def test_table_layout_does_not_depend_on_the_feature_kind():
  """Where rows live is the same whether the feature is a sequence or combined."""
  from sc_framework import auto_stack_tables

  sequence = make_specs()
  combined = [FeatureSpec("tokens", sequence[0].table, (BATCH, LENGTH)), sequence[1]]
  a, b = auto_stack_tables(sequence, 8), auto_stack_tables(combined, 8)
  assert a.table_geometry() == b.table_geometry()
  assert [s.tables for s in a.stacks] == [s.tables for s in b.stacks]


def test_checkpoint_converts_to_another_layout(tmp_path, capsys):
  """sc-checkpoint convert handles a checkpoint whose layout holds a sequence feature."""
  import checkpoint as ck
  from checkpoint.cli import main

  trainer = make_trainer(False, 8, tmp_path / "run")
  trainer.fit(make_batches(2, seed=13))
  step = trainer.latest_checkpoint_step()
  out = tmp_path / "converted"
  assert main(["convert", str(tmp_path / "run" / "checkpoints" / str(step)), str(out),
               "--num-devices", "2", "--shards-per-device", "2", "--quiet"]) == 0
  reader = ck.CheckpointReader(out / "embedding")
  assert reader.layout.num_shards == 4
  assert reader.layout.feature("tokens").batch_size == BATCH * LENGTH
  restored = ck.EmbeddingCheckpointHandler().restore(out / "embedding", ck.TableRestore())
  assert_same_bits(restored.tables["words"], logical_table(trainer))


class PositionsPooledHead(nn.Module):
  """A head whose parameters do not depend on the sequence length."""

  @nn.compact
  def __call__(self, activations, dense):
    x = jnp.concatenate([activations["tokens"].mean(axis=1), activations["topic"], dense], 1)
    return nn.Dense(1)(x)[:, 0]


def test_a_batch_in_flight_of_another_sequence_length_is_refused_naming_both(tmp_path):
  """Lengthening the sequences at a pipelined checkpoint failed in Orbax's shape check
  of the activations; the refusal names the lengths, and its advice (one synchronous
  step with the old length) lets the length change."""
  from checkpoint import IncompatibleCheckpointError

  def trainer(length, pipelining):
    words = make_specs()[0].table
    specs = [FeatureSpec("tokens", words, (BATCH, length), (BATCH, length, DIM)),
             FeatureSpec("topic", words, (BATCH, 2))]
    return Trainer(PositionsPooledHead(), specs, mse, optax.sgd(DENSE_LR), pipelining=pipelining,
                   mesh=jax.sharding.Mesh(np.array(jax.devices()[:1]), ("devices",)),
                   progress="off", padding_id=PAD, workdir=tmp_path, save_every=1)

  batches = make_batches(5, seed=13)
  longer = [{**b, "sparse": {**b["sparse"], "tokens": np.pad(
      b["sparse"]["tokens"], ((0, 0), (0, 2)), constant_values=PAD)}} for b in batches]
  trainer(LENGTH, True).fit(batches, num_steps=2)  # batch 3 in flight
  with pytest.raises(IncompatibleCheckpointError,
                     match=rf"step 2 .* in-flight batch of other shapes than the Trainer's"
                           rf" \(feature 'tokens': sequence length {LENGTH} then,"
                           rf" sequence length {LENGTH + 2} now\)"):
    trainer(LENGTH + 2, True).fit(longer)
  assert trainer(LENGTH, False).fit(batches, num_steps=3).resumed_from == 2
  history = trainer(LENGTH + 2, True).fit(longer)
  assert history.resumed_from == 3 and history.final_step == 5


def test_a_sequence_feature_made_combined_at_a_batch_in_flight_is_named_so():
  """It read 'sequence length 4 then, None now'."""
  from checkpoint import IncompatibleCheckpointError
  from pipelining._checkpointing import _check_same_batch_shape

  words = make_specs()[0].table
  combined = FeatureSpec("tokens", words, (BATCH, LENGTH))
  saved = {"tokens": {"batch_size": BATCH, "sequence_length": LENGTH}}
  with pytest.raises(IncompatibleCheckpointError,
                     match=rf"\(feature 'tokens': sequence length {LENGTH} then, a combined"
                           r" feature now\).*resume once with the shapes it was written with"
                           r" and pipelining off, for one step"):
    _check_same_batch_shape(2, epath.Path("ckpt"), saved, [combined])
