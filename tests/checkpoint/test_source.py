"""A conversion's source is verified against its steps' integrity manifests before it is read.

Damaged checkpoints are built from real saved steps (small tables); a
conversion of one must fail naming the damaged file and leave nothing at
its destination, never write an output whose fresh manifest would bless the
damage. Sound sources convert bit for bit (the oracle: the model's own
numpy tables).
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import orbax.checkpoint as ocp
import pytest

import checkpoint as ck
from checkpoint.cli import main
from ckpt_testlib import AXIS, make_mesh, make_model
from sc_framework.optimizers import Adam, RowWiseAdagrad
from sc_framework.stacking import logical_to_global_rows
from tests.numerics import assert_same_bits

TABLES = [("a", 64, 12), ("b", 120, 10), ("c", 40, 16)]


def _step(tmp_path, *, seed=0, storage=None):
  """A CheckpointManager step 4 (embedding + a JSON item) of a small model."""
  model = make_model([spec + (Adam(),) for spec in TABLES], seed=seed)
  layout = model.layout([["a", "b"], ["c"]], 4)
  tables, slots = model.state(layout)
  embedding = ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout),
                               storage=storage or ck.StorageOptions())
  with ck.CheckpointManager(tmp_path / "run") as mngr:
    mngr.save(4, embedding, items={"data": ocp.args.JsonSave({"position": 17})})
    mngr.wait_until_finished()
  return model, tmp_path / "run" / "4"


def _check_tables(model, item):
  arrays = ck.EmbeddingCheckpointHandler().restore(item, ck.TableRestore())
  assert set(arrays.tables) == set(model.logical)
  for name, logical in model.logical.items():
    assert_same_bits(arrays.tables[name], logical, err_msg=name)
    for slot, values in model.slots[name].items():
      assert_same_bits(arrays.slots[name][slot], values, err_msg=f"{name} {slot}")


def _flip(path, offset):
  data = bytearray(path.read_bytes())
  data[offset % len(data)] ^= 0x40
  path.write_bytes(bytes(data))


def _nothing_at(out):
  assert not out.exists()
  assert not [p for p in out.parent.iterdir() if p.name.startswith(out.name)]


def _convert_fails_naming(capsys, src, out, damaged, error, match=None):
  """The API raises `error` naming `damaged`; the CLI prints it on one line; nothing is written."""
  with pytest.raises(error, match=match) as raised:
    ck.convert(src, out, "unstacked")
  assert str(damaged) in str(raised.value)
  _nothing_at(out)
  capsys.readouterr()
  assert main(["convert", str(src), str(out), "--unstacked", "--quiet"]) == 1
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and str(damaged) in err, err
  _nothing_at(out)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_changed_chunk_of_a_step_without_chunk_checksums_fails_naming_it(tmp_path, capsys, seed):
  """The step manifest is the only checksum of such chunks: convert must check it."""
  _, step = _step(tmp_path, seed=seed, storage=ck.StorageOptions(checksum="none"))
  chunks = sorted((step / "embedding").glob("stacks/*/table/c/*/0"))
  damaged = chunks[seed * 3 % len(chunks)]
  _flip(damaged, 37 + seed)
  _convert_fails_naming(capsys, step, tmp_path / "out", damaged, ck.CorruptCheckpointError,
                        "checksum mismatch")
  # The embedding item alone is checked against its step's manifest too.
  _convert_fails_naming(capsys, step / "embedding", tmp_path / "out", damaged,
                        ck.CorruptCheckpointError)


@pytest.mark.parametrize("seed", [2, 3])
def test_a_changed_chunk_without_chunk_checksums_fails_every_restore_of_its_item(tmp_path, seed):
  """The handler checks the item against its step's manifest whoever calls it
  (Orbax's Checkpointer, or the handler itself, per table or into a layout),
  as the manager does. Before, only the manager did, and the others returned
  the flipped values."""
  model, step = _step(tmp_path, seed=seed, storage=ck.StorageOptions(checksum="none"))
  _check_tables(model, step / "embedding")  # sound: restores bit for bit
  chunks = sorted((step / "embedding").glob("stacks/*/*/c/*/0"))
  damaged = chunks[seed * 5 % len(chunks)]
  _flip(damaged, 11 + seed)
  layout = model.layout([["a"], ["b", "c"]], 2)
  into_layout = ck.EmbeddingRestore(layout, make_mesh(2), AXIS)
  handler = ck.EmbeddingCheckpointHandler()
  for restore in (
      lambda: handler.restore(step / "embedding", ck.TableRestore()),
      lambda: handler.restore(step / "embedding",
                              ck.TableRestore(tables=["a"], rows={"a": (0, 3)})),
      lambda: handler.restore(step / "embedding", into_layout),
      lambda: ocp.Checkpointer(handler).restore(step / "embedding", args=ck.TableRestore()),
  ):
    with pytest.raises(ck.CorruptCheckpointError, match="checksum mismatch") as raised:
      restore()
    assert str(damaged) in str(raised.value)


@pytest.mark.parametrize("file, edit", [
    ("embedding/layout.json", ('"vocabulary_size": 120', '"vocabulary_size": 119')),
    ("embedding/manifest.json", ('"kind": "stacked"', '"kind":  "stacked"')),
    ("data/metadata", ('17', '18')),
])
def test_an_edited_json_file_fails_naming_it(tmp_path, capsys, file, edit):
  """Valid JSON that is not what was saved: only the manifest tells, so it must be read."""
  _, step = _step(tmp_path)
  damaged = step / file
  text = damaged.read_text()
  assert edit[0] in text
  damaged.write_text(text.replace(edit[0], edit[1], 1))
  json.loads(damaged.read_text())
  _convert_fails_naming(capsys, step, tmp_path / "out", damaged, ck.CorruptCheckpointError,
                        "integrity check")


def test_a_damaged_integrity_manifest_fails_naming_it(tmp_path, capsys):
  _, step = _step(tmp_path)
  manifest = step / "integrity.json"
  manifest.write_bytes(manifest.read_bytes()[:100])
  _convert_fails_naming(capsys, step, tmp_path / "out", manifest, ck.CorruptCheckpointError)


def test_a_step_without_a_manifest_is_refused_until_adopted(tmp_path, capsys):
  """As a restore refuses it; `verify --adopt` checks the step and then it converts."""
  model, step = _step(tmp_path, seed=3)
  (step / "integrity.json").unlink()
  for src in (step, step / "embedding"):
    with pytest.raises(ck.NotACheckpointError, match=r"verify --adopt .*4"):
      ck.convert(src, tmp_path / "out", "unstacked")
    _nothing_at(tmp_path / "out")
  assert main(["convert", str(step), str(tmp_path / "out"), "--unstacked", "--quiet"]) == 1
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "verify --adopt" in err, err
  assert main(["verify", "--adopt", str(step)]) == 0
  written = ck.convert(step, tmp_path / "out", "unstacked")
  _check_tables(model, written)
  assert json.loads((tmp_path / "out" / "data" / "metadata").read_text()) == {"position": 17}
  assert main(["verify", str(tmp_path / "out")]) == 0


def test_entries_the_manifest_does_not_list_are_named_and_not_copied(tmp_path, capsys):
  model, step = _step(tmp_path, seed=5)
  (step / "notes.txt").write_text("not part of the checkpoint")
  (step / "data" / "extra.json").write_text("{}")
  with pytest.warns(RuntimeWarning) as caught:
    written = ck.convert(step, tmp_path / "out", "unstacked")
  said = " ".join(str(w.message) for w in caught)
  assert str(step / "notes.txt") in said and str(step / "data" / "extra.json") in said
  assert not (tmp_path / "out" / "notes.txt").exists()
  assert not (tmp_path / "out" / "data" / "extra.json").exists()
  _check_tables(model, written)
  assert main(["verify", str(tmp_path / "out")]) == 0
  assert "0 errors, 0 warnings" in capsys.readouterr().out


def test_a_sound_step_converts_bit_for_bit_without_warnings(tmp_path):
  model, step = _step(tmp_path, seed=6, storage=ck.StorageOptions(checksum="none"))
  with warnings.catch_warnings():
    warnings.simplefilter("error", RuntimeWarning)
    written = ck.convert(step, tmp_path / "out", "unstacked")
  _check_tables(model, written)


def test_every_step_of_a_delta_chain_is_verified(tmp_path):
  """A delta converts as base + deltas: damage in the base step is found before reading it."""
  specs = [("a", 64, 12, RowWiseAdagrad()), ("b", 120, 10, RowWiseAdagrad())]
  model = make_model(specs, seed=7)
  layout = model.layout([["a", "b"]], 2)
  tracker = ck.UpdatedRows(layout)
  rng = np.random.default_rng(7)
  root = tmp_path / "run"
  with ck.CheckpointManager(root, incremental=ck.IncrementalPolicy()) as mngr:
    for step in (0, 1):
      if step:
        rows = rng.choice(64, size=5, replace=False)
        model.logical["a"][rows] += 1.0
        tracker.add(layout.stack_of_table("a").name, logical_to_global_rows(layout, "a", rows))
      tables, slots = model.state(layout)
      embedding = ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout))
      assert mngr.save(step, embedding, updated_rows=tracker, force=True)
      mngr.wait_until_finished()
      tracker.clear()
  assert "chain" in ck.inspect(root / "1")["embedding"]
  written = ck.convert(root / "1", tmp_path / "full", "unstacked")
  _check_tables(model, written)
  damaged = root / "0" / "embedding" / "layout.json"
  text = damaged.read_text()
  assert '"vocabulary_size": 120' in text
  damaged.write_text(text.replace('"vocabulary_size": 120', '"vocabulary_size": 119'))
  with pytest.raises(ck.CorruptCheckpointError, match="integrity check") as raised:
    ck.convert(root / "1", tmp_path / "out", "unstacked")
  assert str(damaged) in str(raised.value)
  _nothing_at(tmp_path / "out")
