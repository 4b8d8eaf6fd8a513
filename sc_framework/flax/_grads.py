"""Activation gradients of embedding layers, and the fused update they drive.

A training step must never differentiate the loss with respect to a table:
that gradient is as large as the table although almost all of it is zero.
Instead, for every embedding layer call with activations a_f = lookup(T, x)_f,
the step adds a zero "delta" input d_f and differentiates with respect to it:

  a'_f = a_f + d_f,   dL/dd_f |_{d=0} = dL/da_f   (shape [B_f, D_f] or [B_f, L_f, D_f]),

while the tables enter the loss as constants. The fused sparse update
(`sc_framework.primitives.apply_embedding_gradients`) then turns dL/da_f into
row gradients and optimizer updates of the touched rows only.

The "tap" below is what connects the layers to the step: while a step traces
the loss, each embedding layer reports its call (plan, batch) to the active
tap and adds the tap's delta to its activations. Outside a step there is no
tap and the layers are plain lookups.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jax_extend_core

from sc_framework.flax import _step
from sc_framework.preprocessing import StackBatch
from sc_framework.primitives import EmbeddingPlan
from sc_framework.primitives._checks import check_batch as check_plan_batch


@dataclasses.dataclass(frozen=True)
class LayerGradients:
  """What the fused update of one embedding layer needs from one step.

  A pytree: `batch` and `activation_grads` are its leaves; `path`, `plan` and
  `backend` are static.

  Attributes:
    batch: stack name -> StackBatch the layer looked up.
    activation_grads: feature name -> gradient dL/da_f, shaped like a_f.
    path: where the layer sits in the model (module names from the root).
    plan: the layer's embedding plan.
    backend: the primitives backend the layer uses.
  """

  batch: dict[str, StackBatch]
  activation_grads: dict[str, jax.Array]
  path: tuple[Hashable, ...]
  plan: EmbeddingPlan
  backend: str


jax.tree_util.register_dataclass(
    LayerGradients,
    data_fields=["batch", "activation_grads"],
    meta_fields=["path", "plan", "backend"],
)

EmbeddingGradients = dict[str, LayerGradients]
"""Layer key ("/"-joined path) -> that layer's gradients for one step."""


def layer_key(path: tuple[Hashable, ...]) -> str:
  """The key of a layer in `EmbeddingGradients`: its path joined by "/"."""
  return "/".join(str(part) for part in path)


def layer_owner(kind: str, key: str) -> str:
  """How errors name a layer: its class and key, or that it is the top-level module
  (whose key is empty)."""
  return f"{kind} {key!r}" if key else f"{kind} (the top-level module)"


def check_batch(plan: EmbeddingPlan, batch: Mapping[str, Any], owner: str) -> None:
  """Raises a clear error unless `batch` has one StackBatch per stack of `plan`,
  shaped for its layout (`sc_framework.primitives._checks.check_batch`)."""
  check_plan_batch(
      plan, batch, f"{owner}: batch",
      type_hint=(" (The Trainer looks the tables up itself and calls its model as"
                 " model(activations, dense): give it the dense part of a model, without"
                 " embedding layers.)"),
  )


# --- the tap -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Site:
  path: tuple[Hashable, ...]
  plan: EmbeddingPlan
  backend: str
  shapes: dict[str, jax.ShapeDtypeStruct]


def _batch_made_in_a_transform(tap: _Tap, batch: dict[str, StackBatch]) -> bool:
  """Whether a layer runs inside a transform of the loss on a batch of that
  transform's own tracers (passed into it as an argument). A batch the
  transform closes over keeps tracers of an enclosing trace, which the step
  can use. Reads JAX's private tracer state (a tracer's `_trace`); where that
  is absent it answers False, and JAX's own error stands."""
  current = _trace_state()
  if tap.trace is None or current == tap.trace:
    return False
  current_ref = getattr(current, "_trace_ref", None)
  return current_ref is not None and any(
      isinstance(leaf, jax.core.Tracer)
      and getattr(getattr(leaf, "_trace", None), "_weakref", None) == current_ref
      for leaf in jax.tree.leaves(batch))


def _trace_state() -> object | None:
  """An opaque token of JAX's current trace (equal tokens: the same trace), or
  None where this JAX version does not expose one."""
  get = (getattr(jax_extend_core, "get_opaque_trace_state", None)
         or getattr(jax.core, "get_opaque_trace_state", None))  # JAX <= 0.9.2
  return None if get is None else get(convention="flax")


class _Tap:
  """Collects the embedding layer calls of one trace of a loss."""

  def __init__(self, deltas: dict[str, dict[str, jax.Array]] | None):
    self.deltas = deltas  # None while discovering the layers
    self.trace = _trace_state()  # the trace of the loss
    self.sites: dict[str, _Site] = {}
    self.batches: dict[str, dict[str, StackBatch]] = {}
    self.paths_by_id: dict[int, tuple[Hashable, ...]] = {}

  def name_layers(self, paths_by_object: Mapping[int, tuple[Hashable, ...]]) -> None:
    """Registers id(layer) -> path for layers that do not know their path (NNX)."""
    self.paths_by_id.update(paths_by_object)


_CURRENT: contextvars.ContextVar[_Tap | None] = contextvars.ContextVar("sc_embedding_tap", default=None)


@contextlib.contextmanager
def _tapping(deltas) -> Iterator[_Tap]:
  tap = _Tap(deltas)
  token = _CURRENT.set(tap)
  try:
    yield tap
  finally:
    _CURRENT.reset(token)


