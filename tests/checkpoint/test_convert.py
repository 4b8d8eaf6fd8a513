"""Offline conversion between layouts, to and from unstacked arrays, of step directories."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp
from etils import epath
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import checkpoint as ck
from ckpt_testlib import AXIS, make_mesh, make_model
from sc_framework import FeatureSpec, TableSpec, stack_tables
from sc_framework.optimizers import Adagrad, Adam, RowWiseAdagrad
from tests.numerics import assert_same_bits

TABLES = [("a", 64, 12), ("b", 120, 10), ("c", 40, 16), ("d", 200, 8)]


def _saved(path, optimizer=Adam()):
  model = make_model([spec + (optimizer,) for spec in TABLES], seed=2)
  layout = model.layout([["a", "b"], ["c"], ["d"]], 8)
  tables, slots = model.state(layout)
  with ocp.Checkpointer(ck.EmbeddingCheckpointHandler()) as ckptr:
    ckptr.save(path, args=ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout)))
  return model, layout


def _check_tables(model, path):
  arrays = ck.EmbeddingCheckpointHandler().restore(path, ck.TableRestore())
  assert set(arrays.tables) == set(model.logical)
  for name, logical in model.logical.items():
    assert_same_bits(arrays.tables[name], logical)
    assert set(arrays.slots[name]) == set(model.slots[name])
    for slot, values in model.slots[name].items():
      assert_same_bits(arrays.slots[name][slot], values)


@pytest.mark.parametrize(
    "middle, optimizer",
    [
        ((2, 4, [["c", "a", "b"], ["d"]]), Adam()),
        ((1, 1, None), Adagrad(initial_accumulator=0.25)),
        ((4, 3, [["a"], ["b", "c"], ["d"]]), Adagrad()),
    ],
)
def test_a_to_b_to_a_is_bit_exact(tmp_path, middle, optimizer):
  model, layout_a = _saved(tmp_path / "a", optimizer)
  devices, shards, groups = middle
  layout_b = ck.relayout(layout_a, num_devices=devices, shards_per_device=shards, groups=groups)
  ck.convert(tmp_path / "a", tmp_path / "b", layout_b, block_bytes=1024)
  assert ck.CheckpointReader(tmp_path / "b").layout == layout_b
  _check_tables(model, tmp_path / "b")
  ck.convert(tmp_path / "b", tmp_path / "a2", layout_a, block_bytes=1024)
  _check_tables(model, tmp_path / "a2")
  # Back in layout A, the stacked arrays equal the originals, padding included.
  original, again = ck.CheckpointReader(tmp_path / "a"), ck.CheckpointReader(tmp_path / "a2")
  for stack in layout_a.stacks:
    for slot in [None] + [spec.name for spec in optimizer.slots()]:
      assert_same_bits(
          again.read_block(stack.name, slot, 0, stack.vocabulary_size),
          original.read_block(stack.name, slot, 0, stack.vocabulary_size),
      )


_LAYOUTS = st.tuples(
    st.sampled_from([1, 2, 3, 4, 8]),
    st.sampled_from([1, 2, 3]),
    st.sampled_from(
        [None, [["a"], ["b"], ["c"], ["d"]], [["c", "a", "b"], ["d"]], [["b", "c"], ["d"], ["a"]]]
    ),
)


@settings(
    max_examples=10, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(source=_LAYOUTS, target=st.one_of(_LAYOUTS, st.just("unstacked")), seed=st.integers(0, 99))
def test_strided_assembly_equals_the_tables_and_the_row_by_row_path(
    tmp_path_factory, source, target, seed
):
  """Conversions of random layouts, read by strided copies from raw chunks (direct) and,
  from a compressed copy of the same source, row by row through TensorStore: both give
  the model's tables bit for bit, and the same arrays, padding included."""
  tmp = tmp_path_factory.mktemp("strided")
  model = make_model([spec + (RowWiseAdagrad(),) for spec in TABLES], seed=seed)
  layout = model.layout(source[2] or [["a", "b"], ["c"], ["d"]], source[0], source[1])
  tables, slots = model.state(layout)
  with ocp.Checkpointer(ck.EmbeddingCheckpointHandler()) as ckptr:
    for name, compression in [("raw", "none"), ("zstd", "zstd")]:
      storage = ck.StorageOptions(compression=compression, chunk_bytes=1024)
      save = ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout), storage)
      ckptr.save(tmp / name, args=save)
  if target != "unstacked":
    devices, shards, groups = target
    target = ck.relayout(layout, num_devices=devices, shards_per_device=shards, groups=groups)
  raw_storage = ck.StorageOptions(chunk_bytes=1024)
  ck.convert(tmp / "raw", tmp / "direct", target, block_bytes=2048)
  ck.convert(tmp / "zstd", tmp / "listed", target, storage=raw_storage, block_bytes=2048)
  _check_tables(model, tmp / "direct")
  direct, listed = ck.CheckpointReader(tmp / "direct"), ck.CheckpointReader(tmp / "listed")
  for group in direct.manifest.groups:
    for slot in (None, "accumulator"):
      rows = group.table.shape[0]
      assert_same_bits(
          direct.read_block(group.name, slot, 0, rows), listed.read_block(group.name, slot, 0, rows)
      )


