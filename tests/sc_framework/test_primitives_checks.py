"""The primitives refuse tables, slots, batches and gradients that do not fit the plan.

Each case once gave silently wrong activations, an ignored gradient or an
internal JAX error; each must now raise an error naming the stack or feature
and both values. The checks run while tracing, so they hold under jit too.
"""

from __future__ import annotations

import re
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from sc_framework import FeatureSpec, TableSpec
from sc_framework.optimizers import SGD, RowWiseAdagrad
from sc_framework.preprocessing import preprocess
from sc_framework.primitives import (
    EmbeddingPlan,
    EmbeddingVariables,
    apply_embedding_gradients,
    embedding_lookup,
    init_embedding_variables,
    split_stacked_activations,
    stacked_lookup,
)
from sc_framework.stacking import auto_stack_tables, check_rows_addressable

BATCH = 16


def _features(optimizer=SGD(0.1)) -> tuple[FeatureSpec, ...]:
  users = TableSpec("users", 60, 8, optimizer=optimizer)
  items = TableSpec("items", 90, 8, optimizer=optimizer)
  return (FeatureSpec("user", users, (BATCH, 2)), FeatureSpec("item", items, (BATCH, 3)))


def _plan(features, num_devices: int = 1, shards: int = 1) -> EmbeddingPlan:
  if jax.device_count() < num_devices:
    pytest.skip(f"needs {num_devices} devices, have {jax.device_count()}")
  mesh = Mesh(np.array(jax.devices()[:num_devices]), ("devices",))
  return EmbeddingPlan.create(features, mesh=mesh, shards_per_device=shards)


def _batch(features, plan_or_layout, seed: int = 0):
  layout = getattr(plan_or_layout, "layout", plan_or_layout)
  rng = np.random.default_rng(seed)
  raw = {f.name: rng.integers(0, f.table.vocabulary_size, size=f.input_shape)
         for f in features}
  batch, _ = preprocess(raw, features, layout)
  return batch


def _grads(features, **extra):
  return {**{f.name: jnp.ones(f.output_shape) for f in features}, **extra}


@pytest.mark.parametrize("rows", [-8, 64], ids=["fewer_rows", "more_rows"])
@pytest.mark.parametrize("num_devices", [1, 8])
def test_a_table_of_another_shape_is_refused_naming_the_stack(rows, num_devices):
  features = _features()
  plan = _plan(features, num_devices)
  variables = init_embedding_variables(plan, jax.random.key(0))
  batch = _batch(features, plan)
  (stack,) = plan.layout.stacks
  wrong = jnp.zeros((stack.shape[0] + rows, stack.shape[1]))
  message = (rf"tables\['{stack.name}'\] has shape \({stack.shape[0] + rows}, 8\) but stack"
             rf" '{stack.name}' of the plan's layout is \({stack.shape[0]}, 8\)")
  with pytest.raises(ValueError, match=message):
    embedding_lookup(plan, {stack.name: wrong}, batch)
  with pytest.raises(ValueError, match=message):
    jax.jit(lambda t: stacked_lookup(plan, t, batch))({stack.name: wrong})
  with pytest.raises(ValueError, match="variables.tables"):
    apply_embedding_gradients(plan, variables._replace(tables={stack.name: wrong}), batch,
                              _grads(features), 0)


def test_a_wider_table_is_refused_before_the_update():
  features = _features()
  plan = _plan(features)
  variables = init_embedding_variables(plan, jax.random.key(0))
  (stack,) = plan.layout.stacks
  wider = jnp.zeros((stack.shape[0], 2 * stack.shape[1]))
  with pytest.raises(ValueError, match=r"has shape \(\d+, 16\) but stack"):
    apply_embedding_gradients(plan, variables._replace(tables={stack.name: wider}),
                              _batch(features, plan), _grads(features), 0)


def test_missing_or_unknown_stacks_are_named():
  features = _features()
  plan = _plan(features)
  variables = init_embedding_variables(plan, jax.random.key(0))
  batch = _batch(features, plan)
  (name,) = plan.layout.stack_names
  with pytest.raises(ValueError, match=rf"tables has stacks \[\] .* \(missing \['{name}'\]"):
    embedding_lookup(plan, {}, batch)
  with pytest.raises(ValueError, match=rf"unknown \['other'\]"):
    embedding_lookup(plan, {**variables.tables, "other": variables.tables[name]}, batch)
  with pytest.raises(ValueError, match=rf"batch has stacks \[\] .* \(missing \['{name}'\]"):
    embedding_lookup(plan, variables.tables, {})
  with pytest.raises(TypeError, match="the preprocessed batch"):
    embedding_lookup(plan, variables.tables, {name: np.zeros(3)})
  with pytest.raises(ValueError, match=rf"stacked activations has stacks \[\]"):
    split_stacked_activations(plan, {})


