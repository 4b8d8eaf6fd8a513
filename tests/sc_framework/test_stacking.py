"""The stacked, sharded table layout, stacking and host stack/unstack.

The layout is persisted, so it is checked three ways: against the worked
example of the project's design document, against an independent per-row reference
written below from the layout's documented formula (sc_framework/stacking/_layout.py,
the README), and by properties over random table sets.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sc_framework import FeatureSpec, TableSpec
from sc_framework.optimizers import SGD, Adagrad, Adam, CustomOptimizer, RowWiseAdagrad
from sc_framework.stacking import (
    EmbeddingLayout,
    auto_stack_tables,
    check_layout_fits_specs,
    device_block,
    device_of_global_row,
    device_row_range,
    global_to_logical_rows,
    is_padding_row,
    layout_for_stacking,
    logical_progression_to_global,
    logical_to_global_rows,
    normalize_stacking,
    shard_of_global_row,
    shard_row_range,
    stack,
    stack_block,
    stack_name,
    stack_tables,
    table_row_runs_in_block,
    table_rows_in_block,
    unstack,
    unstacked_layout,
)
from tests.numerics import assert_same_bits

_SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _match(*parts: str) -> str:
  return ".*".join(re.escape(part) for part in parts)


# --- the independent reference ----------------------------------------------
# Written from the documented formula, row by row, without the library's mapping.


@dataclasses.dataclass
class _RefStack:
  names: list[str]
  vocab: list[int]  # V_k
  dims: list[int]  # D_k
  padded_vocab: list[int]  # V'_k
  padded_dim: int  # D'
  offsets: list[int]  # o_k
  rotations: list[int]  # r_k
  stack_vocab: int  # V_s
  rows_per_shard: int  # R
  global_row: dict[tuple[int, int], int]  # (k, i) -> global row, for every i < V'_k


def _reference_stack(tables: list[tuple[str, int, int]], g: int, s: int) -> _RefStack:
  n = g * s
  padded_vocab, padded_dims = [], []
  for _, v, d in tables:
    vp = 8 * n
    while vp < v:
      vp += 8 * n
    dp = 8
    while dp < d:
      dp += 8
    padded_vocab.append(vp)
    padded_dims.append(dp)
  assert len(set(padded_dims)) == 1
  offsets, rotations = [], []
  for k in range(len(tables)):
    offsets.append(sum(padded_vocab[j] // n for j in range(k)))
    rotations.append((k * s) % n)
  stack_vocab = sum(padded_vocab)
  rows_per_shard = stack_vocab // n
  global_row = {}
  for k in range(len(tables)):
    for i in range(padded_vocab[k]):
      shard = ((i % n) + rotations[k]) % n
      local = i // n + offsets[k]
      global_row[(k, i)] = shard * rows_per_shard + local
  return _RefStack(
      [t[0] for t in tables], [t[1] for t in tables], [t[2] for t in tables], padded_vocab,
      padded_dims[0], offsets, rotations, stack_vocab, rows_per_shard, global_row,
  )


def _reference_stacked(ref: _RefStack, arrays: dict, row_width: int | None, fill) -> np.ndarray:
  first = arrays[ref.names[0]]
  width = ref.padded_dim if row_width is None else row_width
  out = np.full((ref.stack_vocab, width), fill, dtype=first.dtype)
  for k, name in enumerate(ref.names):
    for i in range(ref.vocab[k]):
      row = ref.global_row[(k, i)]
      for j in range(ref.dims[k] if row_width is None else row_width):
        out[row, j] = arrays[name][i, j]
  return out


def _reference_owners(ref: _RefStack) -> tuple[np.ndarray, np.ndarray]:
  """(table index, logical row) of every global row."""
  table_index = np.full(ref.stack_vocab, -1, np.int64)
  logical = np.full(ref.stack_vocab, -1, np.int64)
  for (k, i), row in ref.global_row.items():
    assert table_index[row] == -1, "the reference maps two rows to one"
    table_index[row], logical[row] = k, i
  assert (table_index >= 0).all()
  return table_index, logical


def _reference_groups(features: list[FeatureSpec]) -> list[list[str]]:
  """The documented grouping: same D', optimizer and combiner; users' order."""
  groups: list[tuple[tuple, list[str]]] = []
  for feature in features:
    table = feature.table
    if any(table.name in names for _, names in groups):
      continue
    key = ((table.embedding_dim + 7) // 8 * 8, table.optimizer, table.combiner)
    for other, names in groups:
      if other == key:
        names.append(table.name)
        break
    else:
      groups.append((key, [table.name]))
  return [names for _, names in groups]


def _ref_of(layout: EmbeddingLayout, stack_layout) -> _RefStack:
  return _reference_stack(
      [(t.name, t.vocabulary_size, t.embedding_dim) for t in stack_layout.tables],
      layout.num_devices, layout.shards_per_device,
  )


def _random_arrays(layout: EmbeddingLayout, seed: int, dtype, row_width: int | None) -> dict:
  """Distinct random rows per table, with -0.0, inf and NaN among them."""
  rng = np.random.default_rng(seed)
  arrays = {}
  for name in layout.table_names:
    table = layout.table(name)
    width = table.embedding_dim if row_width is None else row_width
    data = rng.standard_normal((table.vocabulary_size, width)) * 10 + 1
    if data.size >= 4 and (np.issubdtype(np.dtype(dtype), np.floating) or dtype == ml_dtypes.bfloat16):
      flat = data.reshape(-1)
      flat[rng.choice(flat.size, size=3, replace=False)] = (-0.0, np.inf, np.nan)
    arrays[name] = data.astype(dtype)
  return arrays


# --- random models ------------------------------------------------------------

_OPTIMIZERS = (SGD(), SGD(learning_rate=0.5), Adagrad(), RowWiseAdagrad(), Adam())
_COMBINERS = ("sum", "mean", "sqrtn")


@st.composite
def _models(draw, max_tables: int = 5, max_vocab: int = 300):
  """(features, layout): 1-5 random tables, G in 1..8, S in 1..4, a stacking."""
  # A small pool of (optimizer, combiner, D' / 8) triples, so that tables often
  # stack; dims 1..20 give D' of 8, 16 or 24.
  profiles = st.tuples(st.sampled_from(_OPTIMIZERS), st.sampled_from(_COMBINERS), st.integers(1, 3))
  pool = draw(st.lists(profiles, min_size=1, max_size=3))
  num_tables = draw(st.sampled_from(range(1, max_tables + 1)))
  tables = []
  for t in range(num_tables):
    optimizer, combiner, dim_class = draw(st.sampled_from(pool))
    dim = draw(st.integers(8 * dim_class - 7, min(8 * dim_class, 20)))
    tables.append(
        TableSpec(f"table_{t}", draw(st.integers(1, max_vocab)), dim, optimizer=optimizer, combiner=combiner)
    )
  # Every table is read; some by several features, in a random order.
  reads = list(draw(st.permutations(range(num_tables))))
  reads += draw(st.lists(st.integers(0, num_tables - 1), max_size=3))
  features = [
      FeatureSpec(f"feature_{j}", tables[k], (draw(st.integers(1, 16)),)) for j, k in enumerate(reads)
  ]
  g, s = draw(st.integers(1, 8)), draw(st.integers(1, 4))
  strategy = draw(st.sampled_from(["auto", "auto", "explicit", "unstacked"]))
  if strategy == "auto":
    layout = auto_stack_tables(features, g, s)
  elif strategy == "unstacked":
    layout = unstacked_layout(features, g, s)
  else:
    # Shuffle each compatible group and cut it into random pieces.
    groups = []
    for group in draw(st.permutations(_reference_groups(features))):
      group = list(draw(st.permutations(group)))
      while group:
        size = draw(st.integers(1, len(group)))
        groups.append(group[:size])
        group = group[size:]
    layout = stack_tables(features, groups, g, s)
  return features, layout


_SEEDS = st.integers(0, 2**32 - 1)
_DTYPES = st.sampled_from([np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int32])


# --- the worked example of the design document ------------------------------


@pytest.fixture
def example():
  table_a = TableSpec("table_a", 64, 12)
  table_b = TableSpec("table_b", 120, 10)
  features = [FeatureSpec("feature_a", table_a, (32, 4)), FeatureSpec("feature_b", table_b, (16,))]
  return auto_stack_tables(features, num_devices=2, shards_per_device=4)


def test_example_geometry(example):
  assert example.num_shards == 8
  assert example.stack_names == ("table_a__table_b",)
  (stacked,) = example.stacks
  assert stacked.vocabulary_size == 192
  assert stacked.rows_per_shard == 24
  assert stacked.padded_embedding_dim == 16
  assert stacked.shape == (192, 16)
  a, b = stacked.tables
  assert (a.padded_vocabulary_size, a.padded_embedding_dim, a.row_offset, a.shard_rotation) == (64, 16, 0, 0)
  assert (b.padded_vocabulary_size, b.padded_embedding_dim, b.row_offset, b.shard_rotation) == (128, 16, 8, 4)
  assert example.table_geometry()["table_b"] == ("table_a__table_b", 120, 10, 128, 16, 8, 4)


def test_example_rows(example):
  rows = logical_to_global_rows(example, "table_b", np.array([0, 7, 119]))
  np.testing.assert_array_equal(rows, [104, 80, 94])
  rows = logical_to_global_rows(example, "table_a", np.array([0, 1, 8, 63]))
  np.testing.assert_array_equal(rows, [0, 24, 1, 7 * 24 + 7])
  # The same arithmetic under jit, on jax arrays.
  jitted = jax.jit(lambda r: logical_to_global_rows(example, "table_b", r))
  np.testing.assert_array_equal(jitted(jnp.array([0, 7, 119], jnp.int32)), [104, 80, 94])
  (stacked,) = example.stacks
  table_index, logical = global_to_logical_rows(stacked, np.arange(24))
  np.testing.assert_array_equal(table_index, [0] * 8 + [1] * 16)
  np.testing.assert_array_equal(logical, list(range(0, 64, 8)) + list(range(4, 128, 8)))
  np.testing.assert_array_equal(is_padding_row(stacked, np.arange(24)), [False] * 23 + [True])
  assert logical[-1] == 124  # table_b's padding row 124 >= V = 120
  assert shard_row_range(stacked, 0) == (0, 24)
  assert device_row_range(example, stacked, 1) == (96, 192)
  np.testing.assert_array_equal(shard_of_global_row(stacked, np.array([0, 23, 24, 191])), [0, 0, 1, 7])
  devices = device_of_global_row(example, stacked, np.array([0, 95, 96, 191]))
  np.testing.assert_array_equal(devices, [0, 0, 1, 1])


def test_example_stack(example):
  # Entry (i, j) of table_a is 100000 + 100 i + j, of table_b 200000 + 100 i + j.
  a = 100000 + 100 * np.arange(64)[:, None] + np.arange(12)[None, :]
  b = 200000 + 100 * np.arange(120)[:, None] + np.arange(10)[None, :]
  arrays = {"table_a": a.astype(np.float64), "table_b": b.astype(np.float64)}
  stacked = stack(arrays, example, fill=-1.0)["table_a__table_b"]
  assert stacked.shape == (192, 16) and stacked.dtype == np.float64
  shard0 = stacked[:24]
  expected_first_column = [100000 + 100 * i for i in range(0, 64, 8)]
  expected_first_column += [200000 + 100 * i for i in range(4, 120, 8)] + [-1.0]
  assert_same_bits(shard0[:, 0], np.array(expected_first_column, np.float64))
  assert_same_bits(shard0[:8, :12], arrays["table_a"][0:64:8])
  assert_same_bits(shard0[8:23, :10], arrays["table_b"][4:120:8])
  assert (shard0[:8, 12:] == -1).all() and (shard0[8:23, 10:] == -1).all() and (shard0[23] == -1).all()
  assert stacked[104, 0] == 200000 and stacked[80, 0] == 200700 and stacked[94, 0] == 211900
  assert_same_bits(device_block(arrays, example, "table_a__table_b", 0, fill=-1.0), stacked[:96])
  assert_same_bits(device_block(arrays, example, "table_a__table_b", 1, fill=-1.0), stacked[96:])
  for name, array in unstack({"table_a__table_b": stacked}, example).items():
    assert_same_bits(array, arrays[name])


def test_example_json(example):
  text = example.to_json()
  assert json.loads(text)["format_version"] == 1
  restored = EmbeddingLayout.from_json(text)
  assert restored == example and hash(restored) == hash(example)


# --- the independent reference, compared with the library --------------------


def _check_against_reference(layout: EmbeddingLayout) -> None:
  n = layout.num_shards
  for stack_layout in layout.stacks:
    ref = _ref_of(layout, stack_layout)
    assert stack_layout.vocabulary_size == ref.stack_vocab
    assert stack_layout.rows_per_shard == ref.rows_per_shard
    assert stack_layout.padded_embedding_dim == ref.padded_dim
    assert stack_layout.num_shards == n
    for k, table in enumerate(stack_layout.tables):
      assert (table.padded_vocabulary_size, table.row_offset, table.shard_rotation) == (
          ref.padded_vocab[k], ref.offsets[k], ref.rotations[k]
      )
      rows = np.arange(ref.padded_vocab[k])
      expected = [ref.global_row[(k, i)] for i in rows]
      np.testing.assert_array_equal(logical_to_global_rows(layout, table.name, rows), expected)
    table_index, logical = _reference_owners(ref)
    all_rows = np.arange(ref.stack_vocab)
    actual_index, actual_logical = global_to_logical_rows(stack_layout, all_rows)
    np.testing.assert_array_equal(actual_index, table_index)
    np.testing.assert_array_equal(actual_logical, logical)
    padding = logical >= np.array(ref.vocab)[table_index]
    np.testing.assert_array_equal(is_padding_row(stack_layout, all_rows), padding)
    np.testing.assert_array_equal(shard_of_global_row(stack_layout, all_rows), all_rows // ref.rows_per_shard)
    np.testing.assert_array_equal(
        device_of_global_row(layout, stack_layout, all_rows),
        all_rows // (ref.rows_per_shard * layout.shards_per_device),
    )


def _check_stack_round_trip(layout: EmbeddingLayout, seed: int, dtype, row_width: int | None) -> None:
  arrays = _random_arrays(layout, seed, dtype, row_width)
  fill = -7
  stacked = stack(arrays, layout, row_width=row_width, fill=fill)
  assert set(stacked) == set(layout.stack_names)
  for stack_layout in layout.stacks:
    expected = _reference_stacked(_ref_of(layout, stack_layout), arrays, row_width, fill)
    assert_same_bits(stacked[stack_layout.name], expected)
  restored = unstack(stacked, layout, row_width=row_width)
  assert set(restored) == set(arrays)
  for name, array in arrays.items():
    assert_same_bits(restored[name], array)
  subset = layout.table_names[::2]
  assert set(unstack(stacked, layout, row_width=row_width, tables=subset)) == set(subset)


@_SETTINGS
@given(model=_models())
def test_layout_matches_reference(model):
  features, layout = model
  assert {t for s in layout.stacks for t in s.table_names} == {f.table.name for f in features}
  _check_against_reference(layout)


@_SETTINGS
@given(model=_models(), seed=_SEEDS, dtype=_DTYPES, row_width=st.sampled_from([None, 1, 3]))
def test_stack_matches_reference_and_unstack_inverts_it(model, seed, dtype, row_width):
  _check_stack_round_trip(model[1], seed, dtype, row_width)


# Fixed cases that the random search may miss: many tables in one stack, the
# largest N, odd N, vocabularies at and around multiples of 8N.
@pytest.mark.parametrize("g, s", [(8, 4), (3, 4), (5, 3), (7, 1), (1, 1), (2, 4)])
@pytest.mark.parametrize("seed", [0, 1])
def test_fixed_models_match_reference(g, s, seed):
  n = g * s
  vocabs = [8 * n, 8 * n - 1, 8 * n + 1, 1, 3 * 8 * n + 5]
  tables = [TableSpec(f"t{k}", v, 1 + (5 * k) % 8) for k, v in enumerate(vocabs)]
  tables.append(TableSpec("other", 37, 20, optimizer=Adagrad()))
  layout = auto_stack_tables(_features(*tables), g, s)
  assert [len(x.tables) for x in layout.stacks] == [5, 1]
  _check_against_reference(layout)
  for row_width in (None, 1, 3):
    _check_stack_round_trip(layout, seed, np.float32, row_width)


@_SETTINGS
@given(model=_models())
def test_rows_are_distinct_and_spread_over_all_shards(model):
  _, layout = model
  n = layout.num_shards
  for stack_layout in layout.stacks:
    used = []
    for table in stack_layout.tables:
      rows = logical_to_global_rows(layout, table.name, np.arange(table.padded_vocabulary_size))
      used.append(rows)
      logical_rows = rows[: table.vocabulary_size]
      shards = logical_rows // stack_layout.rows_per_shard
      counts = np.bincount(shards, minlength=n)
      assert len(counts) == n
      # Round robin: every shard holds floor(V/N) or ceil(V/N) rows of the table.
      assert set(counts.tolist()) <= {table.vocabulary_size // n, -(-table.vocabulary_size // n)}
      if table.vocabulary_size >= n:
        assert set(shards.tolist()) == set(range(n))
      # Each table keeps V'/N rows in every shard, padding included.
      padded_counts = np.bincount(rows // stack_layout.rows_per_shard, minlength=n)
      assert (padded_counts == table.padded_vocabulary_size // n).all()
    used = np.concatenate(used)
    # A bijection of the padded logical rows onto [0, V_s).
    np.testing.assert_array_equal(np.sort(used), np.arange(stack_layout.vocabulary_size))


@_SETTINGS
@given(model=_models())
def test_layout_json_round_trip(model):
  _, layout = model
  text = layout.to_json()
  restored = EmbeddingLayout.from_json(text)
  assert restored == layout
  assert hash(restored) == hash(layout)
  assert restored.to_json() == text
  assert EmbeddingLayout.from_dict(json.loads(text)) == layout


@_SETTINGS
@given(model=_models(), seed=_SEEDS, row_width=st.sampled_from([None, 2]), data=st.data())
def test_blocks_equal_slices_of_the_stack(model, seed, row_width, data):
  _, layout = model
  arrays = _random_arrays(layout, seed, np.float32, row_width)
  stacked = stack(arrays, layout, row_width=row_width, fill=0.5)
  for stack_layout in layout.stacks:
    name, total = stack_layout.name, stack_layout.vocabulary_size
    start = data.draw(st.integers(0, total))
    stop = data.draw(st.integers(start, total))
    block = stack_block(arrays, layout, name, start, stop, row_width=row_width, fill=0.5)
    assert_same_bits(block, stacked[name][start:stop])
    for device in range(layout.num_devices):
      lo, hi = device_row_range(layout, stack_layout, device)
      assert hi - lo == stack_layout.rows_per_shard * layout.shards_per_device
      block = device_block(arrays, layout, name, device, row_width=row_width, fill=0.5)
      assert_same_bits(block, stacked[name][lo:hi])
    for k, table in enumerate(stack_layout.tables):
      global_rows, logical_rows = table_rows_in_block(stack_layout, k, start, stop)
      all_rows = logical_to_global_rows(layout, table.name, np.arange(table.vocabulary_size))
      inside = np.flatnonzero((all_rows >= start) & (all_rows < stop))
      order = np.argsort(all_rows[inside])
      np.testing.assert_array_equal(global_rows, all_rows[inside][order])
      np.testing.assert_array_equal(logical_rows, inside[order])
      # The same rows as runs: global rows g + j hold logical rows i0 + N j.
      runs = table_row_runs_in_block(stack_layout, k, start, stop)
      n = stack_layout.num_shards
      run_globals = [np.arange(g, g + count) for g, _, count in runs]
      run_logicals = [first + n * np.arange(count) for _, first, count in runs]
      np.testing.assert_array_equal(np.concatenate([[]] + run_globals), global_rows)
      np.testing.assert_array_equal(np.concatenate([[]] + run_logicals), logical_rows)


@_SETTINGS
@given(model=_models(), data=st.data())
def test_logical_progressions_map_to_strided_global_runs(model, data):
  _, layout = model
  for stack_layout in layout.stacks:
    ref = _ref_of(layout, stack_layout)
    for k, table in enumerate(stack_layout.tables):
      step = data.draw(st.integers(1, 3 * stack_layout.num_shards + 2), label="step")
      first = data.draw(st.integers(0, table.vocabulary_size - 1), label="first")
      count = data.draw(st.integers(0, (table.vocabulary_size - 1 - first) // step + 1))
      runs = logical_progression_to_global(layout, table.name, first, step, count)
      assert len(runs) <= stack_layout.num_shards
      got = np.full(count, -1, np.int64)
      for j0, j_step, length, row, row_step in runs:
        positions = j0 + j_step * np.arange(length)
        assert (got[positions] == -1).all(), "two runs cover one position"
        got[positions] = row + row_step * np.arange(length)
      expected = [ref.global_row[(k, first + step * j)] for j in range(count)]
      np.testing.assert_array_equal(got, np.asarray(expected, np.int64).reshape(-1))


def test_logical_progressions_refuse_a_step_below_one():
  layout = stack_tables(_features(TableSpec("t", 40, 8)), [["t"]], 2)
  with pytest.raises(ValueError, match="step >= 1"):
    logical_progression_to_global(layout, "t", 0, 0, 3)


@_SETTINGS
@given(model=_models())
def test_auto_stacking_groups_by_padded_dim_optimizer_and_combiner(model):
  features, _ = model
  g, s = 2, 3
  layout = auto_stack_tables(features, g, s)
  assert [list(stack_layout.table_names) for stack_layout in layout.stacks] == _reference_groups(features)
  tables = {f.table.name: f.table for f in features}
  for stack_layout in layout.stacks:
    members = [tables[t] for t in stack_layout.table_names]
    keys = {((t.embedding_dim + 7) // 8 * 8, t.optimizer, t.combiner) for t in members}
    assert len(keys) == 1
  unstacked = unstacked_layout(features, g, s)
  assert [list(x.table_names) for x in unstacked.stacks] == [[t] for t in tables]
  for stack_layout in unstacked.stacks:
    assert stack_layout.name == stack_layout.tables[0].name
    assert (stack_layout.tables[0].row_offset, stack_layout.tables[0].shard_rotation) == (0, 0)


# --- grouping -------------------------------------------------------------------


def _features(*tables: TableSpec, batch: int = 4) -> list[FeatureSpec]:
  return [FeatureSpec(f"f_{table.name}_{i}", table, (batch,)) for i, table in enumerate(tables)]


def test_auto_stack_grouping_rules():
  base = TableSpec("base", 10, 12)
  same_padded_dim = TableSpec("dim16", 20, 16)
  dim9 = TableSpec("dim9", 30, 9)
  other_dim = TableSpec("dim17", 40, 17)
  other_lr = TableSpec("lr", 50, 12, optimizer=SGD(learning_rate=0.5))
  other_kind = TableSpec("adagrad", 60, 12, optimizer=Adagrad())
  other_combiner = TableSpec("mean", 70, 12, combiner="mean")
  equal_optimizer = TableSpec("equal_sgd", 80, 12, optimizer=SGD(learning_rate=0.01))
  features = _features(
      same_padded_dim, other_dim, base, other_lr, other_kind, other_combiner, dim9, base, equal_optimizer
  )
  layout = auto_stack_tables(features, num_devices=1)
  assert [s.table_names for s in layout.stacks] == [
      ("dim16", "base", "dim9", "equal_sgd"),
      ("dim17",),
      ("lr",),
      ("adagrad",),
      ("mean",),
  ]
  assert layout.stack_names[0] == "dim16__base__dim9__equal_sgd"


def test_auto_stack_custom_optimizers_stack_only_when_equal():
  def rule(rows, grads, slots, step):
    return rows - grads, slots

  def other_rule(rows, grads, slots, step):
    return rows + grads, slots

  a = TableSpec("a", 10, 8, optimizer=CustomOptimizer("rule", rule))
  b = TableSpec("b", 10, 8, optimizer=CustomOptimizer("rule", rule))
  c = TableSpec("c", 10, 8, optimizer=CustomOptimizer("rule", other_rule))
  layout = auto_stack_tables(_features(a, b, c), num_devices=2)
  assert [s.table_names for s in layout.stacks] == [("a", "b"), ("c",)]


def test_stack_tables_explicit_groups_keep_given_order():
  a, b, c = TableSpec("a", 10, 8), TableSpec("b", 100, 8), TableSpec("c", 10, 4)
  layout = stack_tables(_features(a, b, c), [["c"], ["b", "a"]], num_devices=2, shards_per_device=2)
  assert layout.stack_names == ("c", "b__a")
  b_place, a_place = layout.stack("b__a").tables
  assert (b_place.name, b_place.row_offset, b_place.shard_rotation) == ("b", 0, 0)
  assert (a_place.name, a_place.row_offset, a_place.shard_rotation) == ("a", 128 // 4, 2)
  # A bare string is a group of one.
  assert stack_tables(_features(a, b, c), ["c", ["a", "b"]], 2).stack_names == ("c", "a__b")


@pytest.mark.parametrize(
    "groups, culprit",
    [
        (
            [["a", "b"], ["c"], ["d"], ["e"], ["zzz"]],
            ("group 4 names table 'zzz', which no feature reads", "'e'"),
        ),
        ([["a"], ["c"], ["d"], ["e"]], ("tables ['b'] are in no stacking group",)),
        ([["a"], ["c"]], ("tables ['b', 'd', 'e'] are in no stacking group",)),
        ([["a", "b"], ["a"], ["c"], ["d"], ["e"]], ("table 'a' is in stacking groups 0 and 1",)),
        ([["a", "a", "b"], ["c"], ["d"], ["e"]], ("table 'a' is twice in stacking group 0: name each table in one group, once.",)),
        ([["a", "b"], [], ["c"], ["d"], ["e"]], ("stacking group 1 is empty",)),
        ([["a", "c"], ["b"], ["d"], ["e"]], ("tables 'a' and 'c' cannot share a stack", "D'=8", "D'=16")),
        ([["a", "b", "d"], ["c"], ["e"]], ("tables 'a' and 'd' cannot share a stack", "SGD(", "Adam(")),
        ([["a", "b", "e"], ["c"], ["d"]], ("tables 'a' and 'e' cannot share a stack", "'sum'", "'sqrtn'")),
        ([["e", "a"], ["b"], ["c"], ["d"]], ("tables 'e' and 'a' cannot share a stack", "'sqrtn'", "'sum'")),
    ],
)
def test_stack_tables_errors(groups, culprit):
  a, b = TableSpec("a", 10, 8), TableSpec("b", 20, 5)
  c = TableSpec("c", 10, 9)  # D' = 16
  d = TableSpec("d", 10, 8, optimizer=Adam())
  e = TableSpec("e", 10, 8, combiner="sqrtn")
  with pytest.raises(ValueError, match=_match(*culprit)):
    stack_tables(_features(a, b, c, d, e), groups, num_devices=2)


def test_tables_whose_optimizers_differ_only_in_equal_schedules_are_told_why():
  """Two Adagrad(lambda s: 0.1) differ (functions compare by identity): the message listed
  two function reprs and no reason."""
  a = TableSpec("a", 10, 8, optimizer=Adagrad(lambda step: 0.1))
  b = TableSpec("b", 10, 8, optimizer=Adagrad(lambda step: 0.1))
  with pytest.raises(ValueError, match=_match(
      "tables 'a' and 'b' cannot share a stack", "differ only in learning_rate: functions compare"
      " by identity", "the same function (define it once) or the same optimizer object")):
    stack_tables(_features(a, b), [["a", "b"]], num_devices=1)
  schedule = lambda step: 0.1  # noqa: E731
  c, d = (TableSpec(name, 10, 8, optimizer=Adagrad(schedule)) for name in "cd")
  assert stack_tables(_features(c, d), [["c", "d"]], num_devices=1).stack_names == ("c__d",)
  e = TableSpec("e", 10, 8, optimizer=Adagrad(schedule, eps=1e-3))  # another reason
  with pytest.raises(ValueError) as raised:
    stack_tables(_features(c, e), [["c", "e"]], num_devices=1)
  assert "differ only" not in str(raised.value)


@pytest.mark.parametrize("function", [auto_stack_tables, unstacked_layout])
@pytest.mark.parametrize(
    "num_devices, shards_per_device, culprit",
    [
        (0, 1, "num_devices must be a positive int, got 0"),
        (2, 0, "shards_per_device must be a positive int, got 0"),
        (2.0, 1, "num_devices must be a positive int, got 2.0"),
        (-1, 1, "got -1"),
        # A mistyped S compiled for hours or filled a disk with padding rows.
        (2, 65, "shards_per_device is 65; at most 64 are supported"),
    ],
)
def test_device_counts_validated(function, num_devices, shards_per_device, culprit):
  with pytest.raises(ValueError, match=_match(culprit)):
    function(_features(TableSpec("a", 10, 8)), num_devices, shards_per_device)
  with pytest.raises(ValueError, match=_match(culprit)):
    stack_tables(_features(TableSpec("a", 10, 8)), [["a"]], num_devices, shards_per_device)


def test_long_stack_names_are_shortened_uniquely_and_deterministically():
  prefix = "a_rather_long_table_name_for_the_user_history_features"  # 55 characters
  tables = [TableSpec(f"{prefix}_{i}", 10, 8) for i in range(4)]
  others = [TableSpec(f"{prefix}_{i}", 10, 8, combiner="mean") for i in range(4, 8)]
  features = _features(*tables, *others)
  layout = auto_stack_tables(features, num_devices=2)
  first, second = layout.stack_names
  for name, group in zip((first, second), (tables, others)):
    joined = "__".join(t.name for t in group)
    assert len(joined) > 64
    assert len(name) == 64
    assert re.fullmatch(r".{52}__[0-9a-f]{10}", name), name
    assert name.startswith(joined[:52])
  # Both joined names share their first 52 characters; the hashes tell them apart.
  assert first[:52] == second[:52] and first != second
  assert auto_stack_tables(features, num_devices=2).stack_names == (first, second)
  assert stack_name([t.name for t in tables]) == first
  assert stack_name([t.name for t in reversed(tables)]) != first
  # Short names and names of exactly the limit are kept whole.
  assert stack_name(["a", "b"]) == "a__b"
  assert stack_name(["x" * 30, "y" * 32]) == "x" * 30 + "__" + "y" * 32
  assert len(stack_name(["x" * 30, "y" * 33])) == 64
  assert stack_name(["x" * 30, "y" * 33]) != stack_name(["x" * 30, "y" * 34])


def test_colliding_stack_names_are_an_error():
  joined = TableSpec("p__q", 10, 8, combiner="mean")
  p, q = TableSpec("p", 10, 8), TableSpec("q", 10, 8)
  with pytest.raises(ValueError, match=_match("stack names collide", "'p__q'")):
    auto_stack_tables(_features(joined, p, q), num_devices=1)


def test_feature_placements():
  a, b, c = TableSpec("a", 10, 8), TableSpec("b", 10, 8), TableSpec("c", 10, 8, combiner="mean")
  features = [
      FeatureSpec("f1", a, (4, 2)),
      FeatureSpec("f2", c, (8,)),
      FeatureSpec("f3", b, (16, None)),
      FeatureSpec("f4", a, (2,)),
  ]
  layout = auto_stack_tables(features, num_devices=2)
  ab = layout.stack("a__b")
  assert [(f.name, f.table, f.batch_size, f.sample_offset) for f in ab.features] == [
      ("f1", "a", 4, 0),
      ("f3", "b", 16, 4),
      ("f4", "a", 2, 20),
  ]
  assert ab.total_batch_size == 22
  assert [(f.name, f.sample_offset) for f in layout.stack("c").features] == [("f2", 0)]
  assert layout.feature("f4").sample_offset == 20
  assert layout.stack_of_feature("f2").name == "c"
  assert set(layout.feature_names) == {"f1", "f2", "f3", "f4"}
  with pytest.raises(KeyError, match="'nope'"):
    layout.feature("nope")


def test_layout_lookup_errors(example):
  with pytest.raises(KeyError, match=_match("no stack 'nope'", "table_a__table_b")):
    example.stack("nope")
  with pytest.raises(KeyError, match=_match("no table 'nope'", "table_a")):
    example.table("nope")
  with pytest.raises(KeyError, match=_match("no table 'nope'")):
    logical_to_global_rows(example, "nope", np.arange(3))


# --- from_json rejects bad layouts ----------------------------------------------


def _set(path, value):
  def edit(data):
    target = data
    for key in path[:-1]:
      target = target[key]
    target[path[-1]] = value

  return edit


def _delete(path):
  def edit(data):
    target = data
    for key in path[:-1]:
      target = target[key]
    del target[path[-1]]

  return edit


def _duplicate_stack(rename: bool):
  def edit(data):
    twin = copy.deepcopy(data["stacks"][0])
    if rename:
      twin["name"] = "twin"
    data["stacks"].append(twin)

  return edit


_TABLE_A = ("stacks", 0, "tables", 0)
_TABLE_B = ("stacks", 0, "tables", 1)
_FEATURE_B = ("stacks", 0, "features", 1)
_BAD_LAYOUTS = [
    (_set(("format_version",), 2), "format_version 2 is not supported"),
    (_delete(("format_version",)), "format_version None is not supported"),
    (_delete(("num_devices",)), "malformed layout JSON"),
    (_delete((*_TABLE_A, "row_offset")), "'row_offset'"),
    (_delete(("stacks", 0, "features")), "'features'"),
    (_set(("stacks",), 5), "malformed layout JSON"),
    (_set(("stacks", 0), "table_a__table_b"), "malformed layout JSON"),
    (_set((*_TABLE_A, "vocabulary_size"), 64.5), "'vocabulary_size' must be an integer, got 64.5"),
    (_set((*_TABLE_A, "vocabulary_size"), "64"), "'vocabulary_size' must be an integer, got '64'"),
    (_set(("num_devices",), True), "'num_devices' must be an integer, got True"),
    (_set((*_TABLE_B, "name"), None), "'name' must be a string, got None"),
    (_set((*_TABLE_A, "vocabulary_size"), 0), "table 'table_a'"),
    (
        _set((*_TABLE_A, "padded_vocabulary_size"), 72),
        "table 'table_a': stored (V', D', o, r) = (72, 16, 0, 0)",
    ),
    (_set((*_TABLE_B, "row_offset"), 9), "table 'table_b': stored (V', D', o, r) = (128, 16, 9, 4)"),
    (_set((*_TABLE_B, "shard_rotation"), 0), "table 'table_b': stored (V', D', o, r) = (128, 16, 8, 0)"),
    (_set((*_TABLE_B, "embedding_dim"), 17), "table 'table_b'"),
    (_set(("stacks", 0, "padded_embedding_dim"), 24), "table 'table_a'"),
    (_set(("stacks", 0, "rows_per_shard"), 25), "rows_per_shard 25 != 24"),
    (_set(("stacks", 0, "num_shards"), 4), "num_shards 4 != G*S = 8"),
    (_set(("num_devices",), 4), "num_shards 8 != G*S = 16"),
    (_set(("num_devices",), 0), "must be > 0, got 0 and 4"),
    (_duplicate_stack(rename=False), "stack name 'table_a__table_b' appears twice"),
    (_duplicate_stack(rename=True), "table 'table_a' appears twice"),
    (_set(("stacks", 0, "tables"), []), "holds no tables"),
    (_set((*_FEATURE_B, "sample_offset"), 3), "feature 'feature_b'"),
    (_set((*_FEATURE_B, "batch_size"), 0), "feature 'feature_b'"),
    (_set((*_FEATURE_B, "table"), "table_c"), "feature 'feature_b': reads table 'table_c'"),
    (_set((*_FEATURE_B, "name"), "feature_a"), "feature 'feature_a' appears twice"),
]


@pytest.mark.parametrize("edit, culprit", _BAD_LAYOUTS)
def test_from_json_rejects_inconsistent_layouts(example, edit, culprit):
  data = json.loads(example.to_json())
  edit(data)
  with pytest.raises(ValueError, match=_match(culprit)):
    EmbeddingLayout.from_json(json.dumps(data))


@pytest.mark.parametrize("text", ["", "{", "not json", "[]", "3", "null", '"layout"'])
def test_from_json_rejects_non_layouts(text):
  with pytest.raises(ValueError, match="JSON"):
    EmbeddingLayout.from_json(text)


# --- host stacking errors and lazy reads ----------------------------------------


def test_host_stacking_errors(example):
  arrays = {"table_a": np.ones((64, 12), np.float32), "table_b": np.ones((120, 10), np.float32)}
  name = "table_a__table_b"
  with pytest.raises(ValueError, match=_match("table 'table_b'", "(120, 10)", "(120, 16)")):
    stack({**arrays, "table_b": np.ones((120, 16), np.float32)}, example)
  with pytest.raises(ValueError, match=_match("table 'table_a'", "(64, 1)", "(64, 12)")):
    stack(arrays, example, row_width=1)
  with pytest.raises(KeyError, match="'table_b'"):
    stack({"table_a": arrays["table_a"]}, example)
  with pytest.raises(KeyError, match="table_b"):
    stack_block({"table_a": arrays["table_a"]}, example, name, 0, 10)
  with pytest.raises(ValueError, match=_match("row range [5, 193)", "[0, 192)")):
    stack_block(arrays, example, name, 5, 193)
  with pytest.raises(ValueError, match=_match("row range [7, 3)")):
    stack_block(arrays, example, name, 7, 3)
  with pytest.raises(ValueError, match=_match("device 2 is not in [0, 2)")):
    device_block(arrays, example, name, 2)
  with pytest.raises(ValueError, match=_match("shard 8 is not in [0, 8)")):
    shard_row_range(example.stacks[0], 8)
  with pytest.raises(ValueError, match=_match(name, "(192, 16)", "(192, 12)")):
    unstack({name: np.zeros((192, 12), np.float32)}, example)
  assert stack_block(arrays, example, name, 10, 10).shape == (0, 16)


def test_a_cast_into_the_stack_that_makes_values_infinite_is_refused(example):
  """A float16 table first made the stack float16: table_b's 1e5 read back as inf."""
  arrays = {"table_a": np.ones((64, 12), np.float16),
            "table_b": np.full((120, 10), 1e5, np.float32)}
  message = _match("stack 'table_a__table_b': table 'table_b' holds", "not finite in the",
                   "dtype float16", "dtype=")
  for build in (lambda: stack(arrays, example),
                lambda: stack_block(arrays, example, "table_a__table_b", 0, 192),
                lambda: device_block(arrays, example, "table_a__table_b", 1)):
    with pytest.raises(ValueError, match=message):
      build()
  for wide in (stack(arrays, example, dtype=np.float32)["table_a__table_b"],
               stack_block(arrays, example, "table_a__table_b", 0, 192, dtype=np.float32)):
    assert wide.dtype == np.float32 and wide.max() == 1e5
  # A lossless (or only rounding) cast is the first table's dtype, as before.
  mixed = {"table_a": np.ones((64, 12), np.float32), "table_b": np.full((120, 10), 0.1)}
  assert stack(mixed, example)["table_a__table_b"].dtype == np.float32
  with pytest.raises(ValueError, match=_match("fill=nan", "int32")):
    stack({n: a.astype(np.int32) for n, a in arrays.items()}, example, fill=np.nan)