def test_unstacked_round_trip_and_restore_from_unstacked(tmp_path):
  model, layout = _saved(tmp_path / "a", RowWiseAdagrad())
  ck.convert(tmp_path / "a", tmp_path / "u", "unstacked", block_bytes=512)
  reader = ck.CheckpointReader(tmp_path / "u")
  assert reader.kind == "unstacked" and reader.layout is None
  assert reader.array_info("b").shape == (120, 10) and reader.array_info(
      "b", "accumulator"
  ).shape == (120, 1)
  _check_tables(model, tmp_path / "u")
  # The restore path reads unstacked checkpoints directly, into any layout.
  target = model.layout([["a", "b", "c"], ["d"]], 2, 2)
  restored = ck.EmbeddingCheckpointHandler().restore(
      tmp_path / "u", ck.EmbeddingRestore(target, make_mesh(2), AXIS)
  )
  model.check(target, restored.tables, restored.slots)
  # And unstacked -> stacked conversion gives back the original layout exactly.
  ck.convert(tmp_path / "u", tmp_path / "s", layout, block_bytes=2048)
  again = ck.EmbeddingCheckpointHandler().restore(
      tmp_path / "s", ck.EmbeddingRestore(layout, make_mesh(8), AXIS)
  )
  model.check(layout, again.tables, again.slots)


@pytest.mark.filterwarnings("ignore:Sharding info not provided")
def test_step_directory_conversion_keeps_the_other_items(tmp_path):
  model = make_model([spec + (Adam(),) for spec in TABLES], seed=3)
  layout = model.layout([["a", "b"], ["c"], ["d"]], 8)
  tables, slots = model.state(layout)
  params = {"w": np.arange(12, dtype=np.float32).reshape(3, 4)}
  with ck.CheckpointManager(tmp_path / "run") as mngr:
    mngr.save(
        7,
        ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout)),
        items={
            "params": ocp.args.StandardSave(params),
            "data": ocp.args.JsonSave({"position": 99}),
        },
    )
  target = ck.relayout(layout, num_devices=2, shards_per_device=1)
  calls = []
  written = ck.convert(
      tmp_path / "run" / "7",
      tmp_path / "moved" / "7",
      target,
      progress=lambda done, total, what: calls.append((done, total, what)),
  )
  assert written == tmp_path / "moved" / "7" / "embedding"
  assert calls and calls[-1][0] == calls[-1][1] > 0
  with ck.CheckpointManager(tmp_path / "moved") as mngr:
    assert mngr.latest_step() == 7
    restored = mngr.restore(
        embedding=ck.EmbeddingRestore(target, make_mesh(2), AXIS),
        items={"params": ocp.args.StandardRestore(params), "data": ocp.args.JsonRestore()},
    )
  model.check(target, restored["embedding"].tables, restored["embedding"].slots)
  assert_same_bits(restored["params"]["w"], params["w"])
  assert restored["data"] == {"position": 99}


