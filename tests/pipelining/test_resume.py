"""Checkpointed training: exact resume after a kill, SIGTERM, mismatched specs."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import optax
import pytest

import jax
from checkpoint import CheckpointError, SlotMismatchError
from pipelining import Callback, Trainer
from sc_framework.optimizers import SGD, Adagrad, Adam, LaProp
from test_trainer import LinearHead, logical_tables, make_batches, make_specs, mesh_of, mse
from tests.numerics import assert_same_bits

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def make_trainer(workdir, pipelining, specs=None):
  return Trainer(LinearHead(), specs or make_specs(Adagrad(0.3)), mse, optax.adam(0.05),
                 mesh=mesh_of(1), pipelining=pipelining, progress="off", padding_id=-1,
                 workdir=workdir, save_every=1 if workdir else None)


def assert_same_run(a: Trainer, b: Trainer):
  assert int(a.state.step) == int(b.state.step)
  for name, table in logical_tables(a).items():
    assert_same_bits(logical_tables(b)[name], table)
  jax.tree.map(assert_same_bits, jax.device_get(a.state.params), jax.device_get(b.state.params))
  jax.tree.map(assert_same_bits, jax.device_get(a.state.embeddings.slots),
               jax.device_get(b.state.embeddings.slots))


class AtStep(Callback):
  """Runs `action(trainer)` when step `step` ends."""

  def __init__(self, step, action):
    self.step, self.action = step, action

  def on_step_end(self, trainer, step, metrics):
    if step == self.step:
      self.action(trainer)


def term_at(step):
  return AtStep(step, lambda trainer: os.kill(os.getpid(), signal.SIGTERM))


def stop_at(step):
  return AtStep(step, lambda trainer: trainer.request_stop())


def raise_at(step):
  def action(trainer):
    raise RuntimeError(f"raised by a callback at step {step}")

  return AtStep(step, action)


@pytest.mark.parametrize("pipelining", [True, False])
def test_resume_after_kill_is_bit_exact(tmp_path, pipelining):
  seed = 50 + pipelining
  kill_step = int(np.random.default_rng(seed).integers(2, 8))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
  worker = subprocess.run(
      [sys.executable, os.path.join(HERE, "resume_worker.py"), str(tmp_path),
       "1" if pipelining else "0", str(kill_step), str(seed)],
      env=env, capture_output=True, text=True, timeout=300,
  )
  assert worker.returncode == -signal.SIGKILL, worker.stderr[-3000:]
  resumed = make_trainer(tmp_path, pipelining)
  history = resumed.fit(make_batches(9, seed))
  assert history.resumed_from is not None and 1 <= history.resumed_from <= kill_step
  reference = make_trainer(None, pipelining)
  reference.fit(make_batches(9, seed))
  assert_same_run(resumed, reference)


@pytest.mark.parametrize("pipelining", [True, False])
def test_sigterm_saves_and_next_fit_resumes(tmp_path, pipelining):
  batches = make_batches(7, seed=60)
  first = make_trainer(tmp_path, pipelining)
  history = first.fit(batches, callbacks=[term_at(3)])
  assert history.interrupted and history.final_step == 3
  assert first.latest_checkpoint_step() == 3
  second = make_trainer(tmp_path, pipelining)  # a new process would do the same
  history = second.fit(batches)
  assert history.resumed_from == 3 and history.final_step == 7
  reference = make_trainer(None, pipelining)
  reference.fit(batches)
  assert_same_run(second, reference)


def test_checkpoint_with_other_vocabulary_names_the_table(tmp_path):
  batches = make_batches(2, seed=70)
  make_trainer(tmp_path, False).fit(batches)
  specs = make_specs(Adagrad(0.3))
  bigger = specs[1].table.__class__(**{**specs[1].table.__dict__, "vocabulary_size": 32})
  specs = [specs[0], specs[1].__class__("fb", bigger, specs[1].input_shape), specs[2]]
  with pytest.raises(CheckpointError, match="'b'"):
    make_trainer(tmp_path, False, specs).fit(batches)


def test_a_checkpoint_of_another_optimizer_gets_advice_the_trainer_can_follow(tmp_path):
  """The slot mismatch names both slot sets and no restore option the Trainer lacks."""
  batches = make_batches(2, seed=71)
  make_trainer(tmp_path, False).fit(batches)
  with pytest.raises(SlotMismatchError, match=r"\('accumulator'.*other workdir") as error:
    make_trainer(tmp_path, False, make_specs(SGD(0.3))).fit(batches)
  assert "on_slot_mismatch" not in str(error.value), str(error.value)


def test_a_checkpoint_of_adam_does_not_resume_into_laprop(tmp_path):
  """Adam and LaProp keep slots of the same names and widths ('mu', 'nu'); the checkpoint
  records which optimizer wrote them, so the resume is refused rather than continued on
  moments that mean something else."""
  batches = make_batches(2, seed=72)
  make_trainer(tmp_path, False, make_specs(Adam(0.1))).fit(batches)
  with pytest.raises(SlotMismatchError) as error:
    make_trainer(tmp_path, False, make_specs(LaProp(0.1))).fit(batches)
  message = str(error.value)
  for part in ("target optimizer is 'laprop'", "table 'a'", "optimizer 'adam'",
               str(tmp_path / "checkpoints" / "2"), "other workdir"):
    assert part in message, message
  assert "on_slot_mismatch" not in message, message


@pytest.mark.parametrize("dense_optimizer, difference", [
    (optax.sgd(0.1), r"it stores 9 arrays the restore does not ask for \(opt_state/0/count;"),
    # adamw's state differs from adam's in an empty node only: Orbax's own check sees it.
    (optax.adamw(0.05), r"a tree of another structure than the restore asks for"),
])
def test_a_checkpoint_of_another_dense_optimizer_is_refused_naming_what_differs(
    tmp_path, dense_optimizer, difference):
  """It failed inside Orbax, advising `partial_restore`, an option the Trainer lacks."""
  batches = make_batches(2, seed=75)
  make_trainer(tmp_path, False).fit(batches)
  other = Trainer(LinearHead(), make_specs(Adagrad(0.3)), mse, dense_optimizer,
                  mesh=mesh_of(1), progress="off", padding_id=-1, workdir=tmp_path,
                  save_every=1)
  step_dir = re.escape(str(tmp_path / "checkpoints" / "2"))
  with pytest.raises(CheckpointError, match=rf"(?s)checkpoint.*{step_dir}"
                                            rf".*{difference}.*another optax optimizer"
                     ) as error:
    other.fit(batches)
  assert "partial_restore" not in str(error.value)


def test_the_same_optimizer_retuned_resumes_the_state_as_it_is(tmp_path):
  """Another learning rate and beta1 (fine-tuning): the slots resume bit for bit."""
  first = make_trainer(tmp_path, False, make_specs(Adam(0.1)))
  first.fit(make_batches(3, seed=73))
  retuned = make_trainer(tmp_path, False, make_specs(Adam(0.02, beta1=0.8)))
  history = retuned.fit(make_batches(3, seed=73), num_steps=3)
  assert history.resumed_from == 3 and not history.steps
  assert_same_run(retuned, first)
  history = make_trainer(tmp_path, False, make_specs(Adam(0.02, beta1=0.8))).fit(
      make_batches(5, seed=73))
  assert history.resumed_from == 3 and history.final_step == 5


def test_num_steps_is_exact_with_a_batch_in_flight(tmp_path):
  """An interrupted pipelined fit continued with num_steps = step + 1 applies one
  update and keeps the next batch in flight, in its checkpoint too."""
  batches = make_batches(7, seed=80)
  trainer = make_trainer(tmp_path, True)
  history = trainer.fit(batches, callbacks=[stop_at(3)])
  assert history.interrupted and trainer._loop.in_flight is not None
  history = trainer.fit(batches, num_steps=4)
  assert history.final_step == 4 and int(trainer.state.step) == 4
  # Batch 4 was looked up before update 4, as in a run that goes on: it is in
  # flight, and the checkpoint of step 4 counts it as consumed.
  assert trainer._loop.in_flight is not None
  assert trainer._checkpoints.read_meta(4)["data"]["batches_consumed"] == 5
  resumed = make_trainer(tmp_path, True)
  assert resumed.fit(batches).resumed_from == 4
  reference = make_trainer(None, True)
  reference.fit(batches)
  assert_same_run(resumed, reference)


@pytest.mark.parametrize("num_steps", [1, 3, 6])
@pytest.mark.parametrize("pipelining", [True, False])
def test_a_fit_that_reached_num_steps_resumes_like_one_run(tmp_path, pipelining, num_steps):
  """fit(num_steps=k), then a new Trainer's fit: the same as one fit to the end.

  Only the final checkpoint is written (no save_every), so the pipelined run's
  final checkpoint must hold the lookup of batch k from the tables before
  update k, as an uninterrupted run computes it; a drained pipeline would
  look batch k up after update k.
  """
  batches = make_batches(8, seed=82)

  def trainer(workdir):
    return Trainer(LinearHead(), make_specs(Adagrad(0.3)), mse, optax.adam(0.05),
                   mesh=mesh_of(1), pipelining=pipelining, progress="off", padding_id=-1,
                   workdir=workdir)

  first = trainer(tmp_path)
  assert first.fit(batches, num_steps=num_steps).final_step == num_steps
  assert first.latest_checkpoint_step() == num_steps
  second = trainer(tmp_path)
  history = second.fit(batches)
  assert history.resumed_from == num_steps and history.final_step == 8
  reference = trainer(None)
  reference.fit(batches)
  assert_same_run(second, reference)


@pytest.mark.parametrize("more_steps", [1, 3])
def test_a_checkpoint_whose_batch_in_flight_is_the_datas_last_resumes_to_the_datas_end(
    tmp_path, more_steps):
  """fit(num_steps=3) on 4 batches, pipelined: step 3's checkpoint holds batch 3 in flight
  at the data's end. A new Trainer's fit(num_steps=3 + more_steps) started the data over
  (batch 0 looked up before update 4), where the run drains batch 3 and ends at step 4,
  as one fit, or the same Trainer's next fit, does; its dropped ids counted batch 0 too."""
  batches = make_batches(4, seed=84)
  first = make_trainer(tmp_path / "run", True)
  stopped = first.fit(batches, num_steps=3)
  assert first.latest_checkpoint_step() == 3
  assert first._checkpoints.read_meta(3)["has_in_flight"]
  resumed = make_trainer(tmp_path / "run", True)
  history = resumed.fit(batches, num_steps=3 + more_steps)
  assert history.resumed_from == 3 and history.final_step == 4
  meta = resumed._checkpoints.read_meta(4)
  assert not meta["has_in_flight"] and meta["data"]["batches_consumed"] == 4
  reference = make_trainer(tmp_path / "reference", True)
  whole = reference.fit(batches)
  assert_same_run(resumed, reference)
  assert stopped.dropped_ids + history.dropped_ids == whole.dropped_ids
  # Both go on alike: the next fit starts the data over, from a drained pipeline.
  resumed.fit(batches, num_steps=6)
  reference.fit(batches, num_steps=6)
  assert_same_run(resumed, reference)


