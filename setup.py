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

from setuptools import Extension, setup


def _ffi_include_flags() -> list[str]:
  """-isystem for jaxlib's XLA FFI headers: their own warnings are not ours."""
  spec = importlib.util.find_spec("jaxlib")
  if spec is None or not spec.submodule_search_locations:
    return []
  include = os.path.join(list(spec.submodule_search_locations)[0], "include")
  return ["-isystem", include] if os.path.isdir(os.path.join(include, "xla", "ffi", "api")) else []


setup(
    ext_modules=[
        Extension(
            "sc_framework.primitives._cpu_kernels",
            sources=["sc_framework/primitives/_cpu_kernels.cc"],
            depends=[
                "sc_framework/primitives/_cpu_kernels_common.h",
                "sc_framework/primitives/_cpu_kernels_elementwise.h",
                "sc_framework/primitives/_cpu_kernels_fused.h",
                "sc_framework/primitives/_cpu_kernels_grouping.h",
                "sc_framework/primitives/_cpu_kernels_rows.h",
            ],
            # No errno from std::sqrt and no floating-point traps (neither is
            # read): loops over square roots and selects of quotients vectorise.
            # Results are unchanged (no reassociation, unlike -ffast-math).
            extra_compile_args=["-O3", "-std=c++17", "-fno-math-errno", "-fno-trapping-math",
                                "-Wall", "-Wextra", *_ffi_include_flags()],
            language="c++",
            optional=True,
        ),
        Extension(
            "sc_framework.preprocessing._host_kernels",
            sources=["sc_framework/preprocessing/_host_kernels.cc"],
            depends=[
                "sc_framework/preprocessing/_host_kernels_common.h",
                "sc_framework/preprocessing/_host_kernels_drop.h",
                "sc_framework/preprocessing/_host_kernels_rank.h",
                "sc_framework/preprocessing/_host_kernels_rank_kept.h",
                "sc_framework/preprocessing/_host_kernels_sort.h",
            ],
            extra_compile_args=["-O3", "-std=c++17", "-Wall", "-Wextra"],
            language="c++",
            optional=True,
        ),
    ],
)
