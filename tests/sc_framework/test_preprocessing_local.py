"""Process-local preprocessing: a slice of the devices gives their exact buffers.

A process of a multi-process job feeds only the samples of its L consecutive
devices. Preprocessing that slice with `devices=range(first, first + L)` must
give, for every one of those devices, the very buffers that preprocessing the
whole global batch gives it.
"""

from __future__ import annotations

import pickle
import zlib

import numpy as np
import pytest

from sc_framework.preprocessing import collect_stats, merge_stats, preprocess, size_limits_from_stats
from sc_framework.specs import FeatureSpec
from sc_framework.stacking import auto_stack_tables
from tests.numerics import assert_same_bits
from test_preprocessing import FORMS, model, model_samples, skewed_model, to_form

G = 8


def local_slice(samples_by_feature, specs, devices: range):
  """Each feature's samples of the devices in `devices` (contiguous blocks)."""
  out = {}
  for spec in specs:
    per_device = spec.batch_size // G
    out[spec.name] = samples_by_feature[spec.name][devices.start * per_device:
                                                   devices.stop * per_device]
  return out


def skewed_specs(combiner="mean"):
  """`skewed_model` (small limits, so ids overflow) with batch sizes divisible by G."""
  return [FeatureSpec(s.name, s.table, (s.batch_size * 2, None))
          for s in skewed_model(combiner)]


def forms_of(samples_by_feature, form, weighted):
  return {name: to_form(samples, form, weighted)[0] for name, samples in samples_by_feature.items()}


def assert_local_matches_global(specs, layout, samples, form, weighted, local_devices, **options):
  padding = to_form(next(iter(samples.values())), form, weighted)[1]
  whole, _ = preprocess(forms_of(samples, form, weighted), specs, layout, padding_id=padding,
                        **options)
  for first in range(0, G, local_devices):
    devices = range(first, first + local_devices)
    part, _ = preprocess(forms_of(local_slice(samples, specs, devices), form, weighted), specs,
                         layout, padding_id=padding, devices=devices, **options)
    assert set(part) == set(whole)
    for name, stack in part.items():
      assert stack.num_devices == local_devices
      for field, got, want in zip(stack._fields, stack, whole[name]):
        assert_same_bits(got, want[first:first + local_devices],
                                      err_msg=f"stack {name} field {field} devices {devices}")


@pytest.mark.parametrize("local_devices", [1, 2, 4, 8])
@pytest.mark.parametrize("shards_per_device", [1, 2])
@pytest.mark.parametrize("form", ["dense", "ragged_splits", "coo"])
def test_local_devices_get_the_global_buffers(local_devices, shards_per_device, form):
  rng = np.random.default_rng(zlib.crc32(f"{local_devices}{shards_per_device}{form}".encode()))
  specs = model(combiner="mean", batch=16)
  layout = auto_stack_tables(specs, G, shards_per_device=shards_per_device)
  weighted = form != "dense"
  samples = model_samples(specs, rng, weighted=weighted)
  assert_local_matches_global(specs, layout, samples, form, weighted, local_devices)


@pytest.mark.parametrize("form", FORMS)
def test_every_form_locally(form):
  rng = np.random.default_rng(zlib.crc32(form.encode()))
  specs = model(combiner="sqrtn", batch=16)
  layout = auto_stack_tables(specs, G)
  samples = model_samples(specs, rng, weighted=True)
  assert_local_matches_global(specs, layout, samples, form, True, 4)


@pytest.mark.parametrize("local_devices", [2, 4])
def test_dropping_is_the_same_locally(local_devices):
  rng = np.random.default_rng(7)
  specs = skewed_specs()
  layout = auto_stack_tables(specs, G)
  samples = {
      spec.name: [[(int(i), 1.0) for i in rng.integers(0, 40, rng.integers(0, 12))]
                  for _ in range(spec.batch_size)]
      for spec in specs
  }
  _, stats = preprocess(forms_of(samples, "ragged_list", True), specs, layout,
                        allow_id_dropping=True)
  assert stats.num_dropped_ids > 0  # the case exercises dropping
  assert_local_matches_global(specs, layout, samples, "ragged_list", True, local_devices,
                              allow_id_dropping=True)


