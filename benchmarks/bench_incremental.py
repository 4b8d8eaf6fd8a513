"""Incremental (delta) checkpoints vs full ones, side by side in one run.

Setup: 2 host CPU devices (with JAX_PLATFORMS=cuda or tpu: up to 2 of that
platform's devices), 2 tables in one stack, V rows in all x 64 float32
(full run: V = 10^7, 2.4 GiB; --quick: V = 5 * 10^5), with a row-wise Adagrad
slot ([V_s, 1]). Updates follow a Zipf id stream (exponent 1.05, ids
permuted so hot rows are spread over the shards): each step draws B ids and
adds noise to their rows of the table and slot on the devices (what a sparse
update writes); the host records the rows with `checkpoint.UpdatedRows`.

Measured (medians of --repeats runs; cases interleaved so that a busy machine
slows them alike):

  save      at several shares of changed rows, a full save and a delta save
            of the same state (EmbeddingCheckpointHandler through
            ocp.AsyncCheckpointer): total time, bytes on disk, and the
            caller-blocked time (until save() returns), of which "ours" is
            the delta's validation and snapshot, the rest Orbax's fixed
            cost of starting an asynchronous save. The crossover is the
            smallest share at which the delta save takes as long as the full
            one; `IncrementalPolicy.max_delta_share` sits below it.
  restore   the state after a base and 10 deltas (one every S = 4 steps) restored
            from the chain vs from a full save of the same state
            (EmbeddingRestore into the saved layout), and both compared bit
            for bit.

Goals: delta >= 20x smaller and faster at <= 1% changed rows; restore of base
+ 10 deltas <= 1.3x the full restore; blocked share of a delta save < 10%.

Run: python benchmarks/bench_incremental.py [--quick] [--repeats N] [--json PATH]
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import tempfile
import time


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The repository root after site-packages: an installed sc-framework (with its built
# kernels) comes first; a checkout without an install runs from its sources.
sys.path.append(REPO)

from benchmarks._common import (  # noqa: E402
    default_to_host_devices,
    parse_args,
    print_table,
    write_json,
)

default_to_host_devices(2)  # before jax is imported

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

import checkpoint as ck  # noqa: E402
from sc_framework import FeatureSpec, TableSpec, stack_tables  # noqa: E402
from sc_framework.optimizers import RowWiseAdagrad  # noqa: E402
from sc_framework.stacking import logical_to_global_rows  # noqa: E402

AXIS = "table"
DIM = 64
ZIPF = 1.05


def _setup(total_rows: int):
  half = total_rows // 2
  tables = [TableSpec(name, half, DIM, optimizer=RowWiseAdagrad()) for name in ("users", "items")]
  features = [FeatureSpec(f"f_{t.name}", t, (1024,)) for t in tables]
  devices = jax.devices()[:2]  # 2 host CPU devices, or up to 2 accelerators
  layout = stack_tables(features, [["users", "items"]], len(devices), 1)
  mesh = Mesh(np.array(devices), (AXIS,))
  sharding = NamedSharding(mesh, PartitionSpec(AXIS, None))
  stack = layout.stacks[0]
  key = jax.random.key(0)
  table = jax.jit(
      lambda k: jax.random.normal(k, stack.shape, np.float32), out_shardings=sharding
  )(key)
  slot = jax.jit(
      lambda: np.full((stack.vocabulary_size, 1), 0.1, np.float32), out_shardings=sharding
  )()
  slot_specs = {stack.name: RowWiseAdagrad().slots()}
  slots = {stack.name: {"accumulator": slot}}
  return layout, mesh, sharding, {stack.name: table}, slots, slot_specs


class Stream:
  """Zipf ids over the logical rows of both tables, permuted, as global stacked rows."""

  def __init__(self, layout, seed: int):
    self._layout = layout
    self._rng = np.random.default_rng(seed)
    self._perm = {t.name: self._rng.permutation(t.vocabulary_size) for t in layout.stacks[0].tables}

  def draw(self, count: int) -> np.ndarray:
    rows = []
    for table, perm in self._perm.items():
      ids = (self._rng.zipf(ZIPF, count // 2) - 1) % perm.size
      rows.append(np.asarray(logical_to_global_rows(self._layout, table, perm[ids])))
    return np.concatenate(rows)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _apply(table, slot, rows, noise):
  """The sparse update's writes: every drawn row of the table and slot changes."""
  return table.at[rows].add(noise), slot.at[rows].add(1.0)


def _update(tables, slots, rows, seed: int):
  name = next(iter(tables))
  noise = jax.random.normal(jax.random.key(seed), (rows.size, DIM), np.float32) * 0.01
  table, slot = _apply(tables[name], slots[name]["accumulator"], rows.astype(np.int32), noise)
  return {name: table}, {name: {"accumulator": slot}}


def _bytes(path: str) -> int:
  return sum(
      os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files
  )


