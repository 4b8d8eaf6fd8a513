"""Checks of every batch before it is staged: its entries, its rows, and the first batch.

A batch is a dict with "sparse" (always), "dense" (the model's dense
features, may be absent or None) and "labels" (needed by fit and evaluate,
which give them to the loss; predict neither needs nor reads them). Before a
batch is preprocessed, `BatchChecker.check` refuses, naming the batch's
position in its data, the entry and expected vs actual:

  * a batch that is not a dict, or lacks an entry its use needs;
  * a dense feature or label whose leading dimension is not the batch's
    number of samples (this process's share of the FeatureSpecs' batch
    size): one row per sample;
  * a dense feature or label that is a numpy masked array: its mask would be
    dropped without a word when the batch is staged, and the masked values
    trained on;
  * a batch whose dense features or labels differ in structure, shape or
    dtype from the first batch that had them (dtypes as JAX will hold them:
    float64 becomes float32 without x64). The model, the optimizer state and
    the compiled steps were built from the first batch.

Labels whose shape differs from the predictions' are refused where an
elementwise loss would broadcast them into a larger array
(`check_labels_fit_predictions`): labels [B, 1] against predictions [B] give
(predictions - labels) of shape [B, B], a loss that trains silently on the
wrong thing.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from sc_framework._byte_order import native_dtype

_LOG = logging.getLogger("pipelining")

BatchUse = Literal["training", "evaluation", "prediction"]

# The entries each use needs (present and not None), and those it checks.
_NEEDED: dict[str, tuple[str, ...]] = {
    "training": ("sparse", "labels"), "evaluation": ("sparse", "labels"),
    "prediction": ("sparse",),
}
_CHECKED: dict[str, tuple[str, ...]] = {
    "training": ("dense", "labels"), "evaluation": ("dense", "labels"),
    "prediction": ("dense",),
}
_READ = ("sparse", "dense", "labels")  # every entry any use reads
_METHOD = {"training": "fit", "evaluation": "evaluate", "prediction": "predict"}
_WHY = {
    "sparse": "every batch needs the ids of its sparse features: {{'feature name': ids, ...}}.",
    "labels": ("{use} needs labels: loss_fn(predictions, labels) computes the loss from them."
               " Add them (an array or pytree with one row per sample), or call predict, which"
               " needs only 'sparse' and 'dense'."),
}

Shapes = dict[str, tuple[tuple[int, ...], str]]


def describe(tree: Any, entry: str = "", where: str = "a batch") -> Shapes:
  """Leaf path ("['user']", "" for a single array) -> (shape, dtype as JAX holds it).

  Raises:
    TypeError: a leaf of a dtype JAX holds no array of (strings, Python
      objects), naming the batch (`where`), the entry and the leaf.
  """
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  out = {}
  for path, leaf in leaves:
    dtype = getattr(leaf, "dtype", None) or np.asarray(leaf).dtype
    if not (jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_)):
      raise TypeError(
          f"{where}: {entry}{jax.tree_util.keystr(path)} has dtype {dtype}, which no device"
          " array holds; pass numbers (float or int arrays): encode strings and objects"
          " (categories as sparse ids, values as floats) first."
      )
    out[jax.tree_util.keystr(path)] = (
        tuple(np.shape(leaf)), str(jax.dtypes.canonicalize_dtype(native_dtype(dtype))))
  return out


def batch_name(use: BatchUse, index: int | None) -> str:
  """How messages name a batch: "batch 3 of the training data" (0-based), or "a batch"."""
  return "a batch" if index is None else f"batch {index} of the {use} data"


def check_iterable(data: Any, argument: str) -> None:
  """Raises TypeError naming `argument` when `data` cannot be iterated (None, a number).

  `iter` takes an iterable or a sequence-like object (`__getitem__` from 0, as a
  map-style dataset); it is not called here, which could start a loader's workers.
  """
  if not isinstance(data, Iterable) and not hasattr(type(data), "__getitem__"):
    raise TypeError(
        f"{argument} must be an iterable of batches (a list, a generator, a data loader), got"
        f" {type(data).__name__} {data!r}."
    )


def check_not_one_batch(data: Any, argument: str) -> None:
  """Raises TypeError when `data` is one batch (a dict with a 'sparse' entry), not batches:
  iterating it would give its keys, each refused as "a str, not a dict"."""
  if isinstance(data, Mapping) and "sparse" in data:
    raise TypeError(
        f"{argument} is one batch (a dict with 'sparse'), not an iterable of batches; pass a"
        " list of batches ([batch] for this one), a generator or another iterable."
    )


def check_entries(raw: Any, use: BatchUse, where: str) -> None:
  """Raises unless `raw` is a dict holding every entry `use` needs.

  Raises:
    TypeError: `raw` is not a dict.
    ValueError: a needed entry is absent or None, naming it and the keys present.
  """
  if not isinstance(raw, Mapping):
    raise TypeError(
        f"{where} is a {type(raw).__name__}, not a dict; a batch is a dict with 'sparse'"
        " (feature name -> ids), 'dense' (the model's dense features) and 'labels' (for fit"
        " and evaluate)."
    )
  for entry in _NEEDED[use]:
    if raw.get(entry) is None:
      has = f"has {entry!r}: None" if entry in raw else f"has no {entry!r} entry"
      raise ValueError(f"{where} {has} (its keys are {sorted(map(str, raw))}); "
                       + _WHY[entry].format(use=_METHOD[use]))


def check_rows(shapes: Shapes, entry: str, rows: Sequence[int], samples: str, where: str) -> None:
  """Raises ValueError unless every leaf of `entry` has a leading dimension in `rows`.

  Args:
    shapes: `describe` of the entry.
    entry: "dense" or "labels".
    rows: the allowed leading dimensions (one per distinct FeatureSpec batch size).
    samples: what `rows` are, for the message ("the FeatureSpecs' batch size").
    where: `batch_name` of the batch.
  """
  for path, (shape, _) in shapes.items():
    if shape[:1] in [(r,) for r in rows]:
      continue
    want = " or ".join(map(str, rows))
    got = f"leading dimension {shape[0]}" if shape else "no leading dimension"
    listed = ""
    if all(not leaf_shape and re.fullmatch(r"\[\d+\]", leaf_path)  # a list of numbers
           for leaf_path, (leaf_shape, _) in shapes.items()):
      listed = (f" ({entry} is a list or tuple, each of its items one array: pass"
                f" np.asarray({entry}) to give one array)")
    raise ValueError(
        f"{where}: {entry}{path} has shape {shape}, {got}, but the batch has {want} samples"
        f" ({samples}){listed}; labels and dense features need one row per sample, leading"
        f" dimension {want}. Feed {entry}{path} of shape {(rows[0],) + shape[1:]} or change"
        " the FeatureSpecs' batch size."
    )


def check_unmasked(tree: Any, entry: str, where: str) -> None:
  """Raises TypeError if a leaf of `entry` is a numpy masked array, naming the leaf.

  Staging converts every leaf with np.asarray, which drops a mask: the
  masked values would be trained on as if they were data.
  """
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if isinstance(leaf, np.ma.MaskedArray):
      name = f"{entry}{jax.tree_util.keystr(path)}"
      raise TypeError(
          f"{where}: {name} is a numpy masked array (np.ma.MaskedArray) with"
          f" {int(np.ma.count_masked(leaf))} masked values; its mask would be dropped when the"
          " batch is staged and the masked values used as data. Pass a plain array: fill the"
          f" masked values ({name}.filled(value)), or drop their samples from the batch."
      )


def _leaves(shapes: Shapes) -> str:
  """A batch entry's leaves in words: none (no such entry), one array, or a tree's paths."""
  if not shapes:
    return "nothing (no such entry)"
  if set(shapes) == {""}:
    return "one array"
  return f"the leaves {sorted(shapes)}"


def check_like_first(entry: str, first: Shapes, shapes: Shapes, where: str,
                     first_where: str) -> None:
  """Raises ValueError unless `shapes` (of a later batch) equal `first` (the first batch's).

  The message names the entry and leaf ("dense['user']"), both shapes and
  dtypes, or both sets of leaves when the structure differs, and the first
  batch (`first_where`: of another use, it may be of another data).
  """
  earlier = f"the first batch this Trainer checked ({first_where})"
  if set(shapes) != set(first):
    raise ValueError(
        f"{where}: its {entry!r} entry holds {_leaves(shapes)} but {earlier} held"
        f" {_leaves(first)}; every batch must have the structure of the first (the model was"
        " built for it)."
    )
  for path, (shape, dtype) in first.items():
    got_shape, got_dtype = shapes[path]
    if (got_shape, got_dtype) != (shape, dtype):
      raise ValueError(
          f"{where}: {entry}{path} has shape {got_shape} and dtype {got_dtype} but {earlier}"
          f" had shape {shape} and dtype {dtype}; every batch must have the shapes and"
          " dtypes of the first (the model and the compiled steps were built for them). Feed"
          " batches of one size (drop or pad a short last batch) and one dtype."
      )


class BatchChecker:
  """Checks every batch of fit, evaluate and predict before it is staged (see module doc).

  The first batch that has an entry sets its structure, shapes and dtypes:
  a predict without labels before fit leaves the labels to fit's first
  batch. Thread-safe (batches are staged on the prefetch thread).

  Args:
    batch_sizes: the FeatureSpecs' (global) batch sizes.
    local_devices: L, the devices this process feeds.
    num_devices: G, the devices of the table axis; a process feeds B * L / G
      rows of a global batch of B.
  """

  def __init__(self, batch_sizes: Sequence[int], local_devices: int, num_devices: int):
    sizes = sorted(set(batch_sizes))
    self._rows = [size * local_devices // num_devices for size in sizes]
    sizes_text = " or ".join(map(str, sizes))
    self._samples = ("the FeatureSpecs' batch size" if local_devices == num_devices else
                     f"this process's share, {local_devices} of {num_devices} devices, of the"
                     f" FeatureSpecs' global batch size {sizes_text}")
    self._first: dict[str, tuple[Shapes, str]] = {}  # entry -> (shapes, which batch)
    self._unread_told: set[str] = set()  # entries no batch use reads, warned about once
    self._lock = threading.Lock()

  def check(self, raw: Any, use: BatchUse, index: int | None) -> None:
    """Raises TypeError / ValueError naming the batch (`batch_name`) unless it fits.

    Args:
      raw: the batch.
      use: what it is for; "prediction" needs no labels and does not read them.
      index: its 0-based position in its data (over all epochs for
        training), or None when unknown.
    """
    where = batch_name(use, index)
    check_entries(raw, use, where)
    self._warn_unread(raw, where)
    for entry in _CHECKED[use]:
      check_unmasked(raw.get(entry), entry, where)
      shapes = describe(raw.get(entry), entry, where)
      check_rows(shapes, entry, self._rows, self._samples, where)
      with self._lock:
        first, first_where = self._first.setdefault(entry, (shapes, where))
      if first is not shapes:
        check_like_first(entry, first, shapes, where, first_where)


  def _warn_unread(self, raw: Mapping[str, Any], where: str) -> None:
    """Warns once per entry name: a batch entry the Trainer does not read ('weights' meant as
    per-sample weights, a misspelt 'label') is otherwise ignored without a word."""
    with self._lock:
      unread = sorted(str(key) for key in raw
                      if key not in _READ and str(key) not in self._unread_told)
      self._unread_told.update(unread)
    if unread:
      _LOG.warning(
          "%s has entries %s that the Trainer does not read (it reads only 'sparse', 'dense'"
          " and 'labels'); they are ignored. Per-sample weights or other targets go into the"
          " labels (an array or a pytree), which loss_fn receives.", where, unread)


def check_labels_fit_predictions(predictions: Any, labels: Any) -> None:
  """Refuses labels that an elementwise loss would broadcast against the predictions.

  Args:
    predictions: the model's output (arrays or shape structs), global shapes.
    labels: the batch's labels, global shapes.

  Raises:
    ValueError: both are single arrays of different shapes whose broadcast
      shape is neither of them (e.g. [B] and [B, 1] -> [B, B]), naming both.
  """
  if not (hasattr(predictions, "shape") and hasattr(labels, "shape")):
    return
  p, l = tuple(predictions.shape), tuple(labels.shape)
  if p == l:
    return
  try:
    broadcast = tuple(np.broadcast_shapes(p, l))
  except ValueError:
    return  # no silent broadcast: an elementwise loss fails loudly
  if broadcast not in (p, l):
    raise ValueError(
        f"the labels have shape {l} but the model's predictions have shape {p}: an elementwise"
        f" loss of both, such as (predictions - labels) ** 2, silently broadcasts them to"
        f" {broadcast}. Give the labels the predictions' shape (reshape them to {p}) or make"
        f" the model return shape {l}."
    )
