"""The sc-checkpoint CLI, through main([...])."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

import checkpoint as ck
from checkpoint import cli
from checkpoint.cli import main
from ckpt_testlib import make_model
from sc_framework.optimizers import Adam
from tests.numerics import assert_same_bits

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TABLES = [("a", 64, 12), ("b", 120, 10), ("c", 40, 16), ("d", 200, 8)]


@pytest.fixture
def saved(tmp_path):
  model = make_model([spec + (Adam(),) for spec in TABLES], seed=4)
  layout = model.layout([["a", "b"], ["c"], ["d"]], 8)
  tables, slots = model.state(layout)
  with ck.CheckpointManager(tmp_path / "run") as mngr:
    mngr.save(
        3,
        ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout)),
        items={"data": ocp.args.JsonSave({"position": 5})},
    )
  return model, layout, tmp_path / "run"


def _check(model, path):
  arrays = ck.EmbeddingCheckpointHandler().restore(path, ck.TableRestore())
  for name, logical in model.logical.items():
    assert_same_bits(arrays.tables[name], logical)
    for slot, values in model.slots[name].items():
      assert_same_bits(arrays.slots[name][slot], values)


def test_help(capsys):
  assert main(["--help"]) == 0
  out = capsys.readouterr().out
  assert "Inspect, verify, convert and compact" in out
  assert all(command in out for command in ("inspect", "verify", "convert", "compact"))
  assert main(["convert", "--help"]) == 0
  out = capsys.readouterr().out
  assert "--num-devices" in out and "--groups" in out and "--unstacked" in out


def test_inspect_item_step_and_root(saved, capsys):
  _, _, root = saved
  assert main(["inspect", str(root / "3" / "embedding")]) == 0
  out = capsys.readouterr().out
  assert "G=8 devices x S=1" in out and "stack 'a__b'" in out and "table 'b': V=120 D=10" in out
  assert "slot mu" in out and "float32" in out and "[192, 16]" in out
  assert main(["inspect", str(root / "3")]) == 0
  out = capsys.readouterr().out
  assert "step 3" in out and "Orbax items: data, embedding" in out
  assert main(["inspect", str(root), "--json"]) == 0
  info = json.loads(capsys.readouterr().out)
  assert info["latest_step"] == 3 and info["latest"]["embedding"]["layout"]["num_devices"] == 8


def test_inspect_refuses_a_step_whose_embedding_manifest_was_edited(saved, capsys):
  """A valid JSON edit (a table's dtype) showed as saved, with exit 0; `verify` and
  restore refused the step. The root lists the step as incomplete."""
  _, _, root = saved
  path = root / "3" / "embedding" / "manifest.json"
  path.write_text(path.read_text().replace('"float32"', '"bfloat16"', 1))
  for target in (root / "3", root / "3" / "embedding"):
    assert main(["inspect", str(target)]) == 1
    captured = capsys.readouterr()
    assert not captured.out and f"{path}: has " in captured.err, captured.err
  assert main(["inspect", str(root)]) == 1  # no complete step left
  assert f"{path}: has " in capsys.readouterr().err


def test_inspect_lists_a_step_that_lost_orbaxs_metadata_as_the_manager_does(saved, capsys):
  """Orbax rewrites `_CHECKPOINT_METADATA` at its commit, and the integrity manifest does
  not list it: the manager restores such a step. `inspect` called its root "not a
  checkpoint" without naming the step."""
  _, _, root = saved
  (root / "3" / "_CHECKPOINT_METADATA").unlink()
  with ck.CheckpointManager(root, read_only=True) as manager:
    assert manager.all_steps() == [3]
  for target in (root, root / "3"):
    assert main(["inspect", str(target)]) == 0
    assert "step 3 at" in capsys.readouterr().out


def test_convert_with_flags_and_back(saved, tmp_path, capsys):
  model, layout, root = saved
  out = tmp_path / "two"
  assert (
      main(
          [
              "convert",
              str(root / "3"),
              str(out),
              "--num-devices",
              "2",
              "--shards-per-device",
              "4",
              "--groups",
              "a;b,c;d",
          ]
      )
      == 0
  )
  err = capsys.readouterr().err
  assert "converting" in err and "100.0%" in err and "done in" in err
  reader = ck.CheckpointReader(out / "embedding")
  assert reader.layout.stack_names == ("a", "b__c", "d") and reader.layout.num_shards == 8
  assert json.loads((out / "data" / "metadata").read_text()) == {"position": 5}
  _check(model, out / "embedding")
  layout_file = tmp_path / "layout.json"
  layout_file.write_text(layout.to_json())
  assert (
      main(["convert", str(out), str(tmp_path / "back"), "--layout", str(layout_file), "--quiet"])
      == 0
  )
  assert capsys.readouterr().err == ""
  assert ck.CheckpointReader(tmp_path / "back" / "embedding").layout == layout
  _check(model, tmp_path / "back" / "embedding")


def test_convert_unstacked_and_restack(saved, tmp_path):
  model, layout, root = saved
  assert (
      main(
          ["convert", str(root / "3" / "embedding"), str(tmp_path / "u"), "--unstacked", "--quiet"]
      )
      == 0
  )
  assert ck.CheckpointReader(tmp_path / "u").kind == "unstacked"
  assert (
      main(
          [
              "convert",
              str(tmp_path / "u"),
              str(tmp_path / "s"),
              "--num-devices",
              "4",
              "--groups",
              "a,b;c;d",
              "--compression",
              "zstd",
              "--quiet",
          ]
      )
      == 0
  )
  reader = ck.CheckpointReader(tmp_path / "s")
  assert reader.layout.num_devices == 4 and reader.manifest.storage.compression == "zstd"
  _check(model, tmp_path / "s")
  assert (
      main(
          ["convert", str(tmp_path / "s"), str(tmp_path / "sep"), "--groups", "separate", "--quiet"]
      )
      == 0
  )
  assert len(ck.CheckpointReader(tmp_path / "sep").layout.stacks) == 4


def test_convert_changes_the_table_dtype_rounding_to_nearest(saved, tmp_path):
  """A Trainer resumes only tables of its table_dtype: convert makes the other one."""
  model, layout, root = saved
  assert main(["convert", str(root / "3"), str(tmp_path / "bf16"), "--table-dtype", "bfloat16",
               "--quiet"]) == 0
  reader = ck.CheckpointReader(tmp_path / "bf16" / "embedding")
  assert reader.layout == layout  # --table-dtype alone keeps the source's layout
  assert {reader.dtype(name) for name in reader.table_names} == {np.dtype(ml_dtypes.bfloat16)}
  arrays = ck.EmbeddingCheckpointHandler().restore(tmp_path / "bf16" / "embedding",
                                                   ck.TableRestore())
  for name, logical in model.logical.items():
    assert_same_bits(arrays.tables[name], logical.astype(ml_dtypes.bfloat16))
    for slot, values in model.slots[name].items():
      assert_same_bits(arrays.slots[name][slot], values)  # slots stay float32
  assert main(["verify", str(tmp_path / "bf16")]) == 0
  # To per-table arrays and back to float32 on another layout: the rounded values, widened.
  assert main(["convert", str(tmp_path / "bf16"), str(tmp_path / "u"), "--unstacked",
               "--table-dtype", "float32", "--quiet"]) == 0
  assert main(["convert", str(tmp_path / "u"), str(tmp_path / "f32"), "--num-devices", "2",
               "--quiet"]) == 0
  arrays = ck.EmbeddingCheckpointHandler().restore(tmp_path / "f32" / "embedding",
                                                   ck.TableRestore())
  for name, logical in model.logical.items():
    assert_same_bits(arrays.tables[name], logical.astype(ml_dtypes.bfloat16).astype(np.float32))
  with pytest.raises(ValueError, match="table_dtype must be one of"):
    ck.convert(root / "3", tmp_path / "f16", layout, table_dtype="float16")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["convert", "{tmp}/nowhere", "{tmp}/x", "--unstacked"], "does not exist"),
        (["convert", "{src}", "{src}", "--unstacked"],
         "already exists; choose another destination or pass --overwrite"),
        (
            ["convert", "{src}", "{tmp}/x", "--groups", "a,d;b;c"],
            "(D'=16) and 'd' (D'=8) cannot share",
        ),
        (["convert", "{src}", "{tmp}/x", "--layout", "{tmp}/missing.json"], "no such file"),
        (["convert", "{src}", "{tmp}/x", "--groups", "a,b;c;d;a"],
         "table 'a' is in stacking groups 0 and 3: name each table in one group, once."),
        (["convert", "{src}", "{tmp}/x", "--groups", "c;d;a;b;c", "--num-devices", "2"],
         "table 'c' is in stacking groups 0 and 4: name each table in one group, once."),
        (["inspect", "{tmp}"], "not a checkpoint"),
        (["inspect", "{workdir}"],
         "a Trainer workdir, which keeps its checkpoints in {workdir}/checkpoints: pass that."),
        (["convert", "{workdir}", "{tmp}/x", "--unstacked"],
         "a Trainer workdir, which keeps its checkpoints in {workdir}/checkpoints: pass that."),
        # It was written, listed and verified as step 4, and every resume refused it.
        (["convert", "{src}", "{root}/4", "--num-devices", "2"],
         "the destination {root}/4 is named as step 4, but the source is step 3"),
        (["convert", "{root}", "{root}/4", "--num-devices", "2", "--quiet"],
         "is named as step 4"),
        # Also into a new root, which a Trainer would then resume.
        (["convert", "{src}", "{tmp}/run2/checkpoints/7", "--num-devices", "2"],
         "is named as step 7, but the source is step 3"),
        # A bare KeyError('file://') was printed as the whole message.
        (["inspect", "sftp://host/run"], "PATH 'sftp://host/run': etils.epath has no handler"),
        (["convert", "file://relative/run", "{tmp}/x", "--unstacked"],
         "SRC 'file://relative/run': a file:// URL must name an absolute local path"),
        # --overwrite deleted whatever was there.
        (["convert", "{src}", "{root}", "--unstacked", "--overwrite"], "holds the source"),
        (["convert", "{src}", "{tmp}", "--unstacked", "--overwrite"],
         "w is a directory holding notes.txt, not a checkpoint step directory"),
        (["convert", "{src}", "{tmp}/x", "--groups", "a,b;c;nope;d"],  # it spoke of features
         "--groups names tables ['nope'], which the source does not hold; its tables:"
         " ['a', 'b', 'c', 'd']."),
    ],
)
def test_errors_exit_non_zero_with_a_message(saved, tmp_path, capsys, argv, message):
  _, _, root = saved
  workdir = root.parent / "workdir"
  if not workdir.exists():
    (workdir / "checkpoints").mkdir(parents=True)
  names = dict(src=root / "3", tmp=tmp_path / "w", workdir=workdir, root=root)
  argv = [a.format(**names) for a in argv]
  (tmp_path / "w").mkdir()
  (tmp_path / "w" / "notes.txt").write_text("precious")
  assert main(argv) == 1
  assert (tmp_path / "w" / "notes.txt").read_text() == "precious"
  err = capsys.readouterr().err
  assert "error:" in err and message.format(**names) in err and err.count("\n") == 1, err