def _save(checkpointer, path, embedding) -> dict:
  start = time.perf_counter()
  checkpointer.save(path, embedding)
  blocked = time.perf_counter() - start
  checkpointer.wait_until_finished()
  return {"s": time.perf_counter() - start, "blocked": blocked}


def _advance(tables, slots, tracker, stream, target_share, batch, seed, max_steps=64):
  """Applies Zipf batches until `target_share` of the stacked rows changed.

  A Zipf stream reaches large shares only after very many steps (its tail is
  rarely drawn); past `max_steps` steps the share is topped up with rows drawn
  uniformly from those not yet changed (the save cost depends on how many
  rows changed, not on which).
  """
  name = next(iter(tables))
  total = tracker.layout.stack(name).vocabulary_size
  steps = 0
  while tracker.count() < target_share * total and steps < max_steps:
    rows = stream.draw(batch)
    tables, slots = _update(tables, slots, rows, seed + steps)
    tracker.add(name, rows)
    steps += 1
  missing = int(target_share * total) - tracker.count()
  if missing > 0:
    untouched = np.setdiff1d(np.arange(total), tracker.rows()[name], assume_unique=True)
    rows = np.random.default_rng(seed).choice(untouched, missing, replace=False)
    tables, slots = _update(tables, slots, rows, seed + steps)
    tracker.add(name, rows)
  return tables, slots, steps


def _snapshot_time(embedding, root: str, repeats: int) -> float:
  """The median time of the delta save's own blocking part (validation and snapshot).

  The rest of the caller-blocked time is Orbax's fixed cost of starting an
  asynchronous save (its temporary directory and background threads).
  """
  from checkpoint import _delta  # pylint: disable=g-import-not-at-top
  from etils import epath  # pylint: disable=g-import-not-at-top

  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    write = _delta.prepare_save(epath.Path(root) / "unused", embedding, primary=True)
    times.append(time.perf_counter() - start)
    write.close()  # Never run: nothing is written.
  return float(np.median(times))