def test_row_arithmetic_refuses_rows_outside_the_stack(example):
  """Out-of-range rows and positions came back as other, existing rows: 200 rows of a
  192-row stack, table -1 as the last table, global row 192 as table_a's row 0."""
  stack_layout = example.stacks[0]
  for table_index, start, stop, error, culprit in (
      (0, 0, 200, ValueError, "row range [0, 200)"),
      (-1, 0, 10, ValueError, "table_index -1 is not in [0, 2)"),
      (2, 0, 10, ValueError, "table_index 2"),
      (True, 0, 10, TypeError, "table_index must be an int"),
      (0, 0.5, 10, TypeError, "start must be an int, got 0.5")):
    with pytest.raises(error, match=_match(culprit)):
      table_rows_in_block(stack_layout, table_index, start, stop)
  # Numpy and concrete jax integers are ints.
  for index in (np.int64(1), jnp.int32(1)):
    assert_same_bits(table_rows_in_block(stack_layout, index, jnp.int32(0), np.uint8(100))[1],
                     table_rows_in_block(stack_layout, 1, 0, 100)[1])
    assert shard_row_range(stack_layout, index) == shard_row_range(stack_layout, 1)
    assert device_row_range(example, stack_layout, index) == (96, 192)
  with pytest.raises(ValueError, match=_match("global rows must lie in [0, 192)", "got 192")):
    global_to_logical_rows(stack_layout, [0, 192])
  with pytest.raises(ValueError, match=_match("table 'table_b': logical rows", "[0, 128)",
                                              "got -1")):
    logical_to_global_rows(example, "table_b", np.array([3, -1]))
  with pytest.raises(ValueError, match=_match("must be integers", "float64")):
    logical_to_global_rows(example, "table_b", np.array([1.7]))
  for bad in (1.5, True):
    with pytest.raises(TypeError, match=_match("shard must be an int")):
      shard_row_range(stack_layout, bad)
    with pytest.raises(TypeError, match=_match("device must be an int")):
      device_row_range(example, stack_layout, bad)
  # A uint64 row past int64 is named as it is, not wrapped to a negative one.
  with pytest.raises(ValueError, match=_match("got 9223372036854775813")):
    logical_to_global_rows(example, "table_b", np.array([2**63 + 5], np.uint64))
  assert logical_to_global_rows(example, "table_b", np.array([7], np.int32)).dtype == np.int32
  with pytest.raises(TypeError, match=_match("got the string 'table_a'", "tables=['table_a']")):
    unstack({}, example, tables="table_a")
  # Under jit the rows are traced values: computed, not inspected.
  traced = jax.jit(lambda rows: logical_to_global_rows(example, "table_b", rows))
  assert traced(jnp.array([0, 7, 119])).tolist() == [104, 80, 94]


