"""The C++ preprocessing loops (`_host_kernels`) against numpy, bit for bit.

Two levels: each loop against a plain numpy statement of what it computes
(a stable lexsort, np.unique, fancy indexing, the documented row formula), on
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

from sc_framework.preprocessing import (
    DenseIds,
    RaggedIds,
    StackCapacity,
    batch_stats,
    preprocess,
)
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
@pytest.mark.parametrize("vocab_kind", ["any", "dense", "sparse"])
def test_rank_rows_are_np_unique_with_inverse(seed, size, vocab_kind):
  """dense: a map far smaller than the rows (marked on several threads); sparse: one far
  larger (marked on one, listed on several)."""
  rng = np.random.default_rng(seed)
  vocab = {"any": int(rng.integers(1, 3 * size + 200)), "dense": size // 300 + 1,
           "sparse": 40 * size + 1 + seed}[vocab_kind]
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
  first_rows, kept_entries = {}, {}  # part -> {row: its place in first-entry order}
  keep, alive = [], set()
  for row, part in zip(ids.tolist(), parts.tolist()):
    rows = first_rows.setdefault(part, {})
    place = rows.setdefault(row, len(rows))
    take = place < unique_capacity and kept_entries.get(part, 0) < entry_capacity
    kept_entries[part] = kept_entries.get(part, 0) + take
    keep.append(take)
    if take:
      alive.add(row)
  return np.array(keep, np.bool_), alive


def drop_device(unique_index, stride, edges, capacity, samples, weights, distinct):
  """kernels.drop_device on fresh, garbage-filled outputs: (count, outputs...)."""
  size, num_rows, n_count = unique_index.size, int(edges[-1]), edges.size - 1
  keep = np.full(size, 7, np.uint8).view(np.bool_)
  out_samples, out_index = np.full(size, -9, np.int32), np.full(size, -9, np.int32)
  out_weights = None if weights is None else np.full(size, np.nan, np.float32)
  out_distinct = np.full(num_rows, -9, np.int64)
  words = np.full(num_rows // 64 + 3, 0xDEADBEEF, np.uint64)  # stale content is fine
  counts, unique_counts = np.full(n_count, -9, np.int64), np.full(n_count, -9, np.int64)
  count = kernels.drop_device(unique_index, stride, edges, capacity.max_unique_ids_per_partition,
                              capacity.max_ids_per_partition, samples, weights, distinct, words,
                              keep, out_samples, out_weights, out_index, out_distinct, counts,
                              unique_counts)
  return count, keep, out_samples, out_weights, out_index, out_distinct, counts, unique_counts


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_count=st.integers(1, 4), size=st.integers(0, 400),
       max_rows=st.integers(1, 70), entries=st.integers(0, 200), rows=st.integers(0, 60),
       weighted=st.booleans(), extra_stride=st.integers(0, 5))
def test_drop_device_follows_the_overflow_rules(seed, n_count, size, max_rows, entries, rows,
                                                weighted, extra_stride):
  """Against the rules by a loop: the kept entries (compacted), their unique
  indices n * U + u' among the kept rows of their shard, and the kept rows.
  Limits from 0 (nothing kept) to above the batch (nothing dropped)."""
  rng = np.random.default_rng(seed)
  sizes = rng.integers(0, max_rows + 1, n_count)
  size = size if sizes.any() else 0
  edges = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
  stride = int(sizes.max(initial=0)) + extra_stride or 1
  distinct = np.sort(rng.choice(10 * int(edges[-1]) + 1, int(edges[-1]), replace=False))
  shards = rng.choice(np.flatnonzero(sizes), size) if sizes.any() else np.zeros(0, np.int64)
  u = np.array([rng.integers(0, sizes[n]) for n in shards], np.int64)
  unique_index = (shards * stride + u).astype(np.int32)
  samples = np.sort(rng.integers(0, 50, size)).astype(np.int32)
  weights = rng.uniform(-2, 2, size).astype(np.float32) if weighted else None
  capacity = StackCapacity(entries, rows)
  got = drop_device(unique_index, stride, edges, capacity, samples, weights, distinct)
  count, keep, out_samples, out_weights, out_index, out_distinct, counts, unique_counts = got

  numbered = edges[shards] + u  # the rows of all shards one after the other
  want_keep, alive = reference_drop(numbered, shards, rows, entries)
  assert_same_bits(keep, want_keep)
  assert count == want_keep.sum()
  assert_same_bits(out_samples[:count], samples[want_keep])
  if weighted:
    assert_same_bits(out_weights[:count], weights[want_keep])
  alive_rows = np.zeros(int(edges[-1]), np.bool_)
  alive_rows[list(alive)] = True
  shard_of = np.repeat(np.arange(n_count), sizes)
  before = np.array([np.count_nonzero(alive_rows[edges[n]:j]) for n, j in
                     zip(shard_of, range(int(edges[-1])))], np.int64)
  new_index = shard_of * rows + before
  assert_same_bits(out_index[:count], new_index[numbered[want_keep]].astype(np.int32))
  kept_rows = int(unique_counts.sum())
  assert_same_bits(out_distinct[:kept_rows], distinct[alive_rows])
  assert_same_bits(counts, np.bincount(shards[want_keep], minlength=n_count).astype(np.int64))
  assert_same_bits(unique_counts, np.array(
      [np.count_nonzero(alive_rows[edges[n]:edges[n + 1]]) for n in range(n_count)], np.int64))


@pytest.mark.parametrize("seed", range(3))
def test_drop_device_large_one_shard(seed):
  """Long runs copied as blocks, then entry by entry once a limit is near."""
  rng = np.random.default_rng(seed)
  size, num_rows = 50_000, 20_000
  rows = rng.integers(0, num_rows, size)
  distinct, unique_index = np.unique(rows, return_inverse=True)
  unique_index = unique_index.astype(np.int32)
  edges = np.array([0, distinct.size], np.int64)
  samples = np.sort(rng.integers(0, 5_000, size)).astype(np.int32)
  for entries, rows_cap in [(size, distinct.size), (size - 100, distinct.size - 300),
                            (30_000, distinct.size), (size, 9_000)]:
    capacity = StackCapacity(entries, rows_cap)
    count, keep, out_samples, _, out_index, out_distinct, counts, unique_counts = drop_device(
        unique_index, distinct.size, edges, capacity, samples, None, distinct)
    want_keep, alive = reference_drop(unique_index.astype(np.int64), np.zeros(size, np.int64),
                                      rows_cap, entries)
    assert_same_bits(keep, want_keep)
    assert_same_bits(out_samples[:count], samples[want_keep])
    alive_rows = np.zeros(distinct.size, np.bool_)
    alive_rows[list(alive)] = True
    rank = np.cumsum(alive_rows) - 1
    assert_same_bits(out_index[:count], rank[unique_index[want_keep]].astype(np.int32))
    assert_same_bits(out_distinct[:unique_counts[0]], distinct[alive_rows])
    assert counts[0] == count == want_keep.sum()


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_count=st.integers(1, 4), rows_per_shard=st.integers(1, 90),
       size=st.integers(0, 500), entries=st.integers(0, 300), rows=st.integers(0, 120),
       weighted=st.booleans(), shift=st.integers(0, 7))
def test_rank_kept_rows_is_drop_then_unique(seed, n_count, rows_per_shard, size, entries, rows,
                                            weighted, shift):
  """Against the rules by a loop and np.unique over the kept rows: the kept
  entries move `shift` places towards the front of the same buffers (as a
  later device's do), the statistics count every entry and row before dropping."""
  rng = np.random.default_rng(seed)
  v_s = n_count * rows_per_shard
  row_ids = rng.integers(0, v_s, size)
  samples = np.sort(rng.integers(0, 60, size)).astype(np.int32)
  weights = rng.uniform(-2, 2, size).astype(np.float32) if weighted else None
  row_buffer = np.concatenate([np.full(shift, -5), row_ids]).astype(np.int64)
  sample_buffer = np.concatenate([np.full(shift, -5), samples]).astype(np.int32)
  out_weights = None if weights is None else np.full(size, np.nan, np.float32)
  keep = np.full(size, 7, np.uint8).view(np.bool_)
  distinct = np.full(size, -9, np.int64)
  ranks = np.full(size, -9, np.int32)
  words = np.full(2 * (v_s // 64 + 1) + 2, 0xDEADBEEF, np.uint64)  # stale content is fine
  all_counts, unique_counts = np.full(n_count, -9, np.int64), np.full(n_count, -9, np.int64)
  kept, found = kernels.rank_kept_rows(
      row_buffer[shift:], row_buffer[:size], sample_buffer[shift:], sample_buffer[:size], weights,
      out_weights, words, v_s, rows_per_shard, rows, entries, keep, distinct, ranks, all_counts,
      unique_counts)

  shards = row_ids // rows_per_shard
  want_keep, _ = reference_drop(row_ids, shards, rows, entries)
  assert_same_bits(keep, want_keep)
  assert kept == want_keep.sum()
  assert_same_bits(row_buffer[:kept], row_ids[want_keep])
  assert_same_bits(sample_buffer[:kept], samples[want_keep])
  if weighted:
    assert_same_bits(out_weights[:kept], weights[want_keep])
  unique, inverse = np.unique(row_ids[want_keep], return_inverse=True)
  assert_same_bits(distinct[:found], unique)
  assert_same_bits(ranks[:kept], inverse.astype(np.int32))
  assert_same_bits(all_counts, np.bincount(shards, minlength=n_count).astype(np.int64))
  assert_same_bits(unique_counts, np.bincount(np.unique(row_ids) // rows_per_shard,
                                              minlength=n_count).astype(np.int64))


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


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("width", [1, 3, 20, 70])
@pytest.mark.parametrize("padding", [-1, 0, 7, int(np.iinfo(np.int64).min)])
def test_compact_padded_is_boolean_indexing(seed, dtype, width, padding):
  """values[:k] = ids[ids != padding] row by row, splits the cumulative counts;
  rows all padding, none padding, and a padding id that is a real id (0, 7)."""
  rng = np.random.default_rng(seed)
  rows = 300
  ids = rng.integers(-1, 12, (rows, width)).astype(dtype)
  ids[rng.random((rows, width)) < 0.4] = padding if dtype == np.int64 or padding > -2**31 else -1
  ids[5] = padding if padding > -2**31 or dtype == np.int64 else ids[5]
  ids[6] = 3  # no padding at all
  keep = ids != padding
  values = np.full(ids.size, 99, dtype)
  splits = np.empty(rows + 1, np.int64)
  kept = kernels.compact_padded(ids.reshape(-1), width, padding, values, splits)
  assert kept == int(keep.sum())
  assert_same_bits(values[:kept], ids[keep])
  assert_same_bits(splits, np.concatenate([[0], np.cumsum(keep.sum(axis=1))]).astype(np.int64))


def test_bad_arguments_raise_instead_of_crashing():
  ids = np.arange(12, dtype=np.int32)
  with pytest.raises(ValueError, match="width must be >= 1 and divide the 12 ids, got 5"):
    kernels.compact_padded(ids, 5, -1, np.empty(12, np.int32), np.empty(3, np.int64))
  with pytest.raises(ValueError, match=r"values: at least: expected 12, got 11"):
    kernels.compact_padded(ids, 4, -1, np.empty(11, np.int32), np.empty(4, np.int64))
  with pytest.raises(ValueError, match=r"splits: rows \+ 1: expected 4, got 3"):
    kernels.compact_padded(ids, 4, -1, np.empty(12, np.int32), np.empty(3, np.int64))
  with pytest.raises(TypeError, match="values must be 1-D with 4-byte items"):
    kernels.compact_padded(ids, 4, -1, np.empty(12, np.int64), np.empty(4, np.int64))
  with pytest.raises(TypeError, match="ids must be int32 or int64"):
    kernels.compact_padded(ids.astype(np.int16), 4, -1, np.empty(12, np.int16),
                           np.empty(4, np.int64))
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
  many = np.zeros(300_000, np.int64)  # marked on several threads: the first one outside
  many[[200_001, 250_000]] = [70, 5]
  with pytest.raises(ValueError, match=r"rows\[200001\] = 70 is outside \[0, 5\)"):
    kernels.rank_rows(many, np.zeros(1, np.uint64), 5, np.empty(many.size, np.int64),
                      np.empty(many.size, np.int32))
  with pytest.raises(ValueError, match=r"words: at least \(size \+ 63\) / 64: expected 2, got 1"):
    kernels.rank_rows(np.array([0]), np.zeros(1, np.uint64), 65, np.empty(1, np.int64),
                      np.empty(1, np.int32))
  edges = np.array([0, 3, 5], np.int64)
  with pytest.raises(ValueError, match=r"unique_index\[1\] = 9 names no row of edges"):
    drop_device(np.array([0, 9], np.int32), 4, edges, StackCapacity(1, 1),
                np.zeros(2, np.int32), None, np.arange(5))
  with pytest.raises(ValueError, match=r"unique_index\[0\] = 7 names no row"):  # shard 1, u 3
    drop_device(np.array([7], np.int32), 4, edges, StackCapacity(1, 1), np.zeros(1, np.int32),
                None, np.arange(5))
  with pytest.raises(ValueError, match="edges must rise from 0 by at most stride = 2"):
    drop_device(np.array([0], np.int32), 2, edges, StackCapacity(1, 1), np.zeros(1, np.int32),
                None, np.arange(5))
  with pytest.raises(ValueError, match="distinct: edges"):
    drop_device(np.array([0], np.int32), 4, edges, StackCapacity(1, 1), np.zeros(1, np.int32),
                None, np.arange(4))
  with pytest.raises(ValueError, match=r"rows\[1\] = 8 is outside \[0, 8\)"):
    rows, samples, counts = np.array([0, 8]), np.zeros(2, np.int32), np.empty(2, np.int64)
    kernels.rank_kept_rows(rows, rows, samples, samples, None, None, np.zeros(4, np.uint64), 8, 4,
                           1, 1, np.empty(2, np.bool_), np.empty(2, np.int64),
                           np.empty(2, np.int32), counts, counts.copy())
  with pytest.raises(ValueError, match="holding the size rows"):  # 2 shards of 4 < 9 rows
    kernels.rank_kept_rows(rows, rows, samples, samples, None, None, np.zeros(4, np.uint64), 9, 4,
                           1, 1, np.empty(2, np.bool_), np.empty(2, np.int64),
                           np.empty(2, np.int32), counts, counts.copy())
  with pytest.raises(ValueError, match="weights and out_weights"):
    kernels.rank_kept_rows(rows, rows, samples, samples, np.ones(2, np.float32), None,
                           np.zeros(4, np.uint64), 8, 4, 1, 1, np.empty(2, np.bool_),
                           np.empty(2, np.int64), np.empty(2, np.int32), counts, counts.copy())
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
      dense=draw(st.booleans()),  # dense [B, L] ids padded with -1 (signed dtypes)
      limits=draw(st.sampled_from([None, "tight"])),
      seed=draw(st.integers(0, 2**31)),
  )


def make_inputs(case, rng):
  inputs = {}
  for spec in case["specs"]:
    lengths = random_lengths(rng, spec.batch_size, case["max_len"])
    values = rng.integers(0, spec.table.vocabulary_size, int(lengths.sum()))
    weights = rng.uniform(0.25, 2.0, values.size) if case["weighted"] else None
    if case.get("dense") and np.dtype(case["dtype"]).kind == "i":
      inputs[spec.name] = _padded(values.astype(case["dtype"]), lengths, weights)
    else:
      inputs[spec.name] = RaggedIds.from_lengths(values.astype(case["dtype"]), lengths, weights)
  return inputs


def _padded(values, lengths, weights):
  """Dense [B, max length] ids padded with -1 (DenseIds with weights padded with 0)."""
  width = max(1, int(lengths.max(initial=0)))
  place = np.arange(width) < lengths[:, None]
  ids = np.full((lengths.size, width), -1, values.dtype)
  ids[place] = values
  if weights is None:
    return ids
  dense_weights = np.zeros(ids.shape)
  dense_weights[place] = weights
  return DenseIds(ids, dense_weights)


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
    stats = batch_stats(inputs, specs, layout, padding_id=-1)
    capacities = {
        name: StackCapacity(max(1, s.max_ids_per_partition * 2 // 3),
                            max(1, s.max_unique_ids_per_partition // 2))
        for name, s in stats.stacks.items()
    }
  for dropping in (False, True):
    native, reference = run_both(monkeypatch, inputs, specs, layout, capacities=capacities,
                                 allow_id_dropping=dropping, padding_id=-1)
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
  # Both limits cut: with 100,000 rows one C++ pass per device drops and ranks
  # (`rank_kept_rows`), with 5M rows the ranks come from a sort (`drop_device`).
  tight = {n: StackCapacity(c.max_ids_per_partition * 9 // 10,
                            c.max_unique_ids_per_partition * 8 // 10) for n, c in fits.items()}
  for capacities in (fits, tight):
    native, reference = run_both(monkeypatch, inputs, specs, layout, capacities=capacities,
                                 allow_id_dropping=True)
    assert_same_results(native, reference)
  assert reference[1].num_dropped_ids > 0


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
