"""The CheckpointManager: extra items, cadence, retention, async errors, crashes."""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import checkpoint as ck
from checkpoint._exit import THREADS_REFUSED_AT_EXIT
from ckpt_testlib import AXIS, make_mesh, make_model
from sc_framework.optimizers import RowWiseAdagrad
from tests.numerics import assert_same_bits

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _state():
  model = make_model([("a", 64, 12, RowWiseAdagrad()), ("b", 120, 10, RowWiseAdagrad())])
  layout = model.layout([["a", "b"]], 4, 2)
  tables, slots = model.state(layout)
  return model, layout, ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout))


@pytest.mark.filterwarnings("ignore:Sharding info not provided")
def test_embedding_item_travels_with_ordinary_orbax_items(tmp_path):
  model, layout, embedding = _state()
  params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float32)}
  opt_state = {"mu": {"w": np.full((2, 3), 0.5, np.float32)}, "count": np.array(7, np.int32)}
  key = jax.random.key(3)
  with ck.CheckpointManager(tmp_path) as mngr:
    assert mngr.save(
        10,
        embedding,
        items={
            "params": ocp.args.StandardSave(params),
            "opt_state": ocp.args.StandardSave(opt_state),
            "rng": ocp.args.JaxRandomKeySave(key),
            "data": ocp.args.JsonSave({"position": 1234, "epoch": 2}),
        },
    )
    mngr.wait_until_finished()
    assert mngr.latest_step() == 10
    assert mngr.item_names(10) == ["data", "embedding", "opt_state", "params", "rng"]
  with ck.CheckpointManager(tmp_path) as mngr:
    restored = mngr.restore(
        embedding=ck.EmbeddingRestore(layout, make_mesh(4), AXIS),
        items={
            "params": ocp.args.StandardRestore(params),
            "opt_state": ocp.args.StandardRestore(opt_state),
            "rng": ocp.args.JaxRandomKeyRestore(),
            "data": ocp.args.JsonRestore(),
        },
    )
  model.check(layout, restored["embedding"].tables, restored["embedding"].slots)
  assert_same_bits(restored["params"]["w"], params["w"])
  assert int(restored["opt_state"]["count"]) == 7
  assert_same_bits(jax.random.key_data(restored["rng"]), jax.random.key_data(key))
  assert restored["data"] == {"position": 1234, "epoch": 2}
  # A step's embedding can also be read per table, and inspected.
  with ck.CheckpointManager(tmp_path) as mngr:
    arrays = mngr.restore(10, ck.TableRestore(tables=["b"]))["embedding"]
  assert_same_bits(arrays.tables["b"], model.logical["b"])
  info = ck.inspect(tmp_path)
  assert info["latest_step"] == 10 and info["latest"]["embedding_item"] == "embedding"


def test_one_manager_saves_and_restores_the_embedding_every_way_in_any_order(tmp_path):
  model, layout, embedding = _state()
  other = model.layout([["a"], ["b"]], 2, 1)
  with ck.CheckpointManager(tmp_path, embedding_item="tables") as mngr:
    mngr.save(1, embedding, force=True)
    mngr.wait_until_finished()
    for _ in range(2):
      for target in (layout, other):
        restored = mngr.restore(1, ck.EmbeddingRestore(target, make_mesh(target.num_devices),
                                                       AXIS))["tables"]
        model.check(target, restored.tables, restored.slots)
      rows = mngr.restore(1, ck.TableRestore(tables=["a"], rows={"a": (5, 40)}))["tables"]
      assert_same_bits(rows.tables["a"], model.logical["a"][5:40])
    mngr.save(2, embedding, force=True)  # Saving still works after both restores.
    mngr.wait_until_finished()
    assert mngr.all_steps() == [1, 2]


