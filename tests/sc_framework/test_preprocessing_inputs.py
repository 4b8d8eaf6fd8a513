"""Preprocessing fed what real input pipelines produce, checked by a dense oracle.

Ids of every integer dtype and memory layout, ids beyond int32 on a table of
2^32 rows, ragged rows from Python lists and tokenizers, narrow length dtypes,
COO inputs with huge dense shapes, weights of other dtypes and ranges, and
preprocessing from several threads at once. Each batch's buffers are looked up
through a table whose rows are computed on demand (so a table of 2^32 rows
costs nothing) and compared with the dense sum over the ids each sample owns.
Every test runs with the C++ preprocessing loops (where built) and with numpy.
"""

from __future__ import annotations

import math
import re
import tracemalloc
import zlib
from concurrent.futures import ThreadPoolExecutor

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sc_framework.preprocessing import (
    DenseIds,
    PartitionOverflowError,
    RaggedIds,
    RaggedRows,
    SparseIds,
    batch_stats,
    collect_stats,
    flatten_input,
    preprocess,
    size_limits_from_stats,
)
from sc_framework.specs import FeatureSpec, TableSpec
from sc_framework.stacking import auto_stack_tables, stack_tables
from test_preprocessing import preprocessing_loops  # noqa: F401 - autouse: C++ loops, numpy
from tests.numerics import assert_close, assert_same_bits


# --- the oracle -----------------------------------------------------------------


def table_rows(name: str, ids, dim: int, seed: int) -> np.ndarray:
  """float64 [n, dim]: rows `ids` of a random table without zeros, made on demand.

  Entries are +-[0.5, 1.5), from a hash of (table, seed, id, column).
  """
  salt = np.uint64(zlib.crc32(f"{name}/{seed}".encode()) * 2 + 1)
  with np.errstate(over="ignore"):
    h = np.asarray(ids, np.uint64)[:, None] * np.uint64(0x9E3779B97F4A7C15)
    h = h + (np.arange(dim, dtype=np.uint64) + np.uint64(1)) * salt
    h ^= h >> np.uint64(31)
    h *= np.uint64(0xBF58476D1CE4E5B9)
    h ^= h >> np.uint64(29)
  unit = (h >> np.uint64(11)).astype(np.float64) / 2.0**53
  sign = np.where((h & np.uint64(1)) == 1, -1.0, 1.0)
  return (0.5 + unit) * sign


