"""The public primitives: sparse lookup and fused gradient + optimizer update."""

from __future__ import annotations

import jax

from sc_framework._byte_order import native_byte_order
from sc_framework.preprocessing._batch import StackBatch
from sc_framework.primitives import _sharded
from sc_framework.primitives._checks import (
    check_batch,
    check_features,
    check_stacked,
    check_step,
    check_tables,
    check_variables,
)
from sc_framework.primitives._backend import EmbeddingBackend, get_backend
from sc_framework.primitives._plan import EmbeddingPlan
from sc_framework.primitives._state import EmbeddingVariables


def embedding_lookup(
    plan: EmbeddingPlan,
    tables: dict[str, jax.Array],
    batch: dict[str, StackBatch],
    *,
    backend: str | EmbeddingBackend = "auto",
) -> dict[str, jax.Array]:
  r"""Looks up and combines the rows of every feature (sparse-dense matmul).

  For feature f, sample b with deduplicated ids j and weights w_j:

    a_f[b] = sum_j gain_j * T_f[j],   gain_j = w_j            (sum)
                                             = w_j / sum w     (mean)
                                             = w_j / sqrt(sum w^2)  (sqrtn)

  A sequence feature (output (B, L, D)) has no combiner:
  a_f[b, l] = w_{b,l} * T_f[i_{b,l}], zeros where position l has no id.
  Backends produce it as B * L stacked samples ([B * L, D], position l of
  sample b at row b * L + l); it is reshaped here.

  Args:
    plan: the embedding plan (static under jit).
    tables: stack name -> [V_s, D'] stacked table.
    batch: stack name -> StackBatch from `sc_framework.preprocessing`.
    backend: "auto", a registered backend name ("xla", "cpu", ...) or an
      EmbeddingBackend value.

  Returns:
    feature name -> [batch, D] ([batch, L, D] for a sequence feature)
    activations, sharded over the batch.
  """
  check_tables(plan, tables)
  check_batch(plan, batch)
  return _shaped(plan, get_backend(backend, plan).lookup(plan, tables, batch))


def stacked_lookup(
    plan: EmbeddingPlan,
    tables: dict[str, jax.Array],
    batch: dict[str, StackBatch],
    *,
    backend: str | EmbeddingBackend = "auto",
) -> dict[str, jax.Array]:
  """`embedding_lookup`'s activations as each stack holds them, one array per stack.

  Stack s's array is [G * B_s, D'] (B_s: the stack's samples per device,
  D' its padded width), sharded over the batch: device g's block of B_s
  rows holds its B_f / G samples of each feature f of the stack, feature
  after feature in the stack's order, in the feature's first D_f columns
  (a sequence feature's samples as B * L positions). It is the lookup's own
  result before it is cut into features, so a program that keeps
  activations for a later program (the pipelined Trainer) keeps one buffer
  per stack and copies nothing; `split_stacked_activations` gives
  `embedding_lookup`'s result from it.
  """
  check_tables(plan, tables)
  check_batch(plan, batch)
  chosen = get_backend(backend, plan)
  if chosen.lookup_stacks is not None:
    return chosen.lookup_stacks(plan, tables, batch)
  return _sharded.join_stacks(plan, chosen.lookup(plan, tables, batch))


