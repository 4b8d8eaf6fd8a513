"""The accepted forms of one feature's ids, and their normal form `FlatIds`.

Every form is turned into `FlatIds`, the CSR form of the batch: for B samples,

  values       [nnz]    the ids, sample 0's first, then sample 1's, ...
  row_splits   [B + 1]  sample b owns values[row_splits[b]:row_splits[b + 1]]
  weights      [nnz]    float32 weight of each id, or None (every weight 1)

with the padding id (if any) removed and every id checked against the
table's vocabulary. Numpy masked arrays (np.ma.MaskedArray) are refused in
every place: their masked entries would be read as ids or weights. Accepted
forms:

  * a dense integer array [B, L] (or [B]: one id per sample), optionally
    with a padding id marking unused places; wrap it in `DenseIds` to give
    weights [B, L];
  * ragged ids: a list (or object array) of B per-sample id arrays, or
    `RaggedRows(rows, weights)`, `RaggedIds(values, row_splits)` or
    `RaggedIds.from_lengths(values, lengths)`;
  * sparse COO: `SparseIds(indices [nnz, 2], values [nnz], dense_shape)`,
    indices (sample, position) pairs in any order.

A sequence feature (output (B, L, D)) keeps the place of every id: its
normal form has B * L samples, sample b * L + l holding the id at position l
of sample b (column l of a dense array, the l-th id of a ragged sample, the
COO entry (b, l)) or nothing. A padding id leaves its position empty.

All checks are vectorised: the work is O(nnz) numpy, never a Python loop over
ids (the list form loops once over samples to read their lengths).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from sc_framework._scalars import python_scalar
from sc_framework.preprocessing import _native
from sc_framework.specs import FeatureSpec


@dataclasses.dataclass(frozen=True)
class DenseIds:
  """Dense ids [B, L] (or [B]) with optional weights of the same shape."""

  ids: Any
  weights: Any = None


@dataclasses.dataclass(frozen=True)
class RaggedIds:
  """Ragged ids in CSR form: sample b owns values[row_splits[b]:row_splits[b+1]].

  Attributes:
    values: [nnz] ids.
    row_splits: [B + 1] non-decreasing offsets, row_splits[0] = 0 and
      row_splits[B] = nnz.
    weights: optional [nnz] weights, one per value.
  """

  values: Any
  row_splits: Any
  weights: Any = None

  @classmethod
  def from_lengths(cls, values, lengths, weights=None) -> "RaggedIds":
    """Ragged ids from values [nnz] and per-sample lengths [B] (sum = nnz).

    The lengths are checked with the rest of the batch, by `flatten_input`.
    """
    lengths = np.asarray(_unmasked(lengths, "RaggedIds.from_lengths", "lengths")).reshape(-1)
    # Integer lengths sum in int64: narrow ones (e.g. int8) would wrap around.
    integer = lengths.size == 0 or np.issubdtype(lengths.dtype, np.integer)
    splits = np.zeros(lengths.size + 1, np.int64 if integer else lengths.dtype)
    np.cumsum(lengths, out=splits[1:], dtype=splits.dtype)
    return cls(values, splits, weights)

  @classmethod
  def from_rows(cls, rows, weights=None) -> "RaggedRows":
    """Ragged ids from B per-sample id sequences: the same as RaggedRows(rows, weights)."""
    return RaggedRows(rows, weights)


@dataclasses.dataclass(frozen=True)
class RaggedRows:
  """Ragged ids as B per-sample id sequences, with optional per-sample weights.

  A plain list (or object array) of per-sample ids is accepted as well; this
  wrapper adds the weights: `weights[b]` has one weight per id of `rows[b]`.
  """

  rows: Any
  weights: Any = None


@dataclasses.dataclass(frozen=True)
class SparseIds:
  """Sparse COO ids: values[k] sits at (sample, position) = indices[k].

  Attributes:
    indices: [nnz, 2] integer (sample, position) pairs, in any order.
    values: [nnz] ids.
    dense_shape: (B, L) of the dense array the COO form describes.
    weights: optional [nnz] weights, one per value.
  """

  indices: Any
  values: Any
  dense_shape: Any
  weights: Any = None


@dataclasses.dataclass(frozen=True)
class FlatIds:
  """The normal form of one feature's batch (CSR); see the module docstring."""

  values: np.ndarray
  row_splits: np.ndarray
  weights: np.ndarray | None

  @property
  def batch_size(self) -> int:
    return self.row_splits.shape[0] - 1

  @property
  def lengths(self) -> np.ndarray:
    """[B] ids per sample."""
    return np.diff(self.row_splits)