def test_conversion_streams_in_blocks_and_refuses_to_overwrite(tmp_path):
  model, layout = _saved(tmp_path / "a")
  calls = []
  ck.convert(
      tmp_path / "a",
      tmp_path / "b",
      ck.relayout(layout, num_devices=4, shards_per_device=2),
      block_bytes=256,
      progress=lambda *call: calls.append(call),
  )
  assert len(calls) > 40  # Many small blocks, never a whole table at once.
  with pytest.raises(FileExistsError, match="already exists"):
    ck.convert(tmp_path / "a", tmp_path / "b", "unstacked")
  ck.convert(tmp_path / "a", tmp_path / "b", "unstacked", overwrite=True)
  assert ck.CheckpointReader(tmp_path / "b").kind == "unstacked"
  assert not [p for p in tmp_path.iterdir() if ocp.path.atomicity.TMP_DIR_SUFFIX in p.name]
  _check_tables(model, tmp_path / "b")


@pytest.mark.parametrize("overwrite", [True, False])
def test_a_destination_that_is_a_symbolic_link_is_refused_before_anything_is_written(
    tmp_path, overwrite):
  """With overwrite, the link was renamed aside, the conversion put in its place, and the
  deletion of the renamed link failed ("Cannot call rmtree on a symbolic link")."""
  _saved(tmp_path / "a")
  (tmp_path / "real").mkdir()
  (tmp_path / "link").symlink_to(tmp_path / "real")
  (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
  for dst in (tmp_path / "link", tmp_path / "dangling"):
    with pytest.raises(ValueError, match=rf"{re.escape(str(dst))} is a symbolic link .*never"
                                         r" writes through"):
      ck.convert(tmp_path / "a", dst, "unstacked", overwrite=overwrite)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "dangling", "link", "real"]
  assert not list((tmp_path / "real").iterdir())