def logical_rows(layout, stack, shard: int, local: np.ndarray):
  """(table name, logical id) of local rows of `shard`, by the documented layout formulas."""
  n_count, s_count = layout.num_shards, layout.shards_per_device
  offset = 0
  out = [None] * local.size
  for k, table in enumerate(stack.tables):
    padded = -(-table.vocabulary_size // (8 * n_count)) * 8 * n_count
    rotation = (k * s_count) % n_count
    inside = (local >= offset) & (local < offset + padded // n_count)
    for j in np.flatnonzero(inside):
      i = (int(local[j]) - offset) * n_count + (shard - rotation) % n_count
      assert i < table.vocabulary_size, "a padding row was requested"
      out[j] = (table.name, i)
    offset += padded // n_count
  assert all(x is not None for x in out)
  return out


def looked_up(layout, specs, batches, seed: int) -> dict[str, np.ndarray]:
  """Every feature's activations [B, D] ([B, L, D] for a sequence) through the buffers."""
  by_name = {spec.name: spec for spec in specs}
  result = {}
  g_count = layout.num_devices
  for stack in layout.stacks:
    batch = batches[stack.name]
    local_batch = stack.total_batch_size // g_count
    _, n_count, u_cap = batch.unique_rows.shape
    dims = {t.name: t.embedding_dim for t in stack.tables}
    out = np.zeros((g_count, local_batch, stack.padded_embedding_dim))
    for g in range(g_count):
      rows = np.zeros((n_count * u_cap, stack.padded_embedding_dim))
      for n in range(n_count):
        unique = batch.unique_rows[g, n]
        used = unique[unique >= 0]
        for u, (name, i) in enumerate(logical_rows(layout, stack, n, used)):
          rows[n * u_cap + u, :dims[name]] = table_rows(name, [i], dims[name], seed)[0]
      real = batch.entry_samples[g] < local_batch
      np.add.at(out[g], batch.entry_samples[g, real],
                batch.entry_gains[g, real, None] * rows[batch.entry_unique_index[g, real]])
    for feature in stack.features:
      spec = by_name[feature.name]
      per_device = feature.batch_size // g_count
      start = feature.sample_offset // g_count
      block = out[:, start:start + per_device, :spec.table.embedding_dim]
      result[feature.name] = block.reshape(spec.output_shape)
  return result


def expected(specs, samples_by_feature, seed: int) -> dict[str, np.ndarray]:
  """Dense activations from per-sample lists of (id, weight) (positions for sequences)."""
  result = {}
  for spec in specs:
    table, dim = spec.table, spec.table.embedding_dim
    out = np.zeros(spec.output_shape)
    for b, pairs in enumerate(samples_by_feature[spec.name]):
      if not pairs:
        continue
      ids = [i for i, _ in pairs]
      w = np.array([w for _, w in pairs])
      rows = table_rows(table.name, ids, dim, seed)
      if spec.sequence_length is not None:
        out[b, :len(pairs)] = w[:, None] * rows
        continue
      factor = {"sum": 1.0, "mean": 1 / w.sum(), "sqrtn": 1 / math.sqrt((w * w).sum())}
      out[b] = (w[:, None] * rows).sum(0) * factor[table.combiner]
    result[spec.name] = out
  return result


def check(layout, specs, batches, samples_by_feature, max_ids: int):
  for seed in (0, 1):
    want = expected(specs, samples_by_feature, seed)
    got = looked_up(layout, specs, batches, seed)
    for name in want:
      assert_close(got[name], want[name], terms=max_ids, err_msg=f"feature {name} seed {seed}")


def random_samples(rng, batch: int, vocab: int, max_len: int, low: int = 0,
                   weighted: bool = False):
  """Per-sample lists of (id, weight): repeated ids and empty samples included."""
  samples = []
  for _ in range(batch):
    length = int(rng.integers(0, max_len + 1))
    ids = rng.integers(low, vocab, length)
    if length > 1:
      ids[-1] = ids[0]  # a repeated id
    w = rng.uniform(0.25, 2.0, length) if weighted else np.ones(length)
    samples.append([(int(i), float(x)) for i, x in zip(ids, w)])
  return samples


def ragged(samples, dtype=np.int64, weighted=False) -> RaggedIds:
  lengths = [len(p) for p in samples]
  values = np.array([i for p in samples for i, _ in p], dtype)
  w = np.array([x for p in samples for _, x in p], np.float32) if weighted else None
  return RaggedIds.from_lengths(values, lengths, w)


def dense(samples, width: int, padding: int, dtype=np.int64) -> np.ndarray:
  out = np.full((len(samples), width), padding, dtype)
  for b, pairs in enumerate(samples):
    out[b, :len(pairs)] = [i for i, _ in pairs]
  return out


# --- ids of every integer dtype and memory layout ---------------------------------------


def small_model(num_devices: int, combiner: str = "mean"):
  users = TableSpec("users", 120, 8, combiner=combiner)
  tags = TableSpec("tags", 70, 4, combiner="sqrtn")
  specs = [FeatureSpec("user", users, (8, 5)), FeatureSpec("tag", tags, (8, None))]
  return specs, auto_stack_tables(specs, num_devices)


def memory_layouts(array: np.ndarray, tmp_path) -> dict[str, np.ndarray]:
  read_only = array.copy()
  read_only.setflags(write=False)
  wide = np.zeros((array.shape[0], 2 * array.shape[1]), array.dtype)
  wide[:, ::2] = array
  path = tmp_path / "ids.npy"
  np.save(path, array)
  return {
      "c": np.ascontiguousarray(array),
      "fortran": np.asfortranarray(array),
      "strided": wide[:, ::2],
      "reversed": array[::-1].copy()[::-1],
      "read_only": read_only,
      "memmap": np.load(path, mmap_mode="r"),
      "big_endian": array.astype(array.dtype.newbyteorder(">")),
  }


@pytest.mark.parametrize("num_devices", [1, 8])
@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32,
                                   np.int64, np.uint64])
def test_ids_of_every_integer_dtype_and_memory_layout(dtype, num_devices, tmp_path):
  """Every integer dtype and array layout gives the buffers of C-ordered int64 ids."""
  specs, layout = small_model(num_devices)
  rng = np.random.default_rng(num_devices)
  samples = {s.name: random_samples(rng, 8, s.table.vocabulary_size, 5) for s in specs}
  padding = 127  # not an id of 'users', and held by every dtype (unsigned ones have no -1)
  base = {"tag": ragged(samples["tag"])}
  want, _ = preprocess({**base, "user": dense(samples["user"], 7, padding)}, specs, layout,
                       padding_id={"user": padding})
  check(layout, specs, want, samples, max_ids=5)
  ids = dense(samples["user"], 7, padding, dtype)
  for name, array in memory_layouts(ids, tmp_path).items():
    got, _ = preprocess({**base, "user": array}, specs, layout, padding_id={"user": padding})
    for stack in want:
      for field, a, b in zip(want[stack]._fields, got[stack], want[stack]):
        assert_same_bits(a, b, err_msg=f"{name} {field}")
  # The ragged form takes every dtype too.
  got, _ = preprocess({"user": ragged(samples["user"], dtype), "tag": ragged(samples["tag"])},
                      specs, layout)
  for stack in want:
    for a, b in zip(got[stack], want[stack]):
      assert_same_bits(a, b)


