"""The pipeline's in-flight batch in a layout-free form, for checkpoints.

A pipelined checkpoint taken between steps holds one batch whose lookup ran
early (the pipelined schedule of `pipelining._fit_loop`). It is stored without anything that
depends on the layout (device count G, shards per device S, stacking) or on
the number of processes, so it resumes on any of them:

  activations  feature -> [B, D] (or [B, L, D]) float32: the lookup result;
  dense,       the batch's dense features and labels as global arrays with
  labels       leading dimension B;
  ids          feature -> the batch's raw ids, global over all processes:
                 ids      [B, W] int32    -1 where there is no id;
                 weights  [B, W] float32  only when the batch had weights.

Row b holds sample b's ids in the preprocessing normal form (`FlatIds`): the
padding id removed, every id checked against its vocabulary. For a combined
feature the ids are in order at the start of the row, then -1s, and W is the
longest sample over every process (at least 1). For a sequence feature
(output [B, L, D]) W = L and column l is the id at position l, or -1 where
the position is empty (a padding id, a short ragged sample). Samples are in
global batch order: process p's slice of every global batch holds the
samples of its table-axis positions (`pipelining._placement`), so the slices
of all processes, ordered by position, are the global batch. Each process
saves the rows of its own samples of one global array; a resumed job, with
any number of processes and devices, reads the whole arrays, takes the rows
of its own samples and preprocesses them again for its layout
(`local_inputs`, as COO ids: (sample, column) -> id). On the same layout this
gives the same buffers bit for bit: preprocessing depends on the ids, their
order (and places) and weights only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from pipelining._distributed import allgather_json
from pipelining._steps import DeviceBatch
from sc_framework.preprocessing import (
    FeatureInput,
    FlatIds,
    PaddingId,
    SparseIds,
    flatten_input,
    padding_id_of,
)
from sc_framework.specs import FeatureSpec

_INT32_MAX = int(np.iinfo(np.int32).max)


class Staged(NamedTuple):
  """A batch ready for a step, with the raw ids it was prepared from.

  Attributes:
    batch: the prepared batch on the devices.
    ids: this process's raw ids, feature -> any accepted input form; kept so
      that a checkpoint can store the batch layout-free while it is in flight.
    dropped_ids: the ids its preprocessing dropped (`allow_id_dropping`).
  """

  batch: DeviceBatch
  ids: Mapping[str, FeatureInput] | DroppedIds
  dropped_ids: int = 0


class DroppedIds(NamedTuple):
  """A batch's raw ids when preprocessing dropped some of them (`Staged.ids` then).

  A checkpoint that stores the batch in flight stores the ids its lookup
  kept (`kept_inputs`), which another layout would not drop alike; they are
  worked out from `batch` only then, not for every batch that drops.

  Attributes:
    raw: this process's raw ids, as fed to fit.
    batch: the preprocessed host buffers (stack name -> StackBatch).
  """

  raw: Mapping[str, FeatureInput]
  batch: Mapping[str, Any]


class SavedInFlight(NamedTuple):
  """An in-flight batch as a checkpoint holds it (see the module docstring).

  Attributes:
    activations: feature -> global [B, D] (or [B, L, D]) activations.
    dense, labels: the batch's global dense features and labels.
    ids: feature -> {"ids"[, "weights"]}: global arrays when
      saving, host numpy arrays (the whole global batch) after a restore.
  """

  activations: dict[str, Any]
  dense: Any
  labels: Any
  ids: dict[str, dict[str, Any]]


class FeatureInFlight(NamedTuple):
  """An in-flight batch with its activations per feature (feature -> [B, D]).

  The form checkpoints hold, and of a batch restored from a layout-specific
  (trainer/1) checkpoint, whose preprocessed buffers replay on the layout it
  was written with only. The Trainer carries the activations per stack
  (`pipelining._steps.InFlight`) and converts at save and restore.
  """

  activations: dict[str, Any]
  batch: DeviceBatch


class IdRows(NamedTuple):
  """One feature's ids as rows (see the module docstring), host arrays."""

  ids: np.ndarray
  weights: np.ndarray | None


def _places(flat: FlatIds, spec: FeatureSpec, batch_size: int):
  """(sample, column) of every id of `flat`, and the row width they need."""
  length = getattr(spec, "sequence_length", None)
  lengths = flat.lengths
  entries = np.repeat(np.arange(lengths.size), lengths)
  if length is not None and lengths.size == batch_size * length:
    # A sequence feature's normal form: sample b * L + l is position l of b.
    return entries // length, entries % length, length
  columns = np.arange(flat.values.size) - np.repeat(flat.row_splits[:-1], lengths)
  return entries, columns, max(1, int(lengths.max(initial=0)))


def check_savable(features: Sequence[FeatureSpec]) -> None:
  """Raises ValueError for a feature whose in-flight ids int32 cannot hold (the Trainer
  checks it when built with pipelining and a workdir, before any step is trained)."""
  for spec in features:
    if spec.table.vocabulary_size - 1 > _INT32_MAX:
      raise ValueError(
          f"feature {spec.name!r}: table {spec.table.name!r} has vocabulary_size"
          f" {spec.table.vocabulary_size}, more than int32 holds; an in-flight batch of it"
          " cannot be checkpointed. Save in synchronous mode (pipelining=False)."
      )


