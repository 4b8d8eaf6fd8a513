"""Arguments named as in jax-tpu-embedding or TPUEmbedding: a TypeError says what to pass here."""

import copy
import dataclasses
import inspect
import pickle
import re

import pytest

from pipelining import TrainerConfig
from sc_framework import FeatureSpec, TableSpec, auto_stack_tables, stack_tables
from sc_framework.optimizers import (
    FTRL,
    SGD,
    Adagrad,
    AdagradMomentum,
    Adam,
    LaProp,
    RowWiseAdagrad,
)
from sc_framework.primitives import EmbeddingPlan

TABLE = TableSpec("t", 10, 4)


@pytest.mark.parametrize(
    "make, theirs, ours",
    [
        (lambda **kw: FeatureSpec("f", input_shape=(2, 3), **kw), "table_spec", "table="),
        (lambda **kw: Adagrad(0.1, **kw), "initial_accumulator_value", "initial_accumulator="),
        (lambda **kw: RowWiseAdagrad(**kw), "initial_accumulator_value", "initial_accumulator="),
        (lambda **kw: AdagradMomentum(**kw), "initial_accumulator_value",
         "initial_accumulator="),
        (lambda **kw: FTRL(**kw), "initial_accumulator_value", "initial_accumulator="),
        (lambda **kw: Adam(**kw), "beta_1", "beta1="),
        (lambda **kw: LaProp(**kw), "beta_2", "beta2="),
        (lambda **kw: FTRL(**kw), "l1_regularization_strength", "l1="),
        (lambda **kw: FTRL(**kw), "l2_regularization_strength", "l2="),
        (lambda **kw: FTRL(**kw), "initial_linear_value", "linear slot z starts at 0"),
        (lambda **kw: SGD(**kw), "clip_gradient_min", "clipvalue=(min, max)"),
        (lambda **kw: Adam(**kw), "lazy_adam", "only the rows a batch touches"),
        (lambda **kw: TableSpec("t", 10, 4, **kw), "suggested_coo_buffer_size",
         "max_ids_per_partition"),
        (lambda **kw: TableSpec("t", 10, 4, **kw), "quantization_config", "not supported"),
        # The README's table names these two; they gave Python's plain error.
        (lambda **kw: Adam(0.1, **kw), "use_sum_inside_sqrt", "sum_inside_sqrt="),
        (lambda **kw: auto_stack_tables([FeatureSpec("f", TABLE, (2, 3))], 1, **kw),
         "num_sc_per_device", "shards_per_device="),
        (lambda **kw: stack_tables([FeatureSpec("f", TABLE, (2, 3))], [["t"]], 1, **kw),
         "num_sc_per_device", "shards_per_device="),
        (lambda **kw: EmbeddingPlan.create([FeatureSpec("f", TABLE, (2, 3))], **kw),
         "num_sc_per_device", "shards_per_device="),
        (lambda **kw: TrainerConfig(**kw), "num_sc_per_device", "shards_per_device="),
        # CheckpointManager's name, which a Trainer user guesses.
        (lambda **kw: TrainerConfig(**kw), "keep_latest", "keep="),
    ],
)
def test_another_librarys_argument_name_says_what_to_pass_here(make, theirs, ours):
  with pytest.raises(TypeError,
                     match=rf"unexpected keyword argument '{theirs}': .*{re.escape(ours)}"):
    make(**{theirs: TABLE if theirs == "table_spec" else 0.5})


def test_an_unknown_argument_keeps_pythons_error():
  with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
    Adam(colour=1)
  with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
    TableSpec("t", 10, 4, colour=1)


def test_jax_tpu_embeddings_positional_order_is_named():
  for make in (lambda: TableSpec(100, 8, None, SGD(), "sum", "t"),
               lambda: TableSpec(1000, 16, name="words")):
    with pytest.raises(ValueError, match="name must be a non-empty string, got (100|1000)\\..*start"
                                         " with name, vocabulary_size.*by keyword"):
      make()


def test_the_specs_keep_their_signatures():
  assert list(inspect.signature(TableSpec).parameters)[:3] == [
      "name", "vocabulary_size", "embedding_dim"]
  assert list(inspect.signature(FeatureSpec).parameters) == [
      "name", "table", "input_shape", "output_shape"]
  assert "initial_accumulator" in inspect.signature(Adagrad).parameters
  assert list(inspect.signature(auto_stack_tables).parameters) == [
      "feature_specs", "num_devices", "shards_per_device"]
  assert "shards_per_device" in inspect.signature(EmbeddingPlan.create).parameters


def test_a_subclass_may_have_a_field_of_a_renamed_name():
  @dataclasses.dataclass(frozen=True, repr=False)
  class Lazy(SGD):
    lazy_adam: bool = False

  lazy = Lazy(0.1, lazy_adam=True)
  assert lazy.lazy_adam and dataclasses.replace(lazy, learning_rate=0.2).lazy_adam


@pytest.mark.parametrize(
    "spec",
    [TABLE, FeatureSpec("f", TABLE, (2, 3)), Adagrad(0.1, initial_accumulator=0.2),
     Adam(0.1, beta1=0.8, clipvalue=1.0), FTRL(l1=0.1)],
    ids=type,
)
def test_specs_still_copy_pickle_and_replace(spec):
  assert pickle.loads(pickle.dumps(spec)) == spec
  assert copy.deepcopy(spec) == spec
  field = dataclasses.fields(spec)[0].name
  assert dataclasses.replace(spec, **{field: getattr(spec, field)}) == spec
