"""Sequence features (output (B, L, D)) against a dense per-position reference.

The reference never touches the code under test: activations are numpy
gathers of the logical tables (read back with `unstack`), one per position,
times the position's weight, zeros where the position holds the padding id;
combined features sharing the table are numpy weighted means; the gradient of
every table row is `jax.grad` of a dense jnp formulation over the full logical
tables, and SGD on it gives the expected tables. Batches go through the real
preprocessing in every input form (dense with padding, ragged with shorter
sequences, COO with absent positions), on 1 and 8 devices.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh

from sc_framework import FeatureSpec, TableSpec
from sc_framework.optimizers import SGD
from sc_framework.preprocessing import (
    DenseIds,
    RaggedRows,
    SparseIds,
    batch_stats,
    collect_stats,
    flatten_input,
    preprocess,
    size_limits_from_stats,
)
from sc_framework.primitives import (
    EmbeddingPlan,
    apply_embedding_gradients,
    embedding_lookup,
    init_embedding_variables,
)
from sc_framework.stacking import auto_stack_tables, unstack
from tests.numerics import assert_close, assert_same_bits

PAD = -1
BATCH, LENGTH, BAG = 16, 6, 4
LEARNING_RATE = 0.5


@functools.lru_cache(maxsize=None)
def _features() -> tuple[FeatureSpec, ...]:
  # "words" is read by a sequence feature and a combined (mean) feature, so
  # they share the table and its stack; "tags" (D' = 8 as well, sum) gets a
  # second sequence feature and may be stacked with "words" or not.
  words = TableSpec("words", 40, 6, optimizer=SGD(LEARNING_RATE), combiner="mean",
                    max_ids_per_partition=512, max_unique_ids_per_partition=512)
  tags = TableSpec("tags", 21, 8, optimizer=SGD(LEARNING_RATE), combiner="sum",
                   max_ids_per_partition=512, max_unique_ids_per_partition=512)
  return (
      FeatureSpec("tokens", words, (BATCH, LENGTH), (BATCH, LENGTH, 6)),
      FeatureSpec("bag", words, (BATCH, BAG)),
      FeatureSpec("tag_seq", tags, (BATCH, 3), (BATCH, 3, 8)),
  )


@functools.lru_cache(maxsize=None)
def _plan(num_devices: int, shards: int = 1) -> EmbeddingPlan:
  if jax.device_count() < num_devices:
    pytest.skip(f"needs {num_devices} devices")
  mesh = Mesh(np.array(jax.devices()[:num_devices]), ("devices",))
  return EmbeddingPlan.create(_features(), mesh=mesh, shards_per_device=shards)


@functools.lru_cache(maxsize=None)
def _jitted(plan: EmbeddingPlan):
  lookup = jax.jit(lambda tables, batch: embedding_lookup(plan, tables, batch))
  update = jax.jit(lambda v, batch, grads: apply_embedding_gradients(plan, v, batch, grads, 0))
  return lookup, update


def _dense_batch(rng: np.random.Generator):
  """feature -> (ids [B, L] with PAD, weights [B, L]); the reference's input."""
  out = {}
  for feature in _features():
    shape = feature.input_shape
    vocab = feature.table.vocabulary_size
    ids = rng.integers(0, vocab, shape)
    ids[rng.random(shape) < 0.3] = PAD
    if feature.name == "tokens":  # shorter sequences: a padded tail, one empty sample
      lengths = rng.integers(0, LENGTH + 1, BATCH)
      ids[np.arange(LENGTH)[None, :] >= lengths[:, None]] = PAD
      ids[3] = PAD
      ids[5, :2] = ids[5, 2]  # repeated ids in one sample: distinct positions
    weights = rng.uniform(0.25, 2.0, shape).astype(np.float32)
    if feature.name == "bag":
      ids[:, 0] = rng.integers(0, vocab, BATCH)  # mean needs an id per sample
    out[feature.name] = (ids, weights)
  return out


