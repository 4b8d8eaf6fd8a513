"""The compiled training steps, synchronous and pipelined.

Notation: T_k, theta_k are the tables and dense parameters after k
updates, x_k is batch k, a_k its activations.

  prime(T_0, x_0)            -> a_0 = lookup(T_0, x_0)
  pipelined(T_k, a_k, x_k, x_{k+1}):
      a_{k+1} = lookup(T_k, x_{k+1})        (no dependency on the dense part)
      g_k, dL/da_k = grad of loss at (theta_k, a_k)
      theta_{k+1} = optax update; T_{k+1} = sparse update of T_k with dL/da_k
  drain(T_k, a_k, x_k)       -> the same update without a next lookup
  sync(T_k, x_k)             -> drain(T_k, lookup(T_k, x_k), x_k)

With pipelining the lookup reads the tables one update stale (a_{k+1} sees
T_k, not T_{k+1}); every batch is applied exactly once because the last step
of the data drains (a run stopped earlier keeps its next batch in flight). The carried a_k is the lookup's result as each stack holds it
(`stacked_lookup`: one buffer per stack), cut into features only inside the
step that reads it, so no program copies it into per-feature outputs. All
functions are pure: the state goes in and comes out (donated).
Every step is built from the parts the Flax layers' train steps use
(`sc_framework.flax`: `value_and_grads`, `dense_update`, `sparse_update`) and
follows their convention for the loss: a scalar, or (loss, aux dict), whose
aux entries become metrics beside "loss".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from sc_framework.flax import dense_update, loss_and_aux, sparse_update, value_and_grads
from sc_framework.preprocessing import StackBatch
from sc_framework.primitives import (
    EmbeddingBackend,
    EmbeddingPlan,
    EmbeddingVariables,
    embedding_lookup,
    split_stacked_activations,
    stack_activations,
    stacked_lookup,
)


def call_loss(loss_fn: Callable[[Any, Any], Any], predictions: Any, labels: Any) -> Any:
  """loss_fn(predictions, labels); a TypeError or ValueError it raises (shapes that do not
  broadcast, say) gets a note with the shapes of both, which JAX's message lacks."""
  try:
    return loss_fn(predictions, labels)
  except (TypeError, ValueError) as error:
    shapes = lambda tree: jax.tree.map(lambda leaf: tuple(getattr(leaf, "shape", ())), tree)  # noqa: E731
    error.add_note(f"(raised in loss_fn(predictions, labels), the model's predictions of shape"
                   f" {shapes(predictions)} and the batch's labels of shape {shapes(labels)})")
    raise

class TrainState(NamedTuple):
  """Everything that training updates, as one pytree.

  Attributes:
    params: the dense model's trainable parameters.
    opt_state: the dense optimizer's state.
    embeddings: the stacked tables and their slots.
    step: int32 scalar, the number of updates applied.
  """

  params: Any
  opt_state: Any
  embeddings: EmbeddingVariables
  step: jax.Array


class DeviceBatch(NamedTuple):
  """One batch on the devices: preprocessed ids, dense features, labels."""

  sparse: dict[str, StackBatch]
  dense: Any
  labels: Any


class InFlight(NamedTuple):
  """The pipeline's carry: a batch whose activations were looked up early.

  Attributes:
    stacked_activations: stack name -> the stack's activations
      (`sc_framework.primitives.stacked_lookup`); `CompiledSteps.
      feature_activations` gives them per feature.
    batch: the batch they were looked up for.
  """

  stacked_activations: dict[str, jax.Array]
  batch: DeviceBatch


def _metrics(aux: dict[str, Any] | None) -> dict[str, jax.Array]:
  """The loss's aux dict as the step's metrics: scalars, logged beside "loss"."""
  metrics = dict(aux or {})
  if "loss" in metrics:
    raise ValueError(
        "loss_fn returned (loss, aux) with a 'loss' entry in aux; the Trainer records the loss"
        " under 'loss' itself. Rename that entry."
    )
  shaped = {name: jnp.shape(value) for name, value in metrics.items() if jnp.shape(value) != ()}
  if shaped:
    raise ValueError(
        f"loss_fn's aux entries {shaped} are not scalars; the Trainer logs aux entries as"
        " metrics, one number per step. Reduce them (e.g. .mean())."
    )
  return metrics


