"""Our embedding step vs the memory floor of this machine, stage by stage.

How far can the step of bench_vs_torchrec.py still get faster here? This
script times our lookup and our sparse update (the CPU backend's C++
kernels, through stacked_lookup and apply_stacked_gradients: one array per
stack, no cut into features) beside the plainest C++ loops that move the
same bytes, on the same tables and the same preprocessed batch
(benchmarks/memory_floor.cc, compiled at run time with the system's C++
compiler):

  floor lookup  out[sample] += table[row] for every entry, in entry order:
                one table row read per entry, as our lookup reads them.
  touch rows    w <- w - 1e-6 * w for every touched row (and its row-wise
                slot), in the batch's sorted row order: one read and one
                write per touched row, as our update must do. It reads no
                gradients and groups no entries.
  floor update  touch rows, plus the read of every entry's gradient row
                (w <- w - 1e-6 * sum_e gain_e * grad[sample_e] over the
                row's entries), which any update must read; the entries
                are grouped by row before the timing, so it is below any
                real update.
  prep          `preprocess` of the raw batch + jax.device_put (host work the
                floor cannot remove: TorchRec does it inside its step).

The floors use the same threads (one per core) and row prefetching as our
kernels. The floor of the whole step is floor lookup + floor update; the
table's ratios say how far ours is above it. Where TorchRec is installed (as
for bench_vs_torchrec.py), its training step on the same batch is timed in
the same rounds, T: no step on this machine that reads those rows and
gradients gets end to end below (floor step + prep) / T, the "bound" column.

Configuration: 26 tables x 100,000 rows x dim 64, batch 4,096, 1-20 uniform
ids per sample, sum combiner (--quick: 8 tables x 50,000 rows, batch 1,024),
for SGD and row-wise Adagrad. Cases are interleaved, medians of --repeats
rounds. The floor is one of host memory: without a C++ compiler, or when JAX's
default backend is not the CPU, the script says so and exits.

Run: python benchmarks/bench_memory_floor.py [--quick] [--repeats N] [--json PATH]
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile

# The repository root after site-packages: an installed sc-framework (with its built
# kernels) comes first; a checkout without an install runs from its sources.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks._common import parse_args, print_table, time_interleaved, write_json  # noqa: E402
from benchmarks.bench_vs_torchrec import (  # noqa: E402
    LEARNING_RATE, SETTLE_S, Ours, TorchRec, make_batch, omp_wait_policy, torchrec_missing)
from sc_framework.host_allocator import keep_freed_memory  # noqa: E402
from sc_framework.primitives._row_ops import cpu_kernels_build  # noqa: E402
from sc_framework.optimizers import SGD, RowWiseAdagrad  # noqa: E402
from sc_framework.primitives import apply_stacked_gradients, stacked_lookup  # noqa: E402

OPTIMIZER_NAMES = {SGD: "sgd", RowWiseAdagrad: "rowwise_adagrad"}  # TorchRec's optimizers
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "memory_floor.cc")


def compile_floor(directory: str) -> ctypes.CDLL | None:
  """memory_floor.cc built and loaded; None (after saying why) without a compiler."""
  compiler = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
  if compiler is None:
    print("memory floor skipped: no C++ compiler found (set CXX to one).")
    return None
  library = os.path.join(directory, "memory_floor.so")
  # For the instructions our kernels' build uses: a fair floor.
  target = ["-march=x86-64-v3"] if cpu_kernels_build() == "x86-64-v3" else []
  subprocess.run([compiler, "-O3", "-std=c++17", *target, "-shared", "-fPIC", "-pthread", SOURCE,
                  "-o", library], check=True)
  floor = ctypes.CDLL(library)
  pointer, size, count = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
  floor.GatherSum.argtypes = [pointer, size, size, pointer, pointer, size, pointer, size, count]
  floor.TouchRows.argtypes = [pointer, pointer, size, size, size, pointer, size, count]
  floor.SumAndStep.argtypes = [pointer, pointer, size, size, size, pointer, size, pointer,
                               pointer, pointer, pointer, count]
  return floor


def _address(array: np.ndarray) -> int:
  return array.ctypes.data


class Floor:
  """The floor loops over host copies of one stack's table, slot and batch.

  Needs a single-device plan (one shard): the local rows of the batch are
  then the stacked table's global rows.
  """

  def __init__(self, library, ours: Ours, device_batch):
    (stack, table), = ours.variables.tables.items()
    slots = ours.variables.slots[stack]
    sparse = device_batch[stack]
    self.library = library
    self.table = np.array(table)
    (self.slot,) = [np.array(s) for s in slots.values()] or [np.zeros((0, 0), np.float32)]
    self.slot_width = self.slot.shape[1] if self.slot.size else 0
    unique_rows = np.asarray(sparse.unique_rows).reshape(-1)
    index = np.asarray(sparse.entry_unique_index).reshape(-1)
    self.entry_samples = np.ascontiguousarray(np.asarray(sparse.entry_samples).reshape(-1))
    self.entry_rows = np.ascontiguousarray(unique_rows[index].astype(np.int32))
    self.unique_rows = np.ascontiguousarray(unique_rows[unique_rows >= 0].astype(np.int32))
    self.samples = int(sum(f.output_shape[0] for f in ours.plan.feature_specs))
    # Padding entries name the sample one past the last (GatherSum stops before them).
    self.valid_entries = int((self.entry_samples < self.samples).sum())
    self.out = np.empty((self.samples, self.table.shape[1]), np.float32)
    # The valid entries grouped by touched row (stable, in entry order):
    # row k's are begin[k] .. begin[k + 1) of grouped_samples and grouped_gains.
    valid = (index >= 0) & (self.entry_samples < self.samples)
    valid &= unique_rows[np.where(valid, index, 0)] >= 0
    order = np.argsort(index[valid], kind="stable")
    ranks = np.searchsorted(np.flatnonzero(unique_rows >= 0), index[valid][order])
    self.begin = np.ascontiguousarray(np.searchsorted(
        ranks, np.arange(self.unique_rows.size + 1)).astype(np.int32))
    self.grouped_samples = np.ascontiguousarray(self.entry_samples[valid][order])
    gains = np.asarray(sparse.entry_gains).reshape(-1)
    self.grouped_gains = np.ascontiguousarray(gains[valid][order].astype(np.float32))
    self.grad = np.full((self.samples, self.table.shape[1]), 0.01, np.float32)
    self.threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)

  def lookup(self, _=None) -> None:
    rows, dim = self.table.shape
    self.library.GatherSum(_address(self.table), rows, dim, _address(self.entry_rows),
                           _address(self.entry_samples), self.entry_samples.size,
                           _address(self.out), self.samples, self.threads)

  def touch(self, _=None) -> None:
    rows, dim = self.table.shape
    self.library.TouchRows(_address(self.table), _address(self.slot), rows, dim,
                           self.slot_width, _address(self.unique_rows), self.unique_rows.size,
                           self.threads)

  def update(self, _=None) -> None:
    rows, dim = self.table.shape
    self.library.SumAndStep(_address(self.table), _address(self.slot), rows, dim,
                            self.slot_width, _address(self.unique_rows), self.unique_rows.size,
                            _address(self.begin), _address(self.grouped_samples),
                            _address(self.grouped_gains), _address(self.grad), self.threads)


def measure(library, config, optimizer, repeats: int, with_torchrec: bool) -> dict:
  num_tables, vocab, dim, batch = config
  rng = np.random.default_rng(0)
  warmup = [make_batch(rng, num_tables, batch, vocab) for _ in range(2)]
  raw = make_batch(rng, num_tables, batch, vocab)
  ours = Ours(num_tables, vocab, dim, batch, optimizer, warmup)
  ready = ours.buffers(raw)
  floor = Floor(library, ours, ready)
  plan = ours.plan
  cotangent = {s.name: jnp.full((s.total_batch_size, s.padded_embedding_dim), 0.01, jnp.float32)
               for s in plan.layout.stacks}
  lookup = jax.jit(lambda tables, b: stacked_lookup(plan, tables, b))
  update = jax.jit(lambda v, b, step: apply_stacked_gradients(plan, v, b, cotangent, step),
                   donate_argnums=0)

  def our_lookup(_):
    jax.block_until_ready(lookup(ours.variables.tables, ready))

  def our_update(i):
    ours.variables = update(ours.variables, ready, i)
    jax.block_until_ready(ours.variables)

  cases = {
      "ours_lookup": our_lookup, "floor_lookup": floor.lookup,
      "ours_update": our_update, "floor_touch": floor.touch, "floor_update": floor.update,
      "ours_step": lambda _: ours.train(ready), "prep": lambda _: ours.buffers(raw),
  }
  if with_torchrec:
    torchrec = TorchRec(num_tables, vocab, dim, OPTIMIZER_NAMES[type(optimizer)])
    cases["torchrec"] = lambda _: torchrec.train(raw)
  timing = time_interleaved(cases, repeats, settle_s=SETTLE_S)
  ms = {case: t["ms"] for case, t in timing.items()}
  floor_step = ms["floor_lookup"] + ms["floor_update"]
  floor_e2e = floor_step + ms["prep"]
  return {
      "optimizer": type(optimizer).__name__, "backend": ours.backend,
      "touched_rows": int(floor.unique_rows.size), "entries": floor.valid_entries,
      **{f"{case}_{key}": value for case, t in timing.items() for key, value in t.items()},
      "lookup_ratio": ms["ours_lookup"] / ms["floor_lookup"],
      "update_ratio": ms["ours_update"] / ms["floor_update"],
      "floor_step_ms": floor_step, "step_ratio": ms["ours_step"] / floor_step,
      "floor_e2e_ms": floor_e2e,
      "torchrec_ms": ms.get("torchrec", float("nan")),
      "bound_vs_torchrec": floor_e2e / ms["torchrec"] if with_torchrec else float("nan"),
  }


def main(argv=None) -> dict:
  args = parse_args(__doc__.split("\n\n")[0], repeats=7, quick_repeats=3, argv=argv)
  config = (8, 50_000, 64, 1024) if args.quick else (26, 100_000, 64, 4096)
  allocator = "keep" if keep_freed_memory() else "system"
  result = {"benchmark": "memory_floor", "quick": args.quick, "repeats": args.repeats,
            "config": dict(zip(("tables", "vocab", "dim", "batch"), config))}
  if jax.default_backend() != "cpu":
    print(f"memory floor skipped: it measures host memory, and JAX runs on"
          f" {jax.default_backend()!r}; run it with JAX_PLATFORMS=cpu.")
    result["skipped"] = f"JAX runs on {jax.default_backend()!r}, not the CPU"
    write_json(args.json, result)
    return result
  with tempfile.TemporaryDirectory() as directory:
    library = compile_floor(directory)
    if library is None:
      result["skipped"] = "no C++ compiler found"
      write_json(args.json, result)
      return result
    missing = torchrec_missing()
    if missing:
      print(f"TorchRec not timed: {missing}. Install it as the README says for"
            " bench_vs_torchrec.py to see the bound on the ratio to its step.")
      result["torchrec_skipped"] = missing
    else:
      result["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY")
    rows = [measure(library, config, optimizer, args.repeats, not missing)
            for optimizer in (SGD(LEARNING_RATE), RowWiseAdagrad(LEARNING_RATE))]
  num_tables, vocab, dim, batch = config
  print(f"\nours vs the memory floor: {num_tables} tables x {vocab:,} rows x dim {dim}, batch"
        f" {batch:,}, 1-20 uniform ids/sample; median of {args.repeats} interleaved rounds;"
        f" host allocator {allocator!r}; backend {rows[0]['backend']!r}; C++ kernels build"
        f" {cpu_kernels_build()!r}"
        + ("" if missing else omp_wait_policy().replace(",", ";")))
  print_table(rows, [
      ("optimizer", "optimizer", "s"),
      ("ours_lookup_ms", "lookup ms", ".1f"), ("floor_lookup_ms", "floor", ".1f"),
      ("lookup_ratio", "ours/floor", ".2f"),
      ("ours_update_ms", "update ms", ".1f"), ("floor_touch_ms", "touch rows", ".1f"),
      ("floor_update_ms", "floor", ".1f"),
      ("update_ratio", "ours/floor", ".2f"),
      ("ours_step_ms", "step ms", ".1f"), ("floor_step_ms", "floor", ".1f"),
      ("step_ratio", "ours/floor", ".2f"),
      ("prep_ms", "prep ms", ".1f"), ("floor_e2e_ms", "floor + prep ms", ".1f"),
      ("torchrec_ms", "TorchRec ms", ".1f"), ("bound_vs_torchrec", "bound", ".2f"),
  ])
  result["results"] = rows
  write_json(args.json, result)
  return result


if __name__ == "__main__":
  main()