@pytest.mark.parametrize("dtype", [np.uint32, np.uint64])
def test_unsigned_ids_whose_padding_was_minus_1(dtype):
  """Padded int64 ids cast to an unsigned dtype: -1 became the dtype's largest value."""
  specs, layout = small_model(2)
  rng = np.random.default_rng(9)
  samples = {s.name: random_samples(rng, 8, s.table.vocabulary_size, 5) for s in specs}
  ids = dense(samples["user"], 5, -1)
  assert (ids == -1).any()
  inputs = {"tag": ragged(samples["tag"]), "user": ids.astype(dtype)}
  largest = int(np.iinfo(dtype).max)
  with pytest.raises(ValueError, match=rf"got id {largest} at sample \d+; ids must be in"
                                       rf" \[0, 120\). It is -1 in {np.dtype(dtype)} \(the ids'"
                                       rf" dtype\): if it marks unused places, pass"
                                       rf" padding_id={largest}"):
    preprocess(inputs, specs, layout, padding_id={"user": -1})
  got, _ = preprocess(inputs, specs, layout, padding_id={"user": largest})
  want, _ = preprocess({**inputs, "user": ids}, specs, layout, padding_id={"user": -1})
  for name in want:
    for a, b in zip(got[name], want[name]):
      assert_same_bits(a, b)
  check(layout, specs, got, samples, max_ids=5)


@pytest.mark.parametrize("groups,num_devices,shards", [
    ([["big"], ["small"]], 4, 1), ([["big"], ["small"]], 4, 2), ([["small", "big"]], 8, 1)])
@pytest.mark.parametrize("dtype", [np.int64, np.uint64, np.uint32])
def test_ids_beyond_int32_on_a_table_of_2_to_the_32_rows(dtype, groups, num_devices, shards):
  big = TableSpec("big", 2**32, 8, combiner="mean")
  small = TableSpec("small", 1000, 8, combiner="mean")
  specs = [FeatureSpec("b", big, (8, None)), FeatureSpec("s", small, (8, None))]
  layout = stack_tables(specs, groups, num_devices, shards)
  rng = np.random.default_rng(3)
  samples = {"b": random_samples(rng, 8, 2**32, 6, low=2**31 - 100, weighted=True),
             "s": random_samples(rng, 8, 1000, 6, weighted=True)}
  inputs = {"b": ragged(samples["b"], dtype, weighted=True),
            "s": ragged(samples["s"], weighted=True)}
  # Weights as the reference reads them: rounded to float32 first.
  samples = {n: [[(i, float(np.float32(w))) for i, w in p] for p in s]
             for n, s in samples.items()}
  batches, _ = preprocess(inputs, specs, layout)
  check(layout, specs, batches, samples, max_ids=6)


# --- ragged inputs ------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.uint16, np.int32])
def test_from_lengths_of_narrow_integer_dtypes(dtype):
  """Lengths of a narrow dtype whose sum it cannot hold: the row splits wrapped around."""
  table = TableSpec("t", 500, 8, combiner="mean")
  specs = [FeatureSpec("f", table, (4096, None))]
  layout = auto_stack_tables(specs, 8)
  rng = np.random.default_rng(4)
  samples = random_samples(rng, 4096, 500, 40)  # about 80,000 ids, beyond 16 bits
  lengths = np.array([len(p) for p in samples], dtype)
  values = np.array([i for p in samples for i, _ in p])
  batches, _ = preprocess({"f": RaggedIds.from_lengths(values, lengths)}, specs, layout,
                          capacities={"t": (4096, 512)})
  check(layout, specs, batches, {"f": samples}, max_ids=40)


def test_a_negative_length_names_its_sample():
  table = TableSpec("t", 50, 8)
  spec = FeatureSpec("f", table, (4, None))
  with pytest.raises(ValueError, match=r"feature 'f': row_splits must be non-decreasing, but"
                                       r" sample 1 has row_splits\[1\] = 2 > row_splits\[2\] ="
                                       r" 1 \(length -1\)"):
    flatten_input(RaggedIds.from_lengths([1, 2, 3], [2, -1, 1, 1]), spec)
  with pytest.raises(ValueError, match=r"lengths of RaggedIds.from_lengths\) must be a non-empty"
                                       r" 1-D integer array, got shape \(5,\) and dtype float64"):
    flatten_input(RaggedIds.from_lengths([1, 2, 3], [1.0, 1, 0, 1]), spec)


def test_rows_of_mixed_integer_dtypes():
  """uint64 hashed ids next to rows of Python ints: numpy's concatenation gives float64."""
  table = TableSpec("t", 2**60, 8)
  spec = FeatureSpec("f", table, (4, None))
  big = 2**53 + 1  # float64 would round it
  rows = [np.array([big, 7], np.uint64), [], [3, big], np.array([5], np.int32)]
  flat = flatten_input(rows, spec)
  assert flat.values.tolist() == [big, 7, 3, big, 5]
  assert flat.row_splits.tolist() == [0, 2, 2, 4, 5]
  with pytest.raises(ValueError, match=r"feature 'f': sample 0 has id 18446744073709551615,"
                                       r" beyond every vocabulary"):
    flatten_input([np.array([2**64 - 1], np.uint64), [1], [], []], spec)


