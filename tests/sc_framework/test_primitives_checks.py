"""The primitives refuse tables, slots, batches and gradients that do not fit the plan.

Each case once gave silently wrong activations, an ignored gradient or an
internal JAX error; each must now raise an error naming the stack or feature
and both values. The checks run while tracing, so they hold under jit too.
"""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from sc_framework import FeatureSpec, TableSpec
from sc_framework.optimizers import SGD, Adam, RowWiseAdagrad
from sc_framework.preprocessing import StackBatch, preprocess
from sc_framework.primitives import (
    EmbeddingPlan,
    EmbeddingVariables,
    apply_embedding_gradients,
    apply_stacked_gradients,
    available_backends,
    embedding_lookup,
    init_embedding_variables,
    split_stacked_activations,
    stacked_lookup,
)
from sc_framework.stacking import auto_stack_tables, check_rows_addressable
from tests.numerics import assert_close

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


def test_a_mesh_without_the_table_axis_is_refused_naming_its_axes():
  features = _features()
  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  message = r"mesh has no axis 'devices'; its axes are \('data',\). Pass axis_name="
  with pytest.raises(ValueError, match=message):
    EmbeddingPlan.create(features, mesh=mesh)  # the automatic stacking needs the axis first
  layout = auto_stack_tables(features, 1)
  with pytest.raises(ValueError, match=message):
    EmbeddingPlan.create(features, mesh=mesh, layout=layout)
  assert EmbeddingPlan.create(features, mesh=mesh, axis_name="data").layout == layout


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


@pytest.mark.parametrize("backend", ["xla", "cpu"])
def test_integer_tables_or_slots_are_refused_not_truncated(backend):
  features = _features(RowWiseAdagrad(0.1))
  plan = _plan(features)
  if backend not in available_backends(plan):
    pytest.skip(f"backend {backend!r} is not available here")
  variables = init_embedding_variables(plan, jax.random.key(0))
  (stack,) = plan.layout.stacks
  quantized = {stack.name: jnp.round(variables.tables[stack.name] * 100).astype(jnp.int32)}
  batch = _batch(features, plan)
  with pytest.raises(TypeError, match=rf"tables\['{stack.name}'\] has dtype int32; .*floating"):
    embedding_lookup(plan, quantized, batch, backend=backend)
  with pytest.raises(TypeError, match=r"variables.tables\[.*\] has dtype int32"):
    apply_embedding_gradients(plan, variables._replace(tables=quantized), batch,
                              _grads(features), 0, backend=backend)
  int_slots = {stack.name: {"accumulator": jnp.ones((stack.shape[0], 1), jnp.int32)}}
  with pytest.raises(TypeError, match=r"slots\[.*\]\['accumulator'\] has dtype int32"):
    apply_embedding_gradients(plan, variables._replace(slots=int_slots), batch,
                              _grads(features), 0, backend=backend)


@pytest.mark.parametrize("num_devices", [1, 8])
@pytest.mark.parametrize("field, at, value, message", [
    ("entry_unique_index", (0, 0), "NU+3", r"entry_unique_index holds \d+, outside \[0, N \* U"),
    ("entry_unique_index", (0, 0), -5, r"entry_unique_index holds -5, outside"),
    ("unique_rows", (0, 0, 0), -7, r"unique_rows holds -7 \(rows are >= 0, -1 for unused\)"),
    ("entry_samples", (0, 0), -2, r"entry_samples holds -2"),
    ("entry_gains", (0, 0), np.nan, r"entry_gains holds a non-finite value"),
])
def test_a_batch_edited_by_hand_is_refused_not_read_around(num_devices, field, at, value, message):
  features = _features()
  plan = _plan(features, num_devices)
  variables = init_embedding_variables(plan, jax.random.key(0))
  (stack,) = plan.layout.stacks
  sparse = _batch(features, plan)[stack.name]
  array = np.array(getattr(sparse, field))
  array[at] = sparse.unique_rows[0].size + 3 if value == "NU+3" else value
  edited = {stack.name: sparse._replace(**{field: array})}
  for backend in available_backends(plan):
    with pytest.raises(ValueError, match=rf"batch\['{stack.name}'\]: {message}.*by hand"):
      embedding_lookup(plan, variables.tables, edited, backend=backend)
  with pytest.raises(ValueError, match=message):
    apply_embedding_gradients(plan, variables, edited, _grads(features), 0)


