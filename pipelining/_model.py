"""Adapters that give Linen and NNX dense models one functional interface.

The Trainer needs `apply(params, activations, dense_features) -> predictions`
with the trainable dense parameters as a pytree it can differentiate and hand
to optax. Linen modules are already functional; NNX modules are split into
(graph definition, trainable `nnx.Param` state, other state) once and merged
inside the step.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import flax.errors
import jax
from flax import linen as nn
from flax import nnx

from sc_framework.flax import NnxSparseEmbed


@dataclasses.dataclass(frozen=True)
class DenseModel:
  """A dense model in functional form.

  Attributes:
    apply: (params, activations, dense_features) -> predictions.
    params: the initial trainable parameters.
    kind: "linen" or "nnx".
  """

  apply: Callable[[Any, dict[str, jax.Array], Any], jax.Array]
  params: Any
  kind: str


@contextlib.contextmanager
def _naming_a_missing_dense(dense: Any):
  """Notes on an error of the model's first call that the batches hold no "dense" entry.

  The model is then called with dense=None; a model that reads it fails
  somewhere inside (e.g. concatenating None). The error itself is kept: it
  may have another cause.
  """
  try:
    yield
  except Exception as error:
    if dense is None and not isinstance(error, flax.errors.TraceContextError):
      error.add_note(
          'The batches have no "dense" entry, so the model was called with dense=None: give'
          ' every batch its dense features under "dense" if the model reads them.'
      )
    raise


def _check_nnx_keeps_its_state(apply_nnx, params, rest, activations, dense) -> None:
  """Raises if calling the NNX model changes state besides its nnx.Param variables.

  The Trainer differentiates and jits the model as a function of its
  parameters: BatchNorm's batch statistics or Dropout's random stream,
  changed inside that trace, fail deep in Flax (TraceContextError). One
  abstract call tells, before any training.
  """
  try:
    with _naming_a_missing_dense(dense):
      jax.eval_shape(apply_nnx, params, activations, dense)
  except flax.errors.TraceContextError as error:
    state = [f"{'/'.join(map(str, path))} ({type(value).__name__})"
             for path, value in nnx.to_flat_state(rest)]
    raise ValueError(
        "the NNX model changes state besides its nnx.Param variables when called (its other"
        f" state: {state}); the Trainer trains stateless dense models, applied without"
        " mutable state or random streams. Use LayerNorm instead of BatchNorm, and leave out"
        " Dropout (or construct it with deterministic=True)."
    ) from error


def as_dense_model(model, key: jax.Array, activations: dict[str, jax.Array], dense: Any) -> DenseModel:
  """Wraps a Linen module (initialised here with `key`) or an NNX module.

  Args:
    model: a `flax.linen.Module` called as model(activations, dense), or a
      constructed `flax.nnx.Module` with the same call signature.
    key: initialises a Linen module's parameters (NNX modules arrive
      initialised).
    activations, dense: example inputs (shapes only matter).

  Raises:
    TypeError: for anything else, naming the type received.
    ValueError: an NNX model that holds an `NnxSparseEmbed` (a Linen model
      with a `LinenSparseEmbed` fails in that layer with a TypeError).
  """
  if isinstance(model, nn.Module):
    with _naming_a_missing_dense(dense):
      variables = model.init(key, activations, dense)
    extra = {k: v for k, v in variables.items() if k != "params"}
    if extra:
      raise ValueError(
          f"the Linen model has variable collections {sorted(extra)} besides 'params'; the"
          " Trainer trains stateless dense models. Remove mutable collections (e.g. use"
          " LayerNorm instead of BatchNorm)."
      )

    def apply_linen(params, acts, dense_features):
      return model.apply({"params": params}, acts, dense_features)

    # A model without parameters (e.g. a dot product of two towers) trains its tables alone.
    return DenseModel(apply_linen, variables.get("params", {}), "linen")
  if isinstance(model, nnx.Module):
    layers = ["/".join(map(str, path)) or "the model" for path, module in nnx.iter_modules(model)
              if isinstance(module, NnxSparseEmbed)]
    if layers:
      raise ValueError(
          f"the NNX model holds embedding layers (NnxSparseEmbed at {layers}); the Trainer owns"
          " the tables itself (from feature_specs) and calls its model as model(activations,"
          " dense). Pass the dense part of the model, or train this one with"
          " sc_framework.flax.make_nnx_train_step."
      )
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def apply_nnx(params, acts, dense_features):
      return nnx.merge(graphdef, params, rest)(acts, dense_features)

    _check_nnx_keeps_its_state(apply_nnx, params, rest, activations, dense)
    return DenseModel(apply_nnx, params, "nnx")
  raise TypeError(
      f"model must be a flax.linen.Module or a flax.nnx.Module, got {type(model).__name__}."
  )