@pytest.mark.parametrize("argv, message", [
    (["convert", "a", "b", "--num-devices", "0"], "argument --num-devices: must be >= 1, got 0"),
    (["convert", "a", "b", "--shards-per-device", "two"],
     "argument --shards-per-device: expected an integer, got 'two'"),
    (["convert", "a", "b", "--num-dev", "2"], "unrecognized arguments: --num-dev 2"),
    # Values no source could take: refused before the source is read (they exited 1 after).
    (["convert", "a", "b", "--shards-per-device", "65"],
     "argument --shards-per-device: must be <= 64, got 65"),
    (["convert", "a", "b", "--groups", ""],
     "argument --groups: names no table; write groups as 'a,b;c'."),
    (["convert", "a", "b", "--groups", " ; ,"], "argument --groups: names no table"),
    # Flags that exclude each other, or no target: usage errors too, found before
    # the source is read (it need not exist).
    (["convert", "a", "b"], "convert: choose a target: --layout FILE"),
    (["convert", "a", "b", "--unstacked", "--num-devices", "2"],
     "convert: --unstacked takes no --layout, --num-devices"),
    (["convert", "a", "b", "--unstacked", "--layout", "l.json"], "--unstacked takes no"),
])
def test_bad_flags_give_one_line_naming_the_flag(argv, message, capsys):
  assert main(argv) == 2
  err = capsys.readouterr().err
  assert message in err and err.count("\n") == 1, err