def test_conversion_can_change_the_codecs(tmp_path):
  model, layout = _saved(tmp_path / "a")
  storage = ck.StorageOptions(
      compression="zstd", compression_level=3, checksum="none", chunk_bytes=2048
  )
  ck.convert(tmp_path / "a", tmp_path / "z", layout, storage=storage)
  assert ck.CheckpointReader(tmp_path / "z").manifest.storage == storage
  _check_tables(model, tmp_path / "z")
  # Without chunk checksums the bare item's own manifest checks its chunks.
  chunk = next(p for p in sorted((tmp_path / "z").rglob("*")) if "/c/" in str(p) and p.is_file())
  data = bytearray(chunk.read_bytes())
  data[len(data) // 2] ^= 0x10
  chunk.write_bytes(bytes(data))
  with pytest.raises(ck.CorruptCheckpointError, match=re.escape(f"{chunk}: checksum mismatch")):
    _check_tables(model, tmp_path / "z")


def test_failed_conversion_leaves_nothing_behind(tmp_path):
  _saved(tmp_path / "a")
  other = stack_tables([FeatureSpec("f", TableSpec("zzz", 64, 8), (8,))], [["zzz"]], 2)
  with pytest.raises(ck.MissingTableError, match="zzz"):
    ck.convert(tmp_path / "a", tmp_path / "b", other)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_a_temporary_directory_not_left_by_a_conversion_is_kept_and_refused(tmp_path):
  """`<dst>.orbax-checkpoint-tmp` may be another writer's unfinished step: never deleted."""
  model, layout = _saved(tmp_path / "a")
  foreign = tmp_path / ("b" + ocp.path.atomicity.TMP_DIR_SUFFIX)
  foreign.mkdir()
  (foreign / "data").write_text("someone else's")
  with pytest.raises(FileExistsError, match="lacks CONVERSION_IN_PROGRESS; it may be another"):
    ck.convert(tmp_path / "a", tmp_path / "b", layout)
  assert (foreign / "data").read_text() == "someone else's"
  assert not (tmp_path / "b").exists()


def _ended_process_id() -> int:
  """The id of no running process of this host.

  On Linux the kernel's `pid_max`, which no process is given (ids run below
  it). Elsewhere, that of a child that has ended: the kernel could give it
  to a new process within the test, which would then fail (rarely).
  """
  try:
    pid_max = int(open("/proc/sys/kernel/pid_max").read())
  except (OSError, ValueError):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid
  try:
    os.kill(pid_max, 0)
  except ProcessLookupError:
    return pid_max
  raise AssertionError(f"a process has the id pid_max ({pid_max}), which Linux never gives")


def test_a_conversion_still_running_to_the_same_destination_is_not_deleted(tmp_path):
  """A second conversion to the same destination refuses, naming the first's process."""
  model, layout = _saved(tmp_path / "a")
  target = ck.relayout(layout, num_devices=2, shards_per_device=1)
  seen = []

  def convert_again(done, total, what):
    if not seen:
      seen.append(True)
      with pytest.raises(FileExistsError, match=rf"by process {os.getpid()} on host"):
        ck.convert(tmp_path / "a", tmp_path / "b", target, overwrite=True)

  ck.convert(tmp_path / "a", tmp_path / "b", target, progress=convert_again)
  assert seen
  _check_tables(model, tmp_path / "b")


@pytest.mark.parametrize("whole_step", [False, True])
def test_the_leftover_of_an_interrupted_conversion_is_replaced(tmp_path, whole_step):
  """A killed conversion leaves its marked temporary directory; the next one starts afresh."""
  if whole_step:
    model = make_model([spec + (Adam(),) for spec in TABLES], seed=3)
    layout = model.layout([["a", "b"], ["c"], ["d"]], 8)
    tables, slots = model.state(layout)
    with ck.CheckpointManager(tmp_path / "run") as mngr:
      mngr.save(3, ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout)))
    src, dst, item = tmp_path / "run" / "3", tmp_path / "out" / "3", "embedding"
  else:
    model, layout = _saved(tmp_path / "a")
    src, dst, item = tmp_path / "a", tmp_path / "b", None
  leftover = dst.parent / (dst.name + ocp.path.atomicity.TMP_DIR_SUFFIX)
  leftover.mkdir(parents=True)
  (leftover / "CONVERSION_IN_PROGRESS").write_text(
      json.dumps({"host": socket.gethostname(), "pid": _ended_process_id()}))
  (leftover / "half_written_chunk").write_text("x")
  target = ck.relayout(layout, num_devices=2, shards_per_device=1)
  ck.convert(src, dst, target)
  assert not leftover.exists()
  names = {path.name for path in dst.rglob("*")}
  assert "CONVERSION_IN_PROGRESS" not in names and "half_written_chunk" not in names
  assert ck.verify(dst) == []
  _check_tables(model, dst if item is None else dst / item)


def test_a_target_layout_lacking_tables_of_the_checkpoint_is_refused(tmp_path):
  """A table the target has no place for would be dropped: the error names it."""
  _saved(tmp_path / "a")
  fewer = make_model([spec + (Adam(),) for spec in TABLES if spec[0] != "c"], seed=2)
  target = fewer.layout([["a", "b"], ["d"]], 4)
  with pytest.raises(ck.IncompatibleCheckpointError, match=r"no place for tables \['c'\]"):
    ck.convert(tmp_path / "a", tmp_path / "b", target)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_a_symbolic_link_in_the_step_directory_is_refused_not_followed(tmp_path):
  model = make_model([spec + (Adam(),) for spec in TABLES], seed=4)
  layout = model.layout([["a", "b"], ["c"], ["d"]], 8)
  tables, slots = model.state(layout)
  with ck.CheckpointManager(tmp_path / "run") as mngr:
    mngr.save(7, ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout)),
              items={"data": ocp.args.JsonSave({"position": 1})})
  secret = tmp_path / "outside.txt"
  secret.write_text("not part of the checkpoint")
  (tmp_path / "run" / "7" / "data" / "link.txt").symlink_to(secret)
  target = ck.relayout(layout, num_devices=2, shards_per_device=1)
  with pytest.raises(ck.CorruptCheckpointError, match=r"link\.txt: is a symbolic link"):
    ck.convert(tmp_path / "run" / "7", tmp_path / "moved" / "7", target)
  assert not (tmp_path / "moved" / "7").exists()


