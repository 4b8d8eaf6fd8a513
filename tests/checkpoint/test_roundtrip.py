"""Save / restore in the same layout, and per-table (unstacked) restore."""

from __future__ import annotations

import shutil

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import checkpoint as ck
from ckpt_testlib import AXIS, make_mesh, make_model
from sc_framework.optimizers import (
    FTRL,
    SGD,
    Adagrad,
    AdagradMomentum,
    Adam,
    CustomOptimizer,
    LaProp,
    RowWiseAdagrad,
    SlotSpec,
)
from sc_framework.primitives import EmbeddingVariables
from tests.numerics import assert_same_bits


def _identity(rows, grads, slots, step):
  del grads, step
  return rows, slots


OPTIMIZERS = [
    SGD(),
    Adagrad(),
    RowWiseAdagrad(),
    AdagradMomentum(),
    Adam(),
    LaProp(),
    FTRL(),
    CustomOptimizer("custom", _identity, (SlotSpec("m", 3, 0.5), SlotSpec("v", None, 0.0))),
]


def _model(optimizer, dtype=np.float32):
  return make_model(
      [("a", 64, 12, optimizer), ("b", 120, 10, optimizer), ("c", 40, 16, optimizer)], dtype=dtype
  )


def _save_restore(path, layout, tables, slots, slot_specs, restore_args):
  with ocp.AsyncCheckpointer(ck.EmbeddingCheckpointHandler()) as ckptr:
    ckptr.save(path, args=ck.EmbeddingSave(tables, slots, layout, slot_specs))
    ckptr.wait_until_finished()
    return ckptr.restore(path, args=restore_args)


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.kind)
def test_same_layout_round_trip_is_bit_exact(tmp_path, optimizer):
  model = _model(optimizer)
  layout = model.layout([["a", "b"], ["c"]], 8)
  tables, slots = model.state(layout)
  mesh = make_mesh(8)
  restored = _save_restore(
      tmp_path / "ckpt",
      layout,
      tables,
      slots,
      model.slot_specs(layout),
      ck.EmbeddingRestore(layout, mesh, AXIS),
  )
  assert isinstance(restored, EmbeddingVariables)
  for name, array in tables.items():
    assert restored.tables[name].sharding == array.sharding
    assert_same_bits(np.asarray(restored.tables[name]), np.asarray(array))
    assert set(restored.slots[name]) == {spec.name for spec in optimizer.slots()}
    for slot, slot_array in slots[name].items():
      assert restored.slots[name][slot].sharding == slot_array.sharding
      assert_same_bits(np.asarray(restored.slots[name][slot]), np.asarray(slot_array))
  model.check(layout, restored.tables, restored.slots)


@pytest.mark.parametrize("optimizer", [SGD(), RowWiseAdagrad(), Adam()], ids=lambda o: o.kind)
def test_unstacked_restore_of_every_table(tmp_path, optimizer):
  model = _model(optimizer)
  layout = model.layout([["a", "b", "c"]], 4, 2)
  tables, slots = model.state(layout)
  arrays = _save_restore(
      tmp_path / "ckpt", layout, tables, slots, model.slot_specs(layout), ck.TableRestore()
  )
  assert isinstance(arrays, ck.TableArrays)
  assert set(arrays.tables) == {"a", "b", "c"}
  for name, logical in model.logical.items():
    assert_same_bits(arrays.tables[name], logical)
    assert set(arrays.slots[name]) == set(model.slots[name])
    for slot, values in model.slots[name].items():
      assert_same_bits(arrays.slots[name][slot], values)


def test_unstacked_restore_of_a_subset_and_a_row_range(tmp_path):
  model = _model(Adam())
  layout = model.layout([["a", "b"], ["c"]], 8)
  tables, slots = model.state(layout)
  path = tmp_path / "ckpt"
  _save_restore(path, layout, tables, slots, model.slot_specs(layout), ck.TableRestore())
  reader = ck.CheckpointReader(path)
  subset = ck.EmbeddingCheckpointHandler().restore(path, ck.TableRestore(tables=["b"]))
  assert set(subset.tables) == {"b"} and set(subset.slots) == {"b"}
  assert_same_bits(subset.tables["b"], model.logical["b"])
  ranged = ck.EmbeddingCheckpointHandler().restore(
      path, ck.TableRestore(tables=["b", "c"], rows={"b": (37, 101)})
  )
  assert_same_bits(ranged.tables["b"], model.logical["b"][37:101])
  assert_same_bits(ranged.slots["b"]["nu"], model.slots["b"]["nu"][37:101])
  assert_same_bits(ranged.tables["c"], model.logical["c"])
  only_rows = ck.EmbeddingCheckpointHandler().restore(path, ck.TableRestore(rows={"a": (63, 64)}))
  assert set(only_rows.tables) == {"a"}
  assert_same_bits(only_rows.tables["a"], model.logical["a"][63:64])
  empty = reader.read_rows("a", None, np.zeros((0,), np.int64))
  assert empty.shape == (0, 12) and reader.read_rows("a", None, []).shape == (0, 12)
  # Rows 1.7 and True read row 1, and a [2, 2] array was flattened.
  for rows, culprit in ((np.array([1.7]), "dtype float64"), ([True], "dtype bool"),
                        (np.ones((2, 2), np.int64), r"shape \(2, 2\)")):
    with pytest.raises(ValueError, match=rf"table 'a': rows must be a 1-D array of integer"
                                         rf" logical rows, got {culprit}"):
      reader.read_rows("a", None, rows)


