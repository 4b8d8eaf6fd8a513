"""The Trainer takes the library's values: a stacking, a table dtype, nested feature specs.

Each option is checked against the Trainer with its default (auto stacking,
float32 tables, a flat list of specs) on the same data: the logical tables
(layout removed) and the dense parameters agree up to the changed order of
float32 sums; a run stopped and resumed on its own option is bit-exact.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

from checkpoint import CheckpointManager, IncompatibleCheckpointError, TableRestore
from checkpoint.cli import main as cli
from pipelining import Trainer
from sc_framework.optimizers import Adagrad
from sc_framework.stacking import EmbeddingLayout, unstack
from test_resume import stop_at
from test_trainer import BATCH, LinearHead, make_batches, make_specs, mesh_of, mse
from tests.numerics import assert_close, assert_same_bits

NUM_BATCHES = 4
STOP = 2
# The longest sum behind a table row's gradient: every id of a batch (3 + 2 + 1
# per sample) may hit one row.
TERMS = 6 * BATCH


def make_trainer(workdir=None, *, specs=None, model=None, devices=2, **options):
  return Trainer(model or LinearHead(), specs or make_specs(Adagrad(0.3)), mse, optax.adam(0.05),
                 mesh=mesh_of(devices), progress="off", padding_id=-1, workdir=workdir,
                 **options)


def logical_state(trainer):
  """Tables and accumulators per table (layout removed), dense parameters, step."""
  layout = trainer.plan.layout
  embeddings = jax.device_get(trainer.state.embeddings)
  accumulators = {stack: slots["accumulator"] for stack, slots in embeddings.slots.items()}
  return {"tables": unstack(embeddings.tables, layout), "slots": unstack(accumulators, layout),
          "params": jax.device_get(trainer.state.params), "step": int(trainer.state.step)}


def assert_states(got, want, *, same_program):
  assert got["step"] == want["step"]
  pairs = jax.tree_util.tree_flatten_with_path((got["tables"], got["slots"], got["params"]))[0]
  expected = jax.tree.leaves((want["tables"], want["slots"], want["params"]))
  assert len(pairs) == len(expected)
  for (path, actual), value in zip(pairs, expected):
    name = jax.tree_util.keystr(path)
    if same_program:
      assert_same_bits(actual, value, err_msg=name)
    else:
      assert_close(np.asarray(actual, np.float32), np.asarray(value, np.float32), terms=TERMS,
                   steps=NUM_BATCHES, err_msg=name)


def stopped_and_resumed(tmp_path, **options):
  """(a run stopped after STOP and resumed in a new Trainer, the uninterrupted run)."""
  batches = make_batches(NUM_BATCHES, seed=41)
  history = make_trainer(tmp_path, **options).fit(batches, callbacks=[stop_at(STOP)])
  assert history.interrupted and history.final_step == STOP
  resumed = make_trainer(tmp_path, **options)
  history = resumed.fit(batches)
  assert history.resumed_from == STOP and history.final_step == NUM_BATCHES
  straight = make_trainer(None, **options)
  straight.fit(batches)
  return resumed, straight


# --- stacking -------------------------------------------------------------------


@pytest.fixture(scope="module")
def auto_run():
  trainer = make_trainer()
  trainer.fit(make_batches(NUM_BATCHES, seed=41))
  return logical_state(trainer)


@pytest.mark.parametrize("stacking", [[["a"], ["b"]], [["b", "a"]], "separate"],
                         ids=["groups", "reordered_group", "separate"])
def test_explicit_stacking_trains_as_auto_stacking(auto_run, stacking):
  trainer = make_trainer(stacking=stacking)
  trainer.fit(make_batches(NUM_BATCHES, seed=41))
  expected_stacks = ["a", "b"] if stacking == "separate" else ["__".join(g) for g in stacking]
  assert [stack.name for stack in trainer.plan.layout.stacks] == expected_stacks
  assert_states(logical_state(trainer), auto_run, same_program=False)


def test_a_layout_value_is_used_as_given(auto_run):
  layout = make_trainer(stacking=[["b"], ["a"]]).plan.layout
  layout = EmbeddingLayout.from_json(layout.to_json())  # e.g. read from another job
  trainer = make_trainer(stacking=layout)
  assert trainer.plan.layout == layout
  trainer.fit(make_batches(NUM_BATCHES, seed=41))
  assert_states(logical_state(trainer), auto_run, same_program=False)


def test_explicit_groups_resume_bit_exact(tmp_path):
  resumed, straight = stopped_and_resumed(tmp_path, stacking=[["b"], ["a"]])
  assert [stack.name for stack in resumed.plan.layout.stacks] == ["b", "a"]
  assert_states(logical_state(resumed), logical_state(straight), same_program=True)


def test_groups_resume_a_checkpoint_of_another_stacking(tmp_path):
  batches = make_batches(NUM_BATCHES, seed=41)
  make_trainer(tmp_path).fit(batches, callbacks=[stop_at(STOP)])
  resumed = make_trainer(tmp_path, stacking=[["a"], ["b"]])
  assert resumed.fit(batches).resumed_from == STOP
  straight = make_trainer()
  straight.fit(batches)
  assert_states(logical_state(resumed), logical_state(straight), same_program=False)


@pytest.mark.parametrize("stacking, message", [
    ("grouped", "stacking must be 'auto', 'separate'.*got the string 'grouped'"),
    (3, "stacking must be .* got int"),
    ([["a", 1]], "stacking group 0 must be a sequence of table names"),
    ([["a"]], r"tables \['b'\] are in no stacking group"),
    ([["a"], ["b"], ["c"]], "stacking group 2 names table 'c', which no feature reads"),
    ([["a", "b"], ["b"]], "table 'b' is in stacking groups 0 and 1"),
])
def test_stacking_errors_name_the_value(stacking, message):
  with pytest.raises(ValueError, match=message):
    make_trainer(stacking=stacking)


def test_a_mesh_without_the_table_axis_is_refused_naming_its_axes():
  with pytest.raises(ValueError, match=r"mesh has no axis 'rows'; its axes are \('devices',\)"):
    make_trainer(axis_name="rows")


def test_a_layout_for_other_devices_or_tables_is_refused():
  layout = make_trainer(devices=4).plan.layout
  with pytest.raises(ValueError, match="layout is for G=4 devices .* mesh axis has 2 devices"):
    make_trainer(stacking=layout)
  with pytest.raises(ValueError, match="S=1 shards per device.*shards_per_device is 2"):
    make_trainer(stacking=make_trainer().plan.layout, shards_per_device=2)
  other = make_specs(Adagrad(0.3))[:2]
  with pytest.raises(ValueError, match="the layout's features .* differ from the specs'"):
    make_trainer(specs=other, model=TwoFeatureHead(), stacking=make_trainer().plan.layout)


def test_tables_that_cannot_share_a_stack_are_refused():
  specs = make_specs(Adagrad(0.3))
  table_b = dataclasses.replace(specs[1].table, optimizer=Adagrad(0.1))
  mixed = [specs[0], dataclasses.replace(specs[1], table=table_b), specs[2]]
  assert len(make_trainer(specs=mixed).plan.layout.stacks) == 2  # auto keeps them apart
  with pytest.raises(ValueError, match="tables 'a' and 'b' cannot share a stack"):
    make_trainer(specs=mixed, stacking=[["a", "b"]])


class TwoFeatureHead(nn.Module):
  @nn.compact
  def __call__(self, activations, dense):
    x = jnp.concatenate([activations["fa"], activations["fb"], dense], axis=1)
    return nn.Dense(1)(x)[:, 0]


# --- table dtype ----------------------------------------------------------------


def test_bfloat16_tables_train_with_float32_slots():
  trainer = make_trainer(table_dtype=jnp.bfloat16, log_every=1)
  batches = make_batches(2, seed=43)
  history = trainer.fit(batches, epochs=15)
  assert trainer.config.table_dtype == "bfloat16"
  embeddings = trainer.state.embeddings
  assert {t.dtype for t in embeddings.tables.values()} == {jnp.dtype(jnp.bfloat16)}
  assert {s.dtype for slots in embeddings.slots.values() for s in slots.values()} == {
      jnp.dtype(jnp.float32)}
  losses = [m["loss"] for m in history.metrics]
  assert len(losses) == 30 and np.mean(losses[-4:]) < 0.5 * np.mean(losses[:4])


@pytest.mark.parametrize("pipelining", [True, False], ids=["pipelined", "synchronous"])
def test_bfloat16_tables_resume_bit_exact(tmp_path, pipelining):
  resumed, straight = stopped_and_resumed(tmp_path, table_dtype="bfloat16",
                                          pipelining=pipelining)
  state = logical_state(resumed)
  assert {t.dtype for t in state["tables"].values()} == {jnp.dtype(jnp.bfloat16)}
  assert_states(state, logical_state(straight), same_program=True)


def test_a_checkpoint_of_another_table_dtype_is_refused(tmp_path):
  batches = make_batches(NUM_BATCHES, seed=41)
  make_trainer(tmp_path, table_dtype="bfloat16").fit(batches, callbacks=[stop_at(STOP)])
  with pytest.raises(IncompatibleCheckpointError, match="bfloat16.*float32"):
    make_trainer(tmp_path).fit(batches)


def test_a_float32_checkpoint_converted_to_bfloat16_resumes_in_a_bfloat16_trainer(tmp_path):
  """The refusal above says to convert first: `sc-checkpoint convert --table-dtype` does it,
  rounding each table value to nearest; a pipelined checkpoint's batch in flight comes along."""
  batches = make_batches(NUM_BATCHES, seed=41)
  make_trainer(tmp_path / "f32", pipelining=True).fit(batches, callbacks=[stop_at(STOP)])
  with pytest.raises(IncompatibleCheckpointError, match="--table-dtype bfloat16"):
    make_trainer(tmp_path / "f32", pipelining=True, table_dtype="bfloat16").fit(batches)
  with CheckpointManager(tmp_path / "f32" / "checkpoints", read_only=True) as mngr:
    stored = mngr.restore(STOP, TableRestore())["embedding"]
  assert cli(["convert", str(tmp_path / "f32" / "checkpoints"),
              str(tmp_path / "bf16" / "checkpoints" / str(STOP)), "--table-dtype", "bfloat16",
              "--quiet"]) == 0
  restored = make_trainer(tmp_path / "bf16", pipelining=True, table_dtype="bfloat16")
  restored.fit(batches, num_steps=STOP)  # Restores step STOP; no step is left to run.
  state = logical_state(restored)
  assert state["step"] == STOP
  for name, table in stored.tables.items():
    assert_same_bits(state["tables"][name], table.astype(jnp.bfloat16))
    assert_same_bits(state["slots"][name], stored.slots[name]["accumulator"])
  resumed = make_trainer(tmp_path / "bf16", pipelining=True, table_dtype="bfloat16")
  history = resumed.fit(batches)
  assert history.resumed_from == STOP and history.final_step == NUM_BATCHES
  assert {t.dtype for t in logical_state(resumed)["tables"].values()} == {
      jnp.dtype(jnp.bfloat16)}
  assert all(np.isfinite(m["loss"]) for m in history.metrics)