@pytest.mark.parametrize("name, error, culprit", [
    ("../escape", ValueError, "embedding_item '../escape' is not a plain directory name"),
    ("a/b", ValueError, "embedding_item 'a/b' is not a plain directory name"),
    ("", ValueError, "embedding_item '' is not a plain directory name"),
    ("..", ValueError, "embedding_item '..' is not a plain directory name"),
    (".tables", ValueError, "embedding_item '.tables' is not a plain directory name"),
    ("metrics", ValueError, "embedding_item 'metrics' is reserved by Orbax"),
    ("tables[1]", ValueError, "contain '\\*', '\\?' or '\\[...\\]'"),
    (7, TypeError, "embedding_item must be a str, got 7"),
])
def test_an_item_name_that_is_no_directory_name_is_refused(tmp_path, name, error, culprit):
  """embedding_item='../escape' wrote the tables beside the step, outside its atomic commit,
  and a complete-looking step without them; '' failed inside Orbax's background save."""
  with pytest.raises(error, match=culprit):
    ck.CheckpointManager(tmp_path / "ckpt", embedding_item=name)
  assert not (tmp_path / "ckpt").exists() and not (tmp_path / "escape").exists()
  if isinstance(name, str) and name != "tables[1]":
    with ck.CheckpointManager(tmp_path / "ckpt", async_save=False) as mngr:
      with pytest.raises(error, match=culprit.replace("embedding_item", "item name")):
        mngr.save(1, items={name: ocp.args.JsonSave({"a": 1})})
      assert mngr.all_steps() == []


def test_arguments_of_another_type_are_named(tmp_path):
  """Each gave a bare Python error naming no argument ("expected str, bytes or os.PathLike
  object, not NoneType"; "'int' object is not iterable"; "unsupported operand ... 'str'")."""
  for directory in (None, 5, b"checkpoints"):
    with pytest.raises(TypeError, match="CheckpointManager directory must be a path"):
      ck.CheckpointManager(directory)
  with pytest.raises(TypeError, match="async_save must be True or False, got 'no'"):
    ck.CheckpointManager(tmp_path, async_save="no")
  with pytest.raises(TypeError, match="EmbeddingRestore: layout must be an EmbeddingLayout"):
    ck.EmbeddingRestore("layout", make_mesh(1), AXIS)
  _, _, embedding = _state()
  with ck.CheckpointManager(tmp_path, async_save=False) as mngr:
    with pytest.raises(TypeError, match="items must map item names to Orbax args"):
      mngr.save(1, items=[1, 2])
    mngr.save(1, embedding)
    with pytest.raises(TypeError, match="tables must be table names .*, got 5"):
      mngr.restore(1, ck.TableRestore(tables=5))
    some = mngr.restore(1, ck.TableRestore(tables={"a": 0}.keys()))["embedding"]  # any iterable
    assert list(some.tables) == ["a"]
  with ck.CheckpointManager(tmp_path / "numpy-flag", async_save=np.True_) as mngr:
    assert mngr.directory.is_dir()


def test_interval_on_demand_and_retention_keeps_the_newest(tmp_path):
  _, _, embedding = _state()
  meta = lambda step: {"data": ocp.args.JsonSave({"step": step})}  # noqa: E731
  with ck.CheckpointManager(
      tmp_path, keep_latest=1, keep_best=1, best_metric="loss", save_interval_steps=5
  ) as mngr:
    saved = [
        step
        for step in range(1, 16)
        if mngr.save(step, embedding, items=meta(step), metrics={"loss": float(step)})
    ]
    assert saved == [5, 10, 15]
    assert mngr.save(17, embedding, items=meta(17), metrics={"loss": 100.0}, force=True)
    mngr.wait_until_finished()
    # Best (lowest loss) step 5 and the newest step 17 stay; Orbax's best_fn with
    # max_to_keep=1 alone would have deleted step 17.
    assert mngr.all_steps() == [5, 17]
    assert mngr.best_step() == 5 and mngr.latest_step() == 17


def test_max_mode_and_function_metric(tmp_path):
  _, _, embedding = _state()
  with ck.CheckpointManager(
      tmp_path,
      keep_latest=2,
      keep_best=1,
      best_metric=lambda m: m["acc"],
      best_mode="max",
      async_save=False,
  ) as mngr:
    for step, acc in enumerate([0.5, 0.9, 0.1, 0.2, 0.3]):
      mngr.save(step, embedding, metrics={"acc": acc})
    assert mngr.all_steps() == [1, 3, 4]
    assert mngr.best_step() == 1