def test_num_steps_below_the_resumed_step_warns_that_nothing_is_trained(tmp_path, caplog):
  batches = make_batches(4, seed=83)
  make_trainer(tmp_path, False).fit(batches)
  with caplog.at_level("WARNING", logger="pipelining"):
    history = make_trainer(tmp_path, False).fit(batches, num_steps=2)
  assert history.resumed_from == 4 and history.final_step == 4 and not history.steps
  assert "fit(num_steps=2) trains nothing: the state is already at step 4" in caplog.text



@pytest.mark.parametrize("pipelining", [True, False])
def test_data_that_ends_before_num_steps_is_said_to(pipelining, capsys):
  """fit(3 batches, num_steps=10) ended at step 3 without a word."""
  batches = make_batches(3, seed=84)
  trainer = Trainer(LinearHead(), make_specs(Adagrad(0.3)), mse, optax.adam(0.05),
                    mesh=mesh_of(1), pipelining=pipelining, progress="log", padding_id=-1)
  assert trainer.fit(batches, num_steps=10).final_step == 3
  lines = capsys.readouterr().err.splitlines()
  assert lines[0].startswith("fit: at step 0 to step 10;"), lines
  assert lines[-1] == "fit: the data ended at step 3, before num_steps=10", lines
  assert trainer.fit(batches, num_steps=5).final_step == 5  # the data starts over
  assert "the data ended" not in capsys.readouterr().err