@pytest.mark.parametrize("rows,error,message", [
    # A tokenizer's [1, L] array per sample.
    ([np.array([[1, 2]]), np.array([[3]]), [], [4]], ValueError,
     r"the ids of sample 0 have shape \(1, 2\); a ragged batch holds one 1-D sequence"),
    # (2, 0) and (1, 2) rows: the lengths add up, so the ids went to other samples.
    ([np.zeros((2, 0), np.int64), np.array([[5, 6]]), np.array([[7, 8]]), []], ValueError,
     r"the ids of sample 0 have shape \(2, 0\)"),
    # One id per sample as a list: a list is read as per-sample sequences.
    ([1, 2, 3, 4], TypeError,
     r"sample 0 of the ragged ids is 1 \(int\), not a sequence.*np.asarray\(ids\)"),
    ([[1, 2], [True, False], [], [3]], TypeError,
     r"ids must be integers, but sample 1 holds bool values \[True, False\]"),
    ([[1, 2], [3.0], [], [3]], TypeError, r"sample 1 holds float64 values \[3.0\]"),
])
def test_ragged_rows_that_are_not_integer_sequences_are_refused(rows, error, message):
  spec = FeatureSpec("f", TableSpec("t", 50, 8), (4, None))
  with pytest.raises(error, match=r"feature 'f': .*" + message):
    flatten_input(rows, spec)


def test_object_rows_of_python_ints_are_ids():
  spec = FeatureSpec("f", TableSpec("t", 50, 8), (3, None))
  rows = np.array([[1, 2], [3, 4], [5, 6]], dtype=object)
  flat = flatten_input(rows, spec)
  assert flat.values.tolist() == [1, 2, 3, 4, 5, 6] and flat.row_splits.tolist() == [0, 2, 4, 6]


@pytest.mark.parametrize("weights,error,message", [
    # Were cast per sample to float32: imaginary parts, strings and bools went through.
    ([np.array([1 + 2j, 1]), np.array([1.0])], TypeError, "got dtype complex128"),
    ([["1", "2"], ["3"]], TypeError, "got dtype <U1"),
    ([np.array([True, False]), np.array([True])], TypeError, "got dtype bool"),
    ([[None, 1.0], [1.0]], TypeError, "got dtype object"),
    ([1.0, 2.0], TypeError, r"sample 0 of the ragged weights is 1.0 \(float\), not a sequence"),
    ([[1.0, 2.0], [[3.0]]], ValueError, r"the weights of sample 1 have shape \(1, 1\)"),
])
def test_ragged_row_weights_are_checked_like_the_other_forms(weights, error, message):
  spec = FeatureSpec("f", TableSpec("t", 50, 8, combiner="mean"), (2, None))
  with pytest.raises(error, match=r"feature 'f'.*" + message):
    flatten_input(RaggedRows([[1, 2], [3]], weights), spec)


def test_ragged_weights_for_dense_ids_name_the_feature():
  spec = FeatureSpec("f", TableSpec("t", 50, 8), (2, None))
  with pytest.raises(ValueError, match=r"feature 'f': weights must be an array of the ids' shape"
                                       r" \(2, 2\)"):
    flatten_input(DenseIds(np.array([[1, -1], [2, 3]]), [[1.0], [2.0, 3.0]]), spec, padding_id=-1)


def _masked(data, masked=(0,)):
  array = np.ma.masked_array(data)
  array[masked] = np.ma.masked
  return array


_DENSE = np.array([[1, 2], [3, 4]])
_MASK_CASES = {
    "dense ids": (lambda: _masked(_DENSE), "the ids"),
    "dense ids, nothing masked": (lambda: np.ma.masked_array(_DENSE, mask=False), "the ids"),
    "ids of one per sample": (lambda: _masked(np.array([1, 2])), "the ids"),
    "dense weights": (lambda: DenseIds(_DENSE, _masked(np.ones((2, 2)))), "the weights"),
    "rows, one masked": (lambda: [np.array([1, 2]), _masked(np.array([3, 4]))], "sample 1's ids"),
    "object array of rows": (lambda: np.array([_masked(np.array([1, 2])), np.array([3])],
                                              dtype=object), "sample 0's ids"),
    "masked rows": (lambda: RaggedRows(_masked(_DENSE)), "the ids"),
    "row weights": (lambda: RaggedRows([[1, 2], [3]], [[1.0, 2.0], _masked(np.array([3.0]))]),
                    "sample 1's weights"),
    "ragged values": (lambda: RaggedIds(_masked(np.array([1, 2, 3])), [0, 2, 3]), "the ids"),
    "row_splits": (lambda: RaggedIds([1, 2, 3], _masked(np.array([0, 2, 3]), 1)),
                   "the row_splits"),
    "ragged weights": (lambda: RaggedIds([1, 2, 3], [0, 2, 3], _masked(np.ones(3))),
                       "the weights"),
    "COO ids": (lambda: SparseIds([[0, 0], [1, 0]], _masked(np.array([1, 2])), (2, 2)),
                "the ids"),
    "COO indices": (lambda: SparseIds(_masked(np.array([[0, 0], [1, 0]])), [1, 2], (2, 2)),
                    "the COO indices"),
    "COO weights": (lambda: SparseIds([[0, 0], [1, 0]], [1, 2], (2, 2), _masked(np.ones(2))),
                    "the weights"),
    "dense_shape": (lambda: SparseIds([[0, 0], [1, 0]], [1, 2], _masked(np.array([2, 2]), 1)),
                    "the dense_shape"),
}