class _RecordingArray:
  """A lazily loaded array stand-in that records which rows are read."""

  def __init__(self, array: np.ndarray):
    self._array = array
    self.shape, self.ndim, self.dtype = array.shape, array.ndim, array.dtype
    self.rows_read: set[int] = set()

  def __getitem__(self, index):
    rows = np.arange(self.shape[0])[index]
    self.rows_read.update(np.atleast_1d(rows).tolist())
    return self._array[index]


def test_stack_block_reads_only_the_rows_it_needs(example):
  rng = np.random.default_rng(0)
  arrays = {"table_a": rng.standard_normal((64, 12)), "table_b": rng.standard_normal((120, 10))}
  lazy = {name: _RecordingArray(array) for name, array in arrays.items()}
  block = device_block(lazy, example, "table_a__table_b", 1)
  assert_same_bits(block, stack(arrays, example)["table_a__table_b"][96:])
  for name, array in lazy.items():
    rows = logical_to_global_rows(example, name, np.arange(array.shape[0]))
    assert array.rows_read == set(np.flatnonzero(rows >= 96).tolist())


# --- a layout against the specs it is used with ---------------------------------


def _two_tables(optimizer_b=SGD(), combiner_b="sum", vocab_b=100, dim_b=8, batch=4):
  a = TableSpec("a", 50, 8)
  b = TableSpec("b", vocab_b, dim_b, optimizer=optimizer_b, combiner=combiner_b)
  return [FeatureSpec("fa", a, (batch, 2)), FeatureSpec("fb", b, (batch, 3))]


