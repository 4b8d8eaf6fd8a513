"""Restore into other layouts: other G, S and stacking groups, on sub-meshes."""

from __future__ import annotations

import numpy as np
import orbax.checkpoint as ocp
import pytest

import checkpoint as ck
from checkpoint import _assembly, _direct, _storage
from ckpt_testlib import AXIS, make_mesh, make_model
from sc_framework import FeatureSpec, TableSpec, stack_tables
from sc_framework.optimizers import Adagrad, Adam, RowWiseAdagrad
from tests.numerics import assert_same_bits

TABLES = [("a", 64, 12), ("b", 120, 10), ("c", 40, 16), ("d", 200, 8)]


def _saved(
    tmp_path, optimizer=RowWiseAdagrad(), groups=(("a", "b"), ("c",), ("d",)), devices=8, shards=1
):
  model = make_model([spec + (optimizer,) for spec in TABLES], seed=1)
  layout = model.layout([list(g) for g in groups], devices, shards)
  tables, slots = model.state(layout)
  path = tmp_path / "ckpt"
  with ocp.Checkpointer(ck.EmbeddingCheckpointHandler()) as ckptr:
    ckptr.save(path, args=ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout)))
  return model, layout, path


def _restore(path, layout, **kwargs):
  args = ck.EmbeddingRestore(layout, make_mesh(layout.num_devices), AXIS, **kwargs)
  return ck.EmbeddingCheckpointHandler().restore(path, args)


@pytest.mark.parametrize("target", [(2, 4), (4, 2), (1, 1), (8, 1), (2, 1), (4, 1)])
@pytest.mark.parametrize("optimizer", [RowWiseAdagrad(), Adam()], ids=lambda o: o.kind)
def test_restore_into_other_device_counts(tmp_path, target, optimizer):
  model, _, path = _saved(tmp_path, optimizer)
  layout = model.layout([["a", "b"], ["c"], ["d"]], *target)
  restored = _restore(path, layout)
  model.check(layout, restored.tables, restored.slots)
  for name, array in restored.tables.items():
    assert array.sharding.mesh.shape[AXIS] == target[0]
    assert array.shape == layout.stack(name).shape


def test_restore_from_shards_per_device_into_one_device(tmp_path):
  model, _, path = _saved(tmp_path, Adagrad(), devices=2, shards=4)
  layout = model.layout([["a", "b"], ["c"], ["d"]], 8, 1)
  restored = _restore(path, layout)
  model.check(layout, restored.tables, restored.slots)


@pytest.mark.parametrize(
    "groups", [[["a"], ["b", "c"], ["d"]], [["c", "a", "b"], ["d"]], [["a"], ["b"], ["c"], ["d"]]]
)
@pytest.mark.parametrize("target", [(8, 1), (2, 2)])
def test_restore_into_other_stacking_groups(tmp_path, groups, target):
  model, _, path = _saved(tmp_path, Adam())
  layout = model.layout(groups, *target)
  restored = _restore(path, layout)
  assert set(restored.tables) == set(layout.stack_names)
  model.check(layout, restored.tables, restored.slots)


def test_fast_path_is_taken_exactly_when_placement_is_unchanged(tmp_path):
  model, saved_layout, path = _saved(tmp_path)
  reader = ck.CheckpointReader(path)
  same = _assembly.assemble_stacked(reader, saved_layout)
  assert all(assembly.same_placement_group == name for name, assembly in same.items())
  # (8,1) -> (2,4): N is unchanged, so single-table stacks keep their rows; the
  # second table of 'a__b' gets rotation 4 instead of 1, so that stack is rebuilt.
  other = _assembly.assemble_stacked(reader, model.layout([["a", "b"], ["c"], ["d"]], 2, 4))
  assert other["c"].same_placement_group == "c" and other["d"].same_placement_group == "d"
  assert other["a__b"].same_placement_group is None