def test_file_urls_are_local_paths(saved, tmp_path, capsys):
  model, _, root = saved
  assert main(["inspect", f"file://{root}"]) == 0
  assert main(["convert", f"file://{root}", f"file://{tmp_path / 'x'}", "--unstacked"]) == 0
  _check(model, tmp_path / "x" / "embedding")


def test_convert_of_a_root_takes_its_latest_step(saved, tmp_path, capsys):
  model, _, root = saved
  out = tmp_path / "latest"
  assert main(["convert", str(root), str(tmp_path / "quiet"), "--unstacked", "--quiet"]) == 0
  assert capsys.readouterr().err == ""  # --quiet: nothing but errors
  assert main(["convert", str(root), str(out), "--unstacked"]) == 0
  assert f"converting its latest step 3 ({root / '3'})" in capsys.readouterr().err
  _check(model, out / "embedding")
  assert main(["inspect", str(out)]) == 0  # a converted step: no step number in its name
  text = capsys.readouterr().out
  assert f"Orbax checkpoint at {out}" in text and "step None" not in text


def test_convert_of_a_root_names_a_newer_step_it_skips_even_when_quiet(saved, tmp_path, capsys):
  """A damaged newest step was skipped silently: an older step was converted without a word."""
  model, layout, root = saved
  tables, slots = model.state(layout)
  with ck.CheckpointManager(root) as mngr:
    mngr.save(5, ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout)), force=True)
  damaged = root / "5" / "embedding" / "layout.json"
  damaged.write_bytes(damaged.read_bytes()[:-3])
  assert main(["convert", str(root), str(tmp_path / "out"), "--unstacked", "--quiet"]) == 0
  err = capsys.readouterr().err
  assert err.startswith(f"sc-checkpoint convert: warning: checkpoint step {root / '5'} is"
                        " skipped:"), err
  assert str(damaged) in err and ".." not in err
  _check(model, tmp_path / "out" / "embedding")