@pytest.mark.parametrize("mode, values", [
    ("min", [0.5, float("nan"), 0.7, 0.9, float("nan")]),
    ("max", [0.9, float("nan"), 0.2, 0.1, float("nan")]),
])
def test_a_nan_metric_ranks_worst_and_never_pushes_out_the_best_step(tmp_path, mode, values):
  """A diverged step's NaN loss compares false with everything: sorted as it
  is, it deleted the best step 0 and best_step named a worse one."""
  _, _, embedding = _state()
  with ck.CheckpointManager(tmp_path, keep_latest=1, keep_best=1, best_metric="loss",
                            best_mode=mode, async_save=False) as mngr:
    for step, value in enumerate(values):
      mngr.save(step, embedding, metrics={"loss": value})
    assert mngr.all_steps() == [0, 4]
    assert mngr.best_step() == 0


def test_a_step_another_manager_saved_is_never_moved_aside_as_incomplete(tmp_path):
  """A manager lists the steps when it opens: a complete step saved since by
  another writer was taken for an unfinished save and renamed."""
  _, _, embedding = _state()
  with ck.CheckpointManager(tmp_path, async_save=False) as first, \
      ck.CheckpointManager(tmp_path, async_save=False) as second:
    first.save(1, embedding)
    second.save(2, embedding)
    manifest = (tmp_path / "2" / "integrity.json").read_text()
    with pytest.raises(FileExistsError, match=r"checkpoint step 2 already exists in .*another"
                       r" writer saved it .*\(now \[1, 2\]\)"):
      first.save(2, embedding)
    assert sorted(os.listdir(tmp_path)) == ["1", "2"]
    assert (tmp_path / "2" / "integrity.json").read_text() == manifest
    assert first.all_steps() == [1, 2]
    first.save(3, embedding)
  assert sorted(os.listdir(tmp_path)) == ["1", "2", "3"]


def test_invalid_manager_arguments(tmp_path):
  with pytest.raises(ValueError, match="keep_latest must be an int >= 1"):
    ck.CheckpointManager(tmp_path, keep_latest=0)
  with pytest.raises(ValueError, match="needs best_metric"):
    ck.CheckpointManager(tmp_path, keep_best=2)
  with ck.CheckpointManager(tmp_path) as mngr:
    with pytest.raises(ck.NotACheckpointError, match="no complete checkpoint"):
      mngr.restore(embedding=ck.TableRestore())
    with pytest.raises(TypeError, match="embedding must be EmbeddingSave"):
      mngr.save(1, ck.TableRestore())
    with pytest.raises(TypeError, match="item 'params' must be Orbax args"):
      mngr.save(1, items={"params": {"w": np.zeros(3)}})
  # Numpy integers are taken as the specs take them (they were refused).
  with ck.CheckpointManager(tmp_path.parent / f"{tmp_path.name}-numpy", keep_latest=np.int64(2),
                            save_interval_steps=np.int32(1)) as mngr:
    assert mngr.directory.is_dir()


def test_background_write_error_surfaces_on_wait(tmp_path, monkeypatch):
  _, _, embedding = _state()
  from checkpoint import _save  # pylint: disable=g-import-not-at-top

  async def failing_write(*args, **kwargs):
    del args, kwargs
    raise OSError("disk full (simulated)")

  with ck.CheckpointManager(tmp_path) as mngr:
    monkeypatch.setattr(_save, "write", failing_write)
    assert mngr.save(1, embedding)
    with pytest.raises(Exception, match="disk full"):
      mngr.wait_until_finished()
    assert mngr.latest_step() is None


