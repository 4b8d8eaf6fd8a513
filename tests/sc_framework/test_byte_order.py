"""Byte-swapped user arrays (data read from files written elsewhere) give what native ones do."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from sc_framework import FeatureSpec, TableSpec
from sc_framework._byte_order import native_byte_order, native_dtype
from sc_framework.optimizers import RowWiseAdagrad
from sc_framework.preprocessing import preprocess
from sc_framework.primitives import (
    EmbeddingPlan,
    apply_embedding_gradients,
    apply_stacked_gradients,
    init_embedding_variables,
    stack_activations,
)

SWAPPED = ">" if np.little_endian else "<"


def swap(array):
  return array.astype(array.dtype.newbyteorder(SWAPPED))


def test_native_byte_order_keeps_the_values_and_passes_native_arrays_through():
  values = np.random.default_rng(0).normal(size=(5, 3)).astype(np.float32)
  converted = native_byte_order(swap(values))
  assert converted.dtype == np.float32 and converted.dtype.isnative
  np.testing.assert_array_equal(converted, values)
  assert native_byte_order(values) is values
  assert native_byte_order([1.0]) == [1.0]
  assert native_dtype(np.dtype(SWAPPED + "i8")) == np.int64


def _setup(seed):
  rng = np.random.default_rng(seed)
  table = TableSpec("t", 50, 6, optimizer=RowWiseAdagrad(0.1), max_ids_per_partition=64,
                    max_unique_ids_per_partition=64)
  specs = [FeatureSpec("f", table, (8, 3)), FeatureSpec("g", table, (8, 2))]
  plan = EmbeddingPlan.create(specs)
  variables = init_embedding_variables(plan, jax.random.key(seed))
  raw = {"f": rng.integers(0, 50, (8, 3)), "g": rng.integers(0, 50, (8, 2))}
  batch, _ = preprocess(raw, specs, plan.layout)
  grads = {name: rng.normal(size=(8, 6)).astype(np.float32) for name in raw}
  return plan, variables, batch, grads


@pytest.mark.parametrize("seed", [0, 1])
def test_byte_swapped_activation_gradients_update_as_native_ones(seed):
  plan, variables, batch, grads = _setup(seed)
  native = apply_embedding_gradients(plan, variables, batch, grads, 0)
  swapped = apply_embedding_gradients(plan, variables, batch,
                                      {name: swap(g) for name, g in grads.items()}, 0)
  jax.tree.map(np.testing.assert_array_equal, swapped, native)


def test_byte_swapped_stacked_gradients_update_as_native_ones():
  plan, variables, batch, grads = _setup(2)
  stacked = jax.tree.map(np.asarray, stack_activations(plan, grads))
  native = apply_stacked_gradients(plan, variables, batch, stacked, 0)
  swapped = apply_stacked_gradients(plan, variables, batch,
                                    {name: swap(g) for name, g in stacked.items()}, 0)
  jax.tree.map(np.testing.assert_array_equal, swapped, native)
  joined = stack_activations(plan, {name: swap(g) for name, g in grads.items()})
  jax.tree.map(np.testing.assert_array_equal, joined, stack_activations(plan, grads))