def test_a_destination_inside_a_step_or_the_source_or_holding_it_is_refused(tmp_path):
  """In place is fine for a whole step; an item of a step converted in place broke the
  step (its integrity manifest no longer matched), a destination inside the source copied
  itself without end, and one holding the source replaced the whole root."""
  model = make_model([spec + (Adam(),) for spec in TABLES], seed=5)
  layout = model.layout([["a", "b"], ["c"], ["d"]], 8)
  tables, slots = model.state(layout)
  root = tmp_path / "run"
  with ck.CheckpointManager(root) as mngr:
    for step in (6, 7):
      mngr.save(step, ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout)),
                items={"data": ocp.args.JsonSave({"position": step})})
  target = ck.relayout(layout, num_devices=2, shards_per_device=2)
  item = root / "7" / "embedding"
  with pytest.raises(ValueError, match=r"inside the checkpoint step .*7.*whole step"):
    ck.convert(item, item, target, overwrite=True)
  with pytest.raises(ValueError, match=r"inside the checkpoint step"):
    ck.convert(root / "6", root / "7" / "data" / "copy", target)
  with pytest.raises(ValueError, match=r"lies inside the source"):
    ck.convert(root / "7", root / "7" / "sub", target)
  with pytest.raises(ValueError, match=r"holds the source"):
    ck.convert(root / "7", root, target, overwrite=True)
  assert not [p for p in ck.verify(root) if p.severity == "error"]
  assert sorted(os.listdir(root / "7")) == sorted(os.listdir(root / "6"))
  # The whole step, in place: converted, and it still verifies and restores.
  ck.convert(root / "7", root / "7", target, overwrite=True)
  assert not [p for p in ck.verify(root) if p.severity == "error"]
  with ck.CheckpointManager(root, read_only=True) as mngr:
    restored = mngr.restore(7, ck.EmbeddingRestore(target, make_mesh(2), AXIS))["embedding"]
    assert mngr.all_steps() == [6, 7]
  model.check(target, restored.tables, restored.slots)


@pytest.mark.filterwarnings("ignore:.*(is skipped|interrupted compaction).*:RuntimeWarning")
def test_a_crash_while_a_step_is_converted_in_place_loses_no_step(tmp_path, monkeypatch):
  """The old step was deleted (rmtree) before the new one took its name: a crash in between
  left a half-deleted step and the complete copy under a temporary name, which the next
  manager removed as an unfinished save."""
  model = make_model([spec + (Adam(),) for spec in TABLES], seed=6)
  layout = model.layout([["a", "b"], ["c"], ["d"]], 8)
  tables, slots = model.state(layout)
  root = tmp_path / "run"
  with ck.CheckpointManager(root) as mngr:
    mngr.save(7, ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout)),
              items={"data": ocp.args.JsonSave({"position": 7})})
  target = ck.relayout(layout, num_devices=2, shards_per_device=2)
  step = epath.Path(root / "7")
  rmtree = type(step).rmtree

  def crashing_rmtree(path, *args, **kwargs):
    if path.name.startswith("7") and "orbax-checkpoint-tmp" not in path.name:
      (path / "embedding" / "manifest.json").unlink()  # Half deleted ...
      raise KeyboardInterrupt("the process dies")  # ... when the process dies.
    return rmtree(path, *args, **kwargs)

  monkeypatch.setattr(type(step), "rmtree", crashing_rmtree)
  with pytest.raises(KeyboardInterrupt):
    ck.convert(step, step, target, overwrite=True)
  monkeypatch.undo()
  with ck.CheckpointManager(root) as mngr:  # A writable manager resolves what is left.
    assert mngr.all_steps() == [7]
    restored = mngr.restore(7, ck.EmbeddingRestore(target, make_mesh(2), AXIS))["embedding"]
  model.check(target, restored.tables, restored.slots)
  assert sorted(os.listdir(root)) == ["7"]
  assert ck.CheckpointReader(step / "embedding").layout == target  # The converted one.


