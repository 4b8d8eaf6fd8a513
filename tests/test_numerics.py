"""The suite's tolerance policy itself: what each helper accepts and refuses."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from tests.numerics import FLOAT32_EPS, assert_close, assert_same_bits, reduction_tolerance


def test_same_bits_refuses_any_other_bit_pattern():
  x = np.array([1.0, np.nan, 0.0], np.float32)
  assert_same_bits(x, x.copy())  # NaN equals itself bit for bit
  with pytest.raises(AssertionError, match="1 of 3 elements differ; first at \\(2,\\)"):
    assert_same_bits(x, np.array([1.0, np.nan, -0.0], np.float32))
  with pytest.raises(AssertionError, match="dtype"):
    assert_same_bits(x, x.astype(np.float64))
  with pytest.raises(AssertionError, match="not bit-exact"):
    assert_same_bits(x, np.nextafter(x, np.float32(2)))
  b = np.array([0.5, 1.5], ml_dtypes.bfloat16)
  assert_same_bits(b, b.copy())
  with pytest.raises(AssertionError):
    assert_same_bits(b, np.array([0.5, 1.0], ml_dtypes.bfloat16))


def test_same_bits_names_a_differing_scalar():
  with pytest.raises(AssertionError, match=r"1 of 1 elements differ; first at \(\): "):
    assert_same_bits(np.float32(1.0), np.float32(2.0))
  with pytest.raises(AssertionError, match="1 of 1 elements differ"):
    assert_same_bits(0.5, 0.25)


def test_close_follows_the_reordered_sum_bound():
  rng = np.random.default_rng(0)
  terms = rng.normal(size=(64, 1000)).astype(np.float32)
  forward = terms.sum(axis=0, dtype=np.float32)
  backward = terms[::-1].cumsum(axis=0, dtype=np.float32)[-1]  # another order
  assert_close(forward, backward, terms=64)
  scale = np.abs(forward).max()
  assert reduction_tolerance(64, steps=3) == 4 * FLOAT32_EPS * 64 * 3
  off = forward.copy()
  off[7] += 2 * reduction_tolerance(64) * scale
  with pytest.raises(AssertionError, match=r"at \(7,\).*terms=64, steps=1"):
    assert_close(off, forward, terms=64)
  assert_close(off, forward, terms=64, steps=3)  # three chained steps allow it
  with pytest.raises(AssertionError, match="non-finite"):
    assert_close(np.array([np.inf]), np.array([1.0]), terms=1)
  with pytest.raises(ValueError, match="terms and steps must be >= 0"):
    reduction_tolerance(-1)