def _as_form(ids: np.ndarray, weights: np.ndarray, form: str, rng: np.random.Generator):
  """The same positions in one of the accepted input forms."""
  if form == "dense":
    return DenseIds(ids, weights)
  if form == "ragged":  # drop each sample's padded tail: shorter sequences
    rows, row_weights = [], []
    for sample_ids, sample_weights in zip(ids, weights):
      used = np.flatnonzero(sample_ids != PAD)
      end = used[-1] + 1 if used.size else 0
      rows.append(sample_ids[:end])
      row_weights.append(sample_weights[:end])
    return RaggedRows(rows, row_weights)
  present = np.argwhere(ids != PAD)
  order = rng.permutation(len(present))
  present = present[order]
  return SparseIds(present, ids[present[:, 0], present[:, 1]],
                   ids.shape, weights[present[:, 0], present[:, 1]])


def _reference_activations(tables, raw):
  out = {}
  for feature in _features():
    ids, weights = raw[feature.name]
    table = tables[feature.table.name].astype(np.float64)
    valid = ids != PAD
    rows = table[np.where(valid, ids, 0)] * (weights * valid)[..., None]
    if feature.sequence_length is None:  # mean over the sample's weights
      rows = rows.sum(axis=1) / (weights * valid).sum(axis=1)[:, None]
    out[feature.name] = rows
  return out


def _reference_table_grads(tables, raw, grads):
  """d/dT of sum_f <a_f(T), G_f> for dense logical tables (jax.grad)."""

  def objective(dense_tables):
    total = 0.0
    for feature in _features():
      ids, weights = raw[feature.name]
      valid = ids != PAD
      table = dense_tables[feature.table.name]
      rows = table[np.where(valid, ids, 0)] * jnp.asarray(weights * valid)[..., None]
      if feature.sequence_length is None:
        rows = rows.sum(axis=1) / jnp.asarray((weights * valid).sum(axis=1))[:, None]
      total = total + jnp.sum(rows * grads[feature.name])
    return total

  as_jnp = {name: jnp.asarray(value) for name, value in tables.items()}
  return {name: np.asarray(g) for name, g in jax.grad(objective)(as_jnp).items()}


def _run_step(plan, seed: int, form: str):
  rng = np.random.default_rng(seed)
  variables = init_embedding_variables(plan, jax.random.key(seed))
  tables = unstack({k: np.asarray(v) for k, v in variables.tables.items()}, plan.layout)
  raw = _dense_batch(rng)
  inputs = {name: _as_form(ids, w, form if name != "bag" else "dense", rng)
            for name, (ids, w) in raw.items()}
  batch, _ = preprocess(inputs, _features(), plan.layout, padding_id=PAD)
  lookup, update = _jitted(plan)
  activations = lookup(variables.tables, batch)
  grads = {f.name: rng.normal(size=f.output_shape).astype(np.float32) for f in _features()}
  new = update(variables, batch, grads)
  new_tables = unstack({k: np.asarray(v) for k, v in new.tables.items()}, plan.layout)
  return tables, raw, grads, activations, new_tables


@pytest.mark.parametrize("num_devices", [1, 8])
@pytest.mark.parametrize("form", ["dense", "ragged", "coo"])
@pytest.mark.parametrize("seed", [0, 1])
def test_lookup_and_update_match_dense_reference(num_devices, form, seed):
  plan = _plan(num_devices)
  tables, raw, grads, activations, new_tables = _run_step(plan, seed, form)
  expected = _reference_activations(tables, raw)
  for feature in _features():
    got = np.asarray(activations[feature.name])
    assert got.shape == feature.output_shape
    assert_close(got, expected[feature.name], terms=BAG, err_msg=feature.name)
  tokens, _ = raw["tokens"]
  assert not np.asarray(activations["tokens"])[tokens == PAD].any(), "padding must give zeros"
  table_grads = _reference_table_grads(tables, raw, grads)
  for name, table in tables.items():
    touched = np.zeros(table.shape[0], bool)
    for feature in _features():
      if feature.table.name == name:
        ids = raw[feature.name][0]
        touched[ids[ids != PAD]] = True
    expected_table = table - LEARNING_RATE * table_grads[name]
    assert_close(new_tables[name][touched], expected_table[touched],
                 terms=BATCH * (LENGTH + BAG), err_msg=name)
    assert_same_bits(new_tables[name][~touched], table[~touched], err_msg=f"{name} untouched")


