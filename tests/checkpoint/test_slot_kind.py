"""Slots restore only into the optimizer that wrote them, also where the slots look alike.

Adam and LaProp both keep 'mu' and 'nu' as wide as the table, and a custom
rule may name its slots like any built-in one, so slot names and widths
cannot tell their meaning. The manifest records the optimizer per group;
every restore path refuses another optimizer (SlotMismatchError) and every
writer (full save, delta, conversion, compaction) keeps the record. The
oracle: the logical per-table numpy arrays of `ckpt_testlib.Model`, random
and never zero, compared bit for bit.
"""

from __future__ import annotations

import itertools
import json
import shutil

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import checkpoint as ck
from checkpoint._compact import compact
from checkpoint.cli import main
from ckpt_testlib import AXIS, make_mesh, make_model, touch_rows
from sc_framework.optimizers import (
    FTRL,
    SGD,
    Adagrad,
    AdagradMomentum,
    Adam,
    CustomOptimizer,
    LaProp,
    RowWiseAdagrad,
    SlotSpec,
)
from tests.numerics import assert_same_bits


def _sign_rule(rows, grads, slots, step):
  del step
  return rows - 0.01 * jnp.sign(grads), slots


def _other_rule(rows, grads, slots, step):
  del step
  return rows - 0.02 * grads, slots


MOMENTS = (SlotSpec("mu"), SlotSpec("nu"))
ACCUMULATOR = (SlotSpec("accumulator", None, 0.3),)
# Every sparse optimizer, and custom rules whose slots look like built-in ones.
OPTIMIZERS = {
    "sgd": SGD(0.1),
    "adagrad": Adagrad(0.1),
    "rowwise_adagrad": RowWiseAdagrad(0.1),
    "adagrad_momentum": AdagradMomentum(0.1),
    "adam": Adam(0.1),
    "laprop": LaProp(0.1),
    "ftrl": FTRL(0.1),
    "custom_moments": CustomOptimizer("moments", _sign_rule, MOMENTS),
    "custom_moments_2": CustomOptimizer("moments_2", _sign_rule, MOMENTS),
    "custom_accumulator": CustomOptimizer("acc", _sign_rule, ACCUMULATOR),
}
# The same optimizers with other hyperparameters (a normal fine-tuning change).
RETUNED = {
    "sgd": SGD(0.5),
    "adagrad": Adagrad(0.02, initial_accumulator=0.5),
    "rowwise_adagrad": RowWiseAdagrad(0.3, eps=1e-6),
    "adagrad_momentum": AdagradMomentum(0.2, momentum=0.5),
    "adam": Adam(0.01, beta1=0.8, beta2=0.99),
    "laprop": LaProp(0.05, beta2=0.9),
    "ftrl": FTRL(0.2, learning_rate_power=-0.25),
    "custom_moments": CustomOptimizer("moments", _other_rule, MOMENTS, learning_rate=0.5),
    "custom_moments_2": CustomOptimizer("moments_2", _other_rule, MOMENTS),
    "custom_accumulator": CustomOptimizer("acc", _other_rule, ACCUMULATOR),
}
# What the manifest records for each.
NAMES = {key: key for key in OPTIMIZERS} | {
    "custom_moments": "custom:moments",
    "custom_moments_2": "custom:moments_2",
    "custom_accumulator": "custom:acc",
}


def _signature(optimizer):
  return sorted((slot.name, slot.width) for slot in optimizer.slots())


def _model(optimizer, seed=0):
  return make_model([("a", 64, 12, optimizer), ("b", 120, 10, optimizer)], seed=seed)


def _save(path, model, layout, **kwargs):
  tables, slots = model.state(layout)
  kwargs.setdefault("optimizers", model.optimizers(layout))
  with ocp.Checkpointer(ck.EmbeddingCheckpointHandler()) as ckptr:
    ckptr.save(path, args=ck.EmbeddingSave(tables, slots, layout, **kwargs))


