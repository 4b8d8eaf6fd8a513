"""The row operations and the backends that use them.

Each implementation of the four row ops (XLA, and the C++ CPU kernels when
built) is checked against a numpy reference on random data with out-of-range
indices; the fused optimizer kernels (SGD, row-wise Adagrad, Adagrad, Adam,
FTRL, each in its variants and with every shared option) against the
generic gather -> `optimizer.apply` -> scatter; then a lookup + update step
of the "cpu" backend is checked against the "xla" backend on 1 and 8
devices, and a variant the kernels do not cover against the generic path.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest

from sc_framework import FeatureSpec, TableSpec
from sc_framework.optimizers import FTRL, SGD, Adagrad, Adam, LaProp, RowWiseAdagrad
from sc_framework.preprocessing import preprocess
from sc_framework.primitives import (
    XLA_BACKEND,
    EmbeddingBackend,
    EmbeddingPlan,
    apply_embedding_gradients,
    available_backends,
    embedding_lookup,
    get_backend,
    init_embedding_variables,
    register_backend,
    registered_backends,
)
from sc_framework.primitives import _backend
from sc_framework.primitives._row_ops import CPU_KERNEL_OPS, XLA_OPS, cpu_kernels_available
from tests.numerics import assert_close, assert_same_bits

OPS = [XLA_OPS] + ([CPU_KERNEL_OPS] if cpu_kernels_available() else [])
OPS_IDS = [ops.name for ops in OPS]


def _data(seed, rows=300, dim=7, count=120, samples=40, entries=400):
  rng = np.random.default_rng(seed)
  table = rng.normal(size=(rows, dim)).astype(np.float32)
  index = rng.choice(rows, count, replace=False).astype(np.int32)
  index[::9] = rows + 3  # out of range
  index[1] = -1
  entry_rows = rng.integers(-2, rows + 2, entries).astype(np.int32)
  entry_samples = np.sort(rng.integers(0, samples + 1, entries)).astype(np.int32)  # samples = padding
  gains = rng.uniform(-1, 2, entries).astype(np.float32)
  unique_index = rng.integers(0, count, entries).astype(np.int32)
  grads = rng.normal(size=(samples, dim)).astype(np.float32)
  return table, index, entry_rows, entry_samples, gains, unique_index, grads


# Sizes of `_data`: "threaded" is above the C++ kernels' threading threshold
# (2^14 elements touched), so their parallel grouping and row loops run.
_SIZES = {
    "small": {},
    "threaded": dict(rows=6000, dim=8, count=4000, samples=700, entries=20000),
}


@pytest.mark.parametrize("ops", OPS, ids=OPS_IDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("size", list(_SIZES))
def test_row_ops_match_numpy(ops, seed, size):
  table, index, entry_rows, entry_samples, gains, unique_index, grads = _data(seed, **_SIZES[size])
  rows, dim = table.shape
  valid = (index >= 0) & (index < rows)

  gathered = np.asarray(jax.jit(ops.gather_rows)(table, index))
  expected = np.where(valid[:, None], table[np.clip(index, 0, rows - 1)], 0)
  assert_same_bits(gathered, expected)

  values = np.random.default_rng(seed + 10).normal(size=(len(index), dim)).astype(np.float32)
  scattered = np.asarray(jax.jit(ops.scatter_rows)(table, index, values))
  expected = table.copy()
  expected[index[valid]] = values[valid]
  assert_same_bits(scattered, expected)

  num_samples = grads.shape[0]
  combined = np.asarray(jax.jit(ops.combine_entries, static_argnums=4)(
      table, entry_rows, entry_samples, gains, num_samples))
  expected = np.zeros((num_samples, dim), np.float64)
  for row, sample, gain in zip(entry_rows, entry_samples, gains):
    if 0 <= row < rows and sample < num_samples:
      expected[sample] += gain * table[row]
  # Each sample sums its entries (the longest sum: the most entries of a sample).
  assert_close(combined, expected, terms=int(np.bincount(entry_samples).max()))

  num_unique = len(index)
  summed = np.asarray(jax.jit(ops.segment_grads, static_argnums=4)(
      grads, entry_samples, unique_index, gains, num_unique))
  expected = np.zeros((num_unique, dim), np.float64)
  for sample, unique, gain in zip(entry_samples, unique_index, gains):
    if sample < num_samples:
      expected[unique] += gain * grads[sample]
  assert_close(summed, expected, terms=int(np.bincount(unique_index).max()))


def test_auto_backend_on_cpu():
  plan = EmbeddingPlan.create(
      [FeatureSpec("f", TableSpec("t", 10, 4), (8, 2))],
      mesh=jax.sharding.Mesh(np.array(jax.devices()[:1]), ("devices",)))
  expected = "cpu" if cpu_kernels_available() else "xla"
  assert get_backend("auto", plan).name == expected
  assert "xla" in available_backends()
  with pytest.raises(ValueError, match="unknown embedding backend 'tpu_magic'"):
    get_backend("tpu_magic", plan)


def test_available_backends_lists_only_what_can_run_here():
  """A registered backend that is not installed (the "cpu" one without its
  built kernels) is not available: "auto" skips it, naming it is refused."""
  plan = EmbeddingPlan.create(
      [FeatureSpec("f", TableSpec("t", 10, 4), (8, 2))],
      mesh=jax.sharding.Mesh(np.array(jax.devices()[:1]), ("devices",)))
  assert ("cpu" in available_backends()) == cpu_kernels_available()
  assert "cpu" in registered_backends()
  absent = dataclasses.replace(XLA_BACKEND, name="absent", priority=9, installed=lambda: False)
  refusing = dataclasses.replace(XLA_BACKEND, name="tpu_only", supports=lambda plan: False)
  with pytest.raises(TypeError, match="register_backend takes an EmbeddingBackend, got 'xla'"):
    register_backend("xla")
  register_backend(absent)
  register_backend(refusing)
  try:
    assert {"absent", "tpu_only"} <= set(registered_backends())
    assert "absent" not in available_backends() and "tpu_only" in available_backends()
    usable = available_backends(plan)
    assert "absent" not in usable and "tpu_only" not in usable and "xla" in usable
    for name in usable:
      assert get_backend(name, plan).name == name
    assert get_backend("auto", plan).name in usable
    with pytest.raises(ValueError, match="embedding backend 'absent' is not installed here"):
      get_backend("absent", plan)
  finally:
    _backend._REGISTRY.pop("absent")
    _backend._REGISTRY.pop("tpu_only")


@pytest.mark.parametrize("built", [False, True], ids=["not_built", "not_working"])
def test_the_cpu_backend_without_its_kernels_says_so(monkeypatch, built):
  """backend='cpu' on CPU devices without working kernels was refused as unable to run
  "on devices ['cpu']", which named neither the missing kernels nor how to get them."""
  plan = EmbeddingPlan.create(
      [FeatureSpec("f", TableSpec("t", 10, 4), (8, 2))],
      mesh=jax.sharding.Mesh(np.array(jax.devices()[:1]), ("devices",)))
  monkeypatch.setattr(_backend, "cpu_kernels_available", lambda: False)
  monkeypatch.setattr(_backend, "_kernels_built", lambda: built)
  reason = "do not work with this jax/jaxlib" if built else "are not built"
  with pytest.raises(ValueError, match=rf"backend 'cpu' is not installed here: it needs the C\+\+"
                                       rf" CPU kernels, which {reason}\. Reinstall .* or use"
                                       r" backend='xla'"):
    get_backend("cpu", plan)
  assert "cpu" not in available_backends() and "cpu" in registered_backends()


def test_a_backend_value_is_used_without_registration():
  """The primitives take an EmbeddingBackend value; it runs exactly as its functions."""
  specs = [FeatureSpec("f", TableSpec("t", 30, 4, optimizer=SGD(0.5)), (8, 3))]
  plan = EmbeddingPlan.create(specs, mesh=jax.sharding.Mesh(np.array(jax.devices()[:2]),
                                                            ("devices",)))
  calls = []

  def lookup(*args):
    calls.append("lookup")
    return XLA_BACKEND.lookup(*args)

  def apply_gradients(*args):
    calls.append("apply_gradients")
    return XLA_BACKEND.apply_gradients(*args)

  mine = EmbeddingBackend("mine", lookup, apply_gradients)
  assert "mine" not in available_backends() and get_backend(mine, plan) is mine
  rng = np.random.default_rng(5)
  batch, _ = preprocess({"f": rng.integers(0, 30, (8, 3))}, specs, plan.layout)
  grads = {"f": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32)}
  results = []
  for backend in (mine, "xla"):
    variables = init_embedding_variables(plan, jax.random.key(1))
    activations = embedding_lookup(plan, variables.tables, batch, backend=backend)
    updated = apply_embedding_gradients(plan, variables, batch, grads, 0, backend=backend)
    results.append(jax.device_get((activations, updated)))
  assert calls == ["lookup", "apply_gradients"]
  jax.tree.map(assert_same_bits, results[0], results[1])
  refusing = dataclasses.replace(mine, name="tpu_only", supports=lambda plan: False)
  with pytest.raises(ValueError, match="embedding backend 'tpu_only' cannot run this plan"):
    embedding_lookup(plan, variables.tables, batch, backend=refusing)


@pytest.mark.skipif(not cpu_kernels_available(), reason="the C++ CPU kernels were not built")
@pytest.mark.parametrize("devices,shards", [(1, 1), (8, 2)])
@pytest.mark.parametrize(
    "optimizer",
    [RowWiseAdagrad(0.2), SGD(0.3), Adagrad(0.2), Adam(0.05), FTRL(0.2, l1=0.01, l2=0.1),
     LaProp(0.05)],
    ids=["rowwise_fused", "sgd_fused", "adagrad_fused", "adam_fused", "ftrl_fused", "laprop_generic"])
def test_cpu_backend_equals_xla_backend(devices, shards, optimizer):
  table_a = TableSpec("a", 300, 12, optimizer=optimizer, combiner="mean",
                      max_ids_per_partition=512, max_unique_ids_per_partition=512)
  table_b = TableSpec("b", 90, 16, optimizer=optimizer, combiner="mean",
                      max_ids_per_partition=512, max_unique_ids_per_partition=512)
  specs = [FeatureSpec("x", table_a, (32, 5)), FeatureSpec("y", table_b, (16, 3)),
           FeatureSpec("z", table_a, (16, 1))]
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("devices",))
  plan = EmbeddingPlan.create(specs, mesh=mesh, shards_per_device=shards)
  rng = np.random.default_rng(devices * 10 + shards)
  results = {}
  for backend in ("xla", "cpu"):
    variables = init_embedding_variables(plan, jax.random.key(3))

    @jax.jit
    def step(v, batch, cotangent, step_number, backend=backend):
      activations = embedding_lookup(plan, v.tables, batch, backend=backend)
      grads = {k: cotangent[k] * jnp.tanh(a) for k, a in activations.items()}
      return activations, apply_embedding_gradients(plan, v, batch, grads, step_number,
                                                    backend=backend)

    trajectory = []
    batch_rng = np.random.default_rng(7)
    for step_number in range(3):
      raw = {f.name: batch_rng.integers(-1, f.table.vocabulary_size, f.input_shape) for f in specs}
      batch, _ = preprocess(raw, specs, plan.layout, padding_id=-1)
      cotangent = {f.name: jnp.asarray(batch_rng.normal(size=f.output_shape), jnp.float32)
                   for f in specs}
      activations, variables = step(variables, batch, cotangent, step_number)
      trajectory.append(jax.device_get(activations))
    trajectory.append(jax.device_get(variables))
    results[backend] = trajectory
  # Another backend sums each row's gradient (all ids of table "a" in a
  # batch) in another order, over three chained steps.
  terms = sum(f.batch_size * f.input_shape[1] for f in specs if f.table.name == "a")
  jax.tree.map(lambda a, b: assert_close(a, b, terms=terms, steps=3), results["xla"], results["cpu"])
  del rng


@pytest.mark.skipif(not cpu_kernels_available(), reason="the C++ CPU kernels were not built")
def test_kernel_probe_works_inside_a_trace():
  """The first backend choice often happens while a step is being traced."""
  seen = []

  @jax.jit
  def traced(x):
    seen.append(cpu_kernels_available.__wrapped__())
    return x + 1

  traced(jnp.ones(3))
  assert seen == [True]


@pytest.mark.skipif(not cpu_kernels_available(), reason="the C++ CPU kernels were not built")
def test_kernel_ops_have_the_xla_derivatives():
  """Differentiating through the lookup (e.g. a dense reference step) works on every backend."""
  table, index, entry_rows, entry_samples, gains, unique_index, grads = _data(5)
  entry_rows = np.clip(entry_rows, 0, table.shape[0] - 1)

  def loss(ops, t, g):
    combined = ops.combine_entries(t, entry_rows, entry_samples, gains, grads.shape[0])
    gathered = ops.gather_rows(t, index)
    summed = ops.segment_grads(g, entry_samples, unique_index, gains, len(index))
    return (combined ** 2).sum() + (gathered ** 3).sum() + (summed ** 2).sum()

  want = jax.grad(lambda t, g: loss(XLA_OPS, t, g), argnums=(0, 1))(table, grads)
  got = jax.grad(lambda t, g: loss(CPU_KERNEL_OPS, t, g), argnums=(0, 1))(table, grads)
  # Two chained sums (a sample's entries, then a row's or a unique row's entries).
  terms = int(max(np.bincount(entry_rows).max(), np.bincount(entry_samples).max(),
                  np.bincount(unique_index).max()))
  jax.tree.map(lambda a, b: assert_close(a, b, terms=terms, steps=2), got, want)


@pytest.mark.skipif(not cpu_kernels_available(), reason="the C++ CPU kernels were not built")
@pytest.mark.parametrize("devices, optimizer", [
    *((devices, optimizer) for devices in (1, 8)
      for optimizer in (SGD(0.3), RowWiseAdagrad(0.2), Adam(0.05))),
    (1, Adagrad(0.2)), (1, FTRL(0.2, l1=0.01, l2=0.1)),
], ids=lambda value: getattr(value, "kind", str(value)))
def test_the_fused_update_vmaps_and_differentiates_as_the_xla_backend(devices, optimizer):
  """jax.vmap of the update failed on the cpu backend (an FFI call without a vmap rule), and
  jax.grad through it (a look-ahead loss) raised "cannot be differentiated"."""
  table = TableSpec("a", 120, 8, optimizer=optimizer, max_ids_per_partition=256,
                    max_unique_ids_per_partition=256)
  specs = [FeatureSpec("x", table, (16, 3)), FeatureSpec("y", table, (16, 1))]
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("devices",))
  plan = EmbeddingPlan.create(specs, mesh=mesh)
  rng = np.random.default_rng(devices)
  raw = {f.name: rng.integers(0, 120, f.input_shape) for f in specs}
  batch, _ = preprocess(raw, specs, plan.layout)
  variables = init_embedding_variables(plan, jax.random.key(1))
  cotangents = [{f.name: jnp.asarray(rng.normal(size=f.output_shape), jnp.float32)
                 for f in specs} for _ in range(2)]

  def look_ahead(scale, backend):  # the loss after one update scaled by `scale`
    grads = {k: scale * g for k, g in cotangents[0].items()}
    updated = apply_embedding_gradients(plan, variables, batch, grads, 0, backend=backend)
    return sum(jnp.sum(a ** 2) for a in embedding_lookup(plan, updated.tables, batch,
                                                         backend=backend).values())

  def updated_tables(grads, backend):
    return apply_embedding_gradients(plan, variables, batch, grads, 0, backend=backend).tables

  stacked = jax.tree.map(lambda *g: jnp.stack(g), *cotangents)
  terms = 16 * 4
  for backend in ("xla", "cpu"):
    vmapped = jax.jit(jax.vmap(lambda g: updated_tables(g, backend)))(stacked)
    for index, grads in enumerate(cotangents):
      jax.tree.map(lambda a, b: assert_close(a[index], b, terms=terms), vmapped,
                   updated_tables(grads, "xla"))
  derivatives = {backend: jax.jit(jax.grad(lambda s: look_ahead(s, backend)))(1.0)
                 for backend in ("xla", "cpu")}
  assert_close(derivatives["cpu"], derivatives["xla"], terms=terms, steps=2)


def test_broken_cpu_kernels_fall_back_with_a_warning(monkeypatch):
  pytest.importorskip("sc_framework.primitives._cpu_kernels")
  from sc_framework.primitives import _row_ops

  kernels = _row_ops._kernels_module()  # the build for this CPU

  def broken():
    raise OSError("undefined symbol: XLA_FFI_Api (simulated)")

  monkeypatch.setattr(kernels, "handlers", broken)
  with pytest.warns(RuntimeWarning, match=r"do not work here \(OSError: undefined symbol") as got:
    assert _row_ops.cpu_kernels_available.__wrapped__() is False
  message = str(got[0].message)  # what to do about it, for this jaxlib
  assert f"this process runs jaxlib {jaxlib.__version__}" in message
  assert "pip install --no-build-isolation --no-deps --force-reinstall" in message


def test_without_a_cpu_backend_the_kernels_are_unavailable_without_a_warning(monkeypatch):
  """JAX_PLATFORMS=cuda leaves jax no CPU backend: the kernels cannot serve any
  plan there, which is no build problem to warn about."""
  pytest.importorskip("sc_framework.primitives._cpu_kernels")
  from sc_framework.primitives import _row_ops

  def no_cpu_backend(backend=None, **kwargs):
    raise RuntimeError(f"Unknown backend {backend}. Available backends are ['cuda']")

  monkeypatch.setattr(_row_ops.jax, "local_devices", no_cpu_backend)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert _row_ops.cpu_kernels_available.__wrapped__() is False


_OPTION_SETS = {
    "none": {},
    "clipvalue": dict(clipvalue=0.3),
    "clipvalue_one_sided": dict(clipvalue=(-0.2, None)),
    "row_clipnorm": dict(row_clipnorm=0.5),
    "decay": dict(weight_decay_factor=0.1),
    "decay_by_lr": dict(weight_decay_factor=0.5, multiply_weight_decay_factor_by_learning_rate=True),
    "clip_weights": dict(clip_weight_min=-0.5, clip_weight_max=0.4),
    "all": dict(clipvalue=(-0.4, 0.3), row_clipnorm=0.8, weight_decay_factor=0.2,
                multiply_weight_decay_factor_by_learning_rate=True, clip_weight_min=-0.9,
                clip_weight_max=0.7),
}


# Every optimizer with a fused kernel, in each of its variants.
_FUSED_OPTIMIZERS = {
    "sgd": SGD(0.3),
    "rowwise_adagrad": RowWiseAdagrad(0.2, initial_accumulator=0.0, eps=1e-3),
    "adagrad": Adagrad(0.2, initial_accumulator=0.0, eps=1e-3),
    "adagrad_eps0": Adagrad(0.1),
    "adam": Adam(0.05),
    "adam_sum_inside_sqrt_schedule": Adam(lambda step: 0.05 / (1.0 + step), beta1=0.5, beta2=0.9,
                                          sum_inside_sqrt=True),
    "ftrl": FTRL(0.2, l1=0.05, l2=0.1, beta=0.3),
    "ftrl_power_linear_by_lr": FTRL(0.1, learning_rate_power=-0.3, l1=0.02, l2=0.05,
                                    multiply_linear_by_learning_rate=True),
}


@pytest.mark.skipif(not cpu_kernels_available(), reason="the C++ CPU kernels were not built")
@pytest.mark.parametrize("optimizer", [SGD(0.3), RowWiseAdagrad(0.2, eps=1e-3)], ids=lambda o: o.kind)
def test_fused_entries_variant_sums_as_segment_grads(optimizer):
  """Above the threading threshold, with entries to skip: the entries variant
  sums each row's entries in segment_grads' order, so it equals the rows
  variant fed segment_grads' output bit for bit; both match the generic rule."""
  table, index, _, entry_samples, gains, unique_index, grads = _data(3, **_SIZES["threaded"])
  unique_index[::97] = len(index) + 5  # outside the unique rows: skipped
  row_dims = jnp.full(index.shape, table.shape[1], jnp.int32)
  slots = ({"accumulator": jnp.asarray(np.random.default_rng(4).uniform(0, 1, (len(table), 1)),
                                       jnp.float32)} if optimizer.slots() else {})
  fused = CPU_KERNEL_OPS.fused_update(optimizer, jnp.asarray(table), slots)
  step = jnp.int32(2)
  summed = jax.jit(CPU_KERNEL_OPS.segment_grads, static_argnums=4)(
      grads, entry_samples, unique_index, gains, len(index))
  by_entries = jax.jit(lambda t, s: fused(t, s, jnp.asarray(index), step, row_dims,
                                          entries=(grads, entry_samples, unique_index, gains)))(
      jnp.asarray(table), slots)
  by_rows = jax.jit(lambda t, s: fused(t, s, jnp.asarray(index), step, row_dims,
                                       row_grads=summed))(jnp.asarray(table), slots)
  assert_same_bits(by_entries[0], by_rows[0])
  for k in slots:
    assert_same_bits(by_entries[1][k], by_rows[1][k])

  valid = (index >= 0) & (index < len(table))
  rows = index[valid]
  reference = np.zeros((len(index), table.shape[1]), np.float64)
  for sample, unique, gain in zip(entry_samples, unique_index, gains):
    if sample < grads.shape[0] and unique < len(index):
      reference[unique] += gain * grads[sample]
  new_rows, new_slots = optimizer.apply(
      table[rows], reference[valid].astype(np.float32),
      {k: np.asarray(v)[rows] for k, v in slots.items()}, step, np.asarray(row_dims)[valid])
  want = table.copy()
  want[rows] = new_rows
  terms = table.shape[1] * int(np.bincount(unique_index).max())
  assert_close(by_entries[0], want, terms=terms)
  for k in slots:
    want_slot = np.asarray(slots[k]).copy()
    want_slot[rows] = new_slots[k]
    assert_close(by_entries[1][k], want_slot, terms=terms)


