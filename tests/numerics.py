"""The suite's one tolerance policy for comparing float arrays.

Two kinds of comparison, and nothing in between:

* `assert_same_bits` -- the same program on the same layout: resume, round
  trips through a checkpoint, conversion between layouts, re-running a step.
  Every element must be bit for bit equal (NaNs included).

* `assert_close` -- two computations of the same value whose float32 sums run
  in another order: another device count or stacking, another backend, a
  numpy reference, another XLA thread split. A sum of n float32 terms in any
  order is within n * eps * sum(|x_i|) of the exact sum (the classic bound for
  recursive summation, Higham, "Accuracy and Stability of Numerical
  Algorithms", 4.2), so the tolerance is derived from float32's eps, the
  number of terms summed into each element, and the number of chained steps
  (training steps, layers) through which the differences propagate. The bound
  is taken relative to the largest magnitude of the expected array, so an
  element that is a near-cancelling sum does not need a per-element rtol.

Use `terms` for the longest sum behind an element (ids per sample times
samples for a gradient row, the dense layer's fan-in for an activation) and
`steps` for the number of dependent updates. Never loosen a comparison with a
hand-picked rtol: pass the terms and steps that the computation has.
"""

from __future__ import annotations

import numpy as np

FLOAT32_EPS = float(np.finfo(np.float32).eps)

# Headroom over the worst-case bound's leading term: second-order terms of
# the bound and the rounding of the final comparison.
_SAFETY = 4.0


def reduction_tolerance(terms: int, *, steps: int = 1, dtype=np.float32) -> float:
  """Relative tolerance for sums of `terms` terms reordered, chained `steps` times.

  tolerance = 4 * eps(dtype) * max(terms, 1) * max(steps, 1)
  """
  if terms < 0 or steps < 0:
    raise ValueError(f"terms and steps must be >= 0, got terms={terms}, steps={steps}.")
  eps = float(np.finfo(np.dtype(dtype)).eps) if np.issubdtype(np.dtype(dtype), np.floating) else FLOAT32_EPS
  return _SAFETY * eps * max(terms, 1) * max(steps, 1)


def _as_numpy(x) -> np.ndarray:
  return np.asarray(x)


def assert_same_bits(actual, expected, err_msg: str = "") -> None:
  """Asserts bit-for-bit equality (same shape, dtype and bytes; NaNs equal)."""
  actual, expected = _as_numpy(actual), _as_numpy(expected)
  assert actual.shape == expected.shape, f"{err_msg} shape {actual.shape} != {expected.shape}"
  assert actual.dtype == expected.dtype, f"{err_msg} dtype {actual.dtype} != {expected.dtype}"
  if actual.dtype.kind != "O" and actual.dtype.itemsize in (1, 2, 4, 8):
    # Bit patterns: NaNs and -0.0 compare exactly, also for bfloat16 (ml_dtypes).
    bits = np.dtype(f"u{actual.dtype.itemsize}")
    differ = np.ascontiguousarray(actual).view(bits) != np.ascontiguousarray(expected).view(bits)
    differ = differ.reshape(actual.shape)  # ascontiguousarray makes a scalar 1-D
  else:
    differ = actual != expected
  if np.any(differ):
    index = tuple(int(i) for i in np.argwhere(differ)[0])
    raise AssertionError(
        f"{err_msg} not bit-exact: {int(np.count_nonzero(differ))} of {actual.size} elements differ;"
        f" first at {index}: {actual[index]!r} (actual) vs {expected[index]!r} (expected)".strip()
    )


def assert_close(actual, expected, *, terms: int, steps: int = 1, err_msg: str = "") -> None:
  """Asserts equality up to a changed order of float32 sums.

  |actual - expected| <= reduction_tolerance(terms, steps) * max(|expected|)
  elementwise (plus the smallest normal float32, so exact zeros compare).
  """
  actual = np.asarray(actual, dtype=np.float64)
  expected = np.asarray(expected, dtype=np.float64)
  assert actual.shape == expected.shape, f"{err_msg} shape {actual.shape} != {expected.shape}"
  if actual.size == 0:
    return
  finite = np.isfinite(expected)
  if not np.array_equal(np.isfinite(actual), finite) or not np.array_equal(
      actual[~finite], expected[~finite], equal_nan=True):
    raise AssertionError(f"{err_msg} non-finite values differ".strip())
  scale = float(np.max(np.abs(expected[finite]))) if finite.any() else 0.0
  bound = reduction_tolerance(terms, steps=steps) * scale + float(np.finfo(np.float32).tiny)
  error = np.where(finite, np.abs(actual - expected), 0.0)
  worst = np.unravel_index(int(np.argmax(error)), error.shape)
  if error[worst] > bound:
    raise AssertionError(
        f"{err_msg} differ by more than a reordered float32 sum allows: at {tuple(map(int, worst))}"
        f" {actual[worst]!r} (actual) vs {expected[worst]!r} (expected), |diff| {error[worst]:.3g}"
        f" > bound {bound:.3g} (terms={terms}, steps={steps}, scale {scale:.3g})".strip()
    )
