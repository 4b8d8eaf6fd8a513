"""Numpy and JAX scalars in specs are taken as the Python numbers they hold.

A spec built from numpy scalars must equal, hash and serialise exactly like the
one built from Python numbers; a numpy value that is not a valid number for
the field is still refused, naming the field.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from checkpoint import IncrementalPolicy, StorageOptions
from pipelining import TrainerConfig
from sc_framework import FeatureSpec, TableSpec, auto_stack_tables
from sc_framework._scalars import python_scalar
from sc_framework.optimizers import FTRL, Adam, RowWiseAdagrad, SlotSpec

INT_TYPES = (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)
FLOAT_TYPES = (np.float16, np.float32, np.float64)


@pytest.mark.parametrize("int_type", INT_TYPES)
def test_numpy_integers_become_python_ints(int_type):
  value = python_scalar(int_type(100))
  assert type(value) is int and value == 100
  assert type(python_scalar(np.array(int_type(7)))) is int


@pytest.mark.parametrize("float_type", FLOAT_TYPES)
def test_numpy_floats_become_the_python_float_they_hold(float_type):
  scalar = float_type(0.1)
  value = python_scalar(scalar)
  assert type(value) is float and value == float(scalar)
  assert type(python_scalar(jnp.asarray(scalar))) is float


@pytest.mark.parametrize("value", [np.zeros(2), np.array(["a"]), "3", [np.int64(1)], None, 2.5, 3])
def test_other_values_are_left_alone(value):
  assert python_scalar(value) is value


def _specs(make_int, make_float):
  adam = Adam(make_float(0.01), beta1=make_float(0.8), clipvalue=(make_float(-2.0), None))
  table = TableSpec("items", make_int(1000), make_int(12), optimizer=adam,
                    max_ids_per_partition=make_int(64), max_unique_ids_per_partition=make_int(32))
  users = TableSpec("users", make_int(500), make_int(12),
                    optimizer=RowWiseAdagrad(make_float(0.05), initial_accumulator=make_float(0.1)))
  ftrl_optimizer = FTRL(make_float(0.2), l1=make_float(0.01), row_clipnorm=make_float(3.0))
  ftrl = TableSpec("clicks", make_int(300), make_int(4), optimizer=ftrl_optimizer)
  return [
      FeatureSpec("items", table, input_shape=(make_int(32), make_int(5))),
      FeatureSpec("history", table, input_shape=(make_int(32), make_int(7)),
                  output_shape=(make_int(32), make_int(7), make_int(12))),
      FeatureSpec("users", users, input_shape=(make_int(32),)),
      FeatureSpec("clicks", ftrl, input_shape=[make_int(32), make_int(3)]),
  ]


@pytest.mark.parametrize("int_type,float_type", [(np.int64, np.float64), (np.int32, np.float32),
                                                 (np.uint16, np.float16)])
def test_specs_from_numpy_scalars_equal_specs_from_python_numbers(int_type, float_type):
  def python_float(value):
    return float(float_type(value))  # the value the numpy scalar holds

  from_numpy = _specs(int_type, float_type)
  from_python = _specs(int, python_float)
  assert from_numpy == from_python
  assert hash(tuple(from_numpy)) == hash(tuple(from_python))
  for spec in from_numpy:
    assert type(spec.table.vocabulary_size) is int
    assert all(type(size) is int for size in spec.input_shape + spec.output_shape)
    for value in spec.table.optimizer.hyperparameters().values():
      assert not isinstance(value, np.generic)
  layout = auto_stack_tables(from_numpy, num_devices=int_type(2), shards_per_device=int_type(2))
  expected = auto_stack_tables(from_python, num_devices=2, shards_per_device=2)
  assert layout == expected
  json.loads(layout.to_json())  # serialisable: no numpy scalar left in it


def test_slot_spec_and_configs_take_numpy_scalars():
  slot = SlotSpec("acc", np.int64(1), np.float32(0.5))
  assert slot == SlotSpec("acc", 1, 0.5) and type(slot.width) is int
  policy = IncrementalPolicy(full_every=np.int64(3))
  assert policy == IncrementalPolicy(full_every=3)
  assert StorageOptions(chunk_bytes=np.int64(1 << 20)) == StorageOptions(chunk_bytes=1 << 20)
  config = TrainerConfig(log_every=np.int32(5), pipelining=np.bool_(False))
  assert type(config.log_every) is int and config.pipelining is False


@pytest.mark.parametrize("make_spec,message", [
    (lambda: TableSpec("items", np.float64(100.0), 8), r"table 'items': vocabulary_size .* 100\.0"),
    (lambda: TableSpec("items", np.int64(-3), 8), r"table 'items': vocabulary_size .* -3"),
    (lambda: TableSpec("items", 100, np.bool_(True)), r"table 'items': embedding_dim .* True"),
    (lambda: Adam(np.float32(np.nan)), r"Adam: learning_rate .* nan"),
    (lambda: Adam(np.array([0.1, 0.2])), r"Adam: learning_rate"),
    (lambda: auto_stack_tables(_specs(int, float), num_devices=np.float64(2.0)),
     r"num_devices .* 2\.0"),
])
def test_invalid_numpy_values_are_still_refused(make_spec, message):
  with pytest.raises((TypeError, ValueError), match=message):
    make_spec()
