"""Incremental (delta) checkpoints against full saves of the same states.

The oracle: the logical per-table numpy arrays of `ckpt_testlib.Model`,
changed by random row updates (tables and slots) between saves; the rows each
update touches are recorded independently of the code under test (from the
logical rows through the layout formula). Every step saved as a delta must
restore bit for bit as the full save of the same state does.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
from etils import epath

import checkpoint as ck
from checkpoint import _integrity as integrity
from checkpoint import cli
from checkpoint._compact import compact
from ckpt_testlib import AXIS, make_mesh, make_model, touch_rows
from sc_framework.optimizers import SGD, RowWiseAdagrad
from sc_framework.stacking import logical_to_global_rows
from tests.numerics import assert_same_bits

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPECS = [("a", 64, 12, RowWiseAdagrad()), ("b", 120, 10, RowWiseAdagrad()), ("c", 40, 8, SGD())]


def _save(mngr, step, model, layout, tracker=None):
  tables, slots = model.state(layout)
  embedding = ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout))
  assert mngr.save(step, embedding, updated_rows=tracker, force=True)
  mngr.wait_until_finished()


def _same(restored_a, restored_b):
  for name in restored_a.tables:
    assert_same_bits(np.asarray(restored_a.tables[name]), np.asarray(restored_b.tables[name]))
    for slot in restored_a.slots[name]:
      assert_same_bits(
          np.asarray(restored_a.slots[name][slot]), np.asarray(restored_b.slots[name][slot])
      )


def _train_side_by_side(tmp_path, num_devices, *, steps=5, seed=0, share=0.1, full_every=10):
  """Saves every step of one run twice: incremental and full. Returns the managers' roots."""
  model = make_model(SPECS, seed=seed)
  layout = model.layout([["a", "b"], ["c"]], num_devices, 1)
  rng = np.random.default_rng(seed + 1)
  tracker = ck.UpdatedRows(layout)
  policy = ck.IncrementalPolicy(full_every=full_every)
  delta_root, full_root = tmp_path / "delta", tmp_path / "full"
  states = {}
  with ck.CheckpointManager(delta_root, keep_latest=100, incremental=policy) as incremental, \
      ck.CheckpointManager(full_root, keep_latest=100) as full:
    for step in range(steps):
      if step:
        touch_rows(model, layout, tracker, rng, share)
      _save(incremental, step, model, layout, tracker)
      _save(full, step, model, layout)
      states[step] = ({k: v.copy() for k, v in model.logical.items()})
  return model, layout, delta_root, full_root, states


@pytest.mark.parametrize("num_devices", [1, 8])
def test_every_delta_step_restores_like_the_full_save(tmp_path, num_devices):
  model, layout, delta_root, full_root, states = _train_side_by_side(tmp_path, num_devices)
  kinds = [ck.inspect(delta_root / str(s))["embedding"].get("chain", [{}])[-1].get("kind", "full")
           for s in range(5)]
  assert kinds == ["full", "delta", "delta", "delta", "delta"]
  other = model.layout([["a"], ["b"], ["c"]], 2 if num_devices == 8 else 4, 2)
  with ck.CheckpointManager(delta_root, read_only=True) as delta, \
      ck.CheckpointManager(full_root, read_only=True) as full:
    for step in range(5):
      for target in (layout, other):
        args = ck.EmbeddingRestore(target, make_mesh(target.num_devices), AXIS)
        _same(delta.restore(step, args)["embedding"], full.restore(step, args)["embedding"])
  handler = ck.EmbeddingCheckpointHandler()
  for step in range(5):
    rows = {"b": (7, 93)}
    a = handler.restore(delta_root / str(step) / "embedding", ck.TableRestore(rows=rows))
    b = handler.restore(full_root / str(step) / "embedding", ck.TableRestore(rows=rows))
    assert_same_bits(a.tables["b"], b.tables["b"])
    assert_same_bits(a.tables["b"], states[step]["b"][7:93])
    assert_same_bits(a.slots["b"]["accumulator"], b.slots["b"]["accumulator"])
    every = handler.restore(delta_root / str(step) / "embedding", ck.TableRestore())
    for name, table in states[step].items():
      assert_same_bits(every.tables[name], table)


def _table_state(root, step):
  handler = ck.EmbeddingCheckpointHandler()
  return handler.restore(root / str(step) / "embedding", ck.TableRestore())


def test_retention_keeps_every_chain_whole(tmp_path):
  model = make_model(SPECS, seed=3)
  layout = model.layout([["a", "b"], ["c"]], 4, 1)
  rng = np.random.default_rng(4)
  tracker = ck.UpdatedRows(layout)
  states = {}
  policy = ck.IncrementalPolicy(full_every=4)
  with ck.CheckpointManager(tmp_path, keep_latest=2, incremental=policy) as mngr:
    for step in range(7):
      if step:
        touch_rows(model, layout, tracker, rng, 0.05)
      _save(mngr, step, model, layout, tracker)
      states[step] = {k: v.copy() for k, v in model.logical.items()}
    # Saves: 0 full, 1-3 deltas, 4 full, 5-6 deltas. The latest two (5, 6) need 4.
    assert mngr.all_steps() == [4, 5, 6]
  for step in (4, 5, 6):
    restored = _table_state(tmp_path, step)
    for name, table in states[step].items():
      assert_same_bits(restored.tables[name], table)


def test_a_missing_delta_is_named_and_latest_falls_back(tmp_path):
  model, layout, delta_root, _, states = _train_side_by_side(tmp_path, 2, steps=4)
  shutil.rmtree(delta_root / "2")
  with pytest.raises(ck.BrokenChainError, match=r"step 2 is missing.*delta step 3 needs it"):
    _table_state(delta_root, 3)
  with pytest.raises(ck.BrokenChainError, match="step 2 is missing"):
    ck.inspect(delta_root / "3")
  args = ck.EmbeddingRestore(layout, make_mesh(2), AXIS)
  with ck.CheckpointManager(delta_root, read_only=True) as mngr:
    with pytest.warns(RuntimeWarning, match="skipped: step 2 is missing"):
      assert mngr.latest_step() == 1  # What a Trainer resumes from.
    with warnings.catch_warnings(record=True) as again:
      warnings.simplefilter("always")
      restored = mngr.restore(None, args)["embedding"]  # Step 3 is broken: 1 is the newest.
    assert not [w for w in again if "skipped" in str(w.message)]  # Named once per manager.
  expected = {}
  for name in states[1]:
    expected[name] = states[1][name]
  from sc_framework.stacking import unstack  # pylint: disable=g-import-not-at-top
  host = unstack({k: np.asarray(v) for k, v in restored.tables.items()}, layout)
  for name, table in expected.items():
    assert_same_bits(host[name], table)


