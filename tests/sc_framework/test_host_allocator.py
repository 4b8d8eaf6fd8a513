"""The host allocator modes configure glibc where it exists and never fail elsewhere.

The modes are process-wide and cannot be undone (glibc keeps its arena limit),
so each is tried in a fresh Python process of its own, never in the test
process. What a mode must change is measured there: the page faults of
touching a freed block again (minor faults, one per 4 KiB page mapped anew).
"""

import ctypes.util
import os
import subprocess
import sys

import pytest

from sc_framework import host_allocator

# Prints whether the mode was configured, and the page faults of touching a
# block of `size` MiB again after freeing it (after an 8 MiB block was freed,
# which raises glibc's own mmap threshold past the smaller block).
_PROBE = """
import ctypes, importlib.util, resource, sys
spec = importlib.util.spec_from_file_location("host_allocator", sys.argv[3])
host_allocator = importlib.util.module_from_spec(spec)  # alone: no jax to import
spec.loader.exec_module(host_allocator)
libc = ctypes.CDLL(None)
libc.prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: base pages only, so a fault per page
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def touch(size):
  block = libc.malloc(size)
  ctypes.memset(block, 1, size)
  libc.free(block)
mode, size = sys.argv[1], int(sys.argv[2]) << 20
configured = None if mode == "default" else (  # twice: idempotent
    getattr(host_allocator, mode)() and getattr(host_allocator, mode)())
touch(8 << 20)
touch(size)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touch(size)
print(configured, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults_touching_again(mode: str, size_mib: int) -> tuple[str, int]:
  # glibc's defaults: a user's tunables, malloc variables or preloaded allocator
  # (jemalloc, tcmalloc) would change what is measured.
  environment = {name: value for name, value in os.environ.items()
                 if not name.startswith(("MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD"))}
  result = subprocess.run(
      [sys.executable, "-c", _PROBE, mode, str(size_mib), host_allocator.__file__],
      capture_output=True, text=True, check=True, timeout=60, env=environment)
  configured, faults = result.stdout.split()
  return configured, int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux") or ctypes.util.find_library("c") is None,
                    reason="glibc mallopt is Linux-only")
def test_each_mode_changes_what_a_freed_block_costs_again():
  # The kernel's base page: 4 KiB on x86-64, 16 or 64 KiB on some arm64 kernels.
  pages = lambda mib: (mib << 20) // os.sysconf("SC_PAGE_SIZE")
  # glibc's default: a 64 MiB block is mmap'd and unmapped on free, so touching
  # it again faults every page; a 1 MiB one is reused from the heap.
  assert _faults_touching_again("default", 64)[1] >= pages(64) // 2
  assert _faults_touching_again("default", 1)[1] < pages(1) // 4
  # keep_freed_memory: every block is served from the heap and kept.
  configured, faults = _faults_touching_again("keep_freed_memory", 64)
  assert configured == "True" and faults < pages(64) // 64
  # return_freed_memory: blocks of 128 KiB and more are unmapped on free.
  configured, faults = _faults_touching_again("return_freed_memory", 1)
  assert configured == "True" and faults >= pages(1) // 2


def test_unavailable_libc_is_a_no_op(monkeypatch):
  monkeypatch.setattr(host_allocator, "_libc", lambda: None)
  assert host_allocator.keep_freed_memory() is False
  assert host_allocator.return_freed_memory() is False