def _rows(value: FeatureInput, spec: FeatureSpec, padding_id: PaddingId,
          batch_size: int) -> IdRows:
  flat = flatten_input(value, spec, padding_id=padding_id_of(padding_id, spec.name),
                       batch_size=batch_size)
  check_savable([spec])
  samples, columns, width = _places(flat, spec, batch_size)
  ids = np.full((batch_size, width), -1, np.int32)
  ids[samples, columns] = flat.values
  weights = None
  if flat.weights is not None:
    weights = np.zeros((batch_size, width), np.float32)
    weights[samples, columns] = flat.weights
  return IdRows(ids, weights)


def _widen(rows: IdRows, width: int, weighted: bool) -> IdRows:
  pad = ((0, 0), (0, width - rows.ids.shape[1]))
  weights = rows.weights
  if weighted and weights is None:
    weights = (rows.ids >= 0).astype(np.float32)
  return IdRows(np.pad(rows.ids, pad, constant_values=-1),
                None if weights is None else np.pad(weights, pad))


def id_rows(ids: Mapping[str, FeatureInput], specs: Sequence[FeatureSpec], *,
            padding_id: PaddingId, share: int, num_devices: int) -> dict[str, IdRows]:
  """This process's raw ids of a batch as rows of one width agreed by every process.

  Args:
    ids: feature -> this process's raw ids (as fed to fit).
    specs: the feature specs (global batch sizes).
    padding_id: the Trainer's padding id (one, or one per feature).
    share: L, the table-axis positions this process feeds.
    num_devices: G.

  Returns:
    feature -> IdRows with B * L / G rows. With several processes every one
    must call this at the same point (an exchange of the widths).
  """
  rows = {spec.name: _rows(ids[spec.name], spec, padding_id,
                           spec.batch_size * share // num_devices) for spec in specs}
  mine = {name: [int(r.ids.shape[1]), r.weights is not None] for name, r in rows.items()}
  every = allgather_json("in-flight id widths", mine)
  out = {}
  for name, r in rows.items():
    width = max(process[name][0] for process in every)
    weighted = any(process[name][1] for process in every)
    out[name] = _widen(r, width, weighted)
  return out


def kept_inputs(ids: Mapping[str, FeatureInput], specs: Sequence[FeatureSpec],
                kept: Mapping[str, np.ndarray], *, padding_id: PaddingId, share: int,
                num_devices: int) -> dict[str, SparseIds]:
  """The ids a batch kept (`kept_id_masks`) after dropping some, in place of its raw ids.

  Each kept id stays at its (sample, column) of the raw ids (a sequence
  feature's position), with its weight: preprocessed again on the layout
  that dropped the others, they give that batch's buffers; on another
  layout, the ids its lookup read.
  """
  inputs = {}
  for spec in specs:
    batch_size = spec.batch_size * share // num_devices
    flat = flatten_input(ids[spec.name], spec, padding_id=padding_id_of(padding_id, spec.name),
                         batch_size=batch_size)
    samples, columns, width = _places(flat, spec, batch_size)
    mask = kept[spec.name]
    inputs[spec.name] = SparseIds(
        np.stack([samples[mask], columns[mask]], axis=1), flat.values[mask].astype(np.int64),
        (batch_size, width), None if flat.weights is None else flat.weights[mask])
  return inputs


def rows_tree(rows: Mapping[str, IdRows]) -> dict[str, dict[str, np.ndarray]]:
  """IdRows as a pytree of arrays (no weights entry when a feature has none)."""
  return {name: {k: v for k, v in r._asdict().items() if v is not None}
          for name, r in rows.items()}


def rows_shapes(specs: Sequence[FeatureSpec], widths: Mapping[str, Mapping[str, Any]],
                sharding) -> dict[str, dict[str, jax.ShapeDtypeStruct]]:
  """The global shapes of `rows_tree` for restoring, from the saved widths."""
  tree = {}
  for spec in specs:
    width, weighted = widths[spec.name]["width"], widths[spec.name]["weights"]
    batch = spec.batch_size
    entry = {"ids": jax.ShapeDtypeStruct((batch, width), np.int32, sharding=sharding)}
    if weighted:
      entry["weights"] = jax.ShapeDtypeStruct((batch, width), np.float32, sharding=sharding)
    tree[spec.name] = entry
  return tree


def local_inputs(tree: Mapping[str, Mapping[str, np.ndarray]], specs: Sequence[FeatureSpec],
                 devices: range, num_devices: int) -> dict[str, SparseIds]:
  """The raw ids of this process's samples from the global rows of every feature.

  Args:
    tree: feature -> {"ids"[, "weights"]} global host arrays.
    specs: the feature specs.
    devices: this process's table-axis positions in the new layout.
    num_devices: G of the new layout.

  Returns:
    feature -> SparseIds of this process's B * L / G samples ((sample,
    column) -> id, in row order), ready for preprocessing.
  """
  inputs = {}
  for spec in specs:
    entry = tree[spec.name]
    per_device = spec.batch_size // num_devices
    part = slice(devices.start * per_device, devices.stop * per_device)
    ids = np.asarray(entry["ids"])[part]
    present = ids >= 0
    weights = entry.get("weights")
    inputs[spec.name] = SparseIds(
        np.argwhere(present), ids[present].astype(np.int64), ids.shape,
        None if weights is None else np.asarray(weights)[part][present])
  return inputs
