"""A Trainer resuming a workdir whose newest steps fail their checksums when read.

Listing a step checks its manifests and file sizes, not its chunks' bytes: a
flipped byte shows only when the step is restored. The Trainer then resumes
the step before it, at that step's data position, and saves the damaged
step numbers again (the damaged steps are kept aside).
"""

from __future__ import annotations

import numpy as np
import optax
import pytest

import checkpoint as ck
from pipelining import Trainer
from sc_framework.optimizers import Adagrad
from test_data import Positioned
from test_resume import assert_same_run
from test_trainer import LinearHead, make_batches, make_specs, mesh_of, mse
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
def test_a_newest_step_failing_its_checksum_falls_back_and_trains_on(tmp_path, pipelining):
  """fit raised CorruptCheckpointError on every start: the step's files listed sound."""
  batches = make_batches(8, seed=120 + pipelining)
  make_trainer(tmp_path, pipelining).fit(batches, num_steps=5)
  root = tmp_path / "checkpoints"
  chunk = flip_a_byte(root / "5")
  resumed = make_trainer(tmp_path, pipelining)
  assert resumed.latest_checkpoint_step() == 5  # Its damage shows only when read.
  with pytest.warns(RuntimeWarning, match=rf"{root / '5'} is skipped: a restore found it"
                                          rf" damaged.*{chunk}"):
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


def test_an_iterator_with_set_state_goes_back_to_the_older_steps_position(tmp_path):
  batches = make_batches(7, seed=126)
  make_trainer(tmp_path).fit(Positioned(batches), num_steps=5)
  flip_a_byte(tmp_path / "checkpoints" / "5")
  resumed = make_trainer(tmp_path)
  history = resumed.fit(Positioned(batches))
  assert history.resumed_from == 4 and history.final_step == 7
  assert_same_run(resumed, reference_run(batches))


def test_a_one_shot_iterator_that_cannot_go_back_is_told_to_start_again(tmp_path):
  """Step 5, the only step, is damaged: the run starts over, but the iterator was set to
  step 5's position already, and a one-shot iterator has no state to go back to."""
  batches = make_batches(7, seed=127)
  make_trainer(tmp_path, save_every=5).fit(Positioned(batches), num_steps=5)
  flip_a_byte(tmp_path / "checkpoints" / "5")
  resumed = make_trainer(tmp_path, save_every=5)
  with pytest.raises(ck.CorruptCheckpointError,
                     match=r"(?s)step 5 is damaged, so fit continues from the beginning.*"
                           r"one-shot iterator.*an iterator of the data that starts there"
                           r".*Why step 5 is damaged.*checksum"):
    resumed.fit(Positioned(batches))
  history = resumed.fit(Positioned(batches))
  assert history.resumed_from is None and history.final_step == 7
  assert_same_run(resumed, reference_run(batches))


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
