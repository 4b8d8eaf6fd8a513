"""Steps written without an integrity manifest (before integrity checks existed).

They are never restored unverified, and a root holding only such steps does
not silently start training over: `latest_step` raises naming them and the
way out, `sc-checkpoint verify --adopt STEP` checks one and writes its
manifest, after which it restores bit for bit.
"""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import orbax.checkpoint as ocp
import pytest

import checkpoint as ck
import fault_lib
from checkpoint.cli import main
from ckpt_testlib import AXIS, make_mesh, make_model
from sc_framework.optimizers import RowWiseAdagrad
from tests.numerics import assert_same_bits


def _legacy_root(tmp_path):
  model = make_model([("a", 64, 12, RowWiseAdagrad()), ("b", 120, 10, RowWiseAdagrad())])
  layout = model.layout([["a", "b"]], 2, 1)
  tables, slots = model.state(layout)
  with ck.CheckpointManager(tmp_path) as mngr:
    mngr.save(5, ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout)))
    mngr.wait_until_finished()
  (tmp_path / "5" / "integrity.json").unlink()
  return layout, tables, slots


def test_only_unmanifested_steps_raise_naming_them_and_adopt(tmp_path):
  with pytest.warns(RuntimeWarning):
    layout, tables, slots = _legacy_root(tmp_path)
    with ck.CheckpointManager(tmp_path, read_only=True) as mngr:
      with pytest.raises(ck.NotACheckpointError, match=r"verify --adopt .*5"):
        mngr.latest_step()


def test_adopt_writes_a_manifest_and_the_step_restores(tmp_path, capsys):
  layout, tables, slots = _legacy_root(tmp_path)
  assert main(["verify", "--adopt", str(tmp_path / "5")]) == 0
  assert (tmp_path / "5" / "integrity.json").exists()
  assert main(["verify", str(tmp_path)]) == 0
  with ck.CheckpointManager(tmp_path, read_only=True) as mngr:
    assert mngr.latest_step() == 5
    state = mngr.restore(None, ck.EmbeddingRestore(layout, make_mesh(2), AXIS))["embedding"]
  for name, table in tables.items():
    assert_same_bits(np.asarray(state.tables[name]), np.asarray(table), err_msg=name)


def test_adopt_refuses_a_damaged_step(tmp_path, capsys):
  _legacy_root(tmp_path)
  chunk = max((p for p in (tmp_path / "5" / "embedding").rglob("*")
               if p.is_file() and "/c/" in str(p)), key=lambda p: p.stat().st_size)
  chunk.write_bytes(chunk.read_bytes()[:-3])
  assert main(["verify", "--adopt", str(tmp_path / "5")]) == 1
  assert not (tmp_path / "5" / "integrity.json").exists()
  assert str(chunk) in capsys.readouterr().out


def test_adopt_needs_a_step_directory(tmp_path, capsys):
  assert main(["verify", "--adopt", str(tmp_path)]) != 0
  assert "not a step directory" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["codecs", "byte order", "chunk rows", "missing"])
def test_adopt_refuses_an_array_whose_metadata_no_restore_can_read(tmp_path, capsys, damage):
  """verify and --adopt read the chunks by the manifest, never zarr.json: an array's
  metadata without its crc32c codec, of other chunks, or deleted passed them, the adopted
  step then passed plain verify, and every restore failed."""
  _legacy_root(tmp_path)
  stack = tmp_path / "5" / "embedding" / "stacks" / "a__b"
  metadata = stack / "slots" / "accumulator" / "zarr.json"
  if damage == "missing":
    metadata.unlink()
  else:
    data = json.loads(metadata.read_text())
    if damage == "codecs":
      data["codecs"] = data["codecs"][:-1]
    elif damage == "byte order":
      data["codecs"][0]["configuration"]["endian"] = "big"
    else:
      grid = data["chunk_grid"]["configuration"]["chunk_shape"]
      grid[0] *= 2
    metadata.write_text(json.dumps(data))
  assert main(["verify", "--adopt", str(tmp_path / "5")]) == 1
  assert not (tmp_path / "5" / "integrity.json").exists()
  assert str(metadata) in capsys.readouterr().out


@pytest.fixture(scope="module")
def full_steps(tmp_path_factory):
  """Steps 1 and 2 with every item a Trainer saves (embedding, dense, in_flight, meta)."""
  return fault_lib.build_template(tmp_path_factory.mktemp("full") / "checkpoints")


def _replace_in(path, old, new):
  """The first `old` in the file replaced by `new` (a flipped byte or two)."""
  text = path.read_text()
  assert old in text
  path.write_text(text.replace(old, new, 1))


def _remove_dense_data_file(step_dir):
  next(p for p in sorted((step_dir / "dense" / "d").iterdir()) if p.is_file()).unlink()


