"""Which rows of each stack were updated since the last save, tracked on the host.

A sparse update writes exactly the rows a batch looks up: after preprocessing,
stack s of a batch requests local rows `unique_rows[g, n, u]` (in [0, R),
-1 for unused slots) of shard n, i.e. global rows n * R + unique_rows[g, n, u]
of the stacked [V_s, D'] array (`sc_framework.preprocessing._batch`). The
union of those rows over the batches applied since the last save is what a
delta checkpoint must write; tracking it costs host work only.

Representation: a sorted, duplicate-free int64 array per stack, plus the
batches' rows appended since it was last merged. Appending is O(batch);
merging (np.unique over the pending rows and the merged set) runs when the
pending rows outnumber the merged set (and at least 2^20 rows are pending),
so its cost is amortised O(log) per row, and memory is proportional to the
rows touched (8 bytes each), not to the table. A V_s-byte bitmap would cost
1 GB per 10^9-row stack whatever the share touched, and a scan of all V_s
entries at every save; the sorted set costs 8 bytes per touched row, and
delta saves are used exactly when that share is small.

The tracker is thread-safe, and a save takes its rows in one locked step
(`hand_over`): rows added meanwhile, from another thread too, stay for the
next save, and only the rows the save took are forgotten once it started. A
row must be recorded for every save after which its batch is applied: a
thread that prepares batches ahead records the rows of a batch before it is
applied, so after a save it records those of the batches still unapplied
again (as the Trainer does).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping

import jax
import numpy as np

from checkpoint._delta import sorted_unique
from sc_framework.preprocessing import StackBatch
from sc_framework.stacking import EmbeddingLayout

_MIN_PENDING = 1 << 20


class UpdatedRows:
  """The global rows of each stack updated since the last `clear`.

  Feed it every batch that is applied to the tables (`add_batch` with a
  preprocessed batch, or `add` with global stacked rows) and pass it to
  `CheckpointManager.save`, which takes its rows and forgets them once the
  save has started (`hand_over`, `forget_handed`).

  Example:
    tracker = checkpoint.UpdatedRows(layout)
    for batch in batches:
      sparse, _ = preprocess(batch, features, layout)
      tracker.add_batch(sparse)
      state = train_step(state, sparse)
    mngr.save(step, EmbeddingSave(...), updated_rows=tracker)

  Args:
    layout: the layout of the tables being trained.
  """

  def __init__(self, layout: EmbeddingLayout):
    self._layout = layout
    self._sizes = {stack.name: stack.vocabulary_size for stack in layout.stacks}
    self._merged: dict[str, np.ndarray] = {}
    self._pending: dict[str, list[np.ndarray]] = {}
    self._pending_count: dict[str, int] = {}
    # The rows a save took (`hand_over`) until it starts or fails, and when.
    self._handed: dict[str, np.ndarray] | None = None
    self._handed_at = 0.0
    self._lock = threading.Lock()
    self.clear()

  @property
  def layout(self) -> EmbeddingLayout:
    return self._layout

  @property
  def since(self) -> float:
    """When (time.monotonic()) the tracker was made or last cleared: it holds the rows since."""
    return self._since

  def clear(self) -> None:
    """Forgets every row."""
    with self._lock:
      self._reset()
      self._handed = None
      self._since = time.monotonic()

  def _reset(self) -> None:
    for name in self._sizes:
      self._merged[name] = np.zeros((0,), np.int64)
      self._pending[name] = []
      self._pending_count[name] = 0

  def hand_over(self) -> dict[str, np.ndarray]:
    """Takes every row for a save, in one locked step; see `forget_handed`, `take_back`.

    Rows added from now on are kept apart: they are the next save's. The
    rows taken are still reported by `rows` until the save settles them.
    """
    with self._lock:
      taken = self._all_rows()
      self._reset()
      self._handed, self._handed_at = taken, time.monotonic()
      return dict(taken)

  def handed(self) -> dict[str, np.ndarray]:
    """The rows the pending `hand_over` took (none if there is none)."""
    with self._lock:
      empty = np.zeros((0,), np.int64)
      return {name: (empty if self._handed is None else self._handed[name])
              for name in self._sizes}

  def forget_handed(self) -> None:
    """The save that took the rows started: forgets them, keeps those added since."""
    with self._lock:
      if self._handed is not None:
        self._handed = None
        self._since = self._handed_at

  def take_back(self) -> None:
    """The save that took the rows did not start or failed: they are tracked again."""
    with self._lock:
      if self._handed is not None:
        for name, rows in self._handed.items():
          self._pending[name].append(rows)
          self._pending_count[name] += rows.size
        self._handed = None

  def add_batch(self, batch: Mapping[str, StackBatch]) -> None:
    """Records the rows a preprocessed batch (stack name -> StackBatch) updates."""
    for name, rows in batch_rows(batch, self._layout).items():
      self._append(name, rows)

  def add(self, stack: str, rows: Iterable[int] | np.ndarray) -> None:
    """Records global rows (of the stacked [V_s, D'] array) of one stack."""
    self._check_stack(stack)
    rows = np.asarray(rows).reshape(-1)
    if rows.size and not np.issubdtype(rows.dtype, np.integer):
      raise TypeError(f"UpdatedRows.add: stack {stack!r} rows must be integers, got {rows.dtype}.")
    rows = rows.astype(np.int64, copy=False)
    if rows.size and (rows.min() < 0 or rows.max() >= self._sizes[stack]):
      raise ValueError(
          f"UpdatedRows.add: stack {stack!r} rows must be in [0, {self._sizes[stack]}), got"
          f" rows in [{rows.min()}, {rows.max()}]."
      )
    self._append(stack, rows)

  def rows(self) -> dict[str, np.ndarray]:
    """Stack name -> its updated global rows, sorted and distinct (int64)."""
    with self._lock:
      return self._all_rows()

  def count(self) -> int:
    """The number of distinct rows updated, over all stacks."""
    with self._lock:
      return sum(rows.size for rows in self._all_rows().values())

  def _all_rows(self) -> dict[str, np.ndarray]:
    """Merged, pending and handed rows, per stack (under the lock)."""
    for name in self._sizes:
      self._merge(name)
    if self._handed is None:
      return dict(self._merged)  # Merged arrays are replaced, never changed in place.
    return {name: sorted_unique(np.concatenate([self._merged[name], self._handed[name]]))
            for name in self._sizes}

  def share(self) -> float:
    """The updated rows as a share of all stacked rows (0 to 1)."""
    return self.count() / max(1, sum(self._sizes.values()))

  def _check_stack(self, name: str) -> None:
    _check_stack(name, self._sizes)

  def _append(self, name: str, rows: np.ndarray) -> None:
    if not rows.size:
      return
    with self._lock:
      self._pending[name].append(rows)
      self._pending_count[name] += rows.size
      if self._pending_count[name] >= max(_MIN_PENDING, self._merged[name].size):
        self._merge(name)

  def _merge(self, name: str) -> None:
    if not self._pending[name]:
      return
    self._merged[name] = sorted_unique(np.concatenate([self._merged[name], *self._pending[name]]))
    self._pending[name] = []
    self._pending_count[name] = 0


def batch_rows(batch: Mapping[str, StackBatch], layout: EmbeddingLayout) -> dict[str, np.ndarray]:
  """Stack name -> the global rows a preprocessed batch looks up (and so updates).

  Row u of shard n requested by a device is global row n * R + u; unused
  slots (-1) are skipped. Rows may repeat (several devices ask for one row).
  The batch may be on the host or on the devices (a placed `DeviceBatch`'s
  sparse part): then the rows of this process's devices are read.
  """
  sizes = {stack.name: stack.vocabulary_size for stack in layout.stacks}
  out = {}
  for name, stack_batch in batch.items():
    _check_stack(name, sizes)
    unique = _local_rows(stack_batch.unique_rows)
    if unique.ndim != 3:
      raise ValueError(
          f"UpdatedRows: stack {name!r} unique_rows has shape {unique.shape}; expected"
          " [G, N, U] (a StackBatch from sc_framework.preprocessing.preprocess)."
      )
    shards = np.arange(unique.shape[1], dtype=np.int64)[None, :, None]
    rows_per_shard = layout.stack(name).rows_per_shard
    out[name] = (shards * rows_per_shard + unique)[unique >= 0]
  return out


def _check_stack(name: str, sizes: Mapping[str, int]) -> None:
  if name not in sizes:
    raise KeyError(
        f"UpdatedRows: stack {name!r} is not in the layout; its stacks are {sorted(sizes)}."
    )


def _local_rows(array) -> np.ndarray:
  """A host array, or this process's distinct shards of a device array (by position)."""
  if not isinstance(array, jax.Array):
    return np.asarray(array)
  blocks = {}
  for shard in array.addressable_shards:
    start = tuple(index.indices(size)[0] for index, size in zip(shard.index, array.shape))
    blocks.setdefault(start, shard)
  return np.concatenate([np.asarray(blocks[key].data) for key in sorted(blocks)], axis=0)