def test_a_layout_from_the_specs_fits_them():
  specs = _two_tables()
  for layout in (auto_stack_tables(specs, 2, 2), unstacked_layout(specs, 4)):
    check_layout_fits_specs(layout, specs)


@pytest.mark.parametrize(
    "changed, message",
    [
        (dict(optimizer_b=Adagrad()), r"stack 'a__b': tables 'a' and 'b' cannot share a stack"),
        (dict(optimizer_b=SGD(learning_rate=0.5)), r"tables 'a' and 'b' cannot share a stack"),
        (dict(combiner_b="mean"), r"tables 'a' and 'b' cannot share a stack"),
        (dict(vocab_b=99), r"table 'b': \(vocabulary_size, embedding_dim\) is \(100, 8\) in the"
                           r" layout but \(99, 8\)"),
        (dict(dim_b=4), r"table 'b': .* is \(100, 8\) in the layout but \(100, 4\)"),
        (dict(batch=8), r"feature 'fa': the layout has it read table 'a' with batch size 4"),
    ],
)
def test_a_layout_that_contradicts_the_specs_is_refused(changed, message):
  layout = stack_tables(_two_tables(), [["a", "b"]], num_devices=2)
  with pytest.raises(ValueError, match=message):
    check_layout_fits_specs(layout, _two_tables(**changed))


