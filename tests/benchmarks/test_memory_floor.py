"""The memory floor's loops do the work they stand for (checked against numpy).

bench_memory_floor.py sets our step against these loops as a lower bound; a
floor that skipped rows or entries would make that bound a lie.
"""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import bench_memory_floor
from benchmarks.bench_vs_torchrec import Ours, make_batch
from sc_framework.optimizers import SGD, RowWiseAdagrad
from tests.numerics import assert_close

TABLES, VOCAB, DIM, BATCH = 3, 40, 8, 16


@pytest.fixture(scope="module")
def library(tmp_path_factory):
  floor = bench_memory_floor.compile_floor(str(tmp_path_factory.mktemp("floor")))
  if floor is None:
    pytest.skip("no C++ compiler to build the floor loops")
  return floor


def _entries(floor):
  """(row, sample, gain) of every valid entry, from the floor's own grouping."""
  counts = np.diff(floor.begin)
  rows = np.repeat(floor.unique_rows, counts)
  return rows, floor.grouped_samples, floor.grouped_gains


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("optimizer", [SGD(0.1), RowWiseAdagrad(0.1)], ids=["sgd", "rwa"])
def test_the_floor_loops_read_every_entry_and_touched_row(library, seed, optimizer):
  rng = np.random.default_rng(seed)
  raw = make_batch(rng, TABLES, BATCH, VOCAB)
  ours = Ours(TABLES, VOCAB, DIM, BATCH, optimizer, [raw])
  floor = bench_memory_floor.Floor(library, ours, ours.buffers(raw))
  # Rows of the step's own scale (1e-6 * gradient), so that a skipped entry
  # shows far above float32's rounding of w.
  floor.table[:] = 1e-6 * rng.standard_normal(floor.table.shape, dtype=np.float32)
  floor.grad[:] = rng.standard_normal(floor.grad.shape, dtype=np.float32)

  # The grouping holds every id of the raw batch once per (sample, id) pair,
  # in the stacked table's rows (table k's rows start at k * VOCAB).
  rows, samples, gains = _entries(floor)
  expected_pairs = sorted(
      (k * VOCAB + int(i), k * BATCH + b)
      for k, (values, lengths) in enumerate(raw)
      for b, ids in enumerate(np.split(values, np.cumsum(lengths)[:-1]))
      for i in np.unique(ids))
  assert sorted(zip(rows.tolist(), samples.tolist())) == expected_pairs
  assert np.array_equal(floor.unique_rows, np.unique(rows))

  table = floor.table.copy()
  floor.lookup()
  dense = np.zeros_like(floor.out)
  np.add.at(dense, samples, table[rows])  # sum combiner, one read per (sample, id)
  terms = int(np.bincount(samples).max())
  assert_close(floor.out, dense, terms=terms)

  floor.update()
  gradient = np.zeros_like(table)
  np.add.at(gradient, rows, gains[:, None] * floor.grad[samples])
  expected = table - np.float32(1e-6) * gradient
  assert_close(floor.table, expected, terms=int(np.bincount(rows).max()) + 1)
  untouched = np.setdiff1d(np.arange(table.shape[0]), rows)
  assert np.array_equal(floor.table[untouched], table[untouched])
