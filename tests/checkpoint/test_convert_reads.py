"""Conversion reads each source chunk a bounded number of times, in bounded memory."""

from __future__ import annotations

import collections
import os
import tracemalloc

import orbax.checkpoint as ocp
import pytest

import checkpoint as ck
from checkpoint import _direct, _integrity
from ckpt_testlib import make_model
from sc_framework.optimizers import Adam, RowWiseAdagrad
from tests.numerics import assert_same_bits

TABLES = [("a", 700, 16), ("b", 333, 12), ("c", 500, 16)]
SMALL_CHUNKS = ck.StorageOptions(chunk_bytes=1024)


def _saved(
    path, devices, shards, *, optimizer=RowWiseAdagrad(), tables=TABLES, seed=5,
    storage=SMALL_CHUNKS,
):
  model = make_model([spec + (optimizer,) for spec in tables], seed=seed)
  layout = model.layout([[name for name, *_ in tables]], devices, shards)
  arrays, slots = model.state(layout)
  save = ck.EmbeddingSave(arrays, slots, layout, model.slot_specs(layout), storage)
  with ocp.Checkpointer(ck.EmbeddingCheckpointHandler()) as ckptr:
    ckptr.save(path, args=save)
  return model, layout


def _check_tables(model, path):
  arrays = ck.EmbeddingCheckpointHandler().restore(path, ck.TableRestore())
  for name, logical in model.logical.items():
    assert_same_bits(arrays.tables[name], logical)
    for slot, values in model.slots[name].items():
      assert_same_bits(arrays.slots[name][slot], values)


def _chunk_files(directory) -> list[str]:
  return [
      os.path.join(root, name)
      for root, _, names in os.walk(directory)
      if os.path.basename(os.path.dirname(root)) == "c"
      for name in names
  ]


@pytest.mark.parametrize(
    "source, target",
    [
        ((1, 1), (8, 2)),  # 1 shard -> 16: the case that read each chunk 16 times.
        ((8, 2), (1, 1)),
        ((2, 2), (4, 2)),
        ((1, 1), "unstacked"),
        ((4, 2), "unstacked"),
    ],
)
def test_each_source_chunk_is_read_at_most_twice(tmp_path, monkeypatch, source, target):
  model, layout = _saved(tmp_path / "src", *source)
  files = _chunk_files(tmp_path / "src")
  assert len(files) > 100  # Small chunks: every target block spans many of them.
  block_bytes = 4096  # A chunk cache of 32 KiB: a third of the source, or less.
  assert sum(os.path.getsize(file) for file in files) > 3 * 8 * block_bytes
  reads = collections.Counter()
  read_chunk = _direct._read_chunk

  def counting(file, out):
    reads[os.path.realpath(file)] += 1
    return read_chunk(file, out)

  monkeypatch.setattr(_direct, "_read_chunk", counting)
  if target != "unstacked":
    target = ck.relayout(layout, num_devices=target[0], shards_per_device=target[1])
  ck.convert(tmp_path / "src", tmp_path / "dst", target, block_bytes=block_bytes)
  source_reads = {file: reads[os.path.realpath(file)] for file in files}
  # Every chunk is read; a chunk holding rows of two tables once per table.
  assert min(source_reads.values()) >= 1
  assert max(source_reads.values()) <= 2, sorted(source_reads.values())[-5:]
  assert sum(source_reads.values()) <= 1.1 * len(files)
  monkeypatch.undo()
  _check_tables(model, tmp_path / "dst")


@pytest.mark.parametrize("target", [(2, 2), "unstacked"])
def test_direct_chunk_files_are_what_tensorstore_writes(tmp_path, target):
  """Converted arrays read back through TensorStore's own crc32c decode, bit for bit.

  Unstacked arrays end with a partial chunk (V is no multiple of the chunk
  rows), stored whole with zeros past the end.
  """
  model, layout = _saved(tmp_path / "src", 1, 1, optimizer=Adam())
  if target != "unstacked":
    target = ck.relayout(layout, num_devices=target[0], shards_per_device=target[1])
  ck.convert(tmp_path / "src", tmp_path / "dst", target, block_bytes=4096)
  ck.convert(tmp_path / "src", tmp_path / "ts", target, storage=ck.StorageOptions(checksum="none"))
  direct, other = ck.CheckpointReader(tmp_path / "dst"), ck.CheckpointReader(tmp_path / "ts")
  for group in direct.manifest.groups:
    if target == "unstacked":
      assert group.table.shape[0] % group.table.chunk_rows
    for slot in (None, "mu", "nu"):
      through_tensorstore = direct.store(group.name, slot).read().result()
      assert_same_bits(through_tensorstore, other.store(group.name, slot).read().result())
  _check_tables(model, tmp_path / "dst")


def test_peak_memory_is_bounded_by_the_block_size_not_the_table(tmp_path, monkeypatch):
  tables = [("a", 12000, 64), ("b", 10000, 64)]  # 5.7 MiB of tables and slots.
  model, layout = _saved(
      tmp_path / "src", 1, 1, tables=tables, seed=6, storage=ck.StorageOptions(chunk_bytes=8192)
  )
  size = sum(f.stat().st_size for f in (tmp_path / "src").rglob("*") if f.is_file())
  target = ck.relayout(layout, num_devices=4, shards_per_device=2)
  block_bytes = 32 << 10
  measured = {}
  write_manifest = _integrity.write_manifest

  def measured_write_manifest(directory, **kwargs):
    """The peak up to the output's integrity manifest, written last: a list of every
    file written (a step's manifest lists as many), not data held per block."""
    measured["conversion"] = tracemalloc.get_traced_memory()[1]
    write_manifest(directory, **kwargs)

  monkeypatch.setattr(_integrity, "write_manifest", measured_write_manifest)
  tracemalloc.start()
  try:
    ck.convert(tmp_path / "src", tmp_path / "dst", target, block_bytes=block_bytes)
  finally:
    tracemalloc.stop()
  # The chunk cache (8 blocks), a few blocks in flight, row indices, listings.
  assert measured["conversion"] < 16 * block_bytes + (512 << 10) < size / 4, (measured, size)
  _check_tables(model, tmp_path / "dst")
