"""evaluate and predict: what each needs from a batch, and the ROC AUC of evaluate.

References are written here without the code under test: predictions from
the logical tables (plain gathers and sums) and the same Linen model; AUC as
the fraction of (positive, negative) pairs ranked right, ties counted half,
by a plain double loop.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import linen as nn

from pipelining import Trainer, roc_auc
from sc_framework.optimizers import SGD
from test_trainer import (
    BATCH,
    LinearHead,
    logical_tables,
    make_batches,
    make_specs,
    mesh_of,
    mse,
    reference_lookup,
)
from tests.numerics import assert_close, assert_same_bits


def pairwise_auc(labels, scores) -> float:
  pairs, right = 0, 0.0
  for label_i, score_i in zip(labels, scores):
    for label_j, score_j in zip(labels, scores):
      if label_i == 1 and label_j == 0:
        pairs += 1
        right += 1.0 if score_i > score_j else 0.5 if score_i == score_j else 0.0
  return right / pairs


def bce(logits, labels):
  return optax.sigmoid_binary_cross_entropy(logits, labels).mean()


def binary(batches):
  return [{**b, "labels": (b["labels"] > 0).astype(np.float32)} for b in batches]


def without_labels(batches):
  return [{k: v for k, v in b.items() if k != "labels"} for b in batches]


def make_trainer(model=None, loss=mse, **options):
  return Trainer(model or LinearHead(), make_specs(SGD(0.3)), loss, optax.sgd(0.05),
                 mesh=mesh_of(1), progress="off", padding_id=-1, **options)


def reference_predictions(trainer, batches):
  tables = logical_tables(trainer)
  params = jax.device_get(trainer.state.params)
  def predictions(batch):
    activations = reference_lookup(tables, batch["sparse"])
    activations = {k: jnp.asarray(v, jnp.float32) for k, v in activations.items()}
    return np.asarray(LinearHead().apply({"params": params}, activations, batch["dense"]))

  return np.concatenate([predictions(b) for b in batches])


def test_predict_needs_no_labels_and_never_calls_the_loss():
  calls = []

  def loss(predictions, labels):
    calls.append(labels)
    return mse(predictions, labels)

  batches = make_batches(3, seed=60)
  trainer = make_trainer(loss=loss)
  fresh = trainer.predict(without_labels(batches))  # a fresh trainer: built from these
  assert calls == []
  assert_close(fresh, reference_predictions(trainer, batches), terms=4)
  trainer.fit(batches)  # fit's first batch sets the labels
  assert calls
  calls.clear()
  after = trainer.predict(without_labels(batches))
  assert calls == []
  assert_close(after, reference_predictions(trainer, batches), terms=4)
  assert_same_bits(trainer.predict(batches), after)  # labels, when given, are ignored
  # Labels of any form are not read by predict.
  assert_same_bits(trainer.predict([{**b, "labels": "unused"} for b in batches]), after)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("shape", [(40,), (20, 2)])
def test_roc_auc_equals_the_pairwise_count(seed, shape):
  rng = np.random.default_rng(seed)
  labels = rng.integers(0, 2, shape).astype(np.float32)
  scores = rng.integers(0, 6, shape).astype(np.float32)  # many ties
  assert_close(roc_auc(labels, scores),
               pairwise_auc(labels.reshape(-1).tolist(), scores.reshape(-1).tolist()),
               terms=labels.size)
  assert roc_auc(labels.astype(bool), scores) == roc_auc(labels, scores)
  assert np.isnan(roc_auc(np.ones(shape), scores))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tied_infinite_scores_count_half_as_other_ties(seed):
  """Scores of overflowing logits: tied infinities took other ranks (inf - inf is NaN),
  so roc_auc([1, 0], [inf, inf]) was 0.0 and depended on the samples' order."""
  assert roc_auc([1, 0], [np.inf, np.inf]) == roc_auc([0, 1], [np.inf, np.inf]) == 0.5
  assert roc_auc([1, 0, 1], [-np.inf, -np.inf, 0.0]) == 0.75
  rng = np.random.default_rng(seed)
  labels = rng.integers(0, 2, 60).astype(np.float32)
  scores = np.array([-np.inf, -1.0, 0.0, 2.0, np.inf])[rng.integers(0, 5, 60)]
  assert_close(roc_auc(labels, scores), pairwise_auc(labels.tolist(), scores.tolist()),
               terms=labels.size)


