"""Our embedding step vs TorchRec's fused CPU EmbeddingBagCollection, and vs plain JAX.

Configuration (issue default): 26 tables x 100,000 rows x dim 64, sum
combiner, batch 4,096, 1-20 uniform ids per sample (--quick: 8 tables x
50,000 rows, batch 1,024). Both sides train on the same raw batches with the
same loss, sum 0.01 * log(cosh(a)) over the pooled activations a, whose
gradient 0.01 * tanh(a) flows into the sparse update. Both take it over one
array that holds every feature's activations: TorchRec's KeyedTensor.values()
[B, 26 * 64], our stacked_lookup's [26 * B, 64] (whose gradient
apply_stacked_gradients applies).

Part 1, ours vs TorchRec, for SGD and row-wise Adagrad (lr 0.01):
  torchrec   one training step of torchrec's FusedEmbeddingBagCollection on
             CPU: KeyedJaggedTensor of the raw ids, forward, loss, backward;
             fbgemm's fused CPU kernels group and deduplicate the ids and
             apply the optimizer inside the backward pass.
  ours_step  our jitted step (stacked_lookup + apply_stacked_gradients,
             tables donated) on batch buffers already on the device: the
             CPU backend with the C++ kernels.
  ours_step_features  the same step with the loss taken feature by feature
             (embedding_lookup's dict + apply_embedding_gradients): 26
             slices of the activations and a join of 26 gradients more.
  ours_e2e   `preprocess` of the raw batch (we group and deduplicate on the
             host) + jax.device_put + our step.
  ours_overlap  ours as the Trainer runs it: the step of one batch while a
             host thread preprocesses the next (its prefetch), one of each
             per call; the time per batch of a steady training loop.
  Two ratios, ours / TorchRec (< 1: we are faster): step = ours_step /
  torchrec and end to end = ours_e2e / torchrec; a third, overlapped =
  ours_overlap / torchrec.
  The five cases are interleaved: every round runs each once, on that
  round's fresh batch, so a load change on a shared machine hits all five.
  Partition limits come from two warm-up batches (size_limits_from_stats,
  headroom 1.2), so no id is dropped.

Part 2, ours vs plain JAX, for Adagrad, Adam and FTRL: our step on ready
buffers (the loss feature by feature, as the plain-JAX step takes it table by
table) against bench_embedding's plain-JAX step (26 separate tables, jnp.take
on padded ids, dense gradients through the full tables) followed by
optax.adagrad / optax.adam, or for FTRL (optax has none) the textbook FTRL
formula of sc_framework.optimizers.FTRL applied to the full tables. The two
are interleaved the same way. Part 2 needs no TorchRec.

Every figure is the median over --repeats rounds, after one warm-up round;
the table also shows the process CPU time per call.

torch's OpenMP threads (GNU libgomp) spin for a while after each parallel
region before they sleep, as XLA's own pool does; on a machine of few cores
that spinning takes the cores from whatever runs next. So every case of the
interleaved rounds is followed by SETTLE_S of untimed sleep: each side runs
with its threads' usual policy, and none pays for the one before it. The
header names OMP_WAIT_POLICY where it is set (PASSIVE, threads that sleep at once, made
TorchRec's step slower here; ACTIVE, which spins without end, slowed every case
that followed it).

TorchRec is a benchmark extra, never a dependency of the project. The set
known to install and load together (Linux x86_64, CPU only):

  pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
  pip install -e '.[bench-torchrec]'   # fbgemm-gpu-cpu 1.8.0, tensordict, ...
  pip install --no-deps torchrec==1.8.0

(the CPU build of torch; fbgemm-gpu-cpu 1.9.0 fails to load against torch
2.13; torchrec's own requirements would pull the CUDA fbgemm-gpu, hence
--no-deps). Best in a virtual environment of its own. Without TorchRec, part
1 is skipped with a one-line message.

Run: python benchmarks/bench_vs_torchrec.py [--quick] [--repeats N] [--json PATH]
       [--part {all,torchrec,plain-jax}]
"""

