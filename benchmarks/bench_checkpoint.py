"""Checkpoint throughput: ours vs numpy.save / numpy.load of the same bytes.

Setup: 8 host CPU devices, 4 tables of V rows x 128 float32 in 2 stacks,
row-wise Adagrad slots ([V_s, 1]); about 2 GiB in all (--quick: 246 MiB).
With JAX_PLATFORMS=cuda (or tpu) the arrays live on up to 8 of that
platform's devices instead, and the restore layouts below use at most as
many devices as there are.
Every timed run starts from device arrays and ends with files, or with
device arrays, on both sides:

  numpy save      np.save(np.asarray(shard)) of every shard, one file each
  numpy load      np.load of every file + jax.device_put onto its device
  orbax           ocp.StandardCheckpointer (PyTree handler, OCDBT + zarr3):
                  the alternative to TensorStore-direct storage we measured
  ours save       EmbeddingCheckpointHandler through ocp.AsyncCheckpointer:
                  "blocked" is the time until save() returns (the caller's
                  share), the total until wait_until_finished() returns;
                  with the default crc32c checksum, without it, and (full
                  run) with zstd and blosc compression
  ours restore    EmbeddingRestore into the saved layout (the fast path),
                  into (G, S) = (2, 4) with other stacking groups and into
                  (4, 4) (16 shards from 8: every chunk feeds 2); TableRestore
                  of one whole table (rate over that table's bytes)
  manager         checkpoint.CheckpointManager, as a Trainer saves and
                  resumes: the default crc32c chunk checksums plus the step's
                  integrity manifest, written inside the commit and verified
                  before the restore (the default, integrity on); the restore
                  is timed from an open manager (as a Trainer resumes)

The cases run round-robin (one untimed round first) so that a busy machine
slows them alike, each after an untimed sync of the files earlier cases
wrote; figures are medians. Then the offline conversion: the
checkpoint converted (untimed) to one shard, then, in a subprocess that
reports its peak RSS (resource.getrusage), round-robin with medians (each
case after an untimed sync too):

  cp -r               the machine's copy of the same files (in the kernel)
  numpy read + write  np.fromfile + tofile of every file: the sequential copy
                      rate of the same bytes through a process's memory
  convert -> T        sc-checkpoint convert to (8,2) (1 shard -> 16), (2,4)
                      with other groups, (8,1) with every table alone, and
                      unstacked arrays

run on the checkpoint and on one of 1/8 the size, to show that peak memory
does not grow with the tables.

Targets: save and restore >= 0.9x numpy's rate, restores with checksums
included; restore into another layout >= 0.8x numpy.load; blocked < 10% of
the total save; conversion >= 0.5x the copy rate of the same bytes, peak RSS
< 1 GiB.

Run: python benchmarks/bench_checkpoint.py [--quick] [--repeats N] [--json PATH]
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable


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

default_to_host_devices(8)  # before jax is imported

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

import checkpoint as ck  # noqa: E402
from sc_framework import FeatureSpec, TableSpec, stack_tables  # noqa: E402
from sc_framework.optimizers import RowWiseAdagrad  # noqa: E402
from sc_framework.stacking import stack  # noqa: E402

DIM = 128
AXIS = "table"
MIB = 2**20
GROUPS = [["t0", "t1"], ["t2", "t3"]]
REGROUPED = [["t0", "t2"], ["t1", "t3"]]


def _model(rows_per_table: int) -> list[FeatureSpec]:
  optimizer = RowWiseAdagrad()
  tables = [TableSpec(f"t{i}", rows_per_table, DIM, optimizer=optimizer) for i in range(4)]
  return [FeatureSpec(f"f{i}", table, (64,)) for i, table in enumerate(tables)]


def _state(features, layout, mesh, seed=0):
  rng = np.random.default_rng(seed)
  sharding = NamedSharding(mesh, PartitionSpec(AXIS, None))
  tables, slots = {}, {}
  for group in GROUPS:
    logical = {
        n: rng.standard_normal((features[0].table.vocabulary_size, DIM), dtype=np.float32)
        for n in group
    }
    accumulators = {n: rng.random((v.shape[0], 1), dtype=np.float32) for n, v in logical.items()}
    sub = stack_tables([f for f in features if f.table.name in group], [group], layout.num_devices)
    name = sub.stacks[0].name
    tables[name] = jax.device_put(stack(logical, sub)[name], sharding)
    slots[name] = {
        "accumulator": jax.device_put(stack(accumulators, sub, row_width=1)[name], sharding)
    }
    del logical
  jax.block_until_ready((tables, slots))
  return tables, slots


def _nbytes(tables, slots) -> int:
  return sum(a.nbytes for a in tables.values()) + sum(
      a.nbytes for s in slots.values() for a in s.values()
  )


def _shape(layout) -> str:
  """A layout's (devices, shards per device), as the case names show it."""
  return f"({layout.num_devices},{layout.shards_per_device})"


