"""Whether a Trainer's runs, and so its resumes, reproduce bit for bit on its platform.

A resumed run equals the uninterrupted one bit for bit only if every step is
a deterministic function of its inputs. On CPU XLA's programs are (the test
suite checks it); on TPU XLA lowers scatter-adds without atomic adds (not
checked on a TPU here). On GPU, XLA lowers a scatter-add whose indices may repeat (the embedding
lookup's sums into samples, the update's sums into rows) to atomic adds,
whose float32 sums land in whatever order the threads reach them: two runs
of the same step differ in the last bits, and so does a resumed run from an
uninterrupted one. XLA's flag --xla_gpu_deterministic_ops=true lowers them
deterministically instead, at a large cost: the embedding step of
bench_embedding.py's configuration (26 tables x 100,000 x 64, batch 4,096)
took 86 ms instead of 1.2 ms on an H200.
"""

from __future__ import annotations

from jax.sharding import Mesh

DETERMINISTIC_GPU_FLAG = "--xla_gpu_deterministic_ops=true"
_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


class NondeterministicResumeWarning(UserWarning):
  """A Trainer with a workdir on a platform whose steps are not bit-reproducible."""


def gpu_ops_are_deterministic(xla_flags: str) -> bool:
  """Whether `xla_flags` (XLA_FLAGS) turns --xla_gpu_deterministic_ops on; the
  last occurrence wins, as in XLA's own parsing."""
  enabled = False
  for token in xla_flags.split():
    name, _, value = token.partition("=")
    if name == "--xla_gpu_deterministic_ops":
      enabled = value.lower() in ("", "true", "1")
  return enabled


def mesh_platform(mesh: Mesh) -> str:
  """The platform of the mesh's devices ("cpu", "gpu", "tpu", ...)."""
  return mesh.devices.flat[0].platform


def resume_caveat(platform: str, xla_flags: str) -> str | None:
  """Why a resume on `platform` under `xla_flags` is not bit-exact, or None when it is."""
  if platform not in _GPU_PLATFORMS or gpu_ops_are_deterministic(xla_flags):
    return None
  return (
      f"this Trainer runs on {platform}, where XLA sums repeated indices of a scatter-add"
      " (the embedding lookup's and update's sums) with atomic adds in no fixed order: a"
      " resumed run matches the uninterrupted one up to float32 rounding, not bit for bit,"
      " and so do two runs of the same job. For bit-exact runs and resumes set"
      f" XLA_FLAGS={DETERMINISTIC_GPU_FLAG} before jax is imported; it made the embedding"
      " step about 70x slower on an H200 (86 ms instead of 1.2 ms)."
  )