_NDIM, _DTYPE = operator.attrgetter("ndim"), operator.attrgetter("dtype")
_OBJECT = np.dtype(object)

FeatureInput = Any
"""One feature's ids: an array, a list of arrays, DenseIds, RaggedRows, RaggedIds or SparseIds."""


_MASK_HINTS = {
    "ids": "drop the masked ids (per sample, row.compressed(): a list of rows or"
           " RaggedIds.from_lengths), or fill them with a padding id (ids.filled(-1) and"
           " padding_id=-1)",
    "weights": "drop the masked entries of the ids and weights together (per sample,"
               " row.compressed()), or fill them (weights.filled(w)) with the weight they should"
               " have",
}


def _unmasked(array, owner: str, what: str, sample: int | None = None):
  """`array` itself, or an error if it is a numpy masked array.

  np.asarray drops a mask without a word, so the masked entries would be read
  as ids (or weights, lengths, ...). Refused by type, not by content, so a
  pipeline does not fail only on the batch that first masks an entry.
  """
  if isinstance(array, np.ma.MaskedArray):
    where = f"the {what}" if sample is None else f"sample {sample}'s {what}"
    hint = _MASK_HINTS.get(what, f"pass the {what} as a plain array")
    raise TypeError(
        f"{owner}: {where} are a numpy masked array (np.ma.MaskedArray), whose mask"
        f" preprocessing does not read: the masked entries would be used as {what}. Pass plain"
        f" arrays: {hint}."
    )
  return array


def _row_array(row, b: int, owner: str, what: str) -> np.ndarray:
  """Sample b's entry of a ragged batch as a 1-D array, or an error naming the sample."""
  try:
    array = np.asarray(row)
    if array.dtype == object:  # e.g. a row of an object array: Python ints
      array = np.asarray(array.tolist())
  except ValueError as error:  # e.g. nested lists of different lengths
    raise ValueError(
        f"{owner}: the {what} of sample {b} are not a flat sequence ({error})."
    ) from None
  if array.ndim == 0:
    hint = (" For one id per sample, pass an array of shape [B] (np.asarray(ids))."
            if what == "ids" else "")
    raise TypeError(
        f"{owner}: sample {b} of the ragged {what} is {row!r} ({type(row).__name__}), not a"
        f" sequence: a list (or object array) holds one sequence of {what} per sample.{hint}"
    )
  if array.ndim != 1:
    raise ValueError(
        f"{owner}: the {what} of sample {b} have shape {array.shape}; a ragged batch holds"
        f" one 1-D sequence of {what} per sample. Flatten each sample's {what} (np.ravel),"
        " or pass a dense [B, L] array."
    )
  return array


def _row_arrays(rows, owner: str, what: str) -> tuple[list[np.ndarray], np.ndarray]:
  """(every sample's entry of a ragged batch (ids or weights) as a 1-D array, lengths [B]).

  One pass of C-level maps; the samples are looked at one by one only when
  one of them is not a flat 1-D sequence of numbers (`_row_array`).
  """
  if not hasattr(rows, "__len__"):
    raise TypeError(
        f"{owner}: ragged {what} must be a sequence of per-sample sequences, got"
        f" {type(rows).__name__}."
    )
  _unmasked(rows, owner, what)
  if any(issubclass(kind, np.ma.MaskedArray) for kind in set(map(type, rows))):
    b = next(b for b, row in enumerate(rows) if isinstance(row, np.ma.MaskedArray))
    _unmasked(rows[b], owner, what, sample=b)
  try:
    arrays = list(map(np.asarray, rows))
    ndims = np.fromiter(map(_NDIM, arrays), np.int64, count=len(arrays))
    plain = (ndims == 1).all() and _OBJECT not in set(map(_DTYPE, arrays))
  except ValueError:
    plain = False
  if not plain:
    arrays = [_row_array(row, b, owner, what) for b, row in enumerate(rows)]
  return arrays, np.fromiter(map(len, arrays), np.int64, count=len(arrays))