def test_a_table_missing_from_a_delta_step_is_named_against_that_step(tmp_path):
  """The error named the chain's base (step 0), not the step asked for."""
  _, _, delta_root, _, _ = _train_side_by_side(tmp_path, 2, steps=3)
  item = delta_root / "2" / "embedding"
  assert ck.inspect(delta_root / "2")["embedding"]["chain"][-1]["kind"] == "delta"
  with pytest.raises(ck.MissingTableError,
                     match=rf"'nope' is not in the checkpoint {re.escape(str(item))};"):
    ck.EmbeddingCheckpointHandler().restore(item, ck.TableRestore(tables=["nope"]))


def _edit_parent(root, step, parent):
  """Points delta `step` at another parent by editing its manifest (not its integrity.json)."""
  path = root / str(step) / "embedding" / "manifest.json"
  text = path.read_text()
  edited = re.sub(r'"parent_step": *\d+', f'"parent_step": {parent}', text)
  assert edited != text
  path.write_text(edited)


# The manager also warns about the damaged steps it skips while listing them.
@pytest.mark.filterwarnings("ignore:checkpoint step .* is skipped:RuntimeWarning")
def test_an_edited_earlier_delta_is_caught_by_restore_verify_and_the_fallback(tmp_path):
  """A delta names its parent by step number only: an edit of an earlier link
  must fail that link's integrity manifest, not restore tables of no step."""
  _, layout, delta_root, _, states = _train_side_by_side(tmp_path, 2, steps=5)
  _edit_parent(delta_root, 2, 0)  # step 2's parent was 1
  args = ck.EmbeddingRestore(layout, make_mesh(2), AXIS)
  with ck.CheckpointManager(delta_root, read_only=True) as mngr:
    with pytest.raises(ck.CorruptCheckpointError,
                       match=r"(?s)delta chain of checkpoint step 4 \(its earlier steps.*2/embedding/"
                             r"manifest.json: checksum mismatch"):
      mngr.restore(4, args)
    with pytest.warns(RuntimeWarning, match="skipped"):
      restored = mngr.restore(None, args)["embedding"]  # 4, 3 and 2 are damaged: 1 is used
  from sc_framework.stacking import unstack  # pylint: disable=g-import-not-at-top
  host = unstack({k: np.asarray(v) for k, v in restored.tables.items()}, layout)
  for name, table in states[1].items():
    assert_same_bits(host[name], table)
  problems = ck.verify(delta_root / "4")
  assert any("2/embedding/manifest.json" in str(p.path) for p in problems if p.severity == "error")


@pytest.mark.filterwarnings("ignore:checkpoint step .* is skipped:RuntimeWarning")
def test_an_edited_parent_that_does_not_exist_names_the_edited_manifest(tmp_path):
  """A delta edited to name a step that is not there: every reader names the damaged
  manifest.json, not the missing step (which never held this chain's base)."""
  _, layout, delta_root, _, _ = _train_side_by_side(tmp_path, 2, steps=5)
  _edit_parent(delta_root, 2, 0)  # step 2's parent was 1
  shutil.rmtree(delta_root / "0")
  damaged = r"(?s)delta chain of step 2 cannot be followed.*2/embedding/manifest\.json"
  with ck.CheckpointManager(delta_root, read_only=True) as mngr:
    with pytest.raises(ck.BrokenChainError, match=damaged):
      mngr.restore(4, ck.EmbeddingRestore(layout, make_mesh(2), AXIS))
  for call in (lambda: ck.inspect(delta_root / "4"), lambda: compact(delta_root / "4"),
               lambda: ck.convert(delta_root / "4", tmp_path / "out", "unstacked")):
    with pytest.raises(ck.BrokenChainError, match=damaged):
      call()
  assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["swapped for a full step's", "deleted"])
def test_compact_of_a_step_whose_manifest_was_swapped_or_lost_is_refused(tmp_path, damage,
                                                                         capsys):
  """Whether a step is a delta is read from its manifest: a full step's manifest
  copied over a delta's is damage, not an "already full" step; a lost one is damage,
  not a step without an embedding item (which reads as a usage error)."""
  _, _, delta_root, _, _ = _train_side_by_side(tmp_path, 2, steps=3)
  delta, full = delta_root / "2" / "embedding", delta_root / "0" / "embedding"
  assert ck.inspect(delta_root / "2")["embedding"]["chain"][-1]["kind"] == "delta"
  if damage == "deleted":
    (delta / "manifest.json").unlink()
  else:
    shutil.copyfile(full / "manifest.json", delta / "manifest.json")
  before = sorted(str(p.relative_to(delta_root)) for p in delta_root.rglob("*"))
  with pytest.raises(ck.CorruptCheckpointError, match=r"2/embedding/manifest\.json"):
    compact(delta_root / "2")
  assert cli.main(["compact", str(delta_root / "2"), "--quiet"]) == 1
  assert f"{delta / 'manifest.json'}: " in capsys.readouterr().err
  assert sorted(str(p.relative_to(delta_root)) for p in delta_root.rglob("*")) == before


@pytest.mark.filterwarnings("ignore:checkpoint step .* is skipped:RuntimeWarning")
def test_inspect_of_a_root_describes_the_newest_step_whose_chain_can_be_read(tmp_path, capsys):
  """A delta's earlier step that lost its integrity.json made `inspect ROOT` fail whole,
  in convert's words, although restores fall back past that delta."""
  _, _, delta_root, _, _ = _train_side_by_side(tmp_path, 2, steps=4)
  (delta_root / "2" / "integrity.json").unlink()
  assert cli.main(["inspect", str(delta_root)]) == 0
  out = capsys.readouterr().out
  assert "steps: [0, 1, 3]  latest: 1" in out, out
  assert (f"step 3 cannot be read (skipped): checkpoint step {delta_root / '2'}, an earlier"
          f" step of the delta chain of {delta_root / '3' / 'embedding'}, has no") in out
  assert cli.main(["inspect", str(delta_root / "3")]) == 1
  assert "it is not inspected, as it is not restored" in capsys.readouterr().err


def test_inspect_of_a_root_whose_every_chain_is_broken_names_the_newest_once(tmp_path, capsys):
  """The message repeated the whole chain's error for every step, in one line."""
  _, _, delta_root, _, _ = _train_side_by_side(tmp_path, 2, steps=4)
  shutil.rmtree(delta_root / "0")
  assert cli.main(["inspect", str(delta_root)]) == 1
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.count("base first") == 1, err
  assert "holds no step that can be described: step 3: step 0 is missing" in err, err
  assert (f"Nor can the older steps 2, 1 be described (`sc-checkpoint verify {delta_root}`"
          " names the problem of each).") in err, err