def _restore(path, layout, **kwargs):
  return ck.EmbeddingCheckpointHandler().restore(
      path, ck.EmbeddingRestore(layout, make_mesh(layout.num_devices), AXIS, **kwargs)
  )


def _optimizers(layout, optimizer):
  return {name: optimizer for name in layout.stack_names}


def _recorded(item):
  data = json.loads((item / "manifest.json").read_text())
  data = data.get("state", data)  # A delta holds the state's manifest.
  return {group["name"]: group.get("optimizer") for group in data["groups"]}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """One checkpoint per optimizer (tables a, b stacked over 4 devices), recorded."""
  root = tmp_path_factory.mktemp("slot_kind")
  out = {}
  for key, optimizer in OPTIMIZERS.items():
    model = _model(optimizer, seed=len(out))
    layout = model.layout([["a", "b"]], 4)
    _save(root / key, model, layout)
    out[key] = (model, layout, root / key)
  return out


def test_the_manifest_records_each_stack_optimizer(saved):
  model, layout, path = saved["adam"]
  assert _recorded(path) == {layout.stack_names[0]: "adam"}
  assert json.loads((path / "manifest.json").read_text())["format_version"] == 1
  assert _recorded(saved["custom_moments"][2]) == {layout.stack_names[0]: "custom:moments"}
  reader = ck.CheckpointReader(path)
  assert reader.optimizer_name("a") == reader.optimizer_name("b") == "adam"


def test_a_malformed_record_is_refused(saved, tmp_path):
  _, _, path = saved["adam"]
  shutil.copytree(path, tmp_path / "ckpt")
  manifest = tmp_path / "ckpt" / "manifest.json"
  data = json.loads(manifest.read_text())
  data["groups"][0]["optimizer"] = 3
  manifest.write_text(json.dumps(data))
  with pytest.raises(ck.NotACheckpointError, match=r"malformed manifest.*optimizer 3, not a name"):
    ck.CheckpointReader(tmp_path / "ckpt")


@pytest.mark.parametrize("stored", sorted(OPTIMIZERS))
def test_every_optimizer_restores_only_into_itself(saved, stored):
  """Each stored optimizer against every target: refused unless the same optimizer.

  A target of other slot names or widths was refused before; one with the
  same slots but another optimizer (Adam/LaProp, custom rules named like
  built-in ones) is refused now. The same optimizer with other
  hyperparameters restores bit for bit.
  """
  model, layout, path = saved[stored]
  stack = layout.stack_names[0]
  for target, optimizer in OPTIMIZERS.items():
    if target == stored:
      continue
    with pytest.raises(ck.SlotMismatchError) as error:
      _restore(path, layout, optimizers=_optimizers(layout, optimizer))
    message = str(error.value)
    assert f"stack {stack!r}" in message and str(path) in message, message
    assert "on_slot_mismatch='reset'" in message, message
    if _signature(optimizer) == _signature(OPTIMIZERS[stored]):
      assert "table 'a'" in message, message
      assert repr(NAMES[stored]) in message and repr(NAMES[target]) in message, message
  restored = _restore(path, layout, optimizers=_optimizers(layout, RETUNED[stored]))
  model.check(layout, restored.tables, restored.slots)


def test_optimizers_whose_slots_look_alike_are_covered():
  """The pairs that only the record tells apart (the reason for it) exist as expected."""
  alike = {
      (a, b)
      for a, b in itertools.combinations(sorted(OPTIMIZERS), 2)
      if _signature(OPTIMIZERS[a]) == _signature(OPTIMIZERS[b])
  }
  assert alike == {
      ("adagrad", "custom_accumulator"),
      ("adam", "custom_moments"),
      ("adam", "custom_moments_2"),
      ("adam", "laprop"),
      ("custom_moments", "custom_moments_2"),
      ("custom_moments", "laprop"),
      ("custom_moments_2", "laprop"),
  }


