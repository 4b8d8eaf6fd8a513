"""bfloat16 and float16 tables: sums in float32, one rounding to the table's dtype.

A table in a 16-bit float keeps its values in that dtype, but the lookup's
combining sums and the update's gradient sums must not run in it: bfloat16
holds 8 significant bits, so a sum of ones stalls at 256: a row read by 1024
samples once got a quarter of its gradient, and a sample of 1024 rows of ones
looked up 256. The references here are numpy in float64 from the same 16-bit
inputs; the result may differ from them by one rounding to the table's dtype
(half its eps, relative) plus float32 reordering.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh

from sc_framework import FeatureSpec, TableSpec
from sc_framework.optimizers import SGD
from sc_framework.preprocessing import DenseIds, preprocess
from sc_framework.primitives import (
    EmbeddingPlan,
    apply_embedding_gradients,
    available_backends,
    embedding_lookup,
    init_embedding_variables,
)
from sc_framework.primitives._row_ops import cpu_kernels_available
from sc_framework.stacking import unstack
from tests.numerics import reduction_tolerance

DIM = 8
VOCABULARY = 4096
LEARNING_RATE = 0.01
_DTYPES = {"bfloat16": (jnp.bfloat16, ml_dtypes.bfloat16), "float16": (jnp.float16, np.float16)}
_BACKENDS = ["xla"] + (["cpu"] if "cpu" in available_backends() and cpu_kernels_available() else [])


def _plan(feature: FeatureSpec, num_devices: int) -> EmbeddingPlan:
  if jax.device_count() < num_devices:
    pytest.skip(f"needs {num_devices} devices, have {jax.device_count()}")
  mesh = Mesh(np.array(jax.devices()[:num_devices]), ("devices",))
  return EmbeddingPlan.create([feature], mesh=mesh)


def _table(**options) -> TableSpec:
  return TableSpec("t", VOCABULARY, DIM, optimizer=SGD(LEARNING_RATE),
                   initializer=jax.nn.initializers.normal(1.0), **options)


def _assert_rounded_once(actual, exact, dtype, *, terms: int) -> None:
  """|actual - exact| <= eps(dtype) / 2 * |exact| + the float32 bound of `terms` terms."""
  actual, exact = np.asarray(actual, np.float64), np.asarray(exact, np.float64)
  rounding = float(jnp.finfo(dtype).eps) / 2 * np.abs(exact)
  bound = rounding + reduction_tolerance(terms) * np.abs(exact).max()
  error = np.abs(actual - exact)
  worst = np.unravel_index(int(np.argmax(error - bound)), error.shape)
  assert error[worst] <= bound[worst], (
      f"at {worst}: {actual[worst]!r} vs {exact[worst]!r}, |diff| {error[worst]:.3g} > one"
      f" rounding to {jnp.dtype(dtype).name} {bound[worst]:.3g}")


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("backend", _BACKENDS)
@pytest.mark.parametrize("num_devices", [1, 8])
@pytest.mark.parametrize("dtype_name", list(_DTYPES))
def test_a_row_read_by_thousands_of_samples_gets_its_whole_gradient(dtype_name, num_devices,
                                                                    backend, seed):
  dtype, np_dtype = _DTYPES[dtype_name]
  batch_size = 4096  # 512 samples per device on 8 devices: more than bfloat16 counts exactly
  feature = FeatureSpec("f", _table(max_ids_per_partition=batch_size), (batch_size, 1))
  plan = _plan(feature, num_devices)
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, 3, (batch_size, 1))  # three rows, each read by ~1365 samples
  batch, _ = preprocess({"f": DenseIds(ids)}, [feature], plan.layout)
  variables = init_embedding_variables(plan, jax.random.key(seed), dtype=dtype)
  grads = rng.uniform(0.5, 1.5, (batch_size, DIM)).astype(np_dtype)
  update = jax.jit(lambda v, b, g: apply_embedding_gradients(plan, v, b, g, 0, backend=backend))
  new = update(variables, batch, {"f": jnp.asarray(grads)})
  before = unstack({k: np.asarray(v, np.float32) for k, v in variables.tables.items()},
                   plan.layout)["t"].astype(np.float64)
  after = unstack({k: np.asarray(v, np.float32) for k, v in new.tables.items()}, plan.layout)["t"]
  assert new.tables[plan.layout.stack_names[0]].dtype == dtype
  expected = before.copy()
  np.add.at(expected, ids[:, 0], -LEARNING_RATE * grads.astype(np.float64))
  _assert_rounded_once(after, expected, dtype, terms=batch_size)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("backend", _BACKENDS)
@pytest.mark.parametrize("num_devices", [1, 8])
@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("dtype_name", list(_DTYPES))
def test_a_sample_of_a_thousand_ids_sums_every_row(dtype_name, combiner, num_devices, backend,
                                                   seed):
  dtype, _ = _DTYPES[dtype_name]
  batch_size, length = 8, 1024
  table = _table(combiner=combiner, max_ids_per_partition=batch_size * length,
                 max_unique_ids_per_partition=VOCABULARY)
  feature = FeatureSpec("f", table, (batch_size, length))
  plan = _plan(feature, num_devices)
  rng = np.random.default_rng(seed + 2)
  ids = np.stack([rng.choice(VOCABULARY, length, replace=False) for _ in range(batch_size)])
  weights = rng.uniform(0.5, 1.5, ids.shape).astype(np.float32)
  batch, _ = preprocess({"f": DenseIds(ids, weights)}, [feature], plan.layout)
  variables = init_embedding_variables(plan, jax.random.key(seed + 3), dtype=dtype)
  lookup = jax.jit(lambda t, b: embedding_lookup(plan, t, b, backend=backend))
  got = lookup(variables.tables, batch)["f"]
  assert got.dtype == dtype
  logical = unstack({k: np.asarray(v, np.float32) for k, v in variables.tables.items()},
                    plan.layout)["t"].astype(np.float64)
  w = weights.astype(np.float64)
  scale = {"sum": 1.0, "mean": 1 / w.sum(1), "sqrtn": 1 / np.sqrt((w * w).sum(1))}[combiner]
  expected = (w[..., None] * logical[ids]).sum(1) * np.reshape(scale, (-1, 1))
  _assert_rounded_once(got, expected, dtype, terms=length)
