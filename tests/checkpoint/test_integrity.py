"""Integrity on by default: the step manifest, verified restores, verify, stray entries."""

from __future__ import annotations

import json
import errno
import dataclasses
import os
import re
import shutil
import warnings

import google_crc32c
import jax
import numpy as np
from etils import epath
import optax
import orbax.checkpoint as ocp
import pytest

import checkpoint as ck
import fault_lib
from ckpt_testlib import AXIS, make_mesh
from checkpoint import _integrity, _storage
from checkpoint._chain import open_reader
from checkpoint.cli import main
from tests.numerics import assert_same_bits


@pytest.fixture(scope="module")
def template(tmp_path_factory):
  return fault_lib.build_template(tmp_path_factory.mktemp("template") / "checkpoints")


@pytest.fixture
def root(template, tmp_path):
  shutil.copytree(template.root, tmp_path / "checkpoints", symlinks=True)
  return tmp_path / "checkpoints"


def _files(step_dir):
  return {
      os.path.relpath(os.path.join(folder, name), step_dir)
      for folder, _, names in os.walk(step_dir)
      for name in names
  }


def test_the_manifest_lists_every_file_of_every_item(root):
  step = root / "2"
  manifest = json.loads((step / "integrity.json").read_text())
  listed = set(manifest["files"])
  on_disk = _files(step) - {"integrity.json"} - set(_integrity.COMMIT_FILES)
  assert listed == on_disk
  assert {rel.split("/")[0] for rel in listed} == {"dense", "embedding", "in_flight", "meta"}
  chunks = [rel for rel in listed if "/c/" in rel and rel.startswith("embedding/")]
  assert chunks and all(manifest["files"][rel] == {
      "size": os.path.getsize(step / rel), "zarr_crc32c": True,
      "trailer": int.from_bytes((step / rel).read_bytes()[-4:], "little")} for rel in chunks)
  data = (step / "meta/metadata").read_bytes()
  assert manifest["files"]["meta/metadata"] == {
      "size": len(data), "crc32c": google_crc32c.value(data[:-4]),
      "tail": int.from_bytes(data[-4:], "little")}
  # Only the step carries a manifest (Orbax finalizes each item the same way).
  assert not any(rel.endswith("/integrity.json") for rel in _files(step))
  assert ck.StorageOptions().checksum == "crc32c"


def test_restore_none_falls_back_past_a_corrupt_chunk_but_an_explicit_step_raises(
    root, template
):
  chunk = fault_lib.TARGETS["table chunk"](root / "2")
  fault_lib._flip(chunk)
  layout = template.layout
  restore = ck.EmbeddingRestore(layout, make_mesh(layout.num_devices), AXIS)
  with ck.CheckpointManager(root) as mngr:
    with pytest.raises(ck.CorruptCheckpointError, match=re.escape(str(chunk))):
      mngr.restore(2, restore)
    with pytest.warns(RuntimeWarning, match=f"{re.escape(str(root / '2'))} is"
                                            f" skipped.*{re.escape(str(chunk))}"):
      restored = mngr.restore(None, restore)["embedding"]
  assert_same_bits(restored.tables["a__b"], template.oracle[1]["tables"]["a__b"])
  for slot, array in template.oracle[1]["slots"]["a__b"].items():
    assert_same_bits(restored.slots["a__b"][slot], array)


@pytest.mark.filterwarnings("ignore:checkpoint step .* is skipped:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:.* was in the way of saving step:RuntimeWarning")
def test_a_step_a_restore_found_damaged_is_skipped_until_it_is_saved_again(root, template):
  """Listing a step reads no chunk: a flipped byte shows only when restored, and
  latest_step kept naming the step (a Trainer resumed it and raised, every time)."""
  chunk = fault_lib.TARGETS["table chunk"](root / "2")
  fault_lib._flip(chunk)
  layout = template.layout
  restore = ck.EmbeddingRestore(layout, make_mesh(layout.num_devices), AXIS)
  with ck.CheckpointManager(root, read_only=True) as reader, ck.CheckpointManager(root) as writer:
    assert writer.latest_step() == 2 and writer.why_unrestorable(2) is None
    with pytest.raises(ck.CorruptCheckpointError, match=re.escape(str(chunk))) as error:
      writer.restore(2, restore)
    assert error.value.__cause__ is not error.value  # the checksum failure stays its cause
    reader.mark_damaged(2, "found damaged by another process")
    for mngr, why in ((writer, str(chunk)), (reader, "another process")):
      assert why in mngr.why_unrestorable(2)
      with pytest.warns(RuntimeWarning,
                        match=f"{re.escape(str(root / '2'))} is skipped.*{re.escape(why)}"):
        assert mngr.latest_step() == 1
    # Saved again: the damaged step is moved aside (kept) and the new one is a checkpoint
    # again, also for the manager that only marked the old one.
    model, _, tables, slots, *_ = fault_lib._step_state(2)
    assert writer.save(2, ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout)),
                       force=True)
    writer.wait_until_finished()
    assert (root / "2.incomplete-0" / "integrity.json").exists()
    for mngr in (writer, reader):
      mngr.reload()
      assert mngr.why_unrestorable(2) is None and mngr.latest_step() == 2
    restored = reader.restore(None, restore)["embedding"]
  assert_same_bits(restored.tables["a__b"], template.oracle[2]["tables"]["a__b"])