@pytest.mark.parametrize("pipelining", [True, False])
@pytest.mark.parametrize("one_shot", [True, False])
def test_fits_in_chunks_on_one_trainer_equal_one_fit(pipelining, one_shot):
  """fit(data, num_steps=k) again and again on the same data continues its stream.

  The batches the stopped fit prefetched (and, pipelined, the one in flight)
  are applied next, so no batch of a one-shot iterator is lost and a list is
  not restarted: the chunks equal one fit, bit for bit.
  """
  batches = make_batches(11, seed=84)
  held_out = make_batches(2, seed=85)
  data = iter(batches) if one_shot else batches
  chunked = Trainer(LinearHead(), make_specs(Adagrad(0.3)), mse, optax.adam(0.05),
                    mesh=mesh_of(1), pipelining=pipelining, progress="off", padding_id=-1,
                    eval_metrics=())
  # With evaluations (their data ends every time), a chunk that trains
  # nothing (3 again) and one that stops with the data's last batch in flight.
  finals = [chunked.fit(data, num_steps=total, eval_data=held_out).final_step
            for total in (3, 3, 4, 10)]
  history = chunked.fit(data, epochs=1)  # the same single pass as epochs=None
  assert finals == [3, 3, 4, 10] and history.final_step == 11
  assert len(history.steps) == 1
  reference = make_trainer(None, pipelining)
  reference.fit(batches)
  assert_same_run(chunked, reference)


@pytest.mark.parametrize("pipelining", [True, False])
@pytest.mark.parametrize("one_shot", [True, False])
def test_a_fit_after_a_stop_request_continues_without_losing_a_batch(pipelining, one_shot):
  batches = make_batches(9, seed=86)
  data = iter(batches) if one_shot else batches
  stopped = make_trainer(None, pipelining)
  assert stopped.fit(data, callbacks=[stop_at(4)]).final_step == 4
  assert stopped.fit(data).final_step == 9
  reference = make_trainer(None, pipelining)
  reference.fit(batches)
  assert_same_run(stopped, reference)


@pytest.mark.parametrize("pipelining", [True, False])
def test_a_chunk_that_trains_nothing_keeps_its_first_batch_after_other_data(pipelining):
  """The first batch of new data is not applied by fit(num_steps=current): the next fit is."""
  first_data, other = make_batches(5, seed=87), make_batches(6, seed=88)
  chunked, reference = make_trainer(None, pipelining), make_trainer(None, pipelining)
  chunked.fit(first_data, num_steps=5)
  reference.fit(first_data, num_steps=5)
  chunked.fit(other, num_steps=5)  # trains nothing
  chunked.fit(other, num_steps=8)
  reference.fit(other, num_steps=8)
  assert_same_run(chunked, reference)


@pytest.mark.parametrize("pipelining", [True, False])
def test_a_chunk_that_ends_with_the_data_ends_its_stream_in_both_modes(pipelining):
  """After fit(data, num_steps=len(data)), the next fit on the same list starts
  a new pass, as after fit(data): the data ended, though num_steps stopped it."""
  batches = make_batches(5, seed=89)
  chunked, reference = make_trainer(None, pipelining), make_trainer(None, pipelining)
  assert chunked.fit(batches, num_steps=5).final_step == 5
  history = chunked.fit(batches)
  assert history.final_step == 10 and len(history.steps) == 5
  reference.fit(batches)
  reference.fit(batches)
  assert_same_run(chunked, reference)
  one_shot = make_trainer(None, pipelining)
  data = iter(batches)
  assert one_shot.fit(data, num_steps=5).final_step == 5
  assert one_shot.fit(data).final_step == 5  # nothing left to train on


@pytest.mark.parametrize("pipelining", [True, False])
@pytest.mark.parametrize("one_shot", [True, False])
def test_a_stop_requested_while_fit_waits_for_a_batch_leaves_that_batch_untaken(
    pipelining, one_shot):
  """A stop request (Ctrl-C) while fit waits for a slow iterator takes effect when
  the batch arrives: it is not applied (nor looked up), and the next fit starts with it."""
  batches = make_batches(7, seed=90)
  # The loop waits for batch 3 after update 3 (synchronous) or before it
  # (pipelined: update 3 runs beside batch 3's lookup).
  waiting_after = 2 if pipelining else 3
  loop_waits = threading.Event()

  def slow_data():
    for index, batch in enumerate(batches):
      if index == 3:
        loop_waits.wait(timeout=30)
        time.sleep(0.3)  # the loop is now inside its wait for this batch
        trainer.request_stop()
      yield batch

  trainer = make_trainer(None, pipelining)
  data = slow_data() if one_shot else _Replayed(slow_data)
  history = trainer.fit(data, callbacks=[AtStep(waiting_after, lambda _: loop_waits.set())])
  assert history.interrupted and history.final_step == waiting_after
  assert trainer.stop_requested  # until the next fit starts
  assert trainer.fit(data).final_step == 7
  assert not trainer.stop_requested
  reference = make_trainer(None, pipelining)
  reference.fit(batches)
  assert_same_run(trainer, reference)


class _Replayed:
  """A re-iterable whose every pass is `make()`."""

  def __init__(self, make):
    self._make = make

  def __iter__(self):
    return self._make()


@pytest.mark.parametrize("manifest", ["records its step", "from before steps were recorded"])
def test_a_step_folder_renamed_by_hand_is_never_read_as_another_step(tmp_path, manifest):
  """Its integrity manifest names its real step: the step is damaged, skipped with a warning
  naming the step, as the manager's restore skips it, and fit resumes the step before it.
  A manifest from before steps were recorded leaves only the Trainer's meta item to tell:
  then the step is refused, naming its real step."""
  batches = make_batches(4, seed=91)
  make_trainer(tmp_path, False).fit(batches)
  step_dir = tmp_path / "checkpoints" / "4"
  if manifest == "records its step":
    step_dir.rename(tmp_path / "checkpoints" / "9")
    with pytest.warns(RuntimeWarning, match=(
        r"9/integrity.json: is the integrity manifest of step 4, but its directory is"
        r" step 9: its files are step 4's save .* Put it back as step 4")):
      history = make_trainer(tmp_path, False).fit(batches)
    assert history.resumed_from == 3 and history.final_step == 4
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["3", "4", "9"]  # 9 left as it is
    return
  integrity = json.loads((step_dir / "integrity.json").read_text())
  del integrity["step"], integrity["step_digest"]
  (step_dir / "integrity.json").write_text(json.dumps(integrity))
  step_dir.rename(tmp_path / "checkpoints" / "9")
  with pytest.raises(CheckpointError, match=r"holds the state after 4 updates, not 9: the step"
                                            r" folder was renamed or copied by hand.* rename it"
                                            r" back to 4"):
    make_trainer(tmp_path, False).fit(batches)
  # Refused: neither resumed from step 3 nor saved anything beside the renamed step.
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "3", "9"]