def test_roc_auc_ranks_low_precision_and_integer_scores():
  """bfloat16 predictions of a mixed-precision model are ranked as the float32 ones."""
  labels = np.array([0, 1, 0, 1, 1])
  scores = np.array([0.1, 0.7, 0.3, 0.2, 0.9], np.float32)
  for kind in (ml_dtypes.bfloat16, np.float16, np.int32, bool):
    cast = (scores > 0.25) if kind is bool else (scores * 10).astype(kind)
    assert roc_auc(labels, cast) == pairwise_auc(labels.tolist(), cast.astype(float).tolist())


def test_roc_auc_of_a_nan_score_is_undefined():
  """A NaN score has no rank: the AUC is NaN, not that of the NaN ranked highest."""
  labels = np.array([0.0, 1.0, 0.0, 1.0])
  assert np.isnan(roc_auc(labels, np.array([0.1, np.nan, 0.3, 0.2])))
  assert_close(roc_auc(labels, np.array([0.1, np.inf, 0.3, 0.2])), 0.75, terms=4)


def test_evaluate_with_a_nan_dense_feature_reports_auc_as_undefined():
  trainer = make_trainer(loss=bce)
  trainer.fit(binary(make_batches(2, seed=63)))
  held_out = binary(make_batches(2, seed=64))
  held_out[1]["dense"][0, 0] = np.nan
  metrics = trainer.evaluate(held_out)
  assert np.isnan(metrics["loss"]) and np.isnan(metrics["auc"])


@pytest.mark.parametrize("labels, scores, message", [
    (np.array([0.0, 1.0, 0.4]), np.zeros(3), "labels[2] of batch 0 is 0.4, not 0 or 1"),
    (np.array([0, 1, 3]), np.zeros((3, 4)),
     "the labels have shape (3,) and the predictions (3, 4) (per batch), not one score per label"),
    # The imaginary part was dropped, with only numpy's ComplexWarning.
    (np.array([0, 1]), np.array([1 + 1j, 2j]), "the predictions have dtype complex128"),
])
def test_roc_auc_refuses_what_is_not_binary(labels, scores, message):
  with pytest.raises(ValueError, match=re.escape(
      f"roc_auc needs binary labels with one score each: {message}")):
    roc_auc(labels, scores)


def test_evaluate_of_a_binary_classifier_equals_the_references():
  train, held_out = binary(make_batches(3, seed=61)), binary(make_batches(3, seed=62))
  trainer = make_trainer(loss=bce)
  trainer.fit(train)
  metrics = trainer.evaluate(held_out)
  assert set(metrics) == {"loss", "auc"}
  logits = reference_predictions(trainer, held_out).astype(np.float64)
  labels = np.concatenate([b["labels"] for b in held_out]).astype(np.float64)
  assert_close(metrics["auc"], pairwise_auc(labels.tolist(), logits.tolist()), terms=4)
  reference_loss = np.mean(np.maximum(logits, 0) - logits * labels
                           + np.log1p(np.exp(-np.abs(logits))))
  assert_close(metrics["loss"], reference_loss, terms=BATCH * 4)


class FourClasses(nn.Module):
  @nn.compact
  def __call__(self, activations, dense):
    return nn.Dense(4)(jnp.concatenate([activations["fa"], dense], axis=1))


def multi_class():
  batches = make_batches(2, seed=63)
  for i, b in enumerate(batches):
    b["labels"] = ((np.arange(BATCH) + i) % 4).astype(np.int32)
  return FourClasses(), lambda p, y: optax.softmax_cross_entropy_with_integer_labels(p, y).mean(), \
      batches, f"the labels have shape ({BATCH},) and the predictions ({BATCH}, 4) (per batch)"


def pytree_labels():
  batches = make_batches(2, seed=64)
  for b in batches:
    b["labels"] = {"y": (b["labels"] > 0).astype(np.float32), "w": np.ones(BATCH, np.float32)}
  loss = lambda p, y: jnp.mean(y["w"] * (p - y["y"]) ** 2)  # noqa: E731
  return LinearHead(), loss, batches, (f"the labels are a pytree of shapes {{'w': ({BATCH},),"
                                       f" 'y': ({BATCH},)}}, not one array")


