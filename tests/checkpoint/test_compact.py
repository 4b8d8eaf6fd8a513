"""`compact`, and recovery from a compaction a crash interrupted.

The oracle: the logical numpy tables of `ckpt_testlib.Model` saved at every
step of a delta chain; every state a crash can leave between the writes and
renames of `compact` must resolve, when a writable manager opens the root, to
a step that restores bit for bit as saved, with no leftover beside it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings

import numpy as np
import pytest

import checkpoint as ck
from checkpoint._compact import COMPACTING_SUFFIX, REPLACED_SUFFIX, compact
from ckpt_testlib import make_model, touch_rows
from sc_framework.optimizers import SGD, RowWiseAdagrad
from tests.numerics import assert_same_bits

SPECS = [("a", 48, 8, RowWiseAdagrad()), ("b", 64, 6, RowWiseAdagrad()), ("c", 40, 8, SGD())]
STEPS = 4
STEP = 2  # The step compacted: a delta with parent 1, itself the parent of step 3.


def _chain(root, seed):
  """Saves steps 0..3 as a chain (0 full, then deltas); returns the logical states."""
  model = make_model(SPECS, seed=seed)
  layout = model.layout([["a", "b"], ["c"]], 2, 1)
  rng = np.random.default_rng(seed)
  tracker = ck.UpdatedRows(layout)
  states = {}
  with ck.CheckpointManager(root, keep_latest=10, incremental=ck.IncrementalPolicy()) as manager:
    for step in range(STEPS):
      if step:
        touch_rows(model, layout, tracker, rng, 0.1)
      tables, slots = model.state(layout)
      assert manager.save(step, ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout)),
                          updated_rows=tracker, force=True)
      manager.wait_until_finished()
      states[step] = {name: table.copy() for name, table in model.logical.items()}
  return states


def _restores_as_saved(root, states):
  handler = ck.EmbeddingCheckpointHandler()
  for step in range(STEPS):
    restored = handler.restore(root / str(step) / "embedding", ck.TableRestore())
    for name, table in states[step].items():
      assert_same_bits(restored.tables[name], table)


def _is_full(step_dir):
  return "chain" not in ck.inspect(step_dir)["embedding"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A chain, and the same chain with step 2 compacted (both read-only templates)."""
  base = tmp_path_factory.mktemp("compact")
  states = _chain(base / "delta", seed=5)
  shutil.copytree(base / "delta", base / "compacted")
  assert compact(base / "compacted" / str(STEP)) is True
  assert _is_full(base / "compacted" / str(STEP)) and not _is_full(base / "delta" / str(STEP))
  # Written as <step>.compacting, it records the step it replaces.
  integrity = json.loads((base / "compacted" / str(STEP) / "integrity.json").read_text())
  assert integrity["step"] == STEP
  return base, states


def test_compact_makes_a_full_step_that_later_deltas_chain_through(saved, tmp_path):
  base, states = saved
  root = tmp_path / "root"
  shutil.copytree(base / "compacted", root)
  assert sorted(os.listdir(root)) == [str(s) for s in range(STEPS)]
  shutil.rmtree(root / "0")
  shutil.rmtree(root / "1")  # Steps 2 and 3 no longer need them.
  handler = ck.EmbeddingCheckpointHandler()
  for step in (2, 3):
    restored = handler.restore(root / str(step) / "embedding", ck.TableRestore())
    for name, table in states[step].items():
      assert_same_bits(restored.tables[name], table)
  assert compact(root / str(STEP)) is False  # Already full.


def _crash_states():
  """name -> (entries to place: name in the root -> template step dir ('delta'/'compacted'),
  whether step 2 ends full)."""
  step, staged, replaced = str(STEP), f"{STEP}{COMPACTING_SUFFIX}", f"{STEP}{REPLACED_SUFFIX}"
  return {
      "before the first rename": ({step: "delta", staged: "compacted"}, False),
      "while convert wrote the copy": ({step: "delta", staged + ".orbax-checkpoint-tmp": "half"},
                                       False),
      "between the renames": ({replaced: "delta", staged: "compacted"}, True),
      "between the renames, copy damaged": ({replaced: "delta", staged: "damaged"}, False),
      "after the first rename, no copy": ({replaced: "delta"}, False),
      "before the old step was deleted": ({step: "compacted", replaced: "delta"}, True),
  }


@pytest.mark.parametrize("case", list(_crash_states()))
def test_a_writable_manager_resolves_an_interrupted_compaction(saved, tmp_path, case):
  base, states = saved
  entries, ends_full = _crash_states()[case]
  root = tmp_path / "root"
  root.mkdir()
  for step in range(STEPS):
    if step != STEP:
      shutil.copytree(base / "delta" / str(step), root / str(step))
  for name, template in entries.items():
    source = base / ("compacted" if template in ("half", "damaged") else template) / str(STEP)
    shutil.copytree(source, root / name)
    if template == "half":
      shutil.rmtree(root / name / "embedding")
    if template == "damaged":
      victim = next(p for p in sorted((root / name).rglob("*")) if p.is_file() and
                    p.name.endswith(".json") and p.parent.name == "embedding")
      victim.write_text(victim.read_text() + " ")
  # A read-only manager changes nothing.
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    ck.CheckpointManager(root, read_only=True).close()
  assert sorted(os.listdir(root)) == sorted([str(s) for s in range(STEPS) if s != STEP] +
                                            list(entries))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with ck.CheckpointManager(root, keep_latest=10) as manager:
      assert manager.all_steps() == list(range(STEPS))
  assert sorted(os.listdir(root)) == [str(s) for s in range(STEPS)]
  renamed_back = str(STEP) not in entries
  assert any("interrupted compaction" in str(w.message) for w in caught) == renamed_back
  assert not any("no save wrote" in str(w.message) for w in caught)
  assert _is_full(root / str(STEP)) == ends_full
  _restores_as_saved(root, states)