@pytest.mark.filterwarnings("ignore:checkpoint step .* is skipped:RuntimeWarning")
@pytest.mark.parametrize("mix", ["from another step", "swapped within the array"])
def test_a_chunk_of_another_step_or_position_is_refused(root, template, mix):
  """Each such chunk carries a valid checksum of its own (a backup restore that mixed two
  steps): verify, convert and restore all passed it and restored stale rows."""
  step = root / "2"
  chunks = sorted(rel for rel in json.loads((step / "integrity.json").read_text())["files"]
                  if rel.startswith("embedding/stacks/a__b/table/c/"))
  if mix == "from another step":
    changed = [step / chunks[0]]
    shutil.copyfile(root / "1" / chunks[0], changed[0])
  else:
    changed = [step / chunks[0], step / chunks[1]]
    first, second = (path.read_bytes() for path in changed)
    assert len(first) == len(second) and first != second
    changed[0].write_bytes(second), changed[1].write_bytes(first)
  errors = [p for p in ck.verify(step) if p.severity == "error"]
  assert {str(p.path) for p in errors} == {str(path) for path in changed}, errors
  assert all("a chunk of another step or position" in p.message for p in errors)
  layout = template.layout
  restore = ck.EmbeddingRestore(layout, make_mesh(layout.num_devices), AXIS)
  with ck.CheckpointManager(root) as mngr:
    with pytest.raises(ck.CorruptCheckpointError, match=re.escape(str(changed[0]))):
      mngr.restore(2, restore)
    restored = mngr.restore(None, restore)["embedding"]  # falls back to step 1
  assert_same_bits(restored.tables["a__b"], template.oracle[1]["tables"]["a__b"])
  with pytest.raises(ck.CorruptCheckpointError, match=re.escape(str(changed[0]))):
    ck.convert(step, root.parent / "converted", "unstacked")
  assert not (root.parent / "converted").exists()


def test_a_dense_shape_mismatch_names_the_parameter_both_shapes_and_the_step(root, template):
  stored = template.oracle[2]["dense"]
  params = {"w": np.zeros((36, 16), np.float32), "b": stored["params"]["b"]}
  wanted = {"params": params, "opt_state": optax.adam(0.1).init(params), "step": np.int32(0)}
  with ck.CheckpointManager(root) as mngr:
    with pytest.raises(
        ck.IncompatibleCheckpointError,
        match=rf"{re.escape(str(root / '2'))}: item 'dense':.*params/w is stored with shape"
              r" \(20, 16\) but the"
        r" model asks for \(36, 16\)",
    ):
      mngr.restore(2, items={"dense": ocp.args.StandardRestore(fault_lib._abstract(wanted))})


def test_a_dense_item_of_another_optimizer_names_the_arrays_that_differ(root, template):
  """It failed inside Orbax, advising `partial_restore` (half an optimizer's state)."""
  params = template.oracle[2]["dense"]["params"]
  wanted = {"params": params, "opt_state": optax.sgd(0.1, momentum=0.9).init(params),
            "step": np.int32(0)}
  with ck.CheckpointManager(root) as mngr:
    with pytest.raises(ck.IncompatibleCheckpointError) as error:
      mngr.restore(2, items={"dense": ocp.args.StandardRestore(fault_lib._abstract(wanted))})
  message = str(error.value)
  for part in (f"{root / '2'}: item 'dense' holds another tree",
               "it stores 5 arrays the restore does not ask for (opt_state/0/count;"
               " opt_state/0/mu/b; opt_state/0/mu/w; opt_state/0/nu/b; opt_state/0/nu/w)",
               "the restore asks for 2 arrays it does not store (opt_state/0/trace/b;"
               " opt_state/0/trace/w)", "another optax optimizer"):
    assert part in message, message


def test_unfinished_saves_are_removed_but_links_and_foreign_entries_are_left(root, tmp_path):
  (root / "7.orbax-checkpoint-tmp-123").mkdir()
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  (elsewhere / "keep.txt").write_text("x")
  os.symlink(elsewhere, root / "8.orbax-checkpoint-tmp-5")
  (root / "README").write_text("notes")
  with pytest.warns(RuntimeWarning) as caught:
    with ck.CheckpointManager(root) as mngr:
      assert mngr.latest_step() == 2
  said = " ".join(str(w.message) for w in caught)
  assert str(root / "8.orbax-checkpoint-tmp-5") in said and str(root / "README") in said
  assert not (root / "7.orbax-checkpoint-tmp-123").exists()
  assert os.path.islink(root / "8.orbax-checkpoint-tmp-5") and (elsewhere / "keep.txt").exists()
  assert (root / "README").read_text() == "notes"


def test_an_unfinished_save_still_being_finished_is_removed_while_its_files_vanish(
    root, monkeypatch):
  """A save a second Ctrl-C abandoned may still be finishing in a background thread of the
  process, renaming and writing its files while a new manager removes it: the new manager
  failed with FileNotFoundError (the walk listed a file the save had just renamed) or
  "Directory not empty" (the save wrote a file after the walk had emptied a directory)."""
  unfinished = root / "7.orbax-checkpoint-tmp-123"
  (unfinished / "meta.orbax-checkpoint-tmp").mkdir(parents=True)
  (unfinished / "meta.orbax-checkpoint-tmp" / "data").write_text("x")
  rmtree = shutil.rmtree
  calls = []

  def racing_rmtree(path, *args, **kwargs):
    calls.append(path)
    if len(calls) == 1:  # the save renames a directory as the walk reaches it
      os.rename(os.path.join(path, "meta.orbax-checkpoint-tmp"), os.path.join(path, "meta"))
      raise FileNotFoundError(2, "No such file or directory", "meta.orbax-checkpoint-tmp")
    if len(calls) == 2:  # it writes a file into a directory the walk has just emptied
      (unfinished / "meta" / "late").write_text("x")
      raise OSError(errno.ENOTEMPTY, "Directory not empty", "meta")
    return rmtree(path, *args, **kwargs)

  monkeypatch.setattr(shutil, "rmtree", racing_rmtree)
  with ck.CheckpointManager(root) as mngr:
    assert mngr.latest_step() == 2
  assert len(calls) == 3 and not unfinished.exists()


