"""How glibc malloc keeps or returns freed host memory: two process-wide modes.

`keep_freed_memory` (training): keep freed memory for reuse, so the step's
temporaries do not page-fault every step. `return_freed_memory` (streaming
jobs such as the checkpoint converter): return large blocks to the kernel at
once, so the peak resident memory does not grow with the data.

On CPU, XLA allocates each step's temporaries (gathered rows, gradients,
optimizer intermediates: often hundreds of MB) with malloc. glibc serves
blocks above 32 MB with fresh mmap regions and returns them to the kernel on
free, so every step touches those pages anew and pays a page fault per 4 KB:
for a 26-table DLRM step that is most of the step time. `keep_freed_memory`
tells glibc to serve every block from its heap and to keep freed memory for
reuse, so after the first step the temporaries live in pages already mapped.
XLA allocates on its worker threads, and glibc gives each thread an arena of
its own whose heaps are at most 64 MB: a block that does not fit is mmap'd
regardless of M_MMAP_MAX, and a heap that empties is unmapped whatever the
trim threshold. So `keep_freed_memory` also limits glibc to one arena (the
main heap, grown with brk, has neither limit). Threads that allocated before
the call keep the arena they have: call it early (before the first jitted
step), as the Trainer does when it is built.

The cost: the process's resident memory stays at its peak instead of
shrinking after large temporaries are freed. The setting is process-wide and
only affects glibc-based systems (Linux); elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_MAX_INT = 2**31 - 1


@functools.cache
def _libc():
  if not sys.platform.startswith("linux"):
    return None
  name = ctypes.util.find_library("c")
  if name is None:
    return None
  try:
    libc = ctypes.CDLL(name)
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc
  except (OSError, AttributeError):
    return None


def keep_freed_memory() -> bool:
  """Makes glibc malloc reuse freed memory instead of unmapping it.

  Sets M_MMAP_MAX = 0 (no per-block mmap; every block comes from the heap),
  M_TRIM_THRESHOLD to its maximum (freed heap memory is kept) and
  M_ARENA_MAX = 1 (threads that have not allocated yet share the main heap;
  see the module docstring). Idempotent.

  Returns:
    True if the allocator was configured, False where glibc's mallopt is not
    available (non-Linux, musl, ...).
  """
  libc = _libc()
  if libc is None:
    return False
  ok = libc.mallopt(_M_MMAP_MAX, 0) == 1
  ok &= libc.mallopt(_M_TRIM_THRESHOLD, _MAX_INT) == 1
  ok &= libc.mallopt(_M_ARENA_MAX, 1) == 1
  return bool(ok)


def return_freed_memory(threshold_bytes: int = 128 * 1024) -> bool:
  """Makes glibc serve blocks >= threshold with mmap, unmapped on free.

  By default glibc raises its mmap threshold to the largest block freed so far
  (up to 32 MiB), after which multi-MiB buffers come from arenas that keep
  freed memory, so a job streaming many large buffers grows its peak RSS.
  Fixing the threshold (M_MMAP_THRESHOLD) keeps it flat.

  Returns:
    True if the allocator was configured, False where glibc's mallopt is not
    available.
  """
  libc = _libc()
  if libc is None:
    return False
  return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(threshold_bytes)) == 1)
