"""Flax layers for stacked, sharded embedding tables (Linen and NNX).

`LinenSparseEmbed` and `NnxSparseEmbed` hold a model's embedding tables (and
optimizer slots) apart from its dense parameters and delegate every lookup and
update to `sc_framework.primitives`. Training computes gradients with respect
to the activations, never the tables: the dense parameters get their optax
update and the tables the fused sparse update, in one jitted step
(`make_linen_train_step`, `make_nnx_train_step`). Those steps and the
Trainer's (`pipelining`) are built from the same parts (`value_and_grads`,
`dense_update`, `sparse_update`) and follow one convention for auxiliary
outputs (`loss_and_aux`): a loss returns the scalar loss or (loss, aux dict).
"""

from sc_framework.flax._grads import EmbeddingGradients, LayerGradients
from sc_framework.flax._linen import EMBEDDING_COLLECTION, LinenSparseEmbed
from sc_framework.flax._linen_train import (
    LinenTrainState,
    apply_linen_embedding_grads,
    init_linen_train_state,
    linen_value_and_grad,
    make_linen_train_step,
)
from sc_framework.flax._nnx import EmbeddingVariable, NnxSparseEmbed
from sc_framework.flax._nnx_train import (
    NnxTrainStep,
    apply_nnx_embedding_grads,
    make_nnx_train_step,
    nnx_value_and_grad,
)
from sc_framework.flax._step import dense_update, loss_and_aux, sparse_update, value_and_grads
from sc_framework.flax._tables import linen_slot_values, linen_table_values, replace_linen_tables

__all__ = [
    "LinenSparseEmbed",
    "EMBEDDING_COLLECTION",
    "LinenTrainState",
    "init_linen_train_state",
    "linen_value_and_grad",
    "apply_linen_embedding_grads",
    "make_linen_train_step",
    "linen_table_values",
    "linen_slot_values",
    "replace_linen_tables",
    "NnxSparseEmbed",
    "EmbeddingVariable",
    "NnxTrainStep",
    "nnx_value_and_grad",
    "apply_nnx_embedding_grads",
    "make_nnx_train_step",
    "EmbeddingGradients",
    "LayerGradients",
    "loss_and_aux",
    "value_and_grads",
    "dense_update",
    "sparse_update",
]