def test_reset_starts_the_other_optimizer_from_its_initial_values(saved):
  """Adagrad's accumulator into a custom rule's accumulator (initial 0.3): reset, tables kept."""
  model, layout, path = saved["adagrad"]
  target = OPTIMIZERS["custom_accumulator"]
  restored = _restore(
      path, layout, optimizers=_optimizers(layout, target), on_slot_mismatch="reset"
  )
  model.check(layout, restored.tables)  # The tables bit for bit.
  (stack,) = layout.stack_names
  assert set(restored.slots[stack]) == {"accumulator"}
  accumulator = np.asarray(restored.slots[stack]["accumulator"])
  assert_same_bits(accumulator, np.full(accumulator.shape, 0.3, np.float32))


def test_restore_with_slot_specs_alone_is_not_checked(saved):
  """A caller that names no optimizer gets the old check, by slot names and widths."""
  model, layout, path = saved["adam"]
  restored = _restore(path, layout, slot_specs=model.slot_specs(layout))
  model.check(layout, restored.tables, restored.slots)


def test_checkpoints_without_the_record_restore_as_before(tmp_path):
  """Saved with slot_specs (as before the record existed): no record, restores anywhere alike."""
  model = _model(Adam(0.1))
  layout = model.layout([["a", "b"]], 8)
  _save(tmp_path / "ckpt", model, layout, optimizers=None, slot_specs=model.slot_specs(layout))
  assert _recorded(tmp_path / "ckpt") == {layout.stack_names[0]: None}
  assert "optimizer" not in (tmp_path / "ckpt" / "manifest.json").read_text()
  assert ck.CheckpointReader(tmp_path / "ckpt").optimizer_name("a") is None
  restored = _restore(tmp_path / "ckpt", layout, optimizers=_optimizers(layout, LaProp(0.1)))
  model.check(layout, restored.tables, restored.slots)
  with pytest.raises(ck.SlotMismatchError, match=r"'sgd' keeps slots \[\] .*'a' with slots"):
    _restore(tmp_path / "ckpt", layout, optimizers=_optimizers(layout, SGD(0.1)))
  info = ck.inspect(tmp_path / "ckpt")
  assert info["groups"][0]["optimizer"] is None
  assert "optimizer=" not in ck.format_description(info)


def test_a_legacy_manager_step_restores_into_either_moment_optimizer(tmp_path):
  """A step whose manifest predates the record (rewritten, its integrity re-adopted)."""
  model = _model(Adam(0.1))
  layout = model.layout([["a", "b"]], 2)
  tables, slots = model.state(layout)
  with ck.CheckpointManager(tmp_path) as mngr:
    mngr.save(5, ck.EmbeddingSave(tables, slots, layout, optimizers=model.optimizers(layout)))
  manifest = tmp_path / "5" / "embedding" / "manifest.json"
  data = json.loads(manifest.read_text())
  for group in data["groups"]:
    del group["optimizer"]
  manifest.write_text(json.dumps(data, indent=1, sort_keys=True))
  (tmp_path / "5" / "integrity.json").unlink()
  assert main(["verify", "--adopt", str(tmp_path / "5")]) == 0
  for optimizer in (Adam(0.1), LaProp(0.1)):
    with ck.CheckpointManager(tmp_path, read_only=True) as mngr:
      state = mngr.restore(None, ck.EmbeddingRestore(
          layout, make_mesh(2), AXIS, optimizers=_optimizers(layout, optimizer)))["embedding"]
    model.check(layout, state.tables, state.slots)