def regression():
  batches = make_batches(2, seed=65)
  batches[1]["labels"][:] = np.linspace(0.0, 1.0, BATCH, dtype=np.float32)
  batches[0]["labels"][:] = 1.0
  value = np.float32(1.0 / (BATCH - 1))
  return LinearHead(), mse, batches, f"labels[1] of batch 1 is {value!s}, not 0 or 1"


@pytest.mark.parametrize("case", [multi_class, pytree_labels, regression])
def test_evaluate_names_why_auc_does_not_apply_and_the_fix(case):
  model, loss, batches, problem = case()
  trainer = make_trainer(model, loss)
  trainer.fit(batches)
  with pytest.raises(ValueError, match=re.escape(
      "eval_metrics=('auc',) (the default) computes ROC AUC, which needs binary labels (every"
      f" label 0 or 1) and one score per label; here {problem}")) as error:
    trainer.evaluate(batches)
  assert "pass eval_metrics=() to the Trainer" in str(error.value)
  metrics = make_trainer(model, loss, eval_metrics=()).evaluate(batches)
  assert set(metrics) == {"loss"} and np.isfinite(metrics["loss"])


def test_evaluate_reports_the_loss_aux_metrics_as_batch_weighted_means():
  batches = make_batches(3, seed=97)

  def loss_with_aux(predictions, labels):
    error = predictions - labels
    return jnp.mean(error**2), {"mae": jnp.mean(jnp.abs(error)), "bias": jnp.mean(error)}

  trainer = make_trainer(loss=loss_with_aux, eval_metrics=())
  trainer.fit(batches[:2])
  result = trainer.evaluate(batches)
  assert set(result) == {"loss", "mae", "bias"}
  error = trainer.predict(batches) - np.concatenate([b["labels"] for b in batches])
  terms = error.size
  assert_close(result["mae"], np.abs(error).mean(), terms=terms)
  assert_close(result["bias"], error.mean(), terms=terms)
  assert_close(result["loss"], (error**2).mean(), terms=terms)


def test_an_aux_metric_named_auc_beside_the_configured_auc_is_refused():
  batches = binary(make_batches(2, seed=99))

  def loss_with_auc(logits, labels):
    return bce(logits, labels), {"auc": jnp.zeros(())}

  trainer = make_trainer(loss=loss_with_auc)
  with pytest.raises(ValueError, match="aux metric 'auc'"):
    trainer.evaluate(batches)


class _WithTemperature(nn.Module):
  """A per-sample logit and a scalar beside it."""

  @nn.compact
  def __call__(self, activations, dense):
    x = jnp.concatenate([activations["fa"], activations["fb"], activations["fa2"], dense], axis=1)
    return {"logit": nn.Dense(1)(x)[:, 0], "temperature": jnp.float32(2.0)}


def test_evaluate_and_predict_name_a_prediction_without_a_row_per_sample():
  """A scalar leaf failed with IndexError (evaluate) or numpy's concatenate error (predict)."""
  trainer = Trainer(_WithTemperature(), make_specs(SGD(0.1)),
                    lambda predictions, labels: jnp.mean((predictions["logit"] - labels) ** 2),
                    optax.sgd(0.1), mesh=mesh_of(1), progress="off", padding_id=-1,
                    eval_metrics=())
  batches = make_batches(2, seed=51)
  message = r"needs predictions with one row per sample: the model's output\['temperature'\]"
  with pytest.raises(ValueError, match="evaluate " + message):
    trainer.evaluate(batches)
  with pytest.raises(ValueError, match="predict " + message):
    trainer.predict(batches)


def test_a_one_shot_eval_data_used_up_by_an_earlier_evaluation_is_refused_before_training():
  """A second fit given the same generator as eval_data trained, then failed at the end
  with "evaluate got no batches"."""
  train, held_out = make_batches(4, seed=120), make_batches(2, seed=121)
  trainer = make_trainer(eval_metrics=())
  eval_data = iter(held_out)
  assert trainer.fit(train, num_steps=2, eval_data=eval_data).evaluations[0][0] == 2
  with pytest.raises(ValueError, match="eval_data is a one-shot iterator that an earlier"
                                       " evaluation of this Trainer used up"):
    trainer.fit(train, eval_data=eval_data)
  assert int(trainer.state.step) == 2  # refused before any training
  assert trainer.fit(train, eval_data=iter(held_out)).final_step == 4