def test_convert_of_a_root_names_a_newer_step_it_cannot_read_even_when_quiet(saved, tmp_path,
                                                                           capsys):
  """A newest step whose files are whole but that cannot be read as its step (renamed by
  hand here; a delta whose chain is broken alike) was skipped without a word."""
  model, layout, root = saved
  tables, slots = model.state(layout)
  with ck.CheckpointManager(root) as mngr:
    mngr.save(5, ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout)), force=True)
  (root / "5").rename(root / "9")
  assert main(["convert", str(root), str(tmp_path / "out"), "--unstacked", "--quiet"]) == 0
  err = capsys.readouterr().err
  assert err.startswith(f"sc-checkpoint convert: warning: checkpoint step {root / '9'} is"
                        " skipped:"), err
  assert "is the integrity manifest of step 5, but its directory is step 9" in err, err
  _check(model, tmp_path / "out" / "embedding")


def test_convert_of_a_root_falls_back_past_a_step_whose_chunk_fails_its_checksum(
    saved, tmp_path, capsys):
  """A flipped byte shows only when the chunk is read: convert of the root refused (exit 1),
  where a restore of the latest step falls back to the step before, with a warning."""
  model, layout, root = saved
  tables, slots = model.state(layout)
  with ck.CheckpointManager(root) as mngr:
    mngr.save(5, ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout)), force=True)
  chunk = next(path for path in sorted((root / "5" / "embedding").rglob("*"))
               if path.is_file() and "/c/" in str(path))
  data = bytearray(chunk.read_bytes())
  data[len(data) // 2] ^= 0x5A
  chunk.write_bytes(bytes(data))
  assert main(["convert", str(root), str(tmp_path / "out"), "--unstacked"]) == 0
  err = capsys.readouterr().err
  assert f"warning: checkpoint step {root / '5'} is skipped: " in err, err
  assert "fails its CRC32C checksum" in err, err
  assert f"converting the step before it instead: {root / '3'}" in err, err
  _check(model, tmp_path / "out" / "embedding")
  assert sorted(path.name for path in tmp_path.iterdir()) == ["out", "run"]  # nothing left
  assert main(["convert", str(root / "5"), str(tmp_path / "five"), "--unstacked"]) == 1  # named


def test_convert_of_a_root_whose_step_a_job_deletes_meanwhile_converts_the_newest_left(
    saved, tmp_path, capsys, monkeypatch):
  """A job's retention deleted the step being converted: convert failed with "is not a
  checkpoint: no manifest.json", where a restore of the latest step lists the steps again."""
  model, layout, root = saved
  tables, slots = model.state(layout)
  with ck.CheckpointManager(root) as mngr:
    mngr.save(5, ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout)), force=True)
  real_convert = cli.convert

  def convert_while_the_job_deletes(src, *args, **kwargs):
    if (root / "5").exists():
      shutil.rmtree(root / "5")  # the job's retention, as the conversion starts reading
    return real_convert(src, *args, **kwargs)

  monkeypatch.setattr(cli, "convert", convert_while_the_job_deletes)
  assert main(["convert", str(root), str(tmp_path / "out"), "--unstacked"]) == 0
  err = capsys.readouterr().err
  assert (f"{root / '5'} was deleted while it was converted (a job writing {root} keeps only"
          " its latest steps): listing the steps again") in err, err
  assert f"converting its latest step 3 ({root / '3'})" in err, err
  _check(model, tmp_path / "out" / "embedding")