def test_args_that_contradict_themselves_are_refused(saved):
  model, layout, path = saved["adam"]
  (stack,) = layout.stack_names
  with pytest.raises(ValueError, match=r"optimizers names stacks \['nope'\]"):
    _restore(path, layout, optimizers={"nope": Adam()})
  with pytest.raises(ValueError, match=rf"slot_specs\['{stack}'\] declares .*keeps"):
    _restore(path, layout, optimizers={stack: Adam()}, slot_specs={stack: ACCUMULATOR})
  with pytest.raises(TypeError, match=rf"optimizers\['{stack}'\] must be a sparse optimizer"):
    _restore(path, layout, optimizers={stack: "adam"})
  tables, slots = model.state(layout)
  with pytest.raises(ValueError, match=r"EmbeddingSave: optimizers names stacks \['nope'\]"):
    ck.EmbeddingCheckpointHandler().save(
        path.parent / "other", ck.EmbeddingSave(tables, slots, layout, optimizers={"nope": Adam()})
    )
  # slot_specs equal to the optimizer's slots are accepted beside it.
  restored = _restore(path, layout, optimizers={stack: Adam()}, slot_specs={stack: MOMENTS})
  model.check(layout, restored.tables, restored.slots)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
  """Table 'a' trained with Adam and 'b' with LaProp, in separate stacks."""
  root = tmp_path_factory.mktemp("mixed")
  model = make_model([("a", 64, 12, Adam(0.1)), ("b", 120, 10, LaProp(0.1))], seed=3)
  layout = model.layout([["a"], ["b"]], 2)
  _save(root / "ckpt", model, layout)
  return model, layout, root / "ckpt"


def test_tables_of_two_optimizers_cannot_share_a_stack(mixed, tmp_path):
  model, layout, path = mixed
  together = ck.relayout(layout, groups=[["a", "b"]])  # As `convert --groups a,b` builds it.
  match = r"puts tables 'a' and 'b' together.*\('adam' vs 'laprop'\).*share one optimizer"
  with pytest.raises(ck.SlotMismatchError, match=match):
    _restore(path, together)  # The stored slots, whatever they are.
  with pytest.raises(ck.SlotMismatchError, match=match):
    _restore(path, together, slot_specs=model.slot_specs(together))
  with pytest.raises(ck.SlotMismatchError, match=r"optimizer is 'adam'.*table 'b'.*'laprop'"):
    _restore(path, together, optimizers=_optimizers(together, Adam(0.1)))
  with pytest.raises(ck.SlotMismatchError, match=match):
    ck.convert(path, tmp_path / "merged", together)
  assert main(["convert", str(path), str(tmp_path / "cli"), "--groups", "a,b"]) != 0
  assert not (tmp_path / "cli").exists() and not (tmp_path / "merged").exists()
  # Each table restores into its own optimizer in any other layout.
  apart = model.layout([["b"], ["a"]], 8, 2)
  restored = _restore(path, apart, optimizers=model.optimizers(apart))
  model.check(apart, restored.tables, restored.slots)


def test_conversion_keeps_the_record(mixed, tmp_path):
  """stacked -> other G, S -> unstacked -> stacked: recorded throughout, refused at the end."""
  model, layout, path = mixed
  other = model.layout([["b"], ["a"]], 8, 2)
  ck.convert(path, tmp_path / "other", other)
  assert _recorded(tmp_path / "other") == {
      other.stack_of_table("a").name: "adam", other.stack_of_table("b").name: "laprop"
  }
  ck.convert(tmp_path / "other", tmp_path / "unstacked", "unstacked")
  assert _recorded(tmp_path / "unstacked") == {"a": "adam", "b": "laprop"}
  ck.convert(tmp_path / "unstacked", tmp_path / "back", layout)
  assert _recorded(tmp_path / "back") == _recorded(path)
  for converted in ("other", "unstacked", "back"):
    with pytest.raises(ck.SlotMismatchError, match=r"target optimizer is 'laprop'.*'a'.*'adam'"):
      _restore(tmp_path / converted, layout, optimizers=_optimizers(layout, LaProp(0.1)))
  restored = _restore(tmp_path / "back", layout, optimizers=model.optimizers(layout))
  model.check(layout, restored.tables, restored.slots)


