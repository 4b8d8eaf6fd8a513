"""Validation of TableSpec, FeatureSpec and validate_feature_specs.

Every invalid spec must raise a clear exception that names the culprit (the
feature or table, the field and the offending value).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import numpy as np
import pytest

from sc_framework import FeatureSpec, TableSpec, default_initializer, validate_feature_specs
from sc_framework.optimizers import (
    FTRL,
    SGD,
    Adagrad,
    AdagradMomentum,
    Adam,
    CustomOptimizer,
    LaProp,
    RowWiseAdagrad,
    SlotSpec,
)


def _table(name: str = "items", vocabulary_size: int = 100, embedding_dim: int = 8, **kwargs) -> TableSpec:
  return TableSpec(name, vocabulary_size, embedding_dim, **kwargs)


def _match(*parts: str) -> str:
  """A regex that finds every part, in order, anywhere in the message."""
  return ".*".join(re.escape(part) for part in parts)


# --- TableSpec -------------------------------------------------------------


def test_table_spec_defaults():
  table = _table()
  assert table.optimizer == SGD()
  assert table.combiner == "sum"
  assert table.initializer is default_initializer
  assert hash(table) == hash(_table())
  assert table == _table()
  assert table != _table(vocabulary_size=101)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_table_spec_accepts_every_combiner(combiner):
  assert _table(combiner=combiner).combiner == combiner


@pytest.mark.parametrize(
    "field, value",
    [
        ("vocabulary_size", 0),
        ("vocabulary_size", -5),
        ("vocabulary_size", 2.5),
        ("vocabulary_size", True),
        ("vocabulary_size", "100"),
        ("embedding_dim", 0),
        ("embedding_dim", -1),
        ("embedding_dim", 8.0),
        ("max_ids_per_partition", 0),
        ("max_ids_per_partition", -3),
        ("max_unique_ids_per_partition", 0),
        ("max_unique_ids_per_partition", False),
    ],
)
def test_table_spec_rejects_non_positive_sizes(field, value):
  kwargs = {"vocabulary_size": 100, "embedding_dim": 8, field: value}
  with pytest.raises(ValueError, match=_match("table 'clicks'", field, repr(value))):
    TableSpec("clicks", **kwargs)


@pytest.mark.parametrize("name", ["", None, 3])
def test_table_spec_rejects_bad_name(name):
  with pytest.raises(ValueError, match=_match("TableSpec: name", repr(name))):
    TableSpec(name, 10, 4)


@pytest.mark.parametrize("combiner", ["avg", "SUM", "", None, "max"])
def test_table_spec_rejects_unknown_combiner(combiner):
  with pytest.raises(
      ValueError, match=_match("table 'users'", "unknown combiner", repr(combiner), "'sum'", "'sqrtn'")
  ):
    _table("users", combiner=combiner)


@pytest.mark.parametrize("initializer", [None, 0.1, "normal", (1, 2)])
def test_table_spec_rejects_non_callable_initializer(initializer):
  with pytest.raises(TypeError, match=_match("table 'users'", "initializer must be callable")):
    _table("users", initializer=initializer)


def test_table_spec_accepts_any_callable_initializer():
  def zeros(key, shape, dtype):
    del key
    return np.zeros(shape, dtype)

  assert _table(initializer=zeros).initializer is zeros


@pytest.mark.parametrize("optimizer", ["sgd", 0.01, None, SlotSpec("x")])
def test_table_spec_rejects_non_optimizer(optimizer):
  with pytest.raises(
      TypeError,
      match=_match("table 'users'", "optimizer must be an optimizer spec", type(optimizer).__name__),
  ):
    _table("users", optimizer=optimizer)


# Out-of-range hyperparameters, one case per (optimizer, hyperparameter) bound.
# Each entry: the optimizer's name in messages, a factory, the field, the value.
_BAD_HYPERPARAMETERS: list[tuple[str, Callable, str, object]] = [
    ("SGD", SGD, "learning_rate", 0.0),
    ("SGD", SGD, "learning_rate", -0.1),
    ("SGD", SGD, "learning_rate", float("nan")),
    ("SGD", SGD, "learning_rate", float("inf")),
    ("Adagrad", Adagrad, "learning_rate", -1.0),
    ("Adagrad", Adagrad, "initial_accumulator", 0.0),
    ("Adagrad", Adagrad, "initial_accumulator", -0.1),
    ("Adagrad", Adagrad, "initial_accumulator", float("nan")),
    ("RowWiseAdagrad", RowWiseAdagrad, "learning_rate", 0.0),
    ("RowWiseAdagrad", RowWiseAdagrad, "initial_accumulator", -0.5),
    ("RowWiseAdagrad", RowWiseAdagrad, "eps", -1e-8),
    ("RowWiseAdagrad", RowWiseAdagrad, "eps", float("inf")),
    ("AdagradMomentum", AdagradMomentum, "learning_rate", -0.01),
    ("AdagradMomentum", AdagradMomentum, "momentum", 1.0),
    ("AdagradMomentum", AdagradMomentum, "momentum", -0.1),
    ("AdagradMomentum", AdagradMomentum, "beta2", 0.0),
    ("AdagradMomentum", AdagradMomentum, "beta2", 1.5),
    ("AdagradMomentum", AdagradMomentum, "epsilon", 0.0),
    ("AdagradMomentum", AdagradMomentum, "exponent", 0.0),
    ("AdagradMomentum", AdagradMomentum, "exponent", -2.0),
    ("AdagradMomentum", AdagradMomentum, "initial_accumulator", -1.0),
    ("Adam", Adam, "learning_rate", 0.0),
    ("Adam", Adam, "beta1", 1.0),
    ("Adam", Adam, "beta1", -0.5),
    ("Adam", Adam, "beta2", 1.0),
    ("Adam", Adam, "beta2", 2.0),
    ("Adam", Adam, "epsilon", 0.0),
    ("Adam", Adam, "epsilon", -1e-8),
    ("LaProp", LaProp, "learning_rate", -3.0),
    ("LaProp", LaProp, "beta1", 1.0),
    ("LaProp", LaProp, "beta2", -0.1),
    ("LaProp", LaProp, "epsilon", 0.0),
    ("FTRL", FTRL, "learning_rate", 0.0),
    ("FTRL", FTRL, "learning_rate_power", 0.5),
    ("FTRL", FTRL, "l1", -0.1),
    ("FTRL", FTRL, "l2", -1.0),
    ("FTRL", FTRL, "beta", -0.01),
    ("FTRL", FTRL, "initial_accumulator", -0.1),
    ("FTRL", FTRL, "initial_accumulator", float("nan")),
]


@pytest.mark.parametrize(
    "owner, factory, field, value",
    _BAD_HYPERPARAMETERS,
    ids=[f"{owner}-{field}-{value}" for owner, _, field, value in _BAD_HYPERPARAMETERS],
)
def test_optimizer_hyperparameter_out_of_range(owner, factory, field, value):
  with pytest.raises(ValueError, match=_match(f"{owner}:", field, repr(value))):
    _table(optimizer=factory(**{field: value}))


def test_every_optimizer_kind_is_covered_by_the_out_of_range_cases():
  covered = {factory for _, factory, _, _ in _BAD_HYPERPARAMETERS}
  assert covered == {SGD, Adagrad, RowWiseAdagrad, AdagradMomentum, Adam, LaProp, FTRL}


def test_rowwise_adagrad_rejects_zero_accumulator_and_zero_eps():
  with pytest.raises(ValueError, match=_match("RowWiseAdagrad", "initial_accumulator", "eps", "both 0")):
    RowWiseAdagrad(initial_accumulator=0.0, eps=0.0)


@pytest.mark.parametrize("factory", [SGD, Adagrad, RowWiseAdagrad, AdagradMomentum, Adam, LaProp, FTRL])
@pytest.mark.parametrize("value", ["0.1", None, True, [0.1]])
def test_optimizer_learning_rate_of_wrong_type(factory, value):
  with pytest.raises(TypeError, match=_match(f"{factory.__name__}:", "learning_rate", repr(value))):
    factory(learning_rate=value)


@pytest.mark.parametrize(
    "factory, field", [(AdagradMomentum, "use_nesterov"), (FTRL, "multiply_linear_by_learning_rate")]
)
def test_optimizer_bool_flags_must_be_bools(factory, field):
  with pytest.raises(TypeError, match=_match(factory.__name__, field, "'yes'")):
    factory(**{field: "yes"})


def test_custom_optimizer_validation_names_the_rule():
  with pytest.raises(TypeError, match=_match("CustomOptimizer 'mine'", "update_fn must be callable")):
    CustomOptimizer("mine", update_fn=None)
  with pytest.raises(ValueError, match=_match("CustomOptimizer", "name", "''")):
    CustomOptimizer("", update_fn=lambda r, g, s, t: (r, s))


# --- FeatureSpec -----------------------------------------------------------


def test_feature_spec_defaults_and_normalisation():
  table = _table(embedding_dim=12)
  feature = FeatureSpec("item_id", table, [32, 5])
  assert feature.input_shape == (32, 5)
  assert feature.output_shape == (32, 12)
  assert feature.batch_size == 32
  ragged = FeatureSpec("item_ids", table, (32, None), output_shape=[32, 12])
  assert ragged.input_shape == (32, None)
  assert ragged.output_shape == (32, 12)
  assert FeatureSpec("one_d", table, (7,)).output_shape == (7, 12)
  assert hash(feature) == hash(FeatureSpec("item_id", table, (32, 5)))


@pytest.mark.parametrize("output_dim", [16, 8, 1, 13])
def test_feature_output_dim_must_match_table_dim(output_dim):
  table = _table("items", embedding_dim=12)
  with pytest.raises(
      ValueError,
      match=_match(
          "feature 'item_id'", f"output dim {output_dim}", "table 'items'", "embedding_dim 12", "(32, 12)"
      ),
  ):
    FeatureSpec("item_id", table, (32, 4), output_shape=(32, output_dim))


def test_feature_output_batch_must_match_input_batch():
  table = _table("items", embedding_dim=12)
  with pytest.raises(ValueError, match=_match("feature 'item_id'", "output batch 16", "input batch 32")):
    FeatureSpec("item_id", table, (32, 4), output_shape=(16, 12))


@pytest.mark.parametrize("output_shape", [(32,), (32, 12, 1)])
def test_feature_output_shape_rank(output_shape):
  with pytest.raises(ValueError, match=_match("feature 'item_id'", "output_shape", str(output_shape))):
    FeatureSpec("item_id", _table(embedding_dim=12), (32, 4), output_shape=output_shape)


@pytest.mark.parametrize("output_shape, error, culprit", [
    ((32.0, 12.0), ValueError, "output_shape[0] must be a positive int, got 32.0"),
    ((32, 12.5), ValueError, "output_shape[1] must be a positive int, got 12.5"),
    ((32, True), ValueError, "output_shape[1] must be a positive int, got True"),
    ((-32, 12), ValueError, "output_shape[0] must be a positive int, got -32"),
    ("84", TypeError, "output_shape must be a tuple such as (batch, dim)"),
])
def test_feature_output_shape_sizes_are_positive_ints(output_shape, error, culprit):
  """(8.0, 4.0) was taken and failed at the first lookup inside jax's reshape; "84" got the
  hint output_shape=('8', 4)."""
  with pytest.raises(error, match=_match("feature 'item_id'", culprit)):
    FeatureSpec("item_id", _table(embedding_dim=12), (32, 4), output_shape=output_shape)


@pytest.mark.parametrize(
    "input_shape, culprit",
    [
        ((0, 4), "input_shape[0] (batch size) must be a positive int, got 0"),
        ((-2,), "input_shape[0] (batch size) must be a positive int, got -2"),
        ((8, 0), "input_shape[1] (max ids per sample) must be a positive int, got 0"),
        ((8, -1), "input_shape[1] (max ids per sample) must be a positive int, got -1"),
        ((8.0, 2), "input_shape[0] (batch size) must be a positive int, got 8.0"),
        ((), "input_shape must be (batch,) or (batch, max_ids_per_sample), got ()"),
        ((8, 2, 3), "input_shape must be (batch,) or (batch, max_ids_per_sample), got (8, 2, 3)"),
    ],
)
def test_feature_rejects_bad_input_shape(input_shape, culprit):
  with pytest.raises(ValueError, match=_match("feature 'user_id'", culprit)):
    FeatureSpec("user_id", _table(), input_shape)


def test_feature_rejects_bad_name_and_table():
  with pytest.raises(ValueError, match=_match("FeatureSpec: name", "''")):
    FeatureSpec("", _table(), (4,))
  with pytest.raises(TypeError, match=_match("feature 'user_id'", "table must be a TableSpec", "str")):
    FeatureSpec("user_id", "items", (4,))


# --- validate_feature_specs ------------------------------------------------


def test_validate_feature_specs_returns_tuple_and_allows_shared_tables():
  table = _table("items")
  features = [FeatureSpec("a", table, (4,)), FeatureSpec("b", table, (8, 2))]
  assert validate_feature_specs(features) == tuple(features)
  # Equal but distinct TableSpec objects with one name are the same table.
  twin = _table("items")
  assert twin is not table
  validate_feature_specs([FeatureSpec("a", table, (4,)), FeatureSpec("b", twin, (4,))])


def test_validate_feature_specs_rejects_empty():
  with pytest.raises(ValueError, match="feature_specs is empty"):
    validate_feature_specs([])


def test_validate_feature_specs_rejects_non_feature():
  with pytest.raises(TypeError, match=_match("FeatureSpec", "TableSpec")):
    validate_feature_specs([FeatureSpec("a", _table(), (4,)), _table()])
  for nothing in (None, 3, "user_id"):  # "'NoneType' object is not iterable"
    with pytest.raises(TypeError, match=_match("feature_specs must be a sequence of"
                                               f" FeatureSpecs, got {nothing!r}")):
      validate_feature_specs(nothing)


def test_validate_feature_specs_rejects_duplicate_feature_names():
  features = [
      FeatureSpec("user_id", _table("users"), (4,)),
      FeatureSpec("item_id", _table("items"), (4,)),
      FeatureSpec("user_id", _table("items"), (8,)),
  ]
  with pytest.raises(ValueError, match=_match("duplicate feature name 'user_id'")):
    validate_feature_specs(features)


@pytest.mark.parametrize(
    "change",
    [
        {"vocabulary_size": 101},
        {"embedding_dim": 16},
        {"combiner": "mean"},
        {"optimizer": Adagrad()},
        {"optimizer": SGD(learning_rate=0.5)},
        {"max_ids_per_partition": 7},
    ],
)
def test_validate_feature_specs_rejects_two_tables_with_one_name(change):
  first = _table("items")
  second = dataclasses.replace(first, **change)
  features = [FeatureSpec("item_id", first, (4,)), FeatureSpec("other_item_id", second, (4,))]
  with pytest.raises(ValueError, match=_match("duplicate table name 'items'",
                                              "features 'item_id' and 'other_item_id'")):
    validate_feature_specs(features)


def test_an_input_shape_that_is_no_tuple_is_named():
  table = TableSpec("t", 10, 4)
  for shape in (None, 8, "8,3", {20, 16}, {"b": 8}, (d for d in (8, 3))):
    with pytest.raises(TypeError, match=r"feature 'f': input_shape must be a tuple such as"):
      FeatureSpec("f", table, shape)


def test_partition_limits_beyond_int32_buffers_are_refused_naming_the_table():
  with pytest.raises(ValueError, match=r"table 't': max_ids_per_partition is about 1e300, more"
                                       r" than the 2147483647 entries"):
    TableSpec("t", 10, 4, max_ids_per_partition=10**300)
  with pytest.raises(ValueError, match=r"is about 1e400, more"):
    TableSpec("t", 10, 4, max_ids_per_partition=10**400)
  with pytest.raises(ValueError, match=r"max_unique_ids_per_partition is 2147483648, more"):
    TableSpec("t", 10, 4, max_unique_ids_per_partition=2**31)
  TableSpec("t", 10, 4, max_ids_per_partition=2**31 - 1)


def test_an_input_shape_of_numpy_integers_is_read():
  table = TableSpec("t", 10, 4)
  assert FeatureSpec("f", table, np.array([4, 2])).input_shape == (4, 2)
  assert FeatureSpec("f", table, [np.int64(4), None]).input_shape == (4, None)


def test_nested_specs_where_a_flat_sequence_is_taken_are_named_as_such():
  """A dict of specs (as the Trainer and the SparseCore stack take) was iterated by its
  keys: 'feature_specs must hold FeatureSpec values, got str'."""
  from flax import nnx

  from sc_framework.flax import LinenSparseEmbed, NnxSparseEmbed
  from sc_framework.primitives import EmbeddingPlan

  feature = FeatureSpec("f", TableSpec("t", 10, 8), (4,))
  nested = {"user": {"history": feature}}
  for build in (validate_feature_specs, EmbeddingPlan.create,
                lambda specs: LinenSparseEmbed(specs).plan,
                lambda specs: NnxSparseEmbed(specs, rngs=nnx.Rngs(0))):
    with pytest.raises(TypeError, match=re.escape(
        "feature_specs must be a flat sequence of FeatureSpecs, got a dict (keys ['user'])."
        " Pass jax.tree.leaves(specs)")):
      build(nested)
  with pytest.raises(TypeError, match="got a FeatureSpec.* or \\[spec\\] for one feature"):
    validate_feature_specs(feature)
  assert validate_feature_specs([feature]) == (feature,)