@pytest.mark.parametrize("sequence", [False, True])
@pytest.mark.parametrize("case", list(_MASK_CASES))
def test_masked_arrays_are_refused_not_read_without_their_mask(case, sequence):
  """np.asarray drops a mask: the masked entries would be used as ids or weights."""
  make, what = _MASK_CASES[case]
  spec = FeatureSpec("f", TableSpec("t", 50, 8, combiner="mean"), (2, 2),
                     (2, 2, 8) if sequence else (2, 8))
  with pytest.raises(TypeError, match=rf"feature 'f': {what} are a numpy masked array"
                                      r" \(np.ma.MaskedArray\).*Pass plain arrays"):
    flatten_input(make(), spec)


def test_masked_lengths_are_refused():
  with pytest.raises(TypeError, match=r"RaggedIds.from_lengths: the lengths are a numpy masked"):
    RaggedIds.from_lengths([1, 2, 3], _masked(np.array([2, 1]), 1))


# --- COO ----------------------------------------------------------------------


@pytest.mark.parametrize("width", [5, 2**40, 2**62, 2**63, 2**64 - 1])
def test_coo_with_a_huge_dense_shape(width):
  """dense_shape (B, 2^62) for "any length": the (sample, position) keys overflowed int64."""
  table = TableSpec("t", 100, 8)
  specs = [FeatureSpec("f", table, (4, None))]
  layout = auto_stack_tables(specs, 2)
  indices = np.array([[3, 0], [0, 0], [1, 4], [2, 1], [1, 2]], np.uint64)
  coo = SparseIds(indices, np.array([30, 0, 14, 20, 12]), np.array([4, width], np.uint64))
  flat = flatten_input(coo, specs[0])
  assert flat.values.tolist() == [0, 12, 14, 20, 30]
  assert flat.row_splits.tolist() == [0, 1, 3, 4, 5]
  batches, _ = preprocess({"f": coo}, specs, layout)
  check(layout, specs, batches, {"f": [[(0, 1.0)], [(12, 1.0), (14, 1.0)], [(20, 1.0)],
                                       [(30, 1.0)]]}, max_ids=2)
  twice = SparseIds(np.array([[1, 2**40], [0, 0], [1, 2**40]]), np.array([1, 2, 3]), (4, width))
  if width > 2**40:
    with pytest.raises(ValueError, match=r"COO index \[1, 1099511627776\] appears more than once"
                                         r" \(entries 0 and 2\)"):
      flatten_input(twice, specs[0])


def test_coo_of_a_wrong_batch_size_is_refused_before_its_arrays_are_made():
  """dense_shape (2^26, 1) for a batch of 4: [2^26 + 1] arrays were built, then refused."""
  spec = FeatureSpec("f", TableSpec("t", 100, 8), (4, None))
  coo = SparseIds([[0, 0], [1, 0]], [1, 2], (2**26, 1))
  tracemalloc.start()
  try:
    with pytest.raises(ValueError, match=r"feature 'f': got a batch of 67108864 samples but its"
                                         r" FeatureSpec has batch size 4"):
      flatten_input(coo, spec)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  assert peak < 2**20, f"{peak} bytes allocated"


@pytest.mark.parametrize("dense_shape", [(8.9, 3.7), (4, 3.5), "4,3", None, (4, float("nan")),
                                         (4, -3), (4, 3, 2), (), (True, 3)])
def test_a_dense_shape_that_is_no_shape_is_refused_not_truncated(dense_shape):
  spec = FeatureSpec("f", TableSpec("t", 100, 8), (4, 3))
  coo = SparseIds([[0, 0], [3, 2]], [1, 2], dense_shape)
  with pytest.raises(ValueError, match=r"feature 'f': dense_shape must be \(B, L\) \(or \(B,\)\)"
                                       r" of non-negative integers, got"):
    flatten_input(coo, spec)


class _IndexScalar:
  """Another library's integer scalar (a torch or tf scalar tensor): an int by __index__."""

  def __init__(self, value):
    self.value = value

  def __index__(self):
    return self.value


