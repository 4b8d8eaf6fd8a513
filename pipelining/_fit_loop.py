"""The step schedules of `Trainer.fit`, synchronous and pipelined, as pure loops.

The loop's state is one value, `LoopState` (train state, in-flight batch, data
position); the schedules take it with their collaborators (`Schedule`: the
compiled steps, the next batch, the stop decision) and yield every new
state with the step's metrics. The caller assigns each yielded state and
runs `StepEnd` (records, callbacks, evaluation, saves) before the schedule
continues, so a callback, an evaluation or a save sees the state of the step
that just ended, and after an exception the caller holds the last one.

Both schedules apply every batch exactly once, in order, and stop at the
first of: `num_steps` updates in total, the end of the data (of any process),
a requested stop. The pipelined one:

  prime:     lookup(batch 0)                      -> in flight
  step k:    dense(k) + update(k) + lookup(k + 1) -> in flight
  drain:     dense(last) + update(last)

so every lookup is one update stale, and a checkpoint taken between steps
holds the in-flight lookup with its batch. Only the end of the data drains:
a run that stops at `num_steps` or on request keeps the next batch in
flight (looked up from the tables before the last update, as a run that
went on would), so resuming from its final checkpoint, or calling fit
again, continues bit for bit like one uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax

from pipelining._callbacks import Callback, call_each
from pipelining._prefetch import Prepared
from pipelining._progress import Progress
from pipelining._steps import CompiledSteps, InFlight, TrainState


class NonFiniteLossError(FloatingPointError):
  """The loss became NaN or infinite; the offending batch was not applied.

  Attributes:
    step: the update the batch would have been (updates applied + 1).
    batch_index: the batch's 0-based position in the data stream (over all
      epochs).
    saved_step: with `save_on_nonfinite`, the step of the checkpoint that
      holds the last finite state; otherwise None.
    recorded_as_skipped: whether that checkpoint was written now, past the
      batch, recording it as skipped (a resume continues after it). False
      when a checkpoint of that step existed already (written before the
      batch, `save_every`): a resume from it meets the batch again.
    skipped: the batch's record as skipped ("batch", "step", "loss"), as
      `History.skipped_batches` lists it. The Trainer's state is past the
      batch and records it so: its next fit continues after the batch.
  """

  def __init__(self, message: str, *, step: int, batch_index: int, saved_step: int | None,
               recorded_as_skipped: bool, skipped: dict[str, Any]):
    super().__init__(message)
    self.step, self.batch_index, self.saved_step = step, batch_index, saved_step
    self.recorded_as_skipped = recorded_as_skipped
    self.skipped = skipped


@dataclasses.dataclass
class History:
  """What fit did.

  Attributes:
    steps: the step number (updates applied) of each recorded entry.
    metrics: per recorded step, the training metrics (host floats).
    evaluations: (step, metrics) of each evaluation during fit.
    final_step: updates applied when fit returned.
    interrupted: True when fit stopped on SIGTERM/SIGINT or request_stop().
    resumed_from: the checkpoint step fit resumed from, or None.
    dropped_ids: ids dropped (`allow_id_dropping`) from this process's
      training batches that this fit took into the run, and from the
      batches of its evaluations. A training batch counts in the fit whose
      step runs its lookup (pipelined: the step before the one applying
      it), not where it was prepared: batches prefetched past a stop count
      in the fit that uses them, whether this Trainer runs it or a new one
      resuming the checkpoint, so the sum over a run's fits is the run's.
    skipped_batches: the batches of the data stream not applied because
      their loss was not finite, as recorded in the state fit started from:
      a resumed checkpoint (`save_on_nonfinite`), or the state this Trainer
      kept (after a `NonFiniteLossError`, say): dicts with "batch" (0-based
      stream position), "step" and "loss".
  """

  steps: list[int] = dataclasses.field(default_factory=list)
  metrics: list[dict[str, float]] = dataclasses.field(default_factory=list)
  evaluations: list[tuple[int, dict[str, float]]] = dataclasses.field(default_factory=list)
  final_step: int = 0
  interrupted: bool = False
  resumed_from: int | None = None
  dropped_ids: int = 0
  skipped_batches: list[dict[str, Any]] = dataclasses.field(default_factory=list)


class LoopState(NamedTuple):
  """Everything the fit loop carries from one step to the next.

  Attributes:
    train: tables, dense parameters, optimizer state, step.
    in_flight: the batch whose lookup ran early (pipelined), or None.
    in_flight_ids: this process's raw ids of that batch (`Staged.ids`), for
      a layout-free checkpoint; None without an in-flight batch, or for one
      restored from a checkpoint of the older, layout-specific format.
    data: the data position after the newest batch taken from the stream
      (`DataStream.get_state()`, plus "skipped": batches not applied);
      empty before the first.
  """

  train: TrainState
  in_flight: InFlight | None
  in_flight_ids: Mapping[str, Any] | None
  data: Mapping[str, Any]


class StepResult(NamedTuple):
  """One update: the new state, its metrics (device values) and the batch applied."""

  state: LoopState
  metrics: dict[str, jax.Array]
  batch_index: int


@dataclasses.dataclass(frozen=True)
class Schedule:
  """The collaborators of a schedule.

  Attributes:
    steps: the compiled steps.
    next_batch: the next prepared batch (a `Prepared` of a `Staged`), or
      None when the data of any process ended. The processes also agree
      there on any stop requested meanwhile (`stop_agreed`).
    should_stop: whether a stop was requested (on any process).
    stop_agreed: whether the processes have agreed to stop, without asking
      again: a stop requested while `next_batch` waited for the data leaves
      the batch it returned untaken.
    num_steps: the total updates to reach, or None.
    took: called with every batch taken into the run (its lookup ran; the
      state's data position is past it).
  """

  steps: CompiledSteps
  next_batch: Callable[[], Prepared | None]
  should_stop: Callable[[], bool]
  stop_agreed: Callable[[], bool]
  num_steps: int | None
  took: Callable[[Prepared], None] = lambda prepared: None

  def reached(self, step: int) -> bool:
    """Whether `step` updates complete the run."""
    return self.num_steps is not None and step >= self.num_steps


def newest_index(data: Mapping[str, Any]) -> int:
  """The stream position of the newest batch taken (the in-flight one, when any)."""
  return int(data.get("batches_consumed", 0)) - 1


def sync_steps(schedule: Schedule, state: LoopState,
               pending: Prepared | None) -> Iterator[StepResult]:
  """Synchronous steps (lookup, dense, update of one batch).

  A checkpoint of a pipelined run may hold a batch in flight: it is applied
  first, unless the run is complete already.
  """
  step = int(state.train.step)
  if state.in_flight is not None and not (schedule.reached(step) or schedule.should_stop()):
    index = newest_index(state.data)
    train, metrics = schedule.steps.drain(state.train, state.in_flight)
    state = LoopState(train, None, None, state.data)
    yield StepResult(state, metrics, index)
    step = int(state.train.step)
  if pending is None or schedule.should_stop() or schedule.reached(step):
    return
  while True:
    train, metrics = schedule.steps.sync(state.train, pending.batch.batch)
    state = LoopState(train, None, None, _advanced(state.data, pending))
    schedule.took(pending)
    yield StepResult(state, metrics, pending.index)
    step = int(state.train.step)
    # Before taking the next batch: a stopped run leaves it in the stream.
    if schedule.reached(step) or schedule.should_stop():
      return
    pending = schedule.next_batch()
    if pending is None or schedule.stop_agreed():
      return


def pipelined_steps(schedule: Schedule, state: LoopState,
                    pending: Prepared | None) -> Iterator[StepResult]:
  """Pipelined steps (prime, overlapped steps, drain)."""
  step = int(state.train.step)
  if schedule.reached(step) or schedule.should_stop():
    return
  if state.in_flight is None:
    if pending is None:
      return
    state = _taken(state, schedule.steps.prime(state.train, pending.batch.batch), pending)
    schedule.took(pending)
    pending = None
  while state.in_flight is not None:
    # The next batch's lookup runs even in the step that reaches num_steps:
    # the run then stops as at a requested stop, that batch in flight, and a
    # resume (or the next fit) continues exactly as if it had not stopped.
    # Only the end of the data drains the pipeline.
    if pending is None:
      pending = schedule.next_batch()
      if pending is not None and schedule.stop_agreed():
        return  # requested while waiting for it: the batch in flight stays so
    index = newest_index(state.data)
    if pending is None:
      train, metrics = schedule.steps.drain(state.train, state.in_flight)
      state = LoopState(train, None, None, state.data)
    else:
      train, in_flight, metrics = schedule.steps.pipelined(
          state.train, state.in_flight, pending.batch.batch)
      state = _taken(state._replace(train=train), in_flight, pending)
      schedule.took(pending)
      pending = None
    yield StepResult(state, metrics, index)
    step = int(state.train.step)
    if schedule.should_stop() or schedule.reached(step):
      break


def with_skip(state: LoopState, skipped: Mapping[str, Any]) -> LoopState:
  """`state` with a batch recorded as skipped in its data position.

  `skipped` is the batch's record (`NonFiniteLossError.skipped`); the record
  stays in every later position (`_advanced`).
  """
  return state._replace(data={**state.data, "skipped": [*state.data.get("skipped", []), skipped]})


def _advanced(data: Mapping[str, Any], prepared: Prepared) -> dict[str, Any]:
  """The data position after `prepared`, keeping the record of skipped batches."""
  return {**prepared.position, "skipped": list(data.get("skipped", []))}


def _taken(state: LoopState, in_flight: InFlight, prepared: Prepared) -> LoopState:
  """`state` with `prepared`'s batch in flight and the data position after it."""
  return LoopState(state.train, in_flight, prepared.batch.ids, _advanced(state.data, prepared))


@dataclasses.dataclass(frozen=True)
class StepEnd:
  """What follows every update: records, callbacks, evaluation and saves when due.

  Attributes:
    owner: passed to the callbacks (the Trainer).
    history, progress, callbacks: where the step is recorded.
    evaluate: evaluates the current state on the eval data (metrics), or
      None without eval data.
    eval_every: steps between evaluations, or None.
    save: starts a checkpoint of a state; False when that step exists
      already (None without a workdir).
    wait_for_saves: blocks until started checkpoints are complete.
    save_every: steps between checkpoints, or None.
    save_on_nonfinite: save before raising NonFiniteLossError.
  """

  owner: Any
  history: History
  progress: Progress
  callbacks: Sequence[Callback]
  evaluate: Callable[[], dict[str, float]] | None
  eval_every: int | None
  save: Callable[[LoopState], bool] | None
  wait_for_saves: Callable[[], None]
  save_every: int | None
  save_on_nonfinite: bool

  def __call__(self, result: StepResult) -> None:
    """Handles one update: its metrics, callbacks, evaluation and save.

    A checkpoint due at this step is started even when a callback or the
    evaluation raises (the exception then propagates).

    Raises:
      NonFiniteLossError: the batch's loss is NaN or infinite. The step
        functions skip such an update, so the state is the last finite one.
        With `save_on_nonfinite` it is saved first, the data position past
        the batch and the batch recorded in data["skipped"]: a resume
        continues with the next batch and reports the skip
        (`History.skipped_batches` and a warning). When a checkpoint of
        that step exists already (`save_every`), it was written before the
        batch and a resume meets the batch again; the error says which.
    """
    state = result.state
    step = int(state.train.step)
    host = {name: float(value) for name, value in jax.device_get(result.metrics).items()}
    if not math.isfinite(host["loss"]):
      self._raise_nonfinite(state, step, result.batch_index, host)
    self.history.steps.append(step)
    self.history.metrics.append(host)
    self.progress.step(step, host)
    try:
      call_each(self.callbacks, "on_step_end", self.owner, step, host)
      if self.evaluate is not None and self.eval_every is not None and step % self.eval_every == 0:
        self.evaluation(step)
    finally:
      # A callback or an evaluation that raises does not cost the checkpoint
      # due at this step: the update is applied, so its state is saved.
      if self.save is not None and self.save_every is not None and step % self.save_every == 0:
        self.save(state)

  def final(self, state: LoopState, interrupted: bool) -> None:
    """What follows the last update: the final evaluation and the final save.

    The evaluation runs unless the fit was interrupted or the last step
    evaluated already; as at a save_every step, an evaluation that raises
    does not cost the save.
    """
    step = int(state.train.step)
    evaluated = bool(self.history.evaluations) and self.history.evaluations[-1][0] == step
    try:
      if not interrupted and self.evaluate is not None and not evaluated:
        self.evaluation(step)
    finally:
      if self.save is not None:
        self.save(state)
    self.wait_for_saves()

  def evaluation(self, step: int) -> None:
    """Evaluates the current state and records the metrics at `step`."""
    metrics = self.evaluate()
    self.history.evaluations.append((step, metrics))
    self.progress.record({"step": step, **{f"eval_{k}": v for k, v in metrics.items()}})
    call_each(self.callbacks, "on_eval_end", self.owner, step, metrics)

  def _raise_nonfinite(self, state: LoopState, step: int, batch_index: int,
                       host: dict[str, float]) -> None:
    skipped = {"batch": batch_index, "step": step + 1, "loss": str(host["loss"])}
    recorded = False
    if self.save_on_nonfinite and self.save is not None:
      recorded = self.save(with_skip(state, skipped))
      self.wait_for_saves()
    where = ""
    if recorded:
      where = (f" The checkpoint of step {step} records batch {batch_index} as skipped;"
               " resuming from it continues with the next batch (to apply the batch after"
               " all, fix it and resume from an earlier checkpoint).")
    elif self.save_on_nonfinite and self.save is not None:
      where = (f" The checkpoint of step {step} was written before this batch and points at"
               " it: resuming from it meets the batch again (fix or drop it in the data, or"
               " lower the learning rate, first).")
    raise NonFiniteLossError(
        f"the loss is {host['loss']} at step {step + 1} (batch {batch_index} of the data"
        f" stream; metrics {host}); that update was not applied. Lower the learning rate,"
        " check the inputs of this batch, or add gradient clipping." + where,
        step=step + 1, batch_index=batch_index,
        saved_step=step if self.save_on_nonfinite and self.save is not None else None,
        recorded_as_skipped=recorded, skipped=skipped,
    )
