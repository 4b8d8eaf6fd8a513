"""Train a DLRM-style ranking model on built-in synthetic Criteo-like data.

The model: a bottom MLP on 13 dense features, 26 categorical features looked
up in stacked, sharded embedding tables of different vocabularies, the dot
interaction of all 27 vectors, a top MLP and binary cross-entropy.

The data: a deterministic generator with a planted signal. Every id of every
table has a hidden effect; a sample's logit is the sum of the effects of its
ids plus a linear function of the dense features, and its label is drawn from
sigmoid(logit). Ids are Zipf-distributed (popular ids are small), three
features are multi-hot (1 to 5 ids, padded with -1). Learning is measurable:
the AUC of a trained model rises well above 0.5.

Run:  python examples/dlrm.py            (train, evaluate, checkpoint, plot)
      python examples/dlrm.py            (again: resumes and trains further)
      python -m pipelining.plot dlrm_workdir   (the picture, also while it runs)
The last line printed is one JSON object with the final metrics: the
training throughput over the timed steps (`examples_per_sec`) and the
one-off costs apart (`one_off_s`); `--help` lists every flag.

Several processes (README, "Several processes and hosts"): start the same
command once per process with --num-processes, --process-id and
--coordinator-address (or the JAX_NUM_PROCESSES, JAX_PROCESS_ID and
JAX_COORDINATOR_ADDRESS environment variables); each process feeds its slice
of every global batch of --batch-size samples, and process 0 prints.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

import numpy as np

NUM_DENSE = 13
NUM_SPARSE = 26
MULTI_HOT_FEATURES = 3
MAX_IDS_MULTI_HOT = 5
BASE_VOCABULARIES = (
    100_000, 60_000, 40_000, 30_000, 20_000, 12_000, 8_000, 5_000, 3_000, 2_000, 1_500, 1_000,
    800, 500, 300, 200, 150, 100, 60, 40, 30, 20, 12, 8, 5, 3,
)


def vocabulary_sizes(vocab_scale: float) -> list[int]:
  """The 26 tables' vocabularies at a scale (1.0 gives about 285k rows)."""
  return [max(3, int(round(v * vocab_scale))) for v in BASE_VOCABULARIES]


def _uniform_hash(table: int, ids: np.ndarray, salt: int) -> np.ndarray:
  """A fixed pseudo-random value in [0, 1) per (table, id): splitmix64."""
  with np.errstate(over="ignore"):
    x = ids.astype(np.uint64) + np.uint64((table * 0x9E3779B97F4A7C15 + salt) % (1 << 64))
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
  return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)


