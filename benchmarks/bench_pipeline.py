"""Training throughput with pipelining on vs off, and the stage times of a step.

Runs the Trainer with pipelining on and off on the same batches and times
each stage of a step alone on those batches: host preprocessing, embedding
lookup, dense forward/backward (+ optax) and the sparse update. Configurations
(`--config`, default all):

  dlrm      the DLRM example (examples/dlrm.py): 26 Zipf-distributed features
            of about 285k rows in all, dim 16, interaction + MLPs; the dense
            step dominates.
  tables26  26 tables x 100,000 rows x 64, batch 4,096, 1-20 uniform ids per
            sample, sum combiner, row-wise Adagrad, a small dense MLP: sparse
            and dense work are comparable.

Throughput: the two Trainers fit alternately, a few steps each per round, so
a load change on a shared machine hits both alike; a step's time is the mean
interval between consecutive `on_step_end` calls within a round (steady
state: no compile, prime or drain), the median over rounds. With N prefetch
workers batches arrive N at a time (the workers prepare them side by side),
so a round skips the first burst and times a whole number of bursts, at
least four (`timed_steps`); a median of single intervals would time the
short ones alone. Stage times are medians of repeated runs, in
wall-clock and in process CPU time (all threads).

Bounds printed with the stages: a synchronous step runs lookup, dense step
and update one after the other (host preprocessing runs on the prefetch
thread in both modes), so sync >= lookup + dense + update. A pipelined step
can overlap them, but no stage is split: pipelined >= largest stage, so
sync / largest stage bounds the ratio. The stages and the preprocessing also
need their CPU time on the machine's cores, which estimates a tighter bound,
  pipelined >~ max(largest stage, sum of stage CPU times / cores),
an estimate only: a stage's CPU time includes its idle threads' spinning.

The overlap a pipelined step can get is also measured directly: the lookup
of one batch and the dense step of another are independent, and the
pipelined step may run them side by side. They are timed one after the
other and side by side, dispatched from two threads (the CPU client runs
programs dispatched from one thread one at a time, from two threads at
once); the difference is what running them side by side gains on this
machine (none when each already keeps every core busy).

Last, the host preparation alone (Trainer.prepare through the Prefetcher,
as fit runs it) with 1, 2 and 4 prefetch workers (and N, below): the rate at
which the host can feed the devices. `--prefetch-workers N` trains both Trainers with N
workers (TrainerConfig.prefetch_workers, prefetch_depth max(2, N)): where
host preprocessing is the largest stage, as on an accelerator's host, more
workers are what can raise both modes' throughput.

Run: python benchmarks/bench_pipeline.py [--quick] [--config NAME] [--prefetch-workers N]
       [--json PATH]
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

# The repository root after site-packages: an installed sc-framework (with its built
# kernels) comes first; a checkout without an install runs from its sources.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402

from benchmarks._common import machine_info, parse_args, print_table, time_median, write_json  # noqa: E402
from examples import dlrm  # noqa: E402
from pipelining import Callback, Prefetcher, Trainer  # noqa: E402
from pipelining._model import as_dense_model  # noqa: E402
from sc_framework import FeatureSpec, TableSpec  # noqa: E402
from sc_framework.optimizers import RowWiseAdagrad  # noqa: E402
from sc_framework.preprocessing import collect_stats, size_limits_from_stats  # noqa: E402
from sc_framework.primitives import apply_embedding_gradients, embedding_lookup  # noqa: E402
from sc_framework.stacking import auto_stack_tables  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Case:
  """One benchmark configuration: features, dense model, loss and its batches.

  Attributes:
    name: the --config name.
    title: one line describing it.
    specs: the features (size limits already set from the data).
    model: the dense Linen model, model(activations, dense) -> predictions.
    loss_fn: (predictions, labels) -> scalar loss.
    batches: raw batches; the timed ones cycle through them.
    steps_per_round: timed steps per fit: each mode fits steps_per_round + 1
      batches per round (its first step and the drain are not timed).
    rounds: timed rounds (after one warm-up round).
  """

  name: str
  title: str
  specs: list[FeatureSpec]
  model: Any
  loss_fn: Callable[..., Any]
  batches: list[dict[str, Any]]
  steps_per_round: int
  rounds: int


def with_limits(specs: list[FeatureSpec], batches: list[dict[str, Any]]) -> list[FeatureSpec]:
  """The specs with partition limits from the batches' statistics (30% headroom)."""
  layout = auto_stack_tables(specs, jax.device_count())
  stats = collect_stats([b["sparse"] for b in batches], specs, layout, padding_id=-1)
  return list(size_limits_from_stats(specs, stats, layout=layout, headroom=1.3))