@pytest.mark.parametrize("host_memory, calls", [(None, 0), ("system", 0), ("return", 1)])
def test_convert_changes_the_allocator_only_when_asked(tmp_path, monkeypatch, host_memory, calls):
  from checkpoint import _convert

  made = []
  monkeypatch.setattr(_convert, "return_freed_memory", lambda: made.append(True) or True)
  model = make_model([("a", 64, 12, Adagrad())])
  layout = model.layout([["a"]], 2, 1)
  tables, slots = model.state(layout)
  item = tmp_path / "item"
  ck.EmbeddingCheckpointHandler().save(item, ck.EmbeddingSave(tables, slots, layout,
                                                              model.slot_specs(layout)))
  options = {} if host_memory is None else {"host_memory": host_memory}
  ck.convert(item, tmp_path / "out", "unstacked", **options)
  assert len(made) == calls


def test_a_corrupt_source_chunk_fails_the_conversion_and_leaves_nothing_behind(tmp_path):
  """The failure is raised while earlier blocks are being written (on threads), not lost."""
  _, layout = _saved(tmp_path / "a")
  chunks = sorted((tmp_path / "a").glob("stacks/*/table/c/*/0"))
  damaged = chunks[len(chunks) // 2]
  data = bytearray(damaged.read_bytes())
  data[0] ^= 0xFF
  damaged.write_bytes(bytes(data))
  target = ck.relayout(layout, num_devices=4, shards_per_device=2)
  with pytest.raises(ck.CorruptCheckpointError, match="fails its CRC32C"):
    ck.convert(tmp_path / "a", tmp_path / "b", target, block_bytes=256)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_overwrite_replaces_only_a_checkpoint_of_the_kind_written_or_an_empty_directory(tmp_path):
  """overwrite deleted whatever was at the destination: a folder of other files, another
  run's whole checkpoints root, a plain file."""
  model, layout = _saved(tmp_path / "a")
  with ck.CheckpointManager(tmp_path / "run") as mngr:
    tables, slots = model.state(layout)
    mngr.save(3, ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout)))
  folder = tmp_path / "notes"
  folder.mkdir()
  (folder / "notes.txt").write_text("precious")
  (tmp_path / "file").write_text("precious")
  refusals = [
      (tmp_path / "a", folder, r"notes is a directory holding notes.txt, not an embedding item"),
      (tmp_path / "a", tmp_path / "file", r"file is a file, not an embedding item"),
      (tmp_path / "a", tmp_path / "run" / "3",
       r"3 is a directory holding .*embedding.*, not an embedding item"),
      (tmp_path / "run" / "3", tmp_path / "run", r"holds the source"),
      (tmp_path / "run" / "3", folder, r"holding notes.txt, not a checkpoint step directory"),
  ]
  for src, dst, message in refusals:
    with pytest.raises((FileExistsError, ValueError), match=message):
      ck.convert(src, dst, "unstacked", overwrite=True)
  assert (folder / "notes.txt").read_text() == (tmp_path / "file").read_text() == "precious"
  assert ck.CheckpointManager(tmp_path / "run", read_only=True).all_steps() == [3]
  (tmp_path / "empty").mkdir()
  ck.convert(tmp_path / "a", tmp_path / "empty", "unstacked", overwrite=True)
  ck.convert(tmp_path / "a", tmp_path / "empty", layout, overwrite=True)  # its own kind
  _check_tables(model, tmp_path / "empty")


def test_file_urls_name_local_paths_and_unknown_schemes_are_named(tmp_path):
  """etils has no file:// handler: a file:// path failed with a bare KeyError('file://')."""
  model, layout = _saved(tmp_path / "a")
  ck.convert(f"file://{tmp_path / 'a'}", f"file://{tmp_path / 'b'}", "unstacked")
  _check_tables(model, tmp_path / "b")
  with ck.CheckpointManager(f"file://{tmp_path / 'run'}") as mngr:
    tables, slots = model.state(layout)
    mngr.save(1, ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout)))
  assert ck.inspect(f"file://{tmp_path / 'run'}")["latest_step"] == 1
  with pytest.raises(ValueError, match=r"convert source 'nfs://host/a': etils.epath has no"
                                       r" handler for nfs:// paths"):
    ck.convert("nfs://host/a", tmp_path / "c", "unstacked")
  with pytest.raises(ValueError, match=r"CheckpointManager directory 'file://relative/run': a"
                                       r" file:// URL must name an absolute local path"):
    ck.CheckpointManager("file://relative/run")
