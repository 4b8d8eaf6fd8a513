"""Host preprocessing throughput: 26 features x 4,096 samples x 1-20 ids.

The configuration of the C++ reference figures we compare with (80-140 ms per
batch): 26 features, each reading its own table of 100,000 rows (dim 64, sum
combiner), all tables in one stack (auto_stack_tables), G = 1 device, S = 1
shard, 4,096 samples per feature and a uniform 1-20 ids per sample (about
1.1M ids per batch). Ids are uniform over the vocabulary, or Zipf-distributed
(exponent 1.05, hot ids scattered over the table). Inputs come as ragged
values + lengths and as dense [B, 20] arrays padded with -1 (--quick: ragged
only). The partition capacities are sized from two warm-up batches with
`collect_stats` and `size_limits_from_stats`.

Each timed call preprocesses a different batch (generated before timing); the
table reports the median wall-clock time and the process CPU time per batch.
preprocess's sort and ranking loops split a batch over up to 8 threads (one
per core); the rest is single-threaded. The CPU time (all threads) is the
work, the wall-clock time what a caller waits.

Overflow (allow_id_dropping=True): the same batches preprocessed twice per
round, interleaved: with capacities that fit every batch ("fits"), and with
capacities 1% below the smallest need of the batches, so every batch
overflows both limits and a few thousand ids are dropped ("overflow"); the
ratio overflow / fits shows what dropping costs.

Run:  python benchmarks/bench_preprocessing.py [--quick] [--repeats N] [--json PATH]
"""

from __future__ import annotations

import os
import sys

import numpy as np

# The repository root after site-packages: an installed sc-framework (with its built
# kernels) comes first; a checkout without an install runs from its sources.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import parse_args, print_table, time_interleaved, time_median, write_json  # noqa: E402
from sc_framework import FeatureSpec, TableSpec, auto_stack_tables  # noqa: E402
from sc_framework.preprocessing import (  # noqa: E402
    DenseIds,
    RaggedIds,
    StackCapacity,
    batch_stats,
    collect_stats,
    preprocess,
    size_limits_from_stats,
)

NUM_FEATURES = 26
BATCH = 4096
VOCAB = 100_000
DIM = 64
MAX_IDS = 20
ZIPF_EXPONENT = 1.05
CPP_REFERENCE_MS = (80.0, 140.0)
PADDING_ID = -1


def feature_specs() -> list[FeatureSpec]:
  return [
      FeatureSpec(f"feature_{i}", TableSpec(f"table_{i}", VOCAB, DIM, combiner="sum"),
                  (BATCH, MAX_IDS))
      for i in range(NUM_FEATURES)
  ]


class IdSampler:
  """Draws ids uniformly or from a Zipf law over a randomly permuted vocabulary."""

  def __init__(self, distribution: str, rng: np.random.Generator):
    self.distribution = distribution
    if distribution == "zipf":
      weights = 1.0 / np.arange(1, VOCAB + 1) ** ZIPF_EXPONENT
      self.cdf = np.cumsum(weights / weights.sum())
      self.permutation = rng.permutation(VOCAB)

  def __call__(self, rng: np.random.Generator, size: int) -> np.ndarray:
    if self.distribution == "uniform":
      return rng.integers(0, VOCAB, size, dtype=np.int32)
    ranks = np.minimum(np.searchsorted(self.cdf, rng.random(size)), VOCAB - 1)
    return self.permutation[ranks].astype(np.int32)


def make_batch(rng: np.random.Generator, sampler: IdSampler, form: str) -> dict:
  batch = {}
  for i in range(NUM_FEATURES):
    lengths = rng.integers(1, MAX_IDS + 1, BATCH)
    values = sampler(rng, int(lengths.sum()))
    if form == "ragged":
      batch[f"feature_{i}"] = RaggedIds.from_lengths(values, lengths)
    else:
      dense = np.full((BATCH, MAX_IDS), PADDING_ID, np.int32)
      dense[np.arange(MAX_IDS) < lengths[:, None]] = values
      batch[f"feature_{i}"] = DenseIds(dense)
  return batch


def run_case(distribution: str, form: str, repeats: int, seed: int) -> dict:
  rng = np.random.default_rng(seed)
  sampler = IdSampler(distribution, rng)
  specs = feature_specs()
  layout = auto_stack_tables(specs, num_devices=1, shards_per_device=1)
  warmup = [make_batch(rng, sampler, form) for _ in range(2)]
  specs = size_limits_from_stats(
      specs, collect_stats(warmup, specs, layout, padding_id=PADDING_ID), layout=layout,
      headroom=1.2
  )
  batches = [make_batch(rng, sampler, form) for _ in range(repeats)]
  num_ids = [
      sum(int(np.count_nonzero(_ids(v) != PADDING_ID)) for v in b.values()) for b in batches
  ]
  dropped = []

  def step(i: int) -> None:
    _, stats = preprocess(batches[i], specs, layout, padding_id=PADDING_ID)
    dropped.append(stats.num_dropped_ids)

  timing = time_median(step, repeats, warmup=1)
  ms = timing["median_s"] * 1e3
  ids = float(np.median(num_ids))
  return {
      "case": f"{distribution}/{form}",
      "distribution": distribution,
      "input_form": form,
      "ids_per_batch": ids,
      "ms": ms,
      "min_ms": timing["min_s"] * 1e3,
      "max_ms": timing["max_s"] * 1e3,
      "cpu_ms": timing["cpu_median_s"] * 1e3,
      "mids_per_s": ids / timing["median_s"] / 1e6,
      "vs_80": CPP_REFERENCE_MS[0] / ms,
      "vs_140": CPP_REFERENCE_MS[1] / ms,
      "num_stacks": len(layout.stacks),
      "dropped_ids": int(sum(dropped)),
  }