def test_the_reader_refuses_a_link_inside_the_item(root):
  stack = root / "2/embedding/stacks" / "a__b"
  shutil.rmtree(stack)
  os.symlink(root / "1/embedding/stacks/a__b", stack)
  # The handler's check against the step's manifest finds it first; the reader
  # itself refuses it too (an item without a manifest has only that check).
  with pytest.raises(ck.CorruptCheckpointError, match="symbolic link") as caught:
    ck.EmbeddingCheckpointHandler().restore(root / "2/embedding", ck.TableRestore())
  assert str(stack) in str(caught.value)
  with pytest.raises(ck.CorruptCheckpointError, match=f"symbolic links.*{re.escape(str(stack))}"):
    open_reader(root / "2/embedding")
  with pytest.raises(ck.CorruptCheckpointError, match="symbolic link"):
    ck.convert(root / "2", root.parent / "out", "unstacked")


def test_verify_cli_prints_one_line_per_problem_and_fails(root, capsys):
  assert main(["verify", str(root)]) == 0
  assert "0 errors, 0 warnings" in capsys.readouterr().out
  chunk = fault_lib.TARGETS["slot chunk"](root / "1")
  fault_lib._flip(chunk)
  meta = root / "2/meta/metadata"
  meta.write_text("{}")
  assert main(["verify", str(root)]) == 1
  lines = capsys.readouterr().out.strip().splitlines()
  assert lines[:-1] == [
      f"ERROR {chunk}: chunk checksum mismatch (the zarr crc32c codec's trailer)",
      f"ERROR {meta}: has 2 bytes, the manifest says "
      f"{json.loads((root / '2/integrity.json').read_text())['files']['meta/metadata']['size']}"
      " (truncated or changed)",
  ]
  assert lines[-1] == f"{root}: 2 errors, 0 warnings"
  assert main(["verify", str(root / "2")]) == 1
  assert main(["verify", str(root / "2" / "embedding")]) == 0
  assert main(["verify", str(root / "1" / "embedding")]) == 1


def test_verify_of_an_item_in_a_step_checks_it_against_the_step_manifest(root, capsys):
  """An edit that still parses (a slot's initial value) fails the step's manifest: verify of
  the item alone must say so, as a restore or conversion of it does."""
  item = root / "2" / "embedding"
  manifest = item / "manifest.json"
  data = json.loads(manifest.read_text())
  data["groups"][0]["slots"][0]["initial_value"] = 0.5
  manifest.write_text(json.dumps(data))
  assert main(["verify", str(item)]) == 1
  assert f"ERROR {manifest}: " in capsys.readouterr().out
  with pytest.raises(ck.CorruptCheckpointError, match=re.escape(str(manifest))):
    ck.convert(item, root.parent / "out", "unstacked")


def test_a_step_asked_for_by_number_is_never_replaced(root):
  meta = root / "2/meta/metadata"
  meta.write_text(meta.read_text().replace("}", ",", 1))  # Same size, broken JSON.
  with pytest.warns(RuntimeWarning, match=f"{re.escape(str(meta))}: checksum mismatch"), (
      ck.CheckpointManager(root)) as mngr:
    assert mngr.latest_step() == 1
    with pytest.raises(
        ck.NotACheckpointError,
        match=rf"no complete checkpoint for step 2.*{re.escape(str(meta))}: checksum mismatch",
    ):
      mngr.restore(2, items={"meta": ocp.args.JsonRestore()})
    assert mngr.restore(None, items={"meta": ocp.args.JsonRestore()})["meta"]["step"] == 1


def test_links_below_finds_what_the_walk_reports_as_links(tmp_path):
  (tmp_path / "a" / "b" / "c").mkdir(parents=True)
  (tmp_path / "a" / "file").write_text("x")
  (tmp_path / "a" / "b" / "c" / "data").write_text("y")
  os.symlink(tmp_path / "a" / "file", tmp_path / "a" / "b" / "to_file")
  os.symlink(tmp_path / "a" / "b", tmp_path / "a" / "b" / "c" / "to_folder")  # Not followed.
  os.symlink(tmp_path / "missing", tmp_path / "dangling")
  walked = [path for _, path, kind in _integrity.walk(tmp_path) if kind == "link"]
  found = _integrity.links_below(tmp_path)
  assert len(found) == 3
  assert sorted(map(str, found)) == sorted(map(str, walked))
  assert _integrity.links_below(tmp_path / "a" / "b" / "c") == [
      tmp_path / "a" / "b" / "c" / "to_folder"
  ]


def test_a_step_named_through_a_link_to_it_is_verified_where_it_points(root, tmp_path):
  """A `latest` link beside the steps: the handler checks the real step's
  manifest (it refused the link itself), and still finds its damage."""
  latest = tmp_path / "latest"
  os.symlink(root / "2", latest)
  handler = ck.EmbeddingCheckpointHandler()
  through = handler.restore(latest / "embedding", ck.TableRestore())
  direct = handler.restore(root / "2" / "embedding", ck.TableRestore())
  for name, table in direct.tables.items():
    assert_same_bits(through.tables[name], table)
  chunk = fault_lib.TARGETS["table chunk"](root / "2")
  fault_lib._flip(chunk)
  with pytest.raises(ck.CorruptCheckpointError, match="fails its CRC32C checksum"):
    handler.restore(latest / "embedding", ck.TableRestore())


def test_a_root_reached_through_a_link_is_verified_where_it_points(root, tmp_path):
  """A checkpoints root on another disk, linked: verify called it an error that inspect,
  convert and restores accept; the links inside a checkpoint are still refused."""
  linked = tmp_path / "linked"
  os.symlink(root, linked)
  assert _integrity.errors(ck.verify(linked)) == [] and ck.verify(linked) == [
      dataclasses.replace(p, path=linked / p.path.relative_to(root)) for p in ck.verify(root)]
  latest = tmp_path / "latest"
  os.symlink(root / "2", latest)
  assert [p.message for p in _integrity.errors(ck.verify(latest))] == [
      "is a symbolic link; nothing is read through one"]
  fault_lib._flip(fault_lib.TARGETS["table chunk"](root / "2"))
  assert any("chunk checksum mismatch" in p.message for p in _integrity.errors(ck.verify(linked)))


class _RefusedOpen:
  """What TensorStore's open returns when the storage refuses or fails a read."""

  def __init__(self, status):
    self.status = status

  def result(self):
    raise ValueError(f'{self.status}: Error reading "gs://bucket/checkpoints/2/embedding"')