from __future__ import annotations

import concurrent.futures
import os
import sys

# The repository root after site-packages: an installed sc-framework (with its built
# kernels) comes first; a checkout without an install runs from its sources.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from benchmarks._common import parse_args, print_table, time_interleaved, write_json  # noqa: E402
from benchmarks.bench_embedding import MAX_IDS, plain_jax_runner, step_fn  # noqa: E402
from sc_framework import FeatureSpec, TableSpec  # noqa: E402
from sc_framework.host_allocator import keep_freed_memory  # noqa: E402
from sc_framework.optimizers import FTRL, SGD, Adagrad, Adam, OptimizerSpec, RowWiseAdagrad  # noqa: E402
from sc_framework.preprocessing import (  # noqa: E402
    RaggedIds,
    collect_stats,
    preprocess,
    size_limits_from_stats,
)
from sc_framework.primitives import (  # noqa: E402
    EmbeddingPlan,
    apply_stacked_gradients,
    get_backend,
    init_embedding_variables,
    stacked_lookup,
)
from sc_framework.primitives._row_ops import cpu_kernels_build  # noqa: E402

LEARNING_RATE = 0.01
SETTLE_S = 0.05  # untimed sleep after every timed call (see the docstring)
PARTS = ("all", "torchrec", "plain-jax")


def omp_wait_policy() -> str:
  """', OMP_WAIT_POLICY=X' where the variable is set, for a header; else ''."""
  policy = os.environ.get("OMP_WAIT_POLICY")
  return f", OMP_WAIT_POLICY={policy}" if policy else ""


def torchrec_missing() -> str | None:
  """None when TorchRec and fbgemm load, else why not (not installed, or failing to load)."""
  try:
    import fbgemm_gpu  # noqa: F401
    import torchrec  # noqa: F401
  except Exception as error:  # an ImportError, or a library that fails to load
    why = f"{type(error).__name__}: {error}".splitlines()[0]
    state = "not installed" if isinstance(error, ModuleNotFoundError) else "fails to load"
    return f"TorchRec {state} ({why})"
  return None


# ----------------------------------------------------------------------------- data


def make_batch(rng: np.random.Generator, num_tables: int, batch: int,
               vocab: int) -> list[tuple[np.ndarray, np.ndarray]]:
  """Per table (values int64 [n], lengths int64 [B]): 1-20 uniform ids per sample."""
  out = []
  for _ in range(num_tables):
    lengths = rng.integers(1, MAX_IDS + 1, size=batch)
    out.append((rng.integers(0, vocab, size=int(lengths.sum())), lengths))
  return out


def ours_input(raw) -> dict[str, RaggedIds]:
  return {f"f{k}": RaggedIds.from_lengths(values, lengths)
          for k, (values, lengths) in enumerate(raw)}


def padded_ids(raw) -> list[np.ndarray]:
  """Per table the dense [B, 20] ids padded with -1 (the plain-JAX input)."""
  out = []
  for values, lengths in raw:
    dense = np.full((lengths.size, MAX_IDS), -1, np.int64)
    dense[np.arange(MAX_IDS) < lengths[:, None]] = values
    out.append(dense)
  return out


# ----------------------------------------------------------------------------- ours


def stacked_step_fn(plan):
  """bench_embedding's step with the loss over the stacked activations:
  stacked_lookup, the gradient 0.01 * tanh(A) of every stack's whole array,
  apply_stacked_gradients (variables donated)."""

  def step(v, b, step):
    stacked = stacked_lookup(plan, v.tables, b)
    grads = {name: 0.01 * jax.numpy.tanh(a) for name, a in stacked.items()}
    return apply_stacked_gradients(plan, v, b, grads, step)

  return jax.jit(step, donate_argnums=0)


