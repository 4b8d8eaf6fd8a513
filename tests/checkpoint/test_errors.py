"""Every failure names its cause: missing tables, shape and dtype mismatches,
corrupt or truncated arrays, directories that are not checkpoints, hostile names."""

from __future__ import annotations

import json
import os
import re

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

import checkpoint as ck
from ckpt_testlib import AXIS, make_mesh, make_model
from sc_framework import FeatureSpec, TableSpec, stack_tables
from sc_framework.optimizers import Adagrad, RowWiseAdagrad


def _save(path, model, layout, **kwargs):
  tables, slots = model.state(layout)
  with ocp.Checkpointer(ck.EmbeddingCheckpointHandler()) as ckptr:
    ckptr.save(
        path, args=ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout), **kwargs)
    )


@pytest.fixture
def saved(tmp_path):
  model = make_model([("a", 64, 12, RowWiseAdagrad()), ("b", 120, 10, RowWiseAdagrad())])
  layout = model.layout([["a", "b"]], 8)
  _save(tmp_path / "ckpt", model, layout)
  return model, layout, tmp_path / "ckpt"


def _restore(path, layout, **kwargs):
  return ck.EmbeddingCheckpointHandler().restore(
      path, ck.EmbeddingRestore(layout, make_mesh(layout.num_devices), AXIS, **kwargs)
  )


def _layout(tables, groups, devices=4):
  features = [
      FeatureSpec(f"f_{name}", TableSpec(name, v, d, optimizer=RowWiseAdagrad()), (8,))
      for name, v, d in tables
  ]
  return stack_tables(features, groups, devices)


def test_table_missing_from_the_checkpoint(saved):
  _, _, path = saved
  layout = _layout([("a", 64, 12), ("e", 32, 8)], [["a"], ["e"]])
  with pytest.raises(ck.MissingTableError, match=r"needs tables \['e'\].*holds \['a', 'b'\]"):
    _restore(path, layout)
  with pytest.raises(ck.MissingTableError, match="table 'zzz' is not in the checkpoint"):
    ck.EmbeddingCheckpointHandler().restore(path, ck.TableRestore(tables=["a", "zzz"]))
  with pytest.raises(ck.MissingTableError, match=r"no slot 'mu'.*its slots are \['accumulator'\]"):
    ck.CheckpointReader(path).read_rows("a", "mu", [0])


@pytest.mark.parametrize("shape", [(65, 12), (64, 13)])
def test_vocabulary_or_dimension_mismatch(saved, shape):
  _, _, path = saved
  layout = _layout([("a",) + shape, ("b", 120, 10)], [["a", "b"]])
  with pytest.raises(
      ck.IncompatibleCheckpointError,
      match=(
          r"table 'a'.*vocabulary_size=64, embedding_dim=12 but the target layout has"
          rf" vocabulary_size={shape[0]}, embedding_dim={shape[1]}"
      ),
  ):
    _restore(path, layout)


def test_incompatible_dtypes(tmp_path, saved):
  _, layout, path = saved
  with pytest.raises(
      ck.IncompatibleCheckpointError,
      match="stores its tables as float32, but bfloat16 was requested",
  ):
    _restore(path, layout, dtype=jnp.bfloat16)
  low = make_model([("a", 64, 16, Adagrad())], dtype=ml_dtypes.bfloat16)
  high = make_model([("b", 64, 16, Adagrad())])
  low.tables.update(high.tables)
  low.features += high.features
  low.logical.update(high.logical)
  low.slots.update(high.slots)
  separate = low.layout([["a"], ["b"]], 8)
  _save(tmp_path / "mixed", low, separate)
  merged = low.layout([["a", "b"]], 8)
  with pytest.raises(
      ck.IncompatibleCheckpointError, match=r"different dtypes \(a: bfloat16, b: float32\)"
  ):
    _restore(tmp_path / "mixed", merged)


def _chunk(path, index=1):
  return path / "stacks" / "a__b" / "table" / "c" / str(index) / "0"


