"""`NnxSparseEmbed`: stacked, sharded embedding tables as a Flax NNX module."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from sc_framework.flax import _grads, _state
from sc_framework.preprocessing import StackBatch
from sc_framework.primitives import (
    DEFAULT_AXIS_NAME,
    EmbeddingPlan,
    EmbeddingVariables,
    embedding_lookup,
    replace_tables,
    slot_values,
    table_values,
)
from sc_framework.primitives._checks import check_variables
from sc_framework.specs import FeatureSpec
from sc_framework.stacking import EmbeddingLayout


class EmbeddingVariable(nnx.Variable):
  """An embedding table, optimizer slot or sparse step counter.

  A variable type of its own, not an `nnx.Param`: `nnx.Optimizer(model, tx,
  wrt=nnx.Param)` and `nnx.state(model, nnx.Param)` leave it out, so optax
  never sees a table; the fused sparse update writes it instead.
  """


class NnxSparseEmbed(nnx.Module):
  r"""Embedding lookups of several features through stacked, sharded tables.

  The NNX counterpart of `nnx.Embed` for large tables, and the twin of
  `LinenSparseEmbed`. For feature f, sample b with ids j and combiner gains
  g_j:

    out[f][b] = sum_j g_j * T_f[j]      ([B_f, D_f])

  and for a sequence feature (output_shape (B_f, L_f, D_f)), one row per
  position, zeros where a position has no id:

    out[f][b, l] = w_{b,l} * T_f[i_{b,l}]      ([B_f, L_f, D_f])

  Variables (all `EmbeddingVariable`, none `nnx.Param`):
    tables[stack]:       [V_s, D'] stacked table, sharded over `axis_name`;
    slots[stack][slot]:  [V_s, w] optimizer slot;
    step:                int32, the number of sparse updates applied.
  Created by `init_embedding_variables` with a key from `rngs.params()`: each
  device computes only its own rows.

  Call the layer once per step, outside NNX transforms (refused: `nnx.scan`,
  `nnx.vmap`, `nnx.remat`), with the preprocessed batch (stack name ->
  StackBatch) for its `plan.layout`; train with `make_nnx_train_step`.

  Args:
    feature_specs: the features looked up (and, through them, the tables).
    mesh: the device mesh; default all devices on one axis.
    axis_name: the mesh axis holding table rows and batch samples.
    shards_per_device: S, table shards per device; default 1, or the layout's S
      (a different value is refused).
    layout: an explicit stacked layout; default automatic stacking.
    param_dtype: dtype of the tables (slots are float32).
    backend: the primitives backend, "auto" by default.
    rngs: supplies the initialisation key (`rngs.params()`).

  Example:
    >>> embed = NnxSparseEmbed(feature_specs, rngs=nnx.Rngs(0))
    >>> activations = embed(batch)   # {"user": [B, D], ...}
  """

  def __init__(
      self,
      feature_specs: Sequence[FeatureSpec],
      *,
      mesh: Mesh | None = None,
      axis_name: str = DEFAULT_AXIS_NAME,
      shards_per_device: int | None = None,
      layout: EmbeddingLayout | None = None,
      param_dtype: Any = jnp.float32,
      backend: str = "auto",
      rngs: nnx.Rngs,
  ):
    self.plan = EmbeddingPlan.create(
        feature_specs,
        mesh=mesh,
        axis_name=axis_name,
        shards_per_device=shards_per_device,
        layout=layout,
    )
    self.backend = backend
    created = _state.create_layer_state(self.plan, rngs.params(), param_dtype)
    self.tables = nnx.data({name: EmbeddingVariable(t) for name, t in created[_state.TABLES].items()})
    self.slots = nnx.data(
        {
            stack: {slot: EmbeddingVariable(value) for slot, value in slots.items()}
            for stack, slots in created[_state.SLOTS].items()
        }
    )
    self.step = EmbeddingVariable(created[_state.STEP])

  def __call__(self, batch: dict[str, StackBatch]) -> dict[str, jax.Array]:
    """Feature name -> [B_f, D_f] (sequence: [B_f, L_f, D_f]) activations of `batch`."""
    _grads.check_batch(self.plan, batch, "NnxSparseEmbed")
    tables = {name: table.get_value() for name, table in self.tables.items()}
    activations = embedding_lookup(self.plan, tables, batch, backend=self.backend)
    return _grads.tap_activations(self, self.plan, self.backend, batch, activations)

  def embedding_variables(self) -> EmbeddingVariables:
    """The tables and slots as the primitives' `EmbeddingVariables`."""
    state = self.embedding_state()
    return EmbeddingVariables(state[_state.TABLES], state[_state.SLOTS])

  def embedding_state(self) -> dict[str, Any]:
    """{"tables", "slots", "step"} as plain arrays."""
    return {
        _state.TABLES: {name: v.get_value() for name, v in self.tables.items()},
        _state.SLOTS: {
            stack: {slot: v.get_value() for slot, v in slots.items()}
            for stack, slots in self.slots.items()
        },
        _state.STEP: self.step.get_value(),
    }

  def table_values(self, tables: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """The rows of tables as numpy arrays: name -> [V, D] (default every table).

    See `sc_framework.primitives.table_values`."""
    return table_values(self.plan, self.embedding_variables(), tables)

  def slot_values(self, tables: Iterable[str] | None = None) -> dict[str, dict[str, np.ndarray]]:
    """The tables' optimizer slots: name -> slot -> [V, D] or [V, w] numpy array."""
    return slot_values(self.plan, self.embedding_variables(), tables)

  def replace_tables(self, tables: Mapping[str, np.ndarray],
                     slots: Mapping[str, Mapping[str, np.ndarray]] | None = None) -> None:
    """Starts tables from given rows (e.g. pretrained embeddings): name -> [V, D] array.

    Each named table's rows become the array's, its slots slots[name] where
    given, else their initial values; the step and the other tables stay. See
    `sc_framework.primitives.replace_tables`."""
    variables = replace_tables(self.plan, self.embedding_variables(), tables, slots)
    self.set_embedding_state({_state.TABLES: variables.tables, _state.SLOTS: variables.slots,
                              _state.STEP: self.step.get_value()})

  def set_embedding_state(self, state: Mapping[str, Any]) -> None:
    """Writes {"tables", "slots", "step"} arrays into the layer's variables.

    E.g. a checkpoint's: the tables and slots of an `EmbeddingRestore` into
    this layer's layout, and the step saved beside them (README, "Checkpoints
    of a Flax train state"). They are checked against the layer's plan first
    (stacks, shapes, the optimizer's slots), as the primitives check them.

    Raises:
      TypeError, ValueError: `state` lacks one of the three, its tables or
        slots are not those of this layer's layout and optimizers, or its
        step is not an integer scalar.
    """
    keys = (_state.TABLES, _state.SLOTS, _state.STEP)
    if not isinstance(state, Mapping) or any(key not in state for key in keys):
      given = sorted(state) if isinstance(state, Mapping) else type(state).__name__
      raise TypeError(f"set_embedding_state takes a mapping with the keys {list(keys)} (as"
                      f" embedding_state() returns), got {given}.")
    check_variables(self.plan, EmbeddingVariables(state[_state.TABLES], state[_state.SLOTS]))
    step = state[_state.STEP]
    dtype = step.dtype if hasattr(step, "dtype") else np.asarray(step).dtype  # a tracer too
    if np.ndim(step) != 0 or not jnp.issubdtype(dtype, jnp.integer):
      raise TypeError(f"set_embedding_state: the step must be an integer scalar (the count of"
                      f" sparse updates), got {step!r}.")
    for name, value in state[_state.TABLES].items():
      self.tables[name].set_value(value)
    for stack, slots in state[_state.SLOTS].items():
      for slot, value in slots.items():
        self.slots[stack][slot].set_value(value)
    self.step.set_value(state[_state.STEP])