@pytest.fixture(scope="module")
def partly(tmp_path_factory):
  """Tables a, c recorded as Adam's, b, d unrecorded (saved with slot_specs alone), e LaProp's.

  Every table keeps 'mu' and 'nu': slot names and widths alone would let any two share a stack.
  """
  root = tmp_path_factory.mktemp("partly")
  model = make_model([("a", 64, 8, Adam(0.1)), ("b", 120, 8, Adam(0.1)), ("c", 40, 8, Adam(0.1)),
                      ("d", 72, 8, Adam(0.1)), ("e", 56, 8, LaProp(0.1))], seed=4)
  layout = model.layout([["a"], ["b"], ["c"], ["d"], ["e"]], 2)
  recorded = {name: opt for name, opt in model.optimizers(layout).items()
              if layout.stack(name).table_names[0] in ("a", "c", "e")}
  _save(root / "ckpt", model, layout, slot_specs=model.slot_specs(layout), optimizers=recorded)
  reader = ck.CheckpointReader(root / "ckpt")
  assert {t: reader.optimizer_name(t) for t in "abcde"} == {
      "a": "adam", "b": None, "c": "adam", "d": None, "e": "laprop"}
  return model, layout, root / "ckpt"


def test_conversion_never_merges_a_recorded_table_with_an_unrecorded_one(partly, tmp_path):
  """The merged stack would lose a's record, or claim b's slots for Adam unchecked: refused."""
  model, layout, path = partly
  together = ck.relayout(layout, groups=[["a", "b"], ["c"], ["d"], ["e"]])
  match = (r"stack '[^']+' puts tables 'a' and 'b' together, but the checkpoint .* records the"
           r" optimizer of the slots of table 'a' \('adam'\) and not that of table 'b'.*Stack them apart")
  with pytest.raises(ck.SlotMismatchError, match=match):
    ck.convert(path, tmp_path / "merged", together)
  ck.convert(path, tmp_path / "unstacked", "unstacked")
  with pytest.raises(ck.SlotMismatchError, match=match):
    ck.convert(tmp_path / "unstacked", tmp_path / "merged", together)
  assert main(["convert", str(path), str(tmp_path / "cli"), "--groups", "b,a;c;d;e"]) != 0
  assert not (tmp_path / "cli").exists() and not (tmp_path / "merged").exists()
  # Two recorded optimizers in one stack are refused by name, an unrecorded table beside them.
  with pytest.raises(ck.SlotMismatchError, match=r"'a' and 'e' together.*\('adam' vs 'laprop'\)"):
    ck.convert(path, tmp_path / "merged", ck.relayout(layout, groups=[["a", "b", "e"], ["c", "d"]]))
  # Tables that agree keep their record; unrecorded ones stay unrecorded.
  agreeing = ck.relayout(layout, groups=[["a", "c"], ["b", "d"], ["e"]])
  ck.convert(path, tmp_path / "agreeing", agreeing)
  assert _recorded(tmp_path / "agreeing") == {
      agreeing.stack_of_table("a").name: "adam", agreeing.stack_of_table("b").name: None,
      agreeing.stack_of_table("e").name: "laprop"}
  restored = _restore(tmp_path / "agreeing", agreeing, optimizers=model.optimizers(agreeing))
  model.check(agreeing, restored.tables, restored.slots)
  # The way the error points to: restore into the merged layout, naming the optimizer.
  restored = _restore(path, together, optimizers=model.optimizers(together))
  model.check(together, restored.tables, restored.slots)


def test_inspect_shows_the_optimizer(mixed, tmp_path, capsys):
  model, layout, path = mixed
  info = ck.inspect(path)
  by_stack = {group["name"]: group for group in info["groups"]}
  assert by_stack[layout.stack_of_table("a").name]["optimizer"] == "adam"
  assert by_stack[layout.stack_of_table("b").name]["tables"][0]["optimizer"] == "laprop"
  assert main(["inspect", str(path)]) == 0
  out = capsys.readouterr().out
  assert "optimizer=adam" in out and "optimizer=laprop" in out, out
  ck.convert(path, tmp_path / "unstacked", "unstacked")
  assert main(["inspect", str(tmp_path / "unstacked")]) == 0
  out = capsys.readouterr().out
  assert "table 'a'" in out and "optimizer=adam" in out, out


