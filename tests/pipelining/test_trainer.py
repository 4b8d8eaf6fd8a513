"""Trainer trajectories against an independent dense reference.

The reference is written here with dense numpy tables: lookups are plain
gathers and sums over the logical tables, dense gradients come from jax.grad
of the same Linen model, and the sparse optimizers are the textbook formulas.
"""

from __future__ import annotations

import dataclasses
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

from pipelining import Callback, Trainer
from sc_framework import FeatureSpec, TableSpec
from sc_framework.optimizers import SGD, Adagrad
from sc_framework.preprocessing import PartitionOverflowError, preprocess
from sc_framework.stacking import unstack
from tests.numerics import assert_close, assert_same_bits

BATCH = 8
# The longest float32 sum behind a value: a row of table "a" gets the
# gradients of all its ids in a batch (features fa and fa2: BATCH * 4).
TERMS = BATCH * 4
DENSE_LR = 0.05
SPARSE_LR = 0.3


class LinearHead(nn.Module):
  @nn.compact
  def __call__(self, activations, dense):
    x = jnp.concatenate([activations["fa"], activations["fb"], activations["fa2"], dense], axis=1)
    return nn.Dense(1)(jnp.tanh(nn.Dense(6)(x)))[:, 0]


def mse(predictions, labels):
  return jnp.mean((predictions - labels) ** 2)


def make_specs(optimizer):
  table_a = TableSpec("a", 40, 4, optimizer=optimizer, max_ids_per_partition=64,
                      max_unique_ids_per_partition=64)
  table_b = TableSpec("b", 24, 4, optimizer=optimizer, max_ids_per_partition=64,
                      max_unique_ids_per_partition=64)
  return [FeatureSpec("fa", table_a, (BATCH, 3)), FeatureSpec("fb", table_b, (BATCH, 2)),
          FeatureSpec("fa2", table_a, (BATCH, 1))]


def make_batches(count, seed):
  rng = np.random.default_rng(seed)
  batches = []
  for _ in range(count):
    fa = rng.integers(0, 40, (BATCH, 3))
    fa[rng.uniform(size=fa.shape) < 0.2] = -1
    fa[:, 0] = rng.integers(0, 40, BATCH)  # every sample has an id
    fa[0, 1] = fa[0, 0]  # a duplicate id in one sample
    batches.append({
        "sparse": {"fa": fa, "fb": rng.integers(0, 24, (BATCH, 2)),
                   "fa2": rng.integers(0, 40, (BATCH, 1))},
        "dense": rng.normal(size=(BATCH, 3)).astype(np.float32),
        "labels": rng.normal(size=BATCH).astype(np.float32),
    })
  return batches


TABLE_OF = {"fa": "a", "fb": "b", "fa2": "a"}


def reference_lookup(tables, sparse):
  out = {}
  for feature, ids in sparse.items():
    rows = tables[TABLE_OF[feature]][np.maximum(ids, 0)] * (ids >= 0)[..., None]
    out[feature] = rows.sum(axis=1)
  return out


def reference_sparse_update(tables, slots, sparse, activation_grads, kind):
  grads = {name: np.zeros_like(table) for name, table in tables.items()}
  touched = {name: np.zeros(len(table), bool) for name, table in tables.items()}
  for feature, ids in sparse.items():
    name = TABLE_OF[feature]
    for b in range(ids.shape[0]):
      for i in ids[b]:
        if i >= 0:
          grads[name][i] += activation_grads[feature][b]
          touched[name][i] = True
  for name in tables:
    rows = touched[name]
    g = grads[name][rows]
    if kind == "sgd":
      tables[name][rows] -= SPARSE_LR * g
    else:
      slots[name][rows] += g * g
      tables[name][rows] -= SPARSE_LR * g / np.sqrt(slots[name][rows])


