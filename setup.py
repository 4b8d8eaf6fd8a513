"""Builds the optional C++ extensions: the CPU kernels and the preprocessing loops.

Everything else is configured in pyproject.toml. The CPU kernels (an XLA FFI
extension module) need a C++17 compiler and the XLA FFI headers shipped with
jaxlib; when either is missing the build is skipped (optional=True) and the
portable XLA backend is used. The host preprocessing loops need only a C++17
compiler and Python's headers; without them preprocessing runs its numpy code,
which gives the same results.
"""

import importlib.util
import os
import platform
import sys

from setuptools import Extension, setup


def _ffi_include_flags() -> list[str]:
  """-isystem for jaxlib's XLA FFI headers: their own warnings are not ours."""
  spec = importlib.util.find_spec("jaxlib")
  if spec is None or not spec.submodule_search_locations:
    return []
  include = os.path.join(list(spec.submodule_search_locations)[0], "include")
  return ["-isystem", include] if os.path.isdir(os.path.join(include, "xla", "ffi", "api")) else []


_CPU_KERNEL_SOURCES = dict(
    sources=["sc_framework/primitives/_cpu_kernels.cc"],
    depends=[
        "sc_framework/primitives/_cpu_kernels_common.h",
        "sc_framework/primitives/_cpu_kernels_elementwise.h",
        "sc_framework/primitives/_cpu_kernels_fused.h",
        "sc_framework/primitives/_cpu_kernels_grouping.h",
        "sc_framework/primitives/_cpu_kernels_rows.h",
    ],
    language="c++",
    optional=True,
)

# No errno from std::sqrt and no floating-point traps (neither is read): loops
# over square roots and selects of quotients vectorise. No contraction of
# a * b + c into a fused multiply-add: results are unchanged (no
# reassociation, unlike -ffast-math), and the same in both builds below.
# -g0 overrides the -g of Python's own flags: debug information was 90% of the
# installed modules' size (5.2 MB of the kernels' 5.6 MB).
_CPU_KERNEL_FLAGS = ["-O3", "-g0", "-std=c++17", "-fno-math-errno", "-fno-trapping-math",
                     "-ffp-contract=off", "-Wall", "-Wextra"]


def _cpu_kernel_extensions() -> list[Extension]:
  """The CPU kernels for any CPU, and on x86-64 a second build for x86-64-v3 CPUs.

  The second (AVX2, FMA, BMI; 12-16% shorter embedding steps) is loaded
  instead of the first only where the CPU has those instructions
  (`sc_framework.primitives._row_ops`); a compiler without -march=x86-64-v3
  (GCC < 11, Clang < 12) skips it.
  """
  flags = [*_CPU_KERNEL_FLAGS, *_ffi_include_flags()]
  extensions = [Extension("sc_framework.primitives._cpu_kernels", extra_compile_args=flags,
                          **_CPU_KERNEL_SOURCES)]
  if platform.machine().lower() in ("x86_64", "amd64") and sys.platform != "win32":
    extensions.append(Extension(
        "sc_framework.primitives._cpu_kernels_x86_64_v3",
        define_macros=[("SC_KERNELS_X86_64_V3", "1")],
        extra_compile_args=[*flags, "-march=x86-64-v3"], **_CPU_KERNEL_SOURCES))
  return extensions


setup(
    ext_modules=[
        *_cpu_kernel_extensions(),
        Extension(
            "sc_framework.preprocessing._host_kernels",
            sources=["sc_framework/preprocessing/_host_kernels.cc"],
            depends=[
                "sc_framework/preprocessing/_host_kernels_common.h",
                "sc_framework/preprocessing/_host_kernels_compact.h",
                "sc_framework/preprocessing/_host_kernels_drop.h",
                "sc_framework/preprocessing/_host_kernels_rank.h",
                "sc_framework/preprocessing/_host_kernels_rank_kept.h",
                "sc_framework/preprocessing/_host_kernels_sort.h",
            ],
            extra_compile_args=["-O3", "-g0", "-std=c++17", "-Wall", "-Wextra"],
            language="c++",
            optional=True,
        ),
    ],
)
