"""The options every sparse optimizer accepts, around its own rule.

For each touched row i with summed gradient g_i (the gradient of every
occurrence of the row in the batch, duplicates summed first) and rows w_i
before the update, `OptimizerSpec.apply` runs, in this order:

  1. gradient clipping by row norm (row_clipnorm = c > 0):
       g_i <- g_i * min(1, c / ||g_i||_2)
     the L2 norm of the whole summed row gradient (a row of zeros is kept;
     a norm beyond sqrt(float32 max), ~1.8e19, is computed without overflow);
  2. gradient clipping by value (clipvalue = (lo, hi), None = unbounded):
       g_i <- min(max(g_i, lo), hi)                      element-wise
  3. the optimizer's own rule on the clipped gradient:
       (w'_i, slots_i) <- rule(w_i, g_i, slots_i, step)
  4. decoupled weight decay (weight_decay_factor = f >= 0):
       w'_i <- w'_i - lambda * w_i,
       lambda = f * lr(step)  if multiply_weight_decay_factor_by_learning_rate
       lambda = f             otherwise
  5. weight clipping (clip_weight_min / clip_weight_max, None = unbounded):
       w'_i <- min(max(w'_i, clip_weight_min), clip_weight_max)   element-wise

Only the touched rows are updated (lazily): a row absent from a batch is
neither decayed nor clipped in that step. Steps 1 and 2 see the summed row
gradient, so a row looked up twice in a batch is clipped once, on its sum.
Step 5 applies to the table's logical columns only (the padding columns of a
stacked row keep their content). With every option at its default all five
steps reduce to the rule itself. No step filters a non-finite gradient
entry. A NaN makes the values it updates NaN (a check of the tables finds
it), in every built-in rule. An infinite entry leaves a NaN or infinite value
unless step 1 or step 5 bounds it (clipvalue clips it, clip_weight_* the
infinite weight it makes); under row_clipnorm (and row-wise Adagrad's
accumulator) the rest of its row gets a zero update.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

ClipValue = float | tuple[float | None, float | None] | None
"""A bound c > 0 (clip to [-c, c]), a pair (lo, hi) with None for no bound, or None."""


def _finite_number(owner: str, name: str, value) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
    raise ValueError(f"{owner}: {name} must be a finite number or None, got {value!r}.")
  return float(value)


def normalize_clipvalue(owner: str, clipvalue: ClipValue) -> tuple[float | None, float | None] | None:
  """Validates `clipvalue` and returns it as (lo, hi), or None for no clipping.

  A bound c means (-c, c) (TPUEmbedding's convention). The range must hold
  zero (lo <= 0 <= hi, not both 0), so a zero gradient -- a touched row with
  no signal, or a padding column -- stays zero.
  """
  if clipvalue is None:
    return None
  if isinstance(clipvalue, (tuple, list)):
    if len(clipvalue) != 2:
      raise ValueError(
          f"{owner}: clipvalue must be a bound c > 0 or a pair (min, max), got {clipvalue!r}."
      )
    lo, hi = (None if v is None else _finite_number(owner, "clipvalue", v) for v in clipvalue)
  else:
    bound = _finite_number(owner, "clipvalue", clipvalue)
    if bound <= 0:
      raise ValueError(f"{owner}: clipvalue must be > 0 (it clips to [-c, c]), got {clipvalue!r}.")
    lo, hi = -bound, bound
  if (lo is not None and lo > 0) or (hi is not None and hi < 0) or (lo == 0 and hi == 0):
    raise ValueError(
        f"{owner}: clipvalue (min, max) = {(lo, hi)!r} must contain 0 with min < max: a zero"
        " gradient must stay zero. Use e.g. (-1.0, 1.0), or (None, 1.0) for one side only."
    )
  if lo is None and hi is None:
    return None
  return (lo, hi)


def check_options(
    owner: str,
    *,
    row_clipnorm,
    weight_decay_factor,
    multiply_weight_decay_factor_by_learning_rate,
    clip_weight_min,
    clip_weight_max,
) -> None:
  """Raises ValueError/TypeError naming the option and value when one is invalid."""
  if row_clipnorm is not None and _finite_number(owner, "row_clipnorm", row_clipnorm) <= 0:
    raise ValueError(f"{owner}: row_clipnorm must be > 0 or None, got {row_clipnorm!r}.")
  if (isinstance(weight_decay_factor, bool) or not isinstance(weight_decay_factor, (int, float))
      or not math.isfinite(weight_decay_factor) or weight_decay_factor < 0):
    raise ValueError(
        f"{owner}: weight_decay_factor must be a finite number >= 0 (0 for no decay), got"
        f" {weight_decay_factor!r}."
    )
  if not isinstance(multiply_weight_decay_factor_by_learning_rate, bool):
    raise TypeError(
        f"{owner}: multiply_weight_decay_factor_by_learning_rate must be a bool, got"
        f" {multiply_weight_decay_factor_by_learning_rate!r}."
    )
  if multiply_weight_decay_factor_by_learning_rate and weight_decay_factor == 0:
    raise ValueError(
        f"{owner}: multiply_weight_decay_factor_by_learning_rate=True scales the weight decay"
        " by the learning rate, but weight_decay_factor is 0 (no decay), so it would do"
        " nothing. Set weight_decay_factor > 0 for decay, or drop the flag."
    )
  for name, value in (("clip_weight_min", clip_weight_min), ("clip_weight_max", clip_weight_max)):
    if value is not None:
      _finite_number(owner, name, value)
  if clip_weight_min is not None and clip_weight_max is not None and clip_weight_min > clip_weight_max:
    raise ValueError(
        f"{owner}: clip_weight_min ({clip_weight_min!r}) > clip_weight_max ({clip_weight_max!r});"
        " the weights cannot lie in an empty range. Swap them or drop one."
    )


def clip_gradients(
    grads: jax.Array,
    clipvalue: tuple[float | None, float | None] | None,
    row_clipnorm: float | None,
) -> jax.Array:
  """Steps 1 and 2 of the module docstring on a block of summed row gradients [K, D']."""
  if row_clipnorm is not None:
    grads = _clip_by_row_norm(grads.astype(jnp.float32), row_clipnorm).astype(grads.dtype)
  if clipvalue is not None:
    grads = jnp.clip(grads, *clipvalue)
  return grads


def _clip_by_row_norm(wide: jax.Array, clipnorm: float) -> jax.Array:
  """g * min(1, c / ||g||) per row: g * (c / max(||g||, c)), which never divides by zero.

  Where that form fails in float32 -- ||g||^2 overflows (a row of 2e19s), or
  c / ||g|| is below the smallest normal float32 (||g|| = 1e38 with c = 1),
  which the CPU flushes to zero -- a row of finite entries is scaled first by
  a power of two 2^-e, e the exponent of its largest entry (exact):
  g * min(1, c / ||g||) = m * (c / ||m||) with m = g * 2^-e and ||m|| in
  [0.5, sqrt(D')], when ||g|| > c. That runs only when some row needs it, and
  only those rows take it, so the others keep their bits. A row holding an inf
  or a NaN keeps the plain form (its non-finite entries stay non-finite).
  """
  squared = jnp.sum(wide * wide, axis=1, keepdims=True)
  scale = clipnorm / jnp.maximum(jnp.sqrt(squared), clipnorm)
  needs_rescale = jnp.isinf(squared) | (scale < jnp.finfo(jnp.float32).tiny)
  plain = wide * scale
  return jax.lax.cond(
      jnp.any(needs_rescale),
      lambda: jnp.where(needs_rescale, _clip_rescaled(wide, clipnorm, plain), plain),
      lambda: plain,
  )


def _clip_rescaled(wide: jax.Array, clipnorm: float, plain: jax.Array) -> jax.Array:
  """`_clip_by_row_norm` for rows whose ||g||^2 or c / ||g|| leaves float32's range;
  `plain` (g * c / max(||g||, c)) for rows holding an inf or a NaN."""
  largest = jnp.max(jnp.abs(wide), axis=1, keepdims=True)
  finite = jnp.isfinite(largest) & (largest > 0)
  _, exponent = jnp.frexp(jnp.where(finite, largest, 1.0))
  # 2^-e as two factors 2^-h, 2^-(e - h): each a normal float32 for any exponent of a
  # float32 (2^-e alone is subnormal for e > 126, and flushed to zero).
  half = exponent // 2
  mantissas = wide * jnp.ldexp(1.0, -half) * jnp.ldexp(1.0, half - exponent)
  mantissa_norm = jnp.sqrt(jnp.sum(mantissas * mantissas, axis=1, keepdims=True))
  # ||g|| = ||m|| * 2^e: inf where beyond float32, which compares as above c, rightly.
  norm = mantissa_norm * jnp.ldexp(1.0, half) * jnp.ldexp(1.0, exponent - half)
  clipped = mantissas * (clipnorm / jnp.where(finite, mantissa_norm, 1.0))
  return jnp.where(finite, jnp.where(norm > clipnorm, clipped, wide), plain)


def decay_and_clip_weights(
    new_rows: jax.Array,
    rows: jax.Array,
    learning_rate: jax.Array,
    row_dims: jax.Array,
    *,
    weight_decay_factor: float,
    multiply_weight_decay_factor_by_learning_rate: bool,
    clip_weight_min: float | None,
    clip_weight_max: float | None,
) -> jax.Array:
  """Steps 4 and 5 of the module docstring; `rows` are the rows before the update."""
  if weight_decay_factor:
    decay = jnp.float32(weight_decay_factor)
    if multiply_weight_decay_factor_by_learning_rate:
      decay = decay * learning_rate
    new_rows = new_rows - decay * rows.astype(jnp.float32)
  if clip_weight_min is not None or clip_weight_max is not None:
    logical = jnp.arange(new_rows.shape[1])[None, :] < row_dims[:, None]
    new_rows = jnp.where(logical, jnp.clip(new_rows, clip_weight_min, clip_weight_max), new_rows)
  return new_rows