class SyntheticCriteo:
  """Deterministic Criteo-like batches with a planted signal; re-iterable.

  Batch i depends only on (seed, i), so iteration can restart anywhere; the
  iterator exposes get_state()/set_state() for exact resume.

  Args:
    batch_size: samples per (global) batch.
    num_batches: batches per pass (None: endless).
    seed: selects the stream (use different seeds for train and eval).
    vocab_scale: scales the 26 vocabularies.
    signal: standard deviation of each id's hidden effect.
    samples: (start, stop): yield only these samples of every batch, one
      process's share; None: all. (The generator makes the whole batch and
      slices it; a real input pipeline would read only its slice.)
  """

  def __init__(self, batch_size: int, num_batches: int | None = None, *, seed: int = 0,
               vocab_scale: float = 1.0, signal: float = 0.35,
               samples: tuple[int, int] | None = None):
    self.batch_size = batch_size
    self.num_batches = num_batches
    self.seed = seed
    self.samples = samples
    self.vocabularies = vocabulary_sizes(vocab_scale)
    self.signal = signal
    weights = np.random.default_rng(1234).normal(size=NUM_DENSE)
    self._dense_weights = 0.6 * weights / np.linalg.norm(weights)

  def batch(self, index: int) -> dict[str, Any]:
    rng = np.random.default_rng([self.seed, index])
    size = self.batch_size
    sparse, logit = {}, np.full(size, -0.5)
    for t, vocab in enumerate(self.vocabularies):
      width = MAX_IDS_MULTI_HOT if t < MULTI_HOT_FEATURES else 1
      # Zipf(1)-like ranks: P(rank <= r) ~ log(r + 1) / log(V + 1).
      ranks = np.floor(np.exp(rng.uniform(size=(size, width)) * math.log(vocab + 1))) - 1
      ids = np.clip(ranks, 0, vocab - 1).astype(np.int64)
      if width > 1:
        lengths = rng.integers(1, width + 1, size=size)
        ids[np.arange(width)[None, :] >= lengths[:, None]] = -1
      valid = ids >= 0
      effect = (_uniform_hash(t, np.maximum(ids, 0), 17) - 0.5) * math.sqrt(12) * self.signal
      logit += (effect * valid).sum(1) / valid.sum(1)
      sparse[f"cat_{t}"] = ids
    counts = rng.lognormal(mean=1.0, sigma=1.2, size=(size, NUM_DENSE))
    dense = (np.log1p(counts) - 1.3).astype(np.float32)
    logit += dense @ self._dense_weights
    labels = (rng.uniform(size=size) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    batch = {"sparse": sparse, "dense": dense, "labels": labels}
    if self.samples is None:
      return batch
    part = slice(*self.samples)
    return {"sparse": {k: v[part] for k, v in sparse.items()}, "dense": dense[part],
            "labels": labels[part]}

  def __iter__(self) -> "_SyntheticIterator":
    return _SyntheticIterator(self)


class _SyntheticIterator:
  def __init__(self, source: SyntheticCriteo):
    self._source = source
    self._index = 0

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, Any]:
    if self._source.num_batches is not None and self._index >= self._source.num_batches:
      raise StopIteration
    batch = self._source.batch(self._index)
    self._index += 1
    return batch

  def get_state(self) -> dict[str, int]:
    return {"index": self._index}

  def set_state(self, state: dict[str, int]) -> None:
    self._index = int(state["index"])


def build_model(embedding_dim: int, feature_names: tuple[str, ...]):
  """The DLRM dense part as a Linen module: (activations, dense) -> logits."""
  import jax.numpy as jnp
  from flax import linen as nn

  class DLRM(nn.Module):
    names: tuple[str, ...]
    dim: int
    bottom: tuple[int, ...] = (64, 32)
    top: tuple[int, ...] = (128, 64)

    @nn.compact
    def __call__(self, activations, dense):
      x = dense
      for width in self.bottom:
        x = nn.relu(nn.Dense(width)(x))
      x = nn.Dense(self.dim)(x)
      vectors = jnp.stack([x] + [activations[name] for name in self.names], axis=1)
      products = jnp.einsum("bid,bjd->bij", vectors, vectors)
      upper_i, upper_j = np.triu_indices(len(self.names) + 1, k=1)
      z = jnp.concatenate([x, products[:, upper_i, upper_j]], axis=1)
      for width in self.top:
        z = nn.relu(nn.Dense(width)(z))
      return nn.Dense(1)(z)[:, 0]

  return DLRM(feature_names, embedding_dim)


def build_feature_specs(batch_size: int, embedding_dim: int, vocab_scale: float,
                        learning_rate: float = 0.05):
  from sc_framework import FeatureSpec, TableSpec
  from sc_framework.optimizers import RowWiseAdagrad

  optimizer = RowWiseAdagrad(learning_rate)
  specs = []
  for t, vocab in enumerate(vocabulary_sizes(vocab_scale)):
    table = TableSpec(f"table_{t}", vocab, embedding_dim, optimizer=optimizer)
    width = MAX_IDS_MULTI_HOT if t < MULTI_HOT_FEATURES else 1
    specs.append(FeatureSpec(f"cat_{t}", table, (batch_size, width)))
  return specs


def bce_loss(logits, labels):
  import optax

  return optax.sigmoid_binary_cross_entropy(logits, labels).mean()


class _Parser(argparse.ArgumentParser):
  """Reports a bad command line as one line naming the flag, without the usage block."""

  def error(self, message: str):
    self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """Shows every flag's default, except those whose help says it (None)."""

  def _get_help_string(self, action):
    return action.help if action.default is None else super()._get_help_string(action)