@pytest.mark.parametrize("combiner", ["mean", "sqrtn"])
def test_dropping_with_weights_is_the_same_locally(combiner):
  """Weighted ids, repeated within samples: a sample's mean/sqrtn factor must not
  depend on whether another device (absent from a local call) overflowed."""
  rng = np.random.default_rng(zlib.crc32(combiner.encode()))
  specs = skewed_specs(combiner)
  layout = auto_stack_tables(specs, G)
  samples = {
      spec.name: [[(int(i), float(rng.uniform(0.1, 1.0))) for i in rng.integers(0, 6, n)]
                  for n in rng.integers(0, 12, spec.batch_size)]
      for spec in specs
  }
  # Device 0 gets many distinct ids: it overflows, the others need not.
  for spec in specs:
    per_device = spec.batch_size // G
    for b in range(per_device):
      samples[spec.name][b] = [(int(i), float(rng.uniform(0.1, 1.0)))
                               for i in rng.integers(0, 40, 10)]
  _, stats = preprocess(forms_of(samples, "ragged_list", True), specs, layout,
                        allow_id_dropping=True)
  assert stats.num_dropped_ids > 0  # the case exercises dropping
  assert_local_matches_global(specs, layout, samples, "ragged_list", True, 1,
                              allow_id_dropping=True)


def test_a_local_batch_of_the_wrong_size_names_the_share():
  specs = model(batch=16)
  layout = auto_stack_tables(specs, G)
  samples = model_samples(specs, np.random.default_rng(0))
  with pytest.raises(ValueError, match=r"feature 'user': got a batch of 16 samples but"
                                       r" expected 8, this process's share"):
    preprocess(forms_of(samples, "ragged_list", False), specs, layout, devices=range(0, 4))


@pytest.mark.parametrize("devices", [range(0, 0), range(6, 10), range(0, 8, 2), [0, 1]])
def test_bad_device_ranges_are_rejected(devices):
  specs = model(batch=16)
  layout = auto_stack_tables(specs, G)
  samples = model_samples(specs, np.random.default_rng(0))
  with pytest.raises(ValueError, match="devices must be a non-empty range of consecutive"):
    preprocess(forms_of(samples, "ragged_list", False), specs, layout, devices=devices)


def test_overflow_names_the_global_device():
  specs = skewed_specs()
  layout = auto_stack_tables(specs, G)
  hot = [[(i, 1.0) for i in range(40)]]  # one sample with every row of 'hot'
  samples = {spec.name: [[] for _ in range(spec.batch_size)] for spec in specs}
  devices = range(4, 8)
  local = local_slice(samples, specs, devices)
  local["a"] = hot + local["a"][1:]
  with pytest.raises(ValueError, match=r"device 4 (sends|requests)"):
    preprocess(forms_of(local, "ragged_list", True), specs, layout, devices=devices)


@pytest.mark.parametrize("local_devices", [2, 4])
def test_local_statistics_merged_over_processes_size_the_global_limits(local_devices):
  """collect_stats took no devices=: a process could not collect the statistics of its own
  samples, which the sizing workflow needs with several processes."""
  rng = np.random.default_rng(local_devices)
  specs = skewed_specs()
  layout = auto_stack_tables(specs, G)
  batches = [model_samples(specs, rng, weighted=False) for _ in range(3)]
  whole = collect_stats([forms_of(b, "ragged_list", False) for b in batches], specs, layout)
  per_process = [
      pickle.loads(pickle.dumps(collect_stats(
          [forms_of(local_slice(b, specs, devices), "ragged_list", False) for b in batches],
          specs, layout, devices=devices)))
      for devices in (range(first, first + local_devices) for first in range(0, G, local_devices))
  ]
  merged = merge_stats(per_process)
  for name, stack in whole.stacks.items():
    assert (merged[name].max_ids_per_partition, merged[name].max_unique_ids_per_partition,
            merged[name].num_ids) == (stack.max_ids_per_partition,
                                      stack.max_unique_ids_per_partition, stack.num_ids)
  assert size_limits_from_stats(specs, merged, layout=layout) == size_limits_from_stats(
      specs, whole, layout=layout)
