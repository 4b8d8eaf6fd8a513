"""The training-step core's loss convention, on the Linen and NNX train steps.

A loss returns a scalar or (loss, aux dict), recognised by type; the steps
return what the loss returned, and name anything else. `has_aux=` still works
but is deprecated and checked against what the loss returns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flax_reference as ref
from sc_framework.flax import (
    LinenSparseEmbed,
    init_linen_train_state,
    loss_and_aux,
    make_linen_train_step,
    make_nnx_train_step,
)
from tests.numerics import assert_close, assert_same_bits
from test_linen import Model as LinenModel
from test_nnx import Model as NnxModel


def test_loss_and_aux_splits_both_forms():
  loss = jnp.float32(1.5)
  assert loss_and_aux(loss) == (loss, None)
  assert loss_and_aux(2.0) == (2.0, None)
  out_loss, aux = loss_and_aux((loss, {"mae": jnp.ones(())}))
  assert out_loss is loss and list(aux) == ["mae"]


@pytest.mark.parametrize(
    ("output", "match"),
    [
        ((jnp.float32(1.0), {}, 3),
         r"my_loss returned a tuple of 3 \(an array of shape \(\) float32, dict, int\)"),
        (jnp.ones(4), r"my_loss returned an array of shape \(4,\) float32; expected a"
                      r" floating-point scalar"),
        ((jnp.float32(1.0), [1]), r"a tuple of 2 \(an array of shape \(\) float32, list\)"),
        ((jnp.ones(4), {}), r"a tuple of 2 \(an array of shape \(4,\) float32, dict\)"),
        ("loss", r"returned str; expected a floating-point scalar loss, or a pair \(loss, aux\)"),
        # Taken, then JAX's gradient refused them ("grad requires real-valued outputs").
        (jnp.array(3), r"returned an array of shape \(\) int32; expected a floating-point"),
        (jnp.array(1 + 2j), r"returned an array of shape \(\) complex64; expected"),
        ((jnp.array(True), {}), r"a tuple of 2 \(an array of shape \(\) bool, dict\)"),
    ],
    ids=["three-tuple", "vector", "list-aux", "vector-loss-with-aux", "str", "int", "complex",
         "bool-with-aux"],
)
def test_loss_and_aux_names_what_was_returned(output, match):
  with pytest.raises(TypeError, match=match):
    loss_and_aux(output, "my_loss")


def linen_setup():
  model = LinenModel(1, 1)
  raw, labels = ref.raw_batch(7)
  batch = ref.preprocessed(raw, LinenSparseEmbed(ref.FEATURES, mesh=ref.mesh(1)).plan.layout)
  state = init_linen_train_state(model, ref.DENSE_TX, jax.random.key(3), batch)
  return model, state, batch, labels


def mse_of(prediction, labels):
  return jnp.mean((prediction - labels) ** 2)


def test_linen_step_returns_what_the_loss_returned():
  model, state, batch, labels = linen_setup()
  prediction = model.apply({"params": state.params, "embedding": state.embedding}, batch)[0]

  def bare(apply, batch, labels):
    return mse_of(apply(batch)[0], labels)

  def with_aux(apply, batch, labels):
    prediction = apply(batch)[0]
    return mse_of(prediction, labels), {"mean": prediction.mean(), "prediction": prediction}

  copy = lambda tree: jax.tree.map(jnp.copy, tree)  # noqa: E731 (the steps donate)
  bare_state, loss = make_linen_train_step(model, ref.DENSE_TX, bare)(copy(state), batch, labels)
  aux_state, (aux_loss, aux) = make_linen_train_step(model, ref.DENSE_TX, with_aux)(
      copy(state), batch, labels)
  assert loss.shape == () and sorted(aux) == ["mean", "prediction"]
  assert_close(aux["prediction"], prediction, terms=ref.WIDTH)
  assert_close(aux["mean"], np.mean(prediction), terms=len(prediction) * ref.WIDTH)
  assert_close(aux_loss, loss, terms=len(prediction))
  for mine, theirs in zip(jax.tree.leaves(aux_state), jax.tree.leaves(bare_state)):
    assert_close(mine, theirs, terms=len(prediction) * ref.WIDTH)


def test_nnx_step_returns_what_the_loss_returned():
  raw, labels = ref.raw_batch(8)

  def bare(model, batch, labels):
    return mse_of(model(batch)[0], labels)

  def with_aux(model, batch, labels):
    prediction = model(batch)[0]
    return mse_of(prediction, labels), {"mean": prediction.mean()}

  outs = {}
  for name, loss_fn in {"bare": bare, "aux": with_aux}.items():
    model = NnxModel(1, 1, rngs=nnx.Rngs(4))
    prediction = model(ref.preprocessed(raw, model.embed.plan.layout))[0]
    optimizer = nnx.Optimizer(model, ref.DENSE_TX, wrt=nnx.Param)
    outs[name] = make_nnx_train_step(loss_fn)(
        model, optimizer, ref.preprocessed(raw, model.embed.plan.layout), labels)
    outs[name + "_tables"] = model.embed.embedding_state()["tables"]
  loss, (aux_loss, aux) = outs["bare"], outs["aux"]
  assert loss.shape == () and list(aux) == ["mean"]
  assert_close(aux["mean"], np.mean(prediction), terms=len(prediction) * ref.WIDTH)
  assert_close(aux_loss, loss, terms=len(prediction))
  for name in outs["bare_tables"]:
    assert_close(outs["aux_tables"][name], outs["bare_tables"][name], terms=len(prediction))


def with_activations(output, labels):
  """(loss, activations of feature "user"): an aux that is an array, not a dict."""
  prediction, activations = output
  return mse_of(prediction, labels), activations["user"]


@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_steps_name_a_loss_outside_the_convention(api):
  raw, labels = ref.raw_batch(9)
  if api == "linen":
    model, state, batch, labels = linen_setup()
    step = make_linen_train_step(model, ref.DENSE_TX, lambda apply, b, y: apply(b)[0] - y)
    run = lambda: step(state, batch, labels)  # noqa: E731
  else:
    model = NnxModel(1, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, ref.DENSE_TX, wrt=nnx.Param)
    step = make_nnx_train_step(lambda m, b, y: with_activations(m(b), y))
    batch = ref.preprocessed(raw, model.embed.plan.layout)
    run = lambda: step(model, optimizer, batch, labels)  # noqa: E731
  with pytest.raises(TypeError, match=r"loss_fn returned .*; expected a floating-point scalar loss,"):
    run()


def test_has_aux_is_deprecated_and_checked():
  model, state, batch, labels = linen_setup()

  def bare(apply, batch, labels):
    return mse_of(apply(batch)[0], labels)

  def with_aux(apply, batch, labels):
    prediction, _ = apply(batch)
    return mse_of(prediction, labels), {"mean": prediction.mean()}

  with pytest.warns(DeprecationWarning, match="has_aux= is deprecated"):
    declared = make_linen_train_step(model, ref.DENSE_TX, with_aux, has_aux=True)
  plain = make_linen_train_step(model, ref.DENSE_TX, with_aux)
  copy = lambda tree: jax.tree.map(jnp.copy, tree)  # noqa: E731 (the steps donate)
  declared_out, plain_out = declared(copy(state), batch, labels), plain(copy(state), batch, labels)
  assert jax.tree.structure(declared_out) == jax.tree.structure(plain_out)
  for mine, theirs in zip(jax.tree.leaves(declared_out), jax.tree.leaves(plain_out)):
    assert_same_bits(mine, theirs)  # the same program
  with pytest.warns(DeprecationWarning):
    wrong = make_linen_train_step(model, ref.DENSE_TX, bare, has_aux=True)
  with pytest.raises(TypeError, match=r"has_aux=True but loss_fn returned an array of shape \(\)"):
    wrong(copy(state), batch, labels)
  with pytest.warns(DeprecationWarning):
    wrong = make_nnx_train_step(lambda m, b, y: mse_of(m(b)[0], y), has_aux=False)
  nnx_model = NnxModel(1, 1, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(nnx_model, ref.DENSE_TX, wrt=nnx.Param)
  assert wrong(nnx_model, optimizer, batch, labels).shape == ()