def current_tap() -> _Tap | None:
  """The tap of the step being traced, or None outside a training step."""
  return _CURRENT.get()


def tap_activations(
    layer: tuple[Hashable, ...] | object,
    plan: EmbeddingPlan,
    backend: str,
    batch: dict[str, StackBatch],
    activations: dict[str, jax.Array],
) -> dict[str, jax.Array]:
  """Reports one layer call to the active tap and returns a_f + d_f.

  Args:
    layer: the layer's path (a tuple), or the layer object itself when the
      step registered its path with `_Tap.name_layers`.
    plan, backend: the layer's plan and backend.
    batch: the batch the layer looked up.
    activations: feature name -> [B_f, D_f] looked-up activations.

  Returns:
    The activations, plus the tap's zero deltas inside a training step.
  """
  tap = _CURRENT.get()
  if tap is None:
    return activations
  path = layer if isinstance(layer, tuple) else tap.paths_by_id.get(id(layer))
  if _batch_made_in_a_transform(tap, batch):
    # The step would read that transform's tracers outside it, and JAX's error
    # (when the step runs) would name neither the layer nor why.
    described = (repr(layer_key(path)) if path is not None else
                 f"{type(layer).__name__} (a copy an NNX transform made)")
    raise ValueError(
        f"embedding layer {described} was called inside a transform of the loss (nn.remat,"
        " nnx.remat, jax.checkpoint, nn.scan, nn.vmap, nn.jit, ...) on a batch passed into"
        " it, whose tracers the sparse update cannot read outside it. Call embedding layers in"
        " the loss itself and apply such transforms to the dense part of the model only (e.g."
        " nn.remat(DenseBlock)), passing it the activations."
    )
  if path is None:
    raise ValueError(
        "an embedding layer that is not part of the model being trained was called inside the"
        " training step's loss. Make every embedding layer an attribute of the model passed to"
        " the step."
    )
  key = layer_key(path)
  if key in tap.sites:
    raise ValueError(
        f"embedding layer {key!r} was called twice in one training step. Call each embedding"
        " layer once per step; to read a table twice, declare two FeatureSpecs on that table."
    )
  shapes = {name: jax.ShapeDtypeStruct(a.shape, a.dtype) for name, a in activations.items()}
  tap.sites[key] = _Site(path, plan, backend, shapes)
  tap.batches[key] = batch
  if tap.deltas is None:
    return activations
  if key not in tap.deltas:
    raise ValueError(
        f"embedding layer {key!r} was not called while the step traced the loss the first"
        " time. The loss must call the same embedding layers on every trace."
    )
  return {name: a + tap.deltas[key][name] for name, a in activations.items()}


# --- gradients -------------------------------------------------------------------


def _zero_deltas(sites: Mapping[str, _Site]) -> dict[str, dict[str, jax.Array]]:
  """Zeros shaped like each layer's activations, sharded over the batch."""
  deltas = {}
  for key, site in sites.items():
    sharding = site.plan.row_sharding()
    deltas[key] = {
        name: jax.lax.with_sharding_constraint(jnp.zeros(shape.shape, shape.dtype), sharding)
        for name, shape in site.shapes.items()
    }
  return deltas


def value_and_activation_grad(
    fun: Callable[[Any], tuple[Any, Any]], params: Any, owner: str = "loss_fn"
) -> tuple[jax.Array, dict[str, Any] | None, Any, Any, EmbeddingGradients]:
  r"""The loss, its aux, dL/d(params) and dL/da of every embedding layer it calls.

  `fun(params) -> (output, extra)` may call any number of embedding layers,
  each once; `output` is the loss or (loss, aux) (`_step.loss_and_aux`),
  `extra` any pytree the caller wants back (not differentiated). It is traced
  twice: once under `jax.eval_shape` to find the layers and their activation
  shapes, then under `_step.value_and_grads` with respect to (params,
  deltas) where every layer's activations become a_f + d_f, d_f = 0. The
  tables are constants of `fun`: no table-sized gradient is formed.

  Args:
    fun: the loss as a function of the dense parameters.
    params: the dense parameters (any pytree).
    owner: names the loss in error messages.

  Returns:
    (loss, aux or None, extra, dL/dparams, EmbeddingGradients).
  """
  sites: dict[str, _Site] = {}

  def discover(params):
    with _tapping(None) as discovery:  # inside eval_shape's trace, as the loss runs
      output = fun(params)
    sites.update(discovery.sites)
    return output

  jax.eval_shape(discover, params)
  deltas = _zero_deltas(sites)

  def with_deltas(params, deltas):
    with _tapping(deltas) as tap:
      output, extra = fun(params)
    if set(tap.sites) != set(sites):
      raise ValueError(
          f"the loss called embedding layers {sorted(tap.sites)} while computing gradients but"
          f" {sorted(sites)} while discovering them; it must call the same layers every time."
      )
    loss, aux = _step.loss_and_aux(output, owner)
    return loss, {"aux": aux, "extra": extra, "batches": tap.batches}

  loss, out, param_grads, delta_grads = _step.value_and_grads(with_deltas, params, deltas, owner)
  grads = {
      key: LayerGradients(out["batches"][key], delta_grads[key], site.path, site.plan, site.backend)
      for key, site in sites.items()
  }
  return loss, out["aux"], out["extra"], param_grads, grads
