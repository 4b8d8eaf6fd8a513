"""A Trainer resuming a workdir whose newest steps fail their checksums when read.

Listing a step checks its manifests and file sizes, not its chunks' bytes: a
flipped byte shows only when the step is restored. The Trainer then resumes
the step before it, at that step's data position, and saves the damaged
step numbers again (the damaged steps are kept aside).
"""

from __future__ import annotations

import re
import shutil

import numpy as np
import optax
import pytest

import checkpoint as ck
from pipelining import Callback, Trainer
from sc_framework.optimizers import Adagrad
from test_data import Positioned
from test_resume import assert_same_run
from test_trainer import LinearHead, logical_tables, make_batches, make_specs, mesh_of, mse
from tests.numerics import assert_same_bits

pytestmark = [
    pytest.mark.filterwarnings("ignore:checkpoint step .* is skipped:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:.* was in the way of saving step:RuntimeWarning"),
]


def make_trainer(workdir, pipelining=False, incremental=None, save_every=1):
  return Trainer(LinearHead(), make_specs(Adagrad(0.3)), mse, optax.adam(0.05),
                 mesh=mesh_of(1), pipelining=pipelining, progress="off", padding_id=-1,
                 workdir=workdir, save_every=save_every if workdir else None, keep=10,
                 incremental=incremental)