def _concatenate_ids(arrays: list[np.ndarray], lengths: np.ndarray, owner: str) -> np.ndarray:
  """The samples' ids as one integer array (the values of the CSR form)."""
  pieces = [array for array, n in zip(arrays, lengths) if n]
  if not pieces:
    return np.zeros(0, np.int64)
  if any(not np.issubdtype(dtype, np.integer) for dtype in set(map(_DTYPE, pieces))):
    b = next(b for b, (a, n) in enumerate(zip(arrays, lengths))
             if n and not np.issubdtype(a.dtype, np.integer))
    raise TypeError(
        f"{owner}: ids must be integers, but sample {b} holds {arrays[b].dtype} values"
        f" {arrays[b][:3].tolist()}. Hash or bucket non-integer ids into [0, vocabulary_size)"
        " first."
    )
  values = np.concatenate(pieces)
  if not np.issubdtype(values.dtype, np.integer):
    # uint64 next to signed ids: numpy promotes them to float64, which rounds ids
    # above 2^53. Every id of a table fits int64.
    for b, array in enumerate(arrays):
      if array.dtype == np.uint64 and array.size and array.max() > np.iinfo(np.int64).max:
        raise ValueError(
            f"{owner}: sample {b} has id {int(array.max())}, beyond every vocabulary (ids"
            " must be in [0, vocabulary_size) of the feature's table). Hash or bucket the"
            " ids before preprocessing."
        )
    values = np.concatenate(pieces, dtype=np.int64, casting="unsafe")
  return values


def _ragged_from_rows(rows, weights, *, owner: str) -> RaggedIds:
  arrays, lengths = _row_arrays(rows, owner, "ids")
  splits = np.zeros(lengths.size + 1, np.int64)
  np.cumsum(lengths, out=splits[1:])
  values = _concatenate_ids(arrays, lengths, owner)
  flat_weights = None
  if weights is not None:
    weight_arrays, weight_lengths = _row_arrays(weights, owner, "weights")
    if len(weight_arrays) != len(arrays):
      raise ValueError(
          f"{owner}: weights hold {len(weight_arrays)} samples but the ids hold {len(arrays)}."
      )
    bad = np.flatnonzero(weight_lengths != lengths)
    if bad.size:
      b = int(bad[0])
      raise ValueError(
          f"{owner}: sample {b} has {lengths[b]} ids but {weight_lengths[b]} weights; weights"
          " must match the ids one to one."
      )
    # Their dtype is checked with the other forms' (`flatten_input`), not cast here.
    pieces = [w for w, n in zip(weight_arrays, lengths) if n]
    flat_weights = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
  return RaggedIds(values, splits, flat_weights)


_INT64_MIN, _INT64_MAX = int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max)


def _check_ids_kind(ids: Any, owner: str) -> None:
  """Raises TypeError for ids that are no array or list of ids at all (None, text, a dict)."""
  if ids is None or isinstance(ids, (str, bytes, Mapping)):
    raise TypeError(
        f"{owner}: got {type(ids).__name__} {_short(ids)} as its ids; pass an integer array"
        " [B] or [B, L], a list of each sample's ids, or RaggedIds / RaggedRows / SparseIds /"
        " DenseIds."
    )


def _to_csr(value: FeatureInput, owner: str, padding_id: int | None):
  """Any accepted form -> (values, row_splits, weights, whether padding was removed)."""
  if isinstance(value, SparseIds):
    return _coo_to_csr(value, owner)
  if isinstance(value, RaggedIds):
    return _check_ragged(value, owner)
  if isinstance(value, RaggedRows):
    return _check_ragged(_ragged_from_rows(value.rows, value.weights, owner=owner), owner)
  if isinstance(value, DenseIds):
    ids, weights = value.ids, value.weights
  else:
    ids, weights = value, None
  _unmasked(ids, owner, "ids")
  if isinstance(ids, (list, tuple)) or (isinstance(ids, np.ndarray) and ids.dtype == object):
    return _check_ragged(_ragged_from_rows(ids, weights, owner=owner), owner)
  _check_ids_kind(ids, owner)
  ids = np.asarray(ids)
  if ids.ndim not in (1, 2):
    raise ValueError(f"{owner}: dense ids must have shape [B] or [B, L], got {ids.shape}.")
  _check_int(ids, owner, "ids")
  if ids.ndim == 1:
    ids = ids[:, None]
  batch, width = ids.shape
  if weights is not None:
    weights = _weights_array(weights, owner, "ids", ids.shape)
    if width == 1 and weights.shape == (batch,):
      # One id per sample: weights [B] go with ids [B] or [B, 1]. Any other
      # reshape (e.g. weights [L, B] for ids [B, L]) would pair ids with
      # other samples' weights, so the shapes must match.
      weights = weights.reshape(ids.shape)
    weights = _matching_weights(weights, ids, owner, "ids")
  if padding_id is None:
    values = ids.reshape(-1)
    splits = np.arange(batch + 1, dtype=np.int64) * width
    flat_weights = None if weights is None else weights.reshape(-1)
  elif weights is None and (compacted := _compact_natively(ids, padding_id)) is not None:
    values, splits = compacted
    flat_weights = None
  else:
    keep = ids != padding_id
    values = ids[keep]
    splits = np.zeros(batch + 1, np.int64)
    np.cumsum(np.count_nonzero(keep, axis=1), out=splits[1:])
    flat_weights = None if weights is None else weights[keep]
  return values, splits, flat_weights, True


