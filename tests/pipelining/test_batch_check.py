"""Every batch is checked up front: its entries, one row per sample, the first batch's shapes."""

from __future__ import annotations

import re

import jax
import numpy as np
import optax
import pytest

from pipelining import Trainer
from pipelining._batch_check import BatchChecker, check_labels_fit_predictions
from sc_framework.optimizers import SGD
from test_trainer import BATCH, LinearHead, make_batches, make_specs, mesh_of, mse


def make_trainer(**options):
  return Trainer(LinearHead(), make_specs(SGD(0.1)), mse, optax.sgd(0.1), mesh=mesh_of(1),
                 progress="off", padding_id=-1, **options)


def batch(dense, labels):
  return {"sparse": {}, "dense": dense, "labels": labels}


def test_same_shapes_pass_and_float64_counts_as_float32():
  checker = BatchChecker([8], 1, 1)
  checker.check(batch({"x": np.zeros((8, 3), np.float32)}, np.zeros(8, np.float32)),
                "training", 0)
  checker.check(batch({"x": np.ones((8, 3), np.float64)}, np.ones(8, np.float32)), "training", 1)


@pytest.mark.parametrize("dense, labels, message", [
    (np.zeros((8, 3), np.float32), np.zeros(8, np.int32),
     "batch 1 of the training data: labels has shape (8,) and dtype int32 but the first batch"
     " this Trainer checked (batch 0 of the training data) had shape (8,) and dtype float32"),
    (np.zeros((8, 4), np.float32), np.zeros(8, np.float32),
     "batch 1 of the training data: dense has shape (8, 4) and dtype float32 but the first"
     " batch this Trainer checked (batch 0 of the training data) had shape (8, 3)"),
    ({"x": np.zeros((8, 3), np.float32)}, np.zeros(8, np.float32),
     "batch 1 of the training data: its 'dense' entry holds the leaves [\"['x']\"] but the"
     " first batch this Trainer checked (batch 0 of the training data) held one array"),
    (None, np.zeros(8, np.float32),  # read "has the leaves none but ... had ['']"
     "batch 1 of the training data: its 'dense' entry holds nothing (no such entry) but the"
     " first batch this Trainer checked (batch 0 of the training data) held one array"),
])
def test_a_different_batch_names_its_position_the_entry_and_both_shapes(dense, labels, message):
  checker = BatchChecker([8], 1, 1)
  checker.check(batch(np.zeros((8, 3), np.float32), np.zeros(8, np.float32)), "training", 0)
  with pytest.raises(ValueError, match=re.escape(message)):
    checker.check(batch(dense, labels), "training", 1)