def test_a_step_of_several_embedding_items_names_them(saved, tmp_path, capsys):
  """A model with two embedding layers saves one item per layer: inspect said "(no embedding
  item)" and convert "has no embedding item (no subdirectory with manifest.json)"."""
  model, layout, _ = saved
  tables, slots = model.state(layout)
  root = tmp_path / "two"
  with ck.CheckpointManager(root) as mngr:
    save = ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout))
    mngr.save(4, save, items={"embedding2": save})
  step = root / "4"
  assert main(["inspect", str(step)]) == 0
  assert ("embedding items: embedding, embedding2 (inspect or convert each item directory on"
          " its own)") in capsys.readouterr().out
  for source in (step, root):
    assert main(["convert", str(source), str(tmp_path / "out"), "--unstacked"]) == 1
    err = capsys.readouterr().err
    assert (f"It is an Orbax step directory holding 2 embedding items (embedding, embedding2):"
            f" give one of them, e.g. {step / 'embedding2'}. Convert each item directory on its"
            " own.") in err, err
  assert main(["convert", str(step / "embedding2"), str(tmp_path / "out"), "--unstacked"]) == 0
  _check(model, tmp_path / "out")  # an item converts to an item


def test_the_chunk_encoding_alone_keeps_the_layout(saved, tmp_path, capsys):
  model, _, root = saved
  assert main(["convert", str(root / "3"), str(tmp_path / "zstd"), "--compression", "zstd",
               "--checksum", "none"]) == 0
  assert f"converting {root / '3' / 'embedding'} -> " in capsys.readouterr().err
  info = ck.inspect(tmp_path / "zstd")["embedding"]
  assert info["storage"]["compression"] == "zstd" and info["storage"]["checksum"] == "none"
  assert ck.inspect(tmp_path / "zstd")["embedding"]["layout"]["num_devices"] == 8
  _check(model, tmp_path / "zstd" / "embedding")


