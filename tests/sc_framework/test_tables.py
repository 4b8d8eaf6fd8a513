"""Per-table host arrays out of and into the stacked variables (sc_framework.primitives._tables).

Oracles: the initializer's documented per-row keys (table_values of fresh
variables), and a dense numpy gather of the given arrays (the lookup after
replace_tables), independent of the stacking code.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

from sc_framework import FeatureSpec, TableSpec, stack_tables
from sc_framework.optimizers import Adam, RowWiseAdagrad, SlotSpec
from sc_framework.preprocessing import preprocess
from sc_framework.primitives import (
    EmbeddingPlan,
    embedding_lookup,
    embedding_variable_shapes,
    init_embedding_variables,
    replace_tables,
    slot_values,
    table_seed,
    table_values,
)
from sc_framework.stacking import logical_to_global_rows
from tests.numerics import assert_close, assert_same_bits

LIMITS = dict(max_ids_per_partition=256, max_unique_ids_per_partition=256)
BATCH, IDS = 16, 3


def _features():
  # a and b share a stack (different dims: padding columns); d has Adam's
  # table-shaped slots. No vocabulary is a multiple of 8 x 2: padding rows.
  a = TableSpec("a", 50, 12, optimizer=RowWiseAdagrad(0.1), **LIMITS)
  b = TableSpec("b", 121, 10, optimizer=RowWiseAdagrad(0.1), **LIMITS)
  d = TableSpec("d", 170, 20, optimizer=Adam(0.01), **LIMITS)
  return [FeatureSpec(f"f_{t.name}", t, (BATCH, IDS)) for t in (a, b, d)]


def _plan(num_devices: int, shards: int, groups=None) -> EmbeddingPlan:
  features = _features()
  mesh = Mesh(np.array(jax.devices()[:num_devices]), ("devices",))
  layout = None if groups is None else stack_tables(features, groups, num_devices, shards)
  return EmbeddingPlan.create(features, mesh=mesh, axis_name="devices",
                              shards_per_device=shards, layout=layout)


LAYOUTS = [(1, 1, None), (8, 1, None), (8, 2, None), (8, 2, [["a"], ["b"], ["d"]]),
           (4, 2, [["a", "b"], ["d"]])]


def _random_tables(plan, seed):
  rng = np.random.default_rng(seed)
  return {f.table.name: rng.standard_normal((f.table.vocabulary_size, f.table.embedding_dim),
                                            dtype=np.float32)
          for f in plan.feature_specs}


@pytest.mark.parametrize("num_devices, shards, groups", LAYOUTS)
def test_table_values_of_fresh_variables_are_the_initializers_rows(num_devices, shards, groups):
  plan = _plan(num_devices, shards, groups)
  key = jax.random.key(3)
  values = table_values(plan, init_embedding_variables(plan, key))
  for feature in plan.feature_specs:
    table = feature.table
    table_key = jax.random.fold_in(key, table_seed(table.name))
    rows = jax.vmap(lambda i, k=table_key, t=table: t.initializer(
        jax.random.fold_in(k, i), (1, t.embedding_dim), jnp.float32)[0])(
            jnp.arange(table.vocabulary_size))
    assert_same_bits(values[table.name], np.asarray(rows))
  assert list(table_values(plan, init_embedding_variables(plan, key), ["d", "a"])) == ["d", "a"]


@pytest.mark.parametrize("num_devices, shards, groups", LAYOUTS)
@pytest.mark.parametrize("seed", [0, 1])
def test_replaced_tables_are_looked_up_as_their_arrays(num_devices, shards, groups, seed):
  plan = _plan(num_devices, shards, groups)
  variables = init_embedding_variables(plan, jax.random.key(seed))
  arrays = _random_tables(plan, seed)
  replaced = replace_tables(plan, variables, {"a": arrays["a"], "d": arrays["d"]})
  # The other table and every padding row and column are unchanged.
  values = table_values(plan, replaced)
  assert_same_bits(values["b"], table_values(plan, variables, ["b"])["b"])
  for name in ("a", "d"):
    assert_same_bits(values[name], arrays[name])
  for stack in plan.layout.stacks:
    before, after = np.asarray(variables.tables[stack.name]), np.asarray(replaced.tables[stack.name])
    used = np.zeros(after.shape, bool)
    for table in stack.tables:
      rows = logical_to_global_rows(plan.layout, table.name, np.arange(table.vocabulary_size))
      used[np.asarray(rows), : table.embedding_dim] = True
    assert_same_bits(after[~used], before[~used])
  # The lookup reads the given rows where the plan places them.
  rng = np.random.default_rng(seed + 10)
  ids = {f.name: rng.integers(0, f.table.vocabulary_size, (BATCH, IDS)) for f in plan.feature_specs}
  batch, _ = preprocess(ids, plan.feature_specs, plan.layout)
  activations = jax.jit(lambda t, b: embedding_lookup(plan, t, b))(replaced.tables, batch)
  expected_tables = {**values, **arrays, "b": values["b"]}
  for feature in plan.feature_specs:
    expected = expected_tables[feature.table.name][ids[feature.name]].sum(axis=1)
    assert_close(activations[feature.name], expected, terms=IDS)


@pytest.mark.parametrize("num_devices, shards, groups", LAYOUTS[1:3])
def test_slots_of_replaced_tables_are_given_or_initial(num_devices, shards, groups):
  plan = _plan(num_devices, shards, groups)
  variables = init_embedding_variables(plan, jax.random.key(0))
  # Slots that are not initial: one step of updates would do; random values are simpler.
  rng = np.random.default_rng(5)
  variables = variables._replace(slots={
      stack: {name: jnp.asarray(rng.random(v.shape, dtype=np.float32)).astype(v.dtype)
              for name, v in slots.items()} for stack, slots in variables.slots.items()})
  variables = jax.device_put(variables, jax.tree.map(lambda v: v.sharding, init_embedding_variables(
      plan, jax.random.key(0))))
  arrays = _random_tables(plan, 2)
  given_m = rng.random((170, 20), dtype=np.float32)
  replaced = replace_tables(plan, variables, {"a": arrays["a"], "d": arrays["d"]},
                            slots={"d": {"mu": given_m}})
  slots, before = slot_values(plan, replaced), slot_values(plan, variables)
  assert_same_bits(slots["a"]["accumulator"], np.full((50, 1), 0.1, np.float32))
  assert_same_bits(slots["b"]["accumulator"], before["b"]["accumulator"])
  assert_same_bits(slots["d"]["mu"], given_m)
  assert_same_bits(slots["d"]["nu"], np.zeros((170, 20), np.float32))
  assert slots["a"]["accumulator"].shape == (50, 1) and slots["d"]["mu"].shape == (170, 20)


def test_bfloat16_tables_round_the_given_rows():
  plan = _plan(8, 1)
  variables = init_embedding_variables(plan, jax.random.key(0), dtype=jnp.bfloat16)
  arrays = _random_tables(plan, 4)
  values = table_values(plan, replace_tables(plan, variables, {"b": arrays["b"]}), ["b"])
  assert_same_bits(values["b"], arrays["b"].astype(jnp.bfloat16))


def test_bfloat16_and_nested_list_arrays_are_taken():
  plan = _plan(8, 2)
  variables = init_embedding_variables(plan, jax.random.key(0), dtype=jnp.bfloat16)
  values = table_values(plan, variables)  # bfloat16 arrays
  again = replace_tables(plan, variables, values)
  for name, table in values.items():
    assert table.dtype == jnp.bfloat16
    assert_same_bits(table_values(plan, again, [name])[name], table)
  arrays = _random_tables(plan, 8)
  listed = replace_tables(plan, variables, {"b": arrays["b"].tolist()})
  assert_same_bits(table_values(plan, listed, ["b"])["b"], arrays["b"].astype(jnp.bfloat16))


def test_memory_mapped_tables_are_read(tmp_path):
  plan = _plan(8, 2)
  arrays = _random_tables(plan, 6)
  np.save(tmp_path / "d.npy", arrays["d"])
  mapped = np.load(tmp_path / "d.npy", mmap_mode="r")
  replaced = replace_tables(plan, init_embedding_variables(plan, jax.random.key(0)), {"d": mapped})
  assert_same_bits(table_values(plan, replaced, ["d"])["d"], arrays["d"])


def test_bad_arguments_are_named():
  plan = _plan(8, 1)
  variables = init_embedding_variables(plan, jax.random.key(0))
  good = _random_tables(plan, 0)
  with pytest.raises(KeyError, match=r"no table named \['z'\].*tables are"):
    replace_tables(plan, variables, {"z": good["a"]})
  with pytest.raises(KeyError, match=r"no table named \['z'\]"):
    table_values(plan, variables, ["a", "z"])
  with pytest.raises(TypeError, match="list of table names, got the string 'a'"):
    slot_values(plan, variables, "a")
  with pytest.raises(ValueError, match=r"table 'a': expected an array of shape \(50, 12\), got \(50, 11\)"):
    replace_tables(plan, variables, {"a": good["a"][:, :11]})
  with pytest.raises(ValueError, match=r"slot .mu. of table .d.: expected .*\(170, 20\)"):
    replace_tables(plan, variables, {"d": good["d"]}, slots={"d": {"mu": good["d"][:5]}})
  with pytest.raises(KeyError, match=r"table 'd' has no slot \['accumulator'\]"):
    replace_tables(plan, variables, {"d": good["d"]}, slots={"d": {"accumulator": good["d"]}})
  with pytest.raises(KeyError, match=r"slots are given for \['b'\], which are not in tables"):
    replace_tables(plan, variables, {"a": good["a"]}, slots={"b": {}})
  bad = good["a"].copy()
  bad[17, 3] = np.nan
  with pytest.raises(ValueError, match="table 'a': row 17 holds a value that is not finite in"
                                       " float32"):
    replace_tables(plan, variables, {"a": bad})
  large = good["a"].astype(np.float64)
  large[3, 0] = 1e300  # finite in float64, not in the table's float32
  with pytest.raises(ValueError, match="table 'a': row 3 holds a value that is not finite"):
    replace_tables(plan, variables, {"a": large})
  with pytest.raises(ValueError, match="slot 'accumulator' of table 'a': row 0 holds a value"):
    replace_tables(plan, variables, {"a": good["a"]},
                   slots={"a": {"accumulator": np.full((50, 1), 1e40)}})
  with pytest.raises(ValueError, match="slot 'v': minimum must be None or a finite number no"
                                       " greater than initial_value 0.0, got 1.0"):
    SlotSpec("v", None, 0.0, minimum=1.0)
  # A negative accumulator was taken; the next update made its row NaN.
  negative = np.full((50, 1), 0.5, np.float32)
  negative[7] = -1.0
  with pytest.raises(ValueError, match=r"slot 'accumulator' of table 'a': row 7 holds a value"
                                       r" below 0, .* NaN\): \[-1.0\]"):
    replace_tables(plan, variables, {"a": good["a"]}, slots={"a": {"accumulator": negative}})
  second_moment = np.abs(good["d"])
  second_moment[169, 19] = -1e-3
  with pytest.raises(ValueError, match="slot 'nu' of table 'd': row 169 holds a value below 0"):
    replace_tables(plan, variables, {"d": good["d"]}, slots={"d": {"nu": second_moment}})
  replace_tables(plan, variables, {"d": good["d"]},  # a first moment may be negative
                 slots={"d": {"mu": -second_moment, "nu": np.zeros_like(second_moment)}})
  with pytest.raises(TypeError, match="tables must map table names to arrays, got list"):
    replace_tables(plan, variables, ["a"])
  with pytest.raises(TypeError, match=r"slots\['a'\] must map slot names to arrays, got ndarray"):
    replace_tables(plan, variables, {"a": good["a"]}, slots={"a": good["a"]})
  with pytest.raises(TypeError, match=r"slots must map table names to \{slot name: array\}"):
    replace_tables(plan, variables, {"a": good["a"]}, slots=["a"])
  with pytest.raises(ValueError, match=r"table 'a': not an array of rows"):
    replace_tables(plan, variables, {"a": [[1.0] * 12] * 49 + [[1.0]]})
  with pytest.raises(TypeError, match="table 'a': expected a float or integer array, got bool"):
    replace_tables(plan, variables, {"a": good["a"] > 0})


def test_variables_of_a_non_float_dtype_or_without_a_key_are_refused():
  """dtype=jnp.int32 made all-zero tables and dtype=bool all-True ones, refused only at the
  first update; an int key failed inside JAX ("invalid PRNG key data")."""
  plan = _plan(1, 1)
  for dtype in (jnp.int32, bool):
    for make in (init_embedding_variables, embedding_variable_shapes):
      args = (plan, jax.random.key(0)) if make is init_embedding_variables else (plan,)
      with pytest.raises(TypeError, match="dtype must be floating point .* got (int32|bool)"):
        make(*args, dtype=dtype)
  with pytest.raises(TypeError, match=r"key must be a PRNG key such as jax.random.key\(0\), got 0"):
    init_embedding_variables(plan, 0)
  with pytest.raises(TypeError, match="table_seed takes a table name"):
    table_seed(5)
  with jax.default_prng_impl("rbg"):  # a raw key of 4 words, as TPU jobs often use
    init_embedding_variables(plan, jax.random.PRNGKey(3))
  raw = init_embedding_variables(plan, jax.random.PRNGKey(3))  # both kinds of key are taken
  typed = init_embedding_variables(plan, jax.random.wrap_key_data(jax.random.PRNGKey(3)))
  assert_same_bits(table_values(plan, raw)["a"], table_values(plan, typed)["a"])


def test_a_trainer_starts_from_replaced_tables():
  from flax import linen as nn  # pylint: disable=g-import-not-at-top

  from pipelining import Callback, Trainer  # pylint: disable=g-import-not-at-top

  class Head(nn.Module):
    @nn.compact
    def __call__(self, activations, dense):
      del dense
      return nn.Dense(1)(jnp.concatenate([activations[k] for k in sorted(activations)], 1))[:, 0]

  features = _features()
  trainer = Trainer(Head(), features,
                    lambda p, y: jnp.mean((p - y) ** 2), optax.sgd(0.1), progress="off")
  with pytest.raises(RuntimeError, match="no state yet; call initialize"):
    trainer.replace_tables({})
  rng = np.random.default_rng(0)
  batch = {"sparse": {f.name: rng.integers(0, f.table.vocabulary_size, (BATCH, IDS))
                      for f in features},
           "labels": rng.standard_normal(BATCH).astype(np.float32)}
  trainer.initialize(batch)
  arrays = _random_tables(trainer.plan, 1)
  trainer.replace_tables({"b": arrays["b"]})
  assert_same_bits(trainer.table_values(["b"])["b"], arrays["b"])
  assert trainer.slot_values(["b"])["b"]["accumulator"].shape == (121, 1)
  assert int(trainer.state.step) == 0
  trainer.fit([batch])
  assert not np.array_equal(trainer.table_values(["b"])["b"], arrays["b"])

  class ReplaceAtStep(Callback):
    def on_step_end(self, trainer, step, metrics):
      trainer.replace_tables({"b": arrays["b"]})

  with pytest.raises(RuntimeError, match="replace_tables during fit .*between fits"):
    trainer.fit([batch, batch], callbacks=[ReplaceAtStep()])
  trainer.replace_tables({"b": arrays["b"]})  # Between fits, as the message says.


def test_readme_tables_example_runs():
  """The README's tables-example block runs as written (its asserts included)."""
  import pathlib  # pylint: disable=g-import-not-at-top

  text = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
  start, end = "<!-- tables-example:start -->", "<!-- tables-example:end -->"
  assert start in text and end in text, "README.md lost its tables-example markers"
  code = text.split(start, 1)[1].split(end, 1)[0].split("```python\n", 1)[1].split("```", 1)[0]
  namespace: dict = {}
  exec(compile(code, "<README tables example>", "exec"), namespace)  # pylint: disable=exec-used
  assert namespace["accumulator"].shape == (1000, 1)
  assert np.all(namespace["accumulator"] == RowWiseAdagrad().initial_accumulator)