def draining_reference(batches, updates: int) -> Trainer:
  """The uninterrupted pipelined run whose last update is its drain.

  A synchronous fit applies a pipelined checkpoint's batch in flight with the
  drain program; the reference does too (its data end there), so both run the
  same programs and end with the same bits. (`fit(num_steps=...)` on more data
  would apply that batch in an overlapped step, another program.)
  """
  reference = make_trainer(None, True)
  assert reference.fit(batches[:updates]).final_step == updates
  return reference


class _StopAtStart(Callback):
  def on_fit_start(self, trainer, step):
    trainer.request_stop()


def test_a_synchronous_fit_asked_to_stop_at_its_start_leaves_the_batch_in_flight(tmp_path):
  """As a pipelined fit does: the in-flight batch of a pipelined checkpoint is not
  applied by a synchronous fit stopped before its first step; the next fit applies it."""
  batches = make_batches(7, seed=92)
  assert make_trainer(tmp_path, True).fit(batches, callbacks=[stop_at(3)]).interrupted
  synchronous = make_trainer(tmp_path, False)
  history = synchronous.fit(batches, callbacks=[_StopAtStart()])
  assert history.interrupted and history.final_step == 3 and not history.steps
  assert synchronous._loop.in_flight is not None
  assert synchronous.fit(batches, num_steps=4).final_step == 4
  assert_same_run(synchronous, draining_reference(batches, 4))


@pytest.mark.parametrize("num_steps", [3, 4, 5])
def test_a_synchronous_fit_resuming_a_pipelined_checkpoint_stops_at_num_steps(tmp_path, num_steps):
  """The in-flight batch of a pipelined checkpoint counts toward num_steps."""
  batches = make_batches(7, seed=81)
  pipelined = make_trainer(tmp_path, True)
  assert pipelined.fit(batches, callbacks=[stop_at(3)]).interrupted
  synchronous = make_trainer(tmp_path, False)
  history = synchronous.fit(batches, num_steps=num_steps)
  assert history.resumed_from == 3
  assert history.final_step == num_steps and int(synchronous.state.step) == num_steps
  if num_steps == 4:
    assert_same_run(synchronous, draining_reference(batches, 4))


@pytest.mark.parametrize("pipelining", [True, False])
def test_an_exception_in_fit_lets_the_running_save_finish(tmp_path, pipelining, monkeypatch):
  import asyncio

  from checkpoint import _save

  write = _save.write

  async def slow_write(*args, **kwargs):  # each save stays in progress for a while
    await asyncio.sleep(0.5)
    return await write(*args, **kwargs)

  monkeypatch.setattr(_save, "write", slow_write)
  batches = make_batches(6, seed=82)
  trainer = make_trainer(tmp_path, pipelining)
  with pytest.raises(RuntimeError, match="raised by a callback at step 3"):
    trainer.fit(batches, callbacks=[raise_at(3)])
  # Step 3, due when the callback raised, was saved asynchronously; fit waited for it.
  assert not trainer._checkpoints._manager.orbax_manager.is_saving_in_progress()
  assert trainer.latest_checkpoint_step() == 3


class RaiseInEvaluation(Callback):
  def on_eval_end(self, trainer, step, metrics):
    raise RuntimeError(f"raised by a callback after the evaluation of step {step}")


@pytest.mark.parametrize("callback, message", [
    (raise_at(4), "raised by a callback at step 4"),
    (RaiseInEvaluation(), "raised by a callback after the evaluation of step 2"),
])
@pytest.mark.parametrize("pipelining", [True, False])
def test_a_raising_callback_keeps_the_checkpoint_due_at_its_step(tmp_path, pipelining, callback,
                                                                  message):
  batches = make_batches(6, seed=83)
  trainer = Trainer(LinearHead(), make_specs(Adagrad(0.3)), mse, optax.adam(0.05),
                    mesh=mesh_of(1), pipelining=pipelining, progress="off", padding_id=-1,
                    workdir=tmp_path, save_every=2, eval_metrics=())
  with pytest.raises(RuntimeError, match=message):
    trainer.fit(batches, eval_data=batches[:1], eval_every=2, callbacks=[callback])
  step = int(trainer.state.step)
  assert trainer.latest_checkpoint_step() == step
  resumed = make_trainer(tmp_path, pipelining)
  assert resumed.fit(batches).resumed_from == step
  reference = make_trainer(None, pipelining)
  reference.fit(batches)
  assert_same_run(resumed, reference)


@pytest.mark.parametrize("use", ["evaluate", "predict"])
@pytest.mark.parametrize("pipelining", [True, False])
def test_a_new_trainer_evaluates_the_trained_workdir_and_fit_still_resumes(tmp_path, pipelining,
                                                                           use):
  """evaluate / predict of a new Trainer use the latest checkpoint, not the initial values;
  a fit afterwards resumes that checkpoint with its in-flight batch and data position."""
  batches, held_out = make_batches(7, seed=84), make_batches(2, seed=85)
  first = make_trainer(tmp_path, pipelining)
  first.fit(batches, num_steps=4)

  def run(trainer):
    if use == "evaluate":
      return trainer.evaluate([{**b, "labels": (b["labels"] > 0).astype(np.float32)}
                               for b in held_out])["loss"]
    return trainer.predict([{k: v for k, v in b.items() if k != "labels"} for b in held_out])

  expected = run(first)
  second = make_trainer(tmp_path, pipelining)
  assert_same_bits(run(second), expected)
  assert int(second.state.step) == 4
  history = second.fit(batches)
  assert history.resumed_from == 4 and history.final_step == 7
  reference = make_trainer(None, pipelining)
  reference.fit(batches)
  assert_same_run(second, reference)