def reference_run(model, params, tables, batches, *, pipelined, kind):
  tables = {k: np.array(v, np.float64) for k, v in tables.items()}
  slots = {k: np.full_like(v, 0.1) for k, v in tables.items()}
  optimizer = optax.sgd(DENSE_LR)
  opt_state = optimizer.init(params)

  def objective(p, activations, batch):
    return mse(model.apply({"params": p}, activations, batch["dense"]), batch["labels"])

  grad_fn = jax.jit(jax.grad(objective, argnums=(0, 1)))
  in_flight = reference_lookup(tables, batches[0]["sparse"]) if pipelined else None
  for k, batch in enumerate(batches):
    if pipelined:
      activations = in_flight
      if k + 1 < len(batches):
        in_flight = reference_lookup(tables, batches[k + 1]["sparse"])  # reads T_k
    else:
      activations = reference_lookup(tables, batch["sparse"])
    activations32 = {k2: jnp.asarray(v, jnp.float32) for k2, v in activations.items()}
    param_grads, act_grads = grad_fn(params, activations32, batch)
    updates, opt_state = optimizer.update(param_grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    reference_sparse_update(tables, slots, batch["sparse"],
                            {k2: np.asarray(v, np.float64) for k2, v in act_grads.items()}, kind)
  return params, tables


def logical_tables(trainer):
  stacked = {k: np.asarray(jax.device_get(v)) for k, v in trainer.state.embeddings.tables.items()}
  return unstack(stacked, trainer.plan.layout)


def mesh_of(devices):
  return jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("devices",))


def run_trainer(kind, pipelining, batches, devices=1):
  optimizer = SGD(SPARSE_LR) if kind == "sgd" else Adagrad(SPARSE_LR)
  trainer = Trainer(LinearHead(), make_specs(optimizer), mse, optax.sgd(DENSE_LR),
                    mesh=mesh_of(devices), pipelining=pipelining, progress="off", padding_id=-1)
  trainer.initialize(batches[0])
  initial_tables = logical_tables(trainer)
  initial_params = jax.device_get(trainer.state.params)
  history = trainer.fit(batches)
  return trainer, history, initial_tables, initial_params


@pytest.mark.parametrize("kind", ["sgd", "adagrad"])
@pytest.mark.parametrize("pipelining", [True, False])
def test_trajectory_matches_reference(kind, pipelining):
  batches = make_batches(6, seed=3 if kind == "sgd" else 4)
  trainer, history, tables0, params0 = run_trainer(kind, pipelining, batches)
  params, tables = reference_run(LinearHead(), params0, tables0, batches,
                                 pipelined=pipelining, kind=kind)
  assert history.final_step == len(batches) == int(trainer.state.step)
  got = logical_tables(trainer)
  for name in tables:
    assert_close(got[name], tables[name], terms=TERMS, steps=len(batches))
  jax.tree.map(lambda a, b: assert_close(a, b, terms=TERMS, steps=len(batches)),
               jax.device_get(trainer.state.params), params)


def test_pipelined_differs_from_synchronous():
  """The stale lookups are real: the two modes give different tables."""
  batches = make_batches(4, seed=5)
  on, _, _, _ = run_trainer("sgd", True, batches)
  off, _, _, _ = run_trainer("sgd", False, batches)
  with pytest.raises(AssertionError, match="differ by more than"):
    assert_close(logical_tables(on)["a"], logical_tables(off)["a"], terms=TERMS, steps=len(batches))


@pytest.mark.parametrize("length", [1, 2, 7])
@pytest.mark.parametrize("pipelining", [True, False])
def test_every_batch_applied_once(length, pipelining):
  batches = make_batches(length, seed=10 + length)
  trainer, history, tables0, params0 = run_trainer("adagrad", pipelining, batches)
  assert int(trainer.state.step) == length
  assert history.steps == list(range(1, length + 1))
  _, tables = reference_run(LinearHead(), params0, tables0, batches, pipelined=pipelining,
                            kind="adagrad")
  assert_close(logical_tables(trainer)["b"], tables["b"], terms=TERMS, steps=length)


@pytest.mark.parametrize("pipelining", [True, False])
def test_eight_devices_equal_one(pipelining):
  batches = make_batches(5, seed=21)
  one, _, _, _ = run_trainer("adagrad", pipelining, batches, devices=1)
  eight, _, _, _ = run_trainer("adagrad", pipelining, batches, devices=8)
  for name, table in logical_tables(one).items():
    assert_close(logical_tables(eight)[name], table, terms=TERMS, steps=len(batches))
  jax.tree.map(lambda a, b: assert_close(a, b, terms=TERMS, steps=len(batches)),
               jax.device_get(one.state.params), jax.device_get(eight.state.params))


def _compiles(caplog, name):
  return sum(f"compilation of jit({name})" in record.getMessage() for record in caplog.records)


def test_step_compiles_once(caplog):
  """Batches of different content reuse one compiled step."""
  caplog.set_level("WARNING")
  with jax.log_compiles(True):
    trainer, _, _, _ = run_trainer("sgd", True, make_batches(6, seed=30))
    assert _compiles(caplog, "pipelined_body") == 1
    caplog.clear()
    trainer.fit(make_batches(4, seed=31))
  assert _compiles(caplog, "pipelined_body") == 0
  assert _compiles(caplog, "prime_body") == 0


