"""Merging repeated (sample, row) pairs: sorted keys -> entries.

The keys of `_assemble` (key = b * V_s + global row) are grouped by sample b
but unordered inside a sample. A stable sort of each sample's few keys puts
equal keys next to each other; an entry is then one run of equal keys, i.e.
one distinct (sample, row) pair, with

  w_e = sum of the weights of its ids,   multiplicity m_e = number of its ids.

Samples are already in order, so the sort runs over cache-sized groups of
whole samples; the result equals one sort of all keys.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from sc_framework.preprocessing import _native
from sc_framework.preprocessing._scratch import scratch

_SORT_RUN = 1 << 16  # keys per sort call (whole samples)
_MAX_COPY_RUNS = 1024  # up to this many repeats, entries are compacted run by run


class Merged(NamedTuple):
  """Sorted ids and their merge into entries.

  Attributes:
    num_ids: n, the ids (keys) merged.
    weights: float32 [n] aligned with keys (scratch), or None (all ones).
    first: bool [n]: the id opens a new entry; None when every id does.
    repeats: int64 [d] ascending positions of the ids equal to the previous one.
    entry_rows: int64 [n_e = n - d] the global row of every entry, its key
      minus b * V_s (scratch).
    entry_samples: int32 [n_e] the sample b of every entry.
  """

  num_ids: int
  weights: np.ndarray | None
  first: np.ndarray | None
  repeats: np.ndarray
  entry_rows: np.ndarray
  entry_samples: np.ndarray

  def _runs(self) -> tuple[np.ndarray, np.ndarray]:
    """(entries holding repeated ids, ascending; index of each one's first repeat)."""
    # The j-th repeat (0-based), at position d_j, belongs to entry d_j - j - 1;
    # these targets do not decrease, so the repeats of one entry form a run.
    targets = self.repeats - np.arange(1, self.repeats.size + 1)
    starts = np.flatnonzero(np.concatenate([[True], targets[1:] != targets[:-1]]))
    return targets[starts], starts

  def entry_sum(self, values: np.ndarray | None, name: str | None = None) -> np.ndarray | None:
    """Per entry, the sum of `values` ([n] aligned with keys; None: all ones).

    Returns None when `values` is None and no key repeats (every sum is 1).
    `name`: a scratch buffer for the result (a fresh array if None).
    """
    if not self.repeats.size:
      return values
    entries, starts = self._runs()
    if values is None:
      size = self.entry_rows.size
      out = np.empty(size, np.float32) if name is None else scratch(name, size, np.float32)
      out.fill(1.0)
      out[entries] += np.diff(np.append(starts, self.repeats.size))
    else:
      out = values[self.first]
      out[entries] += np.add.reduceat(values[self.repeats], starts)
    return out

  def kept_ids(self, keep: np.ndarray) -> int:
    """The ids of the entries `keep` (bool [n_e]) selects: sum of their m_e."""
    kept = np.count_nonzero(keep)
    if self.repeats.size:  # the j-th repeat (0-based) belongs to entry d_j - j - 1
      kept += np.count_nonzero(keep[self.repeats - np.arange(1, self.repeats.size + 1)])
    return int(kept)

  def multiplicity(self) -> np.ndarray:
    """int64 [n_e]: the ids of every entry."""
    out = np.ones(self.entry_rows.size, np.int64)
    if self.repeats.size:
      entries, starts = self._runs()
      out[entries] += np.diff(np.append(starts, self.repeats.size))
    return out


def _sort_by_sample(keys: np.ndarray, sample_ends: np.ndarray, weights: np.ndarray | None) -> None:
  """Stably sorts keys grouped by sample (and their weights) in place."""
  n = keys.size
  cuts = sample_ends[np.searchsorted(sample_ends, np.arange(_SORT_RUN, n, _SORT_RUN))]
  start = 0
  for stop in [*cuts.tolist(), n]:
    if stop > start:
      run = keys[start:stop]
      if weights is None:
        run.sort(kind="stable")
      else:
        order = np.argsort(run, kind="stable")
        run[...] = run[order]
        weights[start:stop] = weights[start:stop][order]
      start = stop


def _drop_repeats(values: np.ndarray, first: np.ndarray, repeats: np.ndarray, name: str):
  """values[first]; with few repeats, copied run by run into a scratch array."""
  if repeats.size > _MAX_COPY_RUNS:
    return values[first]
  out = scratch(name, values.size - repeats.size, values.dtype)
  start = written = 0
  for stop in [*repeats.tolist(), values.size]:
    out[written : written + stop - start] = values[start:stop]
    written += stop - start
    start = stop + 1
  return out


def merge(keys: np.ndarray, weights: np.ndarray | None, samples: np.ndarray,
          lengths: np.ndarray, vocabulary_size: int) -> Merged:
  """Sorts the keys of every sample and merges equal keys into entries.

  Args:
    keys: int64 [n] b * V_s + global row, grouped by sample b (a scratch
      array, sorted in place; it may come back holding entry_rows).
    weights: float32 [n] aligned with keys (sorted in place), or None.
    samples: int32 [n] the sample of every key (sample b owns lengths[b] keys).
    lengths: [B_total] keys per sample.
    vocabulary_size: V_s.

  Returns:
    Merged.
  """
  n = keys.size
  kernels = _native.host_kernels()
  if kernels is not None:
    found = scratch("repeats", n, np.int64)
    entry_samples = scratch("entry_samples", n, np.int32)
    count = kernels.merge_samples(keys, weights, lengths.astype(np.int64, copy=False), found,
                                  vocabulary_size, entry_samples)
    repeats = found[:count].copy()
    return Merged(n, weights, _first(n, repeats), repeats, keys[:n - count],
                  entry_samples[:n - count])
  repeats = np.zeros(0, np.int64)
  if n > 1:
    step = scratch("compare", n - 1, np.bool_)
    if np.less(keys[1:], keys[:-1], out=step).any():
      _sort_by_sample(keys, np.cumsum(lengths), weights)
    repeats = np.flatnonzero(np.equal(keys[1:], keys[:-1], out=step))
    repeats += 1
  first = _first(n, repeats)
  entry_keys, entry_samples = keys, samples
  if first is not None:
    entry_keys = _drop_repeats(keys, first, repeats, "entry_keys")
    entry_samples = _drop_repeats(samples, first, repeats, "entry_samples")
  base = scratch("base", entry_samples.size, np.int64)
  np.multiply(entry_samples, vocabulary_size, out=base, dtype=np.int64)
  rows = np.subtract(entry_keys, base, out=entry_keys)
  return Merged(n, weights, first, repeats, rows, entry_samples)


def _first(n: int, repeats: np.ndarray) -> np.ndarray | None:
  """bool [n] (scratch): not a repeat; None without repeats."""
  if not repeats.size:
    return None
  first = scratch("first", n, np.bool_)
  first.fill(True)
  first[repeats] = False
  return first