def test_eight_devices_with_shards_equal_one_device():
  one = _run_step(_plan(1), 7, "ragged")
  many = _run_step(_plan(8, 2), 7, "ragged")
  for feature in _features():
    assert_close(many[3][feature.name], one[3][feature.name], terms=BAG)
  for name in one[4]:
    assert_close(many[4][name], one[4][name], terms=BATCH * (LENGTH + BAG))


def test_sequence_and_combined_features_share_a_stack():
  layout = _plan(8).layout
  stack = layout.stack_of_feature("tokens")
  names = [f.name for f in stack.features]
  assert "bag" in names and "tokens" in names
  assert layout.feature("tokens").batch_size == BATCH * LENGTH  # one sample per position


@settings(max_examples=15, deadline=None)
@given(
    batch=st.integers(1, 5),
    length=st.integers(1, 6),
    width=st.integers(0, 6),
    seed=st.integers(0, 2**16),
)
def test_flatten_puts_every_id_at_its_position(batch, length, width, seed):
  """Position l of sample b is sample b * L + l, in every input form."""
  width = min(width, length)
  rng = np.random.default_rng(seed)
  table = TableSpec("t", 9, 4)
  feature = FeatureSpec("s", table, (batch, length), (batch, length, 4))
  ids = rng.integers(0, 9, (batch, width))
  ids[rng.random(ids.shape) < 0.4] = PAD
  weights = rng.uniform(0.5, 1.5, ids.shape).astype(np.float32)
  expected = np.full((batch, length), PAD)
  expected[:, :width] = ids
  expected_weights = np.zeros((batch, length), np.float32)
  expected_weights[:, :width] = weights
  expected_weights[expected == PAD] = 0.0
  for form in ("dense", "ragged", "coo"):
    flat = flatten_input(_as_form(ids, weights, form, rng), feature, padding_id=PAD)
    assert flat.batch_size == batch * length
    assert flat.lengths.max(initial=0) <= 1
    got = np.full(batch * length, PAD)
    got_weights = np.zeros(batch * length, np.float32)
    has = flat.lengths == 1
    got[has] = flat.values
    got_weights[has] = flat.weights
    np.testing.assert_array_equal(got.reshape(batch, length), expected, err_msg=form)
    assert_same_bits(got_weights.reshape(batch, length), expected_weights, err_msg=form)


def test_statistics_and_limits_count_positions():
  plan = _plan(8)
  rng = np.random.default_rng(3)
  batches = []
  for _ in range(3):
    raw = _dense_batch(rng)
    batches.append({name: DenseIds(ids, w) for name, (ids, w) in raw.items()})
  one = batch_stats(batches[0], _features(), plan.layout, padding_id=PAD)
  for stack in plan.layout.stacks:
    ids = sum(int((batches[0][f.name].ids != PAD).sum()) for f in stack.features)
    assert one.stacks[stack.name].num_ids == ids, stack.name  # padding positions count nothing
  stats = collect_stats(batches, _features(), plan.layout, padding_id=PAD)
  sized = size_limits_from_stats(_features(), stats)
  tokens = next(f for f in sized if f.name == "tokens")
  assert tokens.output_shape == (BATCH, LENGTH, 6)  # the feature kind survives resizing
  layout = auto_stack_tables(sized, 8)
  batch, _ = preprocess(batches[0], sized, layout, padding_id=PAD)
  assert set(batch) == set(layout.stack_names)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(input_shape=(4,), output_shape=(4, 3, 6)),
         r"feature 's': a sequence feature .* needs input_shape \(batch, sequence_length\)"),
        (dict(input_shape=(4, None), output_shape=(4, 3, 6)), r"needs input_shape"),
        (dict(input_shape=(4, 5), output_shape=(4, 3, 6)),
         r"output_shape \(4, 3, 6\) has sequence length 3 but input_shape \(4, 5\) has 5"),
        (dict(input_shape=(4, 3), output_shape=(4, 3, 7)),
         r"output dim 7 differs from table 'words' \(embedding_dim 6\). Set"
         r" output_shape=\(4, 3, 6\)"),
        (dict(input_shape=(4, 3), output_shape=(5, 3, 6)), r"output batch 5 differs"),
        (dict(input_shape=(4, 3), output_shape=(4, 3, 2, 6)), r"output_shape must be"),
    ],
)
def test_bad_sequence_specs_are_refused(kwargs, message):
  table = _features()[0].table
  with pytest.raises(ValueError, match=message):
    FeatureSpec("s", table, **kwargs)