def dlrm_case(quick: bool) -> Case:
  batch_size, embedding_dim = (1024, 16) if quick else (2048, 16)
  source = dlrm.SyntheticCriteo(batch_size)
  batches = [source.batch(i) for i in range(16)]
  specs = with_limits(dlrm.build_feature_specs(batch_size, embedding_dim, 1.0), batches[:8])
  model = dlrm.build_model(embedding_dim, tuple(s.name for s in specs))
  return Case("dlrm", f"DLRM, batch {batch_size}, 26 tables (285k rows), dim {embedding_dim}",
              specs, model, dlrm.bce_loss, batches, steps_per_round=6 if quick else 12,
              rounds=5 if quick else 10)


class SmallMLP(nn.Module):
  """concat(activations..., dense) -> Dense(hidden) -> relu -> Dense(1)."""

  names: tuple[str, ...]
  hidden: int

  @nn.compact
  def __call__(self, activations, dense):
    x = jnp.concatenate([activations[name] for name in self.names] + [dense], axis=1)
    return nn.Dense(1)(nn.relu(nn.Dense(self.hidden)(x)))[:, 0]


TABLES, ROWS, DIM, MAX_IDS, HIDDEN = 26, 100_000, 64, 20, 128


def uniform_batch(index: int, batch_size: int) -> dict[str, Any]:
  """Batch `index`: per sample and feature 1-20 ids uniform in [0, ROWS), padded with -1."""
  rng = np.random.default_rng([7, index])
  sparse = {}
  for t in range(TABLES):
    ids = rng.integers(0, ROWS, size=(batch_size, MAX_IDS), dtype=np.int32)
    lengths = rng.integers(1, MAX_IDS + 1, size=batch_size)
    ids[np.arange(MAX_IDS)[None, :] >= lengths[:, None]] = -1
    sparse[f"f{t}"] = ids
  dense = rng.standard_normal((batch_size, 13), dtype=np.float32)
  labels = (rng.uniform(size=batch_size) < 0.5).astype(np.float32)
  return {"sparse": sparse, "dense": dense, "labels": labels}


def tables26_case(quick: bool) -> Case:
  batch_size = 4096
  batches = [uniform_batch(i, batch_size) for i in range(3 if quick else 6)]
  optimizer = RowWiseAdagrad(0.05)
  specs = [FeatureSpec(f"f{t}", TableSpec(f"t{t}", ROWS, DIM, optimizer=optimizer,
                                          combiner="sum"), (batch_size, MAX_IDS))
           for t in range(TABLES)]
  specs = with_limits(specs, batches)
  model = SmallMLP(tuple(s.name for s in specs), hidden=HIDDEN)
  return Case("tables26", f"{TABLES} tables x {ROWS:,} x {DIM}, batch {batch_size}, 1-{MAX_IDS}"
              f" uniform ids/sample, sum, row-wise Adagrad, MLP {TABLES * DIM + 13}-{HIDDEN}-1",
              specs, model, dlrm.bce_loss, batches, steps_per_round=3 if quick else 4,
              rounds=2 if quick else 5)


CASES = {"dlrm": dlrm_case, "tables26": tables26_case}


def make_trainer(case: Case, pipelining: bool, prefetch_workers: int = 1) -> Trainer:
  # host_memory="keep", as the examples train.
  return Trainer(case.model, case.specs, case.loss_fn, optax.adam(1e-3), pipelining=pipelining,
                 padding_id=-1, progress="off", host_memory="keep",
                 prefetch_depth=max(2, prefetch_workers), prefetch_workers=prefetch_workers)