# ---------------------------------------------------------------------------
# Deltas and compaction.


def _chain(root, model, layout, steps, **save):
  """Saves steps 0..steps-1 with an incremental manager (0 full, then deltas)."""
  rng = np.random.default_rng(7)
  tracker = ck.UpdatedRows(layout)
  with ck.CheckpointManager(root, keep_latest=10, incremental=ck.IncrementalPolicy()) as mngr:
    for step in range(steps):
      if step:
        touch_rows(model, layout, tracker, rng, 0.1)
      tables, slots = model.state(layout)
      assert mngr.save(step, ck.EmbeddingSave(tables, slots, layout, **save),
                       updated_rows=tracker, force=True)
      mngr.wait_until_finished()


def _is_delta(root, step):
  return (root / str(step) / "embedding" / "parts").exists()


def test_deltas_and_compaction_keep_the_record(tmp_path):
  model = _model(Adam(0.1), seed=5)
  layout = model.layout([["a", "b"]], 2)
  root = tmp_path / "root"
  _chain(root, model, layout, 3, optimizers=model.optimizers(layout))
  assert _is_delta(root, 2)
  assert set(_recorded(root / "2" / "embedding").values()) == {"adam"}
  with ck.CheckpointManager(root, read_only=True) as mngr:
    with pytest.raises(ck.SlotMismatchError, match=r"'laprop'.*2/embedding.*'adam'"):
      mngr.restore(2, ck.EmbeddingRestore(layout, make_mesh(2), AXIS,
                                          optimizers=_optimizers(layout, LaProp(0.1))))
    state = mngr.restore(2, ck.EmbeddingRestore(
        layout, make_mesh(2), AXIS, optimizers=_optimizers(layout, Adam(0.5))))["embedding"]
  model.check(layout, state.tables, state.slots)
  assert compact(root / "2")
  assert not _is_delta(root, 2)
  assert set(_recorded(root / "2" / "embedding").values()) == {"adam"}
  with pytest.raises(ck.SlotMismatchError, match=r"'laprop'.*'adam'"):
    _restore(root / "2" / "embedding", layout, optimizers=_optimizers(layout, LaProp(0.1)))
  restored = _restore(root / "2" / "embedding", layout, optimizers=model.optimizers(layout))
  model.check(layout, restored.tables, restored.slots)


def test_a_chain_on_a_legacy_base_takes_the_record_of_its_deltas(tmp_path):
  """Base saved with slot_specs (no record), deltas with optimizers: the chain knows Adam."""
  model = _model(Adam(0.1), seed=6)
  layout = model.layout([["a", "b"]], 2)
  root = tmp_path / "root"
  rng = np.random.default_rng(8)
  tracker = ck.UpdatedRows(layout)
  with ck.CheckpointManager(root, keep_latest=10, incremental=ck.IncrementalPolicy()) as mngr:
    for step, save in enumerate([{"slot_specs": model.slot_specs(layout)},
                                 {"optimizers": model.optimizers(layout)}]):
      if step:
        touch_rows(model, layout, tracker, rng, 0.1)
      tables, slots = model.state(layout)
      mngr.save(step, ck.EmbeddingSave(tables, slots, layout, **save),
                updated_rows=tracker, force=True)
      mngr.wait_until_finished()
  assert _is_delta(root, 1)
  reader = ck.open_reader(root / "1" / "embedding")
  assert reader.optimizer_name("a") == "adam"
  with pytest.raises(ck.SlotMismatchError, match=r"'laprop'.*'adam'"):
    _restore(root / "1" / "embedding", layout, optimizers=_optimizers(layout, LaProp(0.1)))
  restored = _restore(root / "1" / "embedding", layout, optimizers=model.optimizers(layout))
  model.check(layout, restored.tables, restored.slots)
  assert "optimizer=adam" in ck.format_description(ck.inspect(root / "1"))