def test_bad_sequence_inputs_name_the_feature_and_position():
  feature = _features()[0]
  too_long = np.zeros((BATCH, LENGTH + 1), np.int64)
  with pytest.raises(ValueError, match=r"feature 'tokens': sample 0 has id 0 at position 6,"
                                       r" but the feature is a sequence of length 6"):
    flatten_input(too_long, feature)
  too_long[:, LENGTH] = PAD  # a padded extra column is fine
  assert flatten_input(too_long, feature, padding_id=PAD).batch_size == BATCH * LENGTH
  bad = np.zeros((BATCH, LENGTH), np.int64)
  bad[2, 4] = 40
  with pytest.raises(ValueError, match=r"got id 40 at sample 2 position 4; ids must be in"):
    flatten_input(bad, feature)
  with pytest.raises(ValueError, match=r"dense ids must have shape \[B, L\]"):
    flatten_input(np.zeros(BATCH, np.int64), feature)
  for nothing in (None, "ids", {"tokens": 1}):  # as a combined feature's: not a shape ()
    with pytest.raises(TypeError, match=r"feature 'tokens': got \w+ .* as its ids; pass an"
                                        r" integer array"):
      flatten_input(nothing, feature)
  # The COO form of the same [B] ids is refused alike (it put every id at position 0).
  with pytest.raises(ValueError, match=r"COO ids must have dense_shape \(B, L\) .* got"
                                       r" dense_shape \(16,\)"):
    flatten_input(SparseIds(np.arange(BATCH)[:, None], np.zeros(BATCH, np.int64), (BATCH,)),
                  feature)
  with pytest.raises(ValueError, match=r"got a batch of 3 samples"):
    flatten_input(np.zeros((3, LENGTH), np.int64), feature)


def test_activation_gradients_of_the_wrong_shape_are_refused():
  plan = _plan(1)
  rng = np.random.default_rng(0)
  raw = _dense_batch(rng)
  batch, _ = preprocess({n: DenseIds(i, w) for n, (i, w) in raw.items()}, _features(),
                        plan.layout, padding_id=PAD)
  variables = init_embedding_variables(plan, jax.random.key(0))
  grads = {f.name: np.zeros(f.output_shape, np.float32) for f in _features()}
  grads["tokens"] = np.zeros((BATCH * LENGTH, 6), np.float32)
  with pytest.raises(ValueError, match=r"activation_grads\['tokens'\] has shape \(96, 6\) but"):
    apply_embedding_gradients(plan, variables, batch, grads, 0)


def test_a_layout_or_batch_of_another_sequence_length_says_batch_times_length():
  """Specs of L=6 against a layout (or a batch) of L=5: the sizes that differ are B * L."""
  table = TableSpec("w", 20, 4)
  five, six = ([FeatureSpec("hist", table, (4, length), (4, length, 4))] for length in (5, 6))
  layout = auto_stack_tables(five, num_devices=1)
  why = re.escape("stacked samples: the batch, times L for a sequence feature")
  with pytest.raises(ValueError, match=rf"batch 20\) but feature_specs have table 'w', batch 24"
                                       rf" \({why}; output_shape \(4, 6, 4\)\)"):
    preprocess({"hist": np.ones((4, 6), np.int64)}, six, layout)
  plan = EmbeddingPlan.create(six, mesh=Mesh(np.array(jax.devices()[:1]), ("devices",)))
  batch, _ = preprocess({"hist": np.ones((4, 5), np.int64)}, five, layout)
  with pytest.raises(ValueError, match=r"feature 'hist' batch_size 20 \(batch\) vs 24 \(plan\)"
                                       rf" \(a batch_size counts {why}\)"):
    embedding_lookup(plan, init_embedding_variables(plan, jax.random.key(0)).tables, batch)