def _workdir_flag(text: str) -> str:
  """A workdir (`workdir_path`) whose checkpoints Orbax can save: no glob characters."""
  from sc_framework.cli_types import workdir_path

  text = workdir_path(text)
  if text:
    from checkpoint import check_can_save_under

    try:
      check_can_save_under(os.path.join(text, "checkpoints"))
    except ValueError as error:
      raise argparse.ArgumentTypeError(str(error)) from None
  return text


def _parser() -> argparse.ArgumentParser:
  from sc_framework.cli_types import integer_at_least, positive_float
  from sc_framework.cli_types import seed as seed_type

  parser = _Parser(prog="dlrm.py", description=__doc__.split("\n\n")[0], allow_abbrev=False,
                   formatter_class=_HelpFormatter)
  count, positive = integer_at_least(0), integer_at_least(1)
  parser.add_argument("--steps", type=count, default=1000,
                      help="training steps of this run (a resumed run trains this many more)")
  parser.add_argument("--batch-size", type=positive, default=1024,
                      help="global batch size in samples (a multiple of the device count)")
  parser.add_argument("--embedding-dim", type=positive, default=16,
                      help="width of every embedding table")
  parser.add_argument("--vocab-scale", type=positive_float, default=1.0,
                      help="scales the 26 vocabularies (1.0: about 285k rows in all)")
  parser.add_argument("--eval-batches", type=positive, default=8,
                      help="batches of the held-out evaluation stream")
  parser.add_argument("--eval-every", type=positive, default=250,
                      help="steps between evaluations during training (and one at the end)")
  parser.add_argument("--pipelining", action=argparse.BooleanOptionalAction, default=True,
                      help="overlap the embedding lookup of the next batch with the dense step")
  parser.add_argument("--workdir", type=_workdir_flag, default="dlrm_workdir",
                      help="checkpoints, metrics.jsonl and the plot; '' disables them")
  parser.add_argument("--save-every", type=positive, default=100,
                      help="steps between checkpoints (with a workdir; one also at the end)")
  parser.add_argument("--seed", type=seed_type, default=0,
                      help="seeds the initialisation and the synthetic data")
  parser.add_argument("--learning-rate", type=positive_float, default=0.003,
                      help="Adam learning rate of the dense layers")
  parser.add_argument("--embedding-learning-rate", type=positive_float, default=0.05,
                      help="row-wise Adagrad learning rate of the embedding tables")
  group = parser.add_argument_group(
      "several processes", "default: the JAX_* environment variables, else one process")
  group.add_argument("--num-processes", type=positive, default=None,
                     help="processes of the job (default: $JAX_NUM_PROCESSES, else 1)")
  group.add_argument("--process-id", type=count, default=None,
                     help="this process's index, 0 to --num-processes - 1"
                     " (default: $JAX_PROCESS_ID, else 0)")
  group.add_argument("--coordinator-address", default=None,
                     help="host:port of process 0 (default: $JAX_COORDINATOR_ADDRESS)")
  group.add_argument("--cpu-devices", type=positive, default=None,
                     help="CPU devices of this process, to try several processes on one machine"
                     " (default: as JAX starts, one CPU device)")
  return parser


def parse_args(argv=None) -> argparse.Namespace:
  """Parses and checks the flags; a bad value exits with one line naming the flag."""
  parser = _parser()
  args = parser.parse_args(argv)
  if (args.process_id is not None and args.num_processes is not None
      and args.process_id >= args.num_processes):
    parser.error(f"argument --process-id: must be < --num-processes {args.num_processes},"
                 f" got {args.process_id}")
  from pipelining import resolve_job_settings  # the flags with the JAX_* variables

  try:
    resolve_job_settings(args.coordinator_address, args.num_processes, args.process_id)
  except ValueError as error:
    parser.error(f"the multi-process flags: {error}")
  return args