def test_the_handler_refuses_a_delta_whose_step_lost_its_integrity_manifest(tmp_path):
  """A delta records, in the state it keeps, that its step was given one."""
  _, _, delta_root, _, _ = _train_side_by_side(tmp_path, 2, steps=3)
  item = delta_root / "2" / "embedding"
  assert json.loads((item / "manifest.json").read_text())["state"]["step_integrity"] is True
  (delta_root / "2" / "integrity.json").unlink()
  with pytest.raises(ck.CorruptCheckpointError, match=r"2 has no integrity.json, but its item"):
    ck.EmbeddingCheckpointHandler().restore(item, ck.TableRestore())


def test_verify_of_a_step_follows_its_chain(tmp_path):
  _, _, delta_root, _, _ = _train_side_by_side(tmp_path, 2, steps=4)
  assert not [p for p in ck.verify(delta_root / "3") if p.severity == "error"]
  shutil.rmtree(delta_root / "1")
  for path in (delta_root / "3", delta_root):
    errors = [p for p in ck.verify(path) if p.severity == "error"]
    assert any("delta chain is broken: step 1 is missing" in p.message for p in errors), errors


def test_verify_of_a_delta_item_reads_it_as_its_chain(tmp_path):
  """A delta item inside a step is checked as its step is, not refused as no checkpoint."""
  _, _, delta_root, _, _ = _train_side_by_side(tmp_path, 2, steps=4)
  item = delta_root / "3" / "embedding"
  assert not [p for p in ck.verify(item) if p.severity == "error"]
  _edit_parent(delta_root, 2, 0)  # An earlier link of item's chain, edited.
  errors = [p for p in ck.verify(item) if p.severity == "error"]
  assert any("2/embedding/manifest.json" in str(p.path) for p in errors), errors
  _edit_parent(delta_root, 2, 1)  # Undone: the step verifies again.
  assert not [p for p in ck.verify(item) if p.severity == "error"]
  shutil.rmtree(delta_root / "1")
  errors = [p for p in ck.verify(item) if p.severity == "error"]
  assert any("delta chain is broken: step 1 is missing" in p.message for p in errors), errors


def test_adopt_of_a_delta_step_without_integrity_manifest_checks_its_parts(tmp_path, capsys):
  """`verify --adopt` of a delta step written before integrity manifests existed: it
  read the delta item as a full one ("not an embedding checkpoint manifest")."""
  from checkpoint.cli import main

  _, _, delta_root, _, _ = _train_side_by_side(tmp_path, 2, steps=4)
  step = delta_root / "3"
  before = _table_state(delta_root, 3)
  (step / "integrity.json").unlink()
  assert main(["verify", "--adopt", str(step)]) == 0, capsys.readouterr()
  assert (step / "integrity.json").exists()
  _same(_table_state(delta_root, 3), before)
  (step / "integrity.json").unlink()
  chunk = next(path for path in sorted((step / "embedding" / "stacks").rglob("*"))
               if path.is_file() and path.parent.parent.name == "c"
               and path.parent.parent.parent.name == "table")
  data = bytearray(chunk.read_bytes())
  data[len(data) // 2] ^= 0x40
  chunk.write_bytes(bytes(data))
  assert main(["verify", "--adopt", str(step)]) != 0
  assert not (step / "integrity.json").exists()


def test_a_failed_delta_save_leaves_the_previous_step_and_restarts_the_chain(tmp_path, monkeypatch):
  from checkpoint import _delta  # pylint: disable=g-import-not-at-top

  model = make_model(SPECS, seed=5)
  layout = model.layout([["a", "b"], ["c"]], 2, 1)
  tracker = ck.UpdatedRows(layout)
  rng = np.random.default_rng(6)
  with ck.CheckpointManager(tmp_path, incremental=ck.IncrementalPolicy()) as mngr:
    _save(mngr, 0, model, layout, tracker)
    before = {k: v.copy() for k, v in model.logical.items()}
    touch_rows(model, layout, tracker, rng, 0.1)

    async def failing_commit(future):
      del future
      raise OSError("disk full (simulated)")

    monkeypatch.setattr(_delta, "_commit", failing_commit)
    tables, slots = model.state(layout)
    assert mngr.save(1, ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout)),
                     updated_rows=tracker)
    with pytest.raises(Exception, match="disk full"):
      mngr.wait_until_finished()
    monkeypatch.undo()
    assert mngr.all_steps() == [0]
    restored = _table_state(tmp_path, 0)
    for name, table in before.items():
      assert_same_bits(restored.tables[name], table)
    touch_rows(model, layout, tracker, rng, 0.1)
    _save(mngr, 2, model, layout, tracker)  # The chain restarts: step 2 is full.
  assert "chain" not in ck.inspect(tmp_path / "2")["embedding"]
  for name, table in model.logical.items():
    assert_same_bits(_table_state(tmp_path, 2).tables[name], table)


_KILLED_DELTA_WRITER = textwrap.dedent("""
    import asyncio, sys
    import numpy as np
    import checkpoint as ck
    from checkpoint import _delta
    sys.path.insert(0, sys.argv[2])
    from ckpt_testlib import make_model
    from sc_framework.optimizers import RowWiseAdagrad

    model = make_model([("a", 4096, 16, RowWiseAdagrad())], seed=7)
    layout = model.layout([["a"]], 1)
    tracker = ck.UpdatedRows(layout)
    mngr = ck.CheckpointManager(sys.argv[1], incremental=ck.IncrementalPolicy())
    def save(step):
      tables, slots = model.state(layout)
      embedding = ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout))
      mngr.save(step, embedding, updated_rows=tracker, force=True)
    save(0)
    mngr.wait_until_finished()
    model.logical["a"][:100] += 1.0
    tracker.add("a", np.arange(100))
    save(1)
    mngr.wait_until_finished()
    model.logical["a"][50:300] -= 2.0
    tracker.add("a", np.arange(50, 300))
    real_commit = _delta._commit
    async def hanging_commit(future):
      await real_commit(future)
      print("WRITING", flush=True)  # Some rows are on disk; the rest never will be.
      while True:
        await asyncio.sleep(1)
    _delta._commit = hanging_commit
    save(2)
    while True:
      pass
    """)


def test_sigkill_during_a_delta_save_leaves_the_previous_step_restorable(tmp_path):
  env = dict(
      os.environ,
      PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
      JAX_PLATFORMS="cpu",
  )
  env.pop("XLA_FLAGS", None)
  here = os.path.dirname(os.path.abspath(__file__))
  process = subprocess.Popen(
      [sys.executable, "-c", _KILLED_DELTA_WRITER, str(tmp_path), here],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
  )
  try:
    line = process.stdout.readline()
    assert "WRITING" in line, process.stderr.read() if process.poll() is not None else line
  finally:
    process.send_signal(signal.SIGKILL)
    process.wait()
  with ck.CheckpointManager(tmp_path, incremental=ck.IncrementalPolicy()) as mngr:
    assert mngr.all_steps() == [0, 1]
  expected = make_model([("a", 4096, 16, RowWiseAdagrad())], seed=7).logical["a"]
  expected[:100] += 1.0
  assert_same_bits(_table_state(tmp_path, 1).tables["a"], expected)