def test_row_range_reads_only_the_chunks_that_hold_it(tmp_path):
  """Every chunk lies inside one shard: delete all other shards' chunks, the rows still read."""
  model = make_model([("a", 1024, 16, RowWiseAdagrad())])
  layout = model.layout([["a"]], 8)
  tables, slots = model.state(layout)
  path = tmp_path / "ckpt"
  storage = ck.StorageOptions(chunk_bytes=1024)  # 16 rows of 64 bytes per chunk.
  with ocp.Checkpointer(ck.EmbeddingCheckpointHandler()) as ckptr:
    ckptr.save(
        path, args=ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout), storage)
    )
  reader = ck.CheckpointReader(path)
  info = reader.array_info("a")
  rows_per_shard = layout.stacks[0].rows_per_shard
  assert rows_per_shard % info.chunk_rows == 0 and info.chunk_rows == 16
  # Logical rows i with i mod 8 == 3 all live in shard 3 (a single-table stack has rotation 0).
  for slot, array_dir in ((None, "table"), ("accumulator", "slots/accumulator")):
    chunk_rows = reader.array_info("a", slot).chunk_rows
    keep = {
        str(c) for c in range(3 * rows_per_shard // chunk_rows, 4 * rows_per_shard // chunk_rows)
    }
    for chunk in (path / "stacks" / "a" / array_dir / "c").iterdir():
      if chunk.name not in keep:
        shutil.rmtree(chunk)
  rows = np.arange(3, 1024, 8)
  assert_same_bits(reader.read_rows("a", None, rows), model.logical["a"][rows])
  assert_same_bits(
      reader.read_rows("a", "accumulator", rows), model.slots["a"]["accumulator"][rows]
  )
  with pytest.raises(ck.CorruptCheckpointError, match="stack 'a'"):
    reader.read_rows("a", None, np.array([4]))


def test_bfloat16_tables_and_sync_save(tmp_path):
  model = _model(Adagrad(), dtype=ml_dtypes.bfloat16)
  layout = model.layout([["a", "b", "c"]], 2, 4)
  tables, slots = model.state(layout)
  path = tmp_path / "ckpt"
  with ocp.Checkpointer(ck.EmbeddingCheckpointHandler()) as ckptr:
    ckptr.save(path, args=ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout)))
    restored = ckptr.restore(path, args=ck.EmbeddingRestore(layout, make_mesh(2), AXIS))
  assert restored.tables["a__b__c"].dtype == ml_dtypes.bfloat16
  model.check(layout, restored.tables, restored.slots)


def test_replicated_mesh_axis_saves_each_row_once_and_restores(tmp_path):
  model = _model(RowWiseAdagrad())
  layout = model.layout([["a", "b"], ["c"]], 4)
  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), (AXIS, "data"))
  tables, slots = model.state(layout, mesh)
  restored = _save_restore(
      tmp_path / "ckpt",
      layout,
      tables,
      slots,
      model.slot_specs(layout),
      ck.EmbeddingRestore(layout, mesh, AXIS),
  )
  assert restored.tables["c"].sharding == NamedSharding(mesh, PartitionSpec(AXIS, None))
  model.check(layout, restored.tables, restored.slots)


@pytest.mark.parametrize("compression", ["zstd", "blosc"])
def test_compressed_round_trip(tmp_path, compression):
  model = _model(Adam())
  layout = model.layout([["a", "b"], ["c"]], 8)
  tables, slots = model.state(layout)
  path = tmp_path / "ckpt"
  storage = ck.StorageOptions(compression=compression, checksum="none")
  with ocp.Checkpointer(ck.EmbeddingCheckpointHandler()) as ckptr:
    ckptr.save(
        path, args=ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout), storage)
    )
    restored = ckptr.restore(path, args=ck.EmbeddingRestore(layout, make_mesh(8), AXIS))
  model.check(layout, restored.tables, restored.slots)
  assert ck.inspect(path)["storage"]["compression"] == compression


def test_async_save_is_immune_to_later_donation_of_the_tables(tmp_path):
  """The training step may donate and overwrite the tables while the write runs."""
  model = _model(Adam())
  layout = model.layout([["a", "b"], ["c"]], 8)
  tables, slots = model.state(layout)
  step = jax.jit(lambda t: jax.tree.map(lambda x: x * 2.0 + 1.0, t), donate_argnums=0)
  path = tmp_path / "ckpt"
  with ocp.AsyncCheckpointer(ck.EmbeddingCheckpointHandler()) as ckptr:
    ckptr.save(path, args=ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout)))
    old_slots = slots
    tables, slots = step((tables, slots))  # Runs while the checkpoint is being written.
    jax.block_until_ready((tables, slots))
    for group in old_slots.values():  # Explicitly freed arrays stay readable by the writer.
      for array in group.values():
        array.delete()
    ckptr.wait_until_finished()
  restored = ck.EmbeddingCheckpointHandler().restore(
      path, ck.EmbeddingRestore(layout, make_mesh(8), AXIS)
  )
  model.check(layout, restored.tables, restored.slots)
  assert_same_bits(
      np.asarray(tables["c"])[:4, :3], np.asarray(restored.tables["c"])[:4, :3] * 2 + 1
  )