def _compact_natively(ids: np.ndarray, padding_id: int) -> tuple[np.ndarray, np.ndarray] | None:
  """(ids[ids != padding_id], row splits) of dense [B, L] ids in one C++ pass
  (`compact_padded`), or None where numpy does it: the loops not built, ids
  that are not C-contiguous int32 / int64, a padding id beyond int64."""
  kernels = _native.host_kernels()
  if (kernels is None or ids.dtype not in (np.int32, np.int64) or not ids.flags.c_contiguous
      or not _INT64_MIN <= padding_id <= _INT64_MAX or ids.size == 0):
    return None
  values = np.empty(ids.size, ids.dtype)
  splits = np.empty(ids.shape[0] + 1, np.int64)
  kept = kernels.compact_padded(ids.reshape(-1), ids.shape[1], int(padding_id), values, splits)
  return values[:kept], splits


def _weights_array(weights, owner: str, what: str, shape: tuple[int, ...]) -> np.ndarray:
  _unmasked(weights, owner, "weights")
  try:
    return np.asarray(weights)
  except ValueError as error:  # e.g. per-sample lists of different lengths
    raise ValueError(
        f"{owner}: weights must be an array of the {what}' shape {shape} ({error})."
    ) from None


def _matching_weights(weights, ids: np.ndarray, owner: str, what: str) -> np.ndarray | None:
  """The weights as an array of the ids' shape; None stays None."""
  if weights is None:
    return None
  weights = _weights_array(weights, owner, what, ids.shape)
  if weights.shape != ids.shape:
    raise ValueError(
        f"{owner}: weights have shape {weights.shape} but the {what} have {ids.shape}; they"
        " must match one to one."
    )
  return weights


def _is_real(dtype: np.dtype) -> bool:
  """A float or integer dtype, the floats of ml_dtypes (bfloat16, float8) included."""
  if np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.integer):
    return True
  if dtype.kind != "V":
    return False
  try:  # JAX's extended floats are numpy "void" dtypes that ml_dtypes describes
    import ml_dtypes

    ml_dtypes.finfo(dtype)
  except (ImportError, ValueError, TypeError):
    return False
  return True


def _check_int(array: np.ndarray, owner: str, what: str) -> None:
  # numpy counts timedelta64 as a signed integer type; durations are no ids.
  if not np.issubdtype(array.dtype, np.integer) or array.dtype.kind == "m":
    hint = (" Hash or bucket non-integer ids into [0, vocabulary_size) first." if what == "ids"
            else "")
    raise TypeError(f"{owner}: {what} must be an integer array, got dtype {array.dtype}.{hint}")


def _dense_shape(value: SparseIds, owner: str) -> tuple[int, ...]:
  """A COO input's dense_shape as ints: (B,) or (B, L), each a non-negative integer."""
  declared = _unmasked(value.dense_shape, owner, "dense_shape")
  if isinstance(declared, (list, tuple)):  # numpy would read (4, 2**63) as floats
    sizes = [_size(d) for d in declared]
  else:
    try:
      array = np.asarray(declared)
    except (TypeError, ValueError):
      array = np.asarray(None)
    sizes = [_size(d) for d in array.reshape(-1).tolist()] if array.ndim else [None]
  if len(sizes) not in (1, 2) or any(d is None or d < 0 for d in sizes):
    raise ValueError(
        f"{owner}: dense_shape must be (B, L) (or (B,)) of non-negative integers, got"
        f" {declared!r}."
    )
  return tuple(sizes)