def test_policy_chooses_full_and_delta():
  policy = ck.IncrementalPolicy(full_every=3, max_delta_share=0.2)
  assert policy.choose(None, 0.0) == "full"
  assert policy.choose(0, 0.1) == "delta"
  assert policy.choose(1, 0.1) == "delta"
  assert policy.choose(2, 0.1) == "full"
  assert policy.choose(0, 0.3) == "full"
  with pytest.raises(ValueError, match="max_delta_share"):
    ck.IncrementalPolicy(max_delta_share=0.0)
  with pytest.raises(ValueError, match="full_every"):
    ck.IncrementalPolicy(full_every=0)


def test_tracker_records_the_rows_of_preprocessed_batches():
  from sc_framework.preprocessing import preprocess  # pylint: disable=g-import-not-at-top

  model = make_model(SPECS, seed=8)
  layout = model.layout([["a", "b"], ["c"]], 4, 2)
  tracker = ck.UpdatedRows(layout)
  rng = np.random.default_rng(9)
  expected = {name: set() for name in layout.stack_names}
  for _ in range(3):
    ids = {
        f"f_{t}": rng.integers(0, spec.vocabulary_size, (16, 3))
        for t, spec in model.tables.items()
    }
    batch, _ = preprocess(ids, model.features, layout)
    tracker.add_batch(batch)
    for t in model.tables:
      rows = logical_to_global_rows(layout, t, ids[f"f_{t}"].reshape(-1))
      expected[layout.stack_of_table(t).name].update(np.asarray(rows).tolist())
  rows = tracker.rows()
  for name in layout.stack_names:
    np.testing.assert_array_equal(rows[name], sorted(expected[name]))
  assert tracker.count() == sum(len(v) for v in expected.values())
  tracker.clear()
  assert tracker.count() == 0
  with pytest.raises(ValueError, match=r"rows must be in \[0, "):
    tracker.add("c", [layout.stack("c").vocabulary_size])


def test_cli_inspects_converts_and_compacts_a_chain(tmp_path, capsys):

  model, layout, delta_root, full_root, states = _train_side_by_side(tmp_path, 2, steps=4)
  assert cli.main(["inspect", str(delta_root / "3")]) == 0
  text = capsys.readouterr().out
  assert "chain: base step 0 (full)" in text
  assert "chain: delta step 3 (parent 2), layout G=2 x S=1, rows a__b: " in text
  info = ck.inspect(delta_root / "3")["embedding"]["chain"]
  assert [link["step"] for link in info] == [0, 1, 2, 3]
  assert info[1]["rows"]["a__b"] == 6 + 12 and info[1]["rows"]["c"] == 4
  # Each link's id, and each delta's parent id, which is its parent's id.
  ids = [link["save_id"] for link in info]
  assert len(set(ids)) == 4 and all(ids)
  assert [link["parent_id"] for link in info[1:]] == ids[:-1]
  assert ck.inspect(delta_root / "3")["embedding"]["save_id"] == ids[-1]
  assert f"save id: {ids[-1]}" in text
  assert f"base step 0 (full) at {delta_root / '0' / 'embedding'}, id {ids[0]}" in text
  assert f", id {ids[3]}, parent id {ids[2]}" in text
  # convert: a delta step becomes a full checkpoint in the target layout.
  assert cli.main(["convert", str(delta_root / "2"), str(tmp_path / "conv"), "--num-devices",
                   "4", "--groups", "separate", "--quiet"]) == 0
  assert cli.main(["convert", str(full_root / "2"), str(tmp_path / "conv_full"), "--num-devices",
                   "4", "--groups", "separate", "--quiet"]) == 0
  handler = ck.EmbeddingCheckpointHandler()
  converted = handler.restore(tmp_path / "conv" / "embedding", ck.TableRestore())
  reference = handler.restore(tmp_path / "conv_full" / "embedding", ck.TableRestore())
  assert "chain" not in ck.inspect(tmp_path / "conv")["embedding"]
  for name in states[2]:
    assert_same_bits(converted.tables[name], reference.tables[name])
    assert_same_bits(converted.tables[name], states[2][name])
    for slot in reference.slots[name]:
      assert_same_bits(converted.slots[name][slot], reference.slots[name][slot])
  # compact: step 2 becomes full; step 3 now needs only step 2.
  assert cli.main(["compact", str(delta_root / "2"), "--quiet"]) == 0
  assert "chain" not in ck.inspect(delta_root / "2")["embedding"]
  shutil.rmtree(delta_root / "0")
  shutil.rmtree(delta_root / "1")
  for step in (2, 3):
    restored = _table_state(delta_root, step)
    for name, table in states[step].items():
      assert_same_bits(restored.tables[name], table)
  assert cli.main(["compact", str(delta_root / "2"), "--quiet"]) == 0  # Already full.


def test_a_chain_continues_in_another_layout_after_a_restore(tmp_path):
  model = make_model(SPECS, seed=11)
  first = model.layout([["a", "b"], ["c"]], 4, 1)
  second = model.layout([["a"], ["b"], ["c"]], 2, 2)
  rng = np.random.default_rng(12)
  states = {}
  policy = ck.IncrementalPolicy(max_delta_share=1.0)
  with ck.CheckpointManager(tmp_path, keep_latest=10, incremental=policy) as mngr:
    tracker = ck.UpdatedRows(first)
    for step in range(3):
      if step:
        touch_rows(model, first, tracker, rng, 0.2)
      _save(mngr, step, model, first, tracker)
      states[step] = {k: v.copy() for k, v in model.logical.items()}
  with ck.CheckpointManager(tmp_path, keep_latest=10, incremental=policy) as mngr:
    mngr.restore(2, ck.EmbeddingRestore(second, make_mesh(2), AXIS))  # Opens the chain at 2.
    tracker = ck.UpdatedRows(second)
    for step in (3, 4):
      touch_rows(model, second, tracker, rng, 0.2)
      _save(mngr, step, model, second, tracker)
      states[step] = {k: v.copy() for k, v in model.logical.items()}
  described = ck.inspect(tmp_path / "4")
  chain = described["embedding"]["chain"]
  assert [link["kind"] for link in chain] == ["full", "delta", "delta", "delta", "delta"]
  # Each delta names the layout its rows refer to: the base's, then the new one.
  assert [(link["layout"]["num_devices"], link["layout"]["shards_per_device"])
          for link in chain[1:]] == [(4, 1), (4, 1), (2, 2), (2, 2)]
  assert chain[3]["layout"]["stacks"] == {"a": ["a"], "b": ["b"], "c": ["c"]}
  text = ck.format_description(described)
  assert "layout (of base step 0): G=4 devices x S=1" in text
  assert "delta step 2 (parent 1), layout G=4 x S=1, rows" in text
  assert "delta step 3 (parent 2), layout G=2 x S=2 stacks a: a; b: b; c: c, rows" in text
  for step, expected in states.items():
    for layout in (first, second):
      restored = ck.EmbeddingCheckpointHandler().restore(
          tmp_path / str(step) / "embedding",
          ck.EmbeddingRestore(layout, make_mesh(layout.num_devices), AXIS))
      model.logical = expected
      model.check(layout, restored.tables)


