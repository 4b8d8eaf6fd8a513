"""Training Linen models with embedding layers: dense optax step + fused sparse update.

One step, for dense parameters θ, tables T and a batch x:

  a = lookup(T, x)                     (every LinenSparseEmbed in the model)
  L, (dL/dθ, dL/da) = value_and_grad of the loss at (θ, a)
  θ <- optax update of θ with dL/dθ
  T <- apply_embedding_gradients(T, x, dL/da, step); step <- step + 1

dL/dT is never formed: the tables are constants of the differentiated
function (see `sc_framework.flax._grads`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import numpy as np
import optax

from sc_framework.flax import _grads, _state, _step
from sc_framework.flax._linen import EMBEDDING_COLLECTION

LinenLossFn = Callable[..., Any]
"""`loss_fn(apply, *data) -> loss` (or `(loss, aux dict)`), where
`apply(*args, **kwargs)` runs `model.apply` with the step's variables."""


class LinenTrainState(NamedTuple):
  """The state of a Linen model with embedding layers, a pytree.

  Attributes:
    params: the "params" collection, the dense parameters (optax's only input).
    opt_state: the optax state of `params`.
    embedding: the "embedding" collection: per embedding layer its tables,
      slots and sparse step, in the sharded stacked layout.
  """

  params: Any
  opt_state: optax.OptState
  embedding: Any


def init_linen_train_state(
    model: nn.Module, tx: optax.GradientTransformation, rngs: Any, *args, **kwargs
) -> LinenTrainState:
  """Initialises the model with `model.init(rngs, *args, **kwargs)` and `tx`, jitted.

  Embedding tables are created by their layers directly in the sharded
  layout (each device computes its own rows); `tx` is initialised on the
  dense parameters only. Array arguments are traced; any other argument
  (e.g. `train=False`) is passed as a static value.

  Raises:
    ValueError: the model creates collections other than "params" and
      "embedding" (e.g. "batch_stats"), which this helper does not carry.
  """
  leaves, treedef = jax.tree.flatten((args, kwargs))
  traced = tuple(isinstance(leaf, (jax.Array, np.ndarray, np.generic)) for leaf in leaves)
  static = tuple(None if t else leaf for leaf, t in zip(leaves, traced))
  arrays = [leaf for leaf, t in zip(leaves, traced) if t]
  try:
    hash((model, tx, treedef, static))
  except TypeError:  # e.g. a list attribute: compile for this call only
    return jax.jit(functools.partial(_init, model, tx, treedef, static))(rngs, arrays)
  return _cached_init(model, tx, treedef, static, rngs, arrays)


def _init(model, tx, treedef, static, rngs, arrays) -> LinenTrainState:
  """The body of `init_linen_train_state`, run under jit."""
  it = iter(arrays)
  args, kwargs = jax.tree.unflatten(treedef, [next(it) if x is None else x for x in static])
  variables = dict(model.init(rngs, *args, **kwargs))
  params = variables.pop("params", {})
  embedding = variables.pop(EMBEDDING_COLLECTION, {})
  if variables:
    raise ValueError(
        f"the model has variable collections {sorted(variables)} besides 'params' and"
        f" {EMBEDDING_COLLECTION!r}; the Linen train-step helpers carry only those two. Build"
        " your own step from `linen_value_and_grad` (pass those collections as its"
        " collections= and return their updates from the loss, e.g. apply(...,"
        " mutable=['batch_stats'])) and `apply_linen_embedding_grads`."
    )
  return LinenTrainState(params, tx.init(params), embedding)


# Compiled once per (model, tx, static arguments): re-initialising is cheap.
_cached_init = jax.jit(_init, static_argnums=(0, 1, 2, 3))