def main() -> None:
  args = parse_args(__doc__.splitlines()[0], repeats=3, quick_repeats=3)
  total_rows = 500_000 if args.quick else 10_000_000
  batch = 4096 if args.quick else 32768
  shares = [0.001, 0.01, 0.05, 0.2, 0.5, 0.9] if args.quick else [0.001, 0.01, 0.05, 0.2, 0.5]
  layout, mesh, _, tables, slots, slot_specs = _setup(total_rows)
  stack = layout.stacks[0]
  full_bytes_logical = stack.vocabulary_size * (DIM + 1) * 4
  print(f"tables: {total_rows} rows x {DIM} float32 + slot, {full_bytes_logical / 2**30:.2f} GiB;"
        f" machine shared with other jobs, figures are medians of {args.repeats}")
  checkpointer = ocp.AsyncCheckpointer(ck.EmbeddingCheckpointHandler())
  root = tempfile.mkdtemp(prefix="bench_incremental_")
  stream = Stream(layout, 1)
  tracker = ck.UpdatedRows(layout)
  base = os.path.join(root, "0", "embedding")
  full = ck.EmbeddingSave(tables, slots, layout, slot_specs)
  checkpointer.save(base, full)
  checkpointer.wait_until_finished()

  # --- Save: delta vs full at growing shares of changed rows (all deltas on the base).
  save_rows = []
  for index, share in enumerate(shares):
    tables, slots, _ = _advance(tables, slots, tracker, stream, share, batch, 1000 * index)
    rows = tracker.rows()
    changed = sum(r.size for r in rows.values()) / stack.vocabulary_size
    full = ck.EmbeddingSave(tables, slots, layout, slot_specs)
    delta = ck.EmbeddingSave(
        tables, slots, layout, slot_specs, delta=ck.Delta(rows, parent_step=0, base_step=0)
    )
    cases = {"full": full, "delta": delta}
    times = {name: [] for name in cases}
    sizes = {}
    for repeat in range(args.repeats + 1):  # Round 0 is untimed.
      for name, embedding in cases.items():
        step = f"{index}{name}{repeat}"
        path = os.path.join(root, step, "embedding")
        result = _save(checkpointer, path, embedding)
        sizes[name] = _bytes(path)
        shutil.rmtree(os.path.join(root, step))
        if repeat:
          times[name].append(result)
    med = {
        name: {k: float(np.median([t[k] for t in values])) for k in ("s", "blocked")}
        for name, values in times.items()
    }
    snapshot_s = _snapshot_time(delta, root, args.repeats)
    save_rows.append({
        "changed_pct": 100 * changed,
        "full_s": med["full"]["s"],
        "delta_s": med["delta"]["s"],
        "time_ratio": med["full"]["s"] / med["delta"]["s"],
        "full_mib": sizes["full"] / 2**20,
        "delta_mib": sizes["delta"] / 2**20,
        "bytes_ratio": sizes["full"] / sizes["delta"],
        "delta_blocked_pct": 100 * med["delta"]["blocked"] / med["delta"]["s"],
        "delta_snapshot_pct": 100 * snapshot_s / med["delta"]["s"],
        "full_blocked_pct": 100 * med["full"]["blocked"] / med["full"]["s"],
    })
  print("\nsave at the same step: full vs delta")
  print_table(save_rows, [
      ("changed_pct", "changed %", ".2f"), ("full_s", "full s", ".3f"),
      ("delta_s", "delta s", ".3f"), ("time_ratio", "full/delta time", ".1f"),
      ("full_mib", "full MiB", ".1f"), ("delta_mib", "delta MiB", ".2f"),
      ("bytes_ratio", "full/delta bytes", ".1f"), ("delta_blocked_pct", "delta blocked %", ".1f"),
      ("delta_snapshot_pct", "of it ours %", ".1f"), ("full_blocked_pct", "full blocked %", ".1f"),
  ])
  crossover = next((r["changed_pct"] for r in save_rows if r["time_ratio"] <= 1.0), None)
  where = "beyond the largest share measured" if crossover is None else f"{crossover:.1f}% changed"
  print(f"crossover (delta save as slow as full): {where}"
        f"; IncrementalPolicy().max_delta_share = {ck.IncrementalPolicy().max_delta_share}")

  # --- Restore: base + 10 deltas (one every S steps) vs a full save of the same state.
  shutil.rmtree(root)
  root = tempfile.mkdtemp(prefix="bench_incremental_")
  tracker.clear()
  checkpointer.save(os.path.join(root, "0", "embedding"),
                    ck.EmbeddingSave(tables, slots, layout, slot_specs))
  checkpointer.wait_until_finished()
  every = 4  # S: steps between saves
  for step in range(1, 11):
    for _ in range(every):
      rows = stream.draw(batch)
      tables, slots = _update(tables, slots, rows, 10**6 + step * every + _)
      tracker.add(stack.name, rows)
    delta = ck.Delta(tracker.rows(), parent_step=step - 1, base_step=0)
    checkpointer.save(os.path.join(root, str(step), "embedding"),
                      ck.EmbeddingSave(tables, slots, layout, slot_specs, delta=delta))
    checkpointer.wait_until_finished()
    tracker.clear()
  checkpointer.save(os.path.join(root, "full", "embedding"),
                    ck.EmbeddingSave(tables, slots, layout, slot_specs))
  checkpointer.wait_until_finished()
  chain_rows = sum(link.get("rows", {}).get(stack.name, 0)
                   for link in ck.inspect(os.path.join(root, "10", "embedding"))["chain"])
  del tables, slots
  handler = ck.EmbeddingCheckpointHandler()
  restore_args = ck.EmbeddingRestore(layout, mesh, AXIS)
  digests = {}

  def restore(name):
    state = handler.restore(os.path.join(root, name, "embedding"), restore_args)
    jax.block_until_ready(state)
    return state

  def digest(state) -> str:
    """A SHA-256 of every restored array's bytes (only digests are kept: memory)."""
    sha = hashlib.sha256()
    for key in sorted(state.tables):
      sha.update(np.asarray(state.tables[key]).tobytes())
      sha.update(np.asarray(state.slots[key]["accumulator"]).tobytes())
    return sha.hexdigest()

  timings = {}
  for name in ("10", "full"):
    digests[name] = digest(restore(name))  # Untimed round; compared bit for bit.
  for name in ("10", "full"):
    timings[name] = []
  for _ in range(args.repeats):
    for name in ("10", "full"):
      start = time.perf_counter()
      restore(name)
      timings[name].append(time.perf_counter() - start)
  same = digests["10"] == digests["full"]
  chain_s, full_s = float(np.median(timings["10"])), float(np.median(timings["full"]))
  restore_row = {
      "deltas": 10, "steps_per_delta": every, "delta_rows": chain_rows,
      "chain_s": chain_s, "full_s": full_s, "ratio": chain_s / full_s, "bit_exact": same,
  }
  print("\nrestore: base + 10 deltas vs full save of the same state")
  print_table([restore_row], [
      ("deltas", "deltas", "d"), ("steps_per_delta", "S steps", "d"),
      ("delta_rows", "rows in deltas", "d"), ("full_s", "full s", ".3f"),
      ("chain_s", "chain s", ".3f"), ("ratio", "chain/full", ".2f"), ("bit_exact", "same bits", ""),
  ])
  shutil.rmtree(root)
  write_json(args.json, {
      "benchmark": "incremental", "total_rows": total_rows, "dim": DIM, "batch": batch,
      "repeats": args.repeats, "quick": args.quick, "save": save_rows,
      "crossover_changed_pct": crossover, "restore": restore_row,
  })


if __name__ == "__main__":
  main()
