"""The Trainer says where its resumes are not bit-exact: on GPU without deterministic XLA ops."""

from __future__ import annotations

import warnings

import optax
import pytest

from pipelining import NondeterministicResumeWarning, Trainer
from pipelining import _determinism
from sc_framework.optimizers import Adagrad
from test_trainer import LinearHead, make_specs, mesh_of, mse


@pytest.mark.parametrize("flags, expected", [
    ("", False),
    ("--xla_gpu_deterministic_ops=true", True),
    ("--xla_gpu_deterministic_ops", True),
    ("--xla_gpu_deterministic_ops=1", True),
    ("--xla_gpu_deterministic_ops=false", False),
    ("--xla_force_host_platform_device_count=8 --xla_gpu_deterministic_ops=true", True),
    ("--xla_gpu_deterministic_ops=true --xla_gpu_deterministic_ops=false", False),
    ("--xla_gpu_deterministic_ops_extra=true", False),
])
def test_the_deterministic_flag_is_read_as_xla_reads_it(flags, expected):
  assert _determinism.gpu_ops_are_deterministic(flags) is expected


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_cpu_and_tpu_resume_exactly(platform):
  assert _determinism.resume_caveat(platform, "") is None


@pytest.mark.parametrize("platform", ["gpu", "cuda", "rocm"])
def test_gpu_resumes_exactly_only_with_deterministic_ops(platform):
  caveat = _determinism.resume_caveat(platform, "--xla_gpu_deterministic_ops=false")
  assert caveat is not None
  assert f"runs on {platform}" in caveat
  assert "XLA_FLAGS=--xla_gpu_deterministic_ops=true" in caveat  # what to do about it
  assert _determinism.resume_caveat(platform, "--xla_gpu_deterministic_ops=true") is None


def _trainer(workdir):
  return Trainer(LinearHead(), make_specs(Adagrad(0.3)), mse, optax.adam(0.05), mesh=mesh_of(1),
                 progress="off", padding_id=-1, workdir=workdir)


def test_a_trainer_on_cpu_does_not_warn(tmp_path):
  with warnings.catch_warnings():
    warnings.simplefilter("error", NondeterministicResumeWarning)
    _trainer(tmp_path / "run")


def test_a_trainer_with_a_workdir_on_gpu_warns_unless_its_ops_are_deterministic(
    tmp_path, monkeypatch):
  from pipelining import _trainer as trainer_module

  monkeypatch.setattr(trainer_module, "mesh_platform", lambda mesh: "gpu")
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  with pytest.warns(NondeterministicResumeWarning, match="not bit for bit"):
    _trainer(tmp_path / "a")
  with warnings.catch_warnings():
    warnings.simplefilter("error", NondeterministicResumeWarning)
    _trainer(None)  # without a workdir there is nothing to resume
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true")
    _trainer(tmp_path / "b")