def linen_value_and_grad(
    model: nn.Module, loss_fn: LinenLossFn, *, has_aux: bool | None = None
) -> Callable[..., tuple[Any, Any, _grads.EmbeddingGradients]]:
  """Builds `f(params, embedding, *data, collections=None) -> (out, dL/dparams, embedding grads)`.

  `out` is what `loss_fn` returned: the loss, or (loss, aux dict)
  (`sc_framework.flax.loss_and_aux`). The embedding gradients hold dL/da of
  every embedding layer the loss called (with its batch); pass them to
  `apply_linen_embedding_grads`. `collections` are the model's other
  variable collections (e.g. {"batch_stats": ...}), given to `model.apply`
  beside "params" and "embedding" and not differentiated; a loss that
  updates them returns the updates in its aux.

  Args:
    model: the Linen model.
    loss_fn: `loss_fn(apply, *data)`; `apply(*args, **kwargs)` is
      `model.apply({"params": params, "embedding": embedding,
      **collections}, *args, **kwargs)`.
    has_aux: deprecated, not needed: the (loss, aux) pair is recognised by
      its type. If given, it is checked against what `loss_fn` returns.

  Example:
    >>> def loss_fn(apply, batch, labels):
    ...   logits, updates = apply(batch, train=True, mutable=["batch_stats"])
    ...   return optax.l2_loss(logits, labels).mean(), dict(updates)
    >>> value_and_grad = linen_value_and_grad(model, loss_fn)
    >>> (loss, updates), grads, embedding_grads = value_and_grad(
    ...     params, embedding, batch, labels, collections={"batch_stats": batch_stats})
  """
  loss_fn = _step.declared_aux(loss_fn, has_aux, "linen_value_and_grad")

  def value_and_grad(params, embedding, *data, collections: Mapping[str, Any] | None = None):
    others = dict(collections or {})
    taken = sorted({"params", EMBEDDING_COLLECTION} & set(others))
    if taken:
      raise ValueError(
          f"linen_value_and_grad: collections= holds {taken}, which are given as the params"
          f" and embedding arguments; pass only the model's other collections"
          f" ({sorted(others)} given)."
      )

    def fun(params):
      def apply(*args, **kwargs):
        variables = {**others, "params": params, EMBEDDING_COLLECTION: embedding}
        return model.apply(variables, *args, **kwargs)

      return loss_fn(apply, *data), None

    loss, aux, _, param_grads, embedding_grads = _grads.value_and_activation_grad(fun, params)
    return (loss if aux is None else (loss, aux)), param_grads, embedding_grads

  return value_and_grad


def _at(tree: Mapping[str, Any], path: tuple, owner: str) -> Any:
  node = tree
  for part in path:
    if not isinstance(node, Mapping) or part not in node:
      raise ValueError(
          f"embedding layer {owner!r}: the {EMBEDDING_COLLECTION!r} collection has no entry at"
          f" {'/'.join(map(str, path))!r}. Pass the collection the model was initialised with."
      )
    node = node[part]
  return node


def _replace(tree: Mapping[str, Any], path: tuple, value: Any) -> dict[str, Any]:
  out = dict(tree)
  if not path:
    return value
  out[path[0]] = _replace(tree[path[0]], path[1:], value)
  return out


def apply_linen_embedding_grads(embedding: Any, grads: _grads.EmbeddingGradients) -> dict[str, Any]:
  """The fused sparse update of every layer in `grads`; returns the new collection.

  For each layer: `apply_embedding_gradients(plan, (tables, slots), batch,
  dL/da, step)`, then step + 1. Layers absent from `grads` are unchanged.
  Call under `jax.jit` with the collection donated so tables update in place.
  """
  new = embedding
  for key, layer_grads in grads.items():
    state = _at(embedding, layer_grads.path, key)
    updated = _state.update_layer_state(
        layer_grads.plan,
        state,
        layer_grads.batch,
        layer_grads.activation_grads,
        backend=layer_grads.backend,
        owner=_grads.layer_owner("LinenSparseEmbed", key),
    )
    new = _replace(new, layer_grads.path, updated)
  return dict(new)


def make_linen_train_step(
    model: nn.Module,
    tx: optax.GradientTransformation,
    loss_fn: LinenLossFn,
    *,
    has_aux: bool | None = None,
) -> Callable[..., tuple[LinenTrainState, Any]]:
  """A jitted `step(state, *data) -> (new_state, out)`; `state` is donated.

  The dense parameters get `tx`'s update from dL/dparams; every embedding
  layer's tables get the fused sparse update from its activation gradients
  (`sc_framework.flax._step`, the same parts as the Trainer's steps). `out`
  is what `loss_fn` returned: the loss, or (loss, aux dict).

  Args:
    model: the Linen model.
    tx: the dense optimizer.
    loss_fn: `loss_fn(apply, *data)`, see `linen_value_and_grad`.
    has_aux: deprecated, not needed (see `linen_value_and_grad`).

  Example:
    >>> def loss_fn(apply, batch, labels):
    ...   return optax.l2_loss(apply(batch)[:, 0], labels).mean()
    >>> state = init_linen_train_state(model, tx, jax.random.key(0), batch)
    >>> step = make_linen_train_step(model, tx, loss_fn)
    >>> state, loss = step(state, batch, labels)
  """
  value_and_grad = linen_value_and_grad(
      model, _step.declared_aux(loss_fn, has_aux, "make_linen_train_step")
  )

  def step(state: LinenTrainState, *data):
    out, param_grads, embedding_grads = value_and_grad(state.params, state.embedding, *data)
    params, opt_state = _step.dense_update(tx, state.params, state.opt_state, param_grads)
    embedding = apply_linen_embedding_grads(state.embedding, embedding_grads)
    return LinenTrainState(params, opt_state, embedding), out

  return jax.jit(step, donate_argnums=0)