def local_samples(trainer, batch_size: int) -> tuple[int, int]:
  """The samples [start, stop) of every global batch that this process feeds."""
  devices = trainer.plan.local_devices()
  per_device = batch_size // trainer.plan.num_devices
  return devices.start * per_device, devices.stop * per_device


class StepClock:
  """Times a fit from the outside: training steps apart from one-off costs.

  A `pipelining.Callback` (all its hooks, without importing JAX at start-up,
  so that --help and flag errors are instant).

  Step k's time is that of its `on_step_end`. The first step carries the
  compilation (prime and step; in synchronous mode the step), the last step
  of a pipelined run the drain's; evaluations during fit run between two
  step ends. So the training throughput is measured over the steps from the
  end of the first to the end of the second to last, evaluations excluded.
  """

  def __init__(self):
    self.called = time.perf_counter()
    self.started = self.ended = None
    self.step_ends: list[float] = []
    self.evaluations: list[tuple[float, float]] = []  # (start, end)

  def on_fit_start(self, trainer, step):
    self.started = time.perf_counter()

  def on_step_end(self, trainer, step, metrics):
    self.step_ends.append(time.perf_counter())

  def on_eval_end(self, trainer, step, metrics):
    now = time.perf_counter()
    previous = max([self.started or self.called, *self.step_ends[-1:],
                    *(end for _, end in self.evaluations[-1:])])
    self.evaluations.append((previous, now))

  def on_save(self, trainer, step):
    pass

  def on_fit_end(self, trainer, history):
    self.ended = time.perf_counter()

  def _evaluating(self, start: float, stop: float) -> float:
    return sum(min(e, stop) - max(s, start) for s, e in self.evaluations if s < stop and e > start)

  def report(self, batch_size: int) -> dict[str, Any]:
    """examples_per_sec over the timed steps (None below 3 steps) and the one-off seconds."""
    started = self.started if self.started is not None else self.ended
    ends = self.step_ends
    timed = len(ends) - 2
    per_step = None
    if timed > 0:
      window = ends[-2] - ends[0] - self._evaluating(ends[0], ends[-2])
      per_step = window / timed
    last = ends[-1] if ends else started
    compile_s = 0.0
    if ends:
      compile_s = ends[0] - started - self._evaluating(started, ends[0])
      if len(ends) > 1:
        compile_s += ends[-1] - ends[-2] - self._evaluating(ends[-2], ends[-1])
      compile_s -= (2 if len(ends) > 1 else 1) * (per_step or 0.0)
    return {
        "examples_per_sec": round(batch_size / per_step, 1) if per_step else None,
        "timed_steps": max(timed, 0),
        "one_off_s": {
            "setup_and_restore": round(started - self.called, 2),
            "compile": round(max(compile_s, 0.0), 2),
            "evaluation": round(self._evaluating(self.called, self.ended), 2),
            "final_save": round(self.ended - last - self._evaluating(last, self.ended), 2),
        },
    }


def main(argv=None) -> dict[str, Any]:
  args = parse_args(argv)
  import jax

  from pipelining import initialize_distributed

  if args.cpu_devices:
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
  # With several processes, an error inside the job ends this process at once
  # so that the others stop too (a no-op scope for one process).
  with initialize_distributed(args.coordinator_address, args.num_processes, args.process_id):
    return train(args)