@pytest.mark.parametrize("use", ["fit", "evaluate"])
def test_a_resumed_trainer_restores_without_initialising_the_tables(tmp_path, monkeypatch, use):
  """The checkpoint restores into the state's shapes: the initial tables a restore would
  replace are never computed, and the run goes on as one run."""
  batches = make_batches(7, seed=86)
  make_trainer(tmp_path, True).fit(batches, num_steps=4)

  def refuse(*args, **kwargs):
    raise AssertionError("the tables were initialised although a checkpoint is restored")

  monkeypatch.setattr("pipelining._trainer.init_embedding_variables", refuse)
  resumed = make_trainer(tmp_path, True)
  if use == "evaluate":
    resumed.evaluate([{**b, "labels": (b["labels"] > 0).astype(np.float32)}
                      for b in batches[:2]])
    assert int(resumed.state.step) == 4
  assert resumed.fit(batches).resumed_from == 4
  monkeypatch.undo()
  reference = make_trainer(None, True)
  reference.fit(batches)
  assert_same_run(resumed, reference)


def _with_bad_labels(batch):
  return {**batch, "labels": batch["labels"][:3]}  # 3 labels for 8 samples


def test_a_synchronous_fit_at_num_steps_does_not_fail_on_a_batch_it_does_not_train(tmp_path):
  """The look past num_steps only asks whether the data ended: an error in the next batch
  belongs to the fit that trains on it (as in one fit: after the same updates)."""
  batches = make_batches(6, seed=92)
  data = batches[:4] + [_with_bad_labels(batches[4])] + batches[5:]
  trainer = make_trainer(tmp_path, False)
  history = trainer.fit(data, num_steps=4)
  assert history.final_step == 4 and trainer.latest_checkpoint_step() == 4
  with pytest.raises(ValueError, match="batch 4 of the training data: labels"):
    trainer.fit(data)
  assert int(trainer.state.step) == 4
  one_fit = make_trainer(None, False)
  with pytest.raises(ValueError, match="batch 4 of the training data: labels"):
    one_fit.fit(data)
  assert_same_run(trainer, one_fit)


@pytest.mark.parametrize("pipelining", [True, False])
@pytest.mark.parametrize("one_shot", [True, False])
def test_a_fit_after_a_raising_callback_continues_the_data_where_it_stood(pipelining, one_shot):
  """The state kept after the exception is that of the batches taken so far (pipelined: one
  of them in flight): the next fit on the data continues after them, as after a stop."""
  batches = make_batches(9, seed=93)
  data = iter(batches) if one_shot else batches
  trainer = make_trainer(None, pipelining)
  with pytest.raises(RuntimeError, match="raised by a callback at step 3"):
    trainer.fit(data, callbacks=[raise_at(3)])
  assert trainer.fit(data).final_step == 9
  reference = make_trainer(None, pipelining)
  reference.fit(batches)
  assert_same_run(trainer, reference)


@pytest.mark.parametrize("pipelining", [True, False])
@pytest.mark.parametrize("stop", ["request_stop", "raising_callback"])
def test_other_data_after_a_stopped_fit_starts_from_its_beginning(pipelining, stop):
  """Early stopping on one dataset, then a fit on another (fine-tuning): the other data's
  first batches are trained, as after a fit stopped at num_steps."""
  first_data, other = make_batches(8, seed=95), make_batches(5, seed=96)
  stopped, reference = make_trainer(None, pipelining), make_trainer(None, pipelining)
  if stop == "request_stop":
    assert stopped.fit(first_data, callbacks=[stop_at(3)]).final_step == 3
  else:
    with pytest.raises(RuntimeError, match="raised by a callback at step 3"):
      stopped.fit(first_data, callbacks=[raise_at(3)])
  reference.fit(first_data, num_steps=3)
  history = stopped.fit(other)
  assert len(history.steps) == 5 + pipelining  # pipelined: first_data's batch in flight too
  reference.fit(other)
  assert_same_run(stopped, reference)


@pytest.mark.parametrize("pipelining", [True, False])
def test_a_batch_fixed_after_its_error_is_applied_in_its_place(tmp_path, pipelining):
  """A bad batch of a list raises; fixed in place, the next fit applies it and goes on, as
  a new Trainer resuming the workdir does."""
  batches = make_batches(8, seed=94)
  data = list(batches)
  data[5] = _with_bad_labels(batches[5])
  trainer = make_trainer(tmp_path / "run", pipelining)
  with pytest.raises(ValueError, match="batch 5 of the training data: labels"):
    trainer.fit(data)
  step = int(trainer.state.step)
  shutil.copytree(tmp_path / "run", tmp_path / "copy")
  data[5] = batches[5]
  history = trainer.fit(data)
  assert history.resumed_from is None and history.final_step == 8
  resumed = make_trainer(tmp_path / "copy", pipelining)
  assert resumed.fit(data).resumed_from == step
  reference = make_trainer(None, pipelining)
  reference.fit(batches)
  assert_same_run(trainer, reference)
  assert_same_run(resumed, reference)


@pytest.mark.parametrize("pipelining", [True, False])
def test_a_raising_final_evaluation_keeps_the_final_checkpoint(tmp_path, pipelining):
  """As at a step of save_every: the evaluation that raises does not cost the save due."""
  batches = make_batches(5, seed=95)

  def trainer(workdir):
    return Trainer(LinearHead(), make_specs(Adagrad(0.3)), mse, optax.adam(0.05),
                   mesh=mesh_of(1), pipelining=pipelining, progress="off", padding_id=-1,
                   workdir=workdir, eval_metrics=())

  with pytest.raises(RuntimeError, match="after the evaluation of step 5"):
    trainer(tmp_path).fit(batches, eval_data=batches[:1], callbacks=[RaiseInEvaluation()])
  resumed = trainer(tmp_path)
  history = resumed.fit(batches)
  assert history.resumed_from == 5 and not history.steps
  reference = trainer(None)
  reference.fit(batches)
  assert_same_run(resumed, reference)


