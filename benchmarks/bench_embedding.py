"""Lookup + fused update step: ours vs the plain-JAX way, and a vocabulary sweep.

Configuration (issue default): 26 tables x 100,000 rows x dim 64, sum
combiner, batch 4,096, 1-20 ids per sample (uniform or Zipf), SGD and
row-wise Adagrad. One timed step = lookup, a fixed activation gradient, and the
sparse update (tables donated). The plain-JAX baseline keeps 26 separate
tables, looks them up with jnp.take on padded [B, 20] ids, differentiates a
loss through the full tables (dense gradients) and applies optax (sgd, or
adagrad for the Adagrad rows: optax has no row-wise Adagrad).

Also times the parts of our step alone (lookup; update; and inside them the
row operations: combine = gather + weighted segment sum into samples,
segment_grads = the backward segment sum into touched rows, gather_rows and
scatter_rows of the touched rows and slots, and the optimizer rule), and the
vocabulary sweep from 1e5 to 1e7 total rows. Preprocessing is not timed here
(see bench_preprocessing.py).

Both sides run in one process with glibc told to keep freed memory
(`sc_framework.host_allocator.keep_freed_memory`, what the Trainer does on
CPU); `--system-malloc` measures with the default allocator instead.

Run: python benchmarks/bench_embedding.py [--quick] [--json PATH] [--system-malloc]
"""

from __future__ import annotations

import json
import os
import sys

# The repository root after site-packages: an installed sc-framework (with its built
# kernels) comes first; a checkout without an install runs from its sources.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from benchmarks._common import machine_info, parse_args, print_table, time_median, write_json  # noqa: E402
from sc_framework import FeatureSpec, TableSpec  # noqa: E402
from sc_framework.host_allocator import keep_freed_memory  # noqa: E402
from sc_framework.optimizers import SGD, RowWiseAdagrad  # noqa: E402
from sc_framework.preprocessing import collect_stats, preprocess, size_limits_from_stats  # noqa: E402
from sc_framework.primitives import (  # noqa: E402
    EmbeddingPlan,
    apply_embedding_gradients,
    embedding_lookup,
    get_backend,
    init_embedding_variables,
)
from sc_framework.primitives._row_ops import CPU_KERNEL_OPS, XLA_OPS  # noqa: E402

MAX_IDS = 20


def make_ids(rng, num_tables, batch, vocab, distribution):
  """Per table: ids [B, 20] padded with -1, 1-20 ids per sample."""
  out = []
  for _ in range(num_tables):
    lengths = rng.integers(1, MAX_IDS + 1, size=batch)
    if distribution == "uniform":
      ids = rng.integers(0, vocab, size=(batch, MAX_IDS))
    else:  # Zipf(1.05)-like ranks, bounded by the vocabulary
      ids = np.minimum(rng.zipf(1.05, size=(batch, MAX_IDS)) - 1, vocab - 1)
    ids[np.arange(MAX_IDS)[None, :] >= lengths[:, None]] = -1
    out.append(ids)
  return out


def build(num_tables, vocab, dim, batch, optimizer, distribution, seed=0):
  tables = [TableSpec(f"t{k}", vocab, dim, optimizer=optimizer) for k in range(num_tables)]
  specs = [FeatureSpec(f"f{k}", tables[k], (batch, MAX_IDS)) for k in range(num_tables)]
  plan = EmbeddingPlan.create(specs, mesh=jax.sharding.Mesh(np.array(jax.devices()[:1]), ("devices",)))
  rng = np.random.default_rng(seed)
  ids = make_ids(rng, num_tables, batch, vocab, distribution)
  raw = {f"f{k}": ids[k] for k in range(num_tables)}
  specs = size_limits_from_stats(specs, collect_stats([raw], specs, plan.layout, padding_id=-1),
                                 layout=plan.layout, headroom=1.0)
  plan = EmbeddingPlan.create(specs, mesh=plan.mesh)
  batch_buffers, _ = preprocess(raw, specs, plan.layout, padding_id=-1)
  return plan, ids, jax.device_put(batch_buffers)


def step_fn(plan):
  """Our jitted training step (variables donated): lookup, the gradient of
  sum 0.01 * log(cosh(a)) (0.01 * tanh(a)), the sparse update."""

  def step(v, b, step):
    activations = embedding_lookup(plan, v.tables, b)
    grads = {k: 0.01 * jnp.tanh(a) for k, a in activations.items()}
    return apply_embedding_gradients(plan, v, b, grads, step)

  return jax.jit(step, donate_argnums=0)