@pytest.mark.skipif(not cpu_kernels_available(), reason="the C++ CPU kernels were not built")
@pytest.mark.parametrize("options", list(_OPTION_SETS))
@pytest.mark.parametrize("name", list(_FUSED_OPTIMIZERS))
def test_fused_kernels_apply_the_options_as_the_generic_rule(name, options):
  """Both fused variants (row gradients, batch entries) against gather -> apply -> scatter."""
  base = _FUSED_OPTIMIZERS[name]
  optimizer = dataclasses.replace(base, **_OPTION_SETS[options])
  # Every case draws its own data (table, slots, indices, gradients, step).
  rng = np.random.default_rng(
      [list(_FUSED_OPTIMIZERS).index(name), list(_OPTION_SETS).index(options)])
  num_rows, dim, count = 50, 8, 20
  row_dims = rng.choice([8, 5, 3], count).astype(np.int32)
  index = rng.choice(num_rows, count, replace=False).astype(np.int32)
  index[[3, 11]] = [-1, num_rows + 2]  # unused capacity: skipped
  table = rng.normal(size=(num_rows, dim)).astype(np.float32)
  slots = {
      spec.name: jnp.asarray(
          spec.initial_value + rng.uniform(0.0, 0.5, (num_rows, spec.stacked_width(dim))),
          jnp.float32)
      for spec in optimizer.slots()
  }
  step = jnp.int32(rng.integers(0, 6))
  fused = CPU_KERNEL_OPS.fused_update(optimizer, jnp.asarray(table), slots)
  assert fused is not None

  def generic(row_grads, rule=optimizer):
    valid = (index >= 0) & (index < num_rows)
    rows = index[valid]
    new_rows, new_slots = rule.apply(
        table[rows], row_grads[valid], {k: np.asarray(v)[rows] for k, v in slots.items()}, step,
        row_dims[valid])
    out_table, out_slots = table.copy(), {k: np.asarray(v).copy() for k, v in slots.items()}
    out_table[rows] = new_rows
    for k in out_slots:
      out_slots[k][rows] = new_slots[k]
    return out_table, out_slots

  # Row gradients [K, D] (the multi-device path), zero beyond each row's logical dim.
  row_grads = rng.normal(scale=1.5, size=(count, dim)).astype(np.float32)
  row_grads[np.arange(dim)[None, :] >= row_dims[:, None]] = 0.0
  got = jax.jit(lambda t, s: fused(t, s, jnp.asarray(index), step, jnp.asarray(row_dims),
                                   row_grads=jnp.asarray(row_grads)))(jnp.asarray(table), slots)
  want = generic(row_grads)
  assert_close(got[0], want[0], terms=dim, err_msg=f"{options}: table (rows variant)")
  for k in slots:
    assert_close(got[1][k], want[1][k], terms=dim, err_msg=f"{options}: {k} (rows variant)")

  # Batch entries (the single-device path): one table of logical dim 5.
  row_dims[:] = 5
  samples_count, entries = 12, 60
  grads = rng.normal(scale=1.5, size=(samples_count, dim)).astype(np.float32)
  grads[:, 5:] = 0.0
  samples = np.sort(rng.integers(0, samples_count + 1, entries)).astype(np.int32)
  entry_unique_index = rng.integers(0, count, entries).astype(np.int32)
  gains = rng.uniform(-1, 2, entries).astype(np.float32)
  summed = np.asarray(XLA_OPS.segment_grads(grads, samples, entry_unique_index, gains, count))
  got = jax.jit(lambda t, s: fused(t, s, jnp.asarray(index), step, jnp.asarray(row_dims),
                                   entries=(grads, samples, entry_unique_index, gains)))(
      jnp.asarray(table), slots)
  want = generic(summed)
  terms = dim * entries  # the per-row sums over entries, then over the row
  assert_close(got[0], want[0], terms=terms, err_msg=f"{options}: table (entries variant)")
  for k in slots:
    assert_close(got[1][k], want[1][k], terms=terms, err_msg=f"{options}: {k} (entries variant)")
  # The options bind: the same step without them ends elsewhere.
  if options != "none":
    assert np.abs(generic(summed, base)[0] - want[0]).max() > 1e-3


