"""Optimizer specs: slot declarations, hashing and equality, validation.

The update rules themselves are tested elsewhere; here only the specs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re

import pytest

from sc_framework import FeatureSpec, TableSpec, stack_tables
from sc_framework.optimizers import (
    FTRL,
    SGD,
    Adagrad,
    AdagradMomentum,
    Adam,
    CustomOptimizer,
    LaProp,
    OptimizerSpec,
    RowWiseAdagrad,
    SlotSpec,
)
from sc_framework.stacking import auto_stack_tables

ALL_BUILTIN = (SGD, Adagrad, RowWiseAdagrad, AdagradMomentum, Adam, LaProp, FTRL)


def _match(*parts: str) -> str:
  return ".*".join(re.escape(part) for part in parts)


def _keep_slots(rows, grads, slots, step):
  del grads, step
  return rows, slots


def _other_rule(rows, grads, slots, step):
  del step
  return rows - grads, slots


# --- slot declarations ------------------------------------------------------


def _slots(optimizer: OptimizerSpec) -> list[tuple[str, int | None, float]]:
  return [(slot.name, slot.width, slot.initial_value) for slot in optimizer.slots()]


@pytest.mark.parametrize(
    "optimizer, expected",
    [
        (SGD(), []),
        (SGD(learning_rate=0.5), []),
        (Adagrad(), [("accumulator", None, 0.1)]),
        (Adagrad(initial_accumulator=0.25), [("accumulator", None, 0.25)]),
        (RowWiseAdagrad(), [("accumulator", 1, 0.1)]),
        (RowWiseAdagrad(initial_accumulator=0.0, eps=1e-6), [("accumulator", 1, 0.0)]),
        (AdagradMomentum(), [("accumulator", None, 0.1), ("momentum", None, 0.0)]),
        (
            AdagradMomentum(initial_accumulator=2.0, momentum=0.5),
            [("accumulator", None, 2.0), ("momentum", None, 0.0)],
        ),
        (Adam(), [("mu", None, 0.0), ("nu", None, 0.0)]),
        (Adam(beta1=0.0, beta2=0.5), [("mu", None, 0.0), ("nu", None, 0.0)]),
        (LaProp(), [("mu", None, 0.0), ("nu", None, 0.0)]),
        (FTRL(), [("accumulator", None, 0.1), ("linear", None, 0.0)]),
        (FTRL(initial_accumulator=3.0), [("accumulator", None, 3.0), ("linear", None, 0.0)]),
        (CustomOptimizer("plain", _keep_slots), []),
        (
            CustomOptimizer(
                "two_slots", _keep_slots, (SlotSpec("velocity"), SlotSpec("count", 3, 1.5))
            ),
            [("velocity", None, 0.0), ("count", 3, 1.5)],
        ),
    ],
    ids=lambda value: value.kind if isinstance(value, OptimizerSpec) else None,
)
def test_slot_declarations(optimizer, expected):
  slots = optimizer.slots()
  assert isinstance(slots, tuple)
  assert all(isinstance(slot, SlotSpec) for slot in slots)
  assert _slots(optimizer) == expected
  # Declarations are deterministic (the stacked checkpoint relies on it).
  assert optimizer.slots() == slots


@pytest.mark.parametrize("padded_dim", [8, 16, 128])
def test_slot_stacked_width(padded_dim):
  assert SlotSpec("m").stacked_width(padded_dim) == padded_dim
  assert SlotSpec("a", 1).stacked_width(padded_dim) == 1
  assert SlotSpec("c", 3).stacked_width(padded_dim) == 3
  (accumulator,) = RowWiseAdagrad().slots()
  assert accumulator.stacked_width(padded_dim) == 1
  for slot in Adam().slots():
    assert slot.stacked_width(padded_dim) == padded_dim


def test_kinds_are_distinct():
  kinds = [factory().kind for factory in ALL_BUILTIN] + [CustomOptimizer("x", _keep_slots).kind]
  assert kinds == [
      "sgd", "adagrad", "rowwise_adagrad", "adagrad_momentum", "adam", "laprop", "ftrl", "custom"
  ]


@pytest.mark.parametrize(
    "name, width, initial_value, culprit",
    [
        ("", None, 0.0, "slot name must be a non-empty string, got ''"),
        (None, None, 0.0, "slot name must be a non-empty string, got None"),
        ("m", 0, 0.0, "slot 'm': width must be None"),
        ("m", -2, 0.0, "positive int, got -2"),
        ("m", 1.5, 0.0, "positive int, got 1.5"),
        ("m", "4", 0.0, "positive int, got '4'"),
        ("m", None, float("nan"), "slot 'm': initial_value must be finite, got nan"),
        ("m", 2, float("inf"), "slot 'm': initial_value must be finite, got inf"),
        ("m", None, float("-inf"), "slot 'm': initial_value must be finite, got -inf"),
    ],
)
def test_slot_spec_validation(name, width, initial_value, culprit):
  with pytest.raises(ValueError, match=_match(culprit)):
    SlotSpec(name, width, initial_value)


# --- hashing and equality ---------------------------------------------------

# (factory, a field, a second valid value for it different from the default).
_ALTERNATIVE_VALUES = [
    (SGD, "learning_rate", 0.5),
    (Adagrad, "learning_rate", 0.5),
    (Adagrad, "initial_accumulator", 0.2),
    (Adagrad, "eps", 1e-8),
    (RowWiseAdagrad, "learning_rate", 0.5),
    (RowWiseAdagrad, "initial_accumulator", 0.2),
    (RowWiseAdagrad, "eps", 1e-6),
    (AdagradMomentum, "learning_rate", 0.5),
    (AdagradMomentum, "momentum", 0.5),
    (AdagradMomentum, "beta2", 0.99),
    (AdagradMomentum, "epsilon", 1e-6),
    (AdagradMomentum, "exponent", 4.0),
    (AdagradMomentum, "use_nesterov", True),
    (AdagradMomentum, "initial_accumulator", 0.0),
    (Adam, "learning_rate", 0.5),
    (Adam, "beta1", 0.8),
    (Adam, "beta2", 0.99),
    (Adam, "epsilon", 1e-6),
    (Adam, "sum_inside_sqrt", True),
    (LaProp, "learning_rate", 0.5),
    (LaProp, "beta1", 0.8),
    (LaProp, "beta2", 0.99),
    (LaProp, "epsilon", 1e-6),
    (FTRL, "learning_rate", 0.5),
    (FTRL, "learning_rate_power", -1.0),
    (FTRL, "l1", 0.1),
    (FTRL, "l2", 0.1),
    (FTRL, "beta", 0.1),
    (FTRL, "initial_accumulator", 0.2),
    (FTRL, "multiply_linear_by_learning_rate", True),
]
# The options every optimizer shares (fields of OptimizerSpec).
_SHARED_ALTERNATIVES = [
    ("clipvalue", (-1.0, 1.0)),
    ("row_clipnorm", 2.0),
    ("weight_decay_factor", 0.01),
    ("multiply_weight_decay_factor_by_learning_rate", True),
    ("clip_weight_min", -1.0),
    ("clip_weight_max", 1.0),
]
_ALTERNATIVE_VALUES += [
    (factory, field, value) for factory in ALL_BUILTIN for field, value in _SHARED_ALTERNATIVES
]


@pytest.mark.parametrize("factory", ALL_BUILTIN)
def test_specs_are_hashable_frozen_and_equal_by_value(factory):
  first, second = factory(), factory()
  assert first is not second
  assert first == second
  assert hash(first) == hash(second)
  assert len({first, second}) == 1
  assert {first: "x"}[second] == "x"
  with pytest.raises(dataclasses.FrozenInstanceError):
    first.learning_rate = 1.0


@pytest.mark.parametrize(
    "factory, field, value",
    _ALTERNATIVE_VALUES,
    ids=[f"{factory.__name__}-{field}" for factory, field, _ in _ALTERNATIVE_VALUES],
)
def test_specs_differ_when_a_hyperparameter_differs(factory, field, value):
  # The flag scales a decay: without one it is refused.
  other = ({"weight_decay_factor": 0.1}
           if field == "multiply_weight_decay_factor_by_learning_rate" else {})
  base = factory(**other)
  assert getattr(base, field) != value
  changed = factory(**other, **{field: value})
  assert changed != base
  assert changed == factory(**other, **{field: value})
  assert hash(changed) == hash(factory(**other, **{field: value}))
  assert len({base, changed}) == 2


def test_every_hyperparameter_has_an_alternative_value():
  for factory in ALL_BUILTIN:
    fields = {field.name for field in dataclasses.fields(factory)}
    covered = {field for f, field, _ in _ALTERNATIVE_VALUES if f is factory}
    assert covered == fields, factory.__name__


def test_different_kinds_with_equal_fields_are_unequal():
  assert Adam(learning_rate=0.1, beta1=0.9, beta2=0.95) != LaProp(learning_rate=0.1, beta1=0.9, beta2=0.95)
  assert SGD(learning_rate=0.1) != Adagrad(learning_rate=0.1)
  assert Adagrad() != RowWiseAdagrad()
  kinds = {factory() for factory in ALL_BUILTIN}
  assert len(kinds) == len(ALL_BUILTIN)


def test_callable_learning_rate_identity():
  def schedule(step):
    return 0.1 / (1.0 + step)

  def other_schedule(step):
    return 0.1 / (1.0 + step)

  assert Adam(learning_rate=schedule) == Adam(learning_rate=schedule)
  assert hash(Adam(learning_rate=schedule)) == hash(Adam(learning_rate=schedule))
  assert Adam(learning_rate=schedule) != Adam(learning_rate=other_schedule)
  assert Adam(learning_rate=schedule) != Adam(learning_rate=0.1)


def test_custom_optimizer_identity():
  slots = (SlotSpec("velocity"), SlotSpec("count", 1, 2.0))
  first = CustomOptimizer("rule", _keep_slots, slots)
  # A list of slot specs is normalised to a tuple, so the spec stays hashable.
  second = CustomOptimizer("rule", _keep_slots, list(slots))
  assert isinstance(second.slot_specs, tuple)
  assert first == second
  assert hash(first) == hash(second)
  assert first != CustomOptimizer("other_name", _keep_slots, slots)
  assert first != CustomOptimizer("rule", _other_rule, slots)
  assert first != CustomOptimizer("rule", _keep_slots, slots[:1])
  assert first != CustomOptimizer("rule", _keep_slots, (SlotSpec("velocity"), SlotSpec("count", 1, 3.0)))
  assert first != CustomOptimizer("rule", _keep_slots, slots, learning_rate=0.5)


def test_slot_specs_are_hashable_and_equal_by_value():
  assert SlotSpec("m", 1, 0.5) == SlotSpec("m", 1, 0.5)
  assert hash(SlotSpec("m", 1, 0.5)) == hash(SlotSpec("m", 1, 0.5))
  assert SlotSpec("m", 1, 0.5) != SlotSpec("m", None, 0.5)
  assert SlotSpec("m", 1, 0.5) != SlotSpec("m", 1, 0.25)
  assert SlotSpec("m", 1, 0.5) != SlotSpec("v", 1, 0.5)


@pytest.mark.parametrize("factory", ALL_BUILTIN)
def test_hyperparameters_are_json_friendly(factory):
  optimizer = factory()
  params = optimizer.hyperparameters()
  assert params["kind"] == optimizer.kind
  assert set(params) == {"kind"} | {field.name for field in dataclasses.fields(optimizer)}
  json.dumps(params)


def test_hyperparameters_name_callables():
  def my_schedule(step):
    return 0.01

  params = Adagrad(learning_rate=my_schedule).hyperparameters()
  assert "my_schedule" in params["learning_rate"]
  json.dumps(params)
  custom = CustomOptimizer("rule", _keep_slots).hyperparameters()
  assert custom["kind"] == "custom" and "_keep_slots" in custom["update_fn"]


# --- validation ------------------------------------------------------------

# (factory, field, a value on the boundary or just inside, a value just outside).
_BOUNDARIES = [
    (SGD, "learning_rate", 1e-12, 0.0),
    (Adagrad, "learning_rate", 1e-12, -1e-12),
    (Adagrad, "eps", 0.0, -1e-12),
    (RowWiseAdagrad, "learning_rate", 1e-12, 0.0),
    (RowWiseAdagrad, "initial_accumulator", 0.0, -1e-12),
    (RowWiseAdagrad, "eps", 0.0, -1e-12),
    (AdagradMomentum, "momentum", 0.0, -1e-12),
    (AdagradMomentum, "momentum", math.nextafter(1.0, 0.0), 1.0),
    (AdagradMomentum, "beta2", 1.0, math.nextafter(1.0, 2.0)),
    (AdagradMomentum, "beta2", 1e-12, 0.0),
    (AdagradMomentum, "epsilon", 1e-30, 0.0),
    (AdagradMomentum, "exponent", 1e-3, 0.0),
    (AdagradMomentum, "initial_accumulator", 0.0, -1e-12),
    (Adam, "beta1", 0.0, -1e-12),
    (Adam, "beta1", math.nextafter(1.0, 0.0), 1.0),
    (Adam, "beta2", 0.0, -1e-12),
    (Adam, "beta2", math.nextafter(1.0, 0.0), 1.0),
    (Adam, "epsilon", 1e-30, 0.0),
    (LaProp, "beta1", 0.0, -1e-12),
    (LaProp, "beta1", math.nextafter(1.0, 0.0), 1.0),
    (LaProp, "beta2", 0.0, -1e-12),
    (LaProp, "beta2", math.nextafter(1.0, 0.0), 1.0),
    (LaProp, "epsilon", 1e-30, 0.0),
    (FTRL, "learning_rate_power", 0.0, 1e-12),
    (FTRL, "l1", 0.0, -1e-12),
    (FTRL, "l2", 0.0, -1e-12),
    (FTRL, "beta", 0.0, -1e-12),
    (FTRL, "initial_accumulator", 0.0, -1e-12),
]


@pytest.mark.parametrize(
    "factory, field, inside, outside",
    _BOUNDARIES,
    ids=[f"{factory.__name__}-{field}-{inside}" for factory, field, inside, _ in _BOUNDARIES],
)
def test_hyperparameter_boundaries(factory, field, inside, outside):
  assert getattr(factory(**{field: inside}), field) == inside
  with pytest.raises(ValueError, match=_match(f"{factory.__name__}:", field, "must be", repr(outside))):
    factory(**{field: outside})


@pytest.mark.parametrize("factory", ALL_BUILTIN)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_learning_rate_rejected(factory, value):
  with pytest.raises(ValueError, match=_match(f"{factory.__name__}: learning_rate", "finite", repr(value))):
    factory(learning_rate=value)


@pytest.mark.parametrize(
    "factory, field",
    [
        (Adagrad, "initial_accumulator"),
        (RowWiseAdagrad, "eps"),
        (AdagradMomentum, "momentum"),
        (Adam, "beta1"),
        (LaProp, "epsilon"),
        (FTRL, "l1"),
    ],
)
@pytest.mark.parametrize("value", [float("nan"), "0.1", None, True])
def test_non_numeric_hyperparameter_rejected(factory, field, value):
  culprit = _match(f"{factory.__name__}: {field} must be a finite number", repr(value))
  with pytest.raises(ValueError, match=culprit):
    factory(**{field: value})


@pytest.mark.parametrize("make, message", [
    (lambda: Adagrad(eps=-1), "Adagrad: eps must be a finite number >= 0.0, got -1."),
    (lambda: FTRL(learning_rate_power=1),
     "FTRL: learning_rate_power must be a finite number <= 0.0, got 1."),
    (lambda: Adam(beta1=1.5), "Adam: beta1 must be in [0.0, 1.0), got 1.5."),
])
def test_a_range_with_one_bound_is_named_as_finite(make, message):
  """The message said [0.0, inf], while inf itself is refused as not finite."""
  with pytest.raises(ValueError) as raised:
    make()
  assert str(raised.value) == message


def test_callable_learning_rate_accepted():
  for factory in ALL_BUILTIN:
    optimizer = factory(learning_rate=lambda step: 0.1)
    assert callable(optimizer.learning_rate)


@pytest.mark.parametrize("factory", [Adagrad, RowWiseAdagrad])
def test_adagrad_needs_a_positive_denominator(factory):
  """A zero accumulator is accepted where sqrt(a) + eps > 0 (FBGEMM's exact Adagrad)."""
  assert factory(initial_accumulator=0.0, eps=1e-8).slots()[0].initial_value == 0.0
  factory(initial_accumulator=0.1, eps=0.0)
  with pytest.raises(ValueError, match=_match(factory.__name__, "both 0", "eps > 0")):
    factory(initial_accumulator=0.0, eps=0.0)
  with pytest.raises(ValueError, match=_match(f"{factory.__name__}: initial_accumulator", "-0.1")):
    factory(initial_accumulator=-0.1, eps=1e-8)


def test_adagrad_defaults_are_unchanged():
  """eps defaults to 0: existing configurations keep their update and checkpoints."""
  assert Adagrad().eps == 0.0 and Adagrad().initial_accumulator == 0.1
  assert not Adam().sum_inside_sqrt


# --- the shared options -------------------------------------------------------


@pytest.mark.parametrize("factory", ALL_BUILTIN)
def test_shared_options_default_to_off(factory):
  optimizer = factory()
  assert optimizer.options_set() == ()
  assert (optimizer.clipvalue, optimizer.row_clipnorm, optimizer.clip_weight_min,
          optimizer.clip_weight_max) == (None, None, None, None)
  assert optimizer.weight_decay_factor == 0.0
  assert optimizer.multiply_weight_decay_factor_by_learning_rate is False


def test_shared_options_are_keyword_only_and_listed_when_set():
  optimizer = Adam(0.1, clip_weight_min=-2.0, row_clipnorm=1.0)
  assert optimizer.options_set() == ("row_clipnorm", "clip_weight_min")
  assert repr(optimizer) == (
      "Adam(learning_rate=0.1, beta1=0.9, beta2=0.999, epsilon=1e-08, sum_inside_sqrt=False,"
      " row_clipnorm=1.0, clip_weight_min=-2.0)"
  )
  assert repr(SGD(0.5)) == "SGD(learning_rate=0.5)"
  with pytest.raises(TypeError):
    SGD(0.1, 1.0)  # pylint: disable=too-many-function-args


@pytest.mark.parametrize(
    "given, stored",
    [(0.5, (-0.5, 0.5)), ((-0.5, 0.5), (-0.5, 0.5)), ([-1, 2], (-1.0, 2.0)),
     ((None, 0.3), (None, 0.3)), ((-0.3, None), (-0.3, None)), ((None, None), None), (None, None)],
)
def test_clipvalue_forms_are_normalised(given, stored):
  """A bound c is (-c, c) (TPUEmbedding's convention); equal ranges are equal specs."""
  optimizer = SGD(clipvalue=given)
  assert optimizer.clipvalue == stored
  assert optimizer == SGD(clipvalue=stored)
  assert hash(optimizer) == hash(SGD(clipvalue=stored))
  json.dumps(optimizer.hyperparameters())


@pytest.mark.parametrize(
    "kwargs, culprit",
    [
        (dict(clipvalue=0.0), "SGD: clipvalue must be > 0 (it clips to [-c, c]), got 0.0"),
        (dict(clipvalue=-1.0), "SGD: clipvalue must be > 0 (it clips to [-c, c]), got -1.0"),
        (dict(clipvalue=(0.1, 1.0)), "SGD: clipvalue (min, max) = (0.1, 1.0) must contain 0"),
        (dict(clipvalue=(-1.0, -0.1)), "SGD: clipvalue (min, max) = (-1.0, -0.1) must contain 0"),
        (dict(clipvalue=(0.0, 0.0)), "SGD: clipvalue (min, max) = (0.0, 0.0) must contain 0"),
        (dict(clipvalue=(1.0,)), "SGD: clipvalue must be a bound c > 0 or a pair (min, max), got (1.0,)"),
        (dict(clipvalue=float("nan")), "SGD: clipvalue must be a finite number or None, got nan"),
        (dict(clipvalue="1"), "SGD: clipvalue must be a finite number or None, got '1'"),
        (dict(row_clipnorm=0.0), "SGD: row_clipnorm must be > 0 or None, got 0.0"),
        (dict(row_clipnorm=float("inf")), "SGD: row_clipnorm must be a finite number or None, got inf"),
        (dict(weight_decay_factor=-0.1), "SGD: weight_decay_factor must be a finite number >= 0 (0 for no decay), got -0.1"),
        (dict(weight_decay_factor=None), "SGD: weight_decay_factor must be a finite number"),
        (dict(multiply_weight_decay_factor_by_learning_rate=True),
         "SGD: multiply_weight_decay_factor_by_learning_rate=True scales the weight decay by the"
         " learning rate, but weight_decay_factor is 0 (no decay)"),
        (dict(clip_weight_min=float("-inf")), "SGD: clip_weight_min must be a finite number or None, got -inf"),
        (dict(clip_weight_max=True), "SGD: clip_weight_max must be a finite number or None, got True"),
        (dict(clip_weight_min=1.0, clip_weight_max=0.5),
         "SGD: clip_weight_min (1.0) > clip_weight_max (0.5)"),
    ],
)
def test_shared_option_validation(kwargs, culprit):
  with pytest.raises(ValueError, match=_match(culprit)):
    SGD(**kwargs)


def test_shared_option_errors_name_the_optimizer():
  with pytest.raises(TypeError, match=_match(
      "Adam: multiply_weight_decay_factor_by_learning_rate must be a bool, got 1")):
    Adam(multiply_weight_decay_factor_by_learning_rate=1)
  with pytest.raises(TypeError, match=_match("Adam: sum_inside_sqrt must be a bool, got 'yes'")):
    Adam(sum_inside_sqrt="yes")
  with pytest.raises(ValueError, match=_match(
      "CustomOptimizer 'rule': clip_weight_min (2.0) > clip_weight_max (1.0)")):
    CustomOptimizer("rule", _keep_slots, clip_weight_min=2.0, clip_weight_max=1.0)
  with pytest.raises(ValueError, match=_match("FTRL: row_clipnorm must be > 0 or None, got -1.0")):
    FTRL(row_clipnorm=-1.0)
  # Equal bounds are a (degenerate but defined) range.
  assert SGD(clip_weight_min=0.5, clip_weight_max=0.5).clip_weight_max == 0.5


def test_shared_options_do_not_change_the_slots():
  """The options are hyperparameters: checkpointed slots stay those of the rule."""
  options = dict(clipvalue=1.0, row_clipnorm=2.0, weight_decay_factor=0.1,
                 multiply_weight_decay_factor_by_learning_rate=True, clip_weight_min=-1.0,
                 clip_weight_max=1.0)
  for factory in ALL_BUILTIN:
    assert factory(**options).slots() == factory().slots(), factory.__name__
    assert factory(**options) != factory()
  custom = CustomOptimizer("rule", _keep_slots, (SlotSpec("m"),))
  assert dataclasses.replace(custom, **options).slots() == custom.slots()


def test_stacking_key_distinguishes_the_options():
  """Tables whose optimizers differ only in an option do not share a stack."""
  def features(optimizer_b):
    a = TableSpec("a", 50, 8, optimizer=SGD(0.1, clip_weight_max=1.0))
    b = TableSpec("b", 60, 8, optimizer=optimizer_b)
    return [FeatureSpec("fa", a, (8,)), FeatureSpec("fb", b, (8,))]

  assert len(auto_stack_tables(features(SGD(0.1, clip_weight_max=1.0)), 1).stacks) == 1
  assert len(auto_stack_tables(features(SGD(0.1, clip_weight_max=2.0)), 1).stacks) == 2
  assert len(auto_stack_tables(features(SGD(0.1)), 1).stacks) == 2
  with pytest.raises(ValueError, match=_match("clip_weight_max=1.0", "SGD(learning_rate=0.1)")):
    stack_tables(features(SGD(0.1)), [["a", "b"]], 1)


def test_custom_optimizer_validation():
  with pytest.raises(ValueError, match=_match("CustomOptimizer: name", "''")):
    CustomOptimizer("", _keep_slots)
  with pytest.raises(ValueError, match=_match("CustomOptimizer: name", "None")):
    CustomOptimizer(None, _keep_slots)
  with pytest.raises(TypeError, match=_match("CustomOptimizer 'rule'", "update_fn must be callable")):
    CustomOptimizer("rule", "not a function")
  culprit = _match("CustomOptimizer 'rule'", "slot_specs must hold SlotSpec", "'velocity'")
  with pytest.raises(TypeError, match=culprit):
    CustomOptimizer("rule", _keep_slots, ("velocity",))
  with pytest.raises(ValueError, match=_match("CustomOptimizer 'rule'", "duplicate slot names", "'m', 'm'")):
    CustomOptimizer("rule", _keep_slots, (SlotSpec("m"), SlotSpec("m", 1)))


def test_readme_optimizer_options_example_runs():
  """The README's optimizer-options block runs as written and sets what it says."""
  text = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
  start, end = "<!-- optimizer-options:start -->", "<!-- optimizer-options:end -->"
  assert start in text and end in text, "README.md lost its optimizer-options markers"
  block = text.split(start, 1)[1].split(end, 1)[0]
  code = block.split("```python\n", 1)[1].split("```", 1)[0]
  namespace: dict = {}
  exec(compile(code, "<README optimizer options>", "exec"), namespace)  # pylint: disable=exec-used
  adam, adagrad = namespace["adam"], namespace["exact_adagrad"]
  assert adam.sum_inside_sqrt and adam.clipvalue == (-1.0, 1.0)
  assert adam.options_set() == (
      "clipvalue", "weight_decay_factor", "multiply_weight_decay_factor_by_learning_rate",
      "clip_weight_min", "clip_weight_max")
  assert adagrad.slots()[0].initial_value == 0.0 and adagrad.row_clipnorm == 10.0


# --- what a user's rule and schedule return ------------------------------------


def _rows_and_grads(dtype="float32"):
  import numpy as np  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(7)
  rows = rng.standard_normal((5, 8)).astype(dtype)
  grads = rng.standard_normal((5, 8)).astype(dtype)
  return rows, grads


@pytest.mark.parametrize("learning_rate", [-1.0, 0.0, math.nan, math.inf])
def test_custom_optimizer_checks_its_learning_rate(learning_rate):
  with pytest.raises(ValueError, match=r"CustomOptimizer 'c': learning_rate must be finite"):
    CustomOptimizer("c", lambda r, g, s, t: (r - g, s), learning_rate=learning_rate)


@pytest.mark.parametrize(
    "returned, message",
    [
        (lambda r: r[:, :1], r"rows of shape \(5, 1\)"),
        (lambda r: r.sum(), r"rows of shape \(\)"),
        (lambda r: r.astype("int32"), r"rows of shape \(5, 8\) and dtype int32"),
        (lambda r: r.astype("float16"), r"rows .* dtype float16, but was given \(5, 8\) float32"),
    ],
    ids=["column", "scalar", "int32", "float16"],
)
def test_custom_optimizer_refuses_rows_of_another_shape_or_a_narrower_dtype(returned, message):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  spec = CustomOptimizer("bad", lambda r, g, s, t: (returned(r), s))
  rows, grads = _rows_and_grads()
  with pytest.raises(ValueError, match=r"CustomOptimizer 'bad': update_fn returned " + message):
    spec.apply(jnp.asarray(rows), jnp.asarray(grads), {}, jnp.asarray(0), jnp.full((5,), 8))


@pytest.mark.parametrize("update_fn, message", [
    (lambda r, g, s, t: (r - g, s, t), "update_fn returned 3 values; it must return the pair"),
    (lambda r, g, s, t: r - g,
     r"update_fn returned a single value \(\w+\); it must return the pair"),
    (lambda r, g, s, t: (r - g, None), "update_fn returned new_slots as a NoneType; it must be a"),
], ids=["three", "rows_alone", "slots_none"])
def test_custom_optimizer_names_a_return_that_is_not_rows_and_slots(update_fn, message):
  """Three values gave Python's bare 'too many values to unpack (expected 2)'."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  spec = CustomOptimizer("bad", update_fn)
  rows, grads = _rows_and_grads()
  with pytest.raises(ValueError, match=r"CustomOptimizer 'bad': (" + message + ")"):
    spec.apply(jnp.asarray(rows), jnp.asarray(grads), {}, jnp.asarray(0), jnp.full((5,), 8))


def test_custom_optimizer_refuses_a_slot_of_another_shape_and_accepts_a_wider_float():
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  slot = SlotSpec("m", width=None)
  rows, grads = _rows_and_grads()
  narrow = CustomOptimizer("bad", lambda r, g, s, t: (r, {"m": s["m"][:, :1]}), (slot,))
  with pytest.raises(ValueError, match=r"slot 'm' of shape \(5, 1\).*given \(5, 8\)"):
    narrow.apply(jnp.asarray(rows), jnp.asarray(grads), {"m": jnp.zeros((5, 8))},
                 jnp.asarray(0), jnp.full((5,), 8))
  wider = CustomOptimizer("ok", lambda r, g, s, t: (r.astype(jnp.float32) - g, s))
  new_rows, _ = wider.apply(jnp.asarray(rows, jnp.bfloat16), jnp.asarray(grads, jnp.bfloat16), {},
                            jnp.asarray(0), jnp.full((5,), 8))
  assert new_rows.dtype == jnp.bfloat16


def test_a_schedule_must_return_one_rate_per_step():
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  spec = SGD(lambda step: jnp.full((5, 1), 0.1))
  rows, grads = _rows_and_grads()
  with pytest.raises(ValueError, match=r"SGD: the learning-rate schedule returned shape \(5, 1\)"):
    spec.apply(jnp.asarray(rows), jnp.asarray(grads), {}, jnp.asarray(0), jnp.full((5,), 8))


def test_a_schedule_that_branches_on_the_step_in_python_is_told_to_use_jnp_where():
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  spec = SGD(lambda step: 0.1 if step < 10 else 0.01)
  rows, grads = _rows_and_grads()
  apply = jax.jit(lambda step: spec.apply(jnp.asarray(rows), jnp.asarray(grads), {}, step,
                                          jnp.full((5,), 8)))
  with pytest.raises(jax.errors.ConcretizationTypeError) as raised:
    apply(jnp.asarray(3))
  notes = " ".join(getattr(raised.value, "__notes__", []))
  assert "in SGD's learning-rate schedule" in notes and "jnp.where(step < n, a, b)" in notes


def _plan_with(optimizer):
  from sc_framework.primitives import EmbeddingPlan  # pylint: disable=g-import-not-at-top

  table = TableSpec("users", 16, 8, optimizer=optimizer)
  return EmbeddingPlan.create([FeatureSpec("f", table, (8, 1))])


@pytest.mark.parametrize("rate, shown", [(math.nan, "nan"), (-0.01, "-0.01"), (math.inf, "inf")])
def test_a_plan_refuses_a_schedule_whose_rate_at_step_0_is_not_finite_and_at_least_0(rate, shown):
  with pytest.raises(ValueError, match=re.escape(
      f"table 'users' (SGD): the learning-rate schedule returns {shown} at step 0; a rate must"
      " be finite and >= 0")):
    _plan_with(SGD(lambda step: rate + 0.0 * step))


def test_a_plan_takes_a_warm_up_schedule_that_starts_at_0():
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  warm_up = lambda step: 0.1 * jnp.minimum(1.0, step.astype(jnp.float32) / 100)
  assert _plan_with(Adam(learning_rate=warm_up)).optimizer("users").learning_rate is warm_up


def test_a_schedule_of_the_wrong_signature_is_named_with_its_table():
  with pytest.raises(TypeError) as caught:
    _plan_with(RowWiseAdagrad(learning_rate=lambda: 0.1))
  assert "table 'users' (RowWiseAdagrad)'s learning-rate schedule, called with the step" in str(
      caught.value.__notes__)


def test_a_plan_made_under_jit_checks_its_schedule_too():
  import jax  # pylint: disable=g-import-not-at-top

  def make(x):
    _plan_with(SGD(lambda step: -1.0 + 0.0 * step))
    return x

  with pytest.raises(ValueError, match=r"table 'users' \(SGD\): the learning-rate schedule"):
    jax.jit(make)(1.0)


@pytest.mark.parametrize("transform", ["jit", "vmap"])
def test_a_schedule_of_traced_values_is_left_unchecked_and_used(transform):
  """A rate passed into a jitted step, or swept under vmap, has no value where the plan is
  made: the plan must take it (it refused it with a TracerArrayConversionError)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  def rate_of_plan(learning_rate):
    plan = _plan_with(SGD(lambda step: learning_rate * 0.5**step))
    return plan.optimizer("users").learning_rate_at(jnp.asarray(1, jnp.int32))

  if transform == "jit":
    assert float(jax.jit(rate_of_plan)(0.25)) == 0.125
  else:
    assert [float(x) for x in jax.vmap(rate_of_plan)(jnp.asarray([0.5, 1.0]))] == [0.25, 0.5]
