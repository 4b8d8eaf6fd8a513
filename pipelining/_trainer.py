"""`Trainer`: fit / evaluate / predict with pipelined embedding lookups."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from checkpoint import CorruptCheckpointError
from pipelining._agreement import (
    check_same_setup,
    check_same_shapes,
    data_ended_agreed,
    every_process_has,
    next_agreed,
)
from pipelining._batch_check import (
    BatchUse,
    check_iterable,
    check_labels_fit_predictions,
    check_not_one_batch,
)
from pipelining._callbacks import Callback, call_each, checked_callbacks
from pipelining._config import TrainerConfig, fit_arguments
from pipelining._damage import DamagedStep, none_restores_error, one_shot_data_error
from pipelining._data import is_one_shot, own_position, share_position
from pipelining._determinism import NondeterministicResumeWarning, mesh_platform, resume_caveat
from pipelining._distributed import check_agreement, check_shared_directory
from pipelining._features import FeatureTree
from pipelining._fit_data import FitData
from pipelining._fit_loop import (
    History,
    LoopState,
    NonFiniteLossError,
    Schedule,
    StepEnd,
    newest_index,
    pipelined_steps,
    sync_steps,
    with_skip,
)
from pipelining._fit_stream import FitStream
from pipelining._in_flight import (
    DroppedIds,
    FeatureInFlight,
    SavedInFlight,
    Staged,
    check_savable,
    id_rows,
    local_inputs,
    rows_tree,
)
from pipelining._metrics import evaluation_metrics, host_tree, no_batches_error, per_sample
from pipelining._model import DenseModel, as_dense_model
from pipelining._placement import any_process, to_global
from pipelining._prefetch import Prefetcher, Prepared
from pipelining._progress import Progress, describe_run
from pipelining._signals import install_stop_handlers, restore_handlers
from pipelining._staging import BatchStager
from pipelining._steps import DeviceBatch, InFlight, StepFunctions, TrainState
from sc_framework.host_allocator import keep_freed_memory
from sc_framework.primitives import (
    DEFAULT_AXIS_NAME,
    EmbeddingPlan,
    default_mesh,
    embedding_variable_shapes,
    get_backend,
    init_embedding_variables,
    mesh_axis_size,
    replace_tables,
    slot_values,
    table_values,
)
from sc_framework.specs import FeatureSpec
from sc_framework.stacking import layout_for_stacking


_LOG = logging.getLogger("pipelining")

_SAME_STEPS = ("Every process must feed the same number of batches (its slice of each global"
               " batch) and stop at the same step.")

class Trainer:
  """Trains a dense Flax model on top of sharded, stacked embedding tables.

  Args:
    model: a Linen or NNX module called as model(activations, dense) where
      activations holds each feature's [B, D] ([B, L, D] for a sequence
      feature) in the structure of `feature_specs` (for a flat sequence of
      specs, a dict feature name -> activation), in the table dtype, and
      dense is the batch's "dense" entry; returns predictions.
    feature_specs: the sparse features and their tables: a sequence of
      FeatureSpec, or any nested structure of them (dicts, lists, tuples, as
      the SparseCore stack and TPUEmbedding accept). A batch's "sparse" ids
      come in the same structure or as a dict feature name -> ids.
    loss_fn: (predictions, labels) -> scalar loss, or (loss, metrics dict).
    dense_optimizer: optax transformation for the dense parameters (the tables
      use their own sparse optimizers from the specs).
    mesh: a 1-D mesh whose axis `axis_name` holds tables and batch; default
      all devices of all processes, ordered by (process, id).
    axis_name: the mesh axis name.
    config: a TrainerConfig; alternatively pass its fields as keyword
      arguments (pipelining=..., workdir=..., stacking=..., table_dtype=...).
      `stacking` chooses which tables share a stack ("auto", "separate",
      groups of table names, or a complete EmbeddingLayout) and
      `table_dtype` the tables' precision ("float32" or "bfloat16" with
      float32 slots); see TrainerConfig.

  Raises:
    ValueError: a stacking that does not fit the specs or the mesh (a table in
      no group or two, tables that cannot share a stack, a layout of other
      tables or another device count), naming the value.

  The batch format is documented in `pipelining._data`. With several
  processes (`initialize_distributed`), every process builds the same
  Trainer and feeds only its slice of every global batch: B * P / G samples
  of each feature, dense feature and label, for the positions
  `trainer.plan.local_devices()` of its P devices among the G; the specs keep
  the global batch sizes. Metrics, evaluate and predict cover the global
  batch on every process; only process 0 reports progress and writes
  metrics.jsonl; checkpoints are written cooperatively to the shared workdir.
  """

  def __init__(
      self,
      model: Any,
      feature_specs: Sequence[FeatureSpec] | Mapping[str, Any],
      loss_fn: Callable[..., Any],
      dense_optimizer: optax.GradientTransformation,
      *,
      mesh: Mesh | None = None,
      axis_name: str = DEFAULT_AXIS_NAME,
      config: TrainerConfig | None = None,
      **options: Any,
  ):
    if config is not None and options:
      raise TypeError(f"pass either config or keyword options, not both (got {sorted(options)}).")
    self.config = config if config is not None else TrainerConfig(**options)
    self._features = FeatureTree.of(feature_specs)
    if isinstance(self.config.padding_id, Mapping):
      unknown = sorted(set(self.config.padding_id) - {spec.name for spec in self._features.specs})
      if unknown:
        raise ValueError(
            f"padding_id names features {unknown} that the Trainer does not have; its features"
            f" are {[spec.name for spec in self._features.specs]}.")
    if mesh is None:
      mesh = default_mesh(axis_name)
    num_devices = mesh_axis_size(mesh, axis_name)
    if self.config.host_memory == "keep" and all(
        device.platform == "cpu" for device in mesh.devices.flat
    ):
      # Before any program of this Trainer runs (the backend's probe is one):
      # threads that allocate after it share the heap (see host_allocator).
      keep_freed_memory()
    layout = layout_for_stacking(self.config.stacking, self._features.specs,
                                 num_devices, self.config.shards_per_device)
    self.plan = EmbeddingPlan.create(self._features.specs, mesh=mesh, axis_name=axis_name,
                                     layout=layout)
    self._local_devices = self.plan.local_devices()
    self.backend = get_backend(self.config.backend, self.plan)
    check_same_setup(self.plan, self.config, self.backend.name)
    self._model = model
    self._loss_fn = loss_fn
    if not (callable(getattr(dense_optimizer, "init", None))
            and callable(getattr(dense_optimizer, "update", None))):
      raise TypeError(
          "dense_optimizer must be an optax.GradientTransformation (with init and update),"
          f" e.g. optax.adam(1e-3); got {dense_optimizer!r}."
      )
    self._dense_optimizer = dense_optimizer
    # The fit loop's state (train state, in-flight batch, data position);
    # fit assigns it after every step.
    self._loop: LoopState | None = None
    # Where each fit's data starts, and what a fit that stopped early hands on.
    self._fit_data = FitData(self._stage_for_training, self.config.prefetch_depth,
                             self.config.prefetch_workers)
    # The checkpoint step whose train state evaluate or predict adopted
    # without its in-flight batch and data position: fit still resumes it.
    self._state_only_from: int | None = None
    self._stager = BatchStager(self.plan, self._features, self.config, self._local_devices)
    self._dense_model: DenseModel | None = None
    # The model's output shapes (global), for the check of the labels.
    self._prediction_shapes = None
    self._steps = None
    # A stop asked for here (request_stop, a signal) becomes `_stop`, the
    # decision, at the next check; with several processes a request on any
    # process stops all after the same step (`_stopping`).
    self._stop_requested = threading.Event()
    self._fitting = False  # fit's loop runs (and carries the state itself)
    # One-shot iterators the latest evaluates and predicts iterated: used up for a later
    # fit (held, as builtin iterators take no weak reference; used up, they hold little).
    self._used_one_shot: collections.deque = collections.deque(maxlen=16)
    self._stop = threading.Event()
    self._checkpoints = None
    if self.config.workdir is not None:
      from pipelining._checkpointing import TrainerCheckpoints

      check_shared_directory("workdir", self.config.workdir)
      if self.config.pipelining:
        check_savable(self.plan.feature_specs)  # not after save_every steps of training
      caveat = resume_caveat(mesh_platform(self.plan.mesh), os.environ.get("XLA_FLAGS", ""))
      if caveat is not None:
        warnings.warn(caveat, NondeterministicResumeWarning, stacklevel=2)
      self._checkpoints = TrainerCheckpoints(
          self.config.workdir, self.plan, keep=self.config.keep,
          incremental=self.config.incremental,
          # Prepared but not applied at once: a fit's queue (depth), one more
          # held by its thread, the next batch and the one in flight, plus, in a
          # fit continuing another's stream (`FitData`), that fit's remainder;
          # and one more per prefetch worker: workers record their batches out of order.
          unapplied_batches=2 * self.config.prefetch_depth + 4 + self.config.prefetch_workers)

  @property
  def state(self) -> TrainState | None:
    """The tables, dense parameters, optimizer state and step; None before the first batch."""
    return None if self._loop is None else self._loop.train

  @state.setter
  def state(self, value: TrainState) -> None:
    self._loop = (LoopState(value, None, None, {}) if self._loop is None
                  else self._loop._replace(train=value))

  # --- batches ------------------------------------------------------------------

  def prepare(self, raw: Any) -> DeviceBatch:
    """Preprocesses this process's slice of one batch and places it on the devices.

    Returns global arrays: with several processes, each process's slice
    becomes its devices' part of the global batch (`pipelining._placement`).
    The batch is checked as a training batch (labels needed).
    """
    return self._stager.stage(raw, "training", None).batch

  def _stage_for_training(self, raw: Any, index: int) -> Staged:
    """The stager's batch for fit; also records the rows it will update (incremental saves)."""
    staged = self._stager.stage(raw, "training", index)
    if self._checkpoints is not None:
      self._checkpoints.track(staged.batch.sparse)
    return staged

  @property
  def dropped_ids(self) -> int:
    """Ids dropped (`allow_id_dropping`) from every batch this process prepared.

    Counts the batches of fit, evaluate and predict, including batches
    prefetched but not used; `History.dropped_ids` has the count of one fit.
    """
    return self._stager.dropped_ids

  # --- state ----------------------------------------------------------------------

  def _keys(self) -> tuple[jax.Array, jax.Array]:
    """The PRNG keys of the initial tables and of the dense model, from the seed."""
    embedding_key, dense_key = jax.random.split(jax.random.key(self.config.seed))
    return embedding_key, dense_key

  def _build(self, example: DeviceBatch) -> None:
    """Initialises the dense model and the compiled steps (the state: `_ensure_state`)."""
    if self._steps is not None:
      return
    _, dense_key = self._keys()
    activations = self._features.activations_for_model({
        f.name: jnp.zeros(f.output_shape, self.config.table_dtype)
        for f in self.plan.feature_specs
    })
    # Initialise on this process's default device from global shapes only.
    dense = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), example.dense)
    self._dense_model = as_dense_model(self._model, dense_key, activations, dense)
    check_same_shapes(example, self._dense_model.params)
    self._prediction_shapes = jax.eval_shape(self._dense_model.apply, self._dense_model.params,
                                             activations, dense)
    model_apply, to_model = self._dense_model.apply, self._features.activations_for_model

    def apply(params, activations_by_name, dense_features):
      return model_apply(params, to_model(activations_by_name), dense_features)

    self._steps = StepFunctions(
        self.plan, apply, self._loss_fn, self._dense_optimizer, backend=self.backend
    ).compiled()

  def _ensure_state(self) -> None:
    """The initial state, unless one was set or restored (after `_build`)."""
    if self.state is None:
      self.state = self._initial_state()

  def _initial_state(self) -> TrainState:
    """Fresh tables and the dense model's initial parameters, at step 0.

    Everything is placed as the compiled steps return it, so the first and
    later steps share one compilation.
    """
    replicated = self.plan.replicated_sharding()
    params = jax.device_put(jax.device_get(self._dense_model.params), replicated)
    embeddings = init_embedding_variables(self.plan, self._keys()[0],
                                          dtype=self.config.table_dtype)
    opt_state = jax.jit(self._dense_optimizer.init, out_shardings=replicated)(params)
    step = jax.device_put(np.zeros((), np.int32), replicated)
    return TrainState(params, opt_state, embeddings, step)

  def _state_template(self) -> TrainState:
    """The state's shapes, dtypes and shardings (`_initial_state`'s), computing nothing.

    A checkpoint restores into it: a resumed Trainer never initialises the
    tables it replaces (compiling the per-row initializer of large tables
    takes seconds).
    """
    replicated = self.plan.replicated_sharding()

    def placed(tree):
      return jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=replicated), tree)

    params = placed(self._dense_model.params)
    return TrainState(
        params, placed(jax.eval_shape(self._dense_optimizer.init, params)),
        embedding_variable_shapes(self.plan, dtype=self.config.table_dtype),
        jax.ShapeDtypeStruct((), np.int32, sharding=replicated))

  def _restore(self, example: DeviceBatch, history: History) -> None:
    """Restores the latest checkpoint when it is newer than the state (with a workdir)."""
    step = self._resume_step()
    if step is None:
      return
    template = FeatureInFlight(
        {f.name: jax.ShapeDtypeStruct(f.output_shape, self.config.table_dtype,
                                      sharding=self.plan.row_sharding())
         for f in self.plan.feature_specs},
        example,
    )
    train, saved, data = self._restore_marking_damage(step, lambda: self._checkpoints.restore(
        step, self._restore_target(), template))
    in_flight, ids = None, None
    if isinstance(saved, SavedInFlight):
      # Preprocessed again for this layout, from this process's samples.
      ids = local_inputs(saved.ids, self.plan.feature_specs, self._local_devices,
                         self.plan.num_devices)
      saved = FeatureInFlight(
          saved.activations,
          DeviceBatch(self._stager.place(self._stager.preprocess(ids)[0], None, None).sparse,
                      saved.dense, saved.labels))
      self._checkpoints.track(saved.batch.sparse)  # Its update is still to apply.
    if saved is not None:
      in_flight = InFlight(self._steps.stacked_activations(saved.activations), saved.batch)
    self._loop = LoopState(train, in_flight, ids, own_position(data))
    self._state_only_from = None
    history.resumed_from = step

  def _restore_marking_damage(self, step: int, restore: Callable[[], Any]) -> Any:
    """`restore()` of checkpoint step `step`, unless the step is found damaged.

    Listing a step reads no chunk: a chunk failing its checksum (a flipped
    byte) shows only when the step is restored. With one process the step
    is then marked damaged, so that the next `latest_step` skips it
    (warning), and `DamagedStep` tells the caller to take the step before
    it. With several, each process reads its own part and only some see the
    damage, while the others wait for them inside the restore: the error is
    raised (the job fails fast), telling what to do before a restart.
    """
    try:
      return restore()
    except CorruptCheckpointError as error:
      if jax.process_count() > 1:
        raise CorruptCheckpointError(
            f"{error} Checkpoint step {step} is damaged. A job of several processes cannot"
            " skip it on its own (each process reads its own part of it): move the step out"
            f" of {self._checkpoints.directory} (or repair it), then restart the job; it"
            " resumes the newest step that restores."
        ) from error
      if self._checkpoints.why_unrestorable(step) is None:  # The manager's restore marks it.
        self._checkpoints.mark_damaged(step, str(error))
      raise DamagedStep(step, str(error)) from error

  def initialize(self, example_batch: Any) -> TrainState:
    """Creates the state (tables, dense parameters, optimizer state) now.

    fit, evaluate and predict do this on their first batch; call it to read
    or modify the initial state first. With a workdir, fit still resumes from
    a newer checkpoint.

    Args:
      example_batch: a raw training batch, with labels (its shapes initialise
        the dense model).

    Returns:
      The TrainState (also `trainer.state`).
    """
    self._build(self.prepare(example_batch))
    self._ensure_state()
    return self.state

  def table_values(self, tables: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """The current rows of tables as numpy arrays: name -> [V, D] (default every table).

    See `sc_framework.primitives.table_values`; `slot_values` gives their
    optimizer slots. Single-process jobs only (a multi-process job reads
    tables from a checkpoint: `checkpoint.TableRestore`).
    """
    return table_values(self.plan, self._state_or_refuse("table_values").embeddings, tables)

  def slot_values(self, tables: Iterable[str] | None = None) -> dict[str, dict[str, np.ndarray]]:
    """The tables' optimizer slots: name -> slot -> [V, D] or [V, w] numpy array."""
    return slot_values(self.plan, self._state_or_refuse("slot_values").embeddings, tables)

  def replace_tables(self, tables: Mapping[str, np.ndarray],
                     slots: Mapping[str, Mapping[str, np.ndarray]] | None = None) -> None:
    """Starts tables from given rows, e.g. pretrained embeddings: name -> [V, D] array.

    After `initialize` (or a fit): each named table's rows become the array's,
    its slots `slots[name]` where given, else their initial values; nothing
    else changes (see `sc_framework.primitives.replace_tables`). Arrays may be
    memory-mapped: each device reads only its rows. With a workdir, a fit
    still resumes from a checkpoint newer than the state's step. A batch a
    stopped pipelined fit left in flight keeps the activations it looked up
    from the rows before (the pipeline's one step of staleness).
    """
    if self._fitting:
      raise RuntimeError(
          "Trainer.replace_tables during fit (from a callback): fit's loop carries the state"
          " from step to step and would not see the new rows. Call it between fits (or in"
          " on_fit_end).")
    state = self._state_or_refuse("replace_tables")
    self.state = state._replace(
        embeddings=replace_tables(self.plan, state.embeddings, tables, slots))
    if self._checkpoints is not None:  # An incremental save writes every replaced row.
      self._checkpoints.track_tables(tables)

  def _state_or_refuse(self, what: str) -> TrainState:
    if self.state is None:
      raise RuntimeError(
          f"Trainer.{what}: the Trainer has no state yet; call initialize(example_batch)"
          " (or fit) first.")
    return self.state

  def latest_checkpoint_step(self) -> int | None:
    """The newest complete checkpoint in the workdir, or None."""
    if self._checkpoints is None:
      return None
    return self._checkpoints.latest_step()

  def request_stop(self) -> None:
    """Asks fit to stop after the current step (saving first, with a workdir).

    With several processes, a request on any of them stops every process
    after the same step.
    """
    self._stop_requested.set()

  @property
  def stop_requested(self) -> bool:
    """Whether this process asked the current (or last) fit to stop.

    Set by `request_stop()`, SIGTERM or a first SIGINT during fit (a second
    SIGINT aborts); each fit starts with it cleared. A data iterator or a
    callback can read it to stop work that fit will not use.
    """
    return self._stop_requested.is_set()

  def _any_process(self, *flags: bool) -> tuple[bool, ...]:
    return any_process(flags, self.plan.row_sharding(), self.plan.num_devices,
                       len(self._local_devices))

  def _stopping(self) -> bool:
    """Whether fit stops now: a stop was requested here or on any other process."""
    if not self._stop.is_set() and self._any_process(self._stop_requested.is_set())[0]:
      self._stop.set()
    return self._stop.is_set()

  # --- fit ------------------------------------------------------------------------

  def fit(
      self,
      train_data: Iterable[Any],
      num_steps: int | None = None,
      epochs: int | None = None,
      eval_data: Iterable[Any] | None = None,
      eval_every: int | None = None,
      callbacks: Sequence[Callback] = (),
  ) -> History:
    """Trains until `num_steps` updates in total, or the data ends.

    With a workdir, fit first resumes from the latest checkpoint (state,
    in-flight lookup and data position; on any device count, shards per
    device, stacking and process count; also one another Trainer saved
    there since this one started), saves every `save_every` steps and at the
    end. SIGTERM/SIGINT finish the current step, save, and return with
    `history.interrupted = True`; the next fit continues bit for bit.

    Args:
      train_data: an iterable of batches (see `pipelining._data`). After a
        fit that stopped before its data ended (num_steps, a stop request),
        a fit given the same object continues its stream where it stopped,
        the batches already taken from it first: fits in chunks on the same
        data equal one fit, also for a one-shot iterator. So it does after a
        fit that raised (a callback, an evaluation): it goes on after the
        batches the raising fit applied; after an error of the data itself
        (a bad batch), a re-iterable is iterated again from that batch.
        Other data starts from its beginning; after its end, the same data
        does too. A new Trainer resuming the checkpoint taken at that end
        starts it over when num_steps asks for more steps; with num_steps
        None the run it resumes is complete and it trains nothing (it logs
        so), as a restarted job that had finished should. A one-shot
        iterator cannot start over.
      num_steps: the total number of updates to reach (counting resumed
        ones); None trains until the data (all epochs) ends.
      epochs: passes over train_data; None is one pass.
      eval_data: evaluated every `eval_every` steps and at the end (once
        per step: not again when the last step was an `eval_every` one). A
        fit that was interrupted (a stop request, early stopping included,
        or SIGTERM/SIGINT) skips the evaluation at its end.
      eval_every: steps between evaluations (needs eval_data, re-iterable:
        a list or a dataset, not a one-shot iterator).
      callbacks: `Callback` hooks.

    Returns:
      A History.

    Raises:
      NonFiniteLossError: the loss became NaN or infinite (that batch is not
        applied; the error names its position in the data stream). With
        save_on_nonfinite the last finite state is saved first, the batch
        recorded there as skipped (see `TrainerConfig.save_on_nonfinite`).
        This Trainer's next fit continues after the batch and lists it in
        `History.skipped_batches`, as a resume of that checkpoint does.
      ValueError: a batch lacks "sparse" or "labels", a dense feature or
        label has a leading dimension other than the batch size, the dense
        features or labels differ in structure, shape or dtype from the first
        batch's, or the labels would broadcast against the predictions
        (`pipelining._batch_check`); the message names the batch's position.
        Also eval_every with a one-shot iterator as eval_data.
      TypeError: a batch that is not a dict.
      CorruptCheckpointError: the workdir holds checkpoint steps but none of
        them restores, and the state is not a trained one of this Trainer
        (none, one at step 0, or one evaluate adopted from a checkpoint): fit
        does not start over beside them (the message names the steps).
    """
    if self._fitting:
      raise RuntimeError(
          "Trainer.fit during fit (from a callback): the running fit carries the state, the"
          " data position and the checkpoints, which a second one would mix. Stop the running"
          " fit (trainer.request_stop() in a callback, or early stopping) and call fit again"
          " after it returns.")
    check_iterable(train_data, "fit's train_data")
    check_not_one_batch(train_data, "fit's train_data")
    check_not_one_batch(eval_data, "fit's eval_data")
    num_steps, epochs, eval_every = fit_arguments(num_steps, epochs, eval_data, eval_every)
    if eval_data is not None and self._used_up(eval_data):
      raise ValueError(
          "eval_data is a one-shot iterator that an earlier evaluation of this Trainer used up:"
          " fit would fail at its evaluation, after training. Pass a new iterator, or a"
          " re-iterable (a list, or a dataset whose __iter__ starts over).")
    callbacks = checked_callbacks(callbacks)
    history = History()
    evaluation_dropped_before = self._stager.dropped_ids_of("evaluation")
    self._stop.clear()
    self._stop_requested.clear()
    tracked = None if self._checkpoints is None else self._checkpoints.tracked()
    stream = FitStream(
        self._fit_data, train_data, epochs,
        can_continue=lambda: self._loop is not None and self._resume_step() is None,
        position=self._data_position, take=self._next, ends=self._data_ended,
        # A finished run restarted (num_steps None) stays finished; more steps asked
        # for start the data over, as this Trainer's next fit after the data's end does.
        at_end="stop" if num_steps is None else "start_over",
        loop_data=lambda: None if self._loop is None else self._loop.data)
    previous_handlers = install_stop_handlers(self._stop_requested)
    progress = None
    aborted = False  # a KeyboardInterrupt: the prefetch thread is not waited for
    self._fitting = True
    try:
      first = stream.next_batch()
      started = self._start_or_fall_back(first, train_data, history)
      while isinstance(started, DamagedStep):
        # At the data position of the step fit falls back to (a damaged step implies a
        # workdir); the batches the dropped stream prepared are never applied.
        stream.reopen(dropped=lambda: self._checkpoints.forget_tracked_since(tracked))
        first = stream.next_batch()
        started = self._start_or_fall_back(first, train_data, history)
      if not started:
        history.final_step = 0 if self.state is None else int(self.state.step)
        return history
      stream.start(first)
      self._report_skipped(history)
      self._check_start(num_steps, epochs, eval_data, eval_every, history, stream.continued)
      progress = self._progress(num_steps, history.resumed_from)
      call_each(callbacks, "on_fit_start", self, int(self.state.step))
      end = self._step_end(history, progress, callbacks, eval_data, eval_every)
      def took(prepared: Prepared) -> None:
        history.dropped_ids += prepared.batch.dropped_ids

      schedule = Schedule(self._steps, stream.next_batch, self._stopping, self._stop.is_set,
                          num_steps, took)
      steps = pipelined_steps if self.config.pipelining else sync_steps
      for result in steps(schedule, self._loop, first):
        self._loop = result.state
        end(result)
      history.interrupted = self._stopping()
      check_agreement("end of fit", {"step": int(self.state.step),
                                     "interrupted": history.interrupted}, hint=_SAME_STEPS)
      stream.hand_on(interrupted=history.interrupted, pipelined=self.config.pipelining)
      end.final(self._loop, history.interrupted)
      history.final_step = int(self.state.step)
      if num_steps is not None and not history.interrupted and history.final_step < num_steps:
        progress.end_note(f"the data ended at step {history.final_step}, before"
                          f" num_steps={num_steps}")
      return history
    except BaseException as error:
      aborted = isinstance(error, KeyboardInterrupt)
      stream.hand_on_after_error(error)
      if isinstance(error, NonFiniteLossError):
        # The loop state is past the batch: it records the batch as skipped, as
        # the save_on_nonfinite checkpoint does. Only after the hand-on, which
        # tells an unapplied batch by the identity of the loop's data position.
        self._loop = with_skip(self._loop, error.skipped)
      self._finish_saves_after_error()
      raise
    finally:
      self._fitting = False
      try:
        stream.close(aborted=aborted)
        history.dropped_ids += (self._stager.dropped_ids_of("evaluation")
                                - evaluation_dropped_before)
        if progress is not None:
          progress.close()
        if not history.final_step:  # fit raised: the steps it applied count
          history.final_step = _step_or_zero(self.state)
        call_each(callbacks, "on_fit_end", self, history)
      finally:
        restore_handlers(previous_handlers)

  def _start_or_fall_back(self, first: Prepared | None, train_data: Iterable[Any],
                          history: History) -> bool | DamagedStep:
    """`_start`, or the damaged step it could not resume: fit resumes an older one instead.

    The stream started at the damaged step's data position; it starts again
    as if that step were not there: at the older step's position, or where
    this Trainer's own state left it. A one-shot iterator can only go back to
    an older step's position, through its `set_state` (else raised, telling
    where the data must start).
    """
    try:
      return self._start(first, train_data, history)
    except DamagedStep as damaged:
      older = self._resume_step()
      if older is None:
        self._refuse_to_start_over()  # From fresh state: raises, naming the damage.
      if not isinstance(train_data, Iterator) or (
          older is not None and hasattr(train_data, "set_state")):
        return damaged
      if older is not None:
        resumes = f"the step before it ({older}), whose data position is earlier"
      else:  # Past the refusal above: this Trainer's own trained state.
        resumes = (f"this Trainer's own state (step {int(self.state.step)}), after batch"
                   f" {newest_index(self._loop.data)} of the data")
      raise one_shot_data_error(damaged, resumes, self._checkpoints.directory) from damaged

  def _start(self, first: Prepared | None, train_data: Iterable[Any], history: History) -> bool:
    """Builds the steps and restores the latest checkpoint; False when there is nothing to fit."""
    if (first is None and self._loop is not None and self._loop.in_flight is not None
        and self._resume_step() is None):
      return True  # No new batch, but the one in flight is still to be applied (drained).
    example = first.batch.batch if first is not None else self._example_batch(train_data)
    if first is None and not every_process_has(example):
      return False
    if example is None:
      _LOG.warning("fit's train_data gave no batch (it is empty, or an iterator already"
                   " exhausted): nothing was trained.")
      return False
    self._build(example)
    check_labels_fit_predictions(self._prediction_shapes, example.labels)
    self._restore(example, history)
    self._refuse_to_start_over()
    self._ensure_state()
    return True

  def _refuse_to_start_over(self) -> None:
    """Raises when the state is not a trained one of this Trainer's own and the workdir
    holds checkpoint steps, none of which restores.

    Not its own: none, one at step 0 (the initial one of `initialize`), or the
    train state evaluate or predict adopted from a checkpoint (which has no
    data position: a fit from it would train the data again on top of it).
    Starting from such a state beside the steps would hide a lost run behind
    a quiet restart (every step found damaged, or copied without its files).
    """
    if self._checkpoints is None:
      return
    if (self._state_only_from is None and self.state is not None
        and int(self.state.step) > 0):
      return
    if self._checkpoints.latest_step() is not None:
      return
    unrestorable = self._checkpoints.unrestorable_steps()
    if not unrestorable:
      return
    raise none_restores_error(self._checkpoints.directory, unrestorable)

  def _report_skipped(self, history: History) -> None:
    """The batches the state fit starts from records as skipped (`History.skipped_batches`)."""
    history.skipped_batches = list(self._loop.data.get("skipped", []))
    if history.skipped_batches:
      _LOG.warning(
          "%s records batches of the data stream that were not applied because their loss was"
          " not finite: %s. Training continues after them.",
          "this Trainer's state" if history.resumed_from is None
          else f"checkpoint step {history.resumed_from}", history.skipped_batches)

  def _check_start(self, num_steps: int | None, epochs: int | None,
                   eval_data: Iterable[Any] | None, eval_every: int | None, history: History,
                   continued: bool) -> None:
    """The processes agree on fit's arguments and start; a num_steps already passed warns."""
    step = int(self.state.step)
    check_agreement("fit arguments", {
        "num_steps": num_steps, "epochs": epochs, "eval_every": eval_every,
        "eval_data": eval_data is not None, "step": step,
        "in_flight": self._loop.in_flight is not None, "resumed_from": history.resumed_from,
        "continues the data stream of the last fit": continued,
    }, hint=_SAME_STEPS)
    if num_steps is not None and step > num_steps:
      _LOG.warning(
          "fit(num_steps=%d) trains nothing: the state is already at step %d%s. num_steps"
          " counts every update, resumed ones included; pass a larger total.",
          num_steps, step,
          "" if history.resumed_from is None else f" (resumed from checkpoint step"
          f" {history.resumed_from})")

  def _progress(self, num_steps: int | None, resumed_from: int | None) -> Progress:
    """The started progress report (process 0 reports)."""
    reporting = jax.process_index() == 0
    progress = Progress(
        total_steps=num_steps, mode=self.config.progress if reporting else "off",
        log_every=self.config.log_every,
        metrics_path=self._metrics_path() if reporting else None,
        batch_size=self._batch_size(),
    )
    progress.start(int(self.state.step), resumed_from=resumed_from, setup=describe_run(
        self.plan, backend=self.backend, pipelining=self.config.pipelining,
        batch_size=self._batch_size()))
    return progress

  def _step_end(self, history: History, progress: Progress, callbacks: Sequence[Callback],
                eval_data: Iterable[Any] | None, eval_every: int | None) -> StepEnd:
    return StepEnd(
        owner=self, history=history, progress=progress, callbacks=callbacks,
        evaluate=None if eval_data is None else lambda: self.evaluate(eval_data),
        eval_every=eval_every,
        save=None if self._checkpoints is None else lambda state: self._save(state, callbacks),
        wait_for_saves=lambda: None if self._checkpoints is None else self._checkpoints.wait(),
        save_every=self.config.save_every,
        save_on_nonfinite=self.config.save_on_nonfinite,
    )

  def _example_batch(self, train_data) -> DeviceBatch | None:
    """A batch to take shapes from when the stream has nothing left."""
    if self._loop is not None and self._loop.in_flight is not None:
      return self._loop.in_flight.batch
    if self._steps is not None and self._resume_step() is None:
      return None  # Built, and no newer checkpoint to restore: nothing to start.
    iterator = iter(train_data)
    if iterator is train_data:
      return None
    raw = next(iterator, None)
    return None if raw is None else self.prepare(raw)

  def _data_position(self, after_interruption: bool) -> dict[str, Any]:
    """Where fit's data starts: in the checkpoint fit resumes (newer than the state), or
    where the state left it after an interruption, or at 0. With "batch_in_flight": True
    where that state holds a batch whose update is still to run (pipelined)."""
    step = self._resume_step()
    while step is not None:
      try:  # A step found damaged here (renamed by hand, say) is marked and skipped.
        meta = self._restore_marking_damage(step, lambda: self._checkpoints.read_meta(step))
      except DamagedStep:
        step = self._resume_step()  # The one before it; _start refuses when none restores.
        continue
      return {**own_position(meta.get("data") or {}),
              "batch_in_flight": bool(meta.get("has_in_flight"))}
    if after_interruption and self._loop is not None:
      return {**self._loop.data, "batch_in_flight": self._loop.in_flight is not None}
    return {}

  def _resume_step(self) -> int | None:
    """The checkpoint fit resumes from: the latest, when newer than the state, or whenever
    evaluate or predict adopted only a checkpoint's train state (also an older one, after
    the adopted step was found damaged); else None."""
    if self._state_only_from is not None:
      return self._checkpoints.latest_step()
    return self._newer_checkpoint_step()

  def _newer_checkpoint_step(self) -> int | None:
    """The latest checkpoint's step when it is newer than the state's, else None."""
    step = None if self._checkpoints is None else self._checkpoints.latest_step()
    if step is None or (self.state is not None and int(self.state.step) >= step):
      return None
    return step

  def _restore_target(self) -> TrainState:
    """What a restore fills: the state, or before there is one its abstract template."""
    return self._state_template() if self.state is None else self.state

  def _adopt_newer_checkpoint(self) -> None:
    """evaluate and predict: the train state of a checkpoint newer than the state.

    A Trainer built on a workdir evaluates what was trained there, not its
    initial values. Only the train state is restored: fit later resumes the
    same checkpoint with its in-flight batch and data position.
    """
    while True:
      step = self._newer_checkpoint_step()
      if step is None:
        return
      try:
        self.state = self._restore_marking_damage(step, lambda: self._checkpoints.restore_state(
            step, self._restore_target()))
      except DamagedStep:
        continue  # marked damaged: latest_step now skips it
      self._state_only_from = step
      return

  def _next(self, prefetcher: Prefetcher, use: BatchUse = "training") -> Prepared | None:
    """The next prepared batch of the `use` data, or None when the data of any process ended
    (`next_agreed`); a stop requested on any process sets `_stop`."""
    prepared, stop = next_agreed(prefetcher, self._any_process, self._stop_requested.is_set,
                                 use)
    if stop:
      self._stop.set()  # agreed here, at no extra exchange (`Schedule.stop_agreed`)
    return prepared

  def _data_ended(self, prefetcher: Prefetcher) -> bool:
    """Whether the data of any process ends here; the next batch stays in `prefetcher`."""
    return data_ended_agreed(prefetcher, self._any_process)

  # --- evaluation -----------------------------------------------------------------

  def _used_up(self, data: Iterable[Any]) -> bool:
    """Whether `data` is a one-shot iterator that a recent evaluate or predict iterated."""
    return any(used is data for used in self._used_one_shot)

  def _prepared(self, data: Iterable[Any], use: BatchUse) -> Iterator[DeviceBatch]:
    """The staged batches of `data` (evaluate or predict), built on the first one."""
    check_iterable(data, f"the {use} data")
    check_not_one_batch(data, f"the {use} data")
    if is_one_shot(data) and not self._used_up(data):
      self._used_one_shot.append(data)
    with Prefetcher(iter(data), lambda raw, index: self._stager.stage(raw, use, index).batch,
                    depth=self.config.prefetch_depth,
                    workers=self.config.prefetch_workers) as prefetcher:
      first = True
      while (prepared := self._next(prefetcher, use)) is not None:
        if first:
          self._build(prepared.batch)
          self._adopt_newer_checkpoint()
          self._refuse_to_start_over()
          self._ensure_state()
          first = False
        yield prepared.batch

  def evaluate(self, data: Iterable[Any]) -> dict[str, float]:
    """The loss and the loss's aux metrics, and the configured metrics; no updates.

    "loss" and every aux metric of loss_fn (its (loss, aux dict) form) are
    means over the batches weighted by their sizes: sum_b n_b m_b / sum_b n_b.
    "auc" (`TrainerConfig.eval_metrics`) is computed over all samples at once.

    Every batch needs "sparse" and "labels" (and "dense" if the model reads
    it). A pipelined trainer evaluates the current tables (any in-flight
    batch is not applied by evaluation). With a workdir whose latest
    checkpoint is newer than the trainer's state (a new Trainer on a trained
    workdir), that checkpoint's state is restored first (as predict does);
    a later fit resumes it with its in-flight batch and data position.

    Raises:
      ValueError: a batch that lacks labels or differs from the first
        (`pipelining._batch_check`); with eval_metrics=("auc",), labels that
        are not binary or predictions with other than one score per label
        (the message says to pass eval_metrics=() for such a model), or an
        aux metric named "auc" as well.
      CorruptCheckpointError: the workdir holds checkpoint steps but none of
        them restores, and the state is at step 0 (or none): it is not
        evaluated beside them (as in fit).
    """
    predictions, labels, per_batch, sizes = [], [], [], []
    with contextlib.closing(self._prepared(data, "evaluation")) as batches:
      for batch in batches:
        check_labels_fit_predictions(self._prediction_shapes, batch.labels)
        preds, metrics = self._steps.evaluate(self.state, batch)
        predictions.append(per_sample(host_tree(preds), self._batch_size(), "evaluate"))
        labels.append(host_tree(batch.labels))
        per_batch.append({name: float(value) for name, value in metrics.items()})
        sizes.append(jax.tree.leaves(predictions[-1])[0].shape[0])
    return evaluation_metrics(per_batch, sizes, labels, predictions, self.config.eval_metrics)

  def predict(self, data: Iterable[Any]) -> Any:
    """The model's predictions for every batch of `data`, concatenated.

    A batch needs only what the model reads: "sparse", and "dense" when the
    Trainer's batches carried it (the model is called as it was built, even
    when it ignores the dense features); its labels, if any, are ignored and
    the loss is not computed. Predictions in
    a pytree come back in that pytree, each leaf concatenated. With several
    processes each feeds its slice of every batch and every process gets the
    predictions of the whole global batches. With a workdir, a newer
    checkpoint is restored first, as in evaluate, which also says when it
    raises CorruptCheckpointError.
    """
    with contextlib.closing(self._prepared(data, "prediction")) as batches:
      predictions = [per_sample(host_tree(self._steps.predict(self.state, batch)),
                                 self._batch_size(), "predict") for batch in batches]
    if not predictions:
      raise no_batches_error("predict")
    return jax.tree.map(lambda *leaves: np.concatenate(leaves), *predictions)

  # --- checkpoints, bookkeeping ---------------------------------------------------

  def _save(self, state: LoopState, callbacks: Sequence[Callback]) -> bool:
    """Starts saving `state` as its step (with a workdir); `on_save` follows the start.

    Returns:
      False when there is nothing to save to, or that step exists already.
    """
    if self._checkpoints is None or state is None:
      return False
    step = int(state.train.step)
    saved = self._checkpoints.save(
        step, state.train, self._saved_in_flight(state), share_position(dict(state.data)),
        pipelining=self.config.pipelining,
    )
    if saved:  # Not again for a step saved already (the final save after a save_every one).
      call_each(callbacks, "on_save", self, step)
    return saved

  def _saved_in_flight(self, state: LoopState) -> SavedInFlight | FeatureInFlight | None:
    """The in-flight batch in its layout-free form (`pipelining._in_flight`).

    A batch restored from a layout-specific checkpoint has no raw ids: it is
    saved in that form again.
    """
    if state.in_flight is None:
      return None
    activations = self._steps.feature_activations(state.in_flight.stacked_activations)
    if state.in_flight_ids is None:
      return FeatureInFlight(activations, state.in_flight.batch)
    local = len(self._local_devices)
    ids = state.in_flight_ids
    if isinstance(ids, DroppedIds):
      ids = self._stager.kept_ids(ids)
    rows = id_rows(ids, self.plan.feature_specs,
                   padding_id=self.config.padding_id, share=local,
                   num_devices=self.plan.num_devices)
    ids = to_global(rows_tree(rows), self.plan.row_sharding(), self.plan.num_devices, local,
                    "in-flight ids")
    batch = state.in_flight.batch
    return SavedInFlight(dict(activations), batch.dense, batch.labels, ids)

  def _finish_saves_after_error(self) -> None:
    """Lets a periodic save still being written finish, without hiding the error.

    With one process the latest complete checkpoint is then as recent as it
    can be when the exception ends the program. With several, the processes
    are not waited for: the fail-fast exit (inside `with initialize_distributed(...)`) must
    stop the job without depending on the other processes.
    """
    if self._checkpoints is None or jax.process_count() > 1:
      return
    try:
      self._checkpoints.wait()
    except Exception as error:  # noqa: BLE001 - the original exception is the one to raise
      _LOG.warning("a checkpoint save that was in progress when fit failed failed too: %s",
                   error)

  def _metrics_path(self):
    if self.config.workdir is None:
      return None
    self.config.workdir.mkdir(parents=True, exist_ok=True)
    return self.config.workdir / "metrics.jsonl"

  def _batch_size(self) -> int:
    return max(f.batch_size for f in self.plan.feature_specs)


def _step_or_zero(state: TrainState | None) -> int:
  """The state's step, or 0 without a state or once its step was donated away."""
  if state is None:
    return 0
  step = state.step
  if isinstance(step, jax.Array) and step.is_deleted():
    return 0
  return int(step)
