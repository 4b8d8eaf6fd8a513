"""Tests of host preprocessing against an independent, slow Python reference.

The reference builds, for every feature and sample, the dict logical id ->
combiner gain from plain per-sample Python lists, places every id with the
documented layout formulas, and splits the samples over the devices. Every StackBatch
is decoded back into per-sample multisets {(shard, local row, gain)} and
compared, and a numpy lookup through the buffers is compared with the dense
sum_j gain_j * table[id_j]. Every test runs twice: with the C++ preprocessing
loops (where they are built) and with the numpy code alone.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import pickle
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sc_framework.preprocessing import (
    DenseIds,
    PartitionOverflowError,
    PreprocessStats,
    RaggedIds,
    RaggedRows,
    SparseIds,
    StackBatch,
    StackCapacity,
    batch_stats,
    collect_stats,
    flatten_input,
    kept_id_masks,
    merge_stats,
    preprocess,
    release_scratch_buffers,
    size_limits_from_stats,
    stack_capacities,
)
from sc_framework.preprocessing import _native
from sc_framework.preprocessing._dropping import _drop_mask, _Numbered
from sc_framework.specs import FeatureSpec, TableSpec
from sc_framework.stacking import auto_stack_tables, stack_tables
from tests.numerics import assert_close, assert_same_bits

FORMS = ("dense", "ragged_list", "object_array", "ragged_splits", "ragged_lengths", "coo")


@pytest.fixture(autouse=True, params=["cpp", "numpy"])
def preprocessing_loops(request, monkeypatch):
  """Runs the test with the C++ loops of `_native`, then with numpy alone."""
  if request.param == "numpy":
    monkeypatch.setattr(_native, "host_kernels", lambda: None)
  elif _native.host_kernels() is None:
    pytest.skip("the C++ preprocessing loops are not built here")
  return request.param


# --- the reference ------------------------------------------------------------


# The most ids of one sample in these tests (random_samples' largest max_len):
# the longest float32 sum behind a gain or a combined activation.
MAX_SAMPLE_IDS = 10


def random_samples(rng, batch, vocab, max_len=6, weighted=False, dup_rate=0.3, empty_rate=0.2):
  """Per-sample lists of (id, weight); duplicates and empty samples included."""
  samples = []
  for _ in range(batch):
    length = 0 if rng.random() < empty_rate else int(rng.integers(1, max_len + 1))
    ids = [int(rng.integers(0, vocab)) for _ in range(length)]
    for j in range(1, length):
      if rng.random() < dup_rate:
        ids[j] = ids[int(rng.integers(0, j))]
    weights = [float(rng.uniform(0.25, 2.0)) if weighted else 1.0 for _ in ids]
    samples.append(list(zip(ids, weights)))
  return samples


def reference_gains(samples, combiner):
  """Per sample: dict id -> gain = sum of w over the id's occurrences * factor."""
  result = []
  for pairs in samples:
    if combiner == "sum" or not pairs:
      factor = 1.0
    elif combiner == "mean":
      factor = 1.0 / sum(w for _, w in pairs)
    else:
      factor = 1.0 / math.sqrt(sum(w * w for _, w in pairs))
    gains = {}
    for i, w in pairs:
      gains[i] = gains.get(i, 0.0) + w * factor
    result.append(gains)
  return result


