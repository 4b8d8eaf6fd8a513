"""Training NNX models with embedding layers: dense optax step + fused sparse update.

The same step as the Linen helpers (see `_linen_train`), for NNX's mutable
modules: the dense parameters (an `nnx.Optimizer`'s `wrt`, by default
`nnx.Param`) get optax's update; every `NnxSparseEmbed` gets the fused sparse
update from its activation gradients. `EmbeddingVariable`s are never
differentiated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from sc_framework.flax import _grads, _state, _step
from sc_framework.flax._nnx import EmbeddingVariable, NnxSparseEmbed

NnxLossFn = Callable[..., Any]
"""`loss_fn(model, *data) -> loss` (or `(loss, aux dict)`)."""


def _embedding_layers(model: nnx.Module) -> dict[str, tuple[tuple, NnxSparseEmbed]]:
  return {
      _grads.layer_key(path): (tuple(path), module)
      for path, module in nnx.iter_modules(model)
      if isinstance(module, NnxSparseEmbed)
  }


def nnx_value_and_grad(
    loss_fn: NnxLossFn, *, wrt: nnx.filterlib.Filter = nnx.Param, has_aux: bool | None = None
) -> Callable[..., tuple[Any, nnx.State, _grads.EmbeddingGradients]]:
  """Builds `f(model, *data) -> (out, dL/dparams, embedding grads)`.

  Like `nnx.value_and_grad` with respect to the `wrt` variables, plus dL/da
  of every embedding layer the loss called (pass them to
  `apply_nnx_embedding_grads`). Updates of other state made by the loss
  (RNG counters, batch statistics) are written back to `model`.

  Args:
    loss_fn: `loss_fn(model, *data)`.
    wrt: the dense parameters' filter; `EmbeddingVariable`s are always
      excluded.
    has_aux: deprecated, not needed: the (loss, aux) pair is recognised by
      its type. If given, it is checked against what `loss_fn` returns.

  Returns:
    A function whose `out` is what `loss_fn` returned: the loss, or (loss,
    aux dict) (`sc_framework.flax.loss_and_aux`).
  """
  loss_fn = _step.declared_aux(loss_fn, has_aux, "nnx_value_and_grad")
  dense = nnx.All(wrt, nnx.Not(EmbeddingVariable))

  def value_and_grad(model: nnx.Module, *data):
    graphdef, params, embedding, rest = nnx.split(model, dense, EmbeddingVariable, ...)

    def fun(params):
      # Fresh variables (copy=True) so the loss may update state (batch statistics,
      # RNG counts) inside the traces of eval_shape and value_and_grad.
      copy = nnx.merge(graphdef, params, embedding, rest, copy=True)
      tap = _grads.current_tap()
      tap.name_layers({id(layer): path for path, layer in _embedding_layers(copy).values()})
      output = loss_fn(copy, *data)
      return output, nnx.split(copy, dense, EmbeddingVariable, ...)[3]

    loss, aux, new_rest, param_grads, embedding_grads = _grads.value_and_activation_grad(
        fun, params
    )
    nnx.update(model, new_rest)
    return (loss if aux is None else (loss, aux)), param_grads, embedding_grads

  return value_and_grad


def apply_nnx_embedding_grads(model: nnx.Module, grads: _grads.EmbeddingGradients) -> None:
  """The fused sparse update of every layer in `grads`, in place.

  For each layer: `apply_embedding_gradients(plan, (tables, slots), batch,
  dL/da, step)`, then step + 1. Use inside a jitted step that donates the
  model's state so tables update in place.
  """
  layers = _embedding_layers(model)
  for key, layer_grads in grads.items():
    if key not in layers:
      raise ValueError(
          f"no NnxSparseEmbed at {key!r} in the model; its embedding layers are at"
          f" {sorted(layers)}. Apply the gradients to the model they were computed with."
      )
    layer = layers[key][1]
    updated = _state.update_layer_state(
        layer_grads.plan,
        layer.embedding_state(),
        layer_grads.batch,
        layer_grads.activation_grads,
        backend=layer_grads.backend,
        owner=_grads.layer_owner("NnxSparseEmbed", key),
    )
    layer.set_embedding_state(updated)


def _check_optimizer_excludes_embeddings(model: nnx.Module, optimizer: nnx.Optimizer) -> None:
  """The dense optimizer must not hold the tables: optax state as large as they are,
  and gradients it never gets (the step's dense gradients leave them out)."""
  wrt = getattr(optimizer, "wrt", None)
  if wrt is None:
    return
  selected = jax.tree.leaves(nnx.state(model, nnx.All(wrt, EmbeddingVariable)))
  if selected:
    layers = sorted(_embedding_layers(model))
    raise ValueError(
        f"the nnx.Optimizer's wrt={wrt!r} selects the EmbeddingVariables (tables, slots,"
        f" step) of the embedding layers {layers}: optax would keep state as large as the"
        " tables, and the fused sparse update trains them instead. Build the optimizer on"
        " the dense parameters only: nnx.Optimizer(model, tx, wrt=nnx.Param)."
    )


class NnxTrainStep:
  """A jitted training step for an NNX model and its `nnx.Optimizer`.

  `step(model, optimizer, *data) -> out` updates `model` and `optimizer` in
  place: dense parameters (the optimizer's `wrt`) by optax, embedding tables
  by the fused sparse update. `out` is what the loss returned: the loss, or
  (loss, aux dict). The model's and optimizer's arrays are donated to the
  step.
  """

  def __init__(self, loss_fn: NnxLossFn, *, has_aux: bool | None = None):
    self._loss_fn = _step.declared_aux(loss_fn, has_aux, "make_nnx_train_step")
    self._jitted = jax.jit(self._pure_step, static_argnums=0, donate_argnums=1)

  def _pure_step(self, graphdef, state, *data):
    model, optimizer = nnx.merge(graphdef, state)
    _check_optimizer_excludes_embeddings(model, optimizer)  # while tracing: free per step
    value_and_grad = nnx_value_and_grad(self._loss_fn, wrt=optimizer.wrt)
    out, param_grads, embedding_grads = value_and_grad(model, *data)
    optimizer.update(model, param_grads)
    apply_nnx_embedding_grads(model, embedding_grads)
    return nnx.state((model, optimizer)), out

  def _split(self, model: nnx.Module, optimizer: nnx.Optimizer):
    graphdef, state = nnx.split((model, optimizer))
    layers = _embedding_layers(model)
    if layers:
      # Eagerly created dense parameters sit on one device; put them on the
      # mesh as the step's outputs will be, so the step compiles once.
      first = next(iter(layers.values()))[1]
      state = _state.replicate_unplaced(state, first.plan.replicated_sharding())
    return graphdef, state

  def __call__(self, model: nnx.Module, optimizer: nnx.Optimizer, *data) -> Any:
    new_state, out = self._jitted(*self._split(model, optimizer), *data)
    nnx.update((model, optimizer), new_state)
    return out

  def lower(self, model: nnx.Module, optimizer: nnx.Optimizer, *data) -> jax.stages.Lowered:
    """The lowered step for these arguments (for `.compile().memory_analysis()`)."""
    return self._jitted.lower(*self._split(model, optimizer), *data)


def make_nnx_train_step(loss_fn: NnxLossFn, *, has_aux: bool | None = None) -> NnxTrainStep:
  """A jitted `step(model, optimizer, *data) -> out` that trains in place.

  Args:
    loss_fn: `loss_fn(model, *data)`, returning the loss, or (loss, aux
      dict) (`sc_framework.flax.loss_and_aux`).
    has_aux: deprecated, not needed (see `nnx_value_and_grad`).

  Example:
    >>> optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    >>> step = make_nnx_train_step(lambda m, batch, y: ((m(batch) - y) ** 2).mean())
    >>> loss = step(model, optimizer, batch, labels)
  """
  return NnxTrainStep(loss_fn, has_aux=has_aux)