@pytest.mark.parametrize("step, error, message", [
    (-1, ValueError, r"step must be in \[0, 2\^31\), got -1"),
    (2**31, ValueError, r"got 2147483648"),
    (1.7, TypeError, r"step must be an integer scalar, got float 1.7"),
    (True, TypeError, r"got the bool True"),
    (np.array([0, 1]), TypeError, r"dtype int64 and shape \(2,\)"),
    (np.float32(2), TypeError, r"dtype float32 and shape \(\)"),
    (None, TypeError, r"got NoneType None"),
])
def test_a_step_that_is_no_count_of_updates_is_refused(step, error, message):
  """Adam's bias correction at step -1 is 0 (NaN rows), a float step would be
  cut: both updates refuse such steps, naming them, before touching a row."""
  features = _features(Adam(0.1))
  plan = _plan(features)
  variables = init_embedding_variables(plan, jax.random.key(0))
  batch = _batch(features, plan)
  stacked = {s.name: jnp.ones((s.total_batch_size, s.padded_embedding_dim))
             for s in plan.layout.stacks}
  with pytest.raises(error, match=message):
    apply_embedding_gradients(plan, variables, batch, _grads(features), step)
  with pytest.raises(error, match=message):
    apply_stacked_gradients(plan, variables, batch, stacked, step)


def test_integer_steps_of_every_form_are_accepted_also_traced():
  features = _features(Adam(0.1))
  plan = _plan(features)
  variables = init_embedding_variables(plan, jax.random.key(0))
  batch = _batch(features, plan)
  results = [apply_embedding_gradients(plan, variables, batch, _grads(features), step)
             for step in (3, np.int64(3), jnp.int32(3), np.array(3, np.uint8))]
  jitted = jax.jit(lambda v, b, s: apply_embedding_gradients(plan, v, b, _grads(features), s))
  results.append(jitted(variables, batch, jnp.int32(3)))
  for result in results[1:]:  # one program traced eagerly or inside a jit: fusions may differ
    for name, table in result.tables.items():
      assert_close(table, results[0].tables[name], terms=BATCH * 3)
  assert all(np.isfinite(t).all() for t in results[0].tables.values())


def test_missing_or_unknown_stacks_are_named():
  features = _features()
  plan = _plan(features)
  variables = init_embedding_variables(plan, jax.random.key(0))
  batch = _batch(features, plan)
  (name,) = plan.layout.stack_names
  with pytest.raises(ValueError, match=rf"tables has stacks \[\] .* \(missing \['{name}'\]"):
    embedding_lookup(plan, {}, batch)
  with pytest.raises(ValueError, match=r"unknown \['other'\]"):
    embedding_lookup(plan, {**variables.tables, "other": variables.tables[name]}, batch)
  with pytest.raises(ValueError, match=rf"batch has stacks \[\] .* \(missing \['{name}'\]"):
    embedding_lookup(plan, variables.tables, {})
  with pytest.raises(TypeError, match="the preprocessed batch"):
    embedding_lookup(plan, variables.tables, {name: np.zeros(3)})
  with pytest.raises(ValueError, match=r"stacked activations has stacks \[\]"):
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


