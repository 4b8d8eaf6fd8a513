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

`back_tables_with_huge_pages` (training on large tables, Linux): the tables
the CPU kernels update in place get transparent huge pages (2 MiB). A step
reads and writes rows at random across tables of hundreds of MB; with 4 KiB
pages nearly every row costs a TLB miss. The cost: a one-time copy of each
table into huge pages at its first update (0.2 to 2.8 s for 665 MB measured
on one machine, most of it the kernel finding free 2 MiB pages).
`advise_huge_pages` does the same for any buffer, e.g. another library's.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"

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


def transparent_huge_pages() -> str | None:
  """This system's transparent huge page mode: "always", "madvise", "never"; None: not Linux or unknown."""
  if not sys.platform.startswith("linux"):
    return None
  try:
    with open(_THP_SETTING, encoding="ascii") as setting:  # a local system file, never a user path
      text = setting.read()
  except OSError:
    return None
  start, end = text.find("["), text.find("]")
  return text[start + 1 : end] if 0 <= start < end else None


def _huge_page_kernels():
  """The C++ kernels module when huge pages can be asked for here, else None."""
  if transparent_huge_pages() in (None, "never"):
    return None
  from sc_framework.primitives import _row_ops  # pylint: disable=g-import-not-at-top

  return _row_ops.loaded_cpu_kernels()


def back_tables_with_huge_pages(min_bytes: int | None = 64 * 2**20) -> bool:
  """Backs the large tables the CPU kernels update in place with huge pages.

  From this call on, the first in-place update (a donated table: the fused
  optimizer updates, the scatter of the generic path) of every table or slot
  of at least `min_bytes` asks Linux for transparent huge pages for it
  (MADV_HUGEPAGE) and to move its pages into them now (MADV_COLLAPSE, Linux
  6.1 and newer; older kernels move them in the background, slowly). Values
  never change; only the step time does (see the module docstring for the
  one-time cost). Process-wide, like the malloc modes; idempotent.

  Args:
    min_bytes: the smallest table (or slot) in bytes that gets huge pages;
      None turns it off for tables updated from then on.

  Returns:
    True where it is in effect: Linux with transparent huge pages not
    "never" and the C++ kernels built. False elsewhere (nothing changes).

  Raises:
    ValueError: min_bytes < 1.
  """
  if min_bytes is not None and (isinstance(min_bytes, bool) or not isinstance(min_bytes, int)
                                or min_bytes < 1):
    raise ValueError(f"min_bytes must be an int >= 1, or None to turn huge pages off;"
                     f" got {min_bytes!r}.")
  kernels = _huge_page_kernels()
  if kernels is None:
    return False
  kernels.set_huge_page_tables(0 if min_bytes is None else min_bytes)
  return min_bytes is not None


def advise_huge_pages(address: int, nbytes: int) -> bool:
  """Asks Linux to back [address, address + nbytes) with transparent huge pages.

  The whole 2 MiB pages inside the range, now (MADV_COLLAPSE where the
  kernel has it) and for future page faults (MADV_HUGEPAGE). The memory must
  be a live buffer the caller owns (e.g. `tensor.data_ptr()` and its byte
  size); its contents do not change.

  Returns:
    Whether Linux accepted the advice for at least one huge page (False: not
    Linux, huge pages "never", the C++ kernels not built, or the range holds
    no whole 2 MiB page).
  """
  if nbytes < 0:
    raise ValueError(f"nbytes must be >= 0, got {nbytes}.")
  kernels = _huge_page_kernels()
  return bool(kernels is not None and kernels.advise_huge_pages(int(address), int(nbytes)))