def test_corrupt_chunk_is_detected_by_its_checksum(tmp_path):
  model = make_model([("a", 64, 12, RowWiseAdagrad()), ("b", 120, 10, RowWiseAdagrad())])
  layout = model.layout([["a", "b"]], 8)
  path = tmp_path / "ckpt"
  _save(path, model, layout, storage=ck.StorageOptions(checksum="crc32c"))
  chunk = _chunk(path)
  data = bytearray(chunk.read_bytes())
  data[17] ^= 0x40
  chunk.write_bytes(bytes(data))
  with pytest.raises(
      ck.CorruptCheckpointError,
      match=r"stack .a__b. table array.*(Digest mismatch|CRC32C).*restore another step",
  ):
    _restore(path, layout)
  with pytest.raises(ck.CorruptCheckpointError, match=f"{re.escape(str(chunk))}.*CRC32C"):
    ck.EmbeddingCheckpointHandler().restore(path, ck.TableRestore(tables=["b"]))
  # TensorStore's own codec check, where the direct read does not apply (zstd).
  other = tmp_path / "zstd"
  _save(other, model, layout, storage=ck.StorageOptions(compression="zstd"))
  chunk = _chunk(other)
  data = bytearray(chunk.read_bytes())
  data[len(data) - 2] ^= 0x40
  chunk.write_bytes(bytes(data))
  with pytest.raises(ck.CorruptCheckpointError, match=f"{re.escape(str(chunk))}.*Digest mismatch"):
    ck.EmbeddingCheckpointHandler().restore(other, ck.TableRestore(tables=["b"]))


def test_truncated_or_missing_chunk(saved):
  _, layout, path = saved
  chunk = _chunk(path, 2)
  chunk.write_bytes(chunk.read_bytes()[:50])
  with pytest.raises(
      ck.CorruptCheckpointError, match=r"stack 'a__b' table array.*(Not enough data|has 50 bytes)"
  ):
    _restore(path, layout)
  os.remove(chunk)
  with pytest.raises(ck.CorruptCheckpointError, match=r"is missing"):
    _restore(path, layout)


def test_missing_array_directory(saved):
  _, layout, path = saved
  (path / "stacks" / "a__b" / "slots" / "accumulator" / "zarr.json").unlink()
  with pytest.raises(
      ck.CorruptCheckpointError, match="cannot open stack 'a__b' slot 'accumulator'"
  ):
    _restore(path, layout)


def test_directories_that_are_not_checkpoints(tmp_path, saved):
  _, layout, path = saved
  with pytest.raises(ck.NotACheckpointError, match="does not exist"):
    ck.CheckpointReader(tmp_path / "nowhere")
  (tmp_path / "empty").mkdir()
  with pytest.raises(ck.NotACheckpointError, match="has no manifest.json"):
    ck.CheckpointReader(tmp_path / "empty")
  with pytest.raises(ck.NotACheckpointError, match="has no manifest.json"):
    _restore(tmp_path / "empty", layout)
  (tmp_path / "junk").mkdir()
  (tmp_path / "junk" / "manifest.json").write_text("{not json")
  with pytest.raises(ck.NotACheckpointError, match="not valid JSON"):
    ck.CheckpointReader(tmp_path / "junk")
  (tmp_path / "junk" / "manifest.json").write_text(json.dumps({"format": "something else"}))
  with pytest.raises(ck.NotACheckpointError, match="not an embedding checkpoint manifest"):
    ck.CheckpointReader(tmp_path / "junk")
  manifest = json.loads((path / "manifest.json").read_text())
  manifest["format_version"] = 99
  (tmp_path / "junk" / "manifest.json").write_text(json.dumps(manifest))
  with pytest.raises(ck.NotACheckpointError, match="format_version 99 is not supported"):
    ck.CheckpointReader(tmp_path / "junk")
  (tmp_path / "step").mkdir()
  os.rename(path, tmp_path / "step" / "embedding")
  with pytest.raises(ck.NotACheckpointError, match="Orbax step directory; its embedding item is"):
    ck.CheckpointReader(tmp_path / "step")
  with pytest.raises(ck.BrokenChainError, match="It is a step: pass its embedding item,"
                                             f" {re.escape(str(tmp_path / 'step' / 'embedding'))}"):
    ck.stored_table_names(tmp_path / "step")
  with pytest.raises(ck.NotACheckpointError):
    ck.inspect(tmp_path / "empty")


def test_layout_json_that_disagrees_with_the_manifest(saved):
  _, layout, path = saved
  other = _layout([("a", 64, 12), ("b", 120, 10)], [["a"], ["b"]], 8)
  (path / "layout.json").write_text(other.to_json())
  with pytest.raises(ck.NotACheckpointError, match="manifest stores stacks"):
    ck.CheckpointReader(path)