@pytest.mark.parametrize("dense_shape", [
    (4, 3), [4, 3], np.array([4, 3]), np.array([4, 3], np.uint64), np.array([[4, 3]]),
    (np.int64(4), np.uint64(3)), (np.array(4), np.array(3)), (4.0, 3.0),
    (jnp.int32(4), jnp.int32(3)), tuple(jnp.array([4, 3])), jnp.array([4, 3]),
    (_IndexScalar(4), _IndexScalar(3))])
def test_dense_shapes_of_every_integer_form_are_read(dense_shape):
  spec = FeatureSpec("f", TableSpec("t", 100, 8), (4, 3))
  flat = flatten_input(SparseIds([[0, 0], [3, 2]], [1, 2], dense_shape), spec)
  assert flat.values.tolist() == [1, 2] and flat.row_splits.tolist() == [0, 1, 1, 1, 2]


@pytest.mark.parametrize("ids, named", [(None, "NoneType None"), ("abc", "str 'abc'"),
                                        ({"a": 1}, "dict {'a': 1}"), (b"1", "bytes b'1'")])
def test_ids_that_are_no_ids_are_named_by_type(ids, named):
  spec = FeatureSpec("f", TableSpec("t", 100, 8), (4, 3))
  with pytest.raises(TypeError, match=rf"feature 'f': got {re.escape(named)} as its ids; pass an"):
    flatten_input(ids, spec)


def test_float_coo_indices_and_timedelta_ids_are_refused():
  spec = FeatureSpec("f", TableSpec("t", 100, 8), (4, 3))
  with pytest.raises(TypeError,
                     match=r"feature 'f': indices must be an integer array, got dtype float64\.$"):
    flatten_input(SparseIds(np.array([[0.0, 0.0]]), [1], (4, 3)), spec)
  with pytest.raises(TypeError, match=r"ids must be an integer array, got dtype timedelta64"):
    flatten_input(np.ones((4, 3), "timedelta64[s]"), spec)


# --- weights ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float64, np.float16, ml_dtypes.bfloat16, np.int32])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_weights_of_other_dtypes(dtype, combiner):
  table = TableSpec("t", 90, 8, combiner=combiner)
  specs = [FeatureSpec("f", table, (8, 4))]
  layout = auto_stack_tables(specs, 8)
  rng = np.random.default_rng(6)
  samples = random_samples(rng, 8, 90, 4)
  ids = dense(samples, 4, -1)
  w = rng.integers(1, 5, ids.shape).astype(dtype)  # exact in every dtype
  samples = [[(int(i), float(x)) for i, x in zip(ids[b], w[b]) if i >= 0] for b in range(8)]
  batches, _ = preprocess({"f": DenseIds(ids, w)}, specs, layout, padding_id=-1)
  check(layout, specs, batches, {"f": samples}, max_ids=4)
  want, _ = preprocess({"f": DenseIds(ids, w.astype(np.float32))}, specs, layout, padding_id=-1)
  for a, b in zip(batches["t"], want["t"]):
    assert_same_bits(a, b)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_weights_beyond_float32(combiner):
  """float64 weights that float32 cannot hold: named as given, never silently changed."""
  table = TableSpec("t", 50, 8, combiner=combiner)
  specs = [FeatureSpec("f", table, (2, 2))]
  layout = auto_stack_tables(specs, 1)
  ids = np.array([[1, 2], [3, 4]])
  with pytest.raises(ValueError, match=r"feature 'f' \(table 't'\): weight 1e\+300 of id 2 at"
                                       r" sample 0 is beyond float32's range"):
    preprocess({"f": DenseIds(ids, [[1.0, 1e300], [1.0, 1.0]])}, specs, layout)
  tiny = DenseIds(ids, [[1e-50, 3e-50], [1.0, 3.0]])
  if combiner == "sum":  # each gain is its weight: 1e-50 is 0 in float32
    batch = preprocess({"f": tiny}, specs, layout)[0]["t"]
    assert batch.entry_gains[0, :4].tolist() == [0.0, 0.0, 1.0, 3.0]
  else:  # the mean of the sample is 1/4, 3/4: it became 0, 0
    with pytest.raises(ValueError, match=r"weight 1e-50 of id 1 at sample 0 rounds to 0 in"
                                         rf" float32, as does every weight of its sample, so the"
                                         rf" {combiner!r} combiner would see no weight"):
      preprocess({"f": tiny}, specs, layout)
  # A weight that rounds to 0 next to a larger one is the rounding of its gain.
  batch = preprocess({"f": DenseIds(ids, [[1e-50, 3.0], [1.0, 3.0]])}, specs, layout)[0]["t"]
  assert batch.entry_gains[0, 0] == 0.0 and batch.entry_gains[0, 1] > 0


# --- limits and statistics ----------------------------------------------------