def test_usage_errors_exit_2(capsys):
  assert main(["frobnicate"]) == 2
  assert main(["convert"]) == 2
  unknown, missing = capsys.readouterr().err.splitlines()  # one line each
  assert unknown.startswith("sc-checkpoint: error: argument command: invalid choice: 'frobnicate'")
  assert missing == (
      "sc-checkpoint convert: error: the following arguments are required: src, dst (see --help)")


def test_a_layout_file_that_is_no_layout_is_named(saved, tmp_path, capsys):
  _, _, root = saved
  junk = tmp_path / "junk.json"
  junk.write_text('{"x": 1}')
  assert main(["convert", str(root), str(tmp_path / "x"), "--layout", str(junk), "--quiet"]) == 1
  err = capsys.readouterr().err
  assert f"--layout {junk}: layout format_version None" in err and err.count("\n") == 1, err


def test_a_layout_file_lacking_a_table_is_refused_naming_it(saved, tmp_path, capsys):
  model, _, root = saved
  fewer = make_model([spec + (Adam(),) for spec in TABLES if spec[0] != "b"], seed=4)
  layout_file = tmp_path / "layout.json"
  layout_file.write_text(fewer.layout([["a"], ["c"], ["d"]], 2).to_json())
  assert main(["convert", str(root / "3"), str(tmp_path / "x"), "--layout", str(layout_file),
               "--quiet"]) == 1
  err = capsys.readouterr().err
  assert "no place for tables ['b']" in err and err.count("\n") == 1, err
  assert not (tmp_path / "x").exists()


def test_an_integrity_failure_is_one_line_naming_every_file(saved, tmp_path, capsys):
  _, _, root = saved
  damaged = [root / "3" / "data" / "metadata", root / "3" / "embedding" / "layout.json"]
  for path in damaged:
    path.write_text(path.read_text() + " ")
  assert main(["convert", str(root / "3"), str(tmp_path / "x"), "--unstacked", "--quiet"]) == 1
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and all(str(path) in err for path in damaged), err
  assert "failed its integrity check: " in err and not (tmp_path / "x").exists()


def test_a_step_whose_embedding_item_lost_its_manifest_is_named_damaged(saved, tmp_path, capsys):
  """It was 'has no embedding item' (cli) or 'an unfinished save never writes one' (convert)."""
  _, _, root = saved
  missing = root / "3" / "embedding" / "manifest.json"
  missing.unlink()
  assert main(["convert", str(root / "3"), str(tmp_path / "x"), "--unstacked", "--quiet"]) == 1
  err = capsys.readouterr().err
  assert f"{missing}: is missing (listed in the step's integrity manifest)" in err, err
  with pytest.raises(ck.CorruptCheckpointError, match=f"{re.escape(str(missing))}: is missing"):
    ck.convert(root / "3", tmp_path / "y", "unstacked")
  assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_a_warning_is_one_line_like_the_errors(saved, tmp_path, capsys):
  """An entry the step's manifest does not list is named, without Python's warning format."""
  _, _, root = saved
  (root / "3" / "notes.txt").write_text("added by hand")
  assert main(["convert", str(root / "3"), str(tmp_path / "x"), "--unstacked", "--quiet"]) == 0
  err = capsys.readouterr().err
  assert err == (f"sc-checkpoint convert: warning: {root / '3' / 'notes.txt'} is not in the"
                 " integrity manifest of the step being converted (not written by the checkpoint"
                 " manager): it is not copied into the output.\n"), err


