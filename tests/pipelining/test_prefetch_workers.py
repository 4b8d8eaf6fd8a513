"""A Trainer preparing batches on several threads (`prefetch_workers`) trains, evaluates
and reports errors exactly as with one."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pipelining import Trainer, TrainerConfig
from pipelining._prefetch import detached
from sc_framework.preprocessing import DenseIds, RaggedIds
from sc_framework.optimizers import Adagrad
from test_resume import assert_same_run
from test_trainer import LinearHead, make_batches, make_specs, mesh_of, mse


def make_trainer(pipelining, workers, **options):
  return Trainer(LinearHead(), make_specs(Adagrad(0.3)), mse, optax.adam(0.05),
                 mesh=mesh_of(2), pipelining=pipelining, progress="off", padding_id=-1,
                 eval_metrics=(), prefetch_depth=3, prefetch_workers=workers, **options)


@pytest.mark.parametrize("pipelining", [True, False])
def test_fits_in_chunks_with_workers_equal_one_fit_with_one(pipelining):
  """A one-shot iterator over fits in chunks: no batch lost or reordered."""
  batches = make_batches(13, seed=120 + pipelining)
  data = iter(batches)
  chunked = make_trainer(pipelining, workers=4)
  finals = [chunked.fit(data, num_steps=total).final_step for total in (2, 5, 9)]
  history = chunked.fit(data)
  assert finals == [2, 5, 9] and history.final_step == 13
  reference = make_trainer(pipelining, workers=1)
  reference.fit(batches)
  assert_same_run(chunked, reference)
  held_out = make_batches(5, seed=130)
  assert chunked.evaluate(held_out) == reference.evaluate(held_out)
  for got, want in zip(chunked.predict(held_out), reference.predict(held_out)):
    np.testing.assert_array_equal(got, want)


def refilled(batches):
  """A loader with preallocated buffers: every batch is yielded in the same arrays, the
  ids inside `DenseIds` and a list of per-sample arrays as well."""
  buffers = {"sparse": {"fa": DenseIds(batches[0]["sparse"]["fa"].copy()),
                        "fb": [row.copy() for row in batches[0]["sparse"]["fb"]],
                        "fa2": batches[0]["sparse"]["fa2"].copy()},
             "dense": batches[0]["dense"].copy(), "labels": batches[0]["labels"].copy()}
  for batch in batches:
    buffers["sparse"]["fa"].ids[...] = batch["sparse"]["fa"]
    for row, values in zip(buffers["sparse"]["fb"], batch["sparse"]["fb"]):
      row[...] = values
    buffers["sparse"]["fa2"][...] = batch["sparse"]["fa2"]
    buffers["dense"][...] = batch["dense"]
    buffers["labels"][...] = batch["labels"]
    yield buffers


@pytest.mark.parametrize("pipelining, workers", [(False, 1), (True, 1), (True, 3)])
def test_a_loader_that_refills_its_arrays_trains_on_every_batch_as_yielded(pipelining, workers):
  """The dense features and labels were placed without a copy (on CPU the device array
  shares the host array's memory), and a worker prepared a batch while the next was
  pulled: the steps trained on the values of later batches, silently."""
  batches = make_batches(9, seed=150)
  refilling = make_trainer(pipelining, workers)
  refilling.fit(refilled(batches))
  reference = make_trainer(pipelining, workers=1)
  reference.fit(batches)
  assert_same_run(refilling, reference)


@pytest.mark.parametrize("workers", [1, 3])
def test_a_refilling_loaders_batch_in_flight_is_checkpointed_as_yielded(tmp_path, workers):
  """A pipelined checkpoint stores its batch in flight as raw ids, read when it is written:
  the loader had refilled them with a later batch's, and the resumed run diverged."""
  batches = make_batches(9, seed=150)
  first = make_trainer(True, workers, workdir=tmp_path)
  assert first.fit(refilled(batches), num_steps=4).final_step == 4
  resumed = make_trainer(True, workers, workdir=tmp_path)
  resumed.fit(batches)
  reference = make_trainer(True, workers=1)
  reference.fit(batches)
  assert_same_run(resumed, reference)


def test_detached_copies_every_array_and_keeps_the_structure():
  ids = np.arange(6).reshape(2, 3)
  ragged = np.empty(2, object)
  ragged[:] = [np.array([1, 2]), np.array([3])]
  raw = {"sparse": {"a": DenseIds(ids, ids * 0.5), "b": [ids[0], ids[1]], "c": ragged,
                    "d": RaggedIds.from_lengths(np.array([4, 5, 6]), np.array([2, 1]))},
         "dense": (ids, jnp.ones(3)), "labels": None}
  copy = detached(raw)
  assert jax.tree.structure(copy) == jax.tree.structure(raw)
  assert type(copy["sparse"]["a"]) is DenseIds and type(copy["dense"]) is tuple
  assert copy["dense"][1] is raw["dense"][1]  # a jax array never changes
  for array in (ids, ragged[0], raw["sparse"]["d"].values):
    array[...] = -7
  np.testing.assert_array_equal(copy["sparse"]["a"].ids, np.arange(6).reshape(2, 3))
  np.testing.assert_array_equal(copy["sparse"]["a"].weights, np.arange(6).reshape(2, 3) * 0.5)
  np.testing.assert_array_equal(copy["sparse"]["b"][1], [3, 4, 5])
  np.testing.assert_array_equal(copy["sparse"]["c"][0], [1, 2])
  np.testing.assert_array_equal(copy["sparse"]["d"].values, [4, 5, 6])
  np.testing.assert_array_equal(copy["sparse"]["d"].row_splits, [0, 2, 3])
  np.testing.assert_array_equal(copy["dense"][0], np.arange(6).reshape(2, 3))
  proxy = types.MappingProxyType({"x": np.arange(3)})  # a mapping jax.tree takes for a leaf
  copied = detached({"sparse": proxy})["sparse"]
  proxy["x"][...] = -1
  np.testing.assert_array_equal(copied["x"], [0, 1, 2])


def test_a_bad_batch_is_named_in_its_place_with_workers():
  batches = make_batches(8, seed=140)
  batches[5]["sparse"]["fb"] = batches[5]["sparse"]["fb"].copy()
  batches[5]["sparse"]["fb"][3, 0] = 24  # table b has 24 rows
  trainer = make_trainer(False, workers=3)
  with pytest.raises(ValueError, match=r"^batch 5 of the training data: .*fb.*24"):
    trainer.fit(batches)
  assert int(trainer.state.step) == 5  # batches 0-4 applied, in order


def test_prefetch_workers_must_be_a_count():
  with pytest.raises(ValueError,
                     match=r"TrainerConfig.prefetch_workers must be an int >= 1, got 0"):
    TrainerConfig(prefetch_workers=0)