_CRASHING_WRITER = textwrap.dedent("""
    import asyncio, sys
    import numpy as np, jax, orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    import checkpoint as ck
    from checkpoint import _save
    from sc_framework import FeatureSpec, TableSpec, stack_tables
    from sc_framework.optimizers import Adam
    from sc_framework.stacking import stack

    table = TableSpec("t", 4096, 16, optimizer=Adam())
    layout = stack_tables([FeatureSpec("f", table, (8,))], [["t"]], 1)
    mesh = Mesh(np.array(jax.devices()[:1]), ("table",))
    sharding = NamedSharding(mesh, PartitionSpec("table", None))
    def state(seed):
      rng = np.random.default_rng(seed)
      put = lambda x: jax.device_put(stack({"t": x}, layout)["t"], sharding)
      values = lambda: rng.random((4096, 16), dtype=np.float32) + 0.5
      tables = {"t": put(values())}  # Drawn first: the test checks these values.
      slots = {"t": {"mu": put(values()), "nu": put(values())}}
      return ck.EmbeddingSave(tables, slots, layout, {"t": Adam().slots()})
    mngr = ck.CheckpointManager(sys.argv[1])
    mngr.save(1, state(1), items={"data": ocp.args.JsonSave({"position": 1})})
    mngr.wait_until_finished()

    async def hanging_write(directory, manifest, layout, blocks, *, primary):
      stores = await _save.create_arrays(directory, manifest)
      block = blocks[0]
      await stores[(block.group, block.slot)][block.rows, block.columns].write(block.data)
      print("WRITING", flush=True)  # Some chunks are on disk; the rest never will be.
      while True:
        await asyncio.sleep(1)

    _save.write = hanging_write
    mngr.save(2, state(2), items={"data": ocp.args.JsonSave({"position": 2})})
    print("SAVE RETURNED", flush=True)
    while True:
      pass
    """)


def test_killed_writer_leaves_the_previous_step_latest_and_restorable(tmp_path):
  env = dict(
      os.environ,
      PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
      JAX_PLATFORMS="cpu",
  )
  env.pop("XLA_FLAGS", None)
  process = subprocess.Popen(
      [sys.executable, "-c", _CRASHING_WRITER, str(tmp_path)],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
      env=env,
  )
  try:
    lines = []
    deadline = time.time() + 120
    while time.time() < deadline:
      line = process.stdout.readline()
      if not line:
        break
      lines.append(line.strip())
      if "WRITING" in lines and "SAVE RETURNED" in lines:
        break
    assert "WRITING" in lines, process.stderr.read() if process.poll() is not None else lines
  finally:
    process.send_signal(signal.SIGKILL)
    process.wait()
  unfinished = [p.name for p in tmp_path.iterdir() if ocp.path.atomicity.TMP_DIR_SUFFIX in p.name]
  assert unfinished and unfinished[0].startswith("2.")
  info = ck.inspect(tmp_path)
  assert info["steps"] == [1] and info["latest_step"] == 1 and info["unfinished"] == unfinished
  with pytest.raises(ck.NotACheckpointError, match="unfinished"):
    ck.CheckpointReader(
        tmp_path / unfinished[0] / ("embedding" + ocp.path.atomicity.TMP_DIR_SUFFIX)
    )
  with ck.CheckpointManager(tmp_path) as mngr:
    assert mngr.latest_step() == 1
    assert not [p for p in tmp_path.iterdir() if ocp.path.atomicity.TMP_DIR_SUFFIX in p.name]
    restored = mngr.restore(embedding=ck.TableRestore(), items={"data": ocp.args.JsonRestore()})
  assert restored["data"] == {"position": 1}
  expected = np.random.default_rng(1).random((4096, 16), dtype=np.float32) + 0.5
  assert_same_bits(restored["embedding"].tables["t"], expected)
  assert set(restored["embedding"].slots["t"]) == {"mu", "nu"}


def test_a_read_only_manager_restores_and_deletes_nothing(tmp_path):
  model, layout, embedding = _state()
  with ck.CheckpointManager(tmp_path) as mngr:
    mngr.save(3, embedding)
  # What a running job's save in progress looks like on disk.
  in_progress = tmp_path / f"4{ocp.path.atomicity.TMP_DIR_SUFFIX}1234"
  in_progress.mkdir()
  (in_progress / "partial").write_text("being written")
  with ck.CheckpointManager(tmp_path, read_only=True) as reader:
    assert reader.latest_step() == 3
    restored = reader.restore(embedding=ck.EmbeddingRestore(layout, make_mesh(4), AXIS))
    model.check(layout, restored["embedding"].tables, restored["embedding"].slots)
    with pytest.raises(ValueError, match="read_only=True and cannot save"):
      reader.save(5, embedding, force=True)
  assert (in_progress / "partial").read_text() == "being written"
  assert sorted(p.name for p in tmp_path.iterdir()) == ["3", in_progress.name]
  # A writing manager cleans the unfinished save up.
  ck.CheckpointManager(tmp_path).close()
  assert not in_progress.exists()