class Boom(RuntimeError):
  pass


def failing_data(batches, fail_at):
  for index, batch in enumerate(batches):
    if index == fail_at:
      raise Boom(f"data source failed at batch {index}")
    yield batch


@pytest.mark.parametrize("pipelining", [True, False])
def test_data_exception_reaches_caller(pipelining):
  batches = make_batches(5, seed=40)
  trainer = Trainer(LinearHead(), make_specs(SGD(0.1)), mse, optax.sgd(0.1),
                    mesh=mesh_of(1), pipelining=pipelining, progress="off", padding_id=-1)
  with pytest.raises(Boom, match="failed at batch 3") as info:
    trainer.fit(failing_data(batches, 3))
  assert any(entry.name == "failing_data" for entry in info.traceback)


def test_bad_id_error_names_feature():
  batches = make_batches(2, seed=41)
  batches[1]["sparse"]["fb"][2, 1] = 24
  trainer = Trainer(LinearHead(), make_specs(SGD(0.1)), mse, optax.sgd(0.1),
                    mesh=mesh_of(1), progress="off", padding_id=-1)
  with pytest.raises(ValueError, match="fb"):
    trainer.fit(batches)


def test_nonfinite_loss_stops_with_step():
  batches = make_batches(4, seed=42)
  batches[2]["labels"][0] = np.nan
  trainer = Trainer(LinearHead(), make_specs(SGD(0.1)), mse, optax.sgd(0.1),
                    mesh=mesh_of(1), pipelining=False, progress="off", padding_id=-1)
  from pipelining import NonFiniteLossError

  with pytest.raises(NonFiniteLossError, match="step 3"):
    trainer.fit(batches)
  assert int(trainer.state.step) == 2
  assert all(np.isfinite(v).all() for v in logical_tables(trainer).values())


def test_evaluate_and_predict_do_not_update():
  batches = make_batches(3, seed=43)
  trainer, _, _, _ = run_trainer("sgd", True, batches)
  before = logical_tables(trainer)
  # AUC (the default eval_metrics) needs binary labels.
  metrics = trainer.evaluate([{**b, "labels": (b["labels"] > 0).astype(np.float32)}
                              for b in batches])
  predictions = trainer.predict(batches)
  assert predictions.shape == (3 * BATCH,)
  assert set(metrics) == {"loss", "auc"}
  for name, table in logical_tables(trainer).items():
    assert_same_bits(table, before[name])


def test_config_errors_name_the_option():
  from pipelining import TrainerConfig

  with pytest.raises(ValueError, match="host_memory must be 'keep' or 'system', got 'fast'"):
    TrainerConfig(host_memory="fast")
  with pytest.raises(ValueError, match="save_every needs a workdir"):
    TrainerConfig(save_every=10)
  with pytest.raises(ValueError, match=r"TrainerConfig.save_every must be None or an int >= 1,"
                                       r" got True"):
    TrainerConfig(save_every=True, workdir="unused")
  with pytest.raises(ValueError, match=r"TrainerConfig.prefetch_depth must be an int >= 1, got 0"):
    TrainerConfig(prefetch_depth=0)
  for name in ("pipelining", "allow_id_dropping", "save_on_nonfinite"):
    with pytest.raises(TypeError, match=rf"TrainerConfig.{name} must be True or False, got 'no'"):
      TrainerConfig(**{name: "no"})
  # A float or string seed failed only inside the first fit, in JAX's words.
  for seed in (1.5, "0", True, None):
    with pytest.raises(TypeError, match=rf"TrainerConfig.seed must be an int .*got {seed!r}"):
      TrainerConfig(seed=seed)
  assert TrainerConfig(seed=np.int64(7)).seed == 7
  # 2**70 was a bare OverflowError inside the first fit; 2**32 started the run of seed 0.
  for seed in (2**70, 2**32, -2**31 - 1):
    with pytest.raises(ValueError, match=rf"TrainerConfig.seed must be in \[-2\*\*31, 2\*\*32\)"
                                         rf".*got {seed}"):
      TrainerConfig(seed=seed)
  assert TrainerConfig(seed=-1).seed == -1 and TrainerConfig(seed=2**32 - 1).seed == 2**32 - 1
  with pytest.raises(ValueError, match=r"TrainerConfig.workdir is '': pass None for no"):
    TrainerConfig(workdir="")  # was the current directory
  with pytest.raises(TypeError, match=r"eval_metrics must be a sequence of metric names.*'auc'"):
    TrainerConfig(eval_metrics="auc")  # was: unknown metrics ['a', 'u', 'c']
  with pytest.raises(TypeError, match=r"eval_metrics must be a sequence of metric names.*None"):
    TrainerConfig(eval_metrics=None)
  with pytest.raises(ValueError, match=r"unknown metrics \['bogus'\]"):
    TrainerConfig(eval_metrics=(m for m in ["bogus"]))  # a generator is read once
  config = TrainerConfig(eval_metrics=["auc"])
  assert config.eval_metrics == ("auc",) and hash(config) == hash(TrainerConfig())
  with pytest.raises(TypeError, match=r"dense_optimizer must be an optax.GradientTransformation"
                                      r" .*got 'adam'"):
    Trainer(LinearHead(), make_specs(SGD(SPARSE_LR)), mse, "adam", mesh=mesh_of(1))