@pytest.mark.parametrize("pipelining", [True, False])
@pytest.mark.parametrize("num_steps", [None, 5])
def test_a_new_trainer_asked_for_more_steps_after_the_end_of_the_data_starts_it_over(
    tmp_path, pipelining, num_steps, caplog):
  """fit(data) ran through the data (or stopped at its last batch): the same
  Trainer's next fit starts the data over; a new Trainer resuming that final
  checkpoint with num_steps=7 found nothing left, trained nothing and said
  nothing. Restarted as it was (num_steps None), the run is complete: it
  trains nothing, and says so."""
  batches = make_batches(5, seed=91)
  same = make_trainer(None, pipelining)
  same.fit(batches, num_steps=num_steps)
  same.fit(batches, num_steps=7)
  make_trainer(tmp_path, pipelining).fit(batches, num_steps=num_steps)
  saved = sorted(os.listdir(tmp_path / "checkpoints"))
  restarted = make_trainer(tmp_path, pipelining)
  with caplog.at_level("INFO", logger="pipelining"):
    history = restarted.fit(batches)
  assert history.steps == [] and int(restarted.state.step) == 5
  assert "the run it continues is complete and nothing is left to train" in caplog.text
  assert sorted(os.listdir(tmp_path / "checkpoints")) == saved
  resumed = make_trainer(tmp_path, pipelining)
  history = resumed.fit(batches, num_steps=7)
  assert history.resumed_from == 5 and history.steps == [6, 7]
  assert_same_run(resumed, same)


def test_a_trainer_sees_the_newer_checkpoint_another_trainer_saved(tmp_path):
  """Its manager's step list was the one it opened with: it retrained from its
  own older state and moved the other's complete step aside as incomplete."""
  batches = make_batches(8, seed=92)
  first = make_trainer(tmp_path, False)
  first.fit(batches, num_steps=3)
  second = make_trainer(tmp_path, False)
  assert second.fit(batches).final_step == 8
  assert first.latest_checkpoint_step() == 8
  history = first.fit(batches, num_steps=10)
  assert history.resumed_from == 8 and history.steps == [9, 10]
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["10", "8", "9"]  # retention: 3 newest
  reference = make_trainer(None, False)
  reference.fit(batches)
  reference.fit(batches, num_steps=10)
  assert_same_run(first, reference)


def test_a_fit_after_a_stop_resumes_a_newer_checkpoint_at_its_data_position(tmp_path):
  """Another Trainer saved step 8 after this one stopped at 4: the fit restored step 8 but
  started the data where this Trainer had stopped, training batches 4-9 on step 8. (The
  data position is chosen before either mode's loop: the pipelined one, with a batch in
  flight in both checkpoints, covers it.)"""
  pipelining = True
  batches = make_batches(10, seed=134)
  stopped = make_trainer(tmp_path, pipelining)
  stopped.fit(batches, callbacks=[stop_at(4)])
  make_trainer(tmp_path, pipelining).fit(batches, num_steps=8)
  history = stopped.fit(batches)
  assert history.resumed_from == 8 and history.final_step == 10
  reference = make_trainer(None, pipelining)
  reference.fit(batches)
  assert_same_run(stopped, reference)


class _Saves(Callback):
  def __init__(self):
    self.steps = []

  def on_save(self, trainer, step):
    self.steps.append(step)


@pytest.mark.parametrize("pipelining", [True, False])
def test_on_save_runs_once_per_checkpoint(tmp_path, pipelining):
  """The final save of step 4 after save_every's save of step 4 starts nothing:
  on_save ran for it a second time."""
  saves = _Saves()
  trainer = Trainer(LinearHead(), make_specs(Adagrad(0.3)), mse, optax.adam(0.05),
                    mesh=mesh_of(1), pipelining=pipelining, progress="off", padding_id=-1,
                    workdir=tmp_path, save_every=2)
  trainer.fit(make_batches(4, seed=93), callbacks=[saves])
  assert saves.steps == [2, 4]
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "4"]


def test_fit_after_evaluate_restores_a_newer_checkpoint_at_the_end_of_the_data(tmp_path):
  """evaluate had built the steps: with no batch left, fit returned without
  restoring the newer checkpoint another Trainer saved, and kept step 4."""
  batches, held_out = make_batches(8, seed=96), make_batches(2, seed=97)
  first = make_trainer(tmp_path, False)
  first.fit(batches, num_steps=4)
  second = Trainer(LinearHead(), make_specs(Adagrad(0.3)), mse, optax.adam(0.05),
                   mesh=mesh_of(1), pipelining=False, progress="off", padding_id=-1,
                   workdir=tmp_path, save_every=1, eval_metrics=())
  second.evaluate(held_out)  # adopts step 4's train state
  first.fit(batches)  # saves step 8, the end of the data
  history = second.fit(batches)
  assert history.resumed_from == 8 and history.steps == [] and int(second.state.step) == 8
  assert_same_run(second, first)


@pytest.mark.parametrize("pipelining", [True, False])
@pytest.mark.parametrize("one_shot", [False, True])
def test_a_fit_that_fails_before_training_keeps_where_a_stopped_fit_left_the_data(
    pipelining, one_shot):
  """After a stop at step 4, a fit on other data whose first batch is bad raises before it
  trained anything: the next fit on the stopped fit's data continues where that fit left
  it (a one-shot iterator loses none of the batches that fit had taken)."""
  batches = make_batches(9, seed=91)
  data = iter(batches) if one_shot else batches
  stopped = make_trainer(None, pipelining)
  assert stopped.fit(data, callbacks=[stop_at(4)]).final_step == 4
  broken = [[batch] if k == 0 else batch for k, batch in enumerate(make_batches(3, seed=97))]
  with pytest.raises(TypeError, match="batch 0 of the training data"):
    stopped.fit(broken)  # not a dict
  assert int(stopped.state.step) == 4
  assert stopped.fit(data).final_step == 9
  reference = make_trainer(None, pipelining)
  reference.fit(batches)
  assert_same_run(stopped, reference)