def reference_place(layout, stack, table_name, i):
  """(shard, local row) of logical row i, from the documented layout formulas."""
  n_shards, s = layout.num_shards, layout.shards_per_device
  offset = 0
  for k, table in enumerate(stack.tables):
    if table.name == table_name:
      return ((i % n_shards) + (k * s) % n_shards) % n_shards, i // n_shards + offset
    offset += -(-table.vocabulary_size // (8 * n_shards)) * 8 * n_shards // n_shards
  raise AssertionError(table_name)


def reference_devices(layout, stack, gains_by_feature):
  """device g -> local sample -> sorted [(shard, row, gain)]."""
  g_count = layout.num_devices
  expected = [collections.defaultdict(list) for _ in range(g_count)]
  start = 0
  for feature in stack.features:
    per_device = feature.batch_size // g_count
    for b, gains in enumerate(gains_by_feature[feature.name]):
      g, j = divmod(b, per_device)
      for i, gain in gains.items():
        n, row = reference_place(layout, stack, feature.table, i)
        expected[g][start + j].append((n, row, gain))
    start += per_device
  return [{b: sorted(v) for b, v in e.items()} for e in expected]


def to_form(samples, form, weighted, padding=-1):
  """The samples in one input form, and the padding id it needs."""
  ids = [[i for i, _ in pairs] for pairs in samples]
  ws = [[w for _, w in pairs] for pairs in samples]
  lengths = [len(x) for x in ids]
  values = np.array([i for x in ids for i in x], np.int64)
  flat_w = np.array([w for x in ws for w in x], np.float32) if weighted else None
  if form == "dense":
    width = max(max(lengths, default=0), 1)
    dense = np.full((len(ids), width), padding, np.int32)
    dense_w = np.zeros((len(ids), width), np.float32)
    for b, (x, w) in enumerate(zip(ids, ws)):
      dense[b, : len(x)], dense_w[b, : len(w)] = x, w
    return DenseIds(dense, dense_w if weighted else None), padding
  if form == "ragged_list":
    rows = [np.array(x, np.int64) for x in ids]
    return (RaggedRows(rows, ws) if weighted else rows), None
  if form == "object_array":
    rows = np.empty(len(ids), dtype=object)
    rows[:] = [np.array(x, np.int32) for x in ids]
    return (RaggedRows(rows, ws) if weighted else rows), None
  if form == "ragged_splits":
    return RaggedIds(values, np.cumsum([0] + lengths), flat_w), None
  if form == "ragged_lengths":
    return RaggedIds.from_lengths(values, np.array(lengths), flat_w), None
  if form == "coo":
    width = max(max(lengths, default=0), 1)
    indices = np.array([(b, j) for b, x in enumerate(ids) for j in range(len(x))], np.int64)
    indices = indices.reshape(-1, 2)
    order = np.random.default_rng(len(values)).permutation(len(values))
    return SparseIds(
        indices[order], values[order], (len(ids), width),
        None if flat_w is None else flat_w[order],
    ), None
  raise AssertionError(form)


# --- decoding the buffers -------------------------------------------------------


def decode(batch: StackBatch, local_batch: int, rows_per_shard: int):
  """device -> local sample -> sorted [(shard, row, gain)], checking the format."""
  g_count, n_count, u_cap = batch.unique_rows.shape
  e_cap = batch.entry_samples.shape[1]
  assert batch.unique_rows.dtype == np.int32 and batch.entry_samples.dtype == np.int32
  assert batch.entry_unique_index.dtype == np.int32 and batch.entry_gains.dtype == np.float32
  assert batch.entry_unique_index.shape == batch.entry_gains.shape == (g_count, e_cap)
  decoded = []
  for g in range(g_count):
    unique = batch.unique_rows[g]
    used_counts = []
    for n in range(n_count):
      used = int((unique[n] >= 0).sum())
      assert (unique[n, used:] == -1).all(), "unused capacity must follow the used rows"
      assert (np.diff(unique[n, :used]) > 0).all(), "unique rows must ascend"
      assert used == 0 or unique[n, used - 1] < rows_per_shard
      used_counts.append(used)
    samples = batch.entry_samples[g]
    count = int((samples < local_batch).sum())
    assert (samples[:count] < local_batch).all() and (samples[count:] == local_batch).all()
    assert (np.diff(samples[:count]) >= 0).all(), "entry samples must ascend"
    assert (batch.entry_unique_index[g, count:] == 0).all() and (batch.entry_gains[g, count:] == 0).all()
    per_sample = collections.defaultdict(list)
    touched = set()
    for e in range(count):
      n, u = divmod(int(batch.entry_unique_index[g, e]), u_cap)
      assert u < used_counts[n], "an entry points at unused capacity"
      touched.add((n, u))
      per_sample[int(samples[e])].append((n, int(unique[n, u]), float(batch.entry_gains[g, e])))
    assert touched == {(n, u) for n in range(n_count) for u in range(used_counts[n])}, (
        "every requested row must be used by an entry"
    )
    for b, items in per_sample.items():
      keys = [(n, row) for n, row, _ in items]
      assert len(keys) == len(set(keys)), f"sample {b} has a repeated (shard, row) entry"
    decoded.append({b: sorted(v) for b, v in per_sample.items()})
  return decoded


def assert_matches(decoded, expected):
  assert len(decoded) == len(expected)
  for g, (got, want) in enumerate(zip(decoded, expected)):
    assert sorted(got) == sorted(want), f"device {g}: samples with entries differ"
    for b in want:
      assert [x[:2] for x in got[b]] == [x[:2] for x in want[b]], f"device {g} sample {b}"
      # A gain sums the weights of a sample's ids (and its norm): reordered sums.
      assert_close([x[2] for x in got[b]], [x[2] for x in want[b]], terms=MAX_SAMPLE_IDS)


def lookup_numpy(batch: StackBatch, table: np.ndarray, local_batch: int, rows_per_shard: int):
  """[G, B_loc, D]: gather the unique rows, then segment-sum gain * row per sample."""
  g_count, n_count, u_cap = batch.unique_rows.shape
  out = np.zeros((g_count, local_batch, table.shape[1]))
  for g in range(g_count):
    unique = batch.unique_rows[g]
    rows = np.where(unique >= 0, np.arange(n_count)[:, None] * rows_per_shard + unique, 0)
    gathered = table[rows.reshape(-1)] * (unique.reshape(-1, 1) >= 0)
    real = batch.entry_samples[g] < local_batch
    contrib = batch.entry_gains[g, real, None] * gathered[batch.entry_unique_index[g, real]]
    np.add.at(out[g], batch.entry_samples[g, real], contrib)
  return out


def check_lookup(layout, stack, batch, gains_by_feature, rng):
  g_count = layout.num_devices
  local_batch = stack.total_batch_size // g_count
  table = rng.uniform(0.5, 1.5, stack.shape) * rng.choice([-1.0, 1.0], stack.shape)
  got = lookup_numpy(batch, table, local_batch, stack.rows_per_shard)
  start = 0
  for feature in stack.features:
    per_device = feature.batch_size // g_count
    for b, gains in enumerate(gains_by_feature[feature.name]):
      want = np.zeros(stack.padded_embedding_dim)
      for i, gain in gains.items():
        n, row = reference_place(layout, stack, feature.table, i)
        want += gain * table[n * stack.rows_per_shard + row]
      g, j = divmod(b, per_device)
      assert_close(got[g, start + j], want, terms=MAX_SAMPLE_IDS)
    start += per_device


def check_all(layout, specs, samples_by_feature, batches, rng=None):
  """Decoded buffers and numeric lookup of every stack against the reference."""
  rng = rng or np.random.default_rng(0)
  by_name = {spec.name: spec for spec in specs}
  gains = {
      name: reference_gains(samples, by_name[name].table.combiner)
      for name, samples in samples_by_feature.items()
  }
  assert set(batches) == set(layout.stack_names)
  for stack in layout.stacks:
    batch = batches[stack.name]
    local_batch = stack.total_batch_size // layout.num_devices
    assert_matches(
        decode(batch, local_batch, stack.rows_per_shard), reference_devices(layout, stack, gains)
    )
    check_lookup(layout, stack, batch, gains, rng)


# --- a model with shared tables and several stacks ---------------------------


def model(combiner="sum", batch=8, limits=(64, 64)):
  ids_limit, unique_limit = limits
  kw = dict(max_ids_per_partition=ids_limit, max_unique_ids_per_partition=unique_limit)
  users = TableSpec("users", 50, 8, combiner=combiner, **kw)
  items = TableSpec("items", 300, 12, combiner=combiner, **kw)
  tags = TableSpec("tags", 20, 4, combiner="sqrtn", **kw)
  return [
      FeatureSpec("user", users, (batch, 6)),  # random_samples: up to 6 ids
      FeatureSpec("history", items, (batch, None)),
      FeatureSpec("item", items, (batch,)),
      FeatureSpec("tag", tags, (batch, 6)),
  ]


def model_samples(specs, rng, weighted=False):
  return {
      spec.name: random_samples(rng, spec.batch_size, spec.table.vocabulary_size, weighted=weighted)
      for spec in specs
  }


# --- tests: correctness -------------------------------------------------------


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("form", FORMS)
def test_every_form_and_combiner(combiner, weighted, form):
  rng = np.random.default_rng(zlib.crc32(f"{combiner}{weighted}{form}".encode()))
  specs = model(combiner)
  layout = auto_stack_tables(specs, num_devices=2, shards_per_device=2)
  samples = model_samples(specs, rng, weighted)
  if form == "object_array" and weighted:
    form = "ragged_list"
  inputs, paddings = {}, {}
  for name, s in samples.items():
    inputs[name], paddings[name] = to_form(s, form, weighted)
  batches, stats = preprocess(inputs, specs, layout, padding_id=paddings)
  assert stats.num_dropped_ids == 0
  check_all(layout, specs, samples, batches, rng)


@pytest.mark.parametrize(
    "num_devices,shards_per_device",
    [(g, s) for g in (1, 2, 4, 8) for s in (1, 2, 4)] + [(3, 1), (1, 3), (2, 3)],
)
def test_devices_and_shards(num_devices, shards_per_device):
  rng = np.random.default_rng(num_devices * 10 + shards_per_device)
  specs = model("mean", batch=24, limits=(160, 96))
  layout = auto_stack_tables(specs, num_devices, shards_per_device)
  assert len(layout.stacks) == 3
  samples = model_samples(specs, rng, weighted=True)
  inputs = {name: to_form(s, "ragged_splits", True)[0] for name, s in samples.items()}
  batches, stats = preprocess(inputs, specs, layout)
  check_all(layout, specs, samples, batches, rng)
  n_count = num_devices * shards_per_device
  for stack in layout.stacks:
    assert batches[stack.name].unique_rows.shape == (num_devices, n_count, 96)
    assert batches[stack.name].entry_samples.shape == (num_devices, n_count * 160)


def test_one_stack_for_all_tables():
  rng = np.random.default_rng(3)
  kw = dict(max_ids_per_partition=40, max_unique_ids_per_partition=30)
  a, b = TableSpec("a", 64, 12, **kw), TableSpec("b", 120, 10, **kw)
  specs = [FeatureSpec("fa", a, (8, 6)), FeatureSpec("fb", b, (8, 6)), FeatureSpec("fb2", b, (8,))]
  layout = stack_tables(specs, [["a", "b"]], num_devices=2, shards_per_device=4)
  samples = model_samples(specs, rng)
  inputs = {name: to_form(s, "dense", False)[0] for name, s in samples.items()}
  batches, _ = preprocess(inputs, specs, layout, padding_id=-1)
  check_all(layout, specs, samples, batches, rng)


def test_padding_inside_ragged_values_and_per_feature_padding():
  specs = model()
  layout = auto_stack_tables(specs, 1)
  rng = np.random.default_rng(4)
  samples = model_samples(specs, rng)
  inputs = {}
  for name, s in samples.items():
    rows = [[i for i, _ in pairs] + [-7] for pairs in s]
    inputs[name] = rows
  inputs["tag"] = [[i for i, _ in pairs] for pairs in samples["tag"]]
  batches, stats = preprocess(inputs, specs, layout, padding_id={"user": -7, "history": -7,
                                                                 "item": -7})
  check_all(layout, specs, samples, batches, rng)
  assert stats.num_dropped_ids == 0


def test_all_samples_empty():
  specs = model()
  layout = auto_stack_tables(specs, 2, 2)
  inputs = {spec.name: [[] for _ in range(spec.batch_size)] for spec in specs}
  batches, stats = preprocess(inputs, specs, layout)
  for stack in layout.stacks:
    batch = batches[stack.name]
    assert (batch.unique_rows == -1).all()
    assert (batch.entry_samples == stack.total_batch_size // 2).all()
    assert (batch.entry_gains == 0).all() and (batch.entry_unique_index == 0).all()
    assert stats[stack.name].num_ids == 0 and stats[stack.name].max_ids_per_partition == 0


def test_same_row_twice_in_a_sample_is_one_entry():
  table = TableSpec("t", 16, 8, combiner="sqrtn")
  specs = [FeatureSpec("f", table, (2, 4))]
  layout = auto_stack_tables(specs, 1)
  ids = np.array([[3, 3, 3, 5], [5, -1, -1, -1]])
  weights = np.array([[1.0, 2.0, 3.0, 4.0], [2.0, 0.0, 0.0, 0.0]])
  batches, stats = preprocess({"f": DenseIds(ids, weights)}, specs, layout, padding_id=-1)
  batch = batches["t"]
  norm = math.sqrt(1 + 4 + 9 + 16)
  assert batch.entry_samples[0, :3].tolist() == [0, 0, 1]
  assert_close(batch.entry_gains[0, :3], [6 / norm, 4 / norm, 1.0], terms=4)
  assert batch.unique_rows[0, 0, :2].tolist() == [3, 5]
  assert batch.entry_unique_index[0, :3].tolist() == [0, 1, 1]
  assert stats["t"].num_ids == 5 and stats["t"].num_entries == 3


@pytest.mark.parametrize("combiner", ["mean", "sqrtn"])
def test_all_zero_weights_give_zero_gains(combiner):
  table = TableSpec("t", 16, 8, combiner=combiner)
  specs = [FeatureSpec("f", table, (2, 2))]
  layout = auto_stack_tables(specs, 1)
  ids = DenseIds(np.array([[3, 4], [5, 5]]), np.array([[0.0, 0.0], [1.0, 3.0]]))
  batch = preprocess({"f": ids}, specs, layout)[0]["t"]
  assert batch.entry_samples[0, :3].tolist() == [0, 0, 1]
  want = 1.0 if combiner == "mean" else 4 / math.sqrt(10)
  assert_close(batch.entry_gains[0, :3], [0.0, 0.0, want], terms=2)


@pytest.mark.parametrize("dropping", [False, True])
@pytest.mark.parametrize("combiner", ["mean", "sqrtn"])
@pytest.mark.parametrize("scale", [1e-44, 1e-39, 1e-25, 1e25, 1e37])
def test_mean_and_sqrtn_gains_of_tiny_and_huge_weights(scale, combiner, dropping):
  """Gains w / sum w and w / sqrt(sum w^2) do not depend on the weights' scale.

  Their factors 1 / sum w and 1 / sqrt(sum w^2) leave float32's normal range for
  weights of such scales (inf or subnormal), while every gain is of order 1.
  """
  table = TableSpec("t", 16, 8, combiner=combiner)
  specs = [FeatureSpec("f", table, (2, 3))]
  layout = auto_stack_tables(specs, 1)
  ids = np.array([[3, 4, 5], [6, 6, 7]])
  unit = np.array([[1.0, 2.0, 1.0], [1.0, 1.0, -1.5]])
  weights = (unit * scale).astype(np.float32)
  batch = preprocess({"f": DenseIds(ids, weights)}, specs, layout,
                     allow_id_dropping=dropping)[0]["t"]
  w = weights.astype(np.float64)  # as given (subnormal weights are rounded)
  merged = np.array([w[0, 0], w[0, 1], w[0, 2], w[1, 0] + w[1, 1], w[1, 2]])
  owner = np.array([0, 0, 0, 1, 1])  # entries (0,3) (0,4) (0,5) (1,6) (1,7)
  if combiner == "mean":
    factor = 1 / w.sum(1)
  else:
    factor = 1 / np.sqrt((w**2).sum(1))
  assert batch.entry_samples[0, :5].tolist() == owner.tolist()
  assert_close(batch.entry_gains[0, :5], merged * factor[owner], terms=3)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_weights_whose_gain_overflows_float32_are_an_error(combiner):
  """Repeated ids of weight 3e38 merge into an entry of weight 6e38 > float32's max."""
  table = TableSpec("t", 16, 8, combiner=combiner)
  specs = [FeatureSpec("f", table, (2, 2))]
  layout = auto_stack_tables(specs, 1)
  ids = DenseIds(np.array([[3, 4], [5, 5]]), np.full((2, 2), 3e38, np.float32))
  with pytest.raises(ValueError, match=rf"feature 'f' \(table 't'\) sample 1: .*{combiner!r}"
                     r" combiner gives the gain inf, which float32 cannot hold"):
    with np.errstate(over="ignore"):
      preprocess({"f": ids}, specs, layout)


def test_shapes_do_not_depend_on_content():
  specs = model()
  layout = auto_stack_tables(specs, 2, 2)
  shapes = []
  for seed in range(3):
    rng = np.random.default_rng(seed)
    samples = model_samples(specs, rng)
    batches, _ = preprocess(
        {n: to_form(s, "ragged_list", False)[0] for n, s in samples.items()}, specs, layout
    )
    shapes.append({k: [(a.shape, a.dtype) for a in v] for k, v in batches.items()})
  assert shapes[0] == shapes[1] == shapes[2]


@pytest.mark.parametrize("num_devices,shards", [(1, 1), (2, 2)])
def test_every_output_array_starts_at_a_64_byte_boundary(num_devices, shards):
  """On the CPU, jax.device_put aliases 64-byte aligned host arrays instead of copying them."""
  specs = model("mean", batch=24, limits=(161, 97))  # sizes not multiples of 16
  layout = auto_stack_tables(specs, num_devices, shards)
  rng = np.random.default_rng(17)
  for _ in range(3):
    inputs = {n: to_form(s, "ragged_splits", True)[0]
              for n, s in model_samples(specs, rng, True).items()}
    batches, _ = preprocess(inputs, specs, layout)
    for name, batch in batches.items():
      for field, array in batch._asdict().items():
        assert array.ctypes.data % 64 == 0, (name, field, array.ctypes.data % 64)
        assert array.flags.c_contiguous and array.flags.writeable, (name, field)


def test_outputs_and_inputs_are_never_overwritten():
  """Scratch buffers are reused across calls; results and inputs must not change."""
  specs = model("mean", batch=16)
  layout = auto_stack_tables(specs, 2, 2)
  rng = np.random.default_rng(11)
  inputs = [
      {n: to_form(s, "ragged_splits", True)[0] for n, s in model_samples(specs, rng, True).items()}
      for _ in range(3)
  ]
  frozen = [{n: (v.values.copy(), v.weights.copy()) for n, v in x.items()} for x in inputs]
  first, _ = preprocess(inputs[0], specs, layout)
  saved = {k: [a.copy() for a in v] for k, v in first.items()}
  for x in inputs[1:]:
    preprocess(x, specs, layout)
  for name, arrays in first.items():
    for got, want in zip(arrays, saved[name]):
      assert_same_bits(got, want)
  for x, f in zip(inputs, frozen):
    for name, value in x.items():
      assert_same_bits(value.values, f[name][0])
      assert_same_bits(value.weights, f[name][1])


def test_released_scratch_buffers_are_rebuilt_with_equal_results():
  from sc_framework.preprocessing import _scratch

  specs = model("mean", batch=16)
  layout = auto_stack_tables(specs, 2, 2)
  rng = np.random.default_rng(13)
  inputs = {n: to_form(s, "ragged_splits", True)[0]
            for n, s in model_samples(specs, rng, True).items()}
  before, _ = preprocess(inputs, specs, layout)
  assert _scratch._LOCAL.arrays
  release_scratch_buffers()
  assert not _scratch._LOCAL.arrays
  after, _ = preprocess(inputs, specs, layout)
  for name, arrays in before.items():
    for got, want in zip(after[name], arrays):
      assert_same_bits(got, want)


def test_concurrent_threads_match_sequential():
  from concurrent.futures import ThreadPoolExecutor

  specs = model("sqrtn", batch=16)
  layout = auto_stack_tables(specs, 2, 1)
  rng = np.random.default_rng(12)
  inputs = [
      {n: to_form(s, "ragged_list", w)[0] for n, s in model_samples(specs, rng, w).items()}
      for w in [False, True] * 4
  ]
  sequential = [preprocess(x, specs, layout)[0] for x in inputs]
  with ThreadPoolExecutor(4) as pool:
    parallel = list(pool.map(lambda x: preprocess(x, specs, layout)[0], inputs * 3))
  for i, result in enumerate(parallel):
    for name, arrays in result.items():
      for got, want in zip(arrays, sequential[i % len(inputs)][name]):
        assert_same_bits(got, want)


def test_forms_flatten_identically():
  rng = np.random.default_rng(5)
  spec = model()[1]
  samples = random_samples(rng, spec.batch_size, spec.table.vocabulary_size, weighted=True)
  flats = []
  for form in ("dense", "ragged_list", "ragged_splits", "ragged_lengths", "coo"):
    value, padding = to_form(samples, form, True)
    flats.append(flatten_input(value, spec, padding_id=padding))
  for flat in flats[1:]:
    np.testing.assert_array_equal(flat.row_splits, flats[0].row_splits)
    for b in range(spec.batch_size):
      lo, hi = flat.row_splits[b], flat.row_splits[b + 1]
      assert sorted(zip(flat.values[lo:hi], flat.weights[lo:hi])) == sorted(
          zip(flats[0].values[lo:hi], flats[0].weights[lo:hi])
      )


@st.composite
def random_models(draw):
  g_count = draw(st.sampled_from([1, 2, 3, 4]))
  s_count = draw(st.sampled_from([1, 2, 3]))
  tables = []
  for t in range(draw(st.integers(1, 3))):
    tables.append(TableSpec(
        f"t{t}",
        draw(st.integers(1, 300)),
        draw(st.sampled_from([4, 8, 16])),
        combiner=draw(st.sampled_from(["sum", "mean", "sqrtn"])),
        max_ids_per_partition=128,
        max_unique_ids_per_partition=128,
    ))
  specs = []
  for f in range(draw(st.integers(1, 4))):
    table = tables[draw(st.integers(0, len(tables) - 1))]
    specs.append(FeatureSpec(f"f{f}", table, (g_count * draw(st.integers(1, 3)), None)))
  return specs, g_count, s_count, draw(st.booleans()), draw(st.sampled_from(FORMS)), draw(
      st.integers(0, 2**31))


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(random_models())
def test_random_models(case):
  specs, g_count, s_count, weighted, form, seed = case
  rng = np.random.default_rng(seed)
  layout = auto_stack_tables(specs, g_count, s_count)
  if form == "object_array" and weighted:
    form = "ragged_list"
  samples = {
      s.name: random_samples(rng, s.batch_size, s.table.vocabulary_size, 5, weighted)
      for s in specs
  }
  inputs, paddings = {}, {}
  for name, s in samples.items():
    inputs[name], paddings[name] = to_form(s, form, weighted)
  batches, stats = preprocess(inputs, specs, layout, padding_id=paddings)
  check_all(layout, specs, samples, batches, rng)
  for stack in layout.stacks:
    assert stats[stack.name].num_ids == sum(
        len(pairs) for f in stack.features for pairs in samples[f.name]
    )


# --- tests: statistics, overflow and dropping ---------------------------------


def reference_partition_counts(layout, stack, samples_by_feature):
  """(device, shard) -> (entries, distinct rows), from the reference."""
  gains = {f.name: reference_gains(samples_by_feature[f.name], "sum") for f in stack.features}
  counts = collections.Counter()
  rows = collections.defaultdict(set)
  for g, per_sample in enumerate(reference_devices(layout, stack, gains)):
    for items in per_sample.values():
      for n, row, _ in items:
        counts[g, n] += 1
        rows[g, n].add(row)
  return counts, {k: len(v) for k, v in rows.items()}


def reference_drop(layout, stack, samples_by_feature, capacity):
  """The samples with the ids dropped by the documented rule, and the count."""
  g_count = layout.num_devices
  # device -> ordered entries (local sample, shard, row, feature, feature sample, id)
  entries = [[] for _ in range(g_count)]
  start = 0
  for feature in stack.features:
    per_device = feature.batch_size // g_count
    for b, pairs in enumerate(samples_by_feature[feature.name]):
      g, j = divmod(b, per_device)
      for i in {i for i, _ in pairs}:
        n, row = reference_place(layout, stack, feature.table, i)
        entries[g].append((start + j, n, row, feature.name, b, i))
    start += per_device
  dropped = set()
  for g in range(g_count):
    ordered = sorted(entries[g], key=lambda e: (e[0], e[1] * stack.rows_per_shard + e[2]))
    by_partition = collections.defaultdict(list)
    for entry in ordered:
      by_partition[entry[1]].append(entry)
    for part in by_partition.values():
      first_rows = []
      for entry in part:
        if entry[2] not in first_rows:
          first_rows.append(entry[2])
      kept_rows = set(first_rows[: capacity.max_unique_ids_per_partition])
      kept = 0
      for entry in part:
        if entry[2] in kept_rows and kept < capacity.max_ids_per_partition:
          kept += 1
        else:
          dropped.add((entry[3], entry[4], entry[5]))
  remaining = {}
  num_dropped = 0
  for name, samples in samples_by_feature.items():
    remaining[name] = []
    for b, pairs in enumerate(samples):
      keep = [(i, w) for i, w in pairs if (name, b, i) not in dropped]
      num_dropped += len(pairs) - len(keep)
      remaining[name].append(keep)
  return remaining, num_dropped


def skewed_model(combiner="mean"):
  table = TableSpec("hot", 40, 8, combiner=combiner, max_ids_per_partition=6,
                    max_unique_ids_per_partition=4)
  other = TableSpec("cold", 40, 8, combiner=combiner, max_ids_per_partition=6,
                    max_unique_ids_per_partition=4)
  return [FeatureSpec("a", table, (8, None)), FeatureSpec("b", other, (8, None)),
          FeatureSpec("c", table, (4, None))]


def test_stats_match_reference():
  rng = np.random.default_rng(6)
  specs = model(batch=16)
  layout = auto_stack_tables(specs, 2, 2)
  samples = model_samples(specs, rng)
  inputs = {n: to_form(s, "ragged_list", False)[0] for n, s in samples.items()}
  _, stats = preprocess(inputs, specs, layout)
  capacities = stack_capacities(specs, layout)
  for stack in layout.stacks:
    counts, unique = reference_partition_counts(layout, stack, samples)
    got = stats[stack.name]
    assert got.max_ids_per_partition == max(counts.values())
    assert got.max_unique_ids_per_partition == max(unique.values())
    assert got.num_entries == sum(counts.values())
    assert got.capacity == capacities[stack.name] == StackCapacity(64, 64)
    assert got.required_capacity == StackCapacity(max(counts.values()), max(unique.values()))
    assert got.tables == stack.table_names
  assert batch_stats(inputs, specs, layout) == stats


def test_overflow_raises_with_a_clear_message():
  rng = np.random.default_rng(7)
  specs = skewed_model()
  layout = auto_stack_tables(specs, 2, 1)
  samples = {s.name: random_samples(rng, s.batch_size, 40, 8, empty_rate=0) for s in specs}
  inputs = {n: to_form(s, "ragged_list", False)[0] for n, s in samples.items()}
  with pytest.raises(PartitionOverflowError) as info:  # a ValueError
    preprocess(inputs, specs, layout)
  message = str(info.value)
  stats = batch_stats(inputs, specs, layout)
  observed = stats["hot__cold"]
  assert info.value.stack == "hot__cold"
  copied = pickle.loads(pickle.dumps(info.value))  # from a data loader's worker process
  assert str(copied) == message and copied.needed == info.value.needed
  assert info.value.needed == (observed.max_ids_per_partition,
                               observed.max_unique_ids_per_partition)
  assert "stack 'hot__cold'" in message and "allow_id_dropping=True" in message
  assert "size_limits_from_stats" in message
  assert f"{observed.max_ids_per_partition} ids" in message
  assert "max_ids_per_partition = 6" in message


@pytest.mark.parametrize("num_devices,shards", [(1, 1), (2, 1), (2, 2), (4, 2), (1, 3)])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_dropping_is_deterministic_and_documented(num_devices, shards, combiner):
  rng = np.random.default_rng(num_devices * 7 + shards)
  specs = skewed_model(combiner)
  layout = auto_stack_tables(specs, num_devices, shards)
  samples = {
      s.name: random_samples(rng, s.batch_size, 40, 10, weighted=True, empty_rate=0.1)
      for s in specs
  }
  inputs = {n: to_form(s, "coo", True)[0] for n, s in samples.items()}
  batches, stats = preprocess(inputs, specs, layout, allow_id_dropping=True)
  again, _ = preprocess(inputs, specs, layout, allow_id_dropping=True)
  for name in batches:
    for x, y in zip(batches[name], again[name]):
      assert_same_bits(x, y)
  stack = layout.stacks[0]
  capacity = StackCapacity(6, 4)
  remaining, num_dropped = reference_drop(layout, stack, samples, capacity)
  assert num_dropped > 0
  assert stats[stack.name].num_dropped_ids == num_dropped
  assert stats.num_dropped_ids == num_dropped
  check_all(layout, specs, remaining, batches, rng)
  # The statistics describe the batch before dropping.
  counts, _ = reference_partition_counts(layout, stack, samples)
  assert stats[stack.name].max_ids_per_partition == max(counts.values())
  # The statistics alone (no buffers built) are the same, and do not raise.
  alone = batch_stats(inputs, specs, layout)[stack.name]
  assert alone == dataclasses.replace(stats[stack.name], num_dropped_ids=0)


@pytest.mark.parametrize("num_devices,shards", [(1, 1), (2, 2), (4, 1)])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_kept_id_masks_name_the_ids_dropping_kept_and_they_preprocess_to_the_batch(
    num_devices, shards, combiner):
  """The oracle: the documented rule (`reference_drop`); and the kept ids, preprocessed
  without dropping, give the dropping batch's buffers bit for bit."""
  rng = np.random.default_rng(num_devices * 5 + shards)
  specs = skewed_model(combiner)
  layout = auto_stack_tables(specs, num_devices, shards)
  samples = {s.name: random_samples(rng, s.batch_size, 40, 10, weighted=True, empty_rate=0.1)
             for s in specs}
  inputs = {n: to_form(s, "coo", True)[0] for n, s in samples.items()}
  batches, stats = preprocess(inputs, specs, layout, allow_id_dropping=True)
  masks = kept_id_masks(inputs, specs, layout, batches)
  remaining, num_dropped = reference_drop(layout, layout.stacks[0], samples, capacity=(
      StackCapacity(6, 4)))
  assert num_dropped == stats.num_dropped_ids > 0
  assert sum(int((~mask).sum()) for mask in masks.values()) == num_dropped
  kept_inputs = {}
  for spec in specs:
    flat = flatten_input(inputs[spec.name], spec)
    mask = masks[spec.name]
    lengths = np.add.reduceat(mask, flat.row_splits[:-1]) * (np.diff(flat.row_splits) > 0)
    kept_inputs[spec.name] = RaggedIds(flat.values[mask],
                                       np.concatenate([[0], np.cumsum(lengths)]),
                                       flat.weights[mask])
    for b, pairs in enumerate(remaining[spec.name]):
      ids = flat.values[flat.row_splits[b]:flat.row_splits[b + 1]]
      kept = mask[flat.row_splits[b]:flat.row_splits[b + 1]]
      assert sorted(ids[kept].tolist()) == sorted(i for i, _ in pairs), (spec.name, b)
  again, again_stats = preprocess(kept_inputs, specs, layout)
  assert again_stats.num_dropped_ids == 0
  for name in batches:
    for field, x, y in zip(StackBatch._fields, batches[name], again[name]):
      assert_same_bits(x, y, err_msg=f"{name} {field}")


def drop_mask(row_ids, stride, num_parts, capacity):
  """`_drop_mask` of rows numbered p * stride + u in partition p (a copy)."""
  parts = None if num_parts == 1 else row_ids // stride
  offsets = np.arange(num_parts + 1) * stride
  return _drop_mask(_Numbered(row_ids, parts, offsets), capacity).copy()


def reference_drop_mask(row_ids, stride, capacity):
  """Rules (a) and (b) of `_dropping` by a loop over the entries in order."""
  first_rows = collections.defaultdict(list)  # partition -> rows, first-entry order
  for row in row_ids.tolist():
    if row not in first_rows[row // stride]:
      first_rows[row // stride].append(row)
  allowed = {p: set(rows[: capacity.max_unique_ids_per_partition])
             for p, rows in first_rows.items()}
  kept = collections.Counter()
  keep = []
  for row in row_ids.tolist():
    p = row // stride
    keep.append(row in allowed[p] and kept[p] < capacity.max_ids_per_partition)
    kept[p] += keep[-1]
  return np.array(keep, np.bool_)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), num_parts=st.integers(1, 6), stride=st.integers(1, 12),
       size=st.integers(0, 300), entries=st.integers(1, 60), rows=st.integers(1, 14),
       grouped=st.booleans())
def test_drop_mask_matches_loop_reference(seed, num_parts, stride, size, entries, rows, grouped):
  """The vectorised mask equals the entry-by-entry rules on random row ids.

  grouped: the partitions come one after the other (one shard per device),
  else interleaved (several shards).
  """
  rng = np.random.default_rng(seed)
  row_ids = rng.integers(0, num_parts * stride, size)
  if grouped:
    row_ids = row_ids[np.argsort(row_ids // stride, kind="stable")]
  capacity = StackCapacity(entries, rows)
  keep = drop_mask(row_ids, stride, num_parts, capacity)
  np.testing.assert_array_equal(keep, reference_drop_mask(row_ids, stride, capacity))


def test_drop_mask_more_partitions_than_16_bits():
  rng = np.random.default_rng(11)
  num_parts, stride = 70_000, 2
  # 8 partitions used, 62,000 ... 69,000: beyond what 16 bits hold.
  row_ids = (rng.integers(0, 8, 400) * 1_000 + 62_000) * stride + rng.integers(0, 2, 400)
  capacity = StackCapacity(30, 1)
  keep = drop_mask(row_ids, stride, num_parts, capacity)
  np.testing.assert_array_equal(keep, reference_drop_mask(row_ids, stride, capacity))
  assert not keep.all()


@pytest.mark.parametrize("num_devices,shards", [(1, 1), (2, 3)])
def test_dropping_a_large_batch_over_many_partitions(num_devices, shards):
  """Both rules bind in many partitions at once; the result is the batch
  without the reference's dropped ids."""
  rng = np.random.default_rng(num_devices + 10 * shards)
  table = TableSpec("t", 300, 8, combiner="sqrtn")
  specs = [FeatureSpec("a", table, (96, None)), FeatureSpec("b", table, (96, None))]
  layout = auto_stack_tables(specs, num_devices, shards)
  samples = {s.name: random_samples(rng, 96, 300, 12, weighted=True, empty_rate=0.05)
             for s in specs}
  inputs = {n: to_form(s, "ragged_lengths", True)[0] for n, s in samples.items()}
  stack = layout.stacks[0]
  needed = batch_stats(inputs, specs, layout)[stack.name].required_capacity
  capacity = StackCapacity(needed.max_ids_per_partition * 3 // 4,
                           needed.max_unique_ids_per_partition * 3 // 4)
  batches, stats = preprocess(inputs, specs, layout, allow_id_dropping=True,
                              capacities={stack.name: capacity})
  remaining, num_dropped = reference_drop(layout, stack, samples, capacity)
  assert num_dropped > 0 and stats.num_dropped_ids == num_dropped
  check_all(layout, specs, remaining, batches, rng)


def test_capacity_override():
  rng = np.random.default_rng(8)
  specs = skewed_model()
  layout = auto_stack_tables(specs, 2, 2)
  samples = {s.name: random_samples(rng, s.batch_size, 40, 8) for s in specs}
  inputs = {n: to_form(s, "ragged_list", False)[0] for n, s in samples.items()}
  needed = batch_stats(inputs, specs, layout)["hot__cold"].required_capacity
  batches, stats = preprocess(inputs, specs, layout, capacities={"hot__cold": needed})
  batch = batches["hot__cold"]
  assert batch.unique_rows.shape == (2, 4, needed.max_unique_ids_per_partition)
  assert batch.entry_samples.shape == (2, 4 * needed.max_ids_per_partition)
  assert stats["hot__cold"].capacity == needed
  check_all(layout, specs, samples, batches, rng)
  with pytest.raises(ValueError, match="unknown stacks"):
    preprocess(inputs, specs, layout, capacities={"nope": (4, 4)})
  with pytest.raises(ValueError, match="must be a positive int"):
    preprocess(inputs, specs, layout, capacities={"hot__cold": (0, 4)})


def test_sizing_from_stats():
  specs = skewed_model()
  layout = auto_stack_tables(specs, 2, 2)
  batches = []
  for seed in range(3):
    rng = np.random.default_rng(seed)
    batches.append({
        s.name: to_form(random_samples(rng, s.batch_size, 40, 8), "ragged_list", False)[0]
        for s in specs
    })
  stats = collect_stats(batches, specs, layout)
  each = [batch_stats(b, specs, layout) for b in batches]
  assert stats == merge_stats(each)
  merged = stats["hot__cold"]
  assert merged.num_batches == 3
  assert merged.max_ids_per_partition == max(s["hot__cold"].max_ids_per_partition for s in each)
  assert merged.num_ids == sum(s["hot__cold"].num_ids for s in each)
  sized = size_limits_from_stats(specs, stats, headroom=1.5)
  want_ids = math.ceil(merged.max_ids_per_partition * 1.5)
  want_unique = math.ceil(merged.max_unique_ids_per_partition * 1.5)
  assert [s.name for s in sized] == [s.name for s in specs]
  for spec in sized:
    assert spec.table.max_ids_per_partition == max(want_ids, 6)
    assert spec.table.max_unique_ids_per_partition == max(want_unique, 4)
  assert sized[0].table is sized[2].table  # still shared
  for batch in batches:
    preprocess(batch, sized, layout)  # no overflow any more
  # "raise" never shrinks, "fit" does.
  roomy = [FeatureSpec(s.name, TableSpec(s.table.name, 40, 8, combiner="mean",
                                         max_ids_per_partition=1000,
                                         max_unique_ids_per_partition=1000), s.input_shape)
           for s in specs]
  assert size_limits_from_stats(roomy, [stats])[0].table.max_ids_per_partition == 1000
  fit = size_limits_from_stats(roomy, stats, headroom=1.0, policy="fit")
  assert fit[0].table.max_ids_per_partition == merged.max_ids_per_partition
  with pytest.raises(ValueError, match="headroom"):
    size_limits_from_stats(specs, stats, headroom=0.5)
  for bad in ("1.2", True, None):
    with pytest.raises(ValueError, match=r"headroom must be a finite number >= 1, got"):
      size_limits_from_stats(specs, stats, headroom=bad)
  assert size_limits_from_stats(specs, stats, headroom=np.float64(1.5)) == sized
  assert isinstance(stats, PreprocessStats)


def test_a_bad_batch_of_collect_stats_is_named_by_its_place():
  specs = skewed_model()
  layout = auto_stack_tables(specs, 2, 2)
  rng = np.random.default_rng(7)
  batches = [{s.name: to_form(random_samples(rng, s.batch_size, 40, 8), "ragged_list", False)[0]
              for s in specs} for _ in range(3)]
  del batches[2][specs[1].name]
  with pytest.raises(ValueError, match=rf"^batch 2 of the batches given to collect_stats:"
                                       rf" .*{specs[1].name}"):
    collect_stats(batches, specs, layout)


def test_stats_of_one_layout_do_not_size_another():
  """Partitions depend on G, S and the stacking: figures of one layout are refused for another."""
  specs = skewed_model()
  rng = np.random.default_rng(3)
  batch = {s.name: to_form(random_samples(rng, s.batch_size, 40, 8), "ragged_list", False)[0]
           for s in specs}
  layout = auto_stack_tables(specs, 2, 2)
  stats = collect_stats([batch], specs, layout)
  assert stats.layout == layout == batch_stats(batch, specs, layout).layout
  assert preprocess(batch, specs, layout, allow_id_dropping=True)[1].layout == layout
  assert collect_stats([], specs, layout).layout == layout
  sized = size_limits_from_stats(specs, stats)
  assert size_limits_from_stats(specs, [stats, stats], layout=layout) == sized
  others = {"G": auto_stack_tables(specs, 1, 2), "S": auto_stack_tables(specs, 2, 1),
            "stacks": stack_tables(specs, [["hot"], ["cold"]], 2, 2)}
  for what, other in others.items():
    with pytest.raises(ValueError, match=rf"collected on another layout than the one to size"
                                         rf" \({what}=.*statistics vs layout\).*collect_stats"):
      size_limits_from_stats(specs, stats, layout=other)
    with pytest.raises(ValueError, match=rf"cannot merge statistics collected on different"
                                         rf" layouts \({what}="):
      size_limits_from_stats(specs, [stats, collect_stats([batch], specs, other)])
  # Statistics that record no layout (built by hand, or objects of an older version, which
  # unpickle without the field) are checked by their stacks' names and tables.
  legacy = PreprocessStats.__new__(PreprocessStats)
  legacy.__dict__["stacks"] = dict(stats.stacks)
  assert legacy.layout is None and merge_stats([legacy, stats]).layout is None
  assert size_limits_from_stats(specs, legacy, layout=layout) == sized
  with pytest.raises(ValueError, match=r"hold stack 'hot__cold' with tables \['hot', 'cold'\],"
                                       r" but the layout to size has no such stack"):
    size_limits_from_stats(specs, legacy, layout=others["stacks"])
  with pytest.raises(TypeError, match="layout must be an EmbeddingLayout or None, got dict"):
    size_limits_from_stats(specs, stats, layout={})


# --- tests: bad input -------------------------------------------------------


def simple():
  table = TableSpec("users", 1000, 8, combiner="mean")
  specs = [FeatureSpec("user_id", table, (4, 2)), FeatureSpec("other", table, (4,))]
  return specs, auto_stack_tables(specs, 2)


def good_inputs():
  return {"user_id": np.array([[1, 2], [3, 4], [5, 6], [7, 8]]), "other": np.arange(4)}


def test_good_inputs_pass():
  specs, layout = simple()
  preprocess(good_inputs(), specs, layout)
  # A wider dense array is fine while no sample has more than 2 ids.
  wide = np.array([[1, -1, 2], [-1, -1, 3], [4, 5, -1], [-1, -1, -1]])
  preprocess({**good_inputs(), "user_id": wide}, specs, layout, padding_id=-1)


@pytest.mark.parametrize(
    "change,error,fragments",
    [
        (dict(user_id=np.array([[1, 2], [3, 1000], [5, 6], [7, 8]])), ValueError,
         ["'user_id'", "'users'", "vocabulary_size=1000", "id 1000", "sample 1"]),
        (dict(user_id=np.array([[1, 2], [3, 4], [-1, 6], [7, 8]])), ValueError,
         ["'user_id'", "id -1", "sample 2", "padding_id=-1"]),
        (dict(other=RaggedIds([1, 2, -5], [0, 1, 2, 2, 3])), ValueError,
         ["'other'", "id -5", "sample 3"]),
        (dict(user_id=np.zeros((3, 2), np.int64)), ValueError,
         ["'user_id'", "3 samples", "batch size 4"]),
        (dict(other=[[1], [2]]), ValueError, ["'other'", "2 samples", "batch size 4"]),
        (dict(user_id=DenseIds(np.ones((4, 2), np.int64), np.ones((4, 3)))), ValueError,
         ["'user_id'", "weights have shape (4, 3)"]),
        # Weights of the ids' size but another shape are not reshaped: [2, 4] (or
        # [8]) for ids [4, 2] would pair ids with other samples' weights.
        (dict(user_id=DenseIds(np.ones((4, 2), np.int64), np.ones((2, 4)))), ValueError,
         ["'user_id'", "weights have shape (2, 4) but the ids have (4, 2)"]),
        (dict(user_id=DenseIds(np.ones((4, 2), np.int64), np.ones(8))), ValueError,
         ["'user_id'", "weights have shape (8,) but the ids have (4, 2)"]),
        (dict(other=RaggedIds([1, 2, 3, 4], [0, 1, 2, 3, 4], [1.0, 2.0])), ValueError,
         ["'other'", "weights have shape (2,)"]),
        (dict(other=RaggedRows([[1], [2], [3], [4]], [[1.0], [2.0, 3.0], [1.0], [1]])),
         ValueError, ["sample 1 has 1 ids but 2 weights"]),
        (dict(user_id=DenseIds(np.ones((4, 2), np.int64),
                               np.array([[1, 1], [1, np.nan], [1, 1], [1, 1]]))), ValueError,
         ["'user_id'", "nan", "sample 1", "not finite"]),
        (dict(other=SparseIds([[0, 0], [1, 0], [2, 0], [3, 0]], [1, 2, 3, 4], (4, 1),
                              [1.0, np.inf, 1.0, 1.0])),
         ValueError, ["'other'", "inf", "sample 1"]),
        (dict(user_id=np.ones((4, 2), np.float32)), TypeError, ["'user_id'", "integer", "float32"]),
        (dict(other=SparseIds([[0, 0], [5, 0]], [1, 2], (4, 1))), ValueError,
         ["'other'", "[5, 0]", "outside dense_shape"]),
        (dict(other=RaggedIds([1, 2], [0, 1, 1, 3, 2])), ValueError, ["'other'", "row_splits"]),
        (dict(user_id=DenseIds(np.array([[1, 2], [3, 4], [5, 6], [7, 8]]),
                               np.array([[1.0, -1.0], [1, 1], [1, 1], [1, 1]]))), ValueError,
         ["'user_id'", "sample 0", "sum to 0", "'mean'"]),
        # More ids in a sample than the spec's input_shape[1] = 2, in each form.
        (dict(user_id=np.arange(12).reshape(4, 3)), ValueError,
         ["'user_id'", "sample 0 has 3 ids", "at most 2 per sample", "input_shape (4, 2)"]),
        (dict(user_id=[[1], [2, 3], [4, 5, 6], []]), ValueError,
         ["'user_id'", "sample 2 has 3 ids", "at most 2"]),
        (dict(user_id=RaggedIds([1, 2, 3, 4], [0, 1, 1, 1, 4])), ValueError,
         ["'user_id'", "sample 3 has 3 ids"]),
        (dict(user_id=SparseIds([[0, 0], [1, 0], [1, 1], [1, 2]], [1, 2, 3, 4], (4, 3))),
         ValueError, ["'user_id'", "sample 1 has 3 ids"]),
        # A COO position given twice.
        (dict(other=SparseIds([[2, 0], [0, 0], [2, 0]], [1, 2, 3], (4, 1))), ValueError,
         ["'other'", "COO index [2, 0] appears more than once (entries 0 and 2)"]),
        (dict(user_id=SparseIds([[0, 1], [0, 1]], [1, 2], (4, 2))), ValueError,
         ["'user_id'", "COO index [0, 1] appears more than once (entries 0 and 1)"]),
    ],
)
def test_bad_input(change, error, fragments):
  specs, layout = simple()
  inputs = {**good_inputs(), **change}
  with pytest.raises(error) as info:
    preprocess(inputs, specs, layout)
  for fragment in fragments:
    assert fragment in str(info.value), (fragment, str(info.value))


def test_one_id_per_sample_takes_weights_of_shape_b():
  """Ids [B] or [B, 1] take weights [B] or [B, 1]: the same gains either way."""
  table = TableSpec("t", 100, 8)  # 'sum': each gain is the id's weight
  specs = [FeatureSpec("f", table, (4,))]
  layout = auto_stack_tables(specs, 2)
  ids, weights = np.array([7, 3, 9, 1]), np.array([0.5, 2.0, 3.0, 4.0], np.float32)
  results = [preprocess({"f": DenseIds(i, w)}, specs, layout)[0]["t"]
             for i in (ids, ids[:, None]) for w in (weights, weights[:, None])]
  for batch in results[1:]:
    for field, expected in zip(batch, results[0]):
      assert_same_bits(field, expected)
  gains = np.asarray(results[0].entry_gains)
  assert sorted(gains[gains != 0].tolist()) == [0.5, 2.0, 3.0, 4.0]


@pytest.mark.parametrize("flag", ["no", 0, None, 1.0])
def test_allow_id_dropping_must_be_a_bool(flag):
  """A truthy non-bool such as "no" would have turned dropping on."""
  specs, layout = simple()
  with pytest.raises(TypeError, match=rf"allow_id_dropping must be True or False, got {flag!r}"):
    preprocess(good_inputs(), specs, layout, allow_id_dropping=flag)
  preprocess(good_inputs(), specs, layout, allow_id_dropping=np.bool_(True))


def test_weights_of_jax_float_types_are_accepted():
  """bfloat16 weights (a JAX model's dtype) are real numbers: they were refused as not real."""
  import ml_dtypes

  table = TableSpec("t", 100, 8)
  specs = [FeatureSpec("f", table, (2, 2))]
  layout = auto_stack_tables(specs, 1)
  ids = np.array([[1, 2], [3, 3]])
  weights = np.array([[0.5, 2.0], [1.5, 0.25]])
  want = preprocess({"f": DenseIds(ids, weights)}, specs, layout)[0]["t"]
  got = preprocess({"f": DenseIds(ids, weights.astype(ml_dtypes.bfloat16))}, specs, layout)[0]["t"]
  for field, expected in zip(got, want):
    assert_same_bits(field, expected)
  with pytest.raises(TypeError, match=r"weights must be a real \(float or integer\) array, got"
                                      r" dtype complex128"):
    preprocess({"f": DenseIds(ids, weights.astype(complex))}, specs, layout)
  with pytest.raises(TypeError, match="got dtype bool"):
    preprocess({"f": DenseIds(ids, weights > 1)}, specs, layout)


def test_missing_and_unknown_features():
  specs, layout = simple()
  inputs = good_inputs()
  del inputs["other"]
  with pytest.raises(ValueError, match=r"features \['other'\] are missing"):
    preprocess(inputs, specs, layout)
  with pytest.raises(ValueError, match=r"unknown features \['oops'\]"):
    preprocess({**good_inputs(), "oops": np.arange(4)}, specs, layout)
  with pytest.raises(ValueError, match="unknown features"):
    preprocess(good_inputs(), specs, layout, padding_id={"oops": -1})


def test_batch_not_divisible_by_devices():
  table = TableSpec("t", 10, 8)
  specs = [FeatureSpec("f", table, (6,))]
  layout = auto_stack_tables(specs, 4)
  with pytest.raises(ValueError, match=r"feature 'f': batch size 6 is not divisible by the 4"):
    preprocess({"f": np.arange(6)}, specs, layout)


def test_layout_from_other_specs():
  specs, layout = simple()
  table = TableSpec("users", 999, 8, combiner="mean")
  other = [FeatureSpec(s.name, table, s.input_shape) for s in specs]
  with pytest.raises(ValueError, match="vocabulary_size 999"):
    preprocess(good_inputs(), other, layout)


@pytest.mark.parametrize("knobs", [
    # Distinct rows by sorting instead of the bitmap.
    {"_locate": dict(_BITMAP_MIN=0, _BITMAP_FACTOR=0)},
    # Boolean compaction of repeats; many small sort runs.
    {"_dedup": dict(_MAX_COPY_RUNS=0, _SORT_RUN=5)},
])
@pytest.mark.parametrize("weighted", [False, True])
def test_internal_algorithm_variants(monkeypatch, knobs, weighted):
  from sc_framework.preprocessing import _dedup, _locate

  modules = {"_dedup": _dedup, "_locate": _locate}
  for module, values in knobs.items():
    for name, value in values.items():
      monkeypatch.setattr(modules[module], name, value)
  rng = np.random.default_rng(9)
  specs = model("sqrtn", batch=24, limits=(128, 128))
  for g_count, s_count in [(1, 1), (2, 2), (4, 1), (3, 1)]:
    layout = auto_stack_tables(specs, g_count, s_count)
    samples = model_samples(specs, rng, weighted)
    inputs = {n: to_form(s, "ragged_splits", weighted)[0] for n, s in samples.items()}
    batches, _ = preprocess(inputs, specs, layout)
    check_all(layout, specs, samples, batches, rng)


@pytest.mark.parametrize("observed, headroom, limit", [
    (100, 1.1, 110), (10, 1.1, 11), (1000, 1.1, 1100), (50, 1.2, 60), (35000, 1.2, 42000),
    (7, 1.5, 11), (3, 1.0, 3), (1, 1.01, 2), (999, 1.001, 1000),
])
def test_headroom_scales_the_observed_maximum_as_written_in_decimal(observed, headroom, limit):
  """ceil(100 * 1.1) was 111: the float product is 110.00000000000001."""
  from sc_framework.preprocessing._stats import _scaled_up
  assert _scaled_up(observed, headroom) == limit