def _arrays(tables, slots):
  out = [(f"{n}.table", a) for n, a in tables.items()]
  return out + [(f"{n}.{s}", a) for n, group in slots.items() for s, a in group.items()]


def _disk_bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


# Linux carries a process's peak RSS across fork + exec, so a child of this
# (large) process would report our peak as its own. A small launcher process
# in between starts the measured process from a small address space.
_LAUNCHER = "import subprocess, sys; sys.exit(subprocess.run(sys.argv[1:]).returncode)"
_CONVERT = textwrap.dedent("""
    import json, os, resource, shutil, subprocess, sys, time
    import numpy as np
    import checkpoint as ck
    src, work, repeats, regrouped = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    out = {"import_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    layout = ck.CheckpointReader(src).layout
    targets = {
        "(8,2)": ck.relayout(layout, num_devices=8, shards_per_device=2),
        "(2,4) regrouped": ck.relayout(
            layout, num_devices=2, shards_per_device=4, groups=json.loads(regrouped)),
        "(8,1) tables alone": ck.relayout(
            layout, num_devices=8, shards_per_device=1, groups=[[t] for t in layout.table_names]),
        "unstacked": "unstacked",
    }

    def numpy_copy(dst):  # The same files, read into and written from numpy arrays.
      for folder, _, files in os.walk(src):
        into = os.path.join(dst, os.path.relpath(folder, src))
        os.makedirs(into, exist_ok=True)
        for name in files:
          with open(os.path.join(folder, name), "rb") as f:
            data = np.fromfile(f, np.uint8)
          data.tofile(os.path.join(into, name))

    cases = [("cp -r", lambda dst: subprocess.run(["cp", "-r", src, dst], check=True)),
             ("numpy read + write", numpy_copy)]
    cases += [(f"convert -> {name}", lambda dst, t=t: ck.convert(src, dst, t))
              for name, t in targets.items()]
    times = {name: [] for name, _ in cases}
    for round_ in range(repeats + 1):  # Round-robin; the first round is not timed.
      for name, run in cases:
        dst = os.path.join(work, "out")
        if hasattr(os, "sync"):  # Untimed: the writes of the case before go to disk first.
          os.sync()
        start = time.perf_counter()
        run(dst)
        seconds = time.perf_counter() - start
        shutil.rmtree(dst)
        if round_:
          times[name].append(seconds)
    out["times"] = times
    out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(out))
    """)


def _convert_in_subprocess(src: str, work: str, repeats: int) -> dict:
  """Conversions of `src` (1 shard) to every target and the copy baselines, round-robin."""
  env = dict(
      os.environ,
      PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
      JAX_PLATFORMS="cpu",
  )
  env.pop("XLA_FLAGS", None)
  os.makedirs(work, exist_ok=True)
  command = [sys.executable, "-c", _LAUNCHER, sys.executable, "-c", _CONVERT, src, work]
  command += [str(repeats), json.dumps(REGROUPED)]
  result = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
  if result.returncode != 0:
    raise RuntimeError(f"conversion subprocess failed:\n{result.stderr[-4000:]}")
  return json.loads(result.stdout.strip().splitlines()[-1])