def test_capacities_of_numpy_ints():
  """Capacities computed with numpy (np.ceil(needed * 1.2).astype(int)) were refused."""
  specs, layout = small_model(2)
  rng = np.random.default_rng(7)
  samples = {s.name: random_samples(rng, 8, s.table.vocabulary_size, 5) for s in specs}
  inputs = {name: ragged(x) for name, x in samples.items()}
  stats = batch_stats(inputs, specs, layout)
  needed = {name: np.ceil(np.array(stats[name].required_capacity) * 1.2).astype(np.int64)
            for name in layout.stack_names}
  got, _ = preprocess(inputs, specs, layout, capacities={k: tuple(v) for k, v in needed.items()})
  want, _ = preprocess(inputs, specs, layout,
                       capacities={k: tuple(map(int, v)) for k, v in needed.items()})
  for name in want:
    for a, b in zip(got[name], want[name]):
      assert_same_bits(a, b)
  check(layout, specs, got, samples, max_ids=5)
  with pytest.raises(ValueError, match=r"max_ids_per_partition must be a positive int, got 2.5"):
    preprocess(inputs, specs, layout, capacities={"users": (np.float64(2.5), 4)})


def test_stats_of_some_batches_size_the_limits_of_others():
  specs, layout = small_model(8)
  rng = np.random.default_rng(8)
  batches = [{s.name: random_samples(rng, 8, s.table.vocabulary_size, 5) for s in specs}
             for _ in range(3)]
  inputs = [{name: ragged(x) for name, x in b.items()} for b in batches]
  with pytest.raises(TypeError, match=r"collect_stats takes an iterable of batches, got a"
                                      r" mapping \(one batch\?\)"):
    collect_stats(inputs[0], specs, layout)
  sized = size_limits_from_stats(specs, collect_stats(inputs[:2], specs, layout), headroom=1.0,
                                 policy="fit")
  for x, samples in zip(inputs[:2], batches):
    batch, stats = preprocess(x, sized, layout)
    assert stats.num_dropped_ids == 0
    check(layout, sized, batch, samples, max_ids=5)
  # Another batch may need more: it fits, or raises naming its stack, or drops and counts.
  try:
    batch, stats = preprocess(inputs[2], sized, layout)
    assert stats.num_dropped_ids == 0
  except PartitionOverflowError as error:
    assert error.stack in layout.stack_names
    batch, stats = preprocess(inputs[2], sized, layout, allow_id_dropping=True)
    assert stats.num_dropped_ids > 0


# --- threads and determinism --------------------------------------------------


def test_threads_with_large_batches_and_dropping_match_serial():
  """A data loader's threads: large batches (the C++ loops split their work over threads)."""
  tables = [TableSpec("a", 200_000, 8, combiner="mean", max_ids_per_partition=600,
                      max_unique_ids_per_partition=500),
            TableSpec("b", 3000, 8, combiner="sqrtn", max_ids_per_partition=400,
                      max_unique_ids_per_partition=300)]
  specs = [FeatureSpec(f"f{k}", tables[k % 2], (2048, None)) for k in range(3)]
  layout = auto_stack_tables(specs, 8, 2)

  def batch(seed):
    rng = np.random.default_rng(seed)
    out = {}
    for spec in specs:
      lengths = rng.integers(0, 50, 2048)
      ids = rng.zipf(1.3, lengths.sum()) % spec.table.vocabulary_size
      out[spec.name] = RaggedIds.from_lengths(ids, lengths, rng.uniform(0.1, 2, lengths.sum()))
    return out

  inputs = [batch(seed) for seed in range(3)]

  def run(x, drop):
    try:
      return preprocess(x, specs, layout, allow_id_dropping=drop)
    except PartitionOverflowError as error:
      return str(error)

  for drop in (False, True):
    serial = [run(x, drop) for x in inputs]
    if drop:
      assert all(stats.num_dropped_ids > 0 for _, stats in serial)
    else:
      assert all(isinstance(result, str) for result in serial)
    with ThreadPoolExecutor(4) as pool:
      parallel = list(pool.map(lambda k: run(inputs[k % 3], drop), range(9)))
    for k, result in enumerate(parallel + [run(x, drop) for x in inputs]):
      want = serial[k % 3]
      if isinstance(want, str):
        assert result == want
        continue
      assert result[1] == want[1]
      for name in want[0]:
        for a, b in zip(result[0][name], want[0][name]):
          assert_same_bits(a, b)


# --- a property over shapes, forms and dtypes -------------------------------------------