@pytest.mark.parametrize("dense, labels, message", [
    (np.zeros((8, 3)), np.zeros(4),
     "batch 2 of the evaluation data: labels has shape (4,), leading dimension 4, but the batch"
     " has 8 samples (the FeatureSpecs' batch size); labels and dense features need one row per"
     " sample, leading dimension 8. Feed labels of shape (8,)"),
    ({"u": np.zeros((8, 3)), "v": np.zeros((16, 2))}, np.zeros(8),
     "dense['v'] has shape (16, 2), leading dimension 16, but the batch has 8 samples"),
    (np.zeros((8, 3)), {"y": np.zeros(8), "w": np.float32(1.0)},
     "labels['w'] has shape (), no leading dimension, but the batch has 8 samples (the"
     " FeatureSpecs' batch size); labels"),
    (np.zeros((8, 3)), (np.zeros(8), np.float32(1.0)),  # not a list of numbers: no hint
     "labels[1] has shape (), no leading dimension, but the batch has 8 samples (the"
     " FeatureSpecs' batch size); labels"),
    (np.zeros((8, 3)), [0.0] * 8,
     "labels[0] has shape (), no leading dimension, but the batch has 8 samples (the"
     " FeatureSpecs' batch size) (labels is a list or tuple, each of its items one array: pass"
     " np.asarray(labels) to give one array); labels"),
])
def test_a_leaf_without_one_row_per_sample_is_refused_naming_both(dense, labels, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    BatchChecker([8], 1, 1).check(batch(dense, labels), "evaluation", 2)


def test_a_process_feeds_its_share_of_the_rows():
  checker = BatchChecker([16], 2, 8)  # 2 of 8 devices: 4 rows of every global batch of 16
  checker.check(batch(np.zeros((4, 3)), np.zeros(4)), "training", 0)
  with pytest.raises(ValueError, match=re.escape(
      "labels has shape (16,), leading dimension 16, but the batch has 4 samples (this"
      " process's share, 2 of 8 devices, of the FeatureSpecs' global batch size 16)")):
    checker.check(batch(np.zeros((4, 3)), np.zeros(16)), "training", 1)


@pytest.mark.parametrize("use, raw, error, message", [
    ("training", {"sparse": {}, "dense": np.zeros((8, 3))}, ValueError,
     "batch 5 of the training data has no 'labels' entry (its keys are ['dense', 'sparse']);"
     " fit needs labels"),
    ("evaluation", {"sparse": {}, "labels": None}, ValueError,
     "batch 5 of the evaluation data has 'labels': None (its keys are ['labels', 'sparse']);"
     " evaluate needs labels"),
    ("prediction", {"dense": np.zeros((8, 3))}, ValueError,
     "batch 5 of the prediction data has no 'sparse' entry"),
    ("prediction", [np.zeros((8, 3))], TypeError,
     "batch 5 of the prediction data is a list, not a dict"),
])
def test_a_missing_entry_is_named(use, raw, error, message):
  with pytest.raises(error, match=re.escape(message)):
    BatchChecker([8], 1, 1).check(raw, use, 5)


def test_prediction_batches_need_no_labels_and_set_none():
  checker = BatchChecker([8], 1, 1)
  checker.check({"sparse": {}, "dense": np.zeros((8, 3))}, "prediction", 0)
  # The first batch with labels sets them, whatever preceded it.
  checker.check(batch(np.zeros((8, 3)), np.zeros((8, 2))), "training", 0)
  with pytest.raises(ValueError, match=re.escape(
      "batch 0 of the evaluation data: labels has shape (8,) and dtype float32 but the first"
      " batch this Trainer checked (batch 0 of the training data) had shape (8, 2)")):
    checker.check(batch(np.zeros((8, 3)), np.zeros(8)), "evaluation", 0)


@pytest.mark.parametrize("predictions, labels, refused", [
    ((8,), (8,), False),
    ((8,), (8, 1), True),       # -> (8, 8)
    ((8, 1), (8,), True),       # -> (8, 8)
    ((8, 5), (8, 1), False),    # broadcasts to the predictions' shape
    ((8, 5), (8,), False),      # not broadcastable: an elementwise loss fails loudly
    ((8, 5), (8, 5), False),
])
def test_labels_that_would_broadcast_are_refused(predictions, labels, refused):
  p = jax.ShapeDtypeStruct(predictions, np.float32)
  l = jax.ShapeDtypeStruct(labels, np.float32)
  if refused:
    with pytest.raises(ValueError, match=re.escape(
        f"the labels have shape {labels} but the model's predictions have shape {predictions}")):
      check_labels_fit_predictions(p, l)
  else:
    check_labels_fit_predictions(p, l)


def test_fit_refuses_labels_of_another_shape_than_the_predictions():
  batches = make_batches(2, seed=100)
  for b in batches:
    b["labels"] = b["labels"][:, None]
  with pytest.raises(ValueError, match=re.escape(
      f"labels have shape ({BATCH}, 1) but the model's predictions have shape ({BATCH},):"
      f" an elementwise loss of both, such as (predictions - labels) ** 2, silently broadcasts"
      f" them to ({BATCH}, {BATCH})")):
    make_trainer().fit(batches)


@pytest.mark.parametrize("empty", [[], iter([])], ids=["list", "iterator"])
def test_fit_on_data_without_a_batch_says_nothing_was_trained(caplog, empty):
  with caplog.at_level("WARNING", logger="pipelining"):
    history = make_trainer().fit(empty)
  assert history.final_step == 0 and not history.steps
  assert "fit's train_data gave no batch (it is empty, or an iterator already exhausted)" \
      in caplog.text


def test_entries_the_trainer_does_not_read_are_warned_about_once_each(caplog):
  """'weights' meant as per-sample weights was ignored without a word."""
  batches = make_batches(3, seed=104)
  for b in batches:
    b["weights"] = np.ones(BATCH, np.float32)
  batches[2]["label"] = batches[2]["labels"]  # misspelt, beside the right one
  with caplog.at_level("WARNING", logger="pipelining"):
    assert make_trainer().fit(batches).final_step == 3
  told = [r.getMessage() for r in caplog.records if "that the Trainer does not read" in r.message]
  assert len(told) == 2, told
  assert told[0].startswith("batch 0 of the training data has entries ['weights']")
  assert told[1].startswith("batch 2 of the training data has entries ['label']")


@pytest.mark.parametrize("call", ["fit", "evaluate"])
def test_a_loss_that_fails_on_the_shapes_is_told_both_shapes(call):
  """Labels [B, 2] against predictions [B] do not broadcast: JAX's error named neither."""
  batches = make_batches(2, seed=103)
  for b in batches:
    b["labels"] = np.stack([b["labels"]] * 2, axis=1)
  with pytest.raises((TypeError, ValueError)) as info:
    getattr(make_trainer(eval_metrics=()), call)(batches)
  assert (f"(raised in loss_fn(predictions, labels), the model's predictions of shape ({BATCH},)"
          f" and the batch's labels of shape ({BATCH}, 2))") in info.value.__notes__


@pytest.mark.parametrize("pipelining", [True, False])
def test_fit_refuses_labels_of_half_the_batch_naming_both_sizes(pipelining):
  batches = make_batches(2, seed=102)
  for b in batches:
    b["labels"] = b["labels"][:BATCH // 2]
  trainer = make_trainer(pipelining=pipelining)
  with pytest.raises(ValueError, match=re.escape(
      f"batch 0 of the training data: labels has shape ({BATCH // 2},), leading dimension"
      f" {BATCH // 2}, but the batch has {BATCH} samples")):
    trainer.fit(batches)
  assert trainer.state is None  # refused before the model was built


def test_fit_names_the_batch_without_labels():
  batches = make_batches(4, seed=103)
  del batches[2]["labels"]
  trainer = make_trainer()
  with pytest.raises(ValueError, match=re.escape(
      "batch 2 of the training data has no 'labels' entry (its keys are ['dense', 'sparse']);"
      " fit needs labels")):
    trainer.fit(batches)
  # Pipelined: the step that applies batch 1 looks up batch 2, so it stops
  # before; batch 0 was applied.
  assert int(trainer.state.step) == 1


def test_evaluate_names_the_batch_without_labels():
  batches = make_batches(2, seed=104)
  del batches[1]["labels"]
  with pytest.raises(ValueError, match=re.escape(
      "batch 1 of the evaluation data has no 'labels' entry")):
    make_trainer(eval_metrics=()).evaluate(batches)


def test_fit_names_a_dense_entry_of_another_batch_size():
  batches = make_batches(3, seed=101)
  batches[2]["dense"] = batches[2]["dense"][:-1]
  trainer = make_trainer()
  with pytest.raises(ValueError, match=re.escape(
      f"batch 2 of the training data: dense has shape ({BATCH - 1}, 3), leading dimension"
      f" {BATCH - 1}, but the batch has {BATCH} samples")):
    trainer.fit(batches)
  assert int(trainer.state.step) == 1


@pytest.mark.parametrize("entry, path, use", [
    ("dense", "['user']", "training"), ("labels", "", "training"), ("labels", "", "evaluation"),
    ("dense", "['user']", "prediction"),
])
def test_a_masked_array_is_refused_naming_the_leaf(entry, path, use):
  rng = np.random.default_rng(7)
  values = rng.normal(size=(8, 3) if entry == "dense" else 8)
  masked = np.ma.masked_array(values, mask=rng.random(values.shape) < 0.3)
  raw = batch({"user": rng.normal(size=(8, 3))}, rng.normal(size=8))
  raw[entry] = {"user": masked} if entry == "dense" else masked
  with pytest.raises(TypeError, match=re.escape(
      f"batch 4 of the {use} data: {entry}{path} is a numpy masked array (np.ma.MaskedArray)"
      f" with {int(masked.mask.sum())} masked values")):
    BatchChecker([8], 1, 1).check(raw, use, 4)


def test_fit_refuses_masked_labels_before_their_step():
  batches = make_batches(3, seed=105)
  labels = batches[1]["labels"]
  mask = np.zeros(np.shape(labels), bool)
  mask.flat[::2] = True
  batches[1]["labels"] = np.ma.masked_array(labels, mask=mask)
  trainer = make_trainer()
  with pytest.raises(TypeError, match=re.escape(
      "batch 1 of the training data: labels is a numpy masked array")):
    trainer.fit(batches)
  assert int(trainer.state.step) == 0  # pipelined: batch 0's step looks up batch 1


def test_one_batch_given_as_the_data_is_named():
  trainer = Trainer(LinearHead(), make_specs(SGD(0.1)), mse, optax.sgd(0.1), mesh=mesh_of(1),
                    padding_id=-1, progress="off")
  batch = make_batches(1, seed=0)[0]
  pattern = r"is one batch \(a dict with 'sparse'\), not an iterable of batches; pass .*\[batch\]"
  with pytest.raises(TypeError, match="fit's train_data " + pattern):
    trainer.fit(batch)
  with pytest.raises(TypeError, match="fit's eval_data " + pattern):
    trainer.fit([batch], eval_data=batch, eval_every=1)
  with pytest.raises(TypeError, match="the evaluation data " + pattern):
    trainer.evaluate(batch)
  with pytest.raises(TypeError, match="the prediction data " + pattern):
    trainer.predict(batch)


@pytest.mark.parametrize("dense", [np.full((BATCH, 3), "x", object), np.full((BATCH, 3), "1.5")])
def test_dense_features_of_strings_or_objects_are_named(dense):
  raw = batch(dense, np.zeros(BATCH, np.float32))
  with pytest.raises(TypeError, match=rf"batch 2 of the training data: dense has dtype"
                                      rf" {re.escape(str(dense.dtype))}, which no device array"):
    BatchChecker([BATCH], 1, 1).check(raw, "training", 2)


def _byte_swapped(batch):
  """The batch with its dense features and labels as big-endian data read from a file."""
  swapped = lambda x: x.astype(x.dtype.newbyteorder(">" if np.little_endian else "<"))
  return {**batch, "dense": swapped(batch["dense"]), "labels": swapped(batch["labels"])}


@pytest.mark.parametrize("pipelining", [True, False])
def test_byte_swapped_dense_features_and_labels_train_and_predict_as_native_ones(pipelining):
  batches = make_batches(4, seed=11)
  native, swapped = make_trainer(pipelining=pipelining), make_trainer(pipelining=pipelining)
  native.initialize(batches[0])
  swapped.initialize(batches[0])
  # Native first batches, then swapped ones: the batch check sees the same dtype.
  mixed = batches[:2] + [_byte_swapped(b) for b in batches[2:]]
  assert swapped.fit(mixed).final_step == native.fit(batches).final_step == 4
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(swapped.state.params),
               jax.device_get(native.state.params))
  np.testing.assert_array_equal(swapped.predict([_byte_swapped(batches[0])]),
                                native.predict([batches[0]]))