def test_portable_backend_on_cpu_warns_once_how_to_build(monkeypatch):
  """Without the built kernels, "auto" on CPU says once what is slower and how to build."""
  from sc_framework.primitives import PortableCpuBackendWarning, _backend

  plan = EmbeddingPlan.create(
      [FeatureSpec("f", TableSpec("t", 10, 4), (8, 2))],
      mesh=jax.sharding.Mesh(np.array(jax.devices()[:1]), ("devices",)))
  monkeypatch.setattr(_backend, "_kernels_built", lambda: False)
  monkeypatch.setitem(_backend._REGISTRY, "cpu", dataclasses.replace(
      _backend._REGISTRY["cpu"], supports=lambda plan: False))
  _backend._warn_portable_on_cpu.cache_clear()
  with pytest.warns(PortableCpuBackendWarning, match=r"slower.*C\+\+17 compiler.*reinstall"):
    assert get_backend("auto", plan).name == "xla"
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert get_backend("auto", plan).name == "xla"  # once per process
  _backend._warn_portable_on_cpu.cache_clear()


@dataclasses.dataclass(frozen=True, repr=False)
class _HalfStepAdam(Adam):
  """Adam taking half its step: a rule the fused Adam kernel does not implement."""

  def update_rule(self, rows, grads, slots, step, row_dims):
    new_rows, new_slots = super().update_rule(rows, grads, slots, step, row_dims)
    return rows + 0.5 * (new_rows - rows), new_slots