@pytest.mark.parametrize("damage, message", [
    (lambda step: shutil.rmtree(step / "embedding"),
     r"embedding: is missing: _CHECKPOINT_METADATA lists item 'embedding'"),
    (lambda step: shutil.rmtree(step / "meta"),
     r"meta: is missing: _CHECKPOINT_METADATA lists item 'meta'"),
    (lambda step: (step / "embedding" / "manifest.json").unlink(),
     r"embedding/manifest.json cannot be read"),
    (_remove_dense_data_file, r"dense: does not read back: NOT_FOUND"),
    (lambda step: (step / "dense" / "manifest.ocdbt").unlink(),
     r"dense: holds per-process OCDBT parts but no merged manifest.ocdbt"),
    (lambda step: [shutil.rmtree(p) if p.is_dir() else p.unlink()
                   for p in (step / "dense").iterdir()],
     r"dense/_METADATA: is missing"),
    (lambda step: [shutil.rmtree(p) if p.is_dir() else p.unlink()
                   for p in (step / "dense").iterdir() if p.name != "_METADATA"],
     r"dense/manifest.ocdbt: is missing"),
    (lambda step: (step / "meta" / "metadata").unlink(),
     r"meta: holds no file: the JSON item.s value is missing"),
    (lambda step: _replace_in(step / "dense" / "_sharding", r'\"sharding_type\"',
                              r'\"sharding_type'),
     r"dense/_sharding: is not readable JSON"),
    (lambda step: _replace_in(step / "dense" / "_METADATA", '"jax.Array"', '"jax/Array"'),
     r"dense/_METADATA: is not a tree Orbax restores \(Unknown type"),
    (lambda step: _replace_in(step / "in_flight" / "_METADATA", '"key_type": 2',
                              '"key_type": 3'),
     r"in_flight/_METADATA: is not a tree Orbax restores \(3 is not a valid KeyType"),
], ids=["embedding item", "meta item", "embedding manifest", "dense data file",
        "dense never merged", "dense emptied", "dense tree alone", "meta value",
        "dense shardings", "dense leaf type", "in-flight key type"])
def test_adopt_refuses_a_partial_copy(full_steps, tmp_path, capsys, damage, message):
  """Each was adopted (0 errors, integrity.json written); a Trainer then raised
  MissingItemError or TensorStore's NOT_FOUND on every resume."""
  root = tmp_path / "checkpoints"
  shutil.copytree(full_steps.root, root)
  step = root / "2"
  (step / "integrity.json").unlink()
  damage(step)
  assert main(["verify", "--adopt", str(step)]) == 1
  assert re.search(message, capsys.readouterr().out)
  assert not (step / "integrity.json").exists()


@pytest.mark.parametrize("relative", [False, True])
def test_adopt_of_a_whole_copy_restores_every_item(full_steps, tmp_path, monkeypatch, relative):
  """relative: the step named from its root's parent, as the README shows it (Orbax, which
  reads the trees, refused relative paths: every tree item was called unreadable)."""
  root = tmp_path / "checkpoints"
  shutil.copytree(full_steps.root, root)
  (root / "2" / "integrity.json").unlink()
  if relative:
    monkeypatch.chdir(tmp_path)
  assert main(["verify", "--adopt", "checkpoints/2" if relative else str(root / "2")]) == 0
  with ck.CheckpointManager(root, read_only=True) as mngr:
    assert mngr.latest_step() == 2
    meta = mngr.restore(2, items={"meta": ocp.args.JsonRestore()})["meta"]
  assert meta == full_steps.oracle[2]["meta"]


def test_adopt_takes_a_step_of_one_item_whose_handler_is_a_plain_string(tmp_path):
  """Orbax's Checkpointer writes `item_handlers` as one string: adopt raised AttributeError."""
  step = tmp_path / "checkpoints" / "3"
  tree = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "step": np.int32(3)}
  ocp.Checkpointer(ocp.StandardCheckpointHandler()).save(step, ocp.args.StandardSave(tree))
  metadata = json.loads((step / "_CHECKPOINT_METADATA").read_text())
  assert isinstance(metadata["item_handlers"], str)
  shutil.copytree(step, tmp_path / "copy" / "3")
  assert main(["verify", "--adopt", str(step)]) == 0
  assert (step / "integrity.json").exists()
  # Its arrays are checked too.
  next(p for p in sorted((tmp_path / "copy" / "3" / "d").iterdir()) if p.is_file()).unlink()
  assert main(["verify", "--adopt", str(tmp_path / "copy" / "3")]) == 1


def test_adopt_takes_metrics_string_leaves_and_keys_with_slashes(tmp_path):
  """A manager's metrics item (its value in `metrics/metrics`), a PyTree item's string
  leaves (kept in _strings.json) and a key holding '/' were each reported missing."""
  root = tmp_path / "checkpoints"
  tree = {"a/b": np.arange(3, dtype=np.float32), "name": "run-7", "count": 4}
  with ck.CheckpointManager(root, keep_best=1, best_metric="loss") as mngr:
    mngr.save(1, items={"tree": ocp.args.PyTreeSave(tree),
                        "words": ocp.args.PyTreeSave({"only": "strings"})},
              metrics={"loss": 0.5})
    mngr.wait_until_finished()
  assert (root / "1" / "metrics" / "metrics").exists()
  (root / "1" / "integrity.json").unlink()
  assert main(["verify", "--adopt", str(root / "1")]) == 0
  with ck.CheckpointManager(root, read_only=True) as mngr:
    restored = mngr.restore(1, items={"tree": ocp.args.PyTreeRestore()})["tree"]
  assert restored["name"] == "run-7" and int(restored["count"]) == 4
  assert_same_bits(np.asarray(restored["a/b"]), tree["a/b"])
