"""User arrays in the machine's byte order, the only one JAX holds.

Data read from files or buffers written on another machine (big-endian
HDF5 or binary files, `np.frombuffer(..., ">f4")`) arrives as numpy arrays of
a byte-swapped dtype, which `jax.device_put` and `jax.jit` refuse ("Dtype >f4
is not a valid JAX array type"). The same values in native byte order are
the same numbers, so where the library takes such arrays from the user it
converts them (one copy; native arrays and everything else pass through).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def native_dtype(dtype: Any) -> Any:
  """`dtype` in native byte order (`>f4` -> float32 on a little-endian machine).

  Anything that is not a byte-swapped numpy dtype is returned unchanged.
  """
  if isinstance(dtype, np.dtype) and not dtype.isnative:
    return dtype.newbyteorder("=")
  return dtype


def native_byte_order(value: Any) -> Any:
  """A numpy array of a byte-swapped dtype as the same values in native order; else `value`."""
  if isinstance(value, (np.ndarray, np.generic)) and not value.dtype.isnative:
    return value.astype(native_dtype(value.dtype))
  return value