@pytest.mark.parametrize("status", ["UNAVAILABLE", "PERMISSION_DENIED", "DEADLINE_EXCEEDED"])
def test_a_storage_that_refuses_or_fails_a_read_is_not_damage(root, template, monkeypatch,
                                                              status):
  """Every TensorStore read error was CorruptCheckpointError: restore(None) marked the
  newest step damaged, fell back to an older one, and a save of its number moved it aside."""
  layout = template.layout
  restore = ck.EmbeddingRestore(layout, make_mesh(layout.num_devices), AXIS)
  with ck.CheckpointManager(root) as mngr:
    with monkeypatch.context() as patch:
      patch.setattr(_storage, "open_for_read", lambda path: _RefusedOpen(status))
      for step in (None, 2):
        with pytest.raises(ck.CheckpointReadError, match=rf"{status}.*nothing says the"
                                                        r" checkpoint is damaged") as error:
          mngr.restore(step, restore)
        assert not isinstance(error.value, ck.CorruptCheckpointError)
      assert mngr.why_unrestorable(2) is None and mngr.latest_step() == 2
    restored = mngr.restore(None, restore)["embedding"]  # the storage answers again
  assert_same_bits(restored.tables["a__b"], template.oracle[2]["tables"]["a__b"])


@pytest.mark.filterwarnings("ignore:checkpoint step .* is skipped:RuntimeWarning")
def test_bytes_the_storage_returned_wrong_are_damage(root, template, monkeypatch):
  layout = template.layout
  restore = ck.EmbeddingRestore(layout, make_mesh(layout.num_devices), AXIS)
  with ck.CheckpointManager(root) as mngr:
    with monkeypatch.context() as patch:
      patch.setattr(_storage, "open_for_read", lambda path: _RefusedOpen("DATA_LOSS"))
      with pytest.raises(ck.CorruptCheckpointError, match="DATA_LOSS"):
        mngr.restore(2, restore)
    assert "DATA_LOSS" in mngr.why_unrestorable(2)


@pytest.mark.parametrize("refused_file", [_integrity.INTEGRITY_FILE, "meta/metadata"])
def test_a_file_the_storage_refuses_to_read_does_not_make_the_step_incomplete(
    root, monkeypatch, refused_file):
  """A step whose integrity.json or metadata could not be read was listed as incomplete
  and skipped: latest_step named the step before it."""
  refused = str(root / "2" / refused_file)
  path_type = type(epath.Path(refused))
  real_read_text, real_crc32c = path_type.read_text, _integrity.crc32c_of_file

  def refuse(path):
    if str(path) == refused:
      raise PermissionError(13, "Permission denied", str(path))

  def read_text(path, *args, **kwargs):
    refuse(path)
    return real_read_text(path, *args, **kwargs)

  def crc32c_of_file(path, **kwargs):
    refuse(path)
    return real_crc32c(path, **kwargs)

  with ck.CheckpointManager(root) as mngr:
    with monkeypatch.context() as patch:
      patch.setattr(path_type, "read_text", read_text)
      patch.setattr(_integrity, "crc32c_of_file", crc32c_of_file)
      with pytest.raises(ck.CheckpointReadError,
                         match=f"{re.escape(str(refused))}.*PermissionError.*left as"):
        mngr.reload()
        mngr.latest_step()
    mngr.reload()
    assert mngr.latest_step() == 2


@pytest.mark.parametrize("refused_file", ["embedding/layout.json", "embedding/manifest.json"])
def test_a_refused_read_of_an_items_layout_or_manifest_names_the_file_and_marks_nothing(
    root, template, monkeypatch, refused_file):
  """They raised the bare PermissionError of the file system, without the checkpoint."""
  refused = str(root / "2" / refused_file)
  path_type = type(epath.Path(refused))
  real_read_text = path_type.read_text

  def read_text(path, *args, **kwargs):
    if str(path) == refused:
      raise PermissionError(13, "Permission denied", str(path))
    return real_read_text(path, *args, **kwargs)

  layout = template.layout
  restore = ck.EmbeddingRestore(layout, make_mesh(layout.num_devices), AXIS)
  with ck.CheckpointManager(root) as mngr:
    with monkeypatch.context() as patch:
      patch.setattr(path_type, "read_text", read_text)
      for step in (None, 2):
        with pytest.raises(ck.CheckpointReadError,
                           match=f"{re.escape(str(refused))}.*PermissionError.*left as"):
          mngr.restore(step, restore)
    assert mngr.why_unrestorable(2) is None and mngr.latest_step() == 2
    restored = mngr.restore(None, restore)["embedding"]
  assert_same_bits(restored.tables["a__b"], template.oracle[2]["tables"]["a__b"])


@pytest.mark.parametrize("name", ["exp[1]", "a[bc]d", "exp*", "q?x"])
def test_a_root_whose_path_orbax_globs_wrongly_is_refused_for_saves(tmp_path, template, name):
  """Orbax merges a dense item's per-process parts found by a glob below the item: under
  'exp[1]' it found none, so every step was saved unmerged, listed complete, verified
  clean, and failed every restore with TensorStore's NOT_FOUND."""
  root = tmp_path / name / "checkpoints"
  with pytest.raises(ValueError, match=rf"under '{re.escape(str(root))}': \['{re.escape(name)}'\]"
                                       r" contain '\*', '\?' or '\[...\]'.*glob"):
    ck.CheckpointManager(root)
  assert not root.exists()
  shutil.copytree(template.root, root)  # Saved elsewhere: it reads.
  layout = template.layout
  with ck.CheckpointManager(root, read_only=True) as mngr:
    restored = mngr.restore(None, ck.EmbeddingRestore(layout, make_mesh(layout.num_devices),
                                                      AXIS))["embedding"]
  assert_same_bits(restored.tables["a__b"], template.oracle[2]["tables"]["a__b"])