def split_stacked_activations(plan: EmbeddingPlan,
                              stacked: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """`stacked_lookup`'s result -> feature name -> activations (as `embedding_lookup`)."""
  check_stacked(plan, stacked, "stacked activations",
                 "Pass stacked_lookup's result for this plan.")
  return _shaped(plan, _sharded.split_stacks(plan, stacked))


def stack_activations(plan: EmbeddingPlan,
                      activations: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """Feature name -> activations (as `embedding_lookup`) -> `stacked_lookup`'s form.

  The inverse of `split_stacked_activations` (padding columns are zeros).
  """
  return _sharded.join_stacks(plan, _as_rows(plan, activations, "activations"))


def _shaped(plan: EmbeddingPlan, rows: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """Feature -> [S_f, D_f] (the backends' form) -> its output_shape."""
  return {name: value.reshape(plan.feature(name).output_shape) for name, value in rows.items()}


def _as_rows(plan: EmbeddingPlan, arrays: dict[str, jax.Array], what: str):
  """Feature -> [B, D] or [B, L, D] -> the backends' [stacked samples, D] form.

  `what` names the argument in the error (e.g. "activation_grads").
  """
  check_features(plan, arrays, what)
  return {feature.name: native_byte_order(arrays[feature.name]).reshape(feature.stacked_batch_size,
                                                     feature.output_shape[-1])
          for feature in plan.feature_specs}


def apply_embedding_gradients(
    plan: EmbeddingPlan,
    variables: EmbeddingVariables,
    batch: dict[str, StackBatch],
    activation_grads: dict[str, jax.Array],
    step: jax.Array | int,
    *,
    backend: str | EmbeddingBackend = "auto",
) -> EmbeddingVariables:
  r"""Applies the activation gradients to the touched rows (lazy update).

  The gradient of row i is g_i = sum over occurrences (f, b, j=i) of
  gain_j * dL/da_f[b]; the stack's optimizer rule then updates row i and its
  slots (see `sc_framework.optimizers`). Rows absent from the batch, and
  padding rows, are not written.

  Use under `jax.jit` with `variables` donated so the update is in place.

  Args:
    plan: the embedding plan (static under jit).
    variables: the tables and slots.
    batch: the batch the activations were looked up with.
    activation_grads: feature name -> gradient of the loss, shaped like the
      feature's activations ([batch, D], or [batch, L, D] for a sequence
      feature).
    step: the number of updates applied so far (learning-rate schedules and
      bias corrections read it).
    backend: "auto", a registered backend name ("xla", "cpu", ...) or an
      EmbeddingBackend value.

  Returns:
    The updated EmbeddingVariables.
  """
  check_variables(plan, variables)
  check_batch(plan, batch)
  check_step(step)
  return get_backend(backend, plan).apply_gradients(
      plan, variables, batch, _as_rows(plan, activation_grads, "activation_grads"), step
  )


def apply_stacked_gradients(
    plan: EmbeddingPlan,
    variables: EmbeddingVariables,
    batch: dict[str, StackBatch],
    stacked_grads: dict[str, jax.Array],
    step: jax.Array | int,
    *,
    backend: str | EmbeddingBackend = "auto",
) -> EmbeddingVariables:
  r"""`apply_embedding_gradients` with the gradients in `stacked_lookup`'s form.

  stacked_grads[s] = dL/dA_s for the stacked activations A_s = stacked_lookup(...)[s]
  ([G * B_s, D'], sharded over the batch): feature f's rows of device g are
  where `stacked_lookup` puts its activations. The update is the one
  `apply_embedding_gradients` applies to `split_stacked_activations(plan,
  stacked_grads)`: the columns beyond a feature's D_f are ignored (A_s holds
  zeros there). A model that computes its loss on the stacked activations
  (one array per stack, as TorchRec's KeyedTensor.values()) gets its gradient
  in this form and skips cutting it into features and joining them again.

  Args:
    plan: the embedding plan (static under jit).
    variables: the tables and slots.
    batch: the batch the activations were looked up with.
    stacked_grads: stack name -> [G * B_s, D'] gradient of the loss.
    step: the number of updates applied so far.
    backend: "auto", a registered backend name or an EmbeddingBackend value.

  Returns:
    The updated EmbeddingVariables.
  """
  check_variables(plan, variables)
  check_batch(plan, batch)
  check_step(step)
  check_stacked(plan, stacked_grads, "stacked_grads",
                 "Pass the gradient of the loss with respect to stacked_lookup's result.")
  stacked_grads = {name: native_byte_order(grads) for name, grads in stacked_grads.items()}
  chosen = get_backend(backend, plan)
  if chosen.apply_stacked_gradients is not None:
    return chosen.apply_stacked_gradients(plan, variables, batch, stacked_grads, step)
  return chosen.apply_gradients(plan, variables, batch, _sharded.split_stacks(plan, stacked_grads),
                                step)