class Ours:
  """Our model: one stack per config, a plan on the first device, its variables."""

  def __init__(self, num_tables, vocab, dim, batch, optimizer: OptimizerSpec, warmup_batches):
    tables = [TableSpec(f"t{k}", vocab, dim, combiner="sum", optimizer=optimizer)
              for k in range(num_tables)]
    specs = [FeatureSpec(f"f{k}", tables[k], (batch, MAX_IDS)) for k in range(num_tables)]
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("devices",))
    layout = EmbeddingPlan.create(specs, mesh=mesh).layout
    stats = collect_stats([ours_input(raw) for raw in warmup_batches], specs, layout)
    self.specs = size_limits_from_stats(specs, stats, layout=layout, headroom=1.2)
    self.plan = EmbeddingPlan.create(self.specs, mesh=mesh)
    self.backend = get_backend("auto", self.plan).name
    self.step = stacked_step_fn(self.plan)
    self.feature_step = step_fn(self.plan)
    self.variables = init_embedding_variables(self.plan, jax.random.key(0))
    self.count = 0

  def buffers(self, raw):
    batch, stats = preprocess(ours_input(raw), self.specs, self.plan.layout)
    if stats.num_dropped_ids:
      raise RuntimeError(f"the benchmark batch dropped {stats.num_dropped_ids} ids")
    return jax.device_put(batch)

  def train(self, buffers) -> None:
    """One step, the loss over the stacked activations (`stacked_step_fn`)."""
    self._run(self.step, buffers)

  def train_features(self, buffers) -> None:
    """One step, the loss feature by feature (bench_embedding's `step_fn`)."""
    self._run(self.feature_step, buffers)

  def _run(self, step, buffers) -> None:
    self.variables = step(self.variables, buffers, self.count)
    self.count += 1
    jax.block_until_ready(self.variables)


class Overlapped:
  """Ours with the next batch preprocessed on a host thread while the step runs.

  Each call trains on the buffers the previous call prepared and prepares
  `raw`'s meanwhile, as the Trainer's prefetch thread does.
  """

  def __init__(self, ours: Ours, first_raw):
    self.ours = ours
    self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefetch")
    self.prepared = ours.buffers(first_raw)

  def __call__(self, raw) -> None:
    future = self.pool.submit(self.ours.buffers, raw)
    self.ours.train(self.prepared)
    self.prepared = future.result()

  def close(self) -> None:
    self.pool.shutdown()


# ----------------------------------------------------------------------------- TorchRec


class TorchRec:
  """torchrec's FusedEmbeddingBagCollection on CPU: fbgemm's fused training step."""

  def __init__(self, num_tables, vocab, dim, optimizer: str):
    import torch
    import torchrec
    import torchrec.optim
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

    self.torch, self.torchrec = torch, torchrec
    tables = [
        torchrec.EmbeddingBagConfig(name=f"t{k}", embedding_dim=dim, num_embeddings=vocab,
                                    feature_names=[f"f{k}"], pooling=torchrec.PoolingType.SUM)
        for k in range(num_tables)
    ]
    kind = {"sgd": torch.optim.SGD, "rowwise_adagrad": torchrec.optim.RowWiseAdagrad}[optimizer]
    self.module = FusedEmbeddingBagCollection(
        tables=tables, optimizer_type=kind, optimizer_kwargs={"lr": LEARNING_RATE},
        device=torch.device("cpu"))
    self.keys = [f"f{k}" for k in range(num_tables)]

  def train(self, raw) -> None:
    torch = self.torch
    features = self.torchrec.KeyedJaggedTensor(
        keys=self.keys,
        values=torch.from_numpy(np.concatenate([values for values, _ in raw])),
        lengths=torch.from_numpy(np.concatenate([lengths for _, lengths in raw])),
    )
    pooled = self.module(features).values()
    (0.01 * torch.log(torch.cosh(pooled))).sum().backward()