def flip_a_byte(step_dir):
  """Flips one byte in the middle of the step's first embedding chunk; its size stays."""
  chunk = next(path for path in sorted((step_dir / "embedding").rglob("*"))
               if path.is_file() and "/c/" in str(path))
  data = bytearray(chunk.read_bytes())
  data[len(data) // 2] ^= 0x5A
  chunk.write_bytes(bytes(data))
  return chunk


def reference_run(batches, pipelining=False):
  reference = make_trainer(None, pipelining)
  reference.fit(batches)
  return reference


@pytest.mark.parametrize("pipelining", [True, False])
def test_a_newest_step_renamed_by_hand_falls_back_as_the_manager_does(tmp_path, pipelining):
  """Step 5 renamed 7: the manager's restore skipped it, fit raised CorruptCheckpointError
  (its data position was read outside the fall back)."""
  batches = make_batches(8, seed=130 + pipelining)
  make_trainer(tmp_path, pipelining).fit(batches, num_steps=5)
  root = tmp_path / "checkpoints"
  (root / "5").rename(root / "7")
  resumed = make_trainer(tmp_path, pipelining)
  with pytest.warns(RuntimeWarning, match=rf"(?s){re.escape(str(root / '7'))} is skipped: .*is"
                                          r" the integrity"
                                          " manifest of step 5, but its directory is step 7"):
    history = resumed.fit(batches)
  assert history.resumed_from == 4 and history.final_step == 8
  assert_same_run(resumed, reference_run(batches, pipelining))
  # The renamed step was kept aside, unchanged, when step 7 was saved again.
  assert sorted(p.name for p in root.iterdir() if p.name.startswith("7")) == [
      "7", "7.incomplete-0"]
  assert not [p for p in ck.verify(root) if p.severity == "error"]


@pytest.mark.parametrize("pipelining", [True, False])
def test_a_newest_step_failing_its_checksum_falls_back_and_trains_on(tmp_path, pipelining):
  """fit raised CorruptCheckpointError on every start: the step's files listed sound."""
  batches = make_batches(8, seed=120 + pipelining)
  make_trainer(tmp_path, pipelining).fit(batches, num_steps=5)
  root = tmp_path / "checkpoints"
  chunk = flip_a_byte(root / "5")
  resumed = make_trainer(tmp_path, pipelining)
  assert resumed.latest_checkpoint_step() == 5  # Its damage shows only when read.
  with pytest.warns(RuntimeWarning, match=rf"{re.escape(str(root / '5'))} is skipped: a restore"
                                          r" found it"
                                          rf" damaged.*{re.escape(str(chunk))}"):
    history = resumed.fit(batches)
  # Resumed at step 4's data position: batch 5 is trained, not skipped.
  assert history.resumed_from == 4 and history.final_step == 8
  assert_same_run(resumed, reference_run(batches, pipelining))
  assert (root / "5.incomplete-0" / "integrity.json").exists()  # kept aside, unchanged
  assert not [p for p in ck.verify(root) if p.severity == "error"]
  again = make_trainer(tmp_path, pipelining)
  assert again.latest_checkpoint_step() == 8
  assert again.fit(batches).final_step == 8


def test_a_trainer_holding_its_own_state_continues_as_if_the_damaged_step_were_not_there(
    tmp_path):
  """Another Trainer saved step 7, damaged: the fall back reopened the data at its
  beginning (no checkpoint newer than the state was left), training batches 0-7 again."""
  batches = make_batches(8, seed=133)
  trainer = make_trainer(tmp_path)
  trainer.fit(batches, num_steps=4)
  make_trainer(tmp_path, save_every=None).fit(batches, num_steps=7)
  flip_a_byte(tmp_path / "checkpoints" / "7")
  history = trainer.fit(batches)
  assert history.resumed_from is None and history.final_step == 8
  assert_same_run(trainer, reference_run(batches))


class TablesAtEachStep(Callback):
  def __init__(self):
    self.tables = {}

  def on_step_end(self, trainer, step, metrics):
    self.tables[step] = {name: np.asarray(t) for name, t in logical_tables(trainer).items()}


def block_batches(count, seed):
  """Batch i reads rows of block i % 8 only (5 of table a's 40, 3 of b's 24): a delta that
  misses a batch's rows shows, where random batches touch most rows every step."""
  rng = np.random.default_rng(seed)
  batches = []
  for i in range(count):
    block = i % 8
    batches.append({
        "sparse": {"fa": 5 * block + rng.integers(0, 5, (8, 3)),
                   "fb": 3 * block + rng.integers(0, 3, (8, 2)),
                   "fa2": 5 * block + rng.integers(0, 5, (8, 1))},
        "dense": rng.normal(size=(8, 3)).astype(np.float32),
        "labels": rng.normal(size=8).astype(np.float32),
    })
  return batches


def test_the_batches_of_dropped_streams_do_not_push_unapplied_ones_out_of_the_deltas(tmp_path):
  """Each stream opened at a damaged step's position prepared batches that were then
  dropped; recorded as the latest batches, they pushed out the carried batch still to
  apply, whose rows the delta after the next save then lacked."""
  batches = block_batches(10, seed=135)
  policy = ck.IncrementalPolicy(max_delta_share=1.0)
  seen = TablesAtEachStep()
  trainer = make_trainer(tmp_path, True, policy)
  trainer.fit(batches, num_steps=4, callbacks=[seen])
  make_trainer(tmp_path, True, policy).fit(list(batches), num_steps=6)
  for step in (5, 6):
    flip_a_byte(tmp_path / "checkpoints" / str(step))
  history = trainer.fit(batches, callbacks=[seen])
  assert history.resumed_from is None and history.final_step == 10
  for step in range(5, 11):
    restored = ck.EmbeddingCheckpointHandler().restore(
        tmp_path / "checkpoints" / str(step) / "embedding", ck.TableRestore())
    for name, table in seen.tables[step].items():
      assert_same_bits(restored.tables[name], table)
  assert_same_run(trainer, reference_run(batches, pipelining=True))


def test_a_fit_after_evaluate_falls_back_when_the_adopted_step_is_found_damaged(tmp_path):
  """evaluate took step 6's train state; its chunk then failed when fit restored the
  whole step: fit trained batches 0-7 on step 6's tables, ending at step 16."""
  batches = make_batches(10, seed=136)
  make_trainer(tmp_path).fit(batches, num_steps=6)
  trainer = make_trainer(tmp_path)
  trainer.predict([{k: v for k, v in b.items() if k != "labels"} for b in batches[:1]])
  assert int(trainer.state.step) == 6
  flip_a_byte(tmp_path / "checkpoints" / "6")
  history = trainer.fit(batches)
  assert history.resumed_from == 5 and history.final_step == 10
  assert_same_run(trainer, reference_run(batches))


def test_an_iterator_with_set_state_goes_back_to_the_older_steps_position(tmp_path):
  batches = make_batches(7, seed=126)
  make_trainer(tmp_path).fit(Positioned(batches), num_steps=5)
  flip_a_byte(tmp_path / "checkpoints" / "5")
  resumed = make_trainer(tmp_path)
  history = resumed.fit(Positioned(batches))
  assert history.resumed_from == 4 and history.final_step == 7
  assert_same_run(resumed, reference_run(batches))


@pytest.mark.parametrize("one_shot", [False, True])
def test_a_workdir_whose_only_step_is_damaged_is_refused_not_started_over(tmp_path, one_shot):
  """Step 5, the only step, fails its checksum: fit started the run over from step 0
  (an iterator was told to start again), so a lost run looked like a fresh one."""
  batches = make_batches(7, seed=127)
  data = (lambda: Positioned(batches)) if one_shot else (lambda: batches)
  make_trainer(tmp_path, save_every=5).fit(data(), num_steps=5)
  root = tmp_path / "checkpoints"
  flip_a_byte(root / "5")
  resumed = make_trainer(tmp_path, save_every=5)
  for _ in range(2):  # The same again: nothing was trained, saved or moved.
    with pytest.raises(ck.CorruptCheckpointError,
                       match=rf"(?s){re.escape(str(root))} holds checkpoint steps, but none of"
                             r" them restores"
                             r" \(step 5: a restore found it damaged.*checksum.*does not start"
                             rf" over.*move them out of {re.escape(str(root))}"):
      resumed.fit(data())
    assert sorted(p.name for p in root.iterdir()) == ["5"] and resumed.state is None
  (root / "5").rename(tmp_path / "damaged-5")  # What the message says.
  history = resumed.fit(data())
  assert history.resumed_from is None and history.final_step == 7
  assert_same_run(resumed, reference_run(batches))


def test_every_step_damaged_or_incomplete_is_refused_by_fit_evaluate_and_predict(tmp_path):
  """Steps 2 and 4 both damaged (a chunk and the integrity manifest): fit trained from
  step 0, with warnings that an older complete step was used, and evaluate and predict
  used untrained tables."""
  batches = make_batches(6, seed=131)
  make_trainer(tmp_path, save_every=2).fit(batches, num_steps=4)
  root = tmp_path / "checkpoints"
  flip_a_byte(root / "4")
  (root / "2" / "integrity.json").write_text("")
  trainer = make_trainer(tmp_path, save_every=2)
  message = (r"(?s)none of them restores \(step 4: a restore found it damaged.*; step 2: .*"
             r"integrity.json.*\)\. A Trainer does not start over")
  for call in (trainer.evaluate, trainer.predict, trainer.fit):
    with pytest.raises(ck.CorruptCheckpointError, match=message):
      call(batches)
  assert sorted(p.name for p in root.iterdir()) == ["2", "4"] and trainer.state is None


def test_a_trainer_with_initial_state_is_refused_too_but_not_beside_numbered_folders(tmp_path):
  """After initialize() (the initial state, at step 0) the refusal did not fire: fit
  trained from step 0 and predict used untrained tables. Numbered directories holding no
  checkpoint (empty, or a folder of the user's) are no lost run: they were refused."""
  batches = make_batches(4, seed=132)
  make_trainer(tmp_path, save_every=2).fit(batches, num_steps=2)
  root = tmp_path / "checkpoints"
  flip_a_byte(root / "2")
  trainer = make_trainer(tmp_path, save_every=2)
  trainer.initialize(batches[0])
  for call in (trainer.predict, trainer.fit):
    with pytest.raises(ck.CorruptCheckpointError, match=r"none of them restores \(step 2: "):
      call(batches)
  assert int(trainer.state.step) == 0
  (root / "2").rename(tmp_path / "damaged-2")
  (root / "3").mkdir()
  (root / "2024").mkdir()
  (root / "2024" / "notes.txt").write_text("mine")
  with pytest.warns(RuntimeWarning, match="2024 is skipped: .*has no integrity.json"):
    history = make_trainer(tmp_path, save_every=2).fit(batches)
  assert history.resumed_from is None and history.final_step == 4


def test_a_state_predict_adopted_from_the_only_step_found_damaged_since_is_refused(tmp_path):
  """predict adopted step 6's train state; fit then met the damage, found no older step and
  trained batches 0-9 on top of step 6's tables (final step 16, batches 0-5 twice)."""
  batches = make_batches(10, seed=136)
  make_trainer(tmp_path, save_every=1000).fit(batches, num_steps=6)
  trainer = make_trainer(tmp_path, save_every=1000)
  trainer.predict(batches[:1])
  assert int(trainer.state.step) == 6
  root = tmp_path / "checkpoints"
  flip_a_byte(root / "6")
  with pytest.raises(ck.CorruptCheckpointError, match=r"none of them restores \(step 6: "):
    trainer.fit(batches)
  assert sorted(p.name for p in root.iterdir()) == ["6"] and int(trainer.state.step) == 6


def test_evaluate_of_a_new_trainer_uses_the_newest_step_that_restores(tmp_path):
  """predict adopts the newest checkpoint through the same path as evaluate."""
  batches, held_out = make_batches(6, seed=128), make_batches(2, seed=129)
  held_out = [{**b, "labels": (b["labels"] > 0).astype(np.float32)} for b in held_out]
  trained = make_trainer(tmp_path)
  trained.fit(batches, num_steps=4)
  expected = trained.evaluate(held_out)["loss"]
  make_trainer(tmp_path).fit(batches, num_steps=5)
  flip_a_byte(tmp_path / "checkpoints" / "5")
  second = make_trainer(tmp_path)
  assert_same_bits(np.asarray(second.evaluate(held_out)["loss"]), np.asarray(expected))
  assert int(second.state.step) == 4
  history = second.fit(batches)
  assert history.resumed_from == 4 and history.final_step == 6
  assert_same_run(second, reference_run(batches))


def test_a_damaged_delta_falls_back_past_every_step_whose_chain_reads_it(tmp_path):
  """Steps 4 and 5 are deltas on step 3, whose chunk fails its checksum: each fails to
  restore in turn, and the run resumes from 2, saving 3, 4 and 5 again."""
  batches = make_batches(7, seed=130)
  policy = ck.IncrementalPolicy(max_delta_share=1.0)
  make_trainer(tmp_path, incremental=policy).fit(batches, num_steps=5)
  root = tmp_path / "checkpoints"
  chain = ck.inspect(root / "5")["embedding"]["chain"]
  assert [link["step"] for link in chain] == [1, 2, 3, 4, 5]
  assert chain[2]["kind"] == "delta"
  flip_a_byte(root / "3")
  resumed = make_trainer(tmp_path, incremental=policy)
  history = resumed.fit(batches)
  assert history.resumed_from == 2 and history.final_step == 7
  reference = reference_run(batches)
  assert_same_run(resumed, reference)
  for step in (3, 4, 5):
    assert (root / f"{step}.incomplete-0").exists()
  assert not [p for p in ck.verify(root) if p.severity == "error"]


def test_a_storage_that_refuses_a_read_fails_the_fit_and_leaves_the_step(tmp_path, monkeypatch):
  """A refused or timed-out read counted as damage: fit fell back to step 4 and moved
  step 5 aside when it saved step 5 again."""
  from checkpoint import _storage

  batches = make_batches(8, seed=127)
  make_trainer(tmp_path).fit(batches, num_steps=5)

  class Unavailable:
    def result(self):
      raise ValueError("UNAVAILABLE: Error reading the store: connection reset")

  resumed = make_trainer(tmp_path)
  with monkeypatch.context() as patch:
    patch.setattr(_storage, "open_for_read", lambda path: Unavailable())
    with pytest.raises(ck.CheckpointReadError, match="UNAVAILABLE"):
      resumed.fit(batches)
  root = tmp_path / "checkpoints"
  assert not list(root.glob("*.incomplete-*")) and resumed.latest_checkpoint_step() == 5
  history = resumed.fit(batches)  # the storage answers again: resumes step 5
  assert history.resumed_from == 5 and history.final_step == 8
  assert_same_run(resumed, reference_run(batches))


def test_a_refused_read_of_a_chain_links_manifest_fails_the_fit_and_leaves_the_steps(
    tmp_path, monkeypatch):
  """Reading a delta chain's link read any error as a broken chain: fit resumed step 2
  and moved steps 3-5 aside when it saved them again."""
  from etils import epath

  batches = make_batches(7, seed=131)
  policy = ck.IncrementalPolicy(max_delta_share=1.0)
  make_trainer(tmp_path, incremental=policy).fit(batches, num_steps=5)
  root = tmp_path / "checkpoints"
  refused = str(root / "3" / "embedding" / "manifest.json")
  path_type = type(epath.Path(refused))
  real_read_text = path_type.read_text

  def read_text(path, *args, **kwargs):
    if str(path) == refused:
      raise TimeoutError("the read timed out")
    return real_read_text(path, *args, **kwargs)

  resumed = make_trainer(tmp_path, incremental=policy)
  with monkeypatch.context() as patch:
    patch.setattr(path_type, "read_text", read_text)
    with pytest.raises(ck.CheckpointReadError, match=f"{re.escape(str(refused))}.*TimeoutError"):
      resumed.fit(batches)
  assert not list(root.glob("*.incomplete-*")) and resumed.latest_checkpoint_step() == 5
  history = resumed.fit(batches)
  assert history.resumed_from == 5 and history.final_step == 7
  assert_same_run(resumed, reference_run(batches))


def test_a_meta_item_of_another_step_adopted_into_a_step_is_refused_naming_both(tmp_path):
  """A step copied together by hand (no manifest, then adopted) from two steps' items:
  the meta item's data position is another step's, and resuming trained on wrongly."""
  from checkpoint.cli import main  # pylint: disable=g-import-not-at-top

  batches = make_batches(6, seed=140)
  make_trainer(tmp_path).fit(batches, num_steps=4)
  root = tmp_path / "checkpoints"
  shutil.rmtree(root / "4" / "meta")
  shutil.copytree(root / "3" / "meta", root / "4" / "meta")
  (root / "4" / "integrity.json").unlink()
  assert main(["verify", "--adopt", str(root / "4")]) == 0  # each item is sound alone
  with pytest.raises(ck.IncompatibleCheckpointError, match=re.escape(
      f"{root / '4'} holds the state after 3 updates, not 4: the step folder was renamed or"
      " copied by hand (its meta item says 3)")):
    make_trainer(tmp_path).fit(batches)


def test_a_workdir_of_the_users_own_checkpoints_is_refused_saying_so(tmp_path):
  """A step a user's CheckpointManager saved (embedding and dense items, no 'meta') failed
  with "holds no item 'meta' ... Restore without 'meta'", which a Trainer user cannot do."""
  import orbax.checkpoint as ocp
  trained = make_trainer(None)
  trained.fit(make_batches(2, seed=60))
  embeddings, plan = trained.state.embeddings, trained.plan
  with ck.CheckpointManager(tmp_path / "checkpoints") as manager:
    manager.save(2, ck.EmbeddingSave(embeddings.tables, embeddings.slots, plan.layout,
                                     optimizers=plan.optimizers()),
                 items={"dense": ocp.args.StandardSave({"params": trained.state.params})})
  with pytest.raises(ck.IncompatibleCheckpointError, match=re.escape(
      f"{tmp_path / 'checkpoints' / '2'} is not a Trainer checkpoint: it has no 'meta' item"
      " (checkpoint step 2")) as raised:
    make_trainer(tmp_path).fit(make_batches(2, seed=61))
  assert "A Trainer resumes the checkpoints a Trainer wrote" in str(raised.value)
