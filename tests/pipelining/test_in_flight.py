"""The layout-free in-flight ids: rows of the global batch, sliced for any device split."""

from __future__ import annotations

import numpy as np
import optax
import pytest

from pipelining import Trainer
from pipelining._in_flight import id_rows, local_inputs, rows_tree
from sc_framework import FeatureSpec, TableSpec
from sc_framework.optimizers import SGD
from sc_framework.preprocessing import DenseIds, RaggedRows, SparseIds, flatten_input
from test_trainer import LinearHead, mse

BATCH = 8


def make_specs():
  table = TableSpec("t", 50, 4, optimizer=SGD(0.1))
  return [FeatureSpec("dense", table, (BATCH, 4)), FeatureSpec("ragged", table, (BATCH, None)),
          FeatureSpec("coo", table, (BATCH, 3))]


def make_inputs(rng):
  """Per feature: the input fed to fit, and its samples as (ids, weights) rows (the oracle)."""
  dense = rng.integers(0, 50, (BATCH, 4))
  dense[rng.uniform(size=dense.shape) < 0.4] = -1
  dense_weights = rng.uniform(0.5, 2, dense.shape).astype(np.float32)
  lengths = rng.integers(0, 6, BATCH)
  ragged = [rng.integers(0, 50, n) for n in lengths]
  coo_dense = rng.integers(0, 50, (BATCH, 3))
  keep = rng.uniform(size=coo_dense.shape) < 0.6
  indices = np.argwhere(keep)
  order = rng.permutation(len(indices))  # COO in any order
  inputs = {
      "dense": DenseIds(dense, dense_weights),
      "ragged": RaggedRows(ragged),
      "coo": SparseIds(indices[order], coo_dense[keep][order], (BATCH, 3)),
  }
  oracle = {
      "dense": [(row[row >= 0], w[row >= 0]) for row, w in zip(dense, dense_weights)],
      "ragged": [(row, None) for row in ragged],
      "coo": [(coo_dense[b][keep[b]], None) for b in range(BATCH)],
  }
  return inputs, oracle


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("num_devices, devices", [(1, range(0, 1)), (2, range(1, 2)),
                                                  (4, range(0, 2)), (8, range(3, 7))])
def test_rows_rebuild_any_processs_samples(seed, num_devices, devices):
  specs = make_specs()
  inputs, oracle = make_inputs(np.random.default_rng(seed))
  rows = id_rows(inputs, specs, padding_id=-1, share=1, num_devices=1)
  tree = rows_tree(rows)
  assert "weights" in tree["dense"] and "weights" not in tree["ragged"]
  local = local_inputs(tree, specs, devices, num_devices)
  per_device = BATCH // num_devices
  samples = range(devices.start * per_device, devices.stop * per_device)
  for spec in specs:
    flat = flatten_input(local[spec.name], spec, padding_id=-1, batch_size=len(samples))
    want = [oracle[spec.name][b] for b in samples]
    np.testing.assert_array_equal(flat.lengths, [len(ids) for ids, _ in want])
    np.testing.assert_array_equal(flat.values, np.concatenate([ids for ids, _ in want]))
    if spec.name == "dense":
      np.testing.assert_array_equal(flat.weights, np.concatenate([w for _, w in want]))
    else:
      assert flat.weights is None


def test_rows_are_as_wide_as_the_longest_sample():
  specs = make_specs()
  inputs, oracle = make_inputs(np.random.default_rng(5))
  rows = id_rows(inputs, specs, padding_id=-1, share=1, num_devices=1)
  for name, r in rows.items():
    longest = max(1, max(len(ids) for ids, _ in oracle[name]))
    assert r.ids.shape == (BATCH, longest) and r.ids.dtype == np.int32
    # Each row: the sample's ids in order, then -1 (no id).
    for row, (ids, _) in zip(r.ids, oracle[name]):
      np.testing.assert_array_equal(row, np.concatenate([ids, np.full(longest - len(ids), -1)]))


def test_a_pipelined_trainer_with_a_workdir_refuses_ids_past_int32_when_built(tmp_path):
  """The refusal came at the first pipelined save, after save_every steps of training."""
  huge = TableSpec("huge", 2**31 + 8, 8, optimizer=SGD(0.1), max_ids_per_partition=64,
                   max_unique_ids_per_partition=64)
  specs = [FeatureSpec("ids", huge, (8, 2))]
  with pytest.raises(ValueError, match=r"feature 'ids': table 'huge' has vocabulary_size"
                                       r" 2147483656, more than int32 holds.*pipelining=False"):
    Trainer(LinearHead(), specs, mse, optax.sgd(0.1), workdir=tmp_path, progress="off")
  for pipelining, workdir in ((False, tmp_path), (True, None)):  # nothing in flight is saved
    Trainer(LinearHead(), specs, mse, optax.sgd(0.1), workdir=workdir, progress="off",
            pipelining=pipelining)
