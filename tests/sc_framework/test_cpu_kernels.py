"""The C++ CPU kernels' plumbing: operand checks and the shared thread pool.

Every handler validates the sizes it relies on and returns an FFI error naming
the kernel, the operand and the expected vs actual shape; XLA raises it in
Python and the process goes on. The row ops pass most shapes through without
checking, so most mismatches here reach the kernels through `CPU_KERNEL_OPS`;
an output shape only a direct `jax.ffi.ffi_call` can get wrong is checked
there. Kernels called from several threads at once share one pool: they must
neither deadlock nor change a bit of their results.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sc_framework.optimizers import FTRL, SGD, Adagrad, Adam, RowWiseAdagrad
from sc_framework.primitives import _row_ops
from sc_framework.primitives._row_ops import (
    _TARGETS,
    CPU_KERNEL_OPS,
    cpu_kernels_available,
    cpu_kernels_build,
)
from tests.numerics import assert_same_bits

pytestmark = pytest.mark.skipif(not cpu_kernels_available(),
                                reason="the C++ CPU kernels were not built")

ROWS, DIM, COUNT, SAMPLES, ENTRIES = 30, 4, 5, 6, 10


def _arrays(seed=0):
  rng = np.random.default_rng(seed)
  return dict(
      table=rng.normal(size=(ROWS, DIM)).astype(np.float32),
      index=rng.choice(ROWS, COUNT, replace=False).astype(np.int32),
      rows=rng.integers(0, ROWS, ENTRIES).astype(np.int32),
      samples=np.sort(rng.integers(0, SAMPLES, ENTRIES)).astype(np.int32),
      unique_index=rng.integers(0, COUNT, ENTRIES).astype(np.int32),
      gains=rng.uniform(-1, 2, ENTRIES).astype(np.float32),
      grads=rng.normal(size=(SAMPLES, DIM)).astype(np.float32),
      row_grads=rng.normal(size=(COUNT, DIM)).astype(np.float32),
      accumulator=rng.uniform(0.1, 1, (ROWS, 1)).astype(np.float32),
      dims=np.full(COUNT, DIM, np.int32),
  )


def _fused(optimizer, a, accumulator=None):
  slots = {} if accumulator is None else {"accumulator": jnp.asarray(accumulator)}
  return CPU_KERNEL_OPS.fused_update(optimizer, jnp.asarray(a["table"]), slots), slots


def _sgd_rows(a, row_grads):
  update, slots = _fused(SGD(learning_rate=0.1), a)
  return update(a["table"], slots, a["index"], 0, a["dims"], row_grads=row_grads)


def _sgd_entries(a, samples):
  update, slots = _fused(SGD(learning_rate=0.1), a)
  entries = (a["grads"], samples, a["unique_index"], a["gains"])
  return update(a["table"], slots, a["index"], 0, a["dims"], entries=entries)


def _adagrad_rows(a, accumulator):
  update, slots = _fused(RowWiseAdagrad(learning_rate=0.1), a, accumulator)
  return update(a["table"], slots, a["index"], 0, a["dims"], row_grads=a["row_grads"])


def _adagrad_entries(a, dims):
  update, slots = _fused(RowWiseAdagrad(learning_rate=0.1), a, a["accumulator"])
  entries = (a["grads"], a["samples"], a["unique_index"], a["gains"])
  return update(a["table"], slots, a["index"], 0, dims, entries=entries)


def _elementwise(optimizer, a, *, slot_rows=ROWS, gains=None, dims=None, row_grads=None):
  """An element-wise rule's fused update: the entries variant unless row_grads is given."""
  slots = {spec.name: jnp.ones((slot_rows, DIM), jnp.float32) for spec in optimizer.slots()}
  update = CPU_KERNEL_OPS.fused_update(optimizer, jnp.asarray(a["table"]), slots)
  dims = a["dims"] if dims is None else dims
  if row_grads is not None:
    return update(a["table"], slots, a["index"], 0, dims, row_grads=row_grads)
  entries = (a["grads"], a["samples"], a["unique_index"], a["gains"] if gains is None else gains)
  return update(a["table"], slots, a["index"], 0, dims, entries=entries)


def _direct_gather(table, index, out_shape):
  out = jax.ShapeDtypeStruct(out_shape, jnp.float32)
  return jax.ffi.ffi_call(_TARGETS["gather_rows"], out)(table, index)