def _other_plan_batch(batch_size=BATCH, vocabulary=60, combiner="sum", seed=0):
  """A batch preprocessed for specs other than `_features()`, on 2 devices."""
  users = TableSpec("users", vocabulary, 8, optimizer=SGD(0.1), combiner=combiner)
  items = TableSpec("items", 90, 8, optimizer=SGD(0.1), combiner=combiner)
  other = (FeatureSpec("user", users, (batch_size, 2)), FeatureSpec("item", items, (batch_size, 3)))
  rng = np.random.default_rng(seed)
  raw = {"user": rng.integers(vocabulary - 8, vocabulary, (batch_size, 2)),
         "item": rng.integers(0, 90, (batch_size, 3))}
  return preprocess(raw, other, auto_stack_tables(other, num_devices=2))[0]


_OTHER_PLANS = {
    "vocabulary": (dict(vocabulary=9000), r"rows per shard R \d+ \(batch\) vs 80 \(plan\); table"
                   r" 'users' vocabulary_size 9000 \(batch\) vs 60 \(plan\)"),
    "batch_size": (dict(batch_size=2 * BATCH),
                   r"feature 'user' batch_size 32 \(batch\) vs 16 \(plan\)"),
    "combiner": (dict(combiner="mean"), r"combiner 'mean' \(batch\) vs 'sum' \(plan\)"),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("change", list(_OTHER_PLANS))
def test_a_batch_of_another_plan_with_the_plans_shapes_is_refused(change, jit):
  """Same G, N and capacities, so the same shapes, but other rows, samples or gains.

  Such a batch once gave zero activations and no update, silently; under jit
  (tracers: no row or sample to read) even after the host check came. The
  batch's static signature tells the plans apart while tracing.
  """
  features = _features()
  plan = _plan(features, 2)
  kwargs, differences = _OTHER_PLANS[change]
  batch = _other_plan_batch(**kwargs)
  (stack,) = plan.layout.stack_names
  assert all(np.shape(a) == np.shape(b)
             for a, b in zip(batch[stack], _batch(features, plan)[stack]))
  variables = init_embedding_variables(plan, jax.random.key(0))
  lookup = lambda t, b: embedding_lookup(plan, t, b)  # noqa: E731
  update = lambda v, b, g: apply_embedding_gradients(plan, v, b, g, 0)  # noqa: E731
  if jit:
    lookup, update = jax.jit(lookup), jax.jit(update)
  message = (rf"batch\['{stack}'\] was preprocessed for another layout than the plan's stack"
             rf" '{stack}' \(tables \['users', 'items'\]\): (.*; )?{differences}")
  with pytest.raises(ValueError, match=message):
    lookup(variables.tables, batch)
  with pytest.raises(ValueError, match=message):
    update(variables, batch, _grads(features))


@pytest.mark.parametrize("change, message", [
    (dict(vocabulary=9000), r"local row \d+, but its shards hold R=\d+ rows"),
    (dict(batch_size=2 * BATCH), r"local sample \d+, but each device holds \d+ samples"),
])
def test_a_hand_built_batch_of_another_vocabulary_or_batch_size_is_refused(change, message):
  """A StackBatch built without a signature: outside jit its largest row and sample tell."""
  features = _features()
  plan = _plan(features, 2)
  batch = {name: StackBatch(*arrays) for name, arrays in _other_plan_batch(**change).items()}
  variables = init_embedding_variables(plan, jax.random.key(0))
  with pytest.raises(ValueError, match=r"batch\['\w+'\] was preprocessed for another layout: it"
                                       r" holds " + message):
    embedding_lookup(plan, variables.tables, batch)
  with pytest.raises(ValueError, match=message):
    apply_embedding_gradients(plan, variables, batch, _grads(features), 0)


_PICKLE_IN_ANOTHER_PROCESS = """
import pickle, sys
import numpy as np
from sc_framework import FeatureSpec, TableSpec
from sc_framework.optimizers import SGD
from sc_framework.preprocessing import preprocess
from sc_framework.stacking import auto_stack_tables
users = TableSpec("users", 60, 8, optimizer=SGD(0.1))
items = TableSpec("items", 90, 8, optimizer=SGD(0.1))
features = (FeatureSpec("user", users, ({B}, 2)), FeatureSpec("item", items, ({B}, 3)))
rng = np.random.default_rng(7)
raw = {{f.name: rng.integers(0, f.table.vocabulary_size, f.input_shape) for f in features}}
batch, _ = preprocess(raw, features, auto_stack_tables(features, num_devices=2))
sys.stdout.buffer.write(pickle.dumps(batch))
"""


def test_a_jitted_lookup_compiles_once_for_batches_of_the_plan_also_from_another_process():
  """The signature is part of the jit cache key: equal for every batch of the plan,
  also one unpickled from a process whose string hashes differ (a loader's worker)."""
  features = _features()
  plan = _plan(features, 2)
  variables = init_embedding_variables(plan, jax.random.key(0))
  lookup = jax.jit(lambda t, b: embedding_lookup(plan, t, b))
  for seed in range(3):
    lookup(variables.tables, _batch(features, plan, seed))
  env = {**os.environ, "PYTHONHASHSEED": "12345", "JAX_PLATFORMS": "cpu"}
  made = subprocess.run([sys.executable, "-c", _PICKLE_IN_ANOTHER_PROCESS.format(B=BATCH)],
                        env=env, capture_output=True, check=True).stdout
  unpickled = pickle.loads(made)
  lookup(variables.tables, unpickled)
  assert lookup._cache_size() == 1
  (stack,) = plan.layout.stack_names
  assert unpickled[stack].signature == plan.batch_signature(stack)
  assert hash(unpickled[stack].signature) == hash(plan.batch_signature(stack))


@pytest.mark.parametrize("cast, wrong", [
    (lambda x: x.astype(np.float32), r"unique_rows is float32, .*entry_unique_index is float32"),
    (lambda x: x.astype(np.uint8) if x.dtype.kind == "i" else x, r"unique_rows is uint8"),
    (lambda x: x.astype(np.int16) if x.dtype.kind == "i" else x,
     r"unique_rows is int16, entry_samples is int16"),
], ids=["float32", "uint8", "int16"])
@pytest.mark.parametrize("num_devices", [1, 8])
def test_a_batch_cast_to_another_dtype_is_refused(num_devices, cast, wrong):
  """A batch cast like the model's inputs: floats failed deep inside JAX ("indices must
  have an integer type"), uint8 turned the unused rows' -1 into row 255 (silently)."""
  features = _features()
  plan = _plan(features, num_devices)
  variables = init_embedding_variables(plan, jax.random.key(0))
  batch = {name: jax.tree.map(cast, stack) for name, stack in _batch(features, plan).items()}
  (stack,) = plan.layout.stack_names
  message = rf"batch\['{stack}'\]: {wrong}.* must be int32 \(or int64\)"
  with pytest.raises(TypeError, match=message):
    jax.jit(lambda t, b: embedding_lookup(plan, t, b))(variables.tables, batch)
  with pytest.raises(TypeError, match=message):
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


def test_arguments_of_another_kind_are_refused_naming_the_argument():
  """A bare array, a list, None or the tables alone failed with Python's own errors
  ("unhashable type", "'dict' object has no attribute 'tables'")."""
  features = (FeatureSpec("user", TableSpec("users", 60, 8, optimizer=Adam(0.1)), (BATCH, 2)),)
  plan = _plan(features)
  variables = init_embedding_variables(plan, jax.random.key(0))
  batch = _batch(features, plan)
  grads = _grads(features)
  stacked = stacked_lookup(plan, variables.tables, batch)
  cases = [
      (lambda: apply_embedding_gradients(plan, variables, batch, grads["user"], 0),
       r"activation_grads must be a dict keyed by feature name, got ArrayImpl"),
      (lambda: apply_embedding_gradients(plan, variables, batch, [grads["user"]], 0),
       r"activation_grads must be a dict keyed by feature name, got list"),
      (lambda: apply_embedding_gradients(plan, variables, batch, {"user": None}, 0),
       r"activation_grads\['user'\] must be an array, got NoneType"),
      (lambda: apply_embedding_gradients(plan, variables.tables, batch, grads, 0),
       r"variables must be the EmbeddingVariables .* got dict"),
      (lambda: apply_stacked_gradients(plan, variables, batch, list(stacked.values()), 0),
       r"stacked_grads must be a dict keyed by stack name, got list"),
      (lambda: apply_stacked_gradients(plan, variables, batch, dict.fromkeys(stacked), 0),
       r"stacked_grads\[.*\] must be an array, got NoneType"),
      (lambda: split_stacked_activations(plan, stacked[next(iter(stacked))]),
       r"must be a dict keyed by stack name, got ArrayImpl"),
      # Integer gradients were cast silently.
      (lambda: apply_embedding_gradients(
          plan, variables, batch, {"user": grads["user"].astype(jnp.int32)}, 0),
       r"activation_grads\['user'\] has dtype int32; it must be floating point"),
      (lambda: apply_stacked_gradients(
          plan, variables, batch, {k: v.astype(jnp.int32) for k, v in stacked.items()}, 0),
       r"stacked_grads\[.*\] has dtype int32; it must be floating point"),
  ]
  for call, message in cases:
    with pytest.raises(TypeError, match=message):
      call()


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
                     rf" shape {re.escape(returned)} when asked for shape \(1, 8\).*"
                     r"pretrained embeddings.*replace_tables"):
    init_embedding_variables(plan, jax.random.key(0))


