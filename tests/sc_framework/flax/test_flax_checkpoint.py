"""A Linen train state checkpointed with the README's recipe resumes exactly, and on
another device count and stacking within float32 tolerance: tables, slots, the layer's
step (Adam's bias correction and a schedule read it), dense parameters and their optax
state, against a run that was never interrupted. An NNX layer takes restored state only
in its own layout."""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import Mesh

import checkpoint as ck
from sc_framework import FeatureSpec, TableSpec, auto_stack_tables, stack_tables
from sc_framework.flax import (
    LinenSparseEmbed,
    NnxSparseEmbed,
    init_linen_train_state,
    linen_slot_values,
    linen_table_values,
    make_linen_train_step,
)
from sc_framework.optimizers import Adam, RowWiseAdagrad
from sc_framework.preprocessing import preprocess
from tests.numerics import assert_close, assert_same_bits

BATCH = 16
PATH = "LinenSparseEmbed_0"
USERS = TableSpec("users", 60, 8, optimizer=Adam(0.05))
ITEMS = TableSpec("items", 40, 8, optimizer=Adam(0.05))
ADS = TableSpec("ads", 30, 4, optimizer=RowWiseAdagrad(lambda step: 0.2 / (1.0 + step)))
FEATURES = (FeatureSpec("user", USERS, (BATCH, 1)), FeatureSpec("history", ITEMS, (BATCH, 3)),
            FeatureSpec("ad", ADS, (BATCH, 1)))


class Ranker(nn.Module):
  mesh: Mesh
  layout: object

  @nn.compact
  def __call__(self, batch):
    emb = LinenSparseEmbed(FEATURES, mesh=self.mesh, layout=self.layout)(batch)
    x = jnp.concatenate([emb["user"], emb["history"], emb["ad"]], axis=-1)
    return nn.Dense(1)(nn.relu(nn.Dense(8)(x)))[:, 0]


def loss_fn(apply, batch, labels):
  return optax.sigmoid_binary_cross_entropy(apply(batch), labels).mean()


def raw_batches(count):
  rng = np.random.default_rng(21)
  return [({"user": rng.integers(0, 60, (BATCH, 1)), "history": rng.integers(0, 40, (BATCH, 3)),
            "ad": rng.integers(0, 30, (BATCH, 1))}, rng.integers(0, 2, BATCH).astype(np.float32))
          for _ in range(count)]


def setup(num_devices, layout):
  mesh = Mesh(np.array(jax.devices()[:num_devices]), ("devices",))
  model, tx = Ranker(mesh, layout), optax.adam(0.01)
  state = init_linen_train_state(model, tx, jax.random.key(0),
                                 preprocess(raw_batches(1)[0][0], FEATURES, layout)[0])
  return mesh, model, tx, state


def train(model, tx, layout, state, batches):
  step = make_linen_train_step(model, tx, loss_fn)
  for ids, labels in batches:
    state, _ = step(state, preprocess(ids, FEATURES, layout)[0], labels)
  return state


def readme_recipe() -> dict:
  """The README's "Checkpoints of a Flax train state" block, run: its save and restore."""
  readme = (pathlib.Path(__file__).parents[3] / "README.md").read_text()
  block = re.search(r"<!-- flax-checkpoint-recipe:start -->\n```python\n(.*?)```", readme,
                    re.DOTALL).group(1)
  namespace = {"PATH": PATH}
  exec(compile(block, "README.md (flax-checkpoint-recipe)", "exec"), namespace)
  return namespace


RECIPE = readme_recipe()
save, restore = RECIPE["save"], RECIPE["restore"]


def test_a_linen_state_resumes_exactly_and_on_another_device_count(tmp_path):
  batches = raw_batches(6)
  layout8 = auto_stack_tables(FEATURES, num_devices=8)
  mesh8, model8, tx, state = setup(8, layout8)
  state = train(model8, tx, layout8, state, batches[:3])
  with ck.CheckpointManager(tmp_path / "ckpt") as manager:
    save(manager, 3, state, layer(mesh8, layout8))
  reference = train(model8, tx, layout8, state, batches[3:])

  with ck.CheckpointManager(tmp_path / "ckpt", read_only=True) as manager:
    same = restore(manager, setup(8, layout8)[3], layer(mesh8, layout8))
  assert int(same.embedding[PATH]["step"]) == 3
  same = train(model8, tx, layout8, same, batches[3:])
  jax.tree.map(assert_same_bits, jax.device_get(same), jax.device_get(reference))

  layout4 = stack_tables(FEATURES, [["users"], ["items"], ["ads"]], 4, 2)  # other G, S, groups
  mesh4, model4, _, fresh = setup(4, layout4)
  with ck.CheckpointManager(tmp_path / "ckpt", read_only=True) as manager:
    moved = train(model4, tx, layout4, restore(manager, fresh, layer(mesh4, layout4)),
                  batches[3:])
  assert int(moved.embedding[PATH]["step"]) == int(reference.embedding[PATH]["step"]) == 6
  for read in (linen_table_values, linen_slot_values):
    jax.tree.map(lambda got, want: assert_close(got, want, terms=BATCH * 3, steps=3),
                 read(moved, layer(mesh4, layout4), PATH),
                 read(reference, layer(mesh8, layout8), PATH))
  jax.tree.map(lambda got, want: assert_close(got, want, terms=BATCH * 3, steps=3),
               jax.device_get((moved.params, moved.opt_state)),
               jax.device_get((reference.params, reference.opt_state)))


def layer(mesh, layout):
  """The model's embedding layer, as its module path PATH builds it."""
  return LinenSparseEmbed(FEATURES, mesh=mesh, layout=layout)


def test_an_nnx_layer_takes_embedding_state_of_its_own_layout_only():
  """Tables of another layout were written into the layer and failed at its next read; a
  state with other stack names raised a bare KeyError."""
  layout8 = auto_stack_tables(FEATURES, num_devices=8)
  mesh = Mesh(np.array(jax.devices()[:8]), ("devices",))
  embed = NnxSparseEmbed(FEATURES, mesh=mesh, layout=layout8, rngs=nnx.Rngs(0))
  other = NnxSparseEmbed(FEATURES, mesh=mesh, rngs=nnx.Rngs(1),
                         layout=stack_tables(FEATURES, [["users"], ["items"], ["ads"]], 8, 2))
  before = embed.embedding_state()
  with pytest.raises(ValueError, match=r"variables\.tables .*stacks"):
    embed.set_embedding_state(other.embedding_state())
  with pytest.raises(TypeError, match=r"set_embedding_state takes a mapping with the keys"
                                      r" \['tables', 'slots', 'step'\]"):
    embed.set_embedding_state({"tables": before["tables"], "slots": before["slots"]})
  with pytest.raises(TypeError, match=r"the step must be an integer scalar .*got 2\.5"):
    embed.set_embedding_state({**before, "step": 2.5})
  jax.tree.map(assert_same_bits, jax.device_get(embed.embedding_state()),
               jax.device_get(before))
  embed.set_embedding_state(before)  # its own: taken
