"""Per-thread scratch arrays reused from one preprocessing call to the next.

A batch of ~1M ids needs tens of MB of temporaries. Fresh numpy arrays of that
size come from the operating system page by page on every call, and those page
faults can cost as much as the arithmetic. The temporaries of `_assemble`,
`_locate` and `_dropping` therefore live in buffers kept per thread (so
concurrent preprocessing threads never share one) and grown when a batch needs
more.

Rules: a scratch view is valid until the same name is requested again in the
same thread, and is never returned to the caller of `preprocess` (outputs are
always fresh arrays).
"""

from __future__ import annotations

import threading

import numpy as np

_SLACK = 1.25  # grow buffers a little beyond the request, as batch sizes vary


class _Buffers(threading.local):

  def __init__(self):
    self.arrays: dict[str, np.ndarray] = {}


_LOCAL = _Buffers()


def scratch(name: str, size: int, dtype) -> np.ndarray:
  """An uninitialised [size] array, this thread's buffer `name`."""
  dtype = np.dtype(dtype)
  array = _LOCAL.arrays.get(name)
  if array is None or array.dtype != dtype or array.size < size:
    array = np.empty(int(size * _SLACK) + 64, dtype)
    _LOCAL.arrays[name] = array
  return array[:size]


def clear_mask(size: int) -> np.ndarray:
  """An all-False bool [size] array; the caller must leave it all False again."""
  array = _LOCAL.arrays.get("_mask")
  if array is None or array.size < size:
    array = np.zeros(int(size * _SLACK) + 64, np.bool_)
    _LOCAL.arrays["_mask"] = array
  return array[:size]


def arange32(size: int) -> np.ndarray:
  """The int32 array [0, 1, ..., size - 1] (read-only use)."""
  array = _LOCAL.arrays.get("_arange")
  if array is None or array.size < size:
    array = np.arange(int(size * _SLACK) + 64, dtype=np.int32)
    _LOCAL.arrays["_arange"] = array
  return array[:size]


def release() -> None:
  """Frees the calling thread's scratch buffers (rebuilt on its next call).

  Exported as `sc_framework.preprocessing.release_scratch_buffers`: each
  thread that preprocessed keeps its buffers (tens of MB for large batches)
  for reuse; call this from that thread once it is done preprocessing.
  """
  _LOCAL.arrays.clear()