def train(args: argparse.Namespace) -> dict[str, Any]:
  """Trains and evaluates as `args` say; returns the printed summary."""
  import jax
  import optax

  from checkpoint import IncompatibleCheckpointError
  from pipelining import NonFiniteLossError, Trainer
  from pipelining.plot import plot_workdir
  from sc_framework.preprocessing import collect_stats, size_limits_from_stats
  from sc_framework.primitives import check_devices_per_process
  from sc_framework.stacking import auto_stack_tables

  check_devices_per_process()  # before a message about the total (--cpu-devices per process)
  if args.batch_size % jax.device_count():
    _parser().error(f"argument --batch-size: must be a multiple of the {jax.device_count()}"
                    f" devices, got {args.batch_size}")
  report = print if jax.process_index() == 0 else (lambda *a, **k: None)

  specs = build_feature_specs(args.batch_size, args.embedding_dim, args.vocab_scale,
                              args.embedding_learning_rate)
  # Size the static buffers from a few global batches (feature-distribution
  # sizing); every process computes the same limits.
  layout = auto_stack_tables(specs, jax.device_count())
  full = SyntheticCriteo(args.batch_size, seed=args.seed, vocab_scale=args.vocab_scale)
  sample = [full.batch(i)["sparse"] for i in range(4)]
  specs = list(size_limits_from_stats(
      specs, collect_stats(sample, specs, layout, padding_id=-1), layout=layout, headroom=1.3))

  workdir = args.workdir or None
  trainer = Trainer(
      build_model(args.embedding_dim, tuple(s.name for s in specs)), specs, bce_loss,
      optax.adam(args.learning_rate), pipelining=args.pipelining, padding_id=-1,
      workdir=workdir, save_every=args.save_every if workdir else None, seed=args.seed,
      host_memory="keep",  # this program only trains: let glibc reuse freed memory (CPU)
      log_every=max(1, min(20, args.steps // 10)),  # a short run still gets a curve
  )
  # Each process feeds its slice of every global batch (all of it with one process).
  samples = local_samples(trainer, args.batch_size)
  train = SyntheticCriteo(args.batch_size, seed=args.seed, vocab_scale=args.vocab_scale,
                          samples=samples)
  evaluation = SyntheticCriteo(args.batch_size, args.eval_batches, seed=args.seed + 10_000,
                               vocab_scale=args.vocab_scale, samples=samples)
  try:
    # With checkpoints in the workdir, evaluate adopts the newest that restores
    # (one found damaged is skipped), the step fit then resumes from.
    before = trainer.evaluate(evaluation)
    start_step = int(trainer.state.step)
    if start_step:
      report(f"resuming from step {start_step}", flush=True)
    when = f"at step {start_step}" if start_step else "before training"
    report(f"{when}: loss {before['loss']:.4f}  auc {before['auc']:.4f}", flush=True)
    clock = StepClock()
    history = trainer.fit(train, num_steps=start_step + args.steps, eval_data=evaluation,
                          eval_every=args.eval_every, callbacks=[clock])
  except IncompatibleCheckpointError as error:  # flags other than the checkpoint's
    _parser().error(
        f"--workdir {args.workdir} holds checkpoints written with other flags than these"
        f" (resume with those flags, or pass a new --workdir): {error}")
  except NonFiniteLossError as error:  # one line, as the flags' errors: a smaller rate
    print(f"{_parser().prog}: error: {error} (here: --learning-rate {args.learning_rate})",
          file=sys.stderr, flush=True)
    raise SystemExit(1) from None
  # fit evaluates at its end unless it was interrupted or trained nothing new.
  ran_final = history.evaluations and history.evaluations[-1][0] == history.final_step
  if ran_final:
    after = history.evaluations[-1][1]
  elif history.final_step == start_step:  # nothing trained: the state evaluated before
    after = before
  else:
    after = trainer.evaluate(evaluation)
  report(f"after training:  loss {after['loss']:.4f}  auc {after['auc']:.4f}", flush=True)
  result = {
      "steps": history.final_step,
      "loss": round(after["loss"], 5),
      # AUC is undefined (NaN) when the evaluation labels are all of one class;
      # JSON has no NaN, so the line says null.
      "auc": round(after["auc"], 5) if math.isfinite(after["auc"]) else None,
      **clock.report(args.batch_size),
      "pipelining": args.pipelining,
  }
  if jax.process_count() > 1:
    result["processes"] = jax.process_count()
  if workdir and jax.process_index() == 0:
    path, drawn = plot_workdir(workdir)
    result["plot"] = str(path)
    result["plot_resume_markers"] = list(drawn.resumes)
  report(json.dumps(result))
  return result


if __name__ == "__main__":
  # The repository root after site-packages: an installed sc-framework (with its built
  # kernels) comes first; a checkout without an install runs from its sources.
  sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  main()