@pytest.mark.parametrize("pipelining", [True, False])
def test_a_one_shot_iterator_whose_first_batch_was_bad_is_refused_not_started_after_it(
    pipelining):
  """A fresh Trainer's first fit raised on the generator's first batch (its prefetch took
  more): a fit given the generator again would silently start after the batches taken."""
  batches = make_batches(6, seed=98)

  def generator():
    yield [batches[0]]  # not a dict
    yield from batches[1:]

  trainer, data = make_trainer(None, pipelining), generator()
  with pytest.raises(TypeError, match="batch 0 of the training data"):
    trainer.fit(data)
  with pytest.raises(ValueError, match="one-shot iterator that an earlier fit of this Trainer"
                                       " took batches from and then raised before it trained"):
    trainer.fit(data)
  assert trainer.fit(iter(batches)).final_step == 6  # a new iterator starts anew
  reference = make_trainer(None, pipelining)
  reference.fit(batches)
  assert_same_run(trainer, reference)


@pytest.mark.parametrize("pipelining", [True, False])
@pytest.mark.parametrize("kind", ["list", "set_state", "one_shot"])
def test_a_chunk_whose_next_batch_is_bad_is_continued_once_it_is_fixed(pipelining, kind):
  """fit(data, num_steps=4), then a fit whose first batch (taken from the carried
  stream) is bad, then a fit on the data fixed in place: the last fit started the data
  over (a list: batches 0-3 trained twice) or lost the batches taken (an iterator)."""
  from test_data import Positioned

  batches = make_batches(9, seed=92)
  items = list(batches)
  bad = 5 if pipelining else 4  # the first batch the second fit takes
  items[bad] = [batches[bad]]  # not a dict
  data = {"list": items, "set_state": Positioned(items), "one_shot": iter(items)}[kind]
  chunked = make_trainer(None, pipelining)
  assert chunked.fit(data, num_steps=4).final_step == 4
  with pytest.raises(TypeError, match=f"batch {bad} of the training data"):
    chunked.fit(data)
  items[bad] = batches[bad]  # fixed in place
  if kind == "one_shot":  # it cannot go back to the batch it handed out
    with pytest.raises(ValueError, match="cannot resume the data at batch"):
      chunked.fit(data)
    return
  assert chunked.fit(data).final_step == 9
  reference = make_trainer(None, pipelining)
  reference.fit(batches)
  assert_same_run(chunked, reference)


@pytest.mark.parametrize("pipelining", [True, False])
def test_fits_after_a_stop_at_the_last_batch_start_the_data_over(pipelining):
  """A synchronous fit stopped at the last batch has not seen the end of its data: the
  next fit meets it (nothing to fit), and every later fit trained nothing. (Pipelined,
  the stopped fit took the next batch for its lookup and met the end.)"""
  batches = make_batches(6, seed=93)
  stopped, reference = make_trainer(None, pipelining), make_trainer(None, pipelining)
  assert stopped.fit(batches, callbacks=[stop_at(6)]).final_step == 6
  assert stopped.fit(batches).final_step == (12 if pipelining else 6)
  passes = 3 if pipelining else 2
  assert stopped.fit(batches).final_step == 6 * passes
  for _ in range(passes):
    reference.fit(batches)
  assert_same_run(stopped, reference)


@pytest.mark.parametrize("padding_id", [{"fa": -1, "fb": 7}, {"fa": -1}])
def test_a_padding_id_per_feature_saves_its_batch_in_flight_and_resumes_bit_exact(
    tmp_path, padding_id):
  # fb's padding 7 is a real row for other features: its entries are skipped, not looked up.
  def trainer(workdir):
    return Trainer(LinearHead(), make_specs(Adagrad(0.3)), mse, optax.adam(0.05),
                   mesh=mesh_of(1), pipelining=True, progress="off", padding_id=padding_id,
                   workdir=workdir)

  batches = make_batches(6, seed=70)
  for batch in batches:
    batch["sparse"]["fa2"] = np.abs(batch["sparse"]["fa2"])
  stopped = trainer(tmp_path)
  assert stopped.fit(batches, num_steps=3).final_step == 3
  assert stopped.latest_checkpoint_step() == 3  # It saved the batch in flight.
  resumed = trainer(tmp_path)
  assert resumed.fit(batches).resumed_from == 3
  reference = trainer(None)
  reference.fit(batches)
  assert_same_run(resumed, reference)


def test_a_padding_id_that_is_no_id_is_refused_when_the_trainer_is_built():
  for padding_id, match in [(-1.0, r"must be an int id .*got -1.0 \(float\)"),
                            ("x", r"got 'x' \(str\)"), (True, r"got True \(bool\)"),
                            ({"fa": 1.5}, r"feature names to an int id .*\{'fa': 1.5\}")]:
    with pytest.raises(TypeError, match=match):
      Trainer(LinearHead(), make_specs(SGD(0.1)), mse, optax.sgd(0.1), padding_id=padding_id)
  with pytest.raises(ValueError, match=r"padding_id names features \['fz'\].*features are"):
    Trainer(LinearHead(), make_specs(SGD(0.1)), mse, optax.sgd(0.1), padding_id={"fz": -1})


def test_a_padding_id_of_numpy_integers_is_an_int():
  trainer = Trainer(LinearHead(), make_specs(SGD(0.1)), mse, optax.sgd(0.1),
                    padding_id={"fa": np.array(-1), "fb": np.int64(7), "fa2": None})
  assert trainer.config.padding_id == {"fa": -1, "fb": 7, "fa2": None}
  assert type(trainer.config.padding_id["fa"]) is int


@pytest.mark.parametrize("pipelining", [False, True])
def test_resuming_without_a_table_of_the_checkpoint_is_refused_naming_it(tmp_path, pipelining):
  """A Trainer without table 'c' resumed and trained on: its saves lacked 'c', whose trained
  rows were gone once the older steps were removed (an added table was refused, a removed
  one silently dropped)."""
  from sc_framework import FeatureSpec, TableSpec
  from checkpoint import CheckpointManager, IncompatibleCheckpointError, TableRestore
  specs = make_specs(SGD(0.3))
  table_c = TableSpec("c", 16, 4, optimizer=SGD(0.3))
  batches = make_batches(3, seed=4)
  with_c = [dict(b, sparse=dict(b["sparse"], fc=b["sparse"]["fb"] % 16)) for b in batches]
  make_trainer(tmp_path, pipelining, specs + [FeatureSpec("fc", table_c, (8, 2))]).fit(with_c)
  trainer = make_trainer(tmp_path, pipelining, specs)
  with pytest.raises(IncompatibleCheckpointError,
                     match=r"step 3 .* holds the tables \['c'\], which the Trainer's feature"
                           r" specs do not use.*replace_tables"):
    trainer.fit(batches)
  assert np.isfinite(trainer.predict(batches[:1])).all()  # reading the checkpoint is fine
  with CheckpointManager(tmp_path / "checkpoints", read_only=True) as manager:
    assert manager.all_steps() == [1, 2, 3]
    assert sorted(manager.restore(3, TableRestore())["embedding"].tables) == ["a", "b", "c"]