def test_a_tracker_of_another_layout_is_refused_before_anything_is_written(tmp_path):
  """A tracker kept from before a restore into another layout holds global rows
  of the old one: in the new one they name other rows (here rows 2 and 3 of
  table a would have kept their old values in the delta). Same stack names and
  V_s, so only the layouts themselves tell."""
  model = make_model([("a", 64, 8, RowWiseAdagrad())], seed=13)
  old, new = model.layout([["a"]], 8, 1), model.layout([["a"]], 4, 1)
  assert old.stack("a").shape == new.stack("a").shape
  policy = ck.IncrementalPolicy(max_delta_share=1.0)
  with ck.CheckpointManager(tmp_path, keep_latest=10, incremental=policy) as mngr:
    _save(mngr, 0, model, new, ck.UpdatedRows(new))
    stale = ck.UpdatedRows(old)
    rows = np.array([1, 2, 3])
    model.logical["a"][rows] += 1.0
    stale.add("a", logical_to_global_rows(old, "a", rows))
    with pytest.raises(ValueError, match=r"updated_rows tracks the rows of another layout than"
                       r" the state being saved \(G=8, S=1.* against G=4, S=1"):
      _save(mngr, 1, model, new, stale)
    assert mngr.all_steps() == [0]
    tracker = ck.UpdatedRows(new)
    tracker.add("a", logical_to_global_rows(new, "a", rows))
    _save(mngr, 1, model, new, tracker)
  assert ck.inspect(tmp_path / "1")["embedding"]["chain"][-1]["kind"] == "delta"
  restored = ck.EmbeddingCheckpointHandler().restore(tmp_path / "1" / "embedding",
                                                     ck.TableRestore())
  assert_same_bits(restored.tables["a"], model.logical["a"])


def test_a_chains_base_converted_in_place_must_keep_its_deltas_readable(tmp_path, capsys):
  """Converting step 0 in place to bfloat16 under float32 deltas would leave
  steps 1 to 4 unrestorable: refused naming every one (not only the steps of the
  first chain found), step 0 untouched. Another layout keeps
  the tables as the chain has them: converted. A base replaced behind the
  converter's back is named by verify."""
  model = make_model(SPECS, seed=14)
  layout = model.layout([["a", "b"], ["c"]], 4, 1)
  rng = np.random.default_rng(15)
  tracker = ck.UpdatedRows(layout)
  root = tmp_path / "run"
  with ck.CheckpointManager(root, keep_latest=10,
                            incremental=ck.IncrementalPolicy(max_delta_share=1.0)) as mngr:
    for step in range(5):
      if step:
        touch_rows(model, layout, tracker, rng, 0.2)
      _save(mngr, step, model, layout, tracker)
  expected = {name: table.copy() for name, table in model.logical.items()}

  def newest():
    return ck.EmbeddingCheckpointHandler().restore(root / "4" / "embedding", ck.TableRestore())

  manifest = (root / "0" / "integrity.json").read_text()
  with pytest.raises(ValueError, match=r"converting .*/0 in place would break the delta steps"
                     r" \[1, 2, 3, 4\].*dtype float32 but its base .* has bfloat16"):
    ck.convert(root / "0", root / "0", layout, table_dtype="bfloat16", overwrite=True)
  assert (root / "0" / "integrity.json").read_text() == manifest
  assert sorted(os.listdir(root)) == ["0", "1", "2", "3", "4"]  # refused, nothing written
  assert cli.main(["convert", str(root / "0"), str(root / "0"), "--overwrite", "--quiet",
                   "--table-dtype", "bfloat16", "--groups", "same"]) == 1
  assert "would break the delta steps [1, 2, 3, 4]" in capsys.readouterr().err
  for name, table in newest().tables.items():
    assert_same_bits(table, expected[name], err_msg=name)

  ck.convert(root / "0", root / "0", model.layout([["a"], ["b"], ["c"]], 2, 2), overwrite=True)
  for name, table in newest().tables.items():
    assert_same_bits(table, expected[name], err_msg=name)
  assert cli.main(["verify", str(root)]) == 0

  ck.convert(root / "0", tmp_path / "bf16", layout, table_dtype="bfloat16")
  shutil.rmtree(root / "0")
  shutil.move(tmp_path / "bf16", root / "0")
  capsys.readouterr()
  assert cli.main(["verify", str(root)]) == 1
  out = capsys.readouterr().out
  assert "its delta chain is broken" in out and "bfloat16" in out, out


def _restored_tables(root, step):
  return ck.EmbeddingCheckpointHandler().restore(root / str(step) / "embedding", ck.TableRestore())


def _assert_state(restored, model):
  for name, table in model.logical.items():
    assert_same_bits(restored.tables[name], table, err_msg=name)
    for slot, values in model.slots[name].items():
      assert_same_bits(restored.slots[name][slot], values, err_msg=f"{name} {slot}")


@pytest.mark.parametrize("retention", [dict(keep_latest=1),
                                       dict(keep_latest=1, keep_best=1, best_metric="loss")])
def test_retention_of_one_step_keeps_the_base_of_the_newest_delta(tmp_path, retention):
  """Orbax chose what to delete inside the save, before the new delta's parent
  was recorded: it deleted the base, and the one step left did not restore."""
  model = make_model(SPECS, seed=16)
  layout = model.layout([["a", "b"], ["c"]], 1, 1)
  rng, tracker = np.random.default_rng(17), ck.UpdatedRows(layout)
  policy = ck.IncrementalPolicy(max_delta_share=1.0)
  with ck.CheckpointManager(tmp_path, incremental=policy, **retention) as mngr:  # async saves
    for step in range(3):
      if step:
        touch_rows(model, layout, tracker, rng, 0.1)
      tables, slots = model.state(layout)
      mngr.save(step, ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout)),
                updated_rows=tracker, force=True, metrics={"loss": 1.0 / (step + 1)})
      mngr.wait_until_finished()
    assert mngr.all_steps() == [0, 1, 2] and mngr.latest_step() == 2
    _assert_state(mngr.restore(None, ck.TableRestore())["embedding"], model)