def _size(value: Any) -> int | None:
  """One dense_shape entry as an int (numpy and JAX scalars, integral floats), or None."""
  try:
    value = python_scalar(value)
  except (TypeError, ValueError):
    return None
  if isinstance(value, float) and math.isfinite(value) and value == int(value):
    return int(value)
  if isinstance(value, (bool, float)):
    return None
  try:  # Python ints, and other libraries' integer scalars (torch, tf) by __index__.
    return operator.index(value)
  except TypeError:
    return None


def _check_ragged(value: RaggedIds, owner: str):
  values = np.asarray(_unmasked(value.values, owner, "ids"))
  splits = np.asarray(_unmasked(value.row_splits, owner, "row_splits"))
  if values.ndim != 1:
    raise ValueError(f"{owner}: ragged values must be 1-D, got shape {values.shape}.")
  if values.size:
    _check_int(values, owner, "ids")
  else:
    values = values.astype(np.int64)
  if splits.ndim != 1 or splits.size == 0 or not np.issubdtype(splits.dtype, np.integer):
    raise ValueError(
        f"{owner}: row_splits (or the lengths of RaggedIds.from_lengths) must be a non-empty"
        f" 1-D integer array, got shape {splits.shape} and dtype {splits.dtype}."
    )
  decreasing = np.flatnonzero(splits[1:] < splits[:-1])
  if decreasing.size:
    b = int(decreasing[0])
    raise ValueError(
        f"{owner}: row_splits must be non-decreasing, but sample {b} has row_splits[{b}] ="
        f" {splits[b]} > row_splits[{b + 1}] = {splits[b + 1]} (length"
        f" {int(splits[b + 1]) - int(splits[b])}). Give every sample a length >= 0."
    )
  if splits[0] != 0 or splits[-1] != values.size:
    hint = ""
    if splits[0] == 0 and splits[-1] < values.size and splits.size >= 2:
      hint = (" If these are the B start offsets of the samples (as torch.nn.EmbeddingBag"
              " takes them), append len(values): row_splits has B + 1 entries. Per-sample"
              " lengths go to RaggedIds.from_lengths.")
    raise ValueError(
        f"{owner}: row_splits must run from 0 to len(values) = {values.size}, got"
        f" [{splits[0]}, ..., {splits[-1]}] (lengths summing to {splits[-1] - splits[0]}).{hint}"
    )
  weights = _matching_weights(value.weights, values, owner, "ids")
  return values, splits.astype(np.int64, copy=False), weights, False


def _coo_sorted(value: SparseIds, owner: str):
  """Checked COO ids in (sample, position) order.

  Returns:
    (samples, positions, values, weights, dense_shape); positions are all 0
    for a 1-D dense_shape.
  """
  indices = np.asarray(_unmasked(value.indices, owner, "COO indices"))
  values = np.asarray(_unmasked(value.values, owner, "ids"))
  shape = _dense_shape(value, owner)
  if indices.ndim != 2 or indices.shape[1] != len(shape) or indices.shape[0] != values.shape[0]:
    raise ValueError(
        f"{owner}: COO indices must have shape [nnz, {len(shape)}] with nnz = len(values) ="
        f" {values.shape[0]}, got {indices.shape}."
    )
  if values.ndim != 1:
    raise ValueError(f"{owner}: COO values must be 1-D, got shape {values.shape}.")
  if values.size:
    _check_int(values, owner, "ids")
    _check_int(indices, owner, "indices")
  else:
    values = values.astype(np.int64)
    indices = indices.astype(np.int64)
  samples = indices[:, 0].astype(np.int64)
  positions = (indices[:, 1] if len(shape) == 2 else np.zeros(samples.size)).astype(np.int64)
  for axis, bound in enumerate(shape):
    column = indices[:, axis]
    bad = np.flatnonzero((column < 0) | (column >= bound))
    if bad.size:
      k = int(bad[0])
      raise ValueError(
          f"{owner}: COO index {indices[k].tolist()} (entry {k}) is outside dense_shape {shape}."
      )
  weights = _matching_weights(value.weights, values, owner, "COO values")
  if samples.size > 1:
    # One int64 key per (sample, position), when the positions in use allow one
    # (dense_shape[1] itself may be huge, e.g. 2^62 for "any length").
    width = int(positions.max()) + 1
    order = None
    if shape[0] * width <= np.iinfo(np.int64).max:
      order_key = samples * width + positions
      if np.any(order_key[1:] < order_key[:-1]):
        order = np.argsort(order_key, kind="stable")
    else:
      order = np.lexsort((positions, samples))
    if order is not None:
      samples, values, positions = samples[order], values[order], positions[order]
      weights = None if weights is None else weights[order]
    repeated = np.flatnonzero((samples[1:] == samples[:-1]) & (positions[1:] == positions[:-1]))
    if repeated.size:
      first, k = int(repeated[0]), int(repeated[0] + 1)
      if order is not None:
        first, k = int(order[first]), int(order[k])
      raise ValueError(
          f"{owner}: COO index {indices[k].tolist()} appears more than once (entries {first}"
          f" and {k}); each position of dense_shape holds one id. Merge the duplicates (to"
          " repeat an id, put it at two positions or give it a larger weight)."
      )
  return samples, positions, values, weights, shape