def test_fit_refuses_callbacks_that_are_not_callbacks_and_empty_eval_data_before_training():
  trainer = Trainer(LinearHead(), make_specs(SGD(SPARSE_LR)), mse, optax.sgd(DENSE_LR),
                    mesh=mesh_of(1), progress="off", padding_id=-1, eval_metrics=())
  batches = make_batches(2, seed=47)
  with pytest.raises(TypeError, match=r"callbacks must be pipelining.Callback objects .* lacks"
                                      r" \['on_fit_start', 'on_step_end'"):
    trainer.fit(batches, callbacks=[lambda *args: None])
  with pytest.raises(TypeError, match=r"callbacks must be a sequence of pipelining.Callback"
                                      r" objects .* got <function"):
    trainer.fit(batches, callbacks=lambda *args: None)  # was "'function' object is not iterable"
  with pytest.raises(TypeError, match=r"fit's train_data must be an iterable of batches .* got"
                                      r" NoneType None"):
    trainer.fit(None)  # was "'NoneType' object is not iterable"
  with pytest.raises(TypeError, match=r"the evaluation data must be an iterable of batches"):
    trainer.evaluate(5)

  class MapStyle:  # a dataset of __getitem__ and __len__ alone, which iter() takes
    def __len__(self):
      return len(batches)

    def __getitem__(self, index):
      return batches[index]

  fresh = Trainer(LinearHead(), make_specs(SGD(SPARSE_LR)), mse, optax.sgd(DENSE_LR),
                  mesh=mesh_of(1), progress="off", padding_id=-1, eval_metrics=())
  assert fresh.fit(MapStyle()).final_step == len(batches)
  with pytest.raises(ValueError, match=r"eval_data is empty: fit would fail at its first"
                                       r" evaluation, after training"):
    trainer.fit(batches, eval_data=[])
  assert trainer.state is None  # refused before any step

  class Count(Callback):
    steps = 0

    def on_step_end(self, trainer, step, metrics):
      Count.steps += 1

  trainer.fit(batches, callbacks=Count())  # one Callback alone is taken as the sequence of it
  assert Count.steps == 2

  class DuckTyped:  # every hook, no base class: as examples/dlrm.py's StepClock
    def __init__(self):
      self.calls = []

    def __getattr__(self, name):
      if not name.startswith("on_"):
        raise AttributeError(name)
      return lambda *args: self.calls.append(name)

  duck = DuckTyped()
  trainer.fit(batches, callbacks=[duck])
  assert duck.calls[0] == "on_fit_start" and duck.calls.count("on_step_end") == 2


@pytest.mark.parametrize("arguments, message", [
    (dict(num_steps=True), "num_steps must be None or an int >= 0, got True"),
    (dict(num_steps=-1), "num_steps must be None or an int >= 0, got -1"),
    (dict(eval_every=0, eval_data=[]), "eval_every must be None or an int >= 1, got 0"),
    (dict(epochs=1.5), "epochs must be None or an int >= 1, got 1.5"),
])
def test_fit_argument_errors_name_the_argument(arguments, message):
  trainer = Trainer(LinearHead(), make_specs(SGD(SPARSE_LR)), mse, optax.sgd(DENSE_LR),
                    mesh=mesh_of(1), progress="off", padding_id=-1)
  with pytest.raises(ValueError, match=message):
    trainer.fit(make_batches(2, seed=41), **arguments)


