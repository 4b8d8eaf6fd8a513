"""`LinenSparseEmbed`: stacked, sharded embedding tables as a Flax Linen module."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from sc_framework.flax import _grads, _state
from sc_framework.preprocessing import StackBatch
from sc_framework.primitives import (
    DEFAULT_AXIS_NAME,
    EmbeddingPlan,
    embedding_lookup,
)
from sc_framework.specs import FeatureSpec
from sc_framework.stacking import EmbeddingLayout

EMBEDDING_COLLECTION = "embedding"
"""The Linen collection holding every embedding layer's tables, slots and step.

Kept apart from "params" so that optax only ever sees the dense parameters:
`variables["params"]` goes to the dense optimizer, `variables["embedding"]`
to the fused sparse update.
"""


class LinenSparseEmbed(nn.Module):
  r"""Embedding lookups of several features through stacked, sharded tables.

  The Linen counterpart of `nn.Embed` for large tables: the features' tables
  are stacked and sharded per `sc_framework.primitives.EmbeddingPlan`, the
  lookup is `embedding_lookup` and training applies the fused sparse update
  `apply_embedding_gradients` (see `make_linen_train_step`). For feature f,
  sample b with ids j and combiner gains g_j:

    out[f][b] = sum_j g_j * T_f[j]      ([B_f, D_f])

  and for a sequence feature (output_shape (B_f, L_f, D_f)), one row per
  position, zeros where a position has no id:

    out[f][b, l] = w_{b,l} * T_f[i_{b,l}]      ([B_f, L_f, D_f])

  Variables (collection "embedding", never "params"):
    tables: stack name -> [V_s, D'] stacked table, sharded over `axis_name`;
    slots:  stack name -> slot name -> [V_s, w] optimizer slot;
    step:   int32, the number of sparse updates applied.
  They are created by `init_embedding_variables`: each device computes only
  its own rows, from the tables' initializers, so values do not depend on the
  layout.

  Call the layer once per step, outside lifted transforms (refused: `nn.scan`,
  `nn.vmap`, `nn.remat`); its input is the preprocessed batch (stack name ->
  StackBatch) for the layer's `plan.layout`.

  Attributes:
    feature_specs: the features looked up (and, through them, the tables).
    mesh: the device mesh; default all devices on one axis.
    axis_name: the mesh axis holding table rows and batch samples.
    shards_per_device: S, table shards per device; default 1, or the layout's S
      (a different value is refused).
    layout: an explicit stacked layout; default automatic stacking.
    param_dtype: dtype of the tables (slots are float32).
    backend: the primitives backend, "auto" by default.

  Example:
    >>> embed = LinenSparseEmbed(feature_specs)
    >>> variables = embed.init(jax.random.key(0), batch)
    >>> activations = embed.apply(variables, batch)   # {"user": [B, D], ...}
  """

  feature_specs: Sequence[FeatureSpec]
  mesh: Mesh | None = None
  axis_name: str = DEFAULT_AXIS_NAME
  shards_per_device: int | None = None
  layout: EmbeddingLayout | None = None
  param_dtype: Any = jnp.float32
  backend: str = "auto"

  @property
  def plan(self) -> EmbeddingPlan:
    """The static embedding plan: specs, stacked layout and mesh axis."""
    return EmbeddingPlan.create(
        self.feature_specs,
        mesh=self.mesh,
        axis_name=self.axis_name,
        shards_per_device=self.shards_per_device,
        layout=self.layout,
    )

  @nn.compact
  def __call__(self, batch: dict[str, StackBatch]) -> dict[str, jax.Array]:
    """Feature name -> [B_f, D_f] (sequence: [B_f, L_f, D_f]) activations of `batch`."""
    plan = self.plan
    path = tuple(self.scope.path)
    owner = _grads.layer_owner("LinenSparseEmbed", _grads.layer_key(path))
    _grads.check_batch(plan, batch, owner)
    if not self.has_variable(EMBEDDING_COLLECTION, _state.TABLES) and not self.is_initializing():
      raise ValueError(
          f"{owner}: no {EMBEDDING_COLLECTION!r} variables."
          f" Pass the whole variables dict from `init`, including variables"
          f"[{EMBEDDING_COLLECTION!r}], to `apply`."
      )
    created: list = []

    def create(name):
      if not created:
        created.append(_state.create_layer_state(plan, self.make_rng("params"), self.param_dtype))
      return created[0][name]

    tables = self.variable(EMBEDDING_COLLECTION, _state.TABLES, create, _state.TABLES)
    self.variable(EMBEDDING_COLLECTION, _state.SLOTS, create, _state.SLOTS)
    self.variable(EMBEDDING_COLLECTION, _state.STEP, create, _state.STEP)
    activations = embedding_lookup(plan, tables.value, batch, backend=self.backend)
    return _grads.tap_activations(path, plan, self.backend, batch, activations)
