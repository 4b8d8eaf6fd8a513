"""The core of one training step, shared by the Flax train steps and the Trainer.

For dense parameters θ, embedding activations a, tables T and a batch x, every
training step of the project (`make_linen_train_step`, `make_nnx_train_step`
and the Trainer's synchronous and pipelined steps) is built from these parts:

  L, aux = loss(θ, a)                                          (`loss_and_aux`)
  dL/dθ, dL/da = value_and_grad of L at (θ, a)                 (`value_and_grads`)
  θ <- optax update of θ with dL/dθ                            (`dense_update`)
  T <- apply_embedding_gradients(T, x, dL/da, step)            (`sparse_update`)

They differ only in where a comes from: the Trainer looks it up before the
dense model runs (possibly one step early, when pipelined), the Flax layers
inside the model (`sc_framework.flax._grads` adds zero offsets d to a and
differentiates with respect to d instead, dL/dd = dL/da).

Auxiliary outputs, one convention everywhere: a loss returns either the
scalar loss or the pair `(loss, aux)` with `aux` a dict of named values; the
pair is recognised by its type, so no flag has to agree with the function.
The Flax train steps return what the loss returned; the Trainer logs `aux` as
metrics beside "loss".
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from sc_framework.preprocessing import StackBatch
from sc_framework.primitives import (
    EmbeddingBackend,
    EmbeddingPlan,
    EmbeddingVariables,
    apply_embedding_gradients,
)

LOSS_CONVENTION = ("a floating-point scalar loss, or a pair (loss, aux) with aux a dict of named"
                   " values")


def _describe(value: Any) -> str:
  if isinstance(value, tuple):
    return f"a tuple of {len(value)} ({', '.join(_describe(v) for v in value)})"
  shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
  if shape is not None and dtype is not None:
    return f"an array of shape {tuple(shape)} {dtype}"
  return type(value).__name__


def loss_and_aux(output: Any, owner: str = "loss_fn") -> tuple[jax.Array, dict[str, Any] | None]:
  """Splits what a loss function returned into (loss, aux); aux is None for a bare loss.

  Args:
    output: the scalar loss, or (scalar loss, dict).
    owner: names the function in the error message.

  Raises:
    TypeError: `output` is neither form, naming what it is.
  """
  if isinstance(output, tuple):
    if len(output) == 2 and _is_scalar(output[0]) and isinstance(output[1], Mapping):
      return output[0], dict(output[1])
  elif _is_scalar(output):
    return output, None
  raise TypeError(
      f"{owner} returned {_describe(output)}; expected {LOSS_CONVENTION}. Reduce the loss to a"
      " scalar (e.g. .mean()) and return other values as (loss, {'name': value, ...})."
  )


def _is_scalar(value: Any) -> bool:
  """A real floating-point scalar: what a gradient can be taken of."""
  if isinstance(value, float):
    return True
  dtype = getattr(value, "dtype", None)
  return (getattr(value, "shape", None) == () and dtype is not None
          and jnp.issubdtype(dtype, jnp.floating))


def value_and_grads(
    fun: Callable[[Any, Any], Any], params: Any, inputs: Any, owner: str = "loss_fn"
) -> tuple[jax.Array, dict[str, Any] | None, Any, Any]:
  """The loss, its aux and dL/d(params), dL/d(inputs) of `fun(params, inputs)`.

  Args:
    fun: returns a loss following `loss_and_aux`'s convention.
    params: the dense parameters (any pytree).
    inputs: the embedding activations, or zero offsets added to them (any
      pytree of float arrays).
    owner: names the loss in error messages.

  Returns:
    (loss, aux or None, dL/dparams, dL/dinputs).
  """

  def split(params, inputs):
    return loss_and_aux(fun(params, inputs), owner)

  (loss, aux), (param_grads, input_grads) = jax.value_and_grad(
      split, argnums=(0, 1), has_aux=True
  )(params, inputs)
  return loss, aux, param_grads, input_grads


def dense_update(
    tx: optax.GradientTransformation, params: Any, opt_state: optax.OptState, grads: Any
) -> tuple[Any, optax.OptState]:
  """θ <- θ + tx.update(dL/dθ): the new dense parameters and optimizer state."""
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def sparse_update(
    plan: EmbeddingPlan,
    variables: EmbeddingVariables,
    batch: Mapping[str, StackBatch],
    activation_grads: Mapping[str, jax.Array],
    step: jax.Array | int,
    *,
    backend: str | EmbeddingBackend = "auto",
    apply: Mapping[str, jax.Array] | None = None,
) -> EmbeddingVariables:
  """The fused sparse update `apply_embedding_gradients(plan, T, x, dL/da, step)`.

  Args:
    plan, variables, batch, activation_grads, step, backend: as for
      `apply_embedding_gradients`.
    apply: optionally, per stack a bool array broadcastable to its
      `unique_rows` ([G, 1, 1]): where False, the stack's rows are marked
      unused (-1), so the update writes none of them. This skips an update
      without the table copy a `lax.cond` around an in-place update costs.
  """
  batch = dict(batch)
  for name, mask in (apply or {}).items():
    batch[name] = batch[name]._replace(unique_rows=jnp.where(mask, batch[name].unique_rows, -1))
  return apply_embedding_gradients(
      plan, variables, batch, dict(activation_grads), step, backend=backend
  )


def declared_aux(
    loss_fn: Callable[..., Any], has_aux: bool | None, owner: str
) -> Callable[..., Any]:
  """`loss_fn`, checked against a deprecated `has_aux=` declaration.

  The pair (loss, aux) is recognised by its type (`loss_and_aux`), so
  `has_aux` is no longer needed. When a caller still passes it, this warns
  once per builder call and checks on every trace that the loss returns what
  was declared.
  """
  if has_aux is None:
    return loss_fn
  warnings.warn(
      f"{owner}: has_aux= is deprecated and will be removed; a loss returning (loss, aux dict)"
      " is recognised by its type. Drop the argument.",
      DeprecationWarning,
      stacklevel=3,
  )

  def checked(*args, **kwargs):
    output = loss_fn(*args, **kwargs)
    _, aux = loss_and_aux(output, "loss_fn")
    if (aux is not None) != has_aux:
      raise TypeError(
          f"{owner} was built with has_aux={has_aux} but loss_fn returned {_describe(output)}."
          " Drop has_aux=: the step recognises a bare loss and a (loss, aux dict) pair."
      )
    return output

  return checked