def test_a_read_only_manager_sees_the_steps_a_writing_job_keeps(tmp_path):
  """An evaluator's manager opened beside a training job: the job's retention deletes the
  steps the evaluator listed, and saves newer ones."""
  model, layout, embedding = _state()
  restore = ck.EmbeddingRestore(layout, make_mesh(4), AXIS)
  with ck.CheckpointManager(tmp_path, keep_latest=2) as writer:
    writer.save(1, embedding)
    writer.save(2, embedding)
    writer.wait_until_finished()
    with ck.CheckpointManager(tmp_path, read_only=True) as reader:
      assert reader.all_steps() == [1, 2]
      writer.save(3, embedding)
      writer.wait_until_finished()
      assert not (tmp_path / "1").exists()  # the job's retention
      with pytest.raises(ck.NotACheckpointError, match=re.escape(
          "has no complete checkpoint for step 1; its steps are [2, 3]")):
        reader.restore(1, restore)
      with warnings.catch_warnings():
        warnings.simplefilter("error")
        restored = reader.restore(None, restore)
      assert reader.latest_step() == 3
  model.check(layout, restored["embedding"].tables, restored["embedding"].slots)


@pytest.mark.parametrize("step", [None, 3])
def test_a_step_deleted_while_it_is_restored_is_named_not_reported_as_damage(
    tmp_path, monkeypatch, step):
  """The job's retention deletes the step between the reader's listing and its read."""
  model, layout, embedding = _state()
  with ck.CheckpointManager(tmp_path, keep_latest=3) as writer:
    for saved in (1, 2, 3):
      writer.save(saved, embedding)
  reader = ck.CheckpointManager(tmp_path, read_only=True)
  read = reader.orbax_manager.restore
  deleted = []

  def restore_racing_retention(at, *args, **kwargs):
    if not deleted:  # the first read only
      deleted.append(at)
      shutil.rmtree(tmp_path / str(at))
    return read(at, *args, **kwargs)

  monkeypatch.setattr(reader.orbax_manager, "restore", restore_racing_retention)
  restore = ck.EmbeddingRestore(layout, make_mesh(4), AXIS)
  with reader, warnings.catch_warnings():
    warnings.simplefilter("error")  # no "skipped, damaged" warning
    if step is None:  # the newest step left is restored
      restored = reader.restore(None, restore)
      model.check(layout, restored["embedding"].tables, restored["embedding"].slots)
      assert deleted == [3] and reader.all_steps() == [1, 2]
    else:
      with pytest.raises(ck.NotACheckpointError, match=re.escape(
          f"checkpoint step 3 ({tmp_path / '3'}) was deleted while it was being restored: the"
          f" job writing {tmp_path} removed it (its retention, keep_latest and keep_best)."
          " Restore a step it keeps: its steps are now [1, 2]")):
        reader.restore(step, restore)


def test_a_path_with_a_backslash_is_refused_before_anything_is_written(tmp_path, monkeypatch):
  """TensorStore reads '\\' as a separator: the arrays would land in tmp_path/a/b, outside
  the checkpoint, and the step would commit without them."""
  model, layout, embedding = _state()
  odd = tmp_path / "a\\b"
  with pytest.raises(ValueError, match=r"backslash.*outside"):
    ck.CheckpointManager(odd / "ckpt")
  monkeypatch.chdir(tmp_path)
  (tmp_path / "c\\d").mkdir()
  monkeypatch.chdir(tmp_path / "c\\d")  # A relative root under such a directory, too.
  with pytest.raises(ValueError, match="backslash"):
    ck.CheckpointManager("ckpt")
  with ocp.Checkpointer(ck.EmbeddingCheckpointHandler()) as ckptr, pytest.raises(
      ValueError, match="backslash"
  ):
    ckptr.save(odd / "item", args=embedding)
  with ck.CheckpointManager(tmp_path / "ok") as mngr:
    mngr.save(1, embedding)
  with pytest.raises(ValueError, match="backslash"):
    ck.convert(tmp_path / "ok" / "1", odd / "converted", "unstacked")
  assert sorted(os.listdir(tmp_path)) == ["a\\b", "c\\d", "ok"]
  assert not os.listdir(tmp_path / "c\\d") and not os.path.exists(tmp_path / "a" / "b")


