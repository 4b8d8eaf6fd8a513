"""Tables by name in the Flax layers: read, and started from given rows, against numpy."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import flax_reference as ref
from sc_framework.flax import (
    LinenSparseEmbed,
    NnxSparseEmbed,
    init_linen_train_state,
    linen_slot_values,
    linen_table_values,
    replace_linen_tables,
)


def _given_rows(seed):
  rng = np.random.default_rng(seed)
  return {t.name: rng.standard_normal((t.vocabulary_size, t.embedding_dim)).astype(np.float32)
          for t in (ref.USERS, ref.TAGS)}


class _Towers(nn.Module):
  """The embedding layer at the path "towers/embed"."""

  num_devices: int

  @nn.compact
  def __call__(self, batch):
    return _Tower(self.num_devices, name="towers")(batch)


class _Tower(nn.Module):
  num_devices: int

  @nn.compact
  def __call__(self, batch):
    return LinenSparseEmbed(ref.FEATURES, mesh=ref.mesh(self.num_devices), name="embed")(batch)


@pytest.mark.parametrize("num_devices", [1, 8])
@pytest.mark.parametrize("seed", [0, 1])
def test_linen_tables_start_from_given_rows_and_read_back(num_devices, seed):
  model = _Towers(num_devices)
  layer = LinenSparseEmbed(ref.FEATURES, mesh=ref.mesh(num_devices))
  raw, _ = ref.raw_batch(seed)
  batch = ref.preprocessed(raw, layer.plan.layout)
  state = init_linen_train_state(model, optax.sgd(0.1), jax.random.key(seed), batch)
  before = linen_table_values(state, layer, "towers/embed")
  given = _given_rows(seed)
  state = replace_linen_tables(state, layer, "towers/embed", given)
  after = linen_table_values(state, layer, "towers/embed")
  for name, rows in given.items():
    np.testing.assert_array_equal(after[name], rows)
  np.testing.assert_array_equal(after["items"], before["items"])  # not replaced: as it was
  slots = linen_slot_values(state, layer, "towers/embed")
  assert not slots["tags"]  # SGD has no slots
  np.testing.assert_array_equal(slots["users"]["mu"], np.zeros_like(given["users"]))
  activations = model.apply({"params": state.params, "embedding": state.embedding}, batch)
  expected = ref.numpy_activations(after, raw)
  for name, value in activations.items():
    ref.assert_trees_close(np.asarray(value), expected[name], steps=1)
  with pytest.raises(KeyError, match=r"no embedding layer at 'embed'.* at \['towers/embed'\]"):
    linen_table_values(state, layer, "embed")


@pytest.mark.parametrize("num_devices", [1, 8])
def test_nnx_tables_start_from_given_rows_and_read_back(num_devices):
  layer = NnxSparseEmbed(ref.FEATURES, mesh=ref.mesh(num_devices), rngs=nnx.Rngs(0))
  raw, _ = ref.raw_batch(3)
  given = _given_rows(3)
  before = layer.table_values(["items"])
  step = layer.step.get_value()
  layer.replace_tables(given)
  after = layer.table_values()
  for name, rows in given.items():
    np.testing.assert_array_equal(after[name], rows)
  np.testing.assert_array_equal(after["items"], before["items"])
  assert layer.step.get_value() == step
  np.testing.assert_array_equal(layer.slot_values(["users"])["users"]["nu"],
                                np.zeros_like(given["users"]))
  activations = layer(ref.preprocessed(raw, layer.plan.layout))
  expected = ref.numpy_activations(after, raw)
  for name, value in activations.items():
    ref.assert_trees_close(np.asarray(value), expected[name], steps=1)
  with pytest.raises(ValueError, match=r"table 'users'"):
    layer.replace_tables({"users": np.full_like(given["users"], np.nan)})