def run_overflow_case(distribution: str, repeats: int, seed: int) -> dict:
  """Dropping vs not dropping on the same ragged batches (see the docstring)."""
  rng = np.random.default_rng(seed)
  sampler = IdSampler(distribution, rng)
  specs = feature_specs()
  layout = auto_stack_tables(specs, num_devices=1, shards_per_device=1)
  batches = [make_batch(rng, sampler, "ragged") for _ in range(repeats + 1)]
  needs = [
      batch_stats(b, specs, layout, padding_id=PADDING_ID)[stack.name].required_capacity
      for b in batches for stack in layout.stacks
  ]
  fits, tight = {}, {}
  for stack in layout.stacks:
    fits[stack.name] = StackCapacity(max(n.max_ids_per_partition for n in needs),
                                     max(n.max_unique_ids_per_partition for n in needs))
    tight[stack.name] = StackCapacity(int(0.99 * min(n.max_ids_per_partition for n in needs)),
                                      int(0.99 * min(n.max_unique_ids_per_partition for n in needs)))
  dropped = []

  def run(capacities, record):
    def call(i: int) -> None:
      _, stats = preprocess(batches[i], specs, layout, padding_id=PADDING_ID,
                            allow_id_dropping=True, capacities=capacities)
      if record and i:
        dropped.append(stats.num_dropped_ids)
    return call

  timing = time_interleaved({"fits": run(fits, False), "overflow": run(tight, True)}, repeats)
  return {
      "case": f"{distribution}/ragged",
      "fits_ms": timing["fits"]["ms"], "overflow_ms": timing["overflow"]["ms"],
      "fits_cpu_ms": timing["fits"]["cpu_ms"], "overflow_cpu_ms": timing["overflow"]["cpu_ms"],
      "ratio": timing["overflow"]["ms"] / timing["fits"]["ms"],
      "cpu_ratio": timing["overflow"]["cpu_ms"] / timing["fits"]["cpu_ms"],
      "dropped_per_batch": float(np.median(dropped)),
  }


def _ids(value) -> np.ndarray:
  return value.values if isinstance(value, RaggedIds) else value.ids


def main(argv=None) -> list[dict]:
  args = parse_args(__doc__.split("\n\n")[0], repeats=10, quick_repeats=3, argv=argv)
  cases = [("uniform", "ragged"), ("zipf", "ragged")]
  if not args.quick:
    cases += [("uniform", "dense"), ("zipf", "dense")]
  rows = [run_case(d, f, args.repeats, seed=i) for i, (d, f) in enumerate(cases)]
  print(f"{NUM_FEATURES} features x {BATCH} samples x 1-{MAX_IDS} ids, tables of {VOCAB} rows,"
        f" G=1 S=1, median of {args.repeats} batches (wall clock; CPU ms: CPU time of the"
        " process); 'x C++' = reference ms / our median ms (> 1: faster)")
  print_table(rows, [
      ("case", "case", "s"),
      ("ids_per_batch", "ids/batch", ",.0f"),
      ("ms", "ms/batch", ".1f"),
      ("min_ms", "min ms", ".1f"),
      ("cpu_ms", "CPU ms", ".1f"),
      ("mids_per_s", "M ids/s", ".1f"),
      ("vs_80", "x C++ 80ms", ".2f"),
      ("vs_140", "x C++ 140ms", ".2f"),
  ])
  overflow = [run_overflow_case(d, args.repeats, seed=10 + i)
              for i, d in enumerate(["uniform"] if args.quick else ["uniform", "zipf"])]
  print("\noverflow with allow_id_dropping=True vs the same batches within their limits"
        f" (interleaved, median of {args.repeats} rounds); ratio = overflow / fits")
  print_table(overflow, [
      ("case", "case", "s"), ("fits_ms", "fits ms", ".1f"), ("overflow_ms", "overflow ms", ".1f"),
      ("ratio", "ratio", ".2f"), ("fits_cpu_ms", "fits CPU ms", ".1f"),
      ("overflow_cpu_ms", "overflow CPU ms", ".1f"), ("cpu_ratio", "CPU ratio", ".2f"),
      ("dropped_per_batch", "dropped ids/batch", ",.0f"),
  ])
  write_json(args.json, {
      "benchmark": "preprocessing",
      "quick": args.quick,
      "config": {"features": NUM_FEATURES, "batch": BATCH, "vocab": VOCAB, "dim": DIM,
                 "ids_per_sample": [1, MAX_IDS], "zipf_exponent": ZIPF_EXPONENT,
                 "num_devices": 1, "shards_per_device": 1, "repeats": args.repeats},
      "cpp_reference_ms": list(CPP_REFERENCE_MS),
      "results": rows,
      "overflow": overflow,
  })
  return rows


if __name__ == "__main__":
  main()
