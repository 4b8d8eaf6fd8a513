"""Test configuration: 8 host CPU devices for the sharded tests, an XLA cache per process.

XLA reads the device flag once, when jax initialises its backends, so it is
set here, before any test module imports jax.

Many tests build the same model and compile the same programs (a Trainer's
steps, a plan's lookup): jax's persistent compilation cache, in a directory
of the test process's own that is removed when it ends, compiles each
program once per process (one per pytest-xdist worker) instead of once per
test. A program read from the cache is the program XLA compiled, so results
are the same bits. It halves the time of the Trainer tests. Processes that
tests start (multiprocess jobs, killed workers) do not use it.
"""

import atexit
import glob
import importlib.util
import mmap
import os
import re
import shutil
import tempfile

# Exactly 8 devices, whatever count a user's XLA_FLAGS or JAX_NUM_CPU_DEVICES (which
# wins over the flag) already asks for; and IEEE float semantics: XLA's fast-math
# flags let the compiler assume no infinities or NaNs, which the overflow-safe row
# clipping tests (and checks) rely on. The user's other flags are kept.
_REPLACED_FLAGS = re.compile(
    r"--xla_force_host_platform_device_count=\S*|--xla_cpu_enable_fast_math=\S*"
    r"|--xla_cpu_fast_math_honor_\w+=\S*|--xla_cpu_enable_fast_min_max=\S*")
os.environ["XLA_FLAGS"] = " ".join(
    _REPLACED_FLAGS.sub("", os.environ.get("XLA_FLAGS", "")).split()
    + ["--xla_force_host_platform_device_count=8"])
# The suite checks the library as JAX runs by default: on the CPU, in float32, with
# its usual promotion rules. A user's environment that changes them (JAX_ENABLE_X64=1
# set for other work, JAX_PLATFORMS=cuda for a GPU job) would fail tests that are right.
for _name in ("JAX_NUM_CPU_DEVICES", "JAX_ENABLE_X64", "JAX_DEFAULT_MATMUL_PRECISION",
              "JAX_NUMPY_RANK_PROMOTION",
              "JAX_NUMPY_DTYPE_PROMOTION", "JAX_DEBUG_NANS", "JAX_DEBUG_INFS", "JAX_DISABLE_JIT",
              "JAX_DEFAULT_PRNG_IMPL"):
  os.environ.pop(_name, None)
# SC_FRAMEWORK_TEST_PLATFORMS=cuda runs it on a GPU instead (as JAX_PLATFORMS would).
os.environ["JAX_PLATFORMS"] = os.environ.get("SC_FRAMEWORK_TEST_PLATFORMS", "cpu")

# The 8 devices' threads meet in every collective; XLA ends the process when
# one has not arrived after 40 s, which a machine busy with other work (8
# device threads per test process on 2 cores) can reach. Patience instead,
# where this jaxlib knows the flag (XLA refuses unknown flags).
_PATIENCE = "xla_cpu_collective_call_terminate_timeout_seconds"


def _jaxlib_knows(flag: str) -> bool:
  spec = importlib.util.find_spec("jaxlib")
  for folder in spec.submodule_search_locations if spec else ():
    for library in glob.glob(os.path.join(folder, "*.so")):
      try:
        with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
          if data.find(flag.encode() + b"\0") >= 0:  # the whole name, not a longer one's start
            return True
      except (OSError, ValueError):  # unreadable, or empty (mmap refuses)
        continue
  return False


if _PATIENCE not in os.environ.get("XLA_FLAGS", "") and _jaxlib_knows(_PATIENCE):
  os.environ["XLA_FLAGS"] += f" --{_PATIENCE}=300"

_XLA_CACHE = tempfile.mkdtemp(prefix="sc-framework-tests-xla-cache-")
atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)

import jax  # noqa: E402  (after the flags above)
from hypothesis import HealthCheck, settings  # noqa: E402

# Property tests judge their inputs, not the machine's speed: no deadline per
# example and no health check timed against the wall clock, which a loaded
# machine (a worker per core, other jobs) can fail. The active profile's other
# settings are kept (Hypothesis's "ci" profile where CI is set), and
# --hypothesis-profile still chooses another. A test's own settings that list
# health checks to suppress must name too_slow too: theirs replace this list.
settings.register_profile(
    "sc_framework_tests",
    settings(settings.default, deadline=None,
             suppress_health_check=[*settings.default.suppress_health_check, HealthCheck.too_slow]))
settings.load_profile("sc_framework_tests")

jax.config.update("jax_compilation_cache_dir", _XLA_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_terminal_summary(terminalreporter):
  """Says so at the end of the run when the C++ kernels are not built: a checkout without
  them (a non-editable install, no compiler) skips their tests quietly otherwise."""
  from sc_framework.primitives import cpu_kernels_build  # pylint: disable=g-import-not-at-top
  if cpu_kernels_build() is None:
    terminalreporter.write_line(
        "C++ CPU kernels: not built here, so their tests were skipped; `pip install -e .` in"
        " this checkout builds them.")
