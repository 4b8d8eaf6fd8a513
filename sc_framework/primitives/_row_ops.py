"""Row-level operations of the primitives, in two implementations.

The lookup and the update (`_sharded`) are written against four operations on
row-major float arrays:

  gather_rows(table [R, D], index [K])             -> [K, D], zeros where
                                                      index is outside [0, R)
  scatter_rows(table [R, D], index [K], rows [K, D]) -> table with
                                                      table[index[k]] = rows[k]
                                                      (outside indices dropped;
                                                      inside ones distinct)
  combine_entries(source [M, D], rows [E], samples [E], gains [E], B)
      -> [B, D], out[b] = sum_{e: samples[e] = b} gains[e] * source[rows[e]]
         (samples ascending; outside [0, B) skipped; outside rows read zeros;
         source's dtype)
  segment_grads(grads [B, D], samples [E], unique_index [E], gains [E], K)
      -> [K, D], out[k] = sum_{e: unique_index[e] = k} gains[e] * grads[samples[e]]
         (samples outside [0, B) skipped; in sum_dtype(grads.dtype))

The sums of combine_entries and segment_grads run in float32 at least
(`sum_dtype`): a bfloat16 or float16 table's activations are rounded to the
table's dtype once, after the sum, and its row gradients stay float32. Summed
in bfloat16 (8 significant bits), a sum of ones stalls at 256, so a row read
by 1024 samples got a quarter of its gradient.

`XLA_OPS` expresses them with jnp gathers, scatters and segment sums and runs
anywhere. `CPU_KERNEL_OPS` calls multi-threaded C++ kernels through the XLA
FFI (`_cpu_kernels.cc`, built at install time when a C++ compiler is
available); for non-float32 arrays it falls back to `XLA_OPS`. On x86-64 the
kernels are built twice, for any CPU and for x86-64-v3 CPUs (AVX2, FMA,
BMI); `cpu_kernels_build()` says which one this process runs. Both give the
same bits.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from sc_framework.optimizers import FTRL, SGD, Adagrad, Adam, OptimizerSpec, RowWiseAdagrad
from sc_framework.optimizers._adam import bias_correction


@dataclasses.dataclass(frozen=True)
class RowOps:
  """The four row ops, and optionally fused optimizer updates.

  fused_update(optimizer, table, slots) returns None, or a function
  (table, slots, rows [K], step, row_dims [K], *, row_grads=None,
  entries=None) -> (table, slots) applying that optimizer's full update
  (`optimizer.apply`, its shared options included: an implementation that
  does not cover an option must return None when it is set) to the rows in
  place in one pass, with the rows' gradients given either as row_grads
  [K, D] or as the batch entries (grads [B, D], samples [E], unique_index [E],
  gains [E]) summed per row on the fly (segment_grads' inputs).
  """

  name: str
  gather_rows: Callable[..., jax.Array]
  scatter_rows: Callable[..., jax.Array]
  combine_entries: Callable[..., jax.Array]
  segment_grads: Callable[..., jax.Array]
  fused_update: Callable[..., Callable[..., Any] | None] = lambda optimizer, table, slots: None


def _no_wrap(index, size: int):
  """Maps negative indices past the end, so numpy-style wrapping never applies."""
  return jnp.where(index < 0, size, index)


def _xla_gather_rows(table, index):
  return jnp.take(table, _no_wrap(index, table.shape[0]), axis=0, mode="fill", fill_value=0)


def _xla_scatter_rows(table, index, rows):
  index = _no_wrap(index, table.shape[0])
  return table.at[index].set(rows.astype(table.dtype), mode="drop", unique_indices=True)


def sum_dtype(dtype) -> jnp.dtype:
  """The dtype sums of `dtype` values run in: float32, or the wider float64."""
  return jnp.promote_types(dtype, jnp.float32)


def _xla_combine_entries(source, rows, samples, gains, num_samples):
  wide = sum_dtype(source.dtype)
  weighted = _xla_gather_rows(source, rows).astype(wide) * gains[:, None].astype(wide)
  combined = jax.ops.segment_sum(weighted, samples, num_segments=num_samples,
                                 indices_are_sorted=True)
  return combined.astype(source.dtype)


def _xla_segment_grads(grads, samples, unique_index, gains, num_unique):
  wide = sum_dtype(grads.dtype)
  entry_grads = jnp.take(grads, _no_wrap(samples, grads.shape[0]), axis=0, mode="fill", fill_value=0)
  entry_grads = entry_grads.astype(wide) * gains[:, None].astype(wide)
  return jax.ops.segment_sum(entry_grads, unique_index, num_segments=num_unique)


XLA_OPS = RowOps("xla", _xla_gather_rows, _xla_scatter_rows, _xla_combine_entries, _xla_segment_grads)


def update_rows(ops: RowOps, optimizer: OptimizerSpec, table, slots, rows, step, row_dims,
                row_grads):
  """The generic optimizer update: gather -> `optimizer.apply` -> scatter.

  Rows must be distinct; a row outside [0, R) (unused capacity) reads zeros
  and its write is dropped. The rule runs in float32 at least: a bfloat16
  table's rows are rounded once, when stored. Returns (table, slots).
  """
  wide = sum_dtype(table.dtype)
  gathered = ops.gather_rows(table, rows).astype(wide)
  slot_rows = {name: ops.gather_rows(value, rows) for name, value in slots.items()}
  new_rows, new_slot_rows = optimizer.apply(gathered, row_grads.astype(wide), slot_rows, step,
                                            row_dims)
  return ops.scatter_rows(table, rows, new_rows), {
      name: ops.scatter_rows(value, rows, new_slot_rows[name]) for name, value in slots.items()}


_TARGETS = {
    "gather_rows": "sc_framework_gather_rows",
    "scatter_rows": "sc_framework_scatter_rows",
    "combine_entries": "sc_framework_combine_entries",
    "segment_grads": "sc_framework_segment_grads",
    "sgd_step_rows": "sc_framework_sgd_step_rows",
    "rowwise_adagrad_step_rows": "sc_framework_rowwise_adagrad_step_rows",
    "sgd_step_entries": "sc_framework_sgd_step_entries",
    "rowwise_adagrad_step_entries": "sc_framework_rowwise_adagrad_step_entries",
    **{f"{rule}_step_{variant}": f"sc_framework_{rule}_step_{variant}"
       for rule in ("adagrad", "adam", "ftrl") for variant in ("rows", "entries")},
}


def _kernels_module():
  """The build of the C++ kernels for this CPU (a module), or None when none is built.

  The x86-64-v3 build where it was built and the CPU runs it, else the build
  for any CPU. The CPU is asked by the latter, which runs everywhere: the
  former must not even be loaded on a CPU without its instructions.
  """
  try:
    from sc_framework.primitives import _cpu_kernels  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  if _cpu_kernels.cpu_supports_x86_64_v3():
    try:
      from sc_framework.primitives import _cpu_kernels_x86_64_v3  # pylint: disable=g-import-not-at-top
    except ImportError:  # not built: a compiler without -march=x86-64-v3, another platform
      return _cpu_kernels
    return _cpu_kernels_x86_64_v3
  return _cpu_kernels


def cpu_kernels_build() -> str | None:
  """Which build of the C++ kernels this process runs: "x86-64-v3", "generic" or None (none works)."""
  if not cpu_kernels_available():
    return None
  return "x86-64-v3" if _kernels_module().__name__.endswith("_x86_64_v3") else "generic"


def _has_cpu_backend() -> bool:
  """Whether jax runs a CPU backend in this process (JAX_PLATFORMS can leave it out)."""
  try:
    jax.local_devices(backend="cpu")
  except RuntimeError:  # "Unknown backend cpu"
    return False
  return True


@functools.cache
def cpu_kernels_available() -> bool:
  """Whether the C++ kernels are built, registered and pass a probe call.

  False without a warning where they are not built, or where this process
  has no CPU backend (JAX_PLATFORMS=cuda, say): no plan can use them there.
  """
  kernels = _kernels_module()
  if kernels is None or not _has_cpu_backend():
    return False
  try:
    handlers = kernels.handlers()
    for key, target in _TARGETS.items():
      jax.ffi.register_ffi_target(target, handlers[key], platform="cpu")
    # The first call may come while a jitted function is being traced: run
    # the probe eagerly, outside that trace.
    with jax.ensure_compile_time_eval():
      cpu = jax.local_devices(backend="cpu")[0]  # this process's: others are not addressable
      table = jax.device_put(np.arange(12, dtype=np.float32).reshape(4, 3), cpu)
      index = jax.device_put(np.array([2, -1], np.int32), cpu)
      probe = np.asarray(jax.jit(_kernel_gather_rows)(table, index))
    if not (probe == np.array([[6, 7, 8], [0, 0, 0]], np.float32)).all():
      raise RuntimeError(f"the probe gather returned {probe.tolist()}")
    return True
  except Exception as error:  # noqa: BLE001 - an ABI or registration problem: use the XLA ops
    warnings.warn(
        f"the built CPU kernels ({kernels.__name__}) do not work here"
        f" ({type(error).__name__}: {error}); using the portable XLA ops instead, which are"
        " slower on CPU. pip compiles the kernels against the jaxlib of its build"
        " environment (pyproject.toml's build requirements), not the installed one;"
        f" this process runs jaxlib {jaxlib.__version__}. To rebuild them against it:"
        " pip install 'setuptools>=77', then pip install --no-build-isolation --no-deps"
        " --force-reinstall with this package's source (its directory; -e DIR for an"
        " editable install).",
        RuntimeWarning, stacklevel=2,
    )
    return False


def _f32(*arrays) -> bool:
  return all(a.dtype == jnp.float32 for a in arrays)


def _kernel_gather_rows(table, index):
  if not _f32(table) or table.ndim != 2:
    return _xla_gather_rows(table, index)
  out = jax.ShapeDtypeStruct((index.shape[0], table.shape[1]), table.dtype)
  return jax.ffi.ffi_call(_TARGETS["gather_rows"], out, vmap_method="sequential")(
      table, index.astype(jnp.int32))


def _kernel_scatter_rows(table, index, rows):
  if not _f32(table) or table.ndim != 2:
    return _xla_scatter_rows(table, index, rows)
  out = jax.ShapeDtypeStruct(table.shape, table.dtype)
  return jax.ffi.ffi_call(_TARGETS["scatter_rows"], out, input_output_aliases={0: 0},
                          vmap_method="sequential")(
      table, index.astype(jnp.int32), rows.astype(table.dtype))


def _kernel_combine_entries(source, rows, samples, gains, num_samples):
  if not _f32(source):
    return _xla_combine_entries(source, rows, samples, gains, num_samples)
  out = jax.ShapeDtypeStruct((num_samples, source.shape[1]), source.dtype)
  return jax.ffi.ffi_call(_TARGETS["combine_entries"], out, vmap_method="sequential")(
      source, rows.astype(jnp.int32), samples.astype(jnp.int32), gains.astype(jnp.float32))


def _kernel_segment_grads(grads, samples, unique_index, gains, num_unique):
  if sum_dtype(grads.dtype) == jnp.float32:
    grads = grads.astype(jnp.float32)  # bfloat16 / float16 gradients, summed in float32
  if not _f32(grads):
    return _xla_segment_grads(grads, samples, unique_index, gains, num_unique)
  out = jax.ShapeDtypeStruct((num_unique, grads.shape[1]), grads.dtype)
  return jax.ffi.ffi_call(_TARGETS["segment_grads"], out, vmap_method="sequential")(
      grads, samples.astype(jnp.int32), unique_index.astype(jnp.int32), gains.astype(jnp.float32))


def _differentiable(kernel_fn, xla_fn, nondiff_argnums=()):
  """`kernel_fn` with the derivatives of its XLA twin (FFI calls have none).

  The primal value comes from the kernel; under jvp/grad both primal and
  tangent come from `xla_fn`, which computes the same function.
  """
  wrapped = jax.custom_jvp(kernel_fn, nondiff_argnums=nondiff_argnums)

  @wrapped.defjvp
  def _jvp(*args):
    *static, primals, tangents = args
    if not static:
      return jax.jvp(xla_fn, primals, tangents)
    return jax.jvp(lambda *p: xla_fn(*p, *static), primals, tangents)

  return wrapped


def _gradient_args(row_grads, entries) -> tuple[str, tuple]:
  """Which kernel variant, and its gradient arguments."""
  if (row_grads is None) == (entries is None):
    raise ValueError("pass exactly one of row_grads and entries.")
  if row_grads is not None:
    return "rows", (row_grads.astype(jnp.float32),)
  grads, samples, unique_index, gains = entries
  return "entries", (grads.astype(jnp.float32), samples.astype(jnp.int32),
                     unique_index.astype(jnp.int32), gains.astype(jnp.float32))


def _option_hyperparameters(optimizer, learning_rate: jax.Array) -> jax.Array:
  """The shared options as the fused kernels read them (RowOptions in the .cc file).

  {clip_lo, clip_hi, row_clipnorm, decay, weight_min, weight_max}: an absent
  bound is -inf / +inf, an absent row norm +inf, and the decay is
  weight_decay_factor, times the learning rate when the spec asks for it.
  """
  lo, hi = optimizer.clipvalue or (None, None)

  def bound(value, absent):
    return jnp.float32(absent if value is None else value)

  decay = jnp.float32(optimizer.weight_decay_factor)
  if optimizer.multiply_weight_decay_factor_by_learning_rate:
    decay = decay * learning_rate
  return jnp.stack([
      bound(lo, -np.inf), bound(hi, np.inf), bound(optimizer.row_clipnorm, np.inf), decay,
      bound(optimizer.clip_weight_min, -np.inf), bound(optimizer.clip_weight_max, np.inf),
  ]).astype(jnp.float32)


def _sgd_hyperparameters(optimizer: SGD, lr, step) -> list[jax.typing.ArrayLike]:
  del optimizer, step
  return [lr]


def _adagrad_hyperparameters(optimizer: Adagrad | RowWiseAdagrad, lr,
                             step) -> list[jax.typing.ArrayLike]:
  del step
  return [lr, jnp.float32(optimizer.eps)]


def _adam_hyperparameters(optimizer: Adam, lr, step) -> list[jax.typing.ArrayLike]:
  """{lr, b1, 1 - b1, b2, 1 - b2, 1 - b1^t, 1 - b2^t, eps inside the root, eps outside}.

  The bias corrections are `Adam.update_rule`'s (`bias_correction`, t = step + 1
  in float32); epsilon goes inside the root (squared) or
  outside it, the other place getting 0.
  """
  t = (jnp.asarray(step) + 1).astype(jnp.float32)
  epsilon = optimizer.epsilon
  inside, outside = (epsilon * epsilon, 0.0) if optimizer.sum_inside_sqrt else (0.0, epsilon)
  return [lr, optimizer.beta1, 1.0 - optimizer.beta1, optimizer.beta2, 1.0 - optimizer.beta2,
          bias_correction(optimizer.beta1, t), bias_correction(optimizer.beta2, t), inside,
          outside]


def _ftrl_hyperparameters(optimizer: FTRL, lr, step) -> list[jax.typing.ArrayLike]:
  """{gradient scale s, divisor q, power p, l1 threshold, beta, l2 term}.

  One kernel formula covers both forms of `FTRL.update_rule`:
    z <- z + s * g - (n'^p - n^p) / q * w
    w <- (sign(z) * threshold - z) / ((beta + n'^p) / q + l2_term)  if |z| > threshold
  with (s, q, threshold, l2_term) = (1, lr, l1, 2 l2), or (lr, 1, l1 lr, 2 l2 lr)
  under multiply_linear_by_learning_rate.
  """
  del step
  if optimizer.multiply_linear_by_learning_rate:
    scale, divisor, threshold, l2_term = lr, 1.0, optimizer.l1 * lr, 2.0 * optimizer.l2 * lr
  else:
    scale, divisor, threshold, l2_term = 1.0, lr, optimizer.l1, 2.0 * optimizer.l2
  return [scale, divisor, -optimizer.learning_rate_power, threshold, optimizer.beta, l2_term]


@dataclasses.dataclass(frozen=True)
class _FusedRule:
  """How the kernels `sc_framework_{kernel}_step_{rows,entries}` run one optimizer.

  hyperparameters(optimizer, lr, step) lists the rule's values in the order
  the kernel reads them (`hyper` before the RowOptions); slot_width is the
  slot width the kernel takes: "row" for one value per row [R, 1], "element"
  for the table's shape [R, D].
  """

  kernel: str
  hyperparameters: Callable[[Any, jax.Array, jax.Array], list[jax.typing.ArrayLike]]
  slot_width: Literal["row", "element"]


_FUSED_RULES: dict[type[OptimizerSpec], _FusedRule] = {
    SGD: _FusedRule("sgd", _sgd_hyperparameters, "element"),
    RowWiseAdagrad: _FusedRule("rowwise_adagrad", _adagrad_hyperparameters, "row"),
    Adagrad: _FusedRule("adagrad", _adagrad_hyperparameters, "element"),
    Adam: _FusedRule("adam", _adam_hyperparameters, "element"),
    FTRL: _FusedRule("ftrl", _ftrl_hyperparameters, "element"),
}


def _kernel_fused_update(optimizer, table, slots):
  """Fused kernels for float32 SGD, RowWiseAdagrad, Adagrad, Adam and FTRL; else None.

  The kernels apply the rule and every shared option (gradient clipping by
  row norm and value, weight decay, weight clipping) exactly as
  `optimizer.apply` does; see `sc_framework.optimizers._options`. Subclasses
  of these optimizers (which may change the rule), other dtypes and slots of
  another width than the kernel's take the generic path (None).
  """
  rule = _FUSED_RULES.get(type(optimizer))
  if rule is None or not _f32(table, *slots.values()) or table.ndim != 2:
    return None
  names = tuple(spec.name for spec in optimizer.slots())
  width = 1 if rule.slot_width == "row" else table.shape[1]
  # Another slot width is another variant; a wrong row count is an error the kernel reports.
  if set(names) != set(slots) or any(slots[n].ndim != 2 or slots[n].shape[1] != width
                                     for n in names):
    return None

  def kernel(table, slots, rows, step, row_dims, grad_args):
    variant = "rows" if len(grad_args) == 1 else "entries"
    lr = optimizer.learning_rate_at(step)
    rule_values = jnp.stack([jnp.asarray(v, jnp.float32)
                             for v in rule.hyperparameters(optimizer, lr, step)])
    hyper = jnp.concatenate([rule_values, _option_hyperparameters(optimizer, lr)])
    arrays = (table, *(slots[n] for n in names))
    outs = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays)
    updated = jax.ffi.ffi_call(
        _TARGETS[f"{rule.kernel}_step_{variant}"], outs, vmap_method="sequential",
        input_output_aliases={i: i for i in range(len(arrays))})(
        *arrays, rows.astype(jnp.int32), *grad_args, row_dims.astype(jnp.int32), hyper)
    return updated[0], dict(zip(names, updated[1:]))

  def twin(table, slots, rows, step, row_dims, grad_args):
    """The same update by XLA ops, whose derivatives the kernel's stand for."""
    row_grads = grad_args[0] if len(grad_args) == 1 else _xla_segment_grads(
        *grad_args, rows.shape[0])
    return update_rows(XLA_OPS, optimizer, table, slots, rows, step, row_dims, row_grads)

  differentiable = _differentiable(kernel, twin)

  def update(table, slots, rows, step, row_dims, *, row_grads=None, entries=None):
    _, grad_args = _gradient_args(row_grads, entries)
    return differentiable(table, slots, rows, jnp.asarray(step), row_dims, grad_args)

  return update


CPU_KERNEL_OPS = RowOps(
    "cpu_kernels",
    _differentiable(_kernel_gather_rows, _xla_gather_rows),
    _differentiable(_kernel_scatter_rows, _xla_scatter_rows),
    _differentiable(_kernel_combine_entries, _xla_combine_entries, nondiff_argnums=(4,)),
    _differentiable(_kernel_segment_grads, _xla_segment_grads, nondiff_argnums=(4,)),
    _kernel_fused_update,
)