def test_eval_every_refuses_one_shot_eval_data_before_training():
  """A generator is exhausted by the first evaluation: the second would fail mid-fit."""
  trainer = Trainer(LinearHead(), make_specs(SGD(SPARSE_LR)), mse, optax.sgd(DENSE_LR),
                    mesh=mesh_of(1), progress="off", padding_id=-1, eval_metrics=())
  held_out = make_batches(2, seed=45)
  with pytest.raises(ValueError, match=r"eval_every=2 evaluates eval_data several times.*"
                                       r" one-shot generator"):
    trainer.fit(make_batches(4, seed=44), eval_data=(b for b in held_out), eval_every=2)
  assert trainer.state is None  # refused before any step
  history = trainer.fit(make_batches(4, seed=44), eval_data=held_out, eval_every=2)
  assert [step for step, _ in history.evaluations] == [2, 4]
  # Evaluated once at the end when the last step is not an eval_every one.
  history = trainer.fit(make_batches(3, seed=46), eval_data=iter(held_out))
  assert [step for step, _ in history.evaluations] == [7]


def _tight_specs(max_ids=4, max_unique=4):
  """make_specs with partition limits of 4: the test batches overflow them."""
  tight = [dataclasses.replace(spec, table=dataclasses.replace(
               spec.table, max_ids_per_partition=max_ids, max_unique_ids_per_partition=max_unique))
           for spec in make_specs(SGD(SPARSE_LR))]
  # Features that share table "a" must carry the same (replaced) TableSpec.
  tight[2] = dataclasses.replace(tight[2], table=tight[0].table)
  return tight


def test_an_overflow_gives_advice_the_trainer_can_follow():
  """preprocess's advice names its own `capacities=`; the Trainer's names its options."""
  trainer = Trainer(LinearHead(), _tight_specs(), mse, optax.sgd(DENSE_LR), mesh=mesh_of(1),
                    progress="off", padding_id=-1)
  with pytest.raises(PartitionOverflowError, match=r"partition overflow in stack .* to at least"
                     r" \d+ and max_unique_ids_per_partition to at least \d+ .*"
                     r" allow_id_dropping=True to the Trainer") as error:
    trainer.fit(make_batches(2, seed=40))
  assert "capacities=" not in str(error.value)
  assert str(error.value).startswith("batch 0 of the training data: partition overflow")
  assert error.value.stack and error.value.finding  # still the preprocessing's error


def test_an_overflow_of_one_limit_advises_raising_that_one():
  """The advice named both limits, the one not exceeded at a value below its own."""
  batches = make_batches(2, seed=40)
  trainer = Trainer(LinearHead(), _tight_specs(max_ids=64), mse, optax.sgd(DENSE_LR),
                    mesh=mesh_of(1), progress="off", padding_id=-1)
  with pytest.raises(PartitionOverflowError) as error:
    trainer.fit(batches)
  advice = str(error.value).split("Raise the ", 1)[1]
  assert advice.startswith("max_unique_ids_per_partition to at least ")
  assert "max_ids_per_partition" not in advice and "tables ['a'" in advice
  needed = error.value.needed.max_unique_ids_per_partition
  followed = Trainer(LinearHead(), _tight_specs(max_ids=64, max_unique=needed), mse,
                     optax.sgd(DENSE_LR), mesh=mesh_of(1), progress="off", padding_id=-1)
  assert followed.fit(batches[:1]).final_step == 1


def test_dropped_ids_are_counted_and_warned_about_once(caplog):
  tight = _tight_specs()
  batches = make_batches(3, seed=40)
  trainer = Trainer(LinearHead(), tight, mse, optax.sgd(DENSE_LR), mesh=mesh_of(1),
                    progress="off", padding_id=-1, allow_id_dropping=True)
  with caplog.at_level("WARNING", logger="pipelining"):
    history = trainer.fit(batches)
  assert history.final_step == 3
  assert history.dropped_ids > 0 and trainer.dropped_ids == history.dropped_ids
  warnings = [r for r in caplog.records if "were dropped to fit the partition limits" in r.message]
  assert len(warnings) == 1
  # The count is what preprocessing reports for the same batches.
  expected = sum(
      preprocess(b["sparse"], trainer.plan.feature_specs, trainer.plan.layout, padding_id=-1,
                 allow_id_dropping=True)[1].num_dropped_ids for b in batches)
  assert history.dropped_ids == expected