def test_inspect_into_a_closed_pipe_exits_quietly(saved):
  """`sc-checkpoint inspect ROOT | head -1`: the reader left early; no error, status 0."""
  _, _, root = saved
  read_end, write_end = os.pipe()
  os.close(read_end)  # Every write to the pipe fails as it does once `head` has exited.
  try:
    done = subprocess.run([sys.executable, "-m", "checkpoint.cli", "inspect", str(root)],
                          stdout=write_end, stderr=subprocess.PIPE, text=True, cwd=REPO,
                          timeout=120)
  finally:
    os.close(write_end)
  assert done.returncode == 0 and done.stderr == "", done.stderr


def test_a_broken_pipe_that_is_not_stdout_is_an_error(saved, tmp_path, monkeypatch, capsys):
  """Only a closed stdout is quiet: a storage connection's broken pipe fails the command."""
  _, _, root = saved

  def broken_storage(*args, **kwargs):
    raise BrokenPipeError(32, "Broken pipe to the storage server")

  monkeypatch.setattr("checkpoint.cli.convert", broken_storage)
  assert main(["convert", str(root / "3"), str(tmp_path / "x"), "--unstacked", "--quiet"]) == 1
  assert (f"error: {root / '3'} -> {tmp_path / 'x'}: [Errno 32] Broken pipe to the storage"
          " server") in capsys.readouterr().err


def test_verify_of_a_step_without_manifest_points_at_adopt(saved, capsys):
  _, _, root = saved
  (root / "3" / "integrity.json").unlink()
  assert main(["verify", str(root / "3")]) == 1
  out = capsys.readouterr().out
  assert f"`sc-checkpoint verify --adopt {root / '3'}`" in out, out
  assert main(["verify", "--adopt", str(root / "3")]) == 0
  assert "--adopt" not in capsys.readouterr().out


def test_a_storage_error_without_a_file_name_names_the_operands(saved, tmp_path, capsys,
                                                                   monkeypatch):
  """A full disk's ENOSPC carries no file name: the error said only "No space left on
  device"."""
  import errno
  from checkpoint import cli

  def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(cli, "convert", full)
  _, _, run = saved
  assert main(["convert", str(run / "3"), str(tmp_path / "out"), "--unstacked"]) == 1
  error = capsys.readouterr().err.splitlines()[-1]
  assert error == (f"sc-checkpoint convert: error: {run / '3'} -> {tmp_path / 'out'}: [Errno 28]"
                   " No space left on device"), error
  # The tool's own refusals name their paths already: no prefix.
  (tmp_path / "taken").mkdir()
  monkeypatch.undo()
  assert main(["convert", str(run / "3"), str(tmp_path / "taken"), "--unstacked"]) == 1
  assert capsys.readouterr().err.splitlines()[-1].startswith(
      f"sc-checkpoint convert: error: {tmp_path / 'taken'}"), error


def test_an_interrupted_command_says_so_in_one_line_and_exits_130(saved, tmp_path, capsys,
                                                                 monkeypatch):
  """Ctrl-C printed a KeyboardInterrupt traceback."""
  _, _, root = saved

  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt

  monkeypatch.setattr(cli, "convert", interrupted)
  assert main(["convert", str(root / "3"), str(tmp_path / "x"), "--unstacked", "--quiet"]) == 130
  err = capsys.readouterr().err
  assert err.startswith(f"sc-checkpoint convert: interrupted; {tmp_path / 'x'} is as it was"
                        " unless the conversion had just finished; run the command again")
  assert err.count("\n") == 1