# (call with one operand of the wrong size, the error it must raise)
MISMATCHES = {
    "scatter rows": (
        lambda a: CPU_KERNEL_OPS.scatter_rows(a["table"], a["index"], a["row_grads"][:3]),
        r"sc_framework_scatter_rows: rows has shape \[3, 4\], expected \[5, 4\]",
    ),
    "scatter row width": (
        lambda a: CPU_KERNEL_OPS.scatter_rows(a["table"], a["index"], a["row_grads"][:, :3]),
        r"sc_framework_scatter_rows: rows has shape \[5, 3\], expected \[5, 4\]",
    ),
    "combine gains": (
        lambda a: CPU_KERNEL_OPS.combine_entries(a["table"], a["rows"], a["samples"],
                                                 a["gains"][:7], SAMPLES),
        r"sc_framework_combine_entries: gains has shape \[7\], expected 10 elements",
    ),
    "combine samples": (
        lambda a: CPU_KERNEL_OPS.combine_entries(a["table"], a["rows"], a["samples"][:4],
                                                 a["gains"], SAMPLES),
        r"sc_framework_combine_entries: samples has shape \[4\], expected 10 elements",
    ),
    "segment samples": (
        lambda a: CPU_KERNEL_OPS.segment_grads(a["grads"], a["samples"][:9], a["unique_index"],
                                               a["gains"], COUNT),
        r"sc_framework_segment_grads: samples has shape \[9\], expected 10 elements",
    ),
    "sgd row grads": (
        lambda a: _sgd_rows(a, a["row_grads"][:4]),
        r"sc_framework_sgd_step_rows: grads has shape \[4, 4\], expected \[5, 4\]",
    ),
    "sgd entry samples": (
        lambda a: _sgd_entries(a, a["samples"][:8]),
        r"sc_framework_sgd_step_entries: samples has shape \[8\], expected 10 elements",
    ),
    "adagrad accumulator": (
        lambda a: _adagrad_rows(a, np.ones((ROWS - 2, 1), np.float32)),
        r"sc_framework_rowwise_adagrad_step_rows: accumulator has shape \[28, 1\], expected 30 elements",
    ),
    "adagrad dims": (
        lambda a: _adagrad_entries(a, a["dims"][:2]),
        r"sc_framework_rowwise_adagrad_step_entries: dims has shape \[2\], expected 5 elements",
    ),
    "adagrad (element-wise) row grads": (
        lambda a: _elementwise(Adagrad(0.1), a, row_grads=a["row_grads"][:4]),
        r"sc_framework_adagrad_step_rows: grads has shape \[4, 4\], expected \[5, 4\]",
    ),
    "adam slot rows": (
        lambda a: _elementwise(Adam(0.1), a, slot_rows=ROWS - 2, row_grads=a["row_grads"]),
        r"sc_framework_adam_step_rows: mu has shape \[28, 4\], expected \[30, 4\]"
        r" \(the table's shape\)",
    ),
    "adam dims": (
        lambda a: _elementwise(Adam(0.1), a, dims=a["dims"][:2]),
        r"sc_framework_adam_step_entries: dims has shape \[2\], expected 5 elements",
    ),
    "ftrl entry gains": (
        lambda a: _elementwise(FTRL(0.1), a, gains=a["gains"][:7]),
        r"sc_framework_ftrl_step_entries: gains has shape \[7\], expected 10 elements",
    ),
    "ftrl slot rows": (
        lambda a: _elementwise(FTRL(0.1), a, slot_rows=ROWS + 1),
        r"sc_framework_ftrl_step_entries: accumulator has shape \[31, 4\], expected \[30, 4\]",
    ),
    "gather output": (
        lambda a: _direct_gather(a["table"], a["index"], (COUNT + 1, DIM)),
        r"sc_framework_gather_rows: the output has shape \[6, 4\], expected \[5, 4\]",
    ),
    "gather table rank": (
        lambda a: _direct_gather(a["table"].reshape(-1), a["index"], (COUNT, DIM)),
        r"sc_framework_gather_rows: table has shape \[120\], expected rank 2",
    ),
}


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_kernels_reject_mismatched_operands(case):
  call, message = MISMATCHES[case]
  a = _arrays()
  with pytest.raises(jax.errors.JaxRuntimeError, match=message):
    jax.block_until_ready(jax.jit(lambda: call(a))())
  # The process goes on: the same kernels still work on well-formed operands.
  gathered = jax.jit(CPU_KERNEL_OPS.gather_rows)(a["table"], a["index"])
  assert_same_bits(gathered, a["table"][a["index"]])


def test_concurrent_calls_share_the_pool_without_deadlock():
  """Many threads run the multi-threaded kernels at once; each gets the serial result."""
  rng = np.random.default_rng(7)
  rows, dim, count, entries = 4096, 16, 2048, 8192  # above the kernels' threading threshold
  table = rng.normal(size=(rows, dim)).astype(np.float32)
  index = rng.permutation(rows)[:count].astype(np.int32)
  samples = np.sort(rng.integers(0, count, entries)).astype(np.int32)
  unique_index = rng.integers(0, count, entries).astype(np.int32)
  gains = rng.uniform(-1, 2, entries).astype(np.float32)
  grads = rng.normal(size=(count, dim)).astype(np.float32)

  @jax.jit
  def step(table, grads):
    gathered = CPU_KERNEL_OPS.gather_rows(table, index)
    summed = CPU_KERNEL_OPS.segment_grads(grads + gathered, samples, unique_index, gains, count)
    return CPU_KERNEL_OPS.scatter_rows(table, index, summed)

  expected = np.asarray(step(table, grads))
  executor = concurrent.futures.ThreadPoolExecutor(max_workers=8)
  futures = [executor.submit(lambda: np.asarray(step(table, grads))) for _ in range(32)]
  done, pending = concurrent.futures.wait(futures, timeout=120)
  executor.shutdown(wait=not pending)
  assert not pending, f"{len(pending)} of 32 concurrent kernel calls did not finish (deadlock?)"
  for future in done:
    assert_same_bits(future.result(), expected)