@pytest.mark.parametrize("pipelining", [True, False])
def test_dropped_ids_of_the_fits_of_a_run_sum_to_the_runs_when_resumed(tmp_path, pipelining):
  """A fit stopped at num_steps has batches prefetched past the stop: they count in the fit
  that takes them into the run, whether this Trainer runs it or a new one resumes."""
  batches = make_batches(6, seed=41)

  def trainer(workdir):
    return Trainer(LinearHead(), _tight_specs(), mse, optax.sgd(DENSE_LR), mesh=mesh_of(1),
                   progress="off", padding_id=-1, allow_id_dropping=True, workdir=workdir,
                   pipelining=pipelining, prefetch_depth=3)

  whole = trainer(tmp_path / "whole").fit(batches).dropped_ids
  per_batch = [
      preprocess(b["sparse"], _tight_specs(), trainer(None).plan.layout, padding_id=-1,
                 allow_id_dropping=True)[1].num_dropped_ids for b in batches]
  assert whole == sum(per_batch) and min(per_batch) > 0
  first = trainer(tmp_path / "run")
  stopped = first.fit(batches, num_steps=3).dropped_ids
  # Pipelined, batch 3's lookup ran in the step that reached 3 (it is in flight).
  assert stopped == sum(per_batch[:4 if pipelining else 3])
  shutil.copytree(tmp_path / "run", tmp_path / "copy")
  assert stopped + first.fit(batches, num_steps=6).dropped_ids == whole
  assert stopped + trainer(tmp_path / "copy").fit(batches, num_steps=6).dropped_ids == whole


@pytest.mark.parametrize("host_memory, calls", [(None, 0), ("system", 0), ("keep", 1)])
def test_malloc_mode_changes_only_when_asked(monkeypatch, host_memory, calls):
  """Creating a Trainer changes no process-wide allocator setting by default."""
  from pipelining import _trainer

  made = []
  monkeypatch.setattr(_trainer, "keep_freed_memory", lambda: made.append(True) or True)
  options = {} if host_memory is None else {"host_memory": host_memory}
  Trainer(LinearHead(), make_specs(SGD(SPARSE_LR)), mse, optax.sgd(DENSE_LR),
          mesh=mesh_of(1), progress="off", **options)
  assert len(made) == calls


def test_backend_is_a_value_the_trainer_uses(monkeypatch):
  """A backend passed as a value runs every lookup and update.

  It has no stacked forms, so its activations are joined from the features' and
  its gradients split into them: another program than 'xla', equal up to the
  order of its sums."""
  from sc_framework.primitives import XLA_BACKEND, EmbeddingBackend

  calls = []

  def counted(fn, name):
    def wrapper(*args, **kwargs):
      calls.append(name)
      return fn(*args, **kwargs)
    return wrapper

  mine = EmbeddingBackend("counted", counted(XLA_BACKEND.lookup, "lookup"),
                          counted(XLA_BACKEND.apply_gradients, "update"))
  batches = make_batches(3, seed=4)
  results = []
  for backend in (mine, "xla"):
    trainer = Trainer(LinearHead(), make_specs(SGD(SPARSE_LR)), mse, optax.sgd(DENSE_LR),
                      mesh=mesh_of(2), progress="off", padding_id=-1, backend=backend)
    assert trainer.backend.name == ("counted" if backend is mine else "xla")
    trainer.fit(batches)
    results.append(logical_tables(trainer))
  assert "lookup" in calls and "update" in calls  # traced into the compiled steps
  for name in results[0]:
    assert_close(results[0][name], results[1][name], terms=TERMS, steps=len(batches),
                 err_msg=name)
  with pytest.raises(ValueError, match="unknown embedding backend 'nope'"):
    Trainer(LinearHead(), make_specs(SGD(SPARSE_LR)), mse, optax.sgd(DENSE_LR),
            mesh=mesh_of(1), progress="off", backend="nope")


@pytest.mark.parametrize("pipelining", [True, False])
def test_an_id_out_of_range_names_the_feature_and_the_batch(pipelining):
  batches = make_batches(4, seed=95)
  batches[2]["sparse"]["fb"][5, 1] = 24  # table b has 24 rows
  trainer = Trainer(LinearHead(), make_specs(SGD(0.1)), mse, optax.sgd(0.1), mesh=mesh_of(1),
                    pipelining=pipelining, progress="off", padding_id=-1)
  # The batch is in the message itself (str(e), as a log shows it), not only in a note.
  with pytest.raises(ValueError) as raised:
    trainer.fit(batches)
  assert re.match(r"batch 2 of the training data: .*'fb'.*24", str(raised.value)), raised.value
  with pytest.raises(ValueError) as raised:
    trainer.predict([batches[0], batches[2]])
  assert re.match(r"batch 1 of the prediction data: .*'fb'.*24", str(raised.value)), raised.value