def test_slots_of_another_optimizer_or_shape_are_refused():
  features = _features(RowWiseAdagrad(0.1))
  plan = _plan(features)
  variables = init_embedding_variables(plan, jax.random.key(0))
  batch = _batch(features, plan)
  (name,) = plan.layout.stack_names
  accumulator = variables.slots[name]["accumulator"]
  no_slots = EmbeddingVariables(variables.tables, {name: {}})
  with pytest.raises(ValueError, match=r"missing \['accumulator'\].*RowWiseAdagrad"):
    apply_embedding_gradients(plan, no_slots, batch, _grads(features), 0)
  wide = EmbeddingVariables(variables.tables,
                            {name: {"accumulator": jnp.tile(accumulator, (1, 8))}})
  with pytest.raises(ValueError, match=r"\['accumulator'\] has shape \(\d+, 8\) but the"
                                       r" optimizer's slot 'accumulator'"):
    apply_embedding_gradients(plan, wide, batch, _grads(features), 0)


@pytest.mark.parametrize(
    "plan_geometry, batch_geometry",
    [((1, 1), (1, 2)), ((8, 1), (1, 1)), ((8, 1), (8, 2)), ((1, 1), (8, 1))],
    ids=["S2_batch_on_S1", "G1_batch_on_G8", "S2_batch_on_G8_S1", "G8_batch_on_G1"],
)
def test_a_batch_preprocessed_for_another_layout_is_refused(plan_geometry, batch_geometry):
  features = _features()
  plan = _plan(features, *plan_geometry)
  other = auto_stack_tables(features, num_devices=batch_geometry[0],
                            shards_per_device=batch_geometry[1])
  batch = _batch(features, other)
  variables = init_embedding_variables(plan, jax.random.key(0))
  message = (rf"batch\['{plan.layout.stack_names[0]}'\] was preprocessed for another layout"
             rf".*G={plan_geometry[0]} devices and N={plan_geometry[0] * plan_geometry[1]}"
             r" shards")
  with pytest.raises(ValueError, match=message):
    embedding_lookup(plan, variables.tables, batch)
  with pytest.raises(ValueError, match=message):
    apply_embedding_gradients(plan, variables, batch, _grads(features), 0)


@pytest.mark.parametrize("change, message", [
    (dict(vocabulary=9000), r"local row \d+, but its shards hold R=\d+ rows"),
    (dict(batch=2 * BATCH), r"local sample \d+, but each device holds \d+ samples"),
])
def test_a_batch_of_another_vocabulary_or_batch_size_is_refused(change, message):
  """Same G, N and capacities, so the same shapes: the rows or samples tell the layouts apart.

  Such a batch once gave zero activations and no update, silently.
  """
  features = _features()
  plan = _plan(features, 2)
  vocabulary, batch_size = change.get("vocabulary", 60), change.get("batch", BATCH)
  users = TableSpec("users", vocabulary, 8, optimizer=SGD(0.1))
  items = TableSpec("items", 90, 8, optimizer=SGD(0.1))
  other = (FeatureSpec("user", users, (batch_size, 2)), FeatureSpec("item", items, (batch_size, 3)))
  layout = auto_stack_tables(other, num_devices=2)
  raw = {"user": np.full((batch_size, 2), vocabulary - 1), "item": np.ones((batch_size, 3), int)}
  batch, _ = preprocess(raw, other, layout)
  assert all(np.shape(a) == np.shape(b)
             for name in batch for a, b in zip(batch[name], _batch(features, plan)[name]))
  variables = init_embedding_variables(plan, jax.random.key(0))
  with pytest.raises(ValueError, match=r"batch\['\w+'\] was preprocessed for another layout: it"
                                       r" holds " + message):
    embedding_lookup(plan, variables.tables, batch)
  with pytest.raises(ValueError, match=message):
    apply_embedding_gradients(plan, variables, batch, _grads(features), 0)