def _coo_to_csr(value: SparseIds, owner: str):
  samples, _, values, weights, shape = _coo_sorted(value, owner)
  splits = np.zeros(shape[0] + 1, np.int64)
  np.cumsum(np.bincount(samples, minlength=shape[0]), out=splits[1:])
  return values, splits, weights, False


def _positions_of(value: FeatureInput, owner: str):
  """A sequence feature's ids with their places, in (sample, position) order.

  Position l of sample b holds: the column l of a dense [B, L'] array, the
  l-th id of a ragged sample, the COO entry at (b, l).

  Returns:
    (samples, positions, values, weights, batch size B).
  """
  if isinstance(value, SparseIds):
    samples, positions, values, weights, shape = _coo_sorted(value, owner)
    if len(shape) != 2:  # as a dense [B] array is refused below
      raise ValueError(
          f"{owner}: a sequence feature's COO ids must have dense_shape (B, L) with indices"
          f" [nnz, 2] of (sample, position), got dense_shape {shape}."
      )
    return samples, positions, values, weights, shape[0]
  ids = _unmasked(value.ids if isinstance(value, DenseIds) else value, owner, "ids")
  ragged = isinstance(value, (RaggedIds, RaggedRows)) or isinstance(ids, (list, tuple)) or (
      isinstance(ids, np.ndarray) and ids.dtype == object)
  _check_ids_kind(ids, owner)
  if not ragged and np.ndim(ids) != 2:
    raise ValueError(
        f"{owner}: a sequence feature's dense ids must have shape [B, L], got"
        f" {np.shape(ids)}."
    )
  values, splits, weights, _ = _to_csr(value, owner, None)
  batch = splits.size - 1
  if ragged:
    samples = np.repeat(np.arange(batch, dtype=np.int64), np.diff(splits))
    positions = np.arange(values.size, dtype=np.int64) - splits[samples]
  else:
    width = values.size // max(batch, 1)
    samples = np.repeat(np.arange(batch, dtype=np.int64), width)
    positions = np.tile(np.arange(width, dtype=np.int64), batch)
  return samples, positions, values, weights, batch


def _sequence_csr(value: FeatureInput, feature: FeatureSpec, owner: str,
                  padding_id: int | None):
  """A sequence feature's ids as B * L single-id samples (`_to_csr`'s form).

  Stack sample b * L + l holds the id at position l of sample b, or nothing
  (a padding id, a position past a shorter ragged sample or missing from
  the COO input). Every id must sit at a position < L.

  Returns:
    (values, row_splits [B * L + 1], weights, B).
  """
  length = feature.sequence_length
  samples, positions, values, weights, batch = _positions_of(value, owner)
  if padding_id is not None:
    keep = values != padding_id
    if not keep.all():
      samples, positions, values = samples[keep], positions[keep], values[keep]
      weights = None if weights is None else weights[keep]
  late = np.flatnonzero(positions >= length)
  if late.size:
    k = int(late[0])
    raise ValueError(
        f"{owner}: sample {int(samples[k])} has id {int(values[k])} at position"
        f" {int(positions[k])}, but the feature is a sequence of length {length} (input_shape"
        f" {feature.input_shape}). Truncate the sequences to {length} positions, or raise"
        " the sequence length of input_shape and output_shape."
        + (f" If {int(values[k])} pads the sequences, pass padding_id={int(values[k])}."
           if padding_id is None and int(values[k]) < 0 else "")
    )
  splits = np.zeros(batch * length + 1, np.int64)
  np.cumsum(np.bincount(samples * length + positions, minlength=batch * length),
            out=splits[1:])
  return values, splits, weights, batch


