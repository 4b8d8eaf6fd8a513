"""The C++ preprocessing loops (`_host_kernels`) against numpy, bit for bit.

Two levels: each loop against a plain numpy statement of what it computes
(a stable lexsort, np.unique, fancy indexing, the DESIGN.md row formula), on
random arrays; and whole `preprocess` calls with the loops against the same
calls with numpy alone, over random models (devices, shards, combiners,
weights, id dtypes, long samples, repeated ids, tight limits with and without
dropping): every output array must have the same bits, the statistics and
the error messages must be equal.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sc_framework.preprocessing import RaggedIds, StackCapacity, batch_stats, preprocess
from sc_framework.preprocessing import _native
from sc_framework.specs import FeatureSpec, TableSpec
from sc_framework.stacking import auto_stack_tables
from tests.numerics import assert_same_bits

kernels = _native.host_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="the C++ preprocessing loops are not built")


def random_lengths(rng, samples, max_len, empty_rate=0.2):
  lengths = rng.integers(1, max_len + 1, samples)
  lengths[rng.random(samples) < empty_rate] = 0
  return lengths.astype(np.int64)


# --- each loop against numpy ----------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("span", [40, 2**27, 2**58])
@pytest.mark.parametrize("num_samples", [3, 300, 30_000])  # 30,000: several threads
def test_merge_samples_sorts_stably_and_merges_repeats(seed, weighted, span, num_samples):
  """Keys b * V_s + row, rows over [0, span) within a sample: spans 2^27 and 2^58
  take the 64-bit codes and std::stable_sort, samples over 32 keys std::sort."""
  rng = np.random.default_rng(seed)
  lengths = random_lengths(rng, num_samples, 70 if num_samples < 1000 else 12)
  samples = np.repeat(np.arange(num_samples), lengths)
  rows = rng.integers(0, 40, samples.size) * (span // 40)  # 40 values: many repeats
  v_s = 40 * (span // 40) if span < 2**40 else 0  # 0: keys = rows, no int64 overflow
  keys = samples * v_s + rows
  weights = rng.uniform(-2, 2, keys.size).astype(np.float32) if weighted else None
  order = np.lexsort((np.arange(keys.size), keys, samples))
  sorted_keys = keys[order]
  repeat = np.zeros(keys.size, np.bool_)
  repeat[1:] = (sorted_keys[1:] == sorted_keys[:-1]) & (samples[order][1:] == samples[order][:-1])
  got_keys, got_weights = keys.copy(), None if weights is None else weights.copy()
  found, entry_samples = np.empty(keys.size, np.int64), np.empty(keys.size, np.int32)
  count = kernels.merge_samples(got_keys, got_weights, lengths, found, v_s, entry_samples)
  assert_same_bits(found[:count], np.flatnonzero(repeat))
  entries = keys.size - count
  assert_same_bits(got_keys[:entries], rows[order][~repeat])
  assert_same_bits(entry_samples[:entries], samples[order][~repeat].astype(np.int32))
  if weighted:
    assert_same_bits(got_weights, weights[order])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("size", [0, 1, 13, 1000, 200_000])  # 200,000: several threads
def test_rank_rows_are_np_unique_with_inverse(seed, size):
  rng = np.random.default_rng(seed)
  vocab = int(rng.integers(1, 3 * size + 200))
  rows = rng.integers(0, vocab, size)
  rows[:2] = [vocab - 1, 0][:size]  # both ends of the map
  words = np.full(-(-vocab // 64) + 3, 0xDEADBEEF, np.uint64)  # stale content is fine
  distinct = np.full(size, -7, np.int64)
  ranks = np.full(size, -7, np.int32)
  count = kernels.rank_rows(rows, words, vocab, distinct, ranks)
  unique, inverse = np.unique(rows, return_inverse=True)
  assert_same_bits(distinct[:count], unique)
  assert_same_bits(ranks, inverse.astype(np.int32))


def reference_drop(ids, parts, unique_capacity, entry_capacity):
  """The overflow rules as a loop: (keep per entry, rows with a kept entry)."""
  first_rows, kept_entries = {}, {}
  keep, alive = [], set()
  for row, part in zip(ids.tolist(), parts.tolist()):
    rows = first_rows.setdefault(part, [])
    if row not in rows:
      rows.append(row)
    take = rows.index(row) < unique_capacity and kept_entries.get(part, 0) < entry_capacity
    kept_entries[part] = kept_entries.get(part, 0) + take
    keep.append(take)
    if take:
      alive.add(row)
  return np.array(keep, np.bool_), alive


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_parts", [1, 3])
def test_drop_entries_follow_the_overflow_rules(seed, num_parts):
  rng = np.random.default_rng(seed)
  size, rows_per_part = 400, int(rng.integers(1, 60))
  parts = np.sort(rng.integers(0, num_parts, size)) if seed % 2 else rng.integers(0, num_parts, size)
  ids = parts * rows_per_part + rng.integers(0, rows_per_part, size)  # rows numbered per part
  unique_capacity, entry_capacity = int(rng.integers(0, 40)), int(rng.integers(0, 200))
  keep = np.empty(size, np.bool_)
  alive = np.empty(num_parts * rows_per_part, np.bool_)
  count = kernels.drop_entries(ids, None if num_parts == 1 else parts, num_parts,
                               unique_capacity, entry_capacity, keep, alive)
  want_keep, want_alive = reference_drop(ids, parts, unique_capacity, entry_capacity)
  assert_same_bits(keep, want_keep)
  assert count == want_keep.sum()
  assert set(np.flatnonzero(alive).tolist()) == want_alive


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("num_parts,num_shards", [(1, 1), (4, 2), (6, 3)])
def test_kept_unique_index_ranks_the_alive_rows_per_partition(seed, num_parts, num_shards):
  rng = np.random.default_rng(seed)
  sizes = rng.integers(0, 50, num_parts)
  offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
  num_rows, unique_capacity = int(offsets[-1]), 64
  alive = rng.random(num_rows) < 0.6
  ids = rng.integers(0, max(num_rows, 1), 500 if num_rows else 0)
  keep = alive[ids] & (rng.random(ids.size) < 0.8)
  unique_of = np.empty(num_rows, np.int32)
  out = np.full(ids.size, -1, np.int32)
  counts = np.empty(num_parts, np.int64)
  count = kernels.kept_unique_index(ids, keep, alive, offsets, num_shards, unique_capacity,
                                    unique_of, out, counts)
  part = np.repeat(np.arange(num_parts), sizes)
  before = np.array([np.count_nonzero(alive[offsets[p]:j]) for p, j in zip(part, range(num_rows))])
  want = (part % num_shards * unique_capacity + before).astype(np.int32)
  assert_same_bits(unique_of, want)
  assert_same_bits(out[:count], want[ids[keep]])
  assert_same_bits(counts, np.array([np.count_nonzero(alive[offsets[p]:offsets[p + 1]])
                                    for p in range(num_parts)], np.int64))


@pytest.mark.parametrize("num_shards,rows_per_shard,offset,rotation",
                         [(1, 400, 0, 0), (1, 1000, 96, 0), (8, 50, 16, 4), (6, 70, 8, 5)])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_fill_keys_follows_the_layout_formula(num_shards, rows_per_shard, offset, rotation, dtype):
  rng = np.random.default_rng(num_shards + offset)
  lengths = random_lengths(rng, 500, 25)
  vocab = num_shards * rows_per_shard - offset * num_shards
  ids = rng.integers(0, vocab, int(lengths.sum())).astype(dtype)
  v_s, first = num_shards * rows_per_shard, 37
  keys = np.empty(ids.size, np.int64)
  samples = np.empty(ids.size, np.int32)
  kernels.fill_keys(keys, samples, ids, lengths, first, v_s, num_shards, rows_per_shard, offset,
                    rotation)
  b = first + np.repeat(np.arange(lengths.size), lengths)
  i = ids.astype(np.int64)
  row = ((i % num_shards + rotation) % num_shards) * rows_per_shard + i // num_shards + offset
  assert_same_bits(samples, b.astype(np.int32))
  assert_same_bits(keys, b * v_s + row)


def test_bad_arguments_raise_instead_of_crashing():
  keys, lengths = np.arange(10, dtype=np.int64), np.array([4, 6], np.int64)
  def merge(keys, lengths):
    n = keys.size
    return kernels.merge_samples(keys, None, lengths, np.empty(n, np.int64), 100,
                                 np.empty(n, np.int32))

  with pytest.raises(ValueError, match="keys: sum of lengths: expected 11, got 10"):
    merge(keys, np.array([5, 6], np.int64))
  with pytest.raises(ValueError, match=r"lengths\[1\] = -1 is negative"):
    merge(keys, np.array([11, -1], np.int64))
  with pytest.raises(TypeError, match="keys must be 1-D with 8-byte items"):
    merge(keys.astype(np.int32), lengths)
  with pytest.raises(TypeError, match="writable"):
    frozen = keys.copy()
    frozen.flags.writeable = False
    merge(frozen, lengths)
  with pytest.raises(ValueError, match=r"rows\[2\] = 9 is outside \[0, 5\)"):
    kernels.rank_rows(np.array([0, 1, 9]), np.zeros(1, np.uint64), 5, np.empty(3, np.int64),
                      np.empty(3, np.int32))
  with pytest.raises(ValueError, match=r"rows\[0\] = -1 is outside"):
    kernels.rank_rows(np.array([-1]), np.zeros(1, np.uint64), 5, np.empty(1, np.int64),
                      np.empty(1, np.int32))
  with pytest.raises(ValueError, match=r"words: at least \(size \+ 63\) / 64: expected 2, got 1"):
    kernels.rank_rows(np.array([0]), np.zeros(1, np.uint64), 65, np.empty(1, np.int64),
                      np.empty(1, np.int32))
  with pytest.raises(ValueError, match=r"ids\[1\] = 4 is outside \[0, 4\)"):
    kernels.drop_entries(np.array([0, 4]), None, 1, 1, 1, np.empty(2, np.bool_),
                         np.empty(4, np.bool_))
  with pytest.raises(ValueError, match=r"parts\[0\] = 2 is outside \[0, 2\)"):
    kernels.drop_entries(np.array([0, 1]), np.array([2, 0]), 2, 1, 1, np.empty(2, np.bool_),
                         np.empty(4, np.bool_))
  with pytest.raises(ValueError, match="rotation"):
    kernels.fill_keys(keys, np.empty(10, np.int32), keys, lengths, 0, 100, 4, 25, 0, 4)


# --- whole preprocess calls, with the loops and without -------------------------------


def run_both(monkeypatch, *args, **kwargs):
  """preprocess(*args, **kwargs) with the C++ loops, then with numpy alone."""
  results = []
  for loops in (kernels, None):
    with monkeypatch.context() as patch:
      patch.setattr(_native, "host_kernels", lambda loops=loops: loops)
      try:
        results.append(preprocess(*args, **kwargs))
      except (ValueError, TypeError) as error:
        results.append(error)
  return results


def assert_same_results(native, reference):
  if isinstance(reference, Exception):
    assert type(native) is type(reference) and str(native) == str(reference)
    return
  assert not isinstance(native, Exception), native
  (batches, stats), (want_batches, want_stats) = native, reference
  assert stats == want_stats
  assert batches.keys() == want_batches.keys()
  for name, batch in batches.items():
    for field, got, want in zip(batch._fields, batch, want_batches[name]):
      assert got.dtype == want.dtype, (name, field)
      assert_same_bits(got, want, err_msg=f"stack {name!r} field {field}")


@st.composite
def random_cases(draw):
  g_count = draw(st.sampled_from([1, 2, 4]))
  s_count = draw(st.sampled_from([1, 2, 3]))
  combiner = draw(st.sampled_from(["sum", "mean", "sqrtn"]))
  tables = [
      TableSpec(f"t{t}", draw(st.sampled_from([1, 7, 40, 300, 5000])), 8, combiner=combiner,
                max_ids_per_partition=4096, max_unique_ids_per_partition=4096)
      for t in range(draw(st.integers(1, 3)))
  ]
  specs = [
      FeatureSpec(f"f{f}", tables[draw(st.integers(0, len(tables) - 1))],
                  (g_count * draw(st.integers(1, 6)), None))
      for f in range(draw(st.integers(1, 4)))
  ]
  return dict(
      specs=specs, g_count=g_count, s_count=s_count,
      max_len=draw(st.sampled_from([1, 5, 40])),  # 40: samples past the rank sort's 32
      weighted=draw(st.booleans()),
      dtype=draw(st.sampled_from([np.int32, np.int64, np.uint16])),
      limits=draw(st.sampled_from([None, "tight"])),
      seed=draw(st.integers(0, 2**31)),
  )


def make_inputs(case, rng):
  inputs = {}
  for spec in case["specs"]:
    lengths = random_lengths(rng, spec.batch_size, case["max_len"])
    values = rng.integers(0, spec.table.vocabulary_size, int(lengths.sum()))
    weights = rng.uniform(0.25, 2.0, values.size) if case["weighted"] else None
    inputs[spec.name] = RaggedIds.from_lengths(values.astype(case["dtype"]), lengths, weights)
  return inputs


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(random_cases())
def test_preprocess_gives_the_same_bits_with_and_without_the_loops(monkeypatch, case):
  rng = np.random.default_rng(case["seed"])
  specs = case["specs"]
  layout = auto_stack_tables(specs, case["g_count"], case["s_count"])
  inputs = make_inputs(case, rng)
  capacities = None
  if case["limits"] == "tight":  # below the batch's needs: overflow
    stats = batch_stats(inputs, specs, layout)
    capacities = {
        name: StackCapacity(max(1, s.max_ids_per_partition * 2 // 3),
                            max(1, s.max_unique_ids_per_partition // 2))
        for name, s in stats.stacks.items()
    }
  for dropping in (False, True):
    native, reference = run_both(monkeypatch, inputs, specs, layout, capacities=capacities,
                                 allow_id_dropping=dropping)
    assert_same_results(native, reference)


@pytest.mark.parametrize("vocab,batch", [(100_000, 256), (5_000_000, 64)])
@pytest.mark.parametrize("seed", range(3))
def test_large_tables_same_bits(monkeypatch, vocab, batch, seed):
  """The bit-map path of the distinct rows and (5M rows, few ids) the sort path."""
  rng = np.random.default_rng(seed)
  tables = [TableSpec(f"t{k}", vocab, 8, combiner="sum") for k in range(3)]
  specs = [FeatureSpec(f"f{k}", tables[k], (batch, 20)) for k in range(3)]
  layout = auto_stack_tables(specs, 1, 1)
  inputs = make_inputs(dict(specs=specs, max_len=20, weighted=False, dtype=np.int64), rng)
  stats = batch_stats(inputs, specs, layout)
  fits = {n: s.required_capacity for n, s in stats.stacks.items()}
  native, reference = run_both(monkeypatch, inputs, specs, layout, capacities=fits)
  assert_same_results(native, reference)


def test_errors_name_the_feature_and_value_on_both_paths(monkeypatch):
  table = TableSpec("items", 100, 8, max_ids_per_partition=3, max_unique_ids_per_partition=2)
  specs = [FeatureSpec("clicks", table, (4, None))]
  layout = auto_stack_tables(specs, 1, 1)
  bad = {"clicks": RaggedIds.from_lengths(np.array([1, 2, 100, 3]), np.array([1, 1, 1, 1]))}
  native, reference = run_both(monkeypatch, bad, specs, layout)
  assert isinstance(reference, ValueError)
  assert "feature 'clicks' (table 'items', vocabulary_size=100) got id 100 at sample 2" in str(
      reference)
  assert_same_results(native, reference)
  full = {"clicks": RaggedIds.from_lengths(np.arange(8), np.array([2, 2, 2, 2]))}
  native, reference = run_both(monkeypatch, full, specs, layout)
  assert isinstance(reference, ValueError)
  assert "partition overflow in stack" in str(reference) and "8 ids" in str(reference)
  assert_same_results(native, reference)
  native, reference = run_both(monkeypatch, full, specs, layout, allow_id_dropping=True)
  assert reference[1].num_dropped_ids == 6
  assert_same_results(native, reference)
