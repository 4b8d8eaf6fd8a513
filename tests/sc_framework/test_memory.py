"""Tables larger than the host's memory are refused by name, not killed by the kernel."""

from __future__ import annotations

import io
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


def test_the_host_memory_counts_physical_memory_and_swap_within_a_cgroup_limit(monkeypatch):
  pages, page = 1000, 4096
  monkeypatch.setattr(_memory.os, "sysconf",
                      lambda name: {"SC_PHYS_PAGES": pages, "SC_PAGE_SIZE": page}[name])
  real_open = open

  def fake_files(files):
    def opened(path, *args, **kwargs):
      if path in files:
        return io.StringIO(files[path])
      if path.startswith(("/proc/", "/sys/")):
        raise FileNotFoundError(path)
      return real_open(path, *args, **kwargs)
    return opened

  meminfo = {"/proc/meminfo": "MemTotal: 4000 kB\nSwapTotal: 100 kB\n"}
  monkeypatch.setattr("builtins.open", fake_files(meminfo))
  assert _memory.host_memory_bytes() == pages * page + 100 * 1024
  cgroup = {**meminfo, "/sys/fs/cgroup/memory.max": "2000\n",
            "/sys/fs/cgroup/memory.swap.max": "max\n"}
  monkeypatch.setattr("builtins.open", fake_files(cgroup))
  assert _memory.host_memory_bytes() == 2000 + 100 * 1024  # "max": the host's swap
  monkeypatch.setattr("builtins.open", fake_files({**cgroup,
                                                   "/sys/fs/cgroup/memory.swap.max": "10\n"}))
  assert _memory.host_memory_bytes() == 2010


def test_abstract_evaluation_allocates_nothing_and_checks_nothing(monkeypatch):
  """Under jax.eval_shape (a Flax model's abstract init) no table is made."""
  monkeypatch.setattr(_memory, "host_memory_bytes", lambda: 1)
  shapes = jax.eval_shape(lambda key: init_embedding_variables(_plan(24), key),
                          jax.random.key(0))
  assert shapes.tables["huge"].shape == (4096, 24)
  with pytest.raises(MemoryError):
    init_embedding_variables(_plan(24), jax.random.key(0))