def ours(plan, batch_buffers, repeats):
  variables = init_embedding_variables(plan, jax.random.key(0))
  cotangent = {f.name: jnp.full(f.output_shape, 0.01, jnp.float32) for f in plan.feature_specs}

  @jax.jit
  def lookup(tables, b):
    return embedding_lookup(plan, tables, b)

  step = step_fn(plan)
  update_only = jax.jit(
      lambda v, b, step: apply_embedding_gradients(plan, v, b, cotangent, step), donate_argnums=0)
  state = [variables]

  def run_step(i):
    state[0] = step(state[0], batch_buffers, i)
    jax.block_until_ready(state[0])

  def run_update(i):
    state[0] = update_only(state[0], batch_buffers, i)
    jax.block_until_ready(state[0])

  def run_lookup(i):
    jax.block_until_ready(lookup(state[0].tables, batch_buffers))

  return {
      "step_ms": 1e3 * time_median(run_step, repeats)["median_s"],
      "lookup_ms": 1e3 * time_median(run_lookup, repeats)["median_s"],
      "update_ms": 1e3 * time_median(run_update, repeats)["median_s"],
  }


def parts(plan, buffers, repeats):
  """Times the row operations of one step alone, on the step's real shapes."""
  backend = get_backend("auto", plan).name
  ops = CPU_KERNEL_OPS if backend == "cpu" else XLA_OPS
  stack = plan.layout.stacks[0]
  batch = buffers[stack.name]
  variables = init_embedding_variables(plan, jax.random.key(0))
  table = variables.tables[stack.name]
  slots = variables.slots[stack.name]
  unique = batch.unique_rows[0].reshape(-1)
  owned = jnp.where(unique >= 0, unique, stack.rows_per_shard)
  entry_rows = jnp.take(owned, batch.entry_unique_index[0], mode="clip")
  num_samples = stack.total_batch_size
  grads = jnp.full((num_samples, stack.padded_embedding_dim), 0.01, jnp.float32)
  rows = jnp.take(table, owned, axis=0, mode="clip")
  slot_rows = {k: jnp.take(v, owned, axis=0, mode="clip") for k, v in slots.items()}
  dims = jnp.full(owned.shape, stack.tables[0].embedding_dim, jnp.int32)
  optimizer = plan.optimizer(stack.name)
  cases = {
      "combine (lookup)": (jax.jit(ops.combine_entries, static_argnums=4),
                           (table, entry_rows, batch.entry_samples[0], batch.entry_gains[0], num_samples)),
      "segment_grads": (jax.jit(ops.segment_grads, static_argnums=4),
                        (grads, batch.entry_samples[0], batch.entry_unique_index[0], batch.entry_gains[0],
                         owned.shape[0])),
      "gather_rows (rows + slots)": (jax.jit(lambda t, s, o: (ops.gather_rows(t, o), {
          k: ops.gather_rows(v, o) for k, v in s.items()})), (table, slots, owned)),
      "optimizer rule": (jax.jit(lambda r, g, s: optimizer.apply(r, g, s, 0, dims)),
                         (rows, rows * 0.01, slot_rows)),
  }
  out = {}
  for name, (fn, args) in cases.items():
    out[name] = 1e3 * time_median(lambda i, fn=fn, args=args: jax.block_until_ready(fn(*args)), repeats)["median_s"]
  scatter = jax.jit(lambda t, s, o, r, sr: (ops.scatter_rows(t, o, r), {
      k: ops.scatter_rows(v, o, sr[k]) for k, v in s.items()}), donate_argnums=(0, 1))
  state = [table, slots]

  def run_scatter(i):
    state[0], state[1] = scatter(state[0], state[1], owned, rows, slot_rows)
    jax.block_until_ready(state[0])

  out["scatter_rows (rows + slots)"] = 1e3 * time_median(run_scatter, repeats)["median_s"]
  fused = ops.fused_update(optimizer, state[0], state[1])
  if fused is not None:
    # What the single-device step really runs: segment sum + rule + write, one pass.
    fused_step = jax.jit(lambda t, s, o, g, smp, sl, ga: fused(
        t, s, o, 0, dims, entries=(g, smp, sl, ga)), donate_argnums=(0, 1))

    def run_fused(i):
      state[0], state[1] = fused_step(state[0], state[1], owned, grads, batch.entry_samples[0],
                                      batch.entry_unique_index[0], batch.entry_gains[0])
      jax.block_until_ready(state[0])

    out["fused update (segment sum + rule + write)"] = (
        1e3 * time_median(run_fused, repeats)["median_s"])
  return backend, out