def test_an_in_flight_batch_of_another_batch_size_is_refused_and_the_advice_works(tmp_path):
  """A resume with a larger batch failed deep in Orbax's shape check, naming the
  activations' shapes; the refusal names the two batch sizes and what to do, and
  what it says to do (resume once with pipelining off) lets the batch change."""
  import dataclasses
  from checkpoint import IncompatibleCheckpointError
  specs = make_specs(SGD(0.3))
  batches = make_batches(6, seed=7)
  make_trainer(tmp_path, True, specs).fit(batches, num_steps=3)  # batch 4 in flight
  tables = {f.table.name: dataclasses.replace(f.table, max_ids_per_partition=128,
                                              max_unique_ids_per_partition=128) for f in specs}
  doubled = [dataclasses.replace(f, table=tables[f.table.name], output_shape=None,
                                input_shape=(2 * f.input_shape[0], *f.input_shape[1:]))
             for f in specs]
  larger = [{"sparse": {k: np.concatenate([v, v]) for k, v in b["sparse"].items()},
             "dense": np.concatenate([b["dense"], b["dense"]]),
             "labels": np.concatenate([b["labels"], b["labels"]])} for b in batches]
  with pytest.raises(IncompatibleCheckpointError,
                     match=r"step 3 .* in-flight batch of other shapes than the Trainer's \(8"
                           r" samples then, 16 now \(feature 'fa'\)\): .* Resume with the batch"
                           r" size"):
    make_trainer(tmp_path, True, doubled).fit(larger)
  history = make_trainer(tmp_path, False, specs).fit(batches, num_steps=4)
  assert history.resumed_from == 3 and history.final_step == 4
  history = make_trainer(tmp_path, True, doubled).fit(larger, num_steps=5)
  assert history.resumed_from == 4 and history.final_step == 5


def test_an_in_flight_batch_looked_up_with_another_combiner_is_refused(tmp_path):
  """Its activations (summed) were applied by the first resumed step, whose update then
  followed the new combiner (mean): one step mixed the two silently."""
  import dataclasses
  from checkpoint import IncompatibleCheckpointError
  specs = make_specs(SGD(0.3))
  batches = make_batches(5, seed=6)
  make_trainer(tmp_path, True, specs).fit(batches, num_steps=3)  # batch 4 in flight
  averaged = [dataclasses.replace(f, table=dataclasses.replace(f.table, combiner="mean"))
              for f in specs]
  with pytest.raises(IncompatibleCheckpointError,
                     match=r"step 3 .* in-flight batch whose activations were looked up otherwise"
                           r" \(feature 'fa': \{'table': 'a', 'combiner': 'sum'\} then,"
                           r" \{'table': 'a', 'combiner': 'mean'\} now"):
    make_trainer(tmp_path, True, averaged).fit(batches)
  history = make_trainer(tmp_path, True, specs).fit(batches)  # the same specs resume
  assert history.resumed_from == 3 and history.final_step == 5


def test_a_metrics_file_the_storage_refuses_warns_once_and_training_and_checkpoints_go_on(
    tmp_path):
  """A full or read-only disk under metrics.jsonl stopped fit before the checkpoint due at
  that step (the last steps' training was lost), and its OSError, raised again when fit
  recorded its end, hid the error that had stopped fit."""
  (tmp_path / "metrics.jsonl").mkdir()  # every append is refused (IsADirectoryError)
  batches = make_batches(4, seed=8)
  trainer = make_trainer(tmp_path, True)
  with pytest.warns(RuntimeWarning, match=r"metrics.jsonl: a record could not be appended") \
      as caught:
    history = trainer.fit(batches)
  assert history.final_step == 4 and len(history.metrics) == 4
  assert sum("metrics.jsonl" in str(w.message) for w in caught) == 1
  assert trainer.latest_checkpoint_step() == 4
  reference = make_trainer(None, True)
  reference.fit(batches)
  assert_same_run(trainer, reference)


@pytest.mark.parametrize("pipelining", [True, False])
def test_a_table_whose_spec_changed_shape_is_named_not_a_dense_kernel(tmp_path, pipelining):
  """embedding_dim 4 -> 5 (the same padded width) was refused naming the dense layer's
  kernel, params/Dense_0/kernel of another shape, not the table."""
  import dataclasses
  from checkpoint import IncompatibleCheckpointError
  specs = make_specs(SGD(0.3))
  batches = make_batches(4, seed=8)
  make_trainer(tmp_path, pipelining, specs).fit(batches, num_steps=2)
  wider = dataclasses.replace(specs[1].table, embedding_dim=5)
  changed = [dataclasses.replace(f, table=wider, output_shape=None) if f.table.name == "b"
             else f for f in specs]
  with pytest.raises(IncompatibleCheckpointError,
                     match=r"step 2 .* table 'b' is stored with vocabulary_size=24,"
                           r" embedding_dim=4 but its TableSpec now has 24, 5\."):
    make_trainer(tmp_path, pipelining, changed).fit(batches)


@pytest.mark.parametrize("pipelining", [True, False])
def test_a_new_trainer_continues_a_finished_run_of_several_epochs(tmp_path, pipelining):
  """fit(epochs=3) to its end, then a new Trainer's fit(num_steps=...) without epochs:
  "cannot resume the data at batch 9: it holds only 3 batches". The same Trainer went on."""
  batches = make_batches(3, seed=17)
  make_trainer(tmp_path, pipelining).fit(batches, epochs=3)
  history = make_trainer(tmp_path, pipelining).fit(batches, num_steps=11)
  assert history.resumed_from == 9 and history.final_step == 11
  # The data started over at step 10: the next fit trains the rest of that pass.
  assert make_trainer(tmp_path, pipelining).fit(batches).final_step == 12