@pytest.mark.filterwarnings("ignore:Sharding info not provided")
def test_an_item_a_step_never_saved_is_named_not_reported_as_damage(tmp_path):
  """Latest step 2 saved no 'extra': an error naming the steps that hold it, no fallback."""
  model, layout, embedding = _state()
  params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
  with ck.CheckpointManager(tmp_path) as mngr:
    mngr.save(1, embedding, items={"params": ocp.args.StandardSave(params),
                                   "extra": ocp.args.JsonSave({"epoch": 1})})
    mngr.save(2, items={"params": ocp.args.StandardSave(params)})
  wanted = {"params": ocp.args.StandardRestore(params), "extra": ocp.args.JsonRestore()}
  with ck.CheckpointManager(tmp_path, read_only=True) as mngr:
    for step in (None, 2):
      with warnings.catch_warnings():
        warnings.simplefilter("error")  # No "skipped, damaged" warning either.
        with pytest.raises(ck.MissingItemError, match=r"step 2 .* holds no item 'extra'.*\[1\]"):
          mngr.restore(step, items=wanted)
    with pytest.raises(ck.MissingItemError, match=r"step 2 .* holds no item 'embedding'.*\[1\]"):
      mngr.restore(None, ck.TableRestore())
    assert mngr.restore(1, items=wanted)["extra"] == {"epoch": 1}
    with pytest.raises(ck.MissingItemError,
                       match=r"holds no item 'other'.*Restore without 'other'; no step of .* holds"):
      mngr.restore(2, items={"other": ocp.args.JsonRestore()})
    assert_same_bits(mngr.restore(items={"params": wanted["params"]})["params"]["w"], params["w"])


def test_restore_waits_for_this_managers_saves_in_progress(tmp_path):
  """restore(None) right after async saves returns the step saved last, with no warning."""
  model, layout, embedding = _state()
  with ck.CheckpointManager(tmp_path) as mngr:
    for step in range(3):
      mngr.save(step, embedding)
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      restored = mngr.restore(None, ck.TableRestore())
    assert mngr.latest_step() == 2
  for name, logical in model.logical.items():
    assert_same_bits(restored["embedding"].tables[name], logical)


def test_saves_and_restores_never_ask_tensorstore_for_its_leaking_metrics(tmp_path, monkeypatch):
  """TensorStore never frees what experimental_collect_matching_metrics returns, and
  Orbax asked for it around every array write and read: about 100 KB lost per save."""
  import tensorstore as ts  # pylint: disable=g-import-not-at-top

  calls = []
  query = ts.experimental_collect_matching_metrics
  monkeypatch.setattr(ts, "experimental_collect_matching_metrics",
                      lambda *args: calls.append(args) or query(*args))
  params = {"w": jax.numpy.arange(12.0).reshape(3, 4), "b": jax.numpy.ones(4)}
  with ck.CheckpointManager(tmp_path / "run") as mngr:
    for step in (1, 2):
      mngr.save(step, items={"params": ocp.args.StandardSave(params)}, force=True)
    mngr.wait_until_finished()
    restored = mngr.restore(2, items={"params": ocp.args.StandardRestore(params)})["params"]
  jax.tree.map(assert_same_bits, jax.device_get(restored), jax.device_get(params))
  assert calls == []


_EXITS_WITHOUT_CLOSE = textwrap.dedent("""
    import sys
    import orbax.checkpoint as ocp
    import checkpoint as ck
    from ckpt_testlib import make_model
    from sc_framework.optimizers import SGD

    model = make_model([("a", 4000, 16, SGD(0.1))], seed=3)
    layout = model.layout([["a"]], 1)
    tables, slots = model.state(layout)

    def train():
      mngr = ck.CheckpointManager(sys.argv[1])
      for step in range(3):
        mngr.save(step, ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout)),
                  items={"data": ocp.args.JsonSave({"step": step})})
      return mngr

    kept = train()
    if sys.argv[2] == "dropped":  # Collected, its last save still being written.
      del kept
    print("SAVES STARTED", flush=True)
    """)