def test_a_layout_with_other_tables_or_features_is_refused():
  specs = _two_tables()
  layout = auto_stack_tables(specs, 1)
  with pytest.raises(ValueError, match=r"layout's tables \['a', 'b'\] differ"):
    check_layout_fits_specs(layout, specs[:1])
  renamed = [specs[0], FeatureSpec("other", specs[1].table, (4, 3))]
  with pytest.raises(ValueError, match=r"layout's features \['fa', 'fb'\] differ"):
    check_layout_fits_specs(layout, renamed)


def test_layout_for_stacking_takes_every_choice():
  """One value for the stacking: each choice gives the layout of its builder."""
  tables = [TableSpec(name, 16 * (i + 1), 8) for i, name in enumerate("abc")]
  specs = [FeatureSpec(f"f{t.name}", t, (8, 2)) for t in tables]
  assert layout_for_stacking("auto", specs, 4, 2) == auto_stack_tables(specs, 4, 2)
  assert layout_for_stacking("separate", specs, 4, 2) == unstacked_layout(specs, 4, 2)
  groups = [["c"], ["a", "b"]]
  assert layout_for_stacking(groups, specs, 4, 2) == stack_tables(specs, groups, 4, 2)
  assert normalize_stacking([["a", "b"], "c"]) == (("a", "b"), ("c",))
  layout = stack_tables(specs, groups, 4, 2)
  assert layout_for_stacking(layout, specs, 4, 2) is layout
  with pytest.raises(ValueError, match="layout is for G=4 devices with S=2"):
    layout_for_stacking(layout, specs, 2, 2)
  with pytest.raises(ValueError, match="differ from the features' tables"):
    layout_for_stacking(layout, specs[:2], 4, 2)