@functools.cache
def _generic_build_targets() -> dict[str, str]:
  """`_TARGETS` with each kernel of the build for any CPU, registered under its own name."""
  from sc_framework.primitives import _cpu_kernels

  handlers = _cpu_kernels.handlers()
  targets = {}
  for key, target in _TARGETS.items():
    targets[key] = f"{target}_generic_build"
    jax.ffi.register_ffi_target(targets[key], handlers[key], platform="cpu")
  return targets


def _every_kernel(seed: int) -> dict[str, jax.Array]:
  """Each kernel once (fused updates with every option), at a threaded size, jitted afresh."""
  rng = np.random.default_rng(seed)
  rows, dim, count, samples, entries = 3000, 37, 1200, 700, 6000  # dim: vector tails too
  table = rng.normal(size=(rows, dim)).astype(np.float32)
  index = rng.permutation(rows)[:count].astype(np.int32)
  index[::50] = -1
  samples_of = np.sort(rng.integers(0, samples + 1, entries)).astype(np.int32)
  unique_index = rng.integers(0, count, entries).astype(np.int32)
  gains = rng.uniform(-1, 2, entries).astype(np.float32)
  grads = rng.normal(size=(samples, dim)).astype(np.float32)
  row_grads = rng.normal(size=(count, dim)).astype(np.float32)
  dims = rng.choice([dim, 30, 9], count).astype(np.int32)
  step = jnp.int32(rng.integers(0, 9))
  out = {
      "gather_rows": jax.jit(CPU_KERNEL_OPS.gather_rows)(table, index),
      "scatter_rows": jax.jit(CPU_KERNEL_OPS.scatter_rows)(table, index, row_grads),
      "combine_entries": jax.jit(CPU_KERNEL_OPS.combine_entries, static_argnums=4)(
          table, index[unique_index].clip(0), samples_of, gains, samples),
      "segment_grads": jax.jit(CPU_KERNEL_OPS.segment_grads, static_argnums=4)(
          grads, samples_of, unique_index, gains, count),
  }
  options = dict(clipvalue=(-0.8, 0.9), row_clipnorm=2.5, weight_decay_factor=0.1,
                 clip_weight_min=-2.0, clip_weight_max=2.5)
  for optimizer in (SGD(0.3), RowWiseAdagrad(0.2, eps=1e-3), Adagrad(0.2, eps=1e-3),
                    Adam(0.05, sum_inside_sqrt=True), FTRL(0.2, l1=0.05, l2=0.1, beta=0.3)):
    optimizer = dataclasses.replace(optimizer, **options)
    slots = {spec.name: jnp.asarray(
        spec.initial_value + rng.uniform(0.0, 0.5, (rows, spec.stacked_width(dim))), jnp.float32)
        for spec in optimizer.slots()}
    fused = CPU_KERNEL_OPS.fused_update(optimizer, jnp.asarray(table), slots)
    for variant, gradients in (("rows", dict(row_grads=row_grads)),
                               ("entries", dict(entries=(grads, samples_of, unique_index, gains)))):
      new_table, new_slots = jax.jit(lambda t, s, g=gradients, f=fused: f(
          t, s, index, step, dims, **g))(jnp.asarray(table), slots)
      out[f"{optimizer.kind}_{variant}"] = new_table
      out.update({f"{optimizer.kind}_{variant}_{k}": v for k, v in new_slots.items()})
  return out


@pytest.mark.skipif(cpu_kernels_build() != "x86-64-v3",
                    reason="this process runs the kernels' build for any CPU, the only one here")
@pytest.mark.parametrize("seed", [0, 1])
def test_the_x86_64_v3_build_gives_the_generic_builds_bits(seed, monkeypatch):
  """The x86-64-v3 build (wider vectors) sums in the same order, without fused multiply-adds."""
  fast = _every_kernel(seed)
  monkeypatch.setattr(_row_ops, "_TARGETS", _generic_build_targets())
  generic = _every_kernel(seed)
  assert fast.keys() == generic.keys()
  for name in fast:
    assert_same_bits(fast[name], generic[name], err_msg=name)


def test_a_cpu_without_x86_64_v3_gets_the_build_for_any_cpu(monkeypatch):
  """The x86-64-v3 build is never even loaded where the CPU lacks its instructions."""
  from sc_framework.primitives import _cpu_kernels

  monkeypatch.setattr(_cpu_kernels, "cpu_supports_x86_64_v3", lambda: False)
  assert _row_ops._kernels_module() is _cpu_kernels