def test_batches_without_dense_features_name_the_missing_entry_when_the_model_reads_it():
  """The model got dense=None and failed inside (concatenating None): its error
  keeps its type and message and gets a note naming the missing entry."""
  batches = [{k: v for k, v in b.items() if k != "dense"} for b in make_batches(2, seed=48)]
  trainer = Trainer(LinearHead(), make_specs(SGD(SPARSE_LR)), mse, optax.sgd(DENSE_LR),
                    mesh=mesh_of(1), progress="off", padding_id=-1)
  with pytest.raises(TypeError) as raised:
    trainer.fit(batches)
  assert any('The batches have no "dense" entry, so the model was called with dense=None' in note
             for note in getattr(raised.value, "__notes__", [])), raised.value

  class SparseOnly(nn.Module):
    @nn.compact
    def __call__(self, activations, dense):
      return nn.Dense(1)(jnp.concatenate([activations["fa"], activations["fb"]], axis=1))[:, 0]

  sparse_only = Trainer(SparseOnly(), make_specs(SGD(SPARSE_LR)), mse, optax.sgd(DENSE_LR),
                        mesh=mesh_of(1), progress="off", padding_id=-1)
  assert sparse_only.fit(batches).final_step == 2


class _LinenDot(nn.Module):
  """prediction_b = <a_fa[b], a_fb[b]>: a model without dense parameters."""

  @nn.compact
  def __call__(self, activations, dense):
    return jnp.sum(activations["fa"] * activations["fb"], axis=1)


class _NnxDot(nnx.Module):
  def __call__(self, activations, dense):
    return jnp.sum(activations["fa"] * activations["fb"], axis=1)


def _dot_reference(tables, batches):
  """float64 SGD on the tables of the dot model under the mean squared error."""
  tables = {name: table.astype(np.float64) for name, table in tables.items()}
  losses = []
  for batch in batches:
    fa, fb = batch["sparse"]["fa"], batch["sparse"]["fb"]
    a = np.stack([tables["a"][row[row >= 0]].sum(0) for row in fa])
    b = tables["b"][fb].sum(1)
    residual = (a * b).sum(1) - batch["labels"]
    losses.append(np.mean(residual ** 2))
    grad = 2 * residual[:, None] / len(residual)
    grad_a, grad_b = np.zeros_like(tables["a"]), np.zeros_like(tables["b"])
    for sample, row in enumerate(fa):
      np.add.at(grad_a, row[row >= 0], grad[sample] * b[sample])
    for sample, row in enumerate(fb):
      np.add.at(grad_b, row, grad[sample] * a[sample])
    tables = {"a": tables["a"] - SPARSE_LR * grad_a, "b": tables["b"] - SPARSE_LR * grad_b}
  return tables, losses


@pytest.mark.parametrize("devices", [1, 8])
@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_a_model_without_dense_parameters_trains_its_tables_and_resumes(api, devices, tmp_path):
  """A dot product of two towers has no dense parameters: the Trainer once raised a bare
  KeyError: 'params' for it (Linen)."""
  specs = make_specs(SGD(SPARSE_LR))[:2]
  batches = [dict(b, sparse={k: b["sparse"][k] for k in ("fa", "fb")})
             for b in make_batches(4, seed=devices)]

  def trainer():
    model = _LinenDot() if api == "linen" else _NnxDot()
    return Trainer(model, specs, mse, optax.sgd(DENSE_LR), mesh=mesh_of(devices),
                   pipelining=False, progress="off", padding_id=-1, workdir=tmp_path,
                   eval_metrics=())

  first = trainer()
  first.initialize(batches[0])
  initial = logical_tables(first)
  history = first.fit(batches[:2])
  resumed = trainer()
  history_after = resumed.fit(batches)
  assert history_after.resumed_from == 2
  expected_tables, expected_losses = _dot_reference(initial, batches)
  losses = [m["loss"] for m in history.metrics + history_after.metrics]
  assert_close(losses, expected_losses, terms=BATCH * 4, steps=4)
  for name, table in logical_tables(resumed).items():
    assert_close(table, expected_tables[name], terms=BATCH * 4, steps=4, err_msg=name)


@pytest.mark.parametrize("pipelining", [False, True])
def test_fit_from_a_callback_during_fit_is_refused(pipelining, tmp_path):
  """The inner fit ran, saving checkpoints that mixed both data streams, and the outer one
  then failed with "Array has been deleted"."""
  trainer = Trainer(LinearHead(), make_specs(SGD(SPARSE_LR)), mse, optax.sgd(DENSE_LR),
                    mesh=mesh_of(1), pipelining=pipelining, progress="off", padding_id=-1,
                    eval_metrics=(), workdir=tmp_path, save_every=1)
  batches = make_batches(4, seed=48)

  class Nested(Callback):
    def on_step_end(self, trainer, step, metrics):
      if step == 2:
        trainer.fit(make_batches(2, seed=49))

  with pytest.raises(RuntimeError, match=r"Trainer.fit during fit \(from a callback\)"):
    trainer.fit(batches, callbacks=[Nested()])
  assert int(trainer.state.step) == 2
  history = trainer.fit(batches)  # the same data goes on after the applied batches
  assert history.final_step == 4