@st.composite
def real_batches(draw):
  g_count = draw(st.sampled_from([1, 2, 8]))
  combiner = draw(st.sampled_from(["sum", "mean", "sqrtn"]))
  vocab = draw(st.sampled_from([7, 300, 2**31 + 5]))
  max_len = draw(st.integers(0, 12))
  batch = g_count * draw(st.integers(1, 3))
  form = draw(st.sampled_from(["dense", "list", "ragged", "coo"]))
  dtype = draw(st.sampled_from([np.int32, np.int64, np.uint32, np.uint64]))
  weighted = draw(st.booleans())
  return g_count, combiner, vocab, max_len, batch, form, dtype, weighted, draw(
      st.integers(0, 2**32 - 1))


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(real_batches())
def test_any_batch_matches_the_dense_oracle(case):
  g_count, combiner, vocab, max_len, batch, form, dtype, weighted, seed = case
  if vocab > 2**31 and (dtype == np.int32 or g_count == 1):
    dtype = np.int64 if dtype == np.int32 else dtype
    if g_count == 1:
      vocab = 2**20
  rng = np.random.default_rng(seed)
  table = TableSpec("t", vocab, 8, combiner=combiner)
  specs = [FeatureSpec("f", table, (batch, None))]
  layout = auto_stack_tables(specs, g_count, 2)
  samples = random_samples(rng, batch, vocab, max_len, low=max(0, vocab - 1000),
                           weighted=weighted)
  samples = [[(i, float(np.float32(w))) for i, w in p] for p in samples]
  ids = [np.array([i for i, _ in p], dtype) for p in samples]
  w = [np.array([x for _, x in p], np.float32) for p in samples] if weighted else None
  flat_w = np.concatenate(w) if weighted else None
  padding = None
  if form == "list":
    value = RaggedRows(ids, w)
  elif form == "ragged":
    value = RaggedIds.from_lengths(np.concatenate(ids), [len(x) for x in ids], flat_w)
  elif form == "dense":
    padding = int(np.iinfo(dtype).max)
    width = max(max_len, 1)
    value = DenseIds(dense(samples, width, padding, dtype),
                     None if not weighted else np.array(
                         [[x for _, x in p] + [0.0] * (width - len(p)) for p in samples],
                         np.float32))
  else:
    indices = np.array([(b, j) for b, p in enumerate(samples) for j in range(len(p))],
                       np.int64).reshape(-1, 2)
    order = rng.permutation(len(indices))
    value = SparseIds(indices[order], np.concatenate(ids)[order], (batch, max(max_len, 1)),
                      None if flat_w is None else flat_w[order])
  batches, _ = preprocess({"f": value}, specs, layout, padding_id=padding)
  check(layout, specs, batches, {"f": samples}, max_ids=max(max_len, 1))
  again, _ = preprocess({"f": value}, specs, layout, padding_id=padding)
  for a, b in zip(again["t"], batches["t"]):
    assert_same_bits(a, b)


def test_arguments_of_another_kind_are_named():
  specs = [FeatureSpec("f", TableSpec("t", 100, 8), (4, 3))]
  layout = auto_stack_tables(specs, 1)
  ids = {"f": np.arange(12).reshape(4, 3)}
  with pytest.raises(TypeError, match=r"layout must be the EmbeddingLayout .*got NoneType"):
    preprocess(ids, specs, None)
  for stats, got in ((None, "got NoneType"), ([1, 2], "holding int values"), ("s", "got str")):
    with pytest.raises(TypeError, match=rf"stats must be a PreprocessStats .*{got}"):
      size_limits_from_stats(specs, stats)
  with pytest.raises(ValueError, match=r"stack 't': max_ids_per_partition is 1099511627776, more"
                                       r" than the 2147483647 entries"):
    preprocess(ids, specs, layout, capacities={"t": (2**40, 2**40)})
  stats = collect_stats([ids], specs, layout)
  with pytest.raises(ValueError, match=r"table 't': max_ids_per_partition is about \de\d+, more"):
    size_limits_from_stats(specs, stats, layout=layout, headroom=1e300)


def test_another_negative_id_beside_the_padding_id_is_named_with_it():
  """With padding_id=-1 an id of -3 was told to pass padding_id=-3, which makes every -1 an
  error instead."""
  features = [FeatureSpec("f", TableSpec("t", 10, 4), (4, 3))]
  ids = np.array([[1, -1, -3], [1, 2, 3], [0, 0, 0], [1, 1, 1]])
  with pytest.raises(ValueError, match=r"got id -3 at sample 0.* the padding id, which is -1"
                                       r" here: mark every unused place with it"):
    preprocess({"f": ids}, features, auto_stack_tables(features, 1), padding_id=-1)
  with pytest.raises(ValueError, match=r"got id -1 at sample 0.* pass padding_id=-1 if"):
    preprocess({"f": ids}, features, auto_stack_tables(features, 1))


def test_embedding_bag_offsets_without_the_end_are_told_to_append_it():
  features = [FeatureSpec("f", TableSpec("t", 10, 4), (4, 3))]
  values = np.arange(8) % 10
  starts = np.array([0, 2, 4, 6])  # torch.nn.EmbeddingBag's offsets: B of them
  with pytest.raises(ValueError, match=r"run from 0 to len\(values\) = 8.* B start offsets.*"
                                       r" append len\(values\)"):
    preprocess({"f": RaggedIds(values, starts)}, features, auto_stack_tables(features, 1))
  batch, _ = preprocess({"f": RaggedIds(values, np.append(starts, 8))}, features,
                        auto_stack_tables(features, 1))
  assert set(batch) == {"t"}