@pytest.mark.parametrize("combiner", ["mean", "sqrtn"])
@pytest.mark.parametrize("capacity", [None, (40, 12)], ids=["fits", "drops"])
def test_each_position_entry_carries_its_weight_whatever_the_combiner(combiner, capacity):
  """Buffers on 1 device: entry (sample b * L + l, row of id) has gain w[b, l] (no factor).

  With small capacities and dropping, the kept positions still carry their own
  weight, while the combined feature's factors are recomputed over its kept ids.
  """
  words = TableSpec("words", 40, 6, combiner=combiner)
  features = (FeatureSpec("tokens", words, (BATCH, LENGTH), (BATCH, LENGTH, 6)),
              FeatureSpec("bag", words, (BATCH, BAG)))
  layout = auto_stack_tables(features, 1)
  rng = np.random.default_rng(5)
  raw = {name: value for name, value in _dense_batch(rng).items() if name != "tag_seq"}
  stack = layout.stacks[0]
  batch, stats = preprocess(
      {name: DenseIds(ids, w) for name, (ids, w) in raw.items()}, features, layout,
      padding_id=PAD, allow_id_dropping=capacity is not None,
      capacities=None if capacity is None else {stack.name: capacity})
  assert (stats.stacks[stack.name].num_dropped_ids > 0) == (capacity is not None)
  buffers = batch[stack.name]
  offset = layout.feature("tokens").sample_offset
  ids, weights = raw["tokens"]
  samples = buffers.entry_samples[0]
  real = samples < stack.total_batch_size
  position = samples[real] - offset
  mine = (position >= 0) & (position < BATCH * LENGTH)
  rows = buffers.unique_rows[0, 0][buffers.entry_unique_index[0][real][mine]]
  b, l = np.divmod(position[mine], LENGTH)
  np.testing.assert_array_equal(rows - stack.tables[0].row_offset, ids[b, l])
  assert_same_bits(buffers.entry_gains[0][real][mine], weights[b, l])
  if capacity is None:  # every position with an id has its entry
    assert mine.sum() == (ids != PAD).sum()


def test_messages_for_what_a_port_from_the_sparsecore_stack_tries():
  """A flattened output shape, padding without padding_id and a misspelt padding_id key
  got messages without the fix."""
  words = TableSpec("words", 20, 4, optimizer=SGD(0.1))
  with pytest.raises(ValueError, match=re.escape(
      "output batch 12 differs from input batch 3. For one embedding per position (a sequence"
      " feature), set output_shape=(3, 4, 4)")):
    FeatureSpec("s", words, (3, 4), (12, 4))
  spec = FeatureSpec("s", words, (3, 2), (3, 2, 4))
  layout = auto_stack_tables([spec], 1)
  padded = np.array([[1, 2, -1], [3, -1, -1], [4, 5, -1]])
  with pytest.raises(ValueError, match=r"has id -1 at position 2, .* If -1 pads the sequences,"
                                       r" pass padding_id=-1\."):
    preprocess({"s": padded}, [spec], layout)
  batch, _ = preprocess({"s": padded}, [spec], layout, padding_id=-1)  # the fix works
  with pytest.raises(ValueError, match=re.escape(
      "padding_id names unknown features ['seq']; the features are ['s'].")):
    preprocess({"s": padded}, [spec], layout, padding_id={"seq": -1})
  wide = np.array([[1, 2, 7]] * 3)
  with pytest.raises(ValueError, match=r"has id 7 at position 2, .* output_shape\.$"):
    preprocess({"s": wide}, [spec], layout)