@pytest.mark.parametrize("manager", ["left open", "dropped"])
def test_a_program_that_exits_without_closing_its_manager_keeps_its_last_save(tmp_path,
                                                                              manager):
  """The last background save failed at exit ("cannot schedule new futures after
  interpreter shutdown") and left a temporary directory: a script that never closed
  its manager lost its last checkpoint."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [REPO, os.path.join(REPO, "tests", "checkpoint"), os.environ.get("PYTHONPATH", "")]),
      JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  done = subprocess.run(
      [sys.executable, "-c", _EXITS_WITHOUT_CLOSE, str(tmp_path / "run"), manager.split()[0]],
      capture_output=True, text=True, env=env, timeout=300)
  assert done.returncode == 0 and "SAVES STARTED" in done.stdout, done.stderr
  if THREADS_REFUSED_AT_EXIT:  # This Python cannot finish the save: the user is told why.
    assert "cannot start the thread Orbax needs to commit it (CPython issue 113964" in (
        done.stderr), done.stderr
    pytest.skip("Python 3.12.0-3.12.2 start no thread at exit (CPython issue 113964)")
  assert "cannot schedule" not in done.stderr and "Traceback" not in done.stderr, done.stderr
  assert sorted(os.listdir(tmp_path / "run")) == ["0", "1", "2"]
  with ck.CheckpointManager(tmp_path / "run", read_only=True) as mngr:
    assert mngr.restore(2, items={"data": ocp.args.JsonRestore()})["data"] == {"step": 2}
  assert ck.verify(tmp_path / "run") == []


def test_a_manager_opened_where_another_of_this_process_is_saving_waits_for_that_save(
    tmp_path, monkeypatch):
  """It removed the other manager's save in progress as an unfinished one (a Trainer
  whose fit raised with a save in flight, and a new Trainer on the same workdir)."""
  from checkpoint import _integrity
  write_manifest = _integrity.write_manifest

  def slow_write_manifest(*args, **kwargs):
    time.sleep(1.0)  # The step's files are written; its commit is still to come.
    write_manifest(*args, **kwargs)

  monkeypatch.setattr(_integrity, "write_manifest", slow_write_manifest)
  first = ck.CheckpointManager(tmp_path / "run")
  first.save(4, items={"data": ocp.args.JsonSave({"step": 4})})
  assert any(".orbax-checkpoint-tmp" in name for name in os.listdir(tmp_path / "run"))
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # Nothing unfinished, nothing foreign.
    second = ck.CheckpointManager(tmp_path / "run")
  assert second.all_steps() == [4]
  assert second.restore(4, items={"data": ocp.args.JsonRestore()})["data"] == {"step": 4}
  first.wait_until_finished()
  first.close(), second.close()
  assert ck.verify(tmp_path / "run") == []


def test_a_step_number_that_is_no_int_is_refused_by_value(tmp_path):
  """A float step was saved as directory '7.0', which no listing reads (lost); -1 and
  True were silently not saved; '5' and 5.0 in restore blamed the step's absence."""
  data = {"x": ocp.args.JsonSave({"a": 1})}
  with ck.CheckpointManager(tmp_path, async_save=False) as mngr:
    assert mngr.save(np.int64(3), items=data, force=True)
    assert mngr.save(jax.numpy.int32(4), items=data, force=True)  # a jax step counter
    for step, error in [(7.0, TypeError), (True, TypeError), ("6", TypeError),
                        (np.float32(8), TypeError), (-1, ValueError)]:
      with pytest.raises(error, match=re.escape("a checkpoint step must be an int >= 0, got")):
        mngr.save(step, items=data, force=True)
    for step in ("4", 4.0):
      with pytest.raises(TypeError, match=re.escape(f"got {step!r}")):
        mngr.restore(step, items={"x": ocp.args.JsonRestore()})
    with pytest.raises(TypeError, match="got 3.0"):
      mngr.should_save(3.0)
    assert mngr.all_steps() == [3, 4]
    assert mngr.restore(np.int64(4), items={"x": ocp.args.JsonRestore()})["x"] == {"a": 1}
  assert sorted(os.listdir(tmp_path)) == ["3", "4"]