def test_hostile_names_stay_inside_the_checkpoint(tmp_path):
  names = ["../x", "a/b", "~tilde", "..", "ünï"]
  model = make_model([(name, 40, 8, RowWiseAdagrad()) for name in names])
  layout = model.layout([[name] for name in names], 8)
  root = tmp_path / "inner"
  root.mkdir()
  _save(root / "ckpt", model, layout)
  assert sorted(os.listdir(tmp_path)) == ["inner"] and sorted(os.listdir(root)) == ["ckpt"]
  stacks = sorted(os.listdir(root / "ckpt" / "stacks"))
  assert all("/" not in s and "." not in s for s in stacks) and len(stacks) == len(names)
  restored = _restore(root / "ckpt", layout)
  model.check(layout, restored.tables, restored.slots)
  # A manifest edited to point outside is still read inside (names are encoded), and fails.
  evil = tmp_path / "evil"
  evil.mkdir()
  manifest = (root / "ckpt" / "manifest.json").read_text().replace('"../x"', '"../../evil"')
  (root / "ckpt" / "manifest.json").write_text(manifest)
  (root / "ckpt" / "layout.json").write_text(
      (root / "ckpt" / "layout.json").read_text().replace('"../x"', '"../../evil"')
  )
  with pytest.raises(
      ck.CorruptCheckpointError, match=r"cannot open stack '\.\./\.\./evil'.*ckpt/stacks/~2e~2e~2f"
  ):
    ck.EmbeddingCheckpointHandler().restore(root / "ckpt", ck.TableRestore(tables=["../../evil"]))


def test_names_that_differ_only_in_case_are_rejected(tmp_path):
  model = make_model([("Users", 40, 8), ("users", 40, 8)])
  layout = model.layout([["Users"], ["users"]], 8)
  with pytest.raises(ValueError, match="differ only in letter case"):
    _save(tmp_path / "ckpt", model, layout)


def test_save_time_validation(tmp_path):
  model = make_model([("a", 64, 12, RowWiseAdagrad())])
  layout = model.layout([["a"]], 8)
  tables, slots = model.state(layout)
  specs = model.slot_specs(layout)
  handler = ck.EmbeddingCheckpointHandler()
  with pytest.raises(
      ValueError, match=r"declares slots \['accumulator'\] but got slot arrays \[\]"
  ):
    handler.save(tmp_path / "x", ck.EmbeddingSave(tables, {}, layout, specs))
  with pytest.raises(ValueError, match=r"stack 'a' table has shape \(64, 8\), expected \(64, 16\)"):
    handler.save(tmp_path / "x", ck.EmbeddingSave({"a": jnp.zeros((64, 8))}, slots, layout, specs))
  with pytest.raises(ValueError, match="dtype int32"):
    handler.save(
        tmp_path / "x",
        ck.EmbeddingSave({"a": jnp.zeros((64, 16), jnp.int32)}, slots, layout, specs),
    )
  with pytest.raises(TypeError, match="is a ndarray, not a jax.Array"):
    handler.save(tmp_path / "x", ck.EmbeddingSave({"a": np.zeros((64, 16))}, slots, layout, specs))
  with pytest.raises(ValueError, match=r"names stacks \['zz'\]"):
    handler.save(
        tmp_path / "x", ck.EmbeddingSave(dict(tables, zz=tables["a"]), slots, layout, specs)
    )


def test_bad_restore_requests(saved):
  _, layout, path = saved
  with pytest.raises(ValueError, match=r"mesh has no axis 'rows'; its axes are \('table',\)"):
    ck.EmbeddingCheckpointHandler().restore(path, ck.EmbeddingRestore(layout, make_mesh(8), "rows"))
  with pytest.raises(
      ValueError, match="mesh axis 'table' has 8 devices but the target layout is for G=4"
  ):
    ck.EmbeddingCheckpointHandler().restore(
        path, ck.EmbeddingRestore(ck.relayout(layout, num_devices=4), make_mesh(8), AXIS)
    )
  with pytest.raises(ValueError, match=r"rows\['a'\] = \(10, 65\) is not a range inside the vocabulary of table 'a', \[0, 64\)"):
    ck.EmbeddingCheckpointHandler().restore(path, ck.TableRestore(rows={"a": (10, 65)}))
  # Bounds are never rounded: (0.5, 10.7) read rows 0-10, (True, 5) rows 1-5.
  for bounds in [(0.5, 10.7), (True, 5), (2.9, 3.1), (np.float32(1), 4), (1,), (1, 2, 3), 7]:
    with pytest.raises(ValueError, match=r"rows\['a'\] must be a \(start, stop\) pair of ints"):
      ck.EmbeddingCheckpointHandler().restore(path, ck.TableRestore(rows={"a": bounds}))
  with pytest.raises(TypeError, match=r"rows must map table names to \(start, stop\) pairs"):
    ck.EmbeddingCheckpointHandler().restore(path, ck.TableRestore(tables=["a"], rows=(0, 3)))
  arrays = ck.EmbeddingCheckpointHandler().restore(
      path, ck.TableRestore(rows={"a": (np.int64(2), 5)}))
  assert arrays.tables["a"].shape[0] == 3
  with pytest.raises(TypeError, match="needs args=EmbeddingRestore"):
    ck.EmbeddingCheckpointHandler().restore(path)
