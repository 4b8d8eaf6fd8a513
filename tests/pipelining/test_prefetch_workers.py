"""A Trainer preparing batches on several threads (`prefetch_workers`) trains, evaluates
and reports errors exactly as with one."""

from __future__ import annotations

import numpy as np
import optax
import pytest

from pipelining import Trainer, TrainerConfig
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