def _flush_writes() -> None:
  """Writes the machine's dirty pages to disk (untimed, before each case).

  No case syncs its own files, so without this a case would run while the
  disk still writes back the gigabytes the cases before it left in the page
  cache, and its time would depend on its place in the round.
  """
  if hasattr(os, "sync"):
    os.sync()


class _Cases:
  """Cases run round-robin; each call returns {"s": seconds, ...extra timings}."""

  def __init__(self):
    self.cases: list[tuple[str, Callable[[], dict]]] = []
    self.samples: dict[str, list[dict]] = {}

  def add(self, name: str, fn: Callable[[], dict]) -> None:
    self.cases.append((name, fn))
    self.samples[name] = []

  def run(self, repeats: int) -> None:
    for round_ in range(repeats + 1):
      for name, fn in self.cases:
        _flush_writes()
        sample = fn()
        if round_:
          self.samples[name].append(sample)

  def median(self, name: str, key: str = "s") -> float:
    return float(np.median([sample[key] for sample in self.samples[name]]))


def main() -> None:
  args = parse_args(__doc__.splitlines()[0], repeats=3, quick_repeats=2)
  rows = 125_000 if args.quick else 1_000_000
  features = _model(rows)
  devices = jax.devices()[:8]  # 8 host CPU devices, or up to 8 accelerators
  layout = stack_tables(features, GROUPS, len(devices), 1)
  mesh = Mesh(np.array(devices), (AXIS,))
  tables, slots = _state(features, layout, mesh)
  nbytes = _nbytes(tables, slots)
  slot_specs = {name: RowWiseAdagrad().slots() for name in layout.stack_names}
  work = tempfile.mkdtemp(prefix="bench_checkpoint_")
  counter = iter(range(10**6))
  print(
      f"{nbytes / MIB:.0f} MiB of stacked tables and slots on {len(devices)}"
      f" {jax.default_backend()} device(s) ({devices[0].device_kind});"
      f" {args.repeats} repeats"
  )

  def fresh() -> str:
    return os.path.join(work, f"c{next(counter)}")

  cases = _Cases()
  keep: dict[str, str] = {}  # case -> its latest checkpoint, read by the restore cases.

  def timed_save(name: str, save: Callable[[str], Callable[[], None]]) -> Callable[[], dict]:
    """save(path) starts a save and returns its wait; measures blocked and total."""

    def run() -> dict:
      path = fresh()
      start = time.perf_counter()
      wait = save(path)
      blocked = time.perf_counter() - start
      wait()
      total = time.perf_counter() - start
      old, keep[name] = keep.get(name), path
      if old:
        shutil.rmtree(old, ignore_errors=True)
      return {"s": total, "blocked": blocked}

    return run

  def numpy_save(path: str):
    os.makedirs(path)
    for name, array in _arrays(tables, slots):
      for i, shard in enumerate(array.addressable_shards):
        np.save(os.path.join(path, f"{name}.{i}.npy"), np.asarray(shard.data))
    return lambda: None

  def numpy_load() -> dict:
    start = time.perf_counter()
    restored = []
    for name, array in _arrays(tables, slots):
      pieces = [
          jax.device_put(np.load(os.path.join(keep["numpy save"], f"{name}.{i}.npy")), shard.device)
          for i, shard in enumerate(array.addressable_shards)
      ]
      restored.append(jax.make_array_from_single_device_arrays(array.shape, array.sharding, pieces))
    jax.block_until_ready(restored)
    return {"s": time.perf_counter() - start}

  state = {"tables": tables, "slots": slots}
  orbax_checkpointer = ocp.StandardCheckpointer()
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)

  def orbax_save(path: str):
    orbax_checkpointer.save(path, state)
    return orbax_checkpointer.wait_until_finished

  def orbax_restore() -> dict:
    start = time.perf_counter()
    jax.block_until_ready(orbax_checkpointer.restore(keep["orbax save"], abstract))
    return {"s": time.perf_counter() - start}

  ours_checkpointer = ocp.AsyncCheckpointer(ck.EmbeddingCheckpointHandler())

  def ours_save(storage: ck.StorageOptions):
    def save(path: str):
      ours_checkpointer.save(
          path, args=ck.EmbeddingSave(tables, slots, layout, slot_specs, storage)
      )
      return ours_checkpointer.wait_until_finished

    return save

  def ours_restore(source: str, target) -> Callable[[], dict]:
    target_mesh = Mesh(np.array(devices[: target.num_devices]), (AXIS,))
    restore_args = ck.EmbeddingRestore(target, target_mesh, AXIS)

    def run() -> dict:
      start = time.perf_counter()
      jax.block_until_ready(ck.EmbeddingCheckpointHandler().restore(keep[source], restore_args))
      return {"s": time.perf_counter() - start}

    return run

  def table_restore() -> dict:
    start = time.perf_counter()
    ck.EmbeddingCheckpointHandler().restore(
        keep["ours save (crc32c)"], ck.TableRestore(tables=["t1"])
    )
    return {"s": time.perf_counter() - start}

  def manager_save(path: str):
    manager = ck.CheckpointManager(path, keep_latest=1)
    manager.save(0, ck.EmbeddingSave(tables, slots, layout, slot_specs))

    def wait() -> None:
      manager.wait_until_finished()
      manager.close()

    return wait

  def manager_restore() -> dict:
    restore_args = ck.EmbeddingRestore(layout, mesh, AXIS)
    # Opening the manager (listing and checking the steps) is not timed: a
    # Trainer opens it once; what is timed is verifying and reading the step.
    with ck.CheckpointManager(keep["manager save (crc32c + manifest)"], read_only=True) as mngr:
      start = time.perf_counter()
      jax.block_until_ready(mngr.restore(0, restore_args))
      return {"s": time.perf_counter() - start}

  # Other layouts: (2,4) with other groups, and (4,4), 16 shards from 8, so
  # that every chunk feeds 2 (with fewer devices, as many as there are).
  regrouped = ck.relayout(layout, num_devices=min(2, len(devices)), shards_per_device=4,
                          groups=REGROUPED)
  more_shards = ck.relayout(layout, num_devices=min(4, len(devices)), shards_per_device=4)
  cases.add("numpy save", timed_save("numpy save", numpy_save))
  cases.add("numpy load", numpy_load)
  cases.add("orbax save", timed_save("orbax save", orbax_save))
  cases.add("orbax restore", orbax_restore)
  variants = [("crc32c", ck.StorageOptions()), ("no checksum", ck.StorageOptions(checksum="none"))]
  if not args.quick:
    variants += [
        ("zstd", ck.StorageOptions(compression="zstd")),
        ("blosc", ck.StorageOptions(compression="blosc")),
    ]
  for label, storage in variants:
    cases.add(f"ours save ({label})", timed_save(f"ours save ({label})", ours_save(storage)))
    cases.add(f"ours restore ({label})", ours_restore(f"ours save ({label})", layout))
    if label == "crc32c":
      # Right after the save they read, as the restore into its own layout
      # and numpy.load are: a full run writes more checkpoints than the page
      # cache holds, and a case placed later would read from the disk.
      for name, target in ((f"ours restore to {_shape(regrouped)} regrouped", regrouped),
                           (f"ours restore to {_shape(more_shards)}", more_shards)):
        cases.add(name, ours_restore("ours save (crc32c)", target))
      cases.add("ours TableRestore (1 table)", table_restore)
  cases.add(
      "manager save (crc32c + manifest)",
      timed_save("manager save (crc32c + manifest)", manager_save),
  )
  cases.add("manager restore (crc32c + manifest)", manager_restore)
  cases.run(args.repeats)

  numpy_save_s, numpy_load_s = cases.median("numpy save"), cases.median("numpy load")
  one_table = rows * (DIM + 1) * 4
  results = []
  for name, _ in cases.cases:
    seconds = cases.median(name)
    size = one_table if name.startswith("ours TableRestore") else nbytes
    row = {
        "case": name,
        "s": seconds,
        "mbps": size / MIB / seconds,
        "ratio": float("nan"),
        "blocked_s": float("nan"),
        "blocked_pct": float("nan"),
        "disk_mib": float("nan"),
    }
    if "save" in name:
      row["blocked_s"] = cases.median(name, "blocked")
      row["blocked_pct"] = 100 * row["blocked_s"] / seconds
      row["disk_mib"] = _disk_bytes(keep[name]) / MIB
      if name != "numpy save":
        row["ratio"] = numpy_save_s / seconds
    elif name != "numpy load" and "TableRestore" not in name:
      row["ratio"] = numpy_load_s / seconds
    results.append(row)
  orbax_checkpointer.close()
  ours_checkpointer.close()

  # Offline conversion from one shard (the source saved on 8 devices, converted
  # to (1,1) untimed) to every kind of target, beside the machine's copy rate of
  # the same files, in subprocesses that report their peak RSS.
  small_features = _model(rows // 8)
  small_layout = stack_tables(small_features, GROUPS, len(devices), 1)
  small_tables, small_slots = _state(small_features, small_layout, mesh, seed=1)
  small_path = fresh()
  with ocp.Checkpointer(ck.EmbeddingCheckpointHandler()) as ckptr:
    ckptr.save(
        small_path, args=ck.EmbeddingSave(small_tables, small_slots, small_layout, slot_specs)
    )
  sources = [
      ("full", keep["ours save (crc32c)"], nbytes, args.repeats),
      ("1/8 size", small_path, _nbytes(small_tables, small_slots), 1),
  ]
  del small_tables, small_slots
  conversions = []
  for label, source, size, repeats in sources:
    one_shard = fresh()
    source_layout = ck.CheckpointReader(source).layout
    ck.convert(source, one_shard, ck.relayout(source_layout, num_devices=1, shards_per_device=1))
    out = _convert_in_subprocess(one_shard, fresh(), repeats)
    times = {name: float(np.median(samples)) for name, samples in out["times"].items()}
    for name, seconds in times.items():
      conversions.append(
          {
              "case": f"{label}: {name}",
              "mib": size / MIB,
              "s": seconds,
              "mbps": size / MIB / seconds,
              "vs_copy": times["numpy read + write"] / seconds,
              "vs_cp": times["cp -r"] / seconds,
              "rss_mib": out["peak_rss"] / MIB,
          }
      )
    shutil.rmtree(one_shard, ignore_errors=True)
  shutil.rmtree(work, ignore_errors=True)

  print()
  print_table(
      results,
      [
          ("case", "case", "s"),
          ("s", "seconds", ".3f"),
          ("mbps", "MiB/s", ".0f"),
          ("ratio", "vs numpy", ".2f"),
          ("blocked_s", "blocked s", ".3f"),
          ("blocked_pct", "blocked %", ".1f"),
          ("disk_mib", "on disk MiB", ".0f"),
      ],
  )
  print()
  print(
      "conversion of a 1-shard checkpoint (tables + slots) and copies of its files, round-robin"
      " in one subprocess per source (medians; peak RSS covers the whole subprocess)"
  )
  print_table(
      conversions,
      [
          ("case", "case", "s"),
          ("mib", "MiB", ".0f"),
          ("s", "seconds", ".2f"),
          ("mbps", "MiB/s", ".0f"),
          ("vs_copy", "vs numpy copy", ".2f"),
          ("vs_cp", "vs cp", ".2f"),
          ("rss_mib", "peak RSS MiB", ".0f"),
      ],
  )
  write_json(
      args.json,
      {
          "benchmark": "checkpoint",
          "quick": args.quick,
          "repeats": args.repeats,
          "bytes": nbytes,
          "results": results,
          "conversions": conversions,
      },
  )


if __name__ == "__main__":
  main()