def plain_jax_runner(num_tables, vocab, dim, ids, optimizer: optax.GradientTransformation):
  """run(i): one plain-JAX step: one array per table, jnp.take on the padded
  ids, dense gradients through the full tables, `optimizer` on them."""
  key = jax.random.key(0)
  tables = [jax.random.normal(jax.random.fold_in(key, k), (vocab, dim)) * 0.05 for k in range(num_tables)]
  opt_state = optimizer.init(tables)
  id_arrays = [jnp.asarray(np.maximum(x, 0)) for x in ids]
  masks = [jnp.asarray((x >= 0).astype(np.float32)) for x in ids]

  def loss(tables):
    total = 0.0
    for table, i, m in zip(tables, id_arrays, masks):
      activations = (jnp.take(table, i, axis=0) * m[..., None]).sum(1)
      total = total + jnp.sum(0.01 * jnp.log(jnp.cosh(activations)))
    return total

  def step(tables, opt_state):
    grads = jax.grad(loss)(tables)
    updates, opt_state = optimizer.update(grads, opt_state, tables)
    return optax.apply_updates(tables, updates), opt_state

  step = jax.jit(step, donate_argnums=(0, 1))
  state = [tables, opt_state]

  def run(i):
    state[0], state[1] = step(state[0], state[1])
    jax.block_until_ready(state[0])

  return run


def plain_jax(num_tables, vocab, dim, ids, optimizer_kind, repeats):
  optimizer = optax.sgd(0.01) if optimizer_kind == "sgd" else optax.adagrad(0.01)
  run = plain_jax_runner(num_tables, vocab, dim, ids, optimizer)
  return 1e3 * time_median(run, repeats)["median_s"]


def main(argv=None):
  args = parse_args(__doc__.split("\n\n")[0], repeats=7, quick_repeats=3, argv=argv,
                    switches={"system-malloc": "measure with the default allocator (by default"
                                               " glibc keeps freed memory for reuse on CPU)"})
  allocator = "system" if args.system_malloc else ("keep" if keep_freed_memory() else "system")
  num_tables, vocab, dim, batch = (26, 100_000, 64, 4096) if not args.quick else (8, 50_000, 64, 1024)
  rows = []
  for distribution in ("uniform", "zipf"):
    for name, optimizer in (("sgd", SGD(0.01)), ("rowwise_adagrad", RowWiseAdagrad(0.01))):
      plan, ids, buffers = build(num_tables, vocab, dim, batch, optimizer, distribution)
      mine = ours(plan, buffers, args.repeats)
      base = plain_jax(num_tables, vocab, dim, ids, "sgd" if name == "sgd" else "adagrad", args.repeats)
      rows.append({
          "case": f"{distribution}/{name}", "total_rows": num_tables * vocab,
          "ours_ms": mine["step_ms"], "lookup_ms": mine["lookup_ms"], "update_ms": mine["update_ms"],
          "plain_jax_ms": base, "speedup": base / mine["step_ms"],
      })
      del plan, buffers
  plan, _, buffers = build(num_tables, vocab, dim, batch, RowWiseAdagrad(0.01), "uniform")
  backend, part_ms = parts(plan, buffers, args.repeats)
  del plan, buffers
  print(f"\n{num_tables} tables x {vocab} rows x dim {dim}, batch {batch}, 1-{MAX_IDS} ids/sample,"
        f" backend {backend!r}, host allocator {allocator!r}")
  columns = [
      ("case", "case", "s"), ("ours_ms", "ours ms/step", ".1f"), ("lookup_ms", "lookup ms", ".1f"),
      ("update_ms", "update ms", ".1f"), ("plain_jax_ms", "plain JAX ms", ".1f"),
      ("speedup", "plain/ours", ".2f"),
  ]
  print_table(rows, columns)

  print("\nparts of one row-wise Adagrad step (uniform ids), each timed alone; the single-device"
        " step runs combine + the fused update, the generic path (other optimizers, G > 1)"
        " segment_grads + gather + rule + scatter")
  print_table([{"part": k, "ms": v} for k, v in part_ms.items()], [("part", "part", "s"), ("ms", "ms", ".1f")])

  sweep = []
  totals = (100_000, 1_000_000) if args.quick else (100_000, 1_000_000, 10_000_000)
  for total in totals:
    per_table = total // num_tables
    plan, ids, buffers = build(num_tables, per_table, dim, batch, RowWiseAdagrad(0.01), "uniform")
    mine = ours(plan, buffers, args.repeats)
    base = plain_jax(num_tables, per_table, dim, ids, "adagrad", args.repeats)
    sweep.append({"total_rows": total, "ours_ms": mine["step_ms"], "plain_jax_ms": base,
                  "speedup": base / mine["step_ms"]})
    del plan, buffers
  print("\nvocabulary sweep (row-wise Adagrad vs optax.adagrad, uniform ids)")
  print_table(sweep, [("total_rows", "total rows", "d"), ("ours_ms", "ours ms/step", ".1f"),
                      ("plain_jax_ms", "plain JAX ms", ".1f"), ("speedup", "plain/ours", ".2f")])
  result = {"benchmark": "embedding", "quick": args.quick, "backend": backend,
            "host_allocator": allocator, "parts_ms": part_ms, "cases": rows, "sweep": sweep}
  print(json.dumps({**result, "machine": machine_info()}))
  write_json(args.json, result)


if __name__ == "__main__":
  main()