def test_on_fit_end_gets_the_steps_applied_and_runs_for_every_callback_when_one_raises():
  """A fit that raised gave on_fit_end final_step 0 although steps 1 to 3 were applied, and
  an on_fit_end that raised kept the next callbacks' on_fit_end from running."""
  trainer = Trainer(LinearHead(), make_specs(SGD(SPARSE_LR)), mse, optax.sgd(DENSE_LR),
                    mesh=mesh_of(1), progress="off", padding_id=-1, eval_metrics=())
  ends = []

  class Raise(Callback):
    def __init__(self, at_step=None, at_end=False):
      self.at_step, self.at_end = at_step, at_end

    def on_step_end(self, trainer, step, metrics):
      if step == self.at_step:
        raise ValueError(f"boom at {step}")

    def on_fit_end(self, trainer, history):
      ends.append((self, history.final_step))
      if self.at_end:
        raise KeyError("boom at the end")

  first, second = Raise(at_step=3, at_end=True), Raise()
  with pytest.raises(KeyError, match="boom at the end"):
    trainer.fit(make_batches(5, seed=50), callbacks=[first, second])
  assert ends == [(first, 3), (second, 3)]
  assert int(trainer.state.step) == 3


@pytest.mark.parametrize("hook", ["on_fit_start", "on_step_end", "on_eval_end", "on_save"])
def test_every_callback_sees_the_event_another_callback_raised_on(hook, tmp_path):
  """A callback that raised kept the later callbacks from that event (a logger lost the
  step the fit stopped on). Each hook now runs on every callback; fit raises the first
  error, with the others noted on it."""
  trainer = Trainer(LinearHead(), make_specs(SGD(SPARSE_LR)), mse, optax.sgd(DENSE_LR),
                    mesh=mesh_of(1), progress="off", padding_id=-1, eval_metrics=(),
                    workdir=tmp_path / "run", save_every=1)
  seen = []

  class Record(Callback):
    def __init__(self, name, raises):
      self.name, self.raises = name, raises

    def _event(self, *args):
      step = args[1] if len(args) > 1 else None
      seen.append((self.name, step))
      if self.raises and step == (0 if hook == "on_fit_start" else 2):
        raise ValueError(f"{self.name} failed at {step}")

  for name in ("on_fit_start", "on_step_end", "on_eval_end", "on_save"):
    setattr(Record, name, Record._event if name == hook else getattr(Callback, name))
  first, second, third = Record("first", True), Record("second", False), Record("third", True)
  with pytest.raises(ValueError, match="first failed") as error:
    trainer.fit(make_batches(4, seed=51), callbacks=[first, second, third],
                eval_data=make_batches(1, seed=52), eval_every=1)
  stopped = 0 if hook == "on_fit_start" else 2
  assert [name for name, step in seen if step == stopped] == ["first", "second", "third"]
  assert max(step for _, step in seen) == stopped
  assert any("third failed" in note for note in error.value.__notes__)


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_from_a_callback_is_raised_at_once_over_earlier_errors(stop):
  """After a ValueError from one callback, another's Ctrl-C (or sys.exit) became a note on
  the ValueError: `except KeyboardInterrupt` never saw it, and the exit status was 1."""
  trainer = Trainer(LinearHead(), make_specs(SGD(SPARSE_LR)), mse, optax.sgd(DENSE_LR),
                    mesh=mesh_of(1), progress="off", padding_id=-1, eval_metrics=())
  called = []

  class Raise(Callback):
    def __init__(self, name, error):
      self.name, self.error = name, error

    def on_step_end(self, trainer, step, metrics):
      called.append(self.name)
      if step == 2 and self.error is not None:
        raise self.error(f"{self.name} at {step}")

  callbacks = [Raise("first", ValueError), Raise("second", stop), Raise("third", None)]
  with pytest.raises(stop) as raised:
    trainer.fit(make_batches(4, seed=53), callbacks=callbacks)
  assert called == ["first", "second", "third", "first", "second"]  # the third not at step 2
  assert any("ValueError: first at 2" in note for note in raised.value.__notes__)
  assert int(trainer.state.step) == 2