def test_gradients_of_an_unknown_feature_are_refused_not_ignored():
  features = _features()
  plan = _plan(features)
  variables = init_embedding_variables(plan, jax.random.key(0))
  batch = _batch(features, plan)
  grads = _grads(features, usr=jnp.ones((BATCH, 8)))
  with pytest.raises(ValueError, match=r"activation_grads has features .*unknown \['usr'\]"):
    apply_embedding_gradients(plan, variables, batch, grads, 0)
  # The right names still train.
  apply_embedding_gradients(plan, variables, batch, _grads(features), 0)


@pytest.mark.parametrize("padding_id", [True, False, "x", 2.5, np.float32(-1.0)],
                         ids=["True", "False", "str", "float", "np_float"])
def test_padding_id_must_be_an_int(padding_id):
  features = _features()
  layout = auto_stack_tables(features, num_devices=1)
  raw = {f.name: np.ones(f.input_shape, np.int64) for f in features}
  with pytest.raises(TypeError, match=r"feature 'user': padding_id must be an int id"):
    preprocess(raw, features, layout, padding_id=padding_id)
  with pytest.raises(TypeError, match=r"feature 'item': padding_id must be an int id"):
    preprocess(raw, features, layout, padding_id={"user": -1, "item": padding_id})


def test_an_integer_padding_id_of_any_integer_type_is_accepted():
  features = _features()
  layout = auto_stack_tables(features, num_devices=1)
  raw = {f.name: np.full(f.input_shape, 1, np.int64) for f in features}
  raw["user"][:, 1] = -1
  expected, _ = preprocess(raw, features, layout, padding_id=-1)
  (stack,) = layout.stack_names
  real = np.asarray(expected[stack].entry_gains) != 0
  assert real.sum() == 2 * BATCH  # one entry per sample and feature: id 1, padding skipped
  for padding_id in (np.int64(-1), np.int32(-1)):
    batch, _ = preprocess(raw, features, layout, padding_id=padding_id)
    for field, value in zip(expected[stack]._fields, expected[stack]):
      np.testing.assert_array_equal(getattr(batch[stack], field), value, err_msg=field)


def test_rows_per_device_beyond_int32_are_refused_naming_the_stack():
  huge = TableSpec("huge", 3_000_000_000, 8, optimizer=SGD(0.1))
  features = (FeatureSpec("ids", huge, (8, 1)),)
  layout = auto_stack_tables(features, num_devices=1)
  message = r"layout stack '.*' \(tables \['huge'\]\) puts 3,000,000,000 rows .* at least 2"
  with pytest.raises(ValueError, match=message):
    check_rows_addressable(layout)
  with pytest.raises(ValueError, match=message):
    preprocess({"ids": np.full((8, 1), 2**31 + 5)}, features, layout)
  with pytest.raises(ValueError, match=message):
    _plan(features)
  # Two devices hold 1.5e9 rows each: addressable.
  check_rows_addressable(auto_stack_tables(features, num_devices=2))


@pytest.mark.parametrize("initializer, returned", [
    (lambda key, shape, dtype: jnp.ones(shape[-1], dtype), "(8,)"),
    (lambda key, shape, dtype: 0.5, "()"),
    (lambda key, shape, dtype: jnp.ones((1, 3), dtype), "(1, 3)"),
    (lambda key, shape, dtype: jnp.ones((2, shape[-1]), dtype), "(2, 8)"),
])
def test_an_initializer_of_another_shape_is_refused_naming_the_table(initializer, returned):
  """A row of shape (D,) once broadcast into a [rows, rows + pad] table, found much later."""
  table = TableSpec("users", 60, 8, initializer=initializer)
  plan = _plan((FeatureSpec("user", table, (BATCH, 2)),))
  with pytest.raises(ValueError, match=rf"table 'users': its initializer returned an array of"
                     rf" shape {re.escape(returned)} when asked for shape \(1, 8\)"):
    init_embedding_variables(plan, jax.random.key(0))


def test_an_initializer_may_return_numpy_or_another_dtype():
  table = TableSpec("users", 60, 8, initializer=lambda key, shape, dtype: np.full(shape, 2, np.int32))
  plan = _plan((FeatureSpec("user", table, (BATCH, 2)),))
  variables = init_embedding_variables(plan, jax.random.key(0))
  (stack,) = variables.tables.values()
  assert stack.dtype == jnp.float32 and set(np.unique(np.asarray(stack))) == {0.0, 2.0}