def test_a_step_below_the_last_saved_is_saved_in_full(tmp_path):
  """A delta's parent must be an earlier step: save(3) after step 4 wrote a
  delta of step 4 that no restore could read."""
  model = make_model(SPECS, seed=18)
  layout = model.layout([["a", "b"], ["c"]], 1, 1)
  rng, tracker = np.random.default_rng(19), ck.UpdatedRows(layout)
  policy = ck.IncrementalPolicy(max_delta_share=1.0)
  with ck.CheckpointManager(tmp_path, keep_latest=10, incremental=policy) as mngr:
    for step in (0, 2, 4):
      if step:
        touch_rows(model, layout, tracker, rng, 0.1)
      _save(mngr, step, model, layout, tracker)
    touch_rows(model, layout, tracker, rng, 0.1)
    tables, slots = model.state(layout)
    embedding = ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout))
    with pytest.raises(ValueError, match=r"save_kind='delta' for step 3: the state it would be a"
                       r" delta of is step 4, not an earlier step"):
      mngr.save(3, embedding, updated_rows=tracker, force=True, save_kind="delta")
    assert mngr.save(3, embedding, updated_rows=tracker, force=True)
    mngr.wait_until_finished()
  assert "chain" not in ck.inspect(tmp_path / "3")["embedding"]
  _assert_state(_restored_tables(tmp_path, 3), model)


def _strip_parent_ids(root, steps):
  """Makes deltas as written before save ids existed (their integrity manifests redone)."""
  for step in steps:
    path = root / str(step) / "embedding" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest.pop("parent_id", None)
    path.write_text(json.dumps(manifest))
    integrity.write_manifest(epath.Path(root / str(step)), step=step)


@pytest.mark.filterwarnings("ignore:checkpoint step .* is skipped:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:.* was in the way of saving step:RuntimeWarning")
@pytest.mark.parametrize("with_ids", [True, False])
def test_a_step_that_later_deltas_name_is_saved_again_only_where_they_record_its_id(tmp_path,
                                                                                  with_ids):
  """Step 3 of a chain 0..5 deleted, the run resumed at 2 and saved 3 again: deltas 4 and 5
  read the new step 3 and restored a mix of two runs. Deltas that record their parent's save
  id refuse the new step 3 (and a save of 4 moves the old one aside); older ones, which name
  it by number only, make that save refused."""
  model = make_model(SPECS, seed=20)
  layout = model.layout([["a", "b"], ["c"]], 1, 1)
  rng, tracker = np.random.default_rng(21), ck.UpdatedRows(layout)
  policy = ck.IncrementalPolicy(max_delta_share=1.0)
  states = {}
  with ck.CheckpointManager(tmp_path, keep_latest=10, incremental=policy) as mngr:
    for step in range(6):
      if step:
        touch_rows(model, layout, tracker, rng, 0.1)
      _save(mngr, step, model, layout, tracker)
      states[step] = ({k: v.copy() for k, v in model.logical.items()},
                      {k: {s: v.copy() for s, v in slots.items()}
                       for k, slots in model.slots.items()})
  shutil.rmtree(tmp_path / "3")
  if not with_ids:
    _strip_parent_ids(tmp_path, [4, 5])
  with ck.CheckpointManager(tmp_path, keep_latest=10, incremental=policy) as mngr:
    assert mngr.latest_step() == 2  # 5 and 4 need the missing step 3
    mngr.restore(2, ck.EmbeddingRestore(layout, make_mesh(1), AXIS))
    model.logical, model.slots = states[2]  # the live state is step 2's again
    tracker = ck.UpdatedRows(layout)
    touch_rows(model, layout, tracker, rng, 0.1)
    if not with_ids:
      with pytest.raises(ValueError, match=r"cannot save step 3 .*the delta steps \[4, 5\] name"
                         r" step 3 in their chains"):
        _save(mngr, 3, model, layout, tracker)
      assert not (tmp_path / "3").exists()
      _save(mngr, 6, model, layout, tracker)
      _assert_state(_restored_tables(tmp_path, 6), model)
      return
    _save(mngr, 3, model, layout, tracker)
    for step in (4, 5):
      with pytest.raises(ck.BrokenChainError, match="delta step 4 was saved on top of save"):
        _restored_tables(tmp_path, step)
    assert mngr.latest_step() == 3
    touch_rows(model, layout, tracker, rng, 0.1)
    _save(mngr, 4, model, layout, tracker)  # the old step 4 is moved aside, kept
  assert (tmp_path / "4.incomplete-0").exists()
  _assert_state(_restored_tables(tmp_path, 4), model)
  assert ck.inspect(tmp_path / "4")["embedding"]["chain"][-1]["kind"] == "delta"


@pytest.mark.filterwarnings("ignore:checkpoint step .* is skipped:RuntimeWarning")
def test_a_delta_saved_after_its_parent_was_replaced_is_refused_not_mixed(tmp_path):
  """The manager records the id of the save it wrote, not of what holds the step when
  the next delta is saved: another run's step 2 copied in between made delta 3 restore
  that run's state plus this run's rows."""
  model = make_model(SPECS, seed=40)
  layout = model.layout([["a", "b"], ["c"]], 1, 1)
  rng, tracker = np.random.default_rng(41), ck.UpdatedRows(layout)
  policy = ck.IncrementalPolicy(max_delta_share=1.0)
  other = make_model(SPECS, seed=42)  # another run, saving in full
  with ck.CheckpointManager(tmp_path / "other", keep_latest=10) as mngr:
    _save(mngr, 2, other, layout)
  root = tmp_path / "run"
  with ck.CheckpointManager(root, keep_latest=10, incremental=policy) as mngr:
    for step in range(3):
      if step:
        touch_rows(model, layout, tracker, rng, 0.1)
      _save(mngr, step, model, layout, tracker)
    shutil.rmtree(root / "2")
    shutil.copytree(tmp_path / "other" / "2", root / "2")
    touch_rows(model, layout, tracker, rng, 0.1)
    _save(mngr, 3, model, layout, tracker)
    with pytest.raises(ck.BrokenChainError, match="delta step 3 was saved on top of save"):
      _restored_tables(root, 3)
    assert mngr.latest_step() == 2
  errors = [p for p in ck.verify(root) if p.severity == "error"]
  assert any("delta step 3 was saved on top of save" in p.message for p in errors), errors


