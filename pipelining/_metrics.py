"""Host-side metrics over a whole evaluation: ROC AUC and friends, and the per-sample
outputs they are computed from.

ROC AUC is defined for binary labels (every label 0 or 1; booleans count)
with one score per label: labels and scores of one shape, [B] or [B, K]
(K binary tasks, pooled). Labels of another kind (class indices, regression
targets, a pytree) and one score per class are refused, never thresholded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from pipelining._placement import to_host


def auc_problem(labels: Sequence[Any], scores: Sequence[Any]) -> str | None:
  """Why ROC AUC is undefined for these batches, or None when it is defined.

  Args:
    labels: each batch's labels (host arrays or pytrees).
    scores: each batch's predictions, in the same order.

  Returns:
    None, or a sentence naming the labels' and predictions' shapes (of one
    batch) or the first label that is neither 0 nor 1, with its batch and
    index.
  """
  for batch, (label, score) in enumerate(zip(labels, scores)):
    for name, value in (("labels", label), ("predictions", score)):
      if not isinstance(value, np.ndarray):
        return (f"the {name} are a pytree of shapes {jax.tree.map(np.shape, value)}, not one"
                " array")
    if label.shape != score.shape:
      return (f"the labels have shape {label.shape} and the predictions {score.shape} (per"
              " batch), not one score per label")
    if score.dtype.kind in "cOSUMm":  # bfloat16 and other ml_dtypes floats rank as floats
      return f"the predictions have dtype {score.dtype}, not real numbers to rank"
    binary = (label == 0) | (label == 1)
    if not binary.all():
      where = np.unravel_index(int(np.flatnonzero(~binary.reshape(-1))[0]), label.shape)
      return (f"labels{list(map(int, where))} of batch {batch} is {label[where]!s}, not 0"
              " or 1")
  return None


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
  """Area under the ROC curve (Mann-Whitney U, ties counted half).

    AUC = (sum of ranks of positives - P (P + 1) / 2) / (P * Q)

  with average ranks for tied scores, P positives and Q negatives.

  Args:
    labels: binary labels (every label 0 or 1).
    scores: one score per label (the same shape), any monotone scale
      (probabilities or logits).

  Returns:
    The AUC in [0, 1], or NaN when only one class is present or a score is
    NaN (a NaN has no rank: the AUC is undefined, not that of NaN ranked last).

  Raises:
    ValueError: labels that are not binary or scores of another shape
      (`auc_problem`).
  """
  labels, scores = np.asarray(labels), np.asarray(scores)
  problem = auc_problem([labels], [scores])
  if problem is not None:
    raise ValueError(f"roc_auc needs binary labels with one score each: {problem}.")
  labels = labels.reshape(-1).astype(bool)
  scores = scores.astype(np.float64).reshape(-1)
  positives = int(labels.sum())
  negatives = labels.size - positives
  if positives == 0 or negatives == 0 or np.isnan(scores).any():
    return float("nan")
  order = np.argsort(scores, kind="stable")
  sorted_scores = scores[order]
  ranks = np.empty(scores.size, np.float64)
  # Average ranks over runs of equal scores.
  # (A comparison, not np.diff: inf - inf is NaN, which would split a run of tied infinities.)
  boundaries = np.flatnonzero(sorted_scores[1:] != sorted_scores[:-1]) + 1
  starts = np.concatenate([[0], boundaries])
  ends = np.concatenate([boundaries, [scores.size]])
  average = (starts + ends + 1) / 2.0  # 1-based average rank of each run
  ranks[order] = np.repeat(average, ends - starts)
  rank_sum = ranks[labels].sum()
  return float((rank_sum - positives * (positives + 1) / 2.0) / (positives * negatives))


def no_batches_error(use: str) -> ValueError:
  """The error of evaluate or predict without a batch; with several processes, one
  process's data without a batch leaves every process without a global batch."""
  if jax.process_count() == 1:
    return ValueError(f"{use} got no batches.")
  return ValueError(
      f"{use} got no global batch: the data of some process (logged above by the processes"
      f" that had batches) holds none, and every global batch needs every process's slice."
      f" Give each of the {jax.process_count()} processes its slice of every batch.")


def evaluation_auc(labels: Sequence[Any], scores: Sequence[Any]) -> float:
  """`roc_auc` over an evaluation's batches, for `TrainerConfig.eval_metrics=("auc",)`.

  Raises:
    ValueError: the model is no binary classifier (`auc_problem`); the
      message says to pass eval_metrics=() for such a model.
  """
  problem = auc_problem(labels, scores)
  if problem is not None:
    raise ValueError(
        f"eval_metrics=('auc',) (the default) computes ROC AUC, which needs binary labels"
        f" (every label 0 or 1) and one score per label; here {problem}. For a model"
        " that is not a binary classifier (several classes, regression, pytree labels) pass"
        " eval_metrics=() to the Trainer: evaluate then reports the loss only."
    )
  return roc_auc(np.concatenate(labels), np.concatenate(scores))


def evaluation_metrics(per_batch: Sequence[dict[str, float]], sizes: Sequence[int],
                       labels: Sequence[Any], scores: Sequence[Any],
                       eval_metrics: Sequence[str]) -> dict[str, float]:
  """An evaluation's result from its batches' metrics, sizes, labels and predictions.

  Each metric of `per_batch` (the loss and the loss's aux metrics) is the
  mean over the batches weighted by their sizes, sum_b n_b m_b / sum_b n_b;
  "auc" (when in `eval_metrics`) is `evaluation_auc` over all samples at once.

  Raises:
    ValueError: no batches; "auc" both an aux metric and in `eval_metrics`;
      `evaluation_auc`'s errors.
  """
  if not sizes:
    raise no_batches_error("evaluate")
  result = {name: float(np.average([metrics[name] for metrics in per_batch], weights=sizes))
            for name in per_batch[0]}
  if "auc" in eval_metrics:
    if "auc" in result:
      raise ValueError(
          "loss_fn reports an aux metric 'auc' and eval_metrics=('auc',) computes one too;"
          " rename the aux metric or pass eval_metrics=()."
      )
    result["auc"] = evaluation_auc(labels, scores)
  return result


def per_sample(predictions: Any, batch_size: int, what: str) -> Any:
  """`predictions` when every leaf has the batch's samples as its leading dimension."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(predictions):
    shape = np.shape(leaf)
    if not shape or shape[0] != batch_size:
      raise ValueError(
          f"{what} needs predictions with one row per sample: the model's output"
          f"{jax.tree_util.keystr(path)} has shape {shape}, not a leading dimension of the"
          f" batch's {batch_size} samples. Return per-sample outputs from the model (a"
          " scalar such as a temperature can live in its parameters instead)."
      )
  return predictions


def host_tree(tree: Any) -> Any:
  """`to_host` of every leaf: whole global values, on every process."""
  return jax.tree.map(to_host, tree)