@pytest.mark.parametrize("name", ["runs]", "exp[", "x-y.z"])
def test_a_root_whose_glob_characters_match_themselves_saves_and_restores(tmp_path, name):
  root = tmp_path / name / "checkpoints"
  tree = {"w": np.arange(6, dtype=np.float32)}
  with ck.CheckpointManager(root) as mngr:
    mngr.save(1, items={"dense": ocp.args.StandardSave(tree)})
    mngr.wait_until_finished()
    with pytest.raises(ValueError, match=r"with items \['d\[0\]'\]: \['d\[0\]'\] contain"):
      mngr.save(2, items={"d[0]": ocp.args.StandardSave(tree)}, force=True)
  with ck.CheckpointManager(root, read_only=True) as mngr:
    assert mngr.all_steps() == [1]
    restored = mngr.restore(1, items={"dense": ocp.args.StandardRestore(tree)})["dense"]
  assert_same_bits(restored["w"], tree["w"])


def test_a_dense_item_orbax_never_merged_is_not_marked_complete_nor_listed(root):
  dense = root / "2" / "dense"
  assert (dense / "manifest.ocdbt").exists() and list(dense.glob("ocdbt.process_*"))
  (dense / "manifest.ocdbt").unlink()
  with pytest.raises(ck.CorruptCheckpointError, match=r"never merged .*: dense\. It is not"):
    _integrity.write_manifest(root / "2", step=2)
  # A step listed so by an older version: an error, and the step is skipped.
  files = _integrity.read_manifest(root / "2")
  del files["dense/manifest.ocdbt"]
  (root / "2" / _integrity.INTEGRITY_FILE).write_text(_integrity.manifest_json(files, step=2))
  problems = [p for p in ck.verify(root) if p.severity == "error"]
  assert [str(p.path) for p in problems] == [str(dense)], problems
  assert "never merged" in problems[0].message
  with pytest.warns(RuntimeWarning, match=r"2 is skipped: .*never merged"):
    with ck.CheckpointManager(root, read_only=True) as mngr:
      assert mngr.latest_step() == 1


def test_a_skipped_step_is_named_once_per_manager_and_reason(root, template):
  """Listing, latest_step and restore(None) each warned, from their own lines (2-3 times)."""
  chunk = fault_lib.TARGETS["table chunk"](root / "2")
  fault_lib._flip(chunk)
  layout = template.layout
  restore = ck.EmbeddingRestore(layout, make_mesh(layout.num_devices), AXIS)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with ck.CheckpointManager(root) as mngr:
      for _ in range(2):
        mngr.restore(None, restore)
        assert mngr.latest_step() == 1
      (root / "1" / "integrity.json").write_text("")  # Another reason, another step.
      mngr.reload()
      for _ in range(2):
        assert mngr.latest_step() is None
  skipped = [str(w.message) for w in caught if "is skipped" in str(w.message)]
  assert len(skipped) == 2, "\n".join(skipped)
  assert f"{root / '2'} is skipped: a restore found it damaged" in skipped[0]
  assert f"{root / '1'} is skipped: " in skipped[1]


@pytest.mark.filterwarnings("ignore:.* was in the way of saving step:RuntimeWarning")
def test_a_step_saved_again_and_damaged_again_is_named_again(root, template):
  layout = template.layout
  restore = ck.EmbeddingRestore(layout, make_mesh(layout.num_devices), AXIS)
  model, _, tables, slots, *_ = fault_lib._step_state(2)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with ck.CheckpointManager(root) as mngr:
      for _ in range(2):
        fault_lib._flip(fault_lib.TARGETS["table chunk"](root / "2"))
        mngr.restore(None, restore)
        assert mngr.latest_step() == 1
        assert mngr.save(2, ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout)),
                         force=True)
        mngr.wait_until_finished()
  skipped = [str(w.message) for w in caught if "is skipped" in str(w.message)]
  assert len(skipped) == 2, "\n".join(skipped)


def test_a_save_whose_directory_cannot_be_made_raises_and_leaves_no_thread_waiting(
    root, monkeypatch):
  """Read-only or full storage refused the step's temporary directory: Orbax made it in a
  background thread, and the save's other threads then waited for it for 20 minutes, so
  the process hung after the save had failed. It is now made inside `save`."""
  import threading
  import time
  import jax
  from fault_lib import _step_state
  model, layout, tables, slots, _, _, _ = _step_state(1)
  makedirs = os.makedirs

  def read_only_makedirs(path, *args, **kwargs):
    if ".orbax-checkpoint-tmp" in os.fspath(path):
      raise OSError(errno.EROFS, "Read-only file system", os.fspath(path))
    return makedirs(path, *args, **kwargs)

  mngr = ck.CheckpointManager(root, keep_latest=5)
  before = set(threading.enumerate())
  monkeypatch.setattr(os, "makedirs", read_only_makedirs)
  with pytest.raises(OSError, match=r"Read-only file system.*3\.orbax-checkpoint-tmp"):
    mngr.save(3, ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout)))
    mngr.wait_until_finished()
  monkeypatch.setattr(os, "makedirs", makedirs)
  deadline = time.monotonic() + 10
  while time.monotonic() < deadline:
    waiting = [t for t in set(threading.enumerate()) - before if t.is_alive() and not t.daemon]
    if not waiting:
      break
    time.sleep(0.1)
  assert not waiting, [t.name for t in waiting]
  assert mngr.latest_step() == 2
  jax.block_until_ready(tables)