@pytest.mark.parametrize("read_only", [False, True])
def test_a_manager_of_a_step_or_an_item_is_refused_naming_the_root(tmp_path, read_only):
  """A manager opened on a step (as `inspect` prints them) wrote its steps inside it."""
  model, layout, embedding = _state()
  root = tmp_path / "root"
  with ck.CheckpointManager(root) as mngr:
    mngr.save(5, embedding, items={"params": ocp.args.StandardSave({"w": np.ones(3, np.float32)})})
  before = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
  for inside, kind in [(root / "5", "is a checkpoint step"),
                       (root / "5" / "embedding", "is an embedding item"),
                       (root / "5" / "embedding" / "new", "lies inside the embedding item"),
                       (root / "5" / "params", "lies inside the checkpoint step")]:
    with pytest.raises(ValueError, match=re.escape(f"{inside} {kind}") + ".*" + re.escape(
        f"(here {root}), not a step or an item inside one")):
      ck.CheckpointManager(inside, read_only=read_only)
  assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == before
  # Folders that merely hold files of those names are no checkpoint.
  project = tmp_path / "web project"
  (project / "7").mkdir(parents=True)
  (project / "manifest.json").write_text('{"name": "my extension"}')
  (project / "7" / "integrity.json").write_text("{}")
  (project / "integrity.json").write_text("{}")
  for directory in (project / "ckpt", project / "7" / "ckpt"):
    with ck.CheckpointManager(directory, read_only=read_only) as mngr:
      assert mngr.all_steps() == []


def test_a_home_relative_directory_is_expanded_not_made_here(tmp_path, monkeypatch):
  """'~/ckpt' made a directory named '~' in the working directory."""
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  monkeypatch.chdir(tmp_path)
  with ck.CheckpointManager("~/ckpt", async_save=False) as mngr:
    assert mngr.directory == tmp_path / "home" / "ckpt"
    mngr.save(1, items={"x": ocp.args.JsonSave({"a": 1})})
  assert not (tmp_path / "~").exists() and (tmp_path / "home" / "ckpt" / "1").is_dir()



def test_a_directory_this_process_cannot_write_is_named_at_the_save(tmp_path, monkeypatch):
  """A save on a read-only file system raised a raw "OSError: [Errno 30] Read-only file
  system: '.../1.orbax-checkpoint-tmp'". Opening such a manager still works: a Trainer that
  only evaluates a read-only workdir never saves."""
  locked = tmp_path / "locked"
  locked.mkdir()
  if os.geteuid() != 0:  # root writes whatever the mode says: then the file system refuses
    locked.chmod(0o555)
  else:
    real_mkdir = os.mkdir
    def refusing_mkdir(path, *args, **kwargs):
      if os.fspath(path).startswith(os.fspath(locked)):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))
      return real_mkdir(path, *args, **kwargs)
    monkeypatch.setattr(os, "mkdir", refusing_mkdir)
  message = re.escape(f"cannot save checkpoints under {locked}: the storage refused to write")
  try:
    with ck.CheckpointManager(locked, async_save=False) as mngr:  # opens: nothing written
      with pytest.raises(PermissionError, match=message + r".*read_only=True"):
        mngr.save(1, items={"x": ocp.args.JsonSave({"a": 1})})
    with pytest.raises(PermissionError, match=re.escape(
        f"cannot save checkpoints under {locked / 'run'}: the storage refused")):
      ck.CheckpointManager(locked / "run")  # a directory to make there
    assert list(locked.iterdir()) == []
  finally:
    locked.chmod(0o755)


def test_a_manager_of_a_file_or_a_missing_directory_says_so(tmp_path):
  """A read-only manager of a missing directory or a file listed no steps, then a restore
  said only that it held no complete checkpoint."""
  afile = tmp_path / "notes.txt"
  afile.write_text("x")
  for read_only in (False, True):
    with pytest.raises(NotADirectoryError, match=re.escape(f"{afile} is a file")):
      ck.CheckpointManager(afile, read_only=read_only)
  with ck.CheckpointManager(tmp_path / "later", read_only=True) as mngr:  # a job may make it
    assert mngr.all_steps() == []
    with pytest.raises(ck.NotACheckpointError, match="no complete checkpoint to restore"
                       r" \(it does not exist yet\)"):
      mngr.restore(None, ck.TableRestore())
  assert afile.read_text() == "x" and not (tmp_path / "later").exists()
