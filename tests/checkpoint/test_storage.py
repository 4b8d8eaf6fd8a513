"""Storage internals: name encoding, chunk sizes, strided row copies, layouts."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tensorstore as ts
from hypothesis import given, settings
from hypothesis import strategies as st

import checkpoint as ck
from checkpoint import _direct, _names, _storage
from checkpoint._layouts import parse_groups
from ckpt_testlib import make_model
from tests.numerics import assert_same_bits


@given(st.lists(st.text(min_size=1, max_size=12), min_size=2, max_size=6, unique=True))
@settings(max_examples=200, deadline=None)
def test_name_encoding_is_injective_and_path_safe(names):
  encoded = [_names.encode_name(name) for name in names]
  assert len(set(encoded)) == len(names)
  for component in encoded:
    assert component and "/" not in component and "\\" not in component and "." not in component
    assert component not in (".", "..")


def test_long_names_are_cut_with_a_digest():
  long_a, long_b = "x" * 300 + "a", "x" * 300 + "b"
  a, b = _names.encode_name(long_a), _names.encode_name(long_b)
  assert len(a) <= _names.MAX_COMPONENT_LENGTH and a != b


@pytest.mark.parametrize(
    "rows_per_shard, row_bytes, chunk_bytes, expected",
    [
        (1000, 512, 4 << 20, 1000),  # the whole shard fits in one chunk
        (65536, 512, 4 << 20, 8192),  # 4 MiB chunks
        (8 * 4099, 256, 1 << 20, 8 * 4099),  # 8 x prime: the whole shard (under 16 chunks)
        (8 * 7919, 512, 1 << 20, 8),  # 8 x prime, too big for one chunk: 8 rows
        (512 * 7919, 512, 1 << 20, 512),
        (24, 4, 1024, 24),
    ],
)
def test_chunk_rows_divide_the_rows_per_shard(rows_per_shard, row_bytes, chunk_bytes, expected):
  rows = _storage.chunk_rows_for(rows_per_shard, row_bytes, chunk_bytes)
  assert rows == expected and rows_per_shard % rows == 0


@given(st.data())
@settings(max_examples=150, deadline=None)
def test_copy_rows_matches_numpy_fancy_indexing(data):
  source = np.arange(400 * 3, dtype=np.float32).reshape(400, 3)
  store = ts.array(source)
  count = data.draw(st.integers(1, 60))
  pattern = data.draw(st.sampled_from(["random", "strided", "slabs"]))
  if pattern == "random":
    rows = np.array(data.draw(st.lists(st.integers(0, 399), min_size=count, max_size=count)))
  elif pattern == "strided":
    start, step = data.draw(st.integers(0, 100)), data.draw(st.integers(1, 5))
    rows = np.arange(start, start + step * count, step)
  else:
    shards, per = data.draw(st.integers(1, 8)), data.draw(st.integers(1, 8))
    rows = np.concatenate([s * 50 + np.arange(per) for s in range(shards)])
  out_rows = np.array(data.draw(st.permutations(range(rows.size)))) * data.draw(st.integers(1, 3))
  out = np.full((out_rows.max() + 1, 3), -1.0, np.float32)
  for future in _storage.copy_rows(store, rows, out, out_rows, 2):
    future.result()
  expected = np.full_like(out, -1.0)
  expected[out_rows, :2] = source[rows, :2]
  assert_same_bits(out, expected)


def test_host_buffers_are_aligned_for_zero_copy_device_put():
  for rows in (1, 7, 1000):
    buffer = _storage.host_buffer((rows, 3), np.float32, 0.5)
    assert buffer.ctypes.data % 64 == 0 and buffer.flags.c_contiguous
    assert np.all(buffer == 0.5)


def test_storage_options_validation():
  with pytest.raises(ValueError, match="compression must be"):
    ck.StorageOptions(compression="lzma")
  with pytest.raises(ValueError, match="chunk_bytes"):
    ck.StorageOptions(chunk_bytes=10)
  options = ck.StorageOptions(compression="zstd", compression_level=5, checksum="none")
  assert ck.StorageOptions.from_dict(options.to_dict()) == options
  assert _storage.kvstore_spec("gs://bucket/a/b") == {
      "driver": "gcs",
      "bucket": "bucket",
      "path": "a/b/",
  }
  with pytest.raises(ValueError, match="unsupported path"):
    _storage.kvstore_spec("ftp://host/x")


def test_relayout_keeps_tables_and_features():
  model = make_model([("a", 64, 12), ("b", 120, 10), ("c", 40, 16)])
  layout = model.layout([["a", "b"], ["c"]], 8)
  other = ck.relayout(layout, num_devices=2, shards_per_device=4, groups=[["c", "b"], ["a"]])
  assert other.stack_names == ("c__b", "a") and other.num_shards == 8
  assert set(other.feature_names) == set(layout.feature_names)
  assert (
      ck.relayout(other, num_devices=8, shards_per_device=1, groups=[["a", "b"], ["c"]]) == layout
  )
  shapes = ck.layout_for_tables({"a": (64, 12), "b": (120, 10)}, num_devices=2, groups=[["a", "b"]])
  assert shapes.stack_names == ("a__b",) and shapes.table("b").row_offset == 32
  with pytest.raises(ValueError, match=r"table 'b': expected its shape \(vocabulary_size,"
                                       r" embedding_dim\), got \(120, 10, 1\)"):
    ck.layout_for_tables({"a": (64, 12), "b": (120, 10, 1)}, num_devices=2)
  with pytest.raises(ValueError, match=r"table 'a': expected its shape .*, got 5"):
    ck.layout_for_tables({"a": 5}, num_devices=2)
  assert parse_groups("a, b; c;") == [["a", "b"], ["c"]]
  with pytest.raises(ValueError, match="names no table"):
    parse_groups(" ; ")


@pytest.mark.parametrize("compression, level", [
    ("zstd", 23), ("zstd", 100), ("zstd", -131073), ("blosc", -3), ("blosc", 10),
])
def test_a_compression_level_outside_the_codecs_is_refused_naming_it(compression, level):
  """Accepted before, it failed only in the background write, with TensorStore's
  words and a temporary directory left behind."""
  with pytest.raises(ValueError, match=rf"compression_level {level} is outside {compression}'s"):
    ck.StorageOptions(compression=compression, compression_level=level)


@pytest.mark.parametrize("compression, level", [
    ("zstd", 22), ("zstd", -131072), ("zstd", 0), ("blosc", 0), ("blosc", 9),
])
def test_the_codecs_extreme_levels_write_and_read_back(tmp_path, compression, level):
  """The bounds StorageOptions accepts are those TensorStore writes with."""
  stored = np.random.default_rng(level % 7).standard_normal((8, 12)).astype(np.float32)
  options = ck.StorageOptions(compression=compression, compression_level=level)
  spec = _storage.create_spec(tmp_path / "array", stored.shape, stored.dtype, 4, options)
  _storage.open_for_write(spec).result().write(stored).result()
  assert_same_bits(_storage.open_for_read(tmp_path / "array").result().read().result(), stored)


def _stored_array(path, rng, chunk_rows, chunks, width=12):
  stored = rng.standard_normal((chunk_rows * chunks, width)).astype(np.float32)
  spec = _storage.create_spec(path, stored.shape, stored.dtype, chunk_rows, ck.StorageOptions())
  _storage.open_for_write(spec).result().write(stored).result()
  return stored


@settings(max_examples=40, deadline=None)
@given(data=st.data(), cached=st.booleans())
def test_strided_direct_copies_match_a_numpy_reference(tmp_path_factory, data, cached):
  rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
  chunk_rows = data.draw(st.integers(1, 9), label="chunk_rows")
  chunks = data.draw(st.integers(1, 6), label="chunks")
  path = tmp_path_factory.mktemp("strided") / "array"
  stored = _stored_array(path, rng, chunk_rows, chunks)
  total = stored.shape[0]
  out_rows_total = data.draw(st.integers(1, 3 * total), label="out rows")
  free = np.ones(out_rows_total, bool)
  runs, expected = [], np.full((out_rows_total, 12), -7.0, np.float32)
  for _ in range(data.draw(st.integers(0, 4), label="runs")):
    row_step = data.draw(st.integers(1, chunk_rows + 2), label="row step")
    row = data.draw(st.integers(0, total - 1), label="row")
    out_step = data.draw(st.integers(1, 3), label="out step")
    out_row = data.draw(st.integers(0, out_rows_total - 1), label="out row")
    room = min((total - 1 - row) // row_step, (out_rows_total - 1 - out_row) // out_step)
    count = data.draw(st.integers(0, room + 1), label="count")
    targets = out_row + out_step * np.arange(count)
    if not free[targets].all():
      continue  # Runs write disjoint rows of out.
    free[targets] = False
    runs.append((row, row_step, count, out_row, out_step))
    expected[targets, :10] = stored[row + row_step * np.arange(count), :10]
  out = np.full((out_rows_total, 12), -7.0, np.float32)
  cache = _direct.ChunkCache(1 << 20) if cached else None
  done = _direct.copy_strided_direct(path, stored.shape, chunk_rows, runs, out, 10, cache)
  if done:
    np.testing.assert_array_equal(out, expected)
  else:  # Declined only when the runs step over more chunks than rows they copy.
    assert sum(run[2] for run in runs) // 4 < sum(
        (step * (count - 1)) // chunk_rows + 2 for _, step, count, _, _ in runs if count
    )
    np.testing.assert_array_equal(out, np.full_like(out, -7.0))


def test_strided_direct_copies_read_each_chunk_once_and_check_it(tmp_path, monkeypatch):
  rng = np.random.default_rng(3)
  path = tmp_path / "array"
  stored = _stored_array(path, rng, chunk_rows=8, chunks=6)
  # Two runs over the same chunks (a source of 2 shards read with step 2, say),
  # one run that takes chunk 5 whole into full-width rows (read in place).
  runs = [(0, 2, 20, 0, 2), (1, 2, 20, 1, 2), (40, 1, 8, 40, 1)]
  reads = []
  read_chunk = _direct._read_chunk
  monkeypatch.setattr(
      _direct, "_read_chunk", lambda file, out: (reads.append(file), read_chunk(file, out))
  )
  out = np.zeros((48, 12), np.float32)
  assert _direct.copy_strided_direct(path, stored.shape, 8, runs, out, 12)
  np.testing.assert_array_equal(out, stored)
  assert sorted(reads) == sorted({str(path / "c" / str(c) / "0") for c in range(6)})
  chunk = path / "c" / "2" / "0"
  data = bytearray(chunk.read_bytes())
  data[5] ^= 4
  chunk.write_bytes(bytes(data))
  with pytest.raises(ck.CorruptCheckpointError, match=rf"{re.escape(str(chunk))}.*CRC32C"):
    _direct.copy_strided_direct(path, stored.shape, 8, runs, out, 12)


def test_chunk_cache_resize_drops_the_oldest_chunks(tmp_path):
  rng = np.random.default_rng(4)
  path = tmp_path / "array"
  stored = _stored_array(path, rng, chunk_rows=4, chunks=4)
  chunk_bytes = 4 * 12 * 4
  cache = _direct.ChunkCache(4 * chunk_bytes)
  files = [str(path / "c" / str(c) / "0") for c in range(4)]
  chunks = [cache.get(file, (4, 12), np.float32) for file in files]
  for c, chunk in enumerate(chunks):
    np.testing.assert_array_equal(chunk, stored[4 * c : 4 * c + 4])
  cache.resize(2 * chunk_bytes)
  assert list(cache._chunks) == files[2:]
  cache.resize(0)
  assert not cache._chunks
  assert cache.get(files[1], (4, 12), np.float32) is not None and len(cache._chunks) == 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_direct_chunk_reads_match_the_stored_array(tmp_path, seed):
  rng = np.random.default_rng(seed)
  chunk_rows, chunks, width = int(rng.integers(1, 9)), int(rng.integers(1, 7)), 12
  stored = rng.standard_normal((chunk_rows * chunks, width)).astype(np.float32)
  path = tmp_path / "array"
  spec = _storage.create_spec(path, stored.shape, stored.dtype, chunk_rows, ck.StorageOptions())
  _storage.open_for_write(spec).result().write(stored).result()
  start = int(rng.integers(0, chunks)) * chunk_rows
  stop = int(rng.integers(start // chunk_rows + 1, chunks + 1)) * chunk_rows
  block = _storage.host_buffer((stop - start, width), np.float32)
  assert _direct.read_chunks_direct(path, chunk_rows, start, stop, stored.shape[0], block)
  np.testing.assert_array_equal(block, stored[start:stop])
  assert not _direct.read_chunks_direct(path, chunk_rows, start + 1, stop, stored.shape[0], block)
  rows = rng.permutation(stored.shape[0])[: int(rng.integers(1, stored.shape[0] + 1))]
  out_rows = rng.permutation(rows.size)
  out = np.full((rows.size, 10), -7.0, np.float32)
  assert _direct.gather_rows_direct(path, stored.shape, chunk_rows, rows, out, out_rows, 10)
  expected = np.empty_like(out)
  expected[out_rows] = stored[rows, :10]
  np.testing.assert_array_equal(out, expected)
  # A flipped bit anywhere in a chunk's data is an error naming the chunk file.
  chunk = path / "c" / str(int(rows[0]) // chunk_rows) / "0"
  data = bytearray(chunk.read_bytes())
  data[int(rng.integers(0, len(data) - 4))] ^= 1 << int(rng.integers(0, 8))
  chunk.write_bytes(bytes(data))
  with pytest.raises(ck.CorruptCheckpointError, match=rf"{re.escape(str(chunk))}.*CRC32C"):
    _direct.gather_rows_direct(path, stored.shape, chunk_rows, rows, out, out_rows, 10)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chunk_writer_pieces_read_back_through_tensorstore(tmp_path, seed):
  """Chunks written in pieces (chunks interleaved, each in order) equal TensorStore's reading."""
  rng = np.random.default_rng(seed)
  chunk_rows, total = int(rng.integers(2, 9)), int(rng.integers(1, 60))
  stored = rng.standard_normal((total, 6)).astype(np.float32)
  path = tmp_path / "array"
  spec = _storage.create_spec(path, stored.shape, stored.dtype, chunk_rows, ck.StorageOptions())
  _storage.open_for_write(spec).result()
  writer = _direct.ChunkWriter(path, chunk_rows, total)
  cuts = np.unique(np.concatenate([[0, total], rng.integers(0, total + 1, size=8)]))
  pieces = [
      piece for a, b in zip(cuts[:-1], cuts[1:]) for piece in writer.pieces(int(a), int(b))
  ]
  assert all(a // chunk_rows == chunk == (b - 1) // chunk_rows for chunk, a, b in pieces)
  queues = {}  # Interleave chunks at random, each chunk's pieces in order.
  for piece in pieces:
    queues.setdefault(piece[0], []).append(piece)
  while queues:
    chunk = int(rng.choice(sorted(queues)))
    _, a, b = queues[chunk].pop(0)
    if not queues[chunk]:
      del queues[chunk]
    if a and rng.random() < 0.3 and writer.unfinished():
      with pytest.raises(ValueError, match="in order"):
        writer.write(a + 1 if b > a + 1 else a - 1, stored[a:b])
    writer.write(a, stored[a:b])
  assert writer.unfinished() == []
  assert_same_bits(_storage.open_for_read(path).result().read().result(), stored)
  if total % chunk_rows == 0:  # The direct reader (which takes whole arrays of whole chunks).
    out = np.empty_like(stored)
    assert _direct.read_chunks_direct(path, chunk_rows, 0, total, total, out)
    assert_same_bits(out, stored)


def test_chunk_writer_reports_unfinished_chunks_and_never_overwrites(tmp_path):
  path = tmp_path / "array"
  writer = _direct.ChunkWriter(path, 4, 10)
  data = np.arange(24, dtype=np.float32).reshape(8, 3)
  writer.write(0, data[:2])
  writer.write(4, data[4:8])
  assert writer.unfinished() == [0]
  with pytest.raises(FileExistsError):
    _direct.ChunkWriter(path, 4, 10).write(4, data[4:8])


@pytest.mark.parametrize("shape", [(37, 5), (0, 5), (3,)])
def test_chunk_checksums_are_the_same_with_google_crc32cs_pure_python_fallback(
    monkeypatch, shape):
  """Where no wheel with its C extension exists, google-crc32c runs Python code,
  which reads its input as ints: the chunk checksums must not depend on it."""
  import google_crc32c
  from google_crc32c import python as pure_python

  data = np.random.default_rng(len(shape)).standard_normal(shape).astype(np.float32)
  want = google_crc32c.value(data.tobytes())
  assert _direct.crc32c_of(data) == want
  monkeypatch.setattr(_direct.google_crc32c, "implementation", "python")
  monkeypatch.setattr(_direct.google_crc32c, "extend", pure_python.extend)
  assert _direct.crc32c_of(data) == want
  assert _direct.crc32c_of(data[1:], crc=_direct.crc32c_of(data[:1])) == want