def test_an_unfinished_save_that_cannot_be_removed_is_left_with_a_warning(root, monkeypatch):
  """On read-only storage a failed save's directory cannot be removed: opening a manager
  (which evaluate and predict do) failed with "Read-only file system: 'embedding'"."""
  from checkpoint import _steps
  unfinished = root / "3.orbax-checkpoint-tmp"
  (unfinished / "embedding").mkdir(parents=True)

  def refused(path, **_):
    raise OSError(errno.EROFS, "Read-only file system", "embedding")

  monkeypatch.setattr(_steps, "_remove_tree", refused)
  with pytest.warns(RuntimeWarning, match=rf"{re.escape(str(unfinished))}: an unfinished save"
                                          r" could not be removed \(.*Read-only file system"):
    with ck.CheckpointManager(root) as mngr:
      assert mngr.latest_step() == 2
      assert mngr.restore(None, ck.TableRestore())["embedding"]
  assert unfinished.exists()

  def failing(path, **_):  # a disk error, or a writer still at work in it: not hidden
    raise OSError(errno.EIO, "Input/output error", "embedding")

  monkeypatch.setattr(_steps, "_remove_tree", failing)
  with pytest.raises(OSError, match="Input/output error"):
    ck.CheckpointManager(root)


def test_verify_names_an_unfinished_save_as_one(root, capsys):
  (root / "3.orbax-checkpoint-tmp" / "embedding").mkdir(parents=True)
  assert main(["verify", str(root)]) == 0
  out = capsys.readouterr().out
  assert f"{root / '3.orbax-checkpoint-tmp'}: an unfinished save, never a step" in out, out


def test_files_that_end_with_their_own_crc32c_get_checksums_of_their_content(root):
  # OCDBT's files end with the CRC32C of the bytes before it, and the CRC32C of such a
  # file is one constant whatever it holds: the manifest must not record that.
  step1, step2 = epath.Path(root / "1"), epath.Path(root / "2")
  files1 = json.loads((step1 / "integrity.json").read_text())["files"]
  files2 = json.loads((step2 / "integrity.json").read_text())["files"]
  rel = "in_flight/manifest.ocdbt"
  whole = [google_crc32c.value((step / rel).read_bytes()) for step in (step1, step2)]
  assert whole[0] == whole[1]  # the constant a whole-file CRC32C would record
  assert files1[rel] != files2[rel]
  shutil.copyfile(step1 / rel, step2 / rel)
  problems = _integrity.check_step(step2, depth="items", items=["in_flight"])
  assert [str(p) for p in _integrity.errors(problems)] == [
      f"{step2 / rel}: checksum mismatch (CRC32C differs from the manifest)"]


def _as_format_1(step_dir):
  """The step's manifest rewritten as format 1 wrote it: whole-file CRC32Cs."""
  path = step_dir / "integrity.json"
  data = json.loads(path.read_text())
  files = {rel: entry if "zarr_crc32c" in entry else {
      "size": entry["size"], "crc32c": google_crc32c.value((step_dir / rel).read_bytes())}
           for rel, entry in data["files"].items()}
  path.write_text(json.dumps({
      "format": data["format"], "format_version": 1, "files": files,
      "digest": google_crc32c.value(json.dumps(files, sort_keys=True).encode())}))


def test_a_manifest_of_format_1_is_still_read_and_checked(root, template):
  root = epath.Path(root)
  _as_format_1(root / "2")
  assert _integrity.errors(_integrity.check_step(root / "2", depth="full")) == []
  layout = template.layout
  restore = ck.EmbeddingRestore(layout, make_mesh(layout.num_devices), AXIS)
  with ck.CheckpointManager(root, read_only=True) as manager:
    restored = manager.restore(2, restore)["embedding"]
  assert_same_bits(restored.tables["a__b"], template.oracle[2]["tables"]["a__b"])
  fault_lib._flip(root / "2/meta/metadata")
  problems = _integrity.errors(_integrity.check_step(root / "2", depth="items"))
  assert [p.path for p in problems] == [root / "2/meta/metadata"]


def test_verify_names_a_link_in_place_of_a_commit_file(root, tmp_path):
  step = epath.Path(root / "2")
  target = tmp_path / "elsewhere_metadata"
  shutil.copyfile(step / _integrity.ORBAX_STEP_METADATA, target)
  (step / _integrity.ORBAX_STEP_METADATA).unlink()
  os.symlink(target, step / _integrity.ORBAX_STEP_METADATA)
  assert [(p.path, p.message) for p in _integrity.errors(ck.verify(step))] == [
      (step / _integrity.ORBAX_STEP_METADATA, "is a symbolic link; nothing is read through one")]


def test_verify_warns_of_orbax_step_metadata_that_does_not_parse(root):
  """It is outside the manifest (Orbax's commit rewrites it): a flipped byte there went
  unreported, while every restore logged Orbax's "Failed to json parse" errors."""
  metadata = root / "2" / _integrity.ORBAX_STEP_METADATA
  metadata.write_text(metadata.read_text()[:-3])
  for path in (root, root / "2"):
    problems = ck.verify(path)
    assert _integrity.errors(problems) == []
    assert [(p.severity, p.path) for p in problems if "step metadata" in p.message] == [
        ("warning", metadata)]