def test_a_tracker_older_than_a_restore_gives_a_full_save(tmp_path):
  """An older step restored (to evaluate it) while training went on: the next
  delta named it as parent with the rows since the last save, and restored
  neither state."""
  model = make_model(SPECS, seed=22)
  layout = model.layout([["a", "b"], ["c"]], 1, 1)
  rng, tracker = np.random.default_rng(23), ck.UpdatedRows(layout)
  policy = ck.IncrementalPolicy(max_delta_share=1.0)
  with ck.CheckpointManager(tmp_path, keep_latest=10, incremental=policy) as mngr:
    for step in range(4):
      if step:
        touch_rows(model, layout, tracker, rng, 0.1)
      _save(mngr, step, model, layout, tracker)
    mngr.restore(1, ck.EmbeddingRestore(layout, make_mesh(1), AXIS))  # evaluated on the side
    touch_rows(model, layout, tracker, rng, 0.1)
    tables, slots = model.state(layout)
    embedding = ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout))
    with pytest.raises(ValueError, match=r"updated_rows was last cleared before step 1 was"
                       r" restored"):
      mngr.save(4, embedding, updated_rows=tracker, force=True, save_kind="delta")
    _save(mngr, 4, model, layout, tracker)
  assert "chain" not in ck.inspect(tmp_path / "4")["embedding"]
  _assert_state(_restored_tables(tmp_path, 4), model)


def test_a_killed_compaction_is_cleaned_up_without_a_warning_calling_it_foreign(tmp_path):
  """The copy a killed `compact` was writing (`<step>.compacting` with the
  temporary suffix) was named in a warning as left alone, then deleted."""
  model = make_model(SPECS, seed=24)
  layout = model.layout([["a", "b"], ["c"]], 1, 1)
  with ck.CheckpointManager(tmp_path) as mngr:
    _save(mngr, 3, model, layout)
  leftover = tmp_path / "3.compacting.orbax-checkpoint-tmp"
  (leftover / "embedding").mkdir(parents=True)
  (leftover / "embedding" / "manifest.json").write_text("{")
  with warnings.catch_warnings():
    warnings.simplefilter("error", RuntimeWarning)
    with ck.CheckpointManager(tmp_path) as mngr:
      assert mngr.all_steps() == [3]
  assert sorted(os.listdir(tmp_path)) == ["3"]
  _assert_state(_restored_tables(tmp_path, 3), model)


def test_a_save_takes_the_trackers_rows_at_once_and_keeps_those_added_meanwhile():
  """hand_over, then rows added (another thread's), then the save settles:
  only the rows it took are forgotten; if it fails, they are tracked again."""
  layout = make_model(SPECS, seed=25).layout([["a", "b"], ["c"]], 1, 1)
  tracker = ck.UpdatedRows(layout)
  tracker.add("c", [1, 5])
  assert tracker.hand_over()["c"].tolist() == [1, 5]
  tracker.add("c", [5, 7])
  assert tracker.rows()["c"].tolist() == [1, 5, 7]  # the taken rows still count until settled
  assert tracker.handed()["c"].tolist() == [1, 5]
  tracker.forget_handed()
  assert tracker.rows()["c"].tolist() == [5, 7]  # 5 was updated again after the hand-over
  tracker.hand_over()
  tracker.add("c", [9])
  tracker.take_back()
  assert tracker.rows()["c"].tolist() == [5, 7, 9]
  assert tracker.handed()["c"].tolist() == []


def test_rows_added_while_a_delta_is_saved_reach_the_next_delta(tmp_path, monkeypatch):
  """The save cleared the tracker once Orbax's save returned: rows another
  thread added meanwhile (a batch applied during the save) were lost, and the
  next delta kept their old values."""
  model = make_model(SPECS, seed=26)
  layout = model.layout([["a", "b"], ["c"]], 1, 1)
  rng, tracker = np.random.default_rng(27), ck.UpdatedRows(layout)
  policy = ck.IncrementalPolicy(max_delta_share=1.0)
  with ck.CheckpointManager(tmp_path, keep_latest=10, incremental=policy) as mngr:
    _save(mngr, 0, model, layout, tracker)
    touch_rows(model, layout, tracker, rng, 0.1)
    tables, slots = model.state(layout)  # step 1's state, as its save snapshots it
    saved = {name: table.copy() for name, table in model.logical.items()}
    orbax_save = mngr._manager.save

    def save_while_training_goes_on(*args, **kwargs):
      started = orbax_save(*args, **kwargs)
      touch_rows(model, layout, tracker, rng, 0.1)  # applied during the save
      return started

    monkeypatch.setattr(mngr._manager, "save", save_while_training_goes_on)
    assert mngr.save(1, ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout)),
                     updated_rows=tracker, force=True)
    monkeypatch.undo()
    mngr.wait_until_finished()
    _save(mngr, 2, model, layout, tracker)
  assert ck.inspect(tmp_path / "2")["embedding"]["chain"][-1]["kind"] == "delta"
  _assert_state(_restored_tables(tmp_path, 2), model)
  for name, table in _restored_tables(tmp_path, 1).tables.items():
    assert_same_bits(table, saved[name], err_msg=name)


def _run(root, seed, steps=4):
  """Saves steps 0..steps-1 of one run as a chain; returns its logical tables at every step."""
  model = make_model(SPECS, seed=seed)
  layout = model.layout([["a", "b"], ["c"]], 1, 1)
  rng, tracker = np.random.default_rng(seed + 1), ck.UpdatedRows(layout)
  states = {}
  with ck.CheckpointManager(root, keep_latest=10,
                            incremental=ck.IncrementalPolicy(max_delta_share=1.0)) as mngr:
    for step in range(steps):
      if step:
        touch_rows(model, layout, tracker, rng, 0.1)
      _save(mngr, step, model, layout, tracker)
      states[step] = {k: v.copy() for k, v in model.logical.items()}
  return layout, states


@pytest.mark.filterwarnings("ignore:checkpoint step .* is skipped:RuntimeWarning")
def test_a_parent_step_replaced_by_another_save_is_refused_not_read_as_the_base(tmp_path):
  """A delta names its parent by number: step 1 of another run put in its place (each
  step intact, with its own integrity manifest) made step 2 restore a mix of two runs."""
  layout, states = _run(tmp_path / "a", seed=30)
  _run(tmp_path / "b", seed=31)
  shutil.rmtree(tmp_path / "a" / "1")
  shutil.copytree(tmp_path / "b" / "1", tmp_path / "a" / "1")
  replaced = r"delta step 2 was saved on top of save \w+ of step 1, but .*1/embedding holds save"
  handler = ck.EmbeddingCheckpointHandler()
  for step in (2, 3):
    with pytest.raises(ck.BrokenChainError, match=replaced):
      handler.restore(tmp_path / "a" / str(step) / "embedding", ck.TableRestore())
  with pytest.raises(ck.BrokenChainError, match=replaced):
    ck.convert(tmp_path / "a" / "3", tmp_path / "out", "unstacked")
  assert not (tmp_path / "out").exists()
  errors = [p for p in ck.verify(tmp_path / "a") if p.severity == "error"]
  assert {p.path.parent.name for p in errors} == {"1", "2", "3"}, errors  # 1: b's 0 is not here
  assert any(re.search(replaced, p.message) for p in errors), errors
  with ck.CheckpointManager(tmp_path / "a", read_only=True) as mngr:
    with pytest.warns(RuntimeWarning, match="skipped"):
      restored = mngr.restore(None, ck.TableRestore())["embedding"]  # 3, 2, 1 refused: 0 used
  for name, table in states[0].items():
    assert_same_bits(restored.tables[name], table, err_msg=name)