def test_an_initializer_is_asked_for_one_row_and_the_documented_recipe_scales_by_d():
  """TableSpec's docstring: (1, D) per row, so fan-based initializers see
  fan_in = 1; variance_scaling(1, 'fan_out', 'normal') gives 1/sqrt(D)."""
  shapes = []
  recipe = jax.nn.initializers.variance_scaling(1.0, "fan_out", "normal")

  def recorded(key, shape, dtype):
    shapes.append(tuple(shape))
    return recipe(key, shape, dtype)

  table = TableSpec("users", 4000, 16, initializer=recorded)
  plan = _plan((FeatureSpec("user", table, (BATCH, 2)),))
  (stack,) = init_embedding_variables(plan, jax.random.key(0)).tables.values()
  assert set(shapes) == {(1, 16)}
  values = np.asarray(stack)[:4000, :16]
  assert abs(values.std() / 0.25 - 1) < 0.05, values.std()


def test_an_initializer_may_return_numpy_or_another_dtype():
  table = TableSpec("users", 60, 8, initializer=lambda key, shape, dtype: np.full(shape, 2, np.int32))
  plan = _plan((FeatureSpec("user", table, (BATCH, 2)),))
  variables = init_embedding_variables(plan, jax.random.key(0))
  (stack,) = variables.tables.values()
  assert stack.dtype == jnp.float32 and set(np.unique(np.asarray(stack))) == {0.0, 2.0}


@pytest.mark.parametrize("update", [False, True, "split"])
def test_a_call_inside_shard_map_is_refused_saying_to_call_outside(update):
  """Inside shard_map each array is one device's block: the tables were said to "belong to
  another layout", though they were the right ones."""
  features = _features()
  plan = _plan(features, num_devices=8)
  variables = init_embedding_variables(plan, jax.random.key(0))
  batch = _batch(features, plan)
  rows = jax.sharding.PartitionSpec("devices")

  stacked = stacked_lookup(plan, variables.tables, batch)

  def body(variables, batch):
    if update == "split":
      return split_stacked_activations(plan, stacked)
    if update:
      return apply_embedding_gradients(plan, variables, batch, _grads(features), 0)
    return embedding_lookup(plan, variables.tables, batch)

  with pytest.raises(ValueError, match=r"called inside shard_map \(manual mesh axes"
                                       r" \['devices'\]\).* Call them outside shard_map"):
    jax.jit(jax.shard_map(body, mesh=plan.mesh, in_specs=rows, out_specs=rows))(variables,
                                                                                 batch)