@pytest.mark.filterwarnings("ignore:checkpoint step .* is skipped:RuntimeWarning")
@pytest.mark.parametrize("swapped", ["the step directories", "their integrity.json"])
def test_steps_whose_directories_or_manifests_were_swapped_are_not_read_as_each_other(
    root, template, swapped, capsys):
  """Swapped step directories are complete saves whose files all match their manifests
  (a botched rename or sync): restore, the handler, verify and convert took step 1's
  state as step 2's. The manifest records the step whose save it lists; with only the
  manifests swapped, the files fail them and each step is incomplete."""
  assert [json.loads((root / str(step) / "integrity.json").read_text())["step"]
          for step in (1, 2)] == [1, 2]
  what = "" if swapped == "the step directories" else "integrity.json"
  os.rename(root / "1" / what, root / "swap")
  os.rename(root / "2" / what, root / "1" / what)
  os.rename(root / "swap", root / "2" / what)
  before = _files(root)
  wrong = {step: f"{root / str(step) / 'integrity.json'}: is the integrity manifest of step"
                 f" {3 - step}, but its directory is step {step}" for step in (1, 2)}
  errors = sorted(_integrity.errors(ck.verify(root)), key=lambda p: str(p.path))
  assert [p.path for p in errors] == [root / step / "integrity.json" for step in ("1", "2")]
  assert all(wrong[step] in str(p) for step, p in zip((1, 2), errors)), errors
  layout = template.layout
  restore = ck.EmbeddingRestore(layout, make_mesh(layout.num_devices), AXIS)
  # Which of the two happened, and what to do about it.
  cause = ("its files are step {}'s save" if not what else
           "and its files do not match it (a partial copy of step {}")
  assert all(cause.format(3 - step) in p.message for step, p in zip((1, 2), errors)), errors
  with ck.CheckpointManager(root, read_only=True) as mngr:
    if what:  # Files that fail the manifest: incomplete steps, not listed.
      assert mngr.all_steps() == []
    else:
      # Whole saves are listed (a listing checks that a step's files are there, not
      # whose they are), as a step with a flipped chunk is; neither restores.
      assert mngr.all_steps() == [1, 2]
      with pytest.raises(ck.CorruptCheckpointError, match=re.escape(wrong[1])):
        mngr.restore(None, restore)  # Falls back past step 2; step 1 fails too.
  with ck.CheckpointManager(root, read_only=True) as mngr:
    for step in (1, 2):
      with pytest.raises(ck.CheckpointError, match=re.escape(wrong[step])):
        mngr.restore(step, restore)
  with pytest.raises(ck.CorruptCheckpointError, match=re.escape(wrong[2])):
    ck.EmbeddingCheckpointHandler().restore(root / "2" / "embedding", ck.TableRestore())
  with pytest.raises(ck.CorruptCheckpointError, match=re.escape(wrong[2])):
    ck.convert(root / "2", root.parent / "converted", "unstacked")
  for command in ("compact", "inspect"):
    assert main([command, str(root / "2")]) == 1
    assert wrong[2] in capsys.readouterr().err
  assert main(["verify", str(root / "1")]) == 1
  assert wrong[1] in capsys.readouterr().out
  assert _files(root) == before and not (root.parent / "converted").exists()
  # Put back under their own numbers, both steps are whole again.
  os.rename(root / "1" / what, root / "swap")
  os.rename(root / "2" / what, root / "1" / what)
  os.rename(root / "swap", root / "2" / what)
  with ck.CheckpointManager(root, read_only=True) as mngr:
    for step in (1, 2):
      restored = mngr.restore(step, restore)["embedding"]
      assert_same_bits(restored.tables["a__b"], template.oracle[step]["tables"]["a__b"])


def test_a_step_converted_or_adopted_records_the_step_whose_save_it_holds(root, tmp_path):
  """A conversion records its source's step, whatever its destination's name (a
  date-named export is no other step); a step adopted records its directory's."""
  for dst in (tmp_path / "other" / "2", tmp_path / "2024.06.01", tmp_path / "best"):
    out = ck.convert(root / "2", dst, "unstacked").parent
    assert json.loads((out / "integrity.json").read_text())["step"] == 2
    assert _integrity.errors(_integrity.check_step(out, depth="full")) == []
  shutil.copytree(tmp_path / "2024.06.01", tmp_path / "again" / "2")  # Under its number.
  with ck.CheckpointManager(tmp_path / "again", read_only=True) as mngr:
    assert mngr.restore(2, items={"meta": ocp.args.JsonRestore()})["meta"]["step"] == 2
  (root / "1" / "integrity.json").unlink()
  assert main(["verify", "--adopt", str(root / "1")]) == 0
  assert json.loads((root / "1" / "integrity.json").read_text())["step"] == 1
  assert [_integrity.step_of(name) for name in (
      "12", "0012", "12.compacting", "2024.06.01", "best", "12b", "")] == [
          12, 12, None, None, None, None, None]


@pytest.mark.parametrize("mix", ["from another item", "swapped within the array"])
def test_a_bare_items_chunk_of_another_item_or_position_is_refused(root, template, tmp_path,
                                                                    mix):
  """A bare item (convert's output outside any step) had only its chunks' checksums,
  which such chunks keep: verify, restore and convert passed them."""
  bare = {step: tmp_path / f"bare{step}" for step in (1, 2)}
  for step, item in bare.items():
    assert ck.convert(root / str(step) / "embedding", item, template.layout) == item
  assert json.loads((bare[2] / "item_integrity.json").read_text())["files"]
  assert not (bare[2] / "integrity.json").exists()  # nothing takes it for a step
  assert _integrity.errors(ck.verify(bare[2])) == []
  layout = template.layout
  restore = ck.EmbeddingRestore(layout, make_mesh(layout.num_devices), AXIS)
  tables = ck.EmbeddingCheckpointHandler().restore(bare[2], restore).tables
  assert_same_bits(tables["a__b"], template.oracle[2]["tables"]["a__b"])
  chunks = sorted(p for p in (bare[2] / "stacks" / "a__b" / "table" / "c").rglob("*")
                  if p.is_file())
  if mix == "from another item":
    changed = [chunks[0]]
    shutil.copyfile(bare[1] / chunks[0].relative_to(bare[2]), chunks[0])
  else:
    changed = chunks[:2]
    first, second = (path.read_bytes() for path in changed)
    assert len(first) == len(second) and first != second
    changed[0].write_bytes(second), changed[1].write_bytes(first)
  errors = _integrity.errors(ck.verify(bare[2]))
  assert {str(p.path) for p in errors} == {str(path) for path in changed}, errors
  assert all("a chunk of another step or position" in p.message for p in errors)
  assert main(["verify", str(bare[2])]) == 1
  with pytest.raises(ck.CorruptCheckpointError, match=re.escape(str(changed[0]))):
    ck.EmbeddingCheckpointHandler().restore(bare[2], restore)
  with pytest.raises(ck.CorruptCheckpointError, match=re.escape(str(changed[0]))):
    ck.convert(bare[2], tmp_path / "again", "unstacked")
  assert not (tmp_path / "again").exists()