def test_an_empty_path_is_refused_not_read_as_the_current_directory(capsys):
  assert main(["inspect", ""]) == 1
  assert "PATH is empty; give a path ('.' for the current directory)" in capsys.readouterr().err


def test_a_cloud_path_without_its_filesystem_package_is_one_line(capsys):
  if importlib.util.find_spec("gcsfs") is not None:
    pytest.skip("gcsfs is installed: gs:// paths are readable")
  assert main(["inspect", "gs://no-such-bucket/run"]) == 1
  err = capsys.readouterr().err
  assert err.startswith("sc-checkpoint inspect: error: gs://no-such-bucket/run: ") and (
      err.count("\n") == 1), err


def test_a_target_larger_than_the_free_space_is_refused_before_writing(saved, tmp_path, capsys,
                                                                       monkeypatch):
  """--num-devices 1000000000000 padded every table to 8e12 rows and filled the disk."""
  _, _, root = saved
  assert main(["convert", str(root / "3"), str(tmp_path / "x"), "--num-devices",
               "1000000000000", "--quiet"]) == 1
  err = capsys.readouterr().err
  assert "[Errno 28] the target's stacked tables and slots need" in err
  assert "The target has 1,000,000,000,000 devices x 1 shards" in err
  assert not (tmp_path / "x").exists() and not list(tmp_path.glob("x*"))
  # The size counted is what is written: the chunks' bytes, less their 4-byte checksums.
  assert main(["convert", str(root / "3"), str(tmp_path / "y"), "--num-devices", "2",
               "--quiet"]) == 0
  chunks = [p for p in (tmp_path / "y" / "embedding" / "stacks").rglob("*")
            if p.is_file() and re.search(r"/c/\d+/\d+$", str(p))]
  written = sum(p.stat().st_size - 4 for p in chunks)
  for free, status in ((written, 0), (written - 1, 1)):
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda path, free=free: shutil._ntuple_diskusage(free, 0, free))
    out = tmp_path / f"z{free}"
    assert main(["convert", str(root / "3"), str(out), "--num-devices", "2", "--quiet"]) == status
    assert out.exists() == (status == 0)
  assert "GiB free there: nothing was kept" in capsys.readouterr().err


def test_a_leftover_of_an_interrupted_replacement_is_named_before_converting(saved, tmp_path,
                                                                            capsys):
  """An in-place conversion interrupted while it deleted the old step left `<dst>.replaced`;
  a rerun converted everything, then failed, advising a rename onto the existing step."""
  _, _, root = saved
  shutil.copytree(root / "3", root / "3.replaced")
  assert main(["convert", str(root / "3"), str(root / "3"), "--num-devices", "2",
               "--overwrite", "--quiet"]) == 1
  err = capsys.readouterr().err
  assert (f"{root / '3.replaced'} is left by an interrupted replacement of {root / '3'}"
          " (the step replaced, or part of it); nothing was converted.") in err
  assert not list(root.glob("*.orbax-checkpoint-tmp*")) and not list(root.glob("*tmp*"))


def test_verify_of_a_file_or_a_trainer_workdir_says_what_to_pass(saved, tmp_path, capsys):
  """A file gave a bare "[Errno 20] Not a directory"; a workdir no hint."""
  _, _, root = saved
  note = tmp_path / "notes.txt"
  note.write_text("not a checkpoint")
  assert main(["verify", str(note)]) == 1
  assert f"{note} is a file, not a checkpoint directory." in capsys.readouterr().err
  workdir = tmp_path / "workdir"
  shutil.copytree(root, workdir / "checkpoints")
  assert main(["verify", str(workdir)]) == 1
  assert (f"It looks like a Trainer workdir, which keeps its checkpoints in"
          f" {workdir / 'checkpoints'}: pass that.") in capsys.readouterr().out
  assert main(["verify", str(workdir / "checkpoints")]) == 0