def _remove_padding(values, splits, weights, padding_id):
  keep = values != padding_id
  if keep.all():
    return values, splits, weights
  cumulative = np.zeros(values.size + 1, np.int64)
  np.cumsum(keep, out=cumulative[1:])
  return values[keep], cumulative[splits], None if weights is None else weights[keep]


def _check_sample_lengths(splits: np.ndarray, feature: FeatureSpec, owner: str) -> None:
  """Every sample holds at most input_shape[1] ids (padding excluded), when given."""
  if len(feature.input_shape) < 2 or feature.input_shape[1] is None or splits.size < 2:
    return
  limit = feature.input_shape[1]
  lengths = np.diff(splits)
  if lengths.max() > limit:
    sample = int(np.argmax(lengths > limit))
    raise ValueError(
        f"{owner}: sample {sample} has {int(lengths[sample])} ids but its FeatureSpec allows at"
        f" most {limit} per sample (input_shape {feature.input_shape}). Raise input_shape[1],"
        " use (batch, None) for samples of any length, or truncate the samples."
    )


def _check_batch(batch: int, feature: FeatureSpec, batch_size: int | None, owner: str) -> None:
  """The batch holds the samples expected (`flatten_input`'s batch_size, else the spec's)."""
  if batch_size is not None and batch_size != feature.batch_size:
    if batch != batch_size:
      raise ValueError(
          f"{owner}: got a batch of {batch} samples but expected {batch_size}, this"
          f" process's share of the FeatureSpec's global batch size {feature.batch_size} (the"
          " samples of the devices it feeds). Feed each process its contiguous slice of every"
          " global batch."
      )
  elif batch != feature.batch_size:
    raise ValueError(
        f"{owner}: got a batch of {batch} samples but its FeatureSpec has batch size"
        f" {feature.batch_size} (input_shape {feature.input_shape}). Feed batches of the spec's"
        " size, or change the spec."
    )


def _sample_of(splits: np.ndarray, position: int) -> int:
  return int(np.searchsorted(splits, position, side="right") - 1)


def flatten_input(
    value: FeatureInput,
    feature: FeatureSpec,
    *,
    padding_id: int | None = None,
    batch_size: int | None = None,
) -> FlatIds:
  """Checks one feature's batch and returns its CSR normal form.

  Args:
    value: the feature's ids in any accepted form (module docstring).
    feature: the feature's spec: batch size and table vocabulary are checked.
    padding_id: an id marking "no id" in any form; such ids are skipped. None:
      every id must be in [0, vocabulary_size).
    batch_size: the samples expected; None: the spec's (global) batch size. A
      process that feeds only some of the devices passes its share.

  Returns:
    FlatIds with int ids in [0, V), row_splits [B + 1] and float32 weights (or
    None when no weights were given). For a sequence feature (output
    (B, L, D)) the FlatIds hold B * L samples of at most one id each: sample
    b * L + l is position l of sample b, empty where the position has no id
    (padding id, past the end of a ragged sample, absent from a COO input).

  Raises:
    TypeError: non-integer ids or padding_id, a malformed ragged batch, or a
      numpy masked array anywhere in `value` (its mask would be dropped).
    ValueError: naming the feature, table, sample and value: a batch size that
      differs from the spec, a sample with more ids (padding excluded) than
      the spec's input_shape[1] (for a sequence feature: an id at a position
      >= L), a COO position given twice, ids outside
      [0, V) that are not the padding id, weights whose shape differs from the
      ids', NaN or infinite weights, weights beyond float32's range (or, under
      'mean' / 'sqrtn', a sample whose weights all round to 0 in float32).
  """
  table = feature.table
  owner = f"feature {feature.name!r}"
  if padding_id is not None and (isinstance(padding_id, (bool, np.bool_))
                                 or not isinstance(padding_id, (int, np.integer))):
    raise TypeError(
        f"{owner}: padding_id must be an int id (e.g. -1) or None, got {padding_id!r}"
        f" ({type(padding_id).__name__})."
    )
  if isinstance(value, SparseIds):  # before arrays of dense_shape[0] samples are made
    _check_batch(_dense_shape(value, owner)[0], feature, batch_size, owner)
  length = feature.sequence_length
  if length is None:
    values, splits, weights, padding_done = _to_csr(value, owner, padding_id)
    batch = splits.size - 1
  else:
    values, splits, weights, batch = _sequence_csr(value, feature, owner, padding_id)
    padding_done = True
  _check_batch(batch, feature, batch_size, owner)
  if padding_id is not None and not padding_done:
    values, splits, weights = _remove_padding(values, splits, weights, padding_id)
  if length is None:
    _check_sample_lengths(splits, feature, owner)

  def where(index: int) -> str:
    sample = _sample_of(splits, index)
    if length is None:
      return f"sample {sample}"
    return f"sample {sample // length} position {sample % length}"

  if values.size:
    low, high = values.min(), values.max()
    if low < 0 or high >= table.vocabulary_size:
      bad = np.flatnonzero((values < 0) | (values >= table.vocabulary_size))[0]
      bad_id = int(values[bad])
      if bad_id < 0 and padding_id is not None:
        hint = (f" Negative ids are only allowed as the padding id, which is {padding_id} here:"
                " mark every unused place with it (one padding id per feature; a dict"
                " padding_id gives each feature its own).")
      elif bad_id < 0:
        hint = (" Negative ids are only allowed as the padding id: pass padding_id="
                f"{bad_id} if it marks unused places.")
      elif values.dtype.kind == "u" and bad_id == np.iinfo(values.dtype).max:
        hint = (f" It is -1 in {values.dtype} (the ids' dtype): if it marks unused places,"
                f" pass padding_id={bad_id} or give the ids a signed dtype.")
      else:
        hint = (" Hash or bucket the ids before preprocessing, or raise the table's"
                " vocabulary_size.")
      raise ValueError(
          f"{owner} (table {table.name!r}, vocabulary_size={table.vocabulary_size}) got id"
          f" {bad_id} at {where(bad)}; ids must be in"
          f" [0, {table.vocabulary_size}).{hint}"
      )
  if weights is not None:
    weights = _float32_weights(weights, values, splits, feature, where)
  return FlatIds(values, splits, weights)