def test_conversions_and_compaction_keep_the_save_a_later_delta_was_written_on(tmp_path):
  """Another layout holds the same state: a chain's base converted in place, and a middle
  delta compacted, still take the later deltas; a base rounded to bfloat16 is a new save."""
  model = make_model(SPECS, seed=32)
  layout, states = _run(tmp_path, seed=32)
  ck.convert(tmp_path / "0", tmp_path / "0", model.layout([["a"], ["b"], ["c"]], 2, 2),
             overwrite=True)
  assert compact(tmp_path / "2") is True
  for step in range(4):
    for name, table in states[step].items():
      assert_same_bits(_restored_tables(tmp_path, step).tables[name], table, err_msg=name)
  assert not [p for p in ck.verify(tmp_path) if p.severity == "error"]
  ids = {}
  for source, target in ((tmp_path / "1", "unstacked"), (tmp_path / "1", layout)):
    out = tmp_path / f"out_{len(ids)}"
    ck.convert(source, out, target)
    ids[len(ids)] = json.loads((out / "embedding" / "manifest.json").read_text())["save_id"]
  bf16 = tmp_path / "bf16"
  ck.convert(tmp_path / "1", bf16, layout, table_dtype="bfloat16")
  delta_1 = json.loads((tmp_path / "1" / "embedding" / "manifest.json").read_text())
  assert ids[0] == ids[1] == delta_1["save_id"]
  assert json.loads((bf16 / "embedding" / "manifest.json").read_text())["save_id"] != ids[0]


def test_a_chain_saved_before_save_ids_existed_restores_as_before(tmp_path):
  """Manifests without save ids (older checkpoints) chain by step number, as they did."""
  _, states = _run(tmp_path, seed=34)
  for step in range(4):
    path = tmp_path / str(step) / "embedding" / "manifest.json"
    manifest = json.loads(path.read_text())
    assert manifest.pop("save_id") and (step == 0 or manifest.pop("parent_id"))
    path.write_text(json.dumps(manifest))
    integrity.write_manifest(epath.Path(tmp_path / str(step)), step=step)
  for step in range(4):
    for name, table in states[step].items():
      assert_same_bits(_restored_tables(tmp_path, step).tables[name], table, err_msg=name)
  assert not [p for p in ck.verify(tmp_path) if p.severity == "error"]


def test_a_step_converted_into_the_place_of_a_chains_link_is_refused(tmp_path):
  """Converting another run's step 1 into step 1 of a chain (overwrite) was accepted: its
  later deltas then read another state, and every one of them stopped restoring."""
  layout, states = _run(tmp_path / "a", seed=36)
  _run(tmp_path / "b", seed=37)
  manifest = (tmp_path / "a" / "1" / "integrity.json").read_text()
  with pytest.raises(ValueError, match=r"converting into .*a/1 would break the delta steps"
                     r" \[2, 3\] .*saved on top of save \w+, and the conversion writes save"):
    ck.convert(tmp_path / "b" / "1", tmp_path / "a" / "1", layout, overwrite=True)
  assert (tmp_path / "a" / "1" / "integrity.json").read_text() == manifest
  for name, table in states[3].items():
    assert_same_bits(_restored_tables(tmp_path / "a", 3).tables[name], table, err_msg=name)


def test_verify_names_a_replaced_link_also_beside_a_stray_file(tmp_path):
  """A file the manager did not write, inside an earlier link, is only a warning: it must
  not hide that the chain no longer restores."""
  _run(tmp_path / "a", seed=38)
  _run(tmp_path / "b", seed=39)
  shutil.rmtree(tmp_path / "a" / "1")
  shutil.copytree(tmp_path / "b" / "1", tmp_path / "a" / "1")
  (tmp_path / "a" / "0" / "embedding" / "notes.txt").write_text("a user's note")
  problems = ck.verify(tmp_path / "a" / "3")
  assert any(p.severity == "foreign" and p.path.name == "notes.txt" for p in problems), problems
  assert any(p.severity == "error" and "delta step 2 was saved on top of save" in p.message
             for p in problems), problems


def _flip_middle(path):
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 1
  path.write_bytes(bytes(data))


@pytest.mark.filterwarnings("ignore:checkpoint step .* is skipped:RuntimeWarning")
@pytest.mark.parametrize("damaged", ["0/embedding/layout.json", "2/embedding/parts/0.json"])
def test_a_damaged_json_file_of_a_chain_is_named_by_verify_inspect_and_restore(tmp_path, capsys,
                                                                             damaged):
  _, layout, delta_root, _, states = _train_side_by_side(tmp_path, 2, steps=4)
  _flip_middle(delta_root / damaged)
  # verify of the root lists every step's problems, the broken chains included.
  assert cli.main(["verify", str(delta_root)]) == 1
  out = capsys.readouterr().out
  assert str(delta_root / damaged) in out and f"{delta_root / '3'}" in out
  assert cli.main(["inspect", str(delta_root / "3")]) != 0
  assert str(delta_root / damaged) in capsys.readouterr().err
  args = ck.EmbeddingRestore(layout, make_mesh(2), AXIS)
  with ck.CheckpointManager(delta_root, read_only=True) as mngr:
    with pytest.raises(ck.CorruptCheckpointError, match=re.escape(str(delta_root / damaged))):
      mngr.restore(3, args)


@pytest.mark.parametrize("count", [-3, 2.5, True, "7", None])
def test_a_part_marker_whose_row_count_is_not_a_count_is_damage(tmp_path, count):
  """A marker passes its checksums when it was damaged before the manifest was written
  (or a step is adopted without one); a row count that is no count is damage all the same."""
  from checkpoint._chain import delta_manifest  # pylint: disable=g-import-not-at-top
  from checkpoint._delta import DeltaItem, part_marker  # pylint: disable=g-import-not-at-top

  _, layout, delta_root, _, _ = _train_side_by_side(tmp_path, 1, steps=2)
  item = delta_root / "1" / "embedding"
  marker = part_marker(item, 0)
  rows = json.loads(marker.read_text())["rows"]
  stack = layout.stack_names[0]
  DeltaItem(item, delta_manifest(item))  # the saved marker opens
  marker.write_text(json.dumps({"rows": {**rows, stack: count}}))
  with pytest.raises(ck.CorruptCheckpointError, match=re.escape(f"{marker} is damaged")) as info:
    DeltaItem(item, delta_manifest(item))
  assert f"stack {stack!r} has {count!r} rows" in str(info.value)