def test_each_device_reads_only_the_rows_it_owns(tmp_path, monkeypatch):
  model, _, path = _saved(tmp_path)
  layout = model.layout([["c", "b", "a"], ["d"]], 4, 1)
  reads = []
  original = _storage.copy_rows

  def recording(store, rows, out, out_rows, columns):
    reads.append(np.asarray(rows).copy())
    return original(store, rows, out, out_rows, columns)

  monkeypatch.setattr(_storage, "copy_rows", recording)
  direct = _direct.gather_rows_direct

  def recording_direct(path, shape, chunk_rows, rows, out, out_rows, columns, cache=None):
    reads.append(np.asarray(rows).copy())
    return direct(path, shape, chunk_rows, rows, out, out_rows, columns, cache)

  monkeypatch.setattr(_direct, "gather_rows_direct", recording_direct)
  strided = _direct.copy_strided_direct

  def recording_strided(path, shape, chunk_rows, runs, out, columns, cache=None):
    rows = [row + step * np.arange(count) for row, step, count, _, _ in runs]
    reads.append(np.concatenate([np.zeros(0, np.int64)] + rows))
    return strided(path, shape, chunk_rows, runs, out, columns, cache)

  monkeypatch.setattr(_direct, "copy_strided_direct", recording_strided)
  restored = _restore(path, layout)
  model.check(layout, restored.tables, restored.slots)
  # Table and slot arrays: every logical row of every table is read exactly
  # once over all devices, and nothing else (no padding, no other device's rows).
  total_rows = sum(v for _, v, _ in TABLES)
  assert sum(r.size for r in reads) == 2 * total_rows
  assert all(np.unique(r).size == r.size for r in reads)
  # Each read serves one (device block, table): at most 4 devices x 4 tables x 2 arrays.
  assert len(reads) == 4 * 4 * 2


def test_restore_a_subset_of_the_tables(tmp_path):
  model, _, path = _saved(tmp_path)
  features = [f for f in model.features if f.table.name in ("b", "c", "d")]
  layout = stack_tables(features, [["c", "b"], ["d"]], 2, 2)
  restored = _restore(path, layout)
  model.check(layout, restored.tables, restored.slots)


def test_slot_mismatch_is_an_error_or_an_explicit_reset(tmp_path):
  model, _, path = _saved(tmp_path, Adam())
  layout = model.layout([["a", "b"], ["c"], ["d"]], 4, 2)
  adagrad_slots = {name: Adagrad(initial_accumulator=0.3).slots() for name in layout.stack_names}
  with pytest.raises(
      ck.SlotMismatchError, match=r"stack 'a__b'.*\('accumulator', None\).*\('mu', None\).*reset"
  ):
    _restore(path, layout, slot_specs=adagrad_slots)
  restored = _restore(path, layout, slot_specs=adagrad_slots, on_slot_mismatch="reset")
  model.check(layout, restored.tables)
  for name in layout.stack_names:
    assert set(restored.slots[name]) == {"accumulator"}
    accumulator = np.asarray(restored.slots[name]["accumulator"])
    assert accumulator.shape == layout.stack(name).shape
    assert_same_bits(accumulator, np.full(accumulator.shape, 0.3, np.float32))
  # Matching declarations restore normally.
  same = {name: Adam(learning_rate=0.5).slots() for name in layout.stack_names}
  restored = _restore(path, layout, slot_specs=same)
  model.check(layout, restored.tables, restored.slots)


def test_merging_stacks_saved_with_different_optimizers_is_an_error(tmp_path):
  model = make_model([("a", 64, 16, Adam()), ("b", 64, 16, Adagrad())])
  layout = model.layout([["a"], ["b"]], 8)
  tables, slots = model.state(layout)
  path = tmp_path / "ckpt"
  with ocp.Checkpointer(ck.EmbeddingCheckpointHandler()) as ckptr:
    ckptr.save(path, args=ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout)))
  same_optimizer = [FeatureSpec(f"f_{n}", TableSpec(n, 64, 16), (16,)) for n in ("a", "b")]
  merged = stack_tables(same_optimizer, [["a", "b"]], 8)
  with pytest.raises(ck.SlotMismatchError, match="'a' and 'b'.*different optimizer slots"):
    _restore(path, merged)


def test_a_conversion_merging_tables_of_two_optimizers_names_them_and_what_to_do(tmp_path):
  """The message named SlotSpec reprs and advised `slot_specs`, which convert lacks."""
  model = make_model([("a", 64, 16, Adagrad()), ("b", 64, 16, RowWiseAdagrad())])
  layout = model.layout([["a"], ["b"]], 2)
  tables, slots = model.state(layout)
  optimizers = {"a": Adagrad(), "b": RowWiseAdagrad()}
  with ck.CheckpointManager(tmp_path / "run") as mngr:
    mngr.save(1, ck.EmbeddingSave(tables, slots, layout, optimizers=optimizers))
  merged = stack_tables(
      [FeatureSpec(f"f_{n}", TableSpec(n, 64, 16), (16,)) for n in ("a", "b")], [["a", "b"]], 2)
  with pytest.raises(ck.SlotMismatchError) as error:
    ck.convert(tmp_path / "run" / "1", tmp_path / "out", merged)
  message = str(error.value)
  for part in ("'a' (trained with 'adagrad') keeps [('accumulator', None)]",
               "'b' (trained with 'rowwise_adagrad') keeps [('accumulator', 1)]",
               "Stack them apart (other stacking groups: `--groups`", "on_slot_mismatch='reset'"):
    assert part in message, message
  assert "slot_specs" not in message and "SlotSpec(" not in message
