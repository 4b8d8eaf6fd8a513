"""Tables by name in a Linen train state: reading them, starting them from given rows.

A Linen model's embedding variables live in `LinenTrainState.embedding`, the
"embedding" collection: per embedding layer, at its module path, the stacked
{"tables", "slots", "step"}. These functions find one layer's by its path
("/"-joined module names, e.g. "LinenSparseEmbed_0" or "towers/user/embed"; ""
when the model is the layer itself)
and apply `sc_framework.primitives.table_values`, `slot_values` and
`replace_tables` to them. (`NnxSparseEmbed` has the same three as methods.)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from sc_framework.flax import _linen_train, _state
from sc_framework.flax._linen import LinenSparseEmbed
from sc_framework.flax._linen_train import LinenTrainState
from sc_framework.primitives import (
    EmbeddingPlan,
    EmbeddingVariables,
    replace_tables,
    slot_values,
    table_values,
)


def _layer_paths(collection: Any, prefix: tuple[str, ...] = ()) -> list[str]:
  """The paths of the embedding layers in an "embedding" collection."""
  if not isinstance(collection, Mapping):
    return []
  if _state.TABLES in collection:
    return ["/".join(prefix)]
  return [path for name, node in collection.items()
          for path in _layer_paths(node, prefix + (str(name),))]


def _layer_state(state: LinenTrainState, path: str) -> Mapping[str, Any]:
  try:
    node = _linen_train._at(state.embedding, tuple(_parts(path)), path)
  except ValueError:
    node = None
  if not isinstance(node, Mapping) or _state.TABLES not in node:
    raise KeyError(
        f"no embedding layer at {path!r} in the state's embedding collection; its embedding"
        f" layers are at {_layer_paths(state.embedding)}."
    )
  return node


def _parts(path: str) -> list[str]:
  """The module names of a path; "" is the root (the model is the layer itself)."""
  return [part for part in path.split("/") if part]


def _plan(layer: LinenSparseEmbed | EmbeddingPlan) -> EmbeddingPlan:
  if isinstance(layer, LinenSparseEmbed):
    return layer.plan
  if isinstance(layer, EmbeddingPlan):
    return layer
  raise TypeError(
      f"layer must be the LinenSparseEmbed (as the model builds it: same specs, mesh and"
      f" layout) or its EmbeddingPlan, got {type(layer).__name__}."
  )


def _variables(state: LinenTrainState, path: str) -> EmbeddingVariables:
  own = _layer_state(state, path)
  return EmbeddingVariables(own[_state.TABLES], own[_state.SLOTS])


def linen_table_values(state: LinenTrainState, layer: LinenSparseEmbed | EmbeddingPlan,
                       path: str, tables: Iterable[str] | None = None) -> dict[str, np.ndarray]:
  """The rows of the tables of the embedding layer at `path`: name -> [V, D] numpy array.

  Args:
    state: the train state (`init_linen_train_state`, a train step's).
    layer: that layer (`LinenSparseEmbed` with the model's arguments) or its plan.
    path: its module path, "/"-joined (e.g. "LinenSparseEmbed_0").
    tables: the table names (default every table of the layer).
  """
  return table_values(_plan(layer), _variables(state, path), tables)


def linen_slot_values(state: LinenTrainState, layer: LinenSparseEmbed | EmbeddingPlan,
                      path: str, tables: Iterable[str] | None = None
                      ) -> dict[str, dict[str, np.ndarray]]:
  """The optimizer slots of the layer's tables: name -> slot -> numpy array."""
  return slot_values(_plan(layer), _variables(state, path), tables)


def replace_linen_tables(state: LinenTrainState, layer: LinenSparseEmbed | EmbeddingPlan,
                         path: str, tables: Mapping[str, np.ndarray],
                         slots: Mapping[str, Mapping[str, np.ndarray]] | None = None
                         ) -> LinenTrainState:
  """The state with tables of the layer at `path` started from given rows.

  Each named table's rows become tables[name] ([V, D], e.g. pretrained
  embeddings), its slots slots[name] where given, else their initial values;
  the layer's other tables, its step and every other variable stay. See
  `sc_framework.primitives.replace_tables`.
  """
  own = _layer_state(state, path)
  new = replace_tables(_plan(layer), EmbeddingVariables(own[_state.TABLES], own[_state.SLOTS]),
                       tables, slots)
  layer_state = {**own, _state.TABLES: new.tables, _state.SLOTS: new.slots}
  return state._replace(
      embedding=_linen_train._replace(state.embedding, tuple(_parts(path)), layer_state))