def test_a_bare_item_is_never_taken_for_a_step_and_a_lost_manifest_is_named(
    root, template, tmp_path, capsys):
  """Its manifest is named apart from a step's: a bare item put in a root under a step
  number was listed as the root's latest step (a Trainer could not start), and convert
  replaced it as if it were a step. Its manifest.json says it has one, so a lost one is
  an error, not an item from before bare items carried one."""
  bare = tmp_path / "bare"
  ck.convert(root / "2" / "embedding", bare, template.layout)
  assert json.loads((bare / "manifest.json").read_text())["item_integrity"] is True
  shutil.copytree(bare, root / "9")
  with pytest.warns(RuntimeWarning, match=r"9 is skipped"):
    with ck.CheckpointManager(root, read_only=True) as mngr:
      assert mngr.all_steps() == [1, 2]
  with pytest.raises(FileExistsError, match=r"not a checkpoint step directory"):
    ck.convert(root / "1", bare, "unstacked", overwrite=True)
  assert main(["compact", str(bare)]) == 1
  assert "compact takes a step directory" in capsys.readouterr().err
  (bare / "item_integrity.json").unlink()
  lost = f"{bare / 'item_integrity.json'}: is missing, but the item's manifest.json says"
  assert [str(p) for p in _integrity.errors(ck.verify(bare))][0].startswith(lost)
  layout = template.layout
  restore = ck.EmbeddingRestore(layout, make_mesh(layout.num_devices), AXIS)
  with pytest.raises(ck.CorruptCheckpointError, match=re.escape(lost)):
    ck.EmbeddingCheckpointHandler().restore(bare, restore)
  with pytest.raises(ck.CorruptCheckpointError, match=re.escape(lost)):
    ck.convert(bare, tmp_path / "again", "unstacked")
  assert main(["inspect", str(bare)]) == 1
  assert lost in capsys.readouterr().err


def test_inspect_checks_a_step_named_through_a_link_where_it_points(root, capsys):
  os.symlink(root / "2", root.parent / "latest")
  for path in (root.parent / "latest", root.parent / "latest" / "embedding"):
    assert main(["inspect", str(path)]) == 0, capsys.readouterr().err
    assert "stack 'a__b'" in capsys.readouterr().out


def test_a_flipped_step_number_in_the_manifest_is_damage_not_another_steps_save(root, capsys):
  """"step" is outside "digest" (older readers check that over "files" only): a flip
  2 -> 3 read as step 3's save, and the advice to rename the step made step 2's state
  restore as step 3. It has a digest of its own."""
  path = root / "2" / "integrity.json"
  data = json.loads(path.read_text())
  assert data["step"] == 2 and data["step_digest"] == google_crc32c.value(b"2")
  path.write_text(path.read_text().replace('"step": 2', '"step": 3'))
  assert main(["verify", str(root / "2")]) == 1
  out = capsys.readouterr().out
  assert "the digest of its step (3) does not match it" in out and "Put it back" not in out
  for dropped, damaged in (("step", True), ("step_digest", True), ("both", False)):
    data = {**json.loads(path.read_text()), "step": 2, "step_digest": google_crc32c.value(b"2")}
    for key in (("step", "step_digest") if dropped == "both" else (dropped,)):
      del data[key]
    path.write_text(json.dumps(data))
    assert bool(_integrity.errors(ck.verify(root / "2"))) == damaged, dropped
  # Readers of the format before "step" check "digest" over "files" alone: still whole.
  old = json.loads(path.read_text())
  assert old["digest"] == google_crc32c.value(json.dumps(old["files"], sort_keys=True).encode())


def test_the_handler_refuses_an_item_whose_step_lost_its_integrity_manifest(root, template,
                                                                           tmp_path):
  """The handler's restore took a step without integrity.json for one written by Orbax's
  own managers and read it unchecked: with two of its chunks swapped as well, it
  restored wrong values. The item records that its step was given one."""
  item = root / "2" / "embedding"
  assert json.loads((item / "manifest.json").read_text())["step_integrity"] is True
  (root / "2" / "integrity.json").unlink()
  chunks = sorted(p for p in (item / "stacks" / "a__b" / "table" / "c").rglob("*")
                  if p.is_file())
  first, second = chunks[0].read_bytes(), chunks[1].read_bytes()
  assert len(first) == len(second) and first != second
  chunks[0].write_bytes(second), chunks[1].write_bytes(first)
  layout = template.layout
  restore = ck.EmbeddingRestore(layout, make_mesh(layout.num_devices), AXIS)
  lost = rf"{re.escape(str(root / '2'))} has no integrity.json, but its item"
  with pytest.raises(ck.CorruptCheckpointError, match=lost):
    ck.EmbeddingCheckpointHandler().restore(item, restore)
  for path in (root / "2", item):
    with pytest.raises(ck.CorruptCheckpointError, match=lost):
      ck.inspect(path)
  # An item copied out of its step on its own reads as before (its chunks' checksums).
  shutil.copytree(item, tmp_path / "copied")
  ck.EmbeddingCheckpointHandler().restore(tmp_path / "copied", restore)
  # A step of Orbax's own manager, with this handler, never had one: read as before.
  rows = jax.sharding.NamedSharding(make_mesh(layout.num_devices),
                                    jax.sharding.PartitionSpec(AXIS, None))
  tables = {"a__b": jax.device_put(template.oracle[2]["tables"]["a__b"], rows)}
  slots = {"a__b": {name: jax.device_put(array, rows)
                    for name, array in template.oracle[2]["slots"]["a__b"].items()}}
  with ocp.CheckpointManager(tmp_path / "orbax") as orbax_manager:
    orbax_manager.save(5, args=ocp.args.Composite(
        embedding=ck.EmbeddingSave(tables, slots, layout, template.slot_specs)))
  orbax_item = tmp_path / "orbax" / "5" / "embedding"
  assert "step_integrity" not in json.loads((orbax_item / "manifest.json").read_text())
  restored = ck.EmbeddingCheckpointHandler().restore(orbax_item, restore)
  assert_same_bits(restored.tables["a__b"], tables["a__b"])