def _float32_weights(weights: np.ndarray, values: np.ndarray, splits: np.ndarray,
                     feature: FeatureSpec, where: Callable[[int], str]) -> np.ndarray:
  """The weights as float32, refusing those that float32 does not stand for.

  Refused: a dtype that is not real; NaN or infinite weights; finite weights
  beyond float32's range; and, for a combined feature under 'mean' or
  'sqrtn', a sample whose given weights are not all 0 but all round to 0 in
  float32 (its combiner would see no weight at all, and the sample no id).
  A weight that rounds to 0 next to larger ones is float32's rounding of
  its gain, as under 'sum'.
  """
  owner = f"feature {feature.name!r} (table {feature.table.name!r})"
  if not _is_real(weights.dtype):
    raise TypeError(
        f"feature {feature.name!r}: weights must be a real (float or integer) array, got dtype"
        f" {weights.dtype}."
    )

  def describe(bad: np.ndarray) -> str:
    k = int(bad[0])
    return f"weight {weights[k]} of id {int(values[k])} at {where(k)}"

  with np.errstate(over="ignore", under="ignore"):
    narrow = weights.astype(np.float32, copy=False)
  finite = np.isfinite(narrow)
  if not finite.all():
    given = np.isfinite(weights)
    if not given.all():
      raise ValueError(
          f"{owner}: {describe(np.flatnonzero(~given))} is not finite; weights must be finite"
          " numbers."
      )
    raise ValueError(
        f"{owner}: {describe(np.flatnonzero(~finite))} is beyond float32's range (magnitude at"
        f" most {float(np.finfo(np.float32).max):.4g}); weights are float32. Scale the weights"
        " down."
    )
  if (narrow is not weights and feature.sequence_length is None
      and feature.table.combiner != "sum"):
    lost = narrow == 0
    if lost.any():
      lost &= weights != 0
    if lost.any():
      samples = np.repeat(np.arange(splits.size - 1), np.diff(splits))
      weighted = np.bincount(samples, np.abs(narrow), minlength=splits.size - 1) > 0
      bad = np.flatnonzero(lost & ~weighted[samples])
      if bad.size:
        raise ValueError(
            f"{owner}: {describe(bad)} rounds to 0 in float32, as does every weight of its"
            f" sample, so the {feature.table.combiner!r} combiner would see no weight. Scale"
            " the sample's weights up (the combined result does not depend on their scale)."
        )
  return narrow


def _short(value: Any) -> str:
  """repr(value), cut to 60 characters."""
  text = repr(value)
  return text if len(text) <= 60 else text[:57] + "..."
