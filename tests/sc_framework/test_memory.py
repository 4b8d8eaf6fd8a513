"""Tables larger than the host's memory are refused by name, not killed by the kernel."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from sc_framework import FeatureSpec, TableSpec
from sc_framework.optimizers import Adam, RowWiseAdagrad
from sc_framework.primitives import EmbeddingPlan, _memory, init_embedding_variables
from sc_framework.stacking import auto_stack_tables


def _plan(dim, devices=1, optimizer=None):
  table = TableSpec("huge", 4096, dim, optimizer=optimizer or RowWiseAdagrad(0.1))
  small = TableSpec("small", 64, 8, optimizer=Adam(0.01))
  specs = [FeatureSpec("f", table, (8, 1)), FeatureSpec("g", small, (8, 1))]
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("data",))
  return EmbeddingPlan.create(specs, mesh=mesh, axis_name="data")


def test_a_dimension_no_host_holds_is_refused_before_anything_is_allocated():
  plan = _plan(2**31)  # 4,096 rows x 2^31 columns: 32 TiB
  with pytest.raises(MemoryError, match=re.escape(
      "The largest is stack 'huge' (tables ['huge'], 4,096 rows x 2,147,483,648 columns with"
      " its slots: 32,768.0 GiB in all)")):
    init_embedding_variables(plan, jax.random.key(0))


@pytest.mark.parametrize("devices", [1, 8])
def test_the_bytes_counted_are_this_hosts_share_of_tables_and_slots(monkeypatch, devices):
  plan = _plan(24, devices)
  layout = auto_stack_tables(plan.feature_specs, devices)
  assert layout == plan.layout
  # huge: 4096 rows padded to 8N, 24 columns + 1 accumulator column; small: 64 x (8 + 8 + 8).
  rows = -(-4096 // (8 * devices)) * 8 * devices
  small_rows = -(-64 // (8 * devices)) * 8 * devices
  needed = (rows * 25 + small_rows * 24) * 4
  monkeypatch.setattr(_memory, "host_memory_bytes", lambda: needed)
  init_embedding_variables(plan, jax.random.key(0))  # exactly fits
  monkeypatch.setattr(_memory, "host_memory_bytes", lambda: needed - 1)
  with pytest.raises(MemoryError, match=r"on this process's \d CPU device\(s\)"):
    init_embedding_variables(plan, jax.random.key(0))


def test_an_unknown_memory_size_checks_nothing(monkeypatch):
  monkeypatch.setattr(_memory, "host_memory_bytes", lambda: None)
  init_embedding_variables(_plan(8), jax.random.key(0))


def test_the_host_memory_is_a_positive_size_on_this_machine():
  size = _memory.host_memory_bytes()
  assert size is None or size > 0