def test_a_delta_of_another_optimizer_is_refused(tmp_path):
  """A delta written on a chain of another optimizer (only by hand) does not read."""
  model = _model(Adam(0.1), seed=9)
  layout = model.layout([["a", "b"]], 2)
  root = tmp_path / "root"
  _chain(root, model, layout, 1, optimizers=model.optimizers(layout))
  tables, slots = model.state(layout)
  delta = ck.Delta({layout.stack_names[0]: np.array([0, 3])}, parent_step=0, base_step=0)
  with ocp.Checkpointer(ck.EmbeddingCheckpointHandler()) as ckptr:
    ckptr.save(root / "1" / "embedding", args=ck.EmbeddingSave(
        tables, slots, layout, optimizers=_optimizers(layout, LaProp(0.1)), delta=delta))
  with pytest.raises(ck.IncompatibleCheckpointError, match=r"optimizer 'laprop'.*optimizer 'adam'"):
    ck.open_reader(root / "1" / "embedding")


@pytest.mark.parametrize("optimizer", [LaProp(0.1), FTRL(0.1)], ids=["same_slots", "other_slots"])
def test_after_a_reset_the_next_save_starts_a_new_chain(tmp_path, optimizer):
  """A delta of reset slots on a chain of the old optimizer would not read back."""
  model = _model(Adam(0.1), seed=10)
  layout = model.layout([["a", "b"]], 2)
  root = tmp_path / "root"
  _chain(root, model, layout, 2, optimizers=model.optimizers(layout))
  assert _is_delta(root, 1)
  target = _optimizers(layout, optimizer)
  policy = ck.IncrementalPolicy()
  with ck.CheckpointManager(root, keep_latest=10, incremental=policy) as mngr:
    state = mngr.restore(None, ck.EmbeddingRestore(
        layout, make_mesh(2), AXIS, optimizers=target, on_slot_mismatch="reset"))["embedding"]
    model.check(layout, state.tables)
    tracker = ck.UpdatedRows(layout)
    tracker.add(layout.stack_names[0], np.array([0, 5]))
    embedding = ck.EmbeddingSave(state.tables, state.slots, layout, optimizers=target)
    with pytest.raises(ValueError, match=r"save_kind='delta'.*chain of step 1.*full"):
      mngr.save(2, embedding, updated_rows=tracker, force=True, save_kind="delta")
    assert mngr.save(2, embedding, updated_rows=tracker, force=True)
    mngr.wait_until_finished()
  assert not _is_delta(root, 2)
  assert set(_recorded(root / "2" / "embedding").values()) == {optimizer.kind}
  restored = _restore(root / "2" / "embedding", layout, optimizers=target)
  model.check(layout, restored.tables)
  for stack, slots in restored.slots.items():
    for name, array in slots.items():
      assert_same_bits(np.asarray(array), np.asarray(state.slots[stack][name]), err_msg=name)
  # The same optimizer retuned continues the chain.
  root = tmp_path / "retuned"
  _chain(root, model, layout, 1, optimizers=model.optimizers(layout))
  with ck.CheckpointManager(root, keep_latest=10, incremental=policy) as mngr:
    retuned = _optimizers(layout, Adam(0.01))
    state = mngr.restore(None, ck.EmbeddingRestore(layout, make_mesh(2), AXIS,
                                                   optimizers=retuned))["embedding"]
    tracker = ck.UpdatedRows(layout)
    tracker.add(layout.stack_names[0], np.array([1]))
    assert mngr.save(1, ck.EmbeddingSave(state.tables, state.slots, layout, optimizers=retuned),
                     updated_rows=tracker, force=True, save_kind="delta")
    mngr.wait_until_finished()
  assert _is_delta(root, 1)
