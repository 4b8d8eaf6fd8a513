"""Fault injection: damage a Trainer-like checkpoint in one way, resume, classify.

Shared by tests/checkpoint/test_fault_injection.py and
benchmarks/fault_injection.py. A template root holds steps 1 and 2, each
with the items a Trainer writes (embedding tables + row-wise Adagrad slots,
dense {"params", "opt_state", "step"} as an Orbax PyTree, an in-flight
PyTree and a meta JSON), with different random values per step. Each `Case`
damages a copy of it; `run_case` then resumes the way a Trainer does
(`latest_step`, then `restore` of that step with every item) and classifies
the outcome against the oracle (the values saved per step):

  detected   a CheckpointError whose message names the damaged path
  fallback   the data of an older step, bit for bit, with a warning naming it
  ignored    the data of the newest step, bit for bit, with a warning naming
             the stray entry, which is left in place
  silent     anything else: wrong data, no word, or a message not naming it
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import warnings
from collections.abc import Callable
from typing import Any, Literal

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from etils import epath

import checkpoint as ck
from ckpt_testlib import AXIS, make_mesh, make_model
from sc_framework.optimizers import RowWiseAdagrad
from tests.numerics import assert_same_bits

Outcome = Literal["detected", "fallback", "ignored", "silent"]
STEPS = (1, 2)
_STACK = "a__b"


@dataclasses.dataclass
class Template:
  """A saved root and, per step, what each item must restore to."""

  root: epath.Path
  layout: Any
  slot_specs: dict
  oracle: dict[int, dict[str, Any]]


def _step_state(step: int):
  model = make_model([("a", 64, 12, RowWiseAdagrad()), ("b", 120, 10, RowWiseAdagrad())], seed=step)
  layout = model.layout([["a", "b"]], 4)
  tables, slots = model.state(layout)
  rng = np.random.default_rng(100 + step)
  params = {
      "w": rng.standard_normal((20, 16)).astype(np.float32),
      "b": rng.standard_normal((16,)).astype(np.float32),
  }
  opt_state = optax.adam(0.1).init(params)
  opt_state = jax.tree.map(
      lambda x: x + np.float32(step) if x.dtype == np.float32 else x, opt_state
  )
  dense = {"params": params, "opt_state": opt_state, "step": np.int32(step)}
  in_flight = {"activations": {"f_a": rng.standard_normal((8, 12)).astype(np.float32)}}
  meta = {"format": "trainer-like", "step": step, "data": {"position": 10 * step}}
  return model, layout, tables, slots, dense, in_flight, meta


def build_template(root: epath.PathLike) -> Template:
  """Saves steps 1 and 2 under `root` and returns their oracle."""
  root = epath.Path(root)
  oracle = {}
  with ck.CheckpointManager(root, keep_latest=5) as mngr:
    for step in STEPS:
      model, layout, tables, slots, dense, in_flight, meta = _step_state(step)
      slot_specs = model.slot_specs(layout)
      mngr.save(
          step,
          ck.EmbeddingSave(tables, slots, layout, slot_specs),
          items={
              "dense": ocp.args.StandardSave(dense),
              "in_flight": ocp.args.StandardSave(in_flight),
              "meta": ocp.args.JsonSave(meta),
          },
      )
      mngr.wait_until_finished()
      oracle[step] = {
          "tables": {name: np.asarray(array) for name, array in tables.items()},
          "slots": {
              name: {slot: np.asarray(array) for slot, array in group.items()}
              for name, group in slots.items()
          },
          "dense": jax.tree.map(np.asarray, dense),
          "in_flight": in_flight,
          "meta": meta,
      }
  return Template(root, layout, slot_specs, oracle)


# ----------------------------------------------------------------------------- damage


def _largest_file(directory: epath.Path) -> epath.Path:
  """The largest data file of an Orbax PyTree item (OCDBT data files live in d/)."""
  files = [
      os.path.join(folder, name)
      for folder, _, names in os.walk(directory)
      for name in names
      if os.path.basename(folder) == "d"
  ]
  return epath.Path(max(files, key=lambda p: (os.path.getsize(p), p)))


TARGETS: dict[str, Callable[[epath.Path], epath.Path]] = {
    "table chunk": lambda step: step / "embedding/stacks" / _STACK / "table/c/1/0",
    "slot chunk": lambda step: step / "embedding/stacks" / _STACK / "slots/accumulator/c/1/0",
    "dense": lambda step: _largest_file(step / "dense"),
    "in-flight": lambda step: _largest_file(step / "in_flight"),
    "meta": lambda step: step / "meta/metadata",
    "layout.json": lambda step: step / "embedding/layout.json",
    "manifest.json": lambda step: step / "embedding/manifest.json",
    "zarr.json": lambda step: step / "embedding/stacks" / _STACK / "table/zarr.json",
    "integrity.json": lambda step: step / "integrity.json",
}


def _truncate(path: epath.Path) -> None:
  data = path.read_bytes()
  path.write_bytes(data[: len(data) // 2])


def _flip(path: epath.Path) -> None:
  data = bytearray(path.read_bytes())
  for offset in (len(data) // 3, len(data) // 2):  # Four bytes, as in the field report.
    for i in range(2):
      data[offset + i] ^= 0x5A
  path.write_bytes(bytes(data))


def _bad_json(path: epath.Path) -> None:
  path.write_text('{"format": "sc_framework.embedding_checkpoint", "kind": ')


def _link_to_previous(path: epath.Path) -> None:
  """Replaces a file or directory of step 2 by a link to the same path in step 1."""
  rel = os.path.relpath(path, path_step(path))
  source = path_step(path).parent / "1" / rel
  if os.path.isdir(path) and not os.path.islink(path):
    shutil.rmtree(path)
  else:
    os.unlink(path)
  os.symlink(source, path)


def path_step(path: epath.Path) -> epath.Path:
  """The step directory (a child of the root named by digits) holding `path`."""
  for parent in [path, *path.parents]:
    if parent.name.isdigit():
      return parent
  raise ValueError(path)


@dataclasses.dataclass(frozen=True)
class Case:
  """One way to damage the template and the outcome that is correct for it.

  Attributes:
    name: the case's id.
    damage: root -> the damaged (or stray) path, which a message must name.
    expect: 'detected', 'fallback' (to step 1) or 'ignored' (step 2 restored).
    then_save: also save step 3 afterwards (retention runs), which must
      succeed and leave the stray entry in place.
  """

  name: str
  damage: Callable[[epath.Path], epath.Path]
  expect: Outcome
  then_save: bool = False


def _on_file(target: str, action: Callable[[epath.Path], None]):
  def damage(root: epath.Path) -> epath.Path:
    path = TARGETS[target](root / "2")
    action(path)
    return path

  return damage


def _empty_step(root: epath.Path) -> epath.Path:
  (root / "3").mkdir()
  return root / "3"


def _partial_step(root: epath.Path) -> epath.Path:
  shutil.copytree(root / "2", root / "3")
  shutil.rmtree(root / "3" / "embedding" / "stacks")
  return root / "3"


def _unmanifested_step(root: epath.Path) -> epath.Path:
  shutil.copytree(root / "2", root / "3")
  (root / "3" / "integrity.json").unlink()
  return root / "3"


def _linked_latest_step(root: epath.Path) -> epath.Path:
  elsewhere = root.parent / "elsewhere-2"
  shutil.move(root / "2", elsewhere)
  os.symlink(elsewhere, root / "2")
  return root / "2"


def _linked_old_step(root: epath.Path) -> epath.Path:
  elsewhere = root.parent / "elsewhere-0"
  shutil.copytree(root / "1", elsewhere)
  os.symlink(elsewhere, root / "0")
  return root / "0"


def _linked_tmp_dir(root: epath.Path) -> epath.Path:
  elsewhere = root.parent / "elsewhere-tmp"
  elsewhere.mkdir()
  (elsewhere / "precious.txt").write_text("not ours")
  os.symlink(elsewhere, root / "41.orbax-checkpoint-tmp-999")
  return root / "41.orbax-checkpoint-tmp-999"


def _stale_item(item: str):
  """Step 2's OCDBT manifest of `item` replaced by step 1's, with step 1's data files beside
  it: each file is whole and self-consistent (OCDBT's files end with their own CRC32C), but
  of another step."""
  def damage(root: epath.Path) -> epath.Path:
    old, new = root / "1" / item, root / "2" / item
    for folder, _, names in os.walk(old / "d"):
      for name in names:
        target = new / "d" / os.path.relpath(os.path.join(folder, name), old / "d")
        if not target.exists():
          shutil.copyfile(os.path.join(folder, name), target)
    shutil.copyfile(old / "manifest.ocdbt", new / "manifest.ocdbt")
    return new / "manifest.ocdbt"

  return damage


def _swapped_item_manifests(root: epath.Path) -> epath.Path:
  """Step 2's dense and in-flight OCDBT manifests swapped."""
  dense, in_flight = root / "2/dense/manifest.ocdbt", root / "2/in_flight/manifest.ocdbt"
  dense_bytes = dense.read_bytes()
  dense.write_bytes(in_flight.read_bytes())
  in_flight.write_bytes(dense_bytes)
  return dense


def _foreign(relative: str):
  def damage(root: epath.Path) -> epath.Path:
    path = root / relative
    path.write_text("a note someone left here")
    return path

  return damage


def _cases() -> list[Case]:
  cases = []
  for target in ("table chunk", "slot chunk", "dense", "in-flight", "meta"):
    cases.append(Case(f"flip {target}", _on_file(target, _flip), "detected"))
    cases.append(Case(f"truncate {target}", _on_file(target, _truncate), "fallback"))
    cases.append(Case(f"delete {target}", _on_file(target, lambda p: p.unlink()), "fallback"))
  for target in ("meta", "layout.json", "manifest.json", "zarr.json", "integrity.json"):
    cases.append(Case(f"corrupt JSON {target}", _on_file(target, _bad_json), "fallback"))
  cases += [
      Case("link chunk to previous step", _on_file("table chunk", _link_to_previous), "fallback"),
      Case("stale dense item from previous step", _stale_item("dense"), "fallback"),
      Case("stale in-flight item from previous step", _stale_item("in_flight"), "fallback"),
      Case("swapped dense and in-flight manifests", _swapped_item_manifests, "fallback"),
      Case(
          "link stack dir to previous step",
          lambda root: _link(root / "2/embedding/stacks" / _STACK),
          "fallback",
      ),
      Case("link item to previous step", lambda root: _link(root / "2/embedding"), "fallback"),
      Case("link latest step", _linked_latest_step, "fallback"),
      Case("link old step", _linked_old_step, "ignored", then_save=True),
      Case("link tmp dir in root", _linked_tmp_dir, "ignored", then_save=True),
      Case("empty step dir", _empty_step, "ignored", then_save=True),
      Case("partial step dir", _partial_step, "ignored", then_save=True),
      Case("step without integrity manifest", _unmanifested_step, "ignored"),
      Case("foreign file in root", _foreign("notes.txt"), "ignored", then_save=True),
      Case("foreign file in step", _foreign("2/notes.txt"), "ignored"),
      Case("foreign file in retired step", _foreign("1/notes.txt"), "ignored", then_save=True),
      Case("foreign file in item", _foreign("2/embedding/stacks/notes.txt"), "ignored"),
  ]
  # Small files (< 1 MiB: meta, dense and in-flight here) are checksummed when
  # the newest step is chosen, so a flip there falls back instead of failing.
  return [
      dataclasses.replace(case, expect="fallback")
      if case.name in ("flip dense", "flip in-flight", "flip meta")
      else case
      for case in cases
  ]


def _link(path: epath.Path) -> epath.Path:
  _link_to_previous(path)
  return path


CASES = _cases()


# ----------------------------------------------------------------------------- running


@dataclasses.dataclass(frozen=True)
class Result:
  case: str
  outcome: Outcome
  expected: Outcome
  detail: str
  path: str = ""


def run_case(template: Template, case: Case, workdir: epath.PathLike) -> Result:
  """Damages a copy of the template, resumes from it and classifies the outcome."""
  workdir = epath.Path(workdir)
  root = workdir / "checkpoints"
  shutil.copytree(template.root, root, symlinks=True)
  damaged = case.damage(root)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
      step, restored = _resume(template, root)
      if case.then_save:
        _save_step_3(root)
    except ck.CheckpointError as error:
      named = str(damaged) in str(error)
      outcome = "detected" if named else "silent"
      detail = f"{type(error).__name__}: {error}"[:400]
      return Result(case.name, outcome, case.expect, detail, str(damaged))
  said = " | ".join(str(w.message) for w in caught)
  named = str(damaged) in said
  if not _matches(restored, template.oracle[step]):
    return Result(case.name, "silent", case.expect, f"step {step} restored WRONG data")
  if not named:
    return Result(case.name, "silent", case.expect, f"step {step} restored; no warning names it")
  moved = [p for p in os.listdir(root) if p.startswith(f"{damaged.name}.incomplete-")]
  kept = os.path.lexists(damaged) or (moved and str(root / moved[0]) in said)
  if case.then_save and not (kept and _intact(damaged if not moved else root / moved[0])):
    return Result(case.name, "silent", case.expect, f"{damaged} was deleted or changed")
  outcome = "fallback" if step < max(STEPS) else "ignored"
  detail = f"step {step} restored; warning: {said[:300]}"
  return Result(case.name, outcome, case.expect, detail, str(damaged))


def _intact(path: epath.Path) -> bool:
  return not os.path.islink(path) or os.path.exists(os.readlink(path))


def _resume(template: Template, root: epath.Path):
  """What a Trainer does: the latest step, then every item of it."""
  with ck.CheckpointManager(root, keep_latest=2) as mngr:
    step = mngr.latest_step()
    if step is None:
      raise ck.NotACheckpointError(f"{root}: no step")
    oracle = template.oracle[step]
    restored = mngr.restore(
        step,
        ck.EmbeddingRestore(template.layout, make_mesh(template.layout.num_devices), AXIS),
        items={
            "dense": ocp.args.StandardRestore(_abstract(oracle["dense"])),
            "in_flight": ocp.args.StandardRestore(_abstract(oracle["in_flight"])),
            "meta": ocp.args.JsonRestore(),
        },
    )
  return step, restored


def _save_step_3(root: epath.Path) -> None:
  model, layout, tables, slots, dense, in_flight, meta = _step_state(3)
  with ck.CheckpointManager(root, keep_latest=2) as mngr:
    mngr.save(
        3,
        ck.EmbeddingSave(tables, slots, layout, model.slot_specs(layout)),
        items={
            "dense": ocp.args.StandardSave(dense),
            "in_flight": ocp.args.StandardSave(in_flight),
            "meta": ocp.args.JsonSave(meta),
        },
    )
    mngr.wait_until_finished()
    if mngr.latest_step() != 3:
      raise AssertionError(f"saving step 3 into {root} did not make it the latest step")


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), tree)


def _matches(restored: dict[str, Any], oracle: dict[str, Any]) -> bool:
  embedding = restored["embedding"]
  pairs = [(embedding.tables[name], oracle["tables"][name]) for name in oracle["tables"]]
  pairs += [
      (embedding.slots[name][slot], oracle["slots"][name][slot])
      for name in oracle["slots"]
      for slot in oracle["slots"][name]
  ]
  for key in ("dense", "in_flight"):
    got, want = jax.tree.leaves(restored[key]), jax.tree.leaves(oracle[key])
    if len(got) != len(want):
      return False
    pairs += list(zip(got, want))
  try:
    for got, want in pairs:
      assert_same_bits(got, want)
  except AssertionError:
    return False
  return restored["meta"] == oracle["meta"]