def _ordered(stacked_activations: jax.Array, num_devices: int) -> jax.Array:
  """A bool [G] that is always True but is computed from each device's activations.

  A program that reads a stack's table (a lookup) and updates it in place
  must run the reads first. Without a data dependency between the two, XLA
  cannot prove that order and copies the table each step; guarding the
  stack's update with this value, computed from the stack's lookup result,
  makes the update depend on the lookup. Each device's entry reads only its
  own rows of the activations (the batch is sharded over the same G
  devices), so no communication is added; x == x or isnan(x) is True for
  every float and is not folded away by XLA.
  """
  probe = stacked_activations.reshape(num_devices, -1)[:, 0]
  return (probe == probe) | jnp.isnan(probe)


@dataclasses.dataclass(frozen=True)
class StepFunctions:
  """Builds the jitted steps for one model, loss and optimizers.

  Attributes:
    plan: the embedding plan.
    apply_fn: (params, activations, dense) -> predictions.
    loss_fn: (predictions, labels) -> loss or (loss, metrics dict).
    dense_optimizer: the optax transformation for the dense parameters.
    backend: the embedding backend of the lookups and sparse updates (a
      registered name or an `EmbeddingBackend` value).
  """

  plan: EmbeddingPlan
  apply_fn: Callable[..., Any]
  loss_fn: Callable[..., Any]
  dense_optimizer: optax.GradientTransformation
  backend: str | EmbeddingBackend = "auto"

  # --- pure bodies ------------------------------------------------------------

  def lookup(self, state: TrainState, batch: DeviceBatch) -> dict[str, jax.Array]:
    return embedding_lookup(self.plan, state.embeddings.tables, batch.sparse,
                            backend=self.backend)

  def lookup_stacks(self, state: TrainState, batch: DeviceBatch) -> dict[str, jax.Array]:
    return stacked_lookup(self.plan, state.embeddings.tables, batch.sparse, backend=self.backend)

  def feature_activations(self, stacked: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return split_stacked_activations(self.plan, stacked)

  def stacked_activations(self, activations: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return stack_activations(self.plan, activations)

  def dense_grads(self, state: TrainState, activations: dict[str, jax.Array], batch: DeviceBatch):
    """Dense forward/backward at (theta_k, a_k): (loss, metrics, dL/dtheta, dL/da)."""

    def objective(params, activations):
      return call_loss(self.loss_fn, self.apply_fn(params, activations, batch.dense),
                       batch.labels)

    loss, aux, param_grads, activation_grads = value_and_grads(
        objective, state.params, activations
    )
    return loss, _metrics(aux), param_grads, activation_grads

  def apply_grads(self, state: TrainState, batch: DeviceBatch, grads,
                  after: dict[str, jax.Array] | None = None) -> tuple[TrainState, dict]:
    """Both updates from `dense_grads`' result.

    `after`: stacked activations (stack name -> `stacked_lookup`'s array)
    looked up from the same tables in the same program; each stack's
    in-place update is ordered after that lookup (see `_ordered`).
    """
    loss, metrics, param_grads, activation_grads = grads
    params, opt_state = dense_update(
        self.dense_optimizer, state.params, state.opt_state, param_grads
    )
    # A non-finite loss applies nothing: the state stays the last finite one
    # and the host raises (see Trainer). For the tables, `sparse_update`'s
    # mask marks every requested row unused, so the update touches no row.
    finite = jnp.isfinite(loss)
    apply = {}
    for name in batch.sparse:
      apply[name] = finite
      if after is not None:
        ordered = _ordered(after[name], self.plan.num_devices)
        apply[name] = finite & ordered[:, None, None]
    embeddings = sparse_update(
        self.plan, state.embeddings, batch.sparse, activation_grads, state.step, apply=apply,
        backend=self.backend,
    )
    if_finite = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
    params = if_finite(params, state.params)
    opt_state = if_finite(opt_state, state.opt_state)
    step = state.step + finite.astype(state.step.dtype)
    metrics = {"loss": loss, **metrics}
    return TrainState(params, opt_state, embeddings, step), metrics

  def apply_update(self, state: TrainState, activations: dict[str, jax.Array], batch: DeviceBatch):
    return self.apply_grads(state, batch, self.dense_grads(state, activations, batch))

  def sync_body(self, state: TrainState, batch: DeviceBatch):
    return self.apply_update(state, self.lookup(state, batch), batch)

  def prime_body(self, state: TrainState, batch: DeviceBatch) -> dict[str, jax.Array]:
    return self.lookup_stacks(state, batch)

  def pipelined_body(self, state: TrainState, stacked_activations: dict[str, jax.Array],
                     batch: DeviceBatch, next_batch: DeviceBatch):
    # The lookup of batch k+1 and the dense step of batch k are independent;
    # the in-place table update follows both.
    next_stacked = self.lookup_stacks(state, next_batch)
    grads = self.dense_grads(state, self.feature_activations(stacked_activations), batch)
    state, metrics = self.apply_grads(state, batch, grads, after=next_stacked)
    return state, next_stacked, metrics

  def drain_body(self, state: TrainState, in_flight: InFlight):
    return self.apply_update(state, self.feature_activations(in_flight.stacked_activations),
                             in_flight.batch)

  def predict_body(self, state: TrainState, batch: DeviceBatch):
    """The model's predictions; reads neither the labels nor the loss."""
    return self.apply_fn(state.params, self.lookup(state, batch), batch.dense)

  def evaluate_body(self, state: TrainState, batch: DeviceBatch):
    """The predictions and the loss's metrics ("loss" and its aux entries)."""
    predictions = self.predict_body(state, batch)
    loss, aux = loss_and_aux(call_loss(self.loss_fn, predictions, batch.labels))
    return predictions, {"loss": loss, **_metrics(aux)}

  # --- compiled ---------------------------------------------------------------

  def compiled(self) -> "CompiledSteps":
    return CompiledSteps(
        sync=jax.jit(self.sync_body, donate_argnums=(0,)),
        prime_jit=jax.jit(self.prime_body),
        # Only the state is donated: the in-flight activations are read by the
        # dense step while the lookup of the next batch writes new ones, so
        # donating them makes XLA copy every activation before the lookup
        # may reuse its buffer (one [B, D] copy per feature and step).
        pipelined_jit=jax.jit(self.pipelined_body, donate_argnums=(0,)),
        drain=jax.jit(self.drain_body, donate_argnums=(0,)),
        predict=jax.jit(self.predict_body),
        evaluate=jax.jit(self.evaluate_body),
        feature_activations=jax.jit(self.feature_activations),
        stacked_activations=jax.jit(self.stacked_activations),
    )


@dataclasses.dataclass(frozen=True)
class CompiledSteps:
  """The jitted steps. The in-flight batch never passes through a compiled
  program's outputs (that would copy it every step): the pipelined step
  returns only the new activations, and the InFlight is assembled here.
  `feature_activations` / `stacked_activations` convert an in-flight batch's
  activations between the carried per-stack form and features (checkpoints
  store them per feature)."""

  sync: Callable[..., Any]
  prime_jit: Callable[..., Any]
  pipelined_jit: Callable[..., Any]
  drain: Callable[..., Any]
  predict: Callable[..., Any]
  evaluate: Callable[..., Any]
  feature_activations: Callable[..., Any]
  stacked_activations: Callable[..., Any]

  def prime(self, state: TrainState, batch: DeviceBatch) -> InFlight:
    return InFlight(self.prime_jit(state, batch), batch)

  def pipelined(self, state: TrainState, in_flight: InFlight, next_batch: DeviceBatch):
    state, stacked, metrics = self.pipelined_jit(
        state, in_flight.stacked_activations, in_flight.batch, next_batch
    )
    return state, InFlight(stacked, next_batch), metrics