def vs_torchrec(config, repeats: int) -> list[dict]:
  num_tables, vocab, dim, batch = config
  rng = np.random.default_rng(0)
  warmup = [make_batch(rng, num_tables, batch, vocab) for _ in range(2)]
  batches = [make_batch(rng, num_tables, batch, vocab) for _ in range(repeats + 1)]
  rows = []
  for name, optimizer in (("sgd", SGD(LEARNING_RATE)),
                          ("rowwise_adagrad", RowWiseAdagrad(LEARNING_RATE))):
    ours = Ours(num_tables, vocab, dim, batch, optimizer, warmup)
    ready = [ours.buffers(raw) for raw in batches]
    torchrec = TorchRec(num_tables, vocab, dim, name)
    overlapped = Overlapped(ours, batches[-1])
    timing = time_interleaved({
        "torchrec": lambda i: torchrec.train(batches[i]),
        "ours_step": lambda i: ours.train(ready[i]),
        "ours_step_features": lambda i: ours.train_features(ready[i]),
        "ours_e2e": lambda i: ours.train(ours.buffers(batches[i])),
        "ours_overlap": lambda i: overlapped(batches[i]),
    }, repeats, settle_s=SETTLE_S)
    overlapped.close()
    rows.append({
        "optimizer": name, "backend": ours.backend,
        **{f"{case}_{key}": value for case, t in timing.items() for key, value in t.items()},
        "step_ratio": timing["ours_step"]["ms"] / timing["torchrec"]["ms"],
        "step_features_ratio": timing["ours_step_features"]["ms"] / timing["torchrec"]["ms"],
        "e2e_ratio": timing["ours_e2e"]["ms"] / timing["torchrec"]["ms"],
        "overlap_ratio": timing["ours_overlap"]["ms"] / timing["torchrec"]["ms"],
    })
    del ours, ready, torchrec, overlapped
  return rows


# ----------------------------------------------------------------------------- plain JAX


def dense_rule(spec: OptimizerSpec) -> optax.GradientTransformation:
  """`spec`'s update formula on whole tables, as an optax transformation."""

  def init(params):
    return [{slot.name: np.full(p.shape[:1] + ((slot.width,) if slot.width else p.shape[1:]),
                                slot.initial_value, np.float32) for slot in spec.slots()}
            for p in params]

  def update(grads, state, params):
    new = [spec.apply(p, g, s, 0, None) for p, g, s in zip(params, grads, state)]
    return [rows - p for (rows, _), p in zip(new, params)], [slots for _, slots in new]

  return optax.GradientTransformation(init, update)


def vs_plain_jax(config, repeats: int) -> list[dict]:
  num_tables, vocab, dim, batch = config
  rng = np.random.default_rng(1)
  warmup = [make_batch(rng, num_tables, batch, vocab) for _ in range(2)]
  raw = make_batch(rng, num_tables, batch, vocab)
  rows = []
  for name, optimizer, baseline in (
      ("adagrad", Adagrad(LEARNING_RATE), optax.adagrad(LEARNING_RATE, initial_accumulator_value=0.1)),
      ("adam", Adam(0.001), optax.adam(0.001)),
      ("ftrl", FTRL(LEARNING_RATE), dense_rule(FTRL(LEARNING_RATE))),
  ):
    ours = Ours(num_tables, vocab, dim, batch, optimizer, warmup)
    ready = ours.buffers(raw)
    plain = plain_jax_runner(num_tables, vocab, dim, padded_ids(raw), baseline)
    timing = time_interleaved(
        {"plain_jax": plain, "ours_step_features": lambda i: ours.train_features(ready)},
        repeats)
    rows.append({
        "optimizer": name, "backend": ours.backend,
        **{f"{case}_{key}": value for case, t in timing.items() for key, value in t.items()},
        "ratio": timing["ours_step_features"]["ms"] / timing["plain_jax"]["ms"],
    })
    del ours, ready, plain
  return rows