def test_table_dtype_errors_name_the_value():
  with pytest.raises(ValueError, match="table_dtype must be 'float32' or 'bfloat16'.*float16"):
    make_trainer(table_dtype="float16")


# --- nested feature specs -------------------------------------------------------


class NestedHead(nn.Module):
  """LinearHead reading its activations from {"user": {"a": ..., "a2": ...}, "item": [...]}."""

  @nn.compact
  def __call__(self, activations, dense):
    user, (item,) = activations["user"], activations["item"]
    x = jnp.concatenate([user["a"], item, user["a2"], dense], axis=1)
    return nn.Dense(1)(jnp.tanh(nn.Dense(6)(x)))[:, 0]


def nested(specs):
  fa, fb, fa2 = specs
  return {"user": {"a": fa, "a2": fa2}, "item": [fb]}


def nested_batches(batches):
  return [dict(batch, sparse=nested([batch["sparse"][n] for n in ("fa", "fb", "fa2")]))
          for batch in batches]


@pytest.mark.parametrize("ids", ["nested", "by_name"])
def test_nested_feature_specs_train_as_flat_ones(auto_run, ids):
  trainer = make_trainer(specs=nested(make_specs(Adagrad(0.3))), model=NestedHead())
  batches = make_batches(NUM_BATCHES, seed=41)
  trainer.fit(nested_batches(batches) if ids == "nested" else batches)
  # The same parameters under LinearHead's names: same initialisation, same data.
  assert_states(logical_state(trainer), auto_run, same_program=False)


def test_nested_ids_of_another_structure_are_refused():
  trainer = make_trainer(specs=nested(make_specs(Adagrad(0.3))), model=NestedHead())
  batch = make_batches(1, seed=41)[0]
  wrong = dict(batch, sparse={"user": batch["sparse"], "item": []})
  with pytest.raises(ValueError, match="feature specs' structure .* or be a dict with keys"):
    trainer.prepare(wrong)


def test_a_nested_leaf_that_is_not_a_spec_is_refused():
  specs = make_specs(Adagrad(0.3))
  with pytest.raises(TypeError, match=r"feature_specs\['item'\]\[0\] is a str"):
    make_trainer(specs={"user": specs[0], "item": ["fb"]})