class StepTimes(Callback):
  """Records the mean step time of each fit over its steady steps.

  `step_seconds` holds, per fit, the mean interval between consecutive step
  ends from step `skip` on, without the last one: a pipelined fit ends with
  the drain (an update without a lookup), which is not a steady-state step.
  """

  def __init__(self, skip: int = 0):
    self.skip = skip
    self.ends: list[float] = []
    self.step_seconds: list[float] = []

  def on_fit_start(self, trainer, step):
    self.ends = []

  def on_step_end(self, trainer, step, metrics):
    self.ends.append(time.perf_counter())

  def on_fit_end(self, trainer, history):
    timed = self.ends[self.skip:-1]
    self.step_seconds.append((timed[-1] - timed[0]) / (len(timed) - 1))


def timed_steps(steps_per_round: int, prefetch_workers: int) -> tuple[int, int]:
  """(steps skipped, step intervals timed) per fit.

  One worker: none skipped, steps_per_round - 1 timed. N > 1 workers prepare
  N batches side by side, so batches arrive in bursts of N, and a fit's
  first steps take the burst the workers prepared while it waited for its
  first batch: N steps are skipped and a whole number of bursts, at least 4,
  is timed (steps_per_round - 1 rounded up to a multiple of N).
  """
  if prefetch_workers == 1:
    return 0, steps_per_round - 1
  bursts = max(4, -(-(steps_per_round - 1) // prefetch_workers))
  return prefetch_workers, bursts * prefetch_workers


def cycle(batches: list[dict[str, Any]], start: int, count: int) -> list[dict[str, Any]]:
  return [batches[(start + i) % len(batches)] for i in range(count)]


def throughput(case: Case, trainers: dict[bool, Trainer],
               prefetch_workers: int) -> dict[bool, dict[str, float]]:
  """Step time (ms; median over rounds of a round's mean) and examples/s of each
  mode (trainers[pipelining]), fit alternately round by round."""
  skip, intervals = timed_steps(case.steps_per_round, prefetch_workers)
  clocks = {mode: StepTimes(skip) for mode in trainers}
  # Each fit: the skipped steps, the timed intervals' steps, the drain.
  batches_per_fit = skip + intervals + 2
  # One warm-up round compiles every program (prime, pipelined, drain, sync).
  position = 0
  for round_index in range(case.rounds + 1):
    for mode, trainer in trainers.items():
      clock = clocks[mode] if round_index else StepTimes()
      trainer.fit(cycle(case.batches, position, batches_per_fit), callbacks=[clock])
      jax.block_until_ready(trainer.state)
    position += batches_per_fit
  batch = case.batches[0]["labels"].shape[0]
  out = {}
  for mode, clock in clocks.items():
    step_s = statistics.median(clock.step_seconds)
    out[mode] = {"step_ms": 1e3 * step_s, "examples_per_sec": batch / step_s}
  return out


def stage_times(case: Case, trainer: Trainer, repeats: int) -> dict[str, dict[str, float]]:
  """Each stage of a step alone, on a trained (synchronous) Trainer's state:
  {"ms": wall median, "cpu_ms": CPU-time median}."""
  plan, state = trainer.plan, trainer.state
  prepared = [trainer.prepare(batch) for batch in case.batches]
  model = as_dense_model(case.model, jax.random.key(0),
                         {f.name: jnp.zeros(f.output_shape) for f in plan.feature_specs},
                         prepared[0].dense)
  optimizer = optax.adam(1e-3)
  backend = trainer.backend

  lookup = jax.jit(lambda tables, sparse: embedding_lookup(plan, tables, sparse, backend=backend))

  @jax.jit
  def dense_step(params, opt_state, activations, dense, labels):
    def loss(p, a):
      return case.loss_fn(model.apply(p, a, dense), labels)
    value, (grads, act_grads) = jax.value_and_grad(loss, argnums=(0, 1))(params, activations)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, act_grads

  update = jax.jit(
      lambda v, sparse, g: apply_embedding_gradients(plan, v, sparse, g, 0, backend=backend),
      donate_argnums=0)
  activations = lookup(state.embeddings.tables, prepared[0].sparse)
  params, opt_state = model.params, optimizer.init(model.params)
  _, _, act_grads = dense_step(params, opt_state, activations, prepared[0].dense,
                               prepared[0].labels)
  embeddings = [state.embeddings]

  def run_prepare(i):
    jax.block_until_ready(trainer.prepare(case.batches[i % len(case.batches)]))

  def run_lookup(i):
    jax.block_until_ready(lookup(embeddings[0].tables, prepared[i % len(prepared)].sparse))

  def run_dense(i):
    jax.block_until_ready(dense_step(params, opt_state, activations, prepared[0].dense,
                                     prepared[0].labels))

  def run_update(i):
    embeddings[0] = update(embeddings[0], prepared[i % len(prepared)].sparse, act_grads)
    jax.block_until_ready(embeddings[0])

  def run_lookup_then_dense(i):
    run_lookup(i)
    run_dense(i)

  with concurrent.futures.ThreadPoolExecutor(2) as pool:

    def run_lookup_beside_dense(i):
      for done in [pool.submit(run_lookup, i), pool.submit(run_dense, i)]:
        done.result()

    stages = {}
    for name, fn in (("host_preprocessing", run_prepare), ("lookup", run_lookup),
                     ("dense_fwd_bwd", run_dense), ("sparse_update", run_update),
                     (SEQUENTIAL, run_lookup_then_dense), (SIDE_BY_SIDE, run_lookup_beside_dense)):
      timed = time_median(fn, repeats)
      stages[name] = {"ms": 1e3 * timed["median_s"], "cpu_ms": 1e3 * timed["cpu_median_s"],
                      "faults": timed["faults_median"]}
  return stages


PREPARE_WORKERS = (1, 2, 4)


def preparation_rate(case: Case, trainer: Trainer, rounds: int,
                     worker_counts: list[int]) -> dict[int, float]:
  """Host preparation alone (Trainer.prepare through a Prefetcher, nothing
  consuming the batches but a wait for their device copies) with each number
  of workers, interleaved round by round: {workers: median ms per batch}."""
  count = 4 * len(case.batches)
  times: dict[int, list[float]] = {workers: [] for workers in worker_counts}
  for round_index in range(rounds + 1):
    for workers in worker_counts:
      data = cycle(case.batches, 0, count)
      start = time.perf_counter()
      with Prefetcher(iter(data), lambda raw, index: trainer.prepare(raw), depth=max(2, workers),
                      workers=workers) as prefetcher:
        for prepared in prefetcher:
          jax.block_until_ready(prepared.batch)
      if round_index:  # the first round warms up every setting
        times[workers].append(1e3 * (time.perf_counter() - start) / count)
  return {workers: statistics.median(values) for workers, values in times.items()}


# Not stages of a step: the lookup and the dense step, one after the other
# and side by side (see the module docstring).
SEQUENTIAL = "lookup, then dense"
SIDE_BY_SIDE = "lookup beside dense"


def run_case(case: Case, repeats: int, prefetch_workers: int = 1) -> dict[str, Any]:
  trainers = {mode: make_trainer(case, mode, prefetch_workers) for mode in (True, False)}
  result = throughput(case, trainers, prefetch_workers)
  stages = stage_times(case, trainers[False], repeats)
  preparation = preparation_rate(case, trainers[False], max(2, repeats // 3),
                                 sorted({*PREPARE_WORKERS, prefetch_workers}))
  overlap = {name: stages.pop(name) for name in (SEQUENTIAL, SIDE_BY_SIDE)}
  saving = overlap[SEQUENTIAL]["ms"] - overlap[SIDE_BY_SIDE]["ms"]
  cores = os.cpu_count() or 1
  device = ("lookup", "dense_fwd_bwd", "sparse_update")
  stage_sum = sum(s["ms"] for s in stages.values())
  device_sum = sum(stages[name]["ms"] for name in device)
  largest = max(stages, key=lambda name: stages[name]["ms"])
  cpu_bound = sum(s["cpu_ms"] for s in stages.values()) / cores
  bound = max(stages[largest]["ms"], cpu_bound)
  pipelined, sync = result[True], result[False]
  rows = [{"stage": name, "ms": s["ms"], "cpu_ms": s["cpu_ms"], "cores": s["cpu_ms"] / s["ms"],
           "faults": s["faults"]} for name, s in stages.items()]
  print(f"\n{case.title}; {jax.device_count()} device(s), {cores} cores")
  print_table(rows, [("stage", "stage", "s"), ("ms", "ms", ".2f"), ("cpu_ms", "cpu ms", ".2f"),
                     ("cores", "cores busy", ".2f"), ("faults", "page faults", ".0f")])
  summary = [
      {"what": "sum of stages", "ms": stage_sum},
      {"what": "sum of device stages (lookup + dense + update)", "ms": device_sum},
      {"what": f"largest stage ({largest})", "ms": stages[largest]["ms"]},
      {"what": f"sum of stage CPU times / {cores} cores", "ms": cpu_bound},
      {"what": "pipelined step", "ms": pipelined["step_ms"]},
      {"what": "synchronous step", "ms": sync["step_ms"]},
  ]
  print_table(summary, [("what", "", "s"), ("ms", "ms", ".2f")])
  overlap_rows = [{"what": name, "ms": value["ms"], "cpu_ms": value["cpu_ms"],
                   "cores": value["cpu_ms"] / value["ms"]} for name, value in overlap.items()]
  print_table(overlap_rows, [("what", "overlap", "s"), ("ms", "ms", ".2f"),
                             ("cpu_ms", "cpu ms", ".2f"), ("cores", "cores busy", ".2f")])
  ratio = pipelined["examples_per_sec"] / sync["examples_per_sec"]
  print(f"examples/s: pipelined {pipelined['examples_per_sec']:.0f}, synchronous"
        f" {sync['examples_per_sec']:.0f}, ratio {ratio:.3f}. Bounds on the ratio: sync /"
        f" largest stage = {sync['step_ms'] / stages[largest]['ms']:.3f}; sync / max(largest"
        f" stage, CPU time / cores) = {sync['step_ms'] / bound:.3f} (estimate). Measured"
        f" overlap: the lookup beside the dense step saves {saving:.2f} ms over running them"
        f" one after the other")
  print_table([{"workers": workers, "ms": ms, "speedup": preparation[1] / ms}
               for workers, ms in preparation.items()],
              [("workers", "prefetch workers", "d"), ("ms", "host preparation ms/batch", ".2f"),
               ("speedup", "vs 1 worker", ".2f")])
  return {"config": case.name, "title": case.title, "stages": stages,
          "sum_of_stages_ms": stage_sum, "largest_stage": largest,
          "pipelined_step_ms": pipelined["step_ms"], "sync_step_ms": sync["step_ms"],
          "examples_per_sec_on": pipelined["examples_per_sec"],
          "examples_per_sec_off": sync["examples_per_sec"], "ratio": ratio,
          "ratio_bound": sync["step_ms"] / stages[largest]["ms"],
          "pipelined_bound_estimate_ms": bound, "ratio_bound_estimate": sync["step_ms"] / bound,
          "overlap": overlap, "overlap_saving_ms": saving,
          "preparation_ms_by_workers": preparation}


def main(argv=None):
  args = parse_args(__doc__.split("\n\n")[0], repeats=10, quick_repeats=3, argv=argv,
                    choices={"config": ("all", *CASES), "prefetch-workers": ("1", "2", "4", "8")})
  names = list(CASES) if args.config == "all" else [args.config]
  workers = int(args.prefetch_workers)
  results = [run_case(CASES[name](args.quick), args.repeats, workers) for name in names]
  out = {"benchmark": "pipeline", "quick": args.quick, "prefetch_workers": workers,
         "configs": results}
  print(json.dumps({**out, "machine": machine_info()}))
  write_json(args.json, out)


if __name__ == "__main__":
  main()