# ----------------------------------------------------------------------------- main


def main(argv=None) -> dict:
  args = parse_args(__doc__.split("\n\n")[0], repeats=7, quick_repeats=3, argv=argv,
                    choices={"part": PARTS})
  part = args.part
  config = (8, 50_000, 64, 1024) if args.quick else (26, 100_000, 64, 4096)
  allocator = "keep" if keep_freed_memory() else "system"
  num_tables, vocab, dim, batch = config
  header = (f"{num_tables} tables x {vocab:,} rows x dim {dim}, batch {batch:,}, 1-{MAX_IDS}"
            f" uniform ids/sample, sum combiner; median of {args.repeats} interleaved rounds;"
            f" host allocator {allocator!r}; {jax.default_backend()} device"
            f" {jax.devices()[0].device_kind!r}; C++ CPU kernels build {cpu_kernels_build()!r}"
            f" (used on CPU devices only)")
  result = {"benchmark": "vs_torchrec", "quick": args.quick, "repeats": args.repeats,
            "cpu_kernels_build": cpu_kernels_build(),
            "config": {"tables": num_tables, "vocab": vocab, "dim": dim, "batch": batch,
                       "ids_per_sample": [1, MAX_IDS], "learning_rate": LEARNING_RATE}}
  if part in ("all", "torchrec"):
    missing = torchrec_missing()
    if missing is not None:
      print(f"TorchRec comparison skipped: {missing}. The README's Benchmarks section (and"
            " this script's docstring) give the set of versions to install.")
      result["torchrec_skipped"] = missing
    else:
      import torch
      import torchrec

      rows = vs_torchrec(config, args.repeats)
      print(f"\nours vs TorchRec {torchrec.__version__} (torch {torch.__version__},"
            f" {torch.get_num_threads()} threads{omp_wait_policy()}): {header}")
      print_table(rows, [
          ("optimizer", "optimizer", "s"), ("torchrec_ms", "TorchRec ms", ".1f"),
          ("ours_step_ms", "ours step ms", ".1f"),
          ("ours_step_features_ms", "step per feature ms", ".1f"),
          ("ours_e2e_ms", "ours prep+step ms", ".1f"),
          ("ours_overlap_ms", "prep||step ms", ".1f"),
          ("step_ratio", "step ours/TR", ".2f"),
          ("step_features_ratio", "step per feature/TR", ".2f"),
          ("e2e_ratio", "prep+step ours/TR", ".2f"),
          ("overlap_ratio", "prep||step ours/TR", ".2f"),
          ("torchrec_cpu_ms", "TR CPU ms", ".1f"), ("ours_step_cpu_ms", "step CPU ms", ".1f"),
          ("ours_e2e_cpu_ms", "prep+step CPU ms", ".1f"),
          ("ours_step_faults", "step page faults", ".0f"),
      ])
      result["torchrec"] = {"version": torchrec.__version__, "torch": torch.__version__,
                            "torch_threads": torch.get_num_threads(),
                            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                            "settle_s": SETTLE_S, "results": rows}
  if part in ("all", "plain-jax"):
    rows = vs_plain_jax(config, args.repeats)
    print(f"\nours vs plain JAX (dense gradients + optax; FTRL: the dense textbook rule): {header}")
    print_table(rows, [
        ("optimizer", "optimizer", "s"), ("plain_jax_ms", "plain JAX ms", ".1f"),
        ("ours_step_features_ms", "ours step ms", ".1f"), ("ratio", "ours/plain", ".2f"),
        ("plain_jax_cpu_ms", "plain CPU ms", ".1f"),
        ("ours_step_features_cpu_ms", "ours CPU ms", ".1f"),
    ])
    result["plain_jax"] = {"results": rows}
  write_json(args.json, result)
  return result


if __name__ == "__main__":
  main()