def test_compact_resolves_its_own_interrupted_run_first(saved, tmp_path):
  base, states = saved
  root = tmp_path / "root"
  shutil.copytree(base / "delta", root)
  os.rename(root / str(STEP), root / f"{STEP}{REPLACED_SUFFIX}")
  with pytest.warns(RuntimeWarning, match="interrupted compaction"):
    assert compact(root / str(STEP)) is True
  assert sorted(os.listdir(root)) == [str(s) for s in range(STEPS)]
  assert _is_full(root / str(STEP))
  _restores_as_saved(root, states)


def test_nothing_is_removed_beside_a_link_in_the_steps_place(saved, tmp_path):
  base, _ = saved
  root = tmp_path / "root"
  shutil.copytree(base / "delta", root)
  os.rename(root / str(STEP), root / f"{STEP}{REPLACED_SUFFIX}")
  shutil.copytree(base / "compacted" / str(STEP), tmp_path / "elsewhere")
  os.symlink(tmp_path / "elsewhere", root / str(STEP))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    ck.CheckpointManager(root, keep_latest=10).close()
  assert os.path.islink(root / str(STEP))
  assert _is_full(tmp_path / "elsewhere") and not _is_full(root / f"{STEP}{REPLACED_SUFFIX}")


def test_a_damaged_chunk_that_later_deltas_rewrote_is_refused_by_convert_and_compact(tmp_path):
  """Step 2 rewrites every row of step 1's delta, so converting step 2 never reads step 1's
  chunks: a damaged one went unnoticed, and the output verified clean."""
  model = make_model(SPECS, seed=9)
  layout = model.layout([["a", "b"], ["c"]], 2, 1)
  rng = np.random.default_rng(9)
  tracker = ck.UpdatedRows(layout)
  root = tmp_path / "root"
  policy = ck.IncrementalPolicy(max_delta_share=1.0)
  with ck.CheckpointManager(root, keep_latest=10, incremental=policy) as manager:
    for step, share in enumerate([0.0, 0.1, 1.0]):
      if step:
        touch_rows(model, layout, tracker, rng, share)
      tables, slots = model.state(layout)
      manager.save(step, ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout)),
                   updated_rows=tracker, force=True)
      manager.wait_until_finished()
  assert [link["kind"] for link in ck.inspect(root / "2")["embedding"]["chain"]] == [
      "full", "delta", "delta"]
  chunk = next(p for p in sorted((root / "1" / "embedding").rglob("*"))
               if p.is_file() and "/table/c/" in str(p))
  data = bytearray(chunk.read_bytes())
  data[len(data) // 2] ^= 0x5A
  chunk.write_bytes(bytes(data))
  assert [p.path for p in ck.verify(root) if p.severity == "error"] == [chunk]
  with pytest.raises(ck.CorruptCheckpointError, match=rf"{re.escape(str(chunk))}: chunk checksum"
                                                      r" mismatch"):
    ck.convert(root / "2", tmp_path / "converted", ck.relayout(layout, num_devices=1))
  assert not (tmp_path / "converted").exists()
  with pytest.raises(ck.CorruptCheckpointError, match=rf"{re.escape(str(chunk))}: chunk checksum"
                                                      r" mismatch"):
    compact(root / "2")
  assert not _is_full(root / "2")


def test_an_interrupted_compaction_on_storage_that_refuses_renames_is_left_with_a_warning(
    saved, tmp_path, monkeypatch):
  """On read-only storage, opening a manager (as evaluate and predict do) raised the
  rename's "Read-only file system"; a manager that can write finishes it later."""
  import errno
  from etils import epath
  base, states = saved
  root = tmp_path / "root"
  shutil.copytree(base / "delta", root)
  os.rename(root / str(STEP), root / f"{STEP}{REPLACED_SUFFIX}")
  local_path = type(epath.Path(root))

  def read_only(self, target):
    raise OSError(errno.EROFS, "Read-only file system", os.fspath(self))

  monkeypatch.setattr(local_path, "rename", read_only)
  with pytest.warns(RuntimeWarning) as caught:
    with ck.CheckpointManager(root, keep_latest=10) as manager:
      assert STEP not in manager.all_steps() and manager.latest_step() == STEP - 1
  # The compaction left as it is, its replaced step named, and the delta after it skipped.
  said = [str(warning.message) for warning in caught]
  for expected in (rf"{STEP}: a compaction interrupted there could not be finished \(.*Read-only"
                   " file system", rf"holds entries no save wrote: .*{STEP}{REPLACED_SUFFIX}",
                   rf"step .*{STEP + 1} is skipped: step {STEP} is missing or incomplete"):
    assert any(re.search(expected, message) for message in said), (expected, said)
  monkeypatch.undo()
  with pytest.warns(RuntimeWarning, match="interrupted compaction"):
    with ck.CheckpointManager(root, keep_latest=10) as manager:
      assert manager.all_steps() == list(range(STEPS))
  _restores_as_saved(root, states)


def test_a_missing_step_is_named_as_missing(tmp_path):
  """It was called 'not an Orbax step directory', as a root or an item is."""
  with pytest.raises(ck.NotACheckpointError,
                     match=f"{re.escape(str(tmp_path / 'ckpt' / '3'))} does not exist; compact"
                           " takes a step"):
    compact(tmp_path / "ckpt" / "3")
  assert not (tmp_path / "ckpt").exists()