@pytest.mark.skipif(not cpu_kernels_available(), reason="the C++ CPU kernels were not built")
def test_uncovered_variants_take_the_generic_path():
  """A subclass, another dtype or another slot width gets no fused kernel, and still trains."""
  table = jnp.ones((10, 4), jnp.float32)
  moments = {"mu": jnp.zeros((10, 4)), "nu": jnp.zeros((10, 4))}
  assert CPU_KERNEL_OPS.fused_update(Adam(0.1), table, moments) is not None
  assert CPU_KERNEL_OPS.fused_update(_HalfStepAdam(0.1), table, moments) is None
  assert CPU_KERNEL_OPS.fused_update(LaProp(0.1), table, moments) is None
  half = {k: v.astype(jnp.bfloat16) for k, v in moments.items()}
  assert CPU_KERNEL_OPS.fused_update(Adam(0.1), table, half) is None
  wide = {"accumulator": jnp.zeros((10, 4)), "linear": jnp.zeros((10, 1))}
  assert CPU_KERNEL_OPS.fused_update(FTRL(0.1), table, wide) is None

  specs = [FeatureSpec("f", TableSpec("t", 40, 6, optimizer=_HalfStepAdam(0.1)), (16, 3))]
  plan = EmbeddingPlan.create(specs, mesh=jax.sharding.Mesh(np.array(jax.devices()[:1]),
                                                            ("devices",)))
  rng = np.random.default_rng(11)
  batch, _ = preprocess({"f": rng.integers(0, 40, (16, 3))}, specs, plan.layout)
  grads = {"f": jnp.asarray(rng.normal(size=(16, 6)), jnp.float32)}
  variables = init_embedding_variables(plan, jax.random.key(2))
  got, want = (apply_embedding_gradients(plan, variables, batch, grads, 2, backend=backend)
               for backend in ("cpu", "xla"))
  # Each row's gradient sums at most all 48 ids of the batch, in another order.
  jax.tree.map(lambda a, b: assert_close(a, b, terms=48), jax.device_get(got),
               jax.device_get(want))
  plain_plan = EmbeddingPlan.create(
      [FeatureSpec("f", TableSpec("t", 40, 6, optimizer=Adam(0.1)), (16, 3))], mesh=plan.mesh)
  plain = apply_embedding_gradients(plain_plan, variables, batch, grads, 2, backend="cpu")
  stack = plan.layout.stacks[0].name
  assert np.abs(np.asarray(plain.tables[stack]) - np.asarray(got.tables[stack])).max() > 1e-3
