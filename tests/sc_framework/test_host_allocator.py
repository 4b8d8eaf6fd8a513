"""The host allocator modes configure glibc where it exists and never fail elsewhere.

The modes are process-wide and cannot be undone (glibc keeps its arena limit),
so each is tried in a fresh Python process of its own, never in the test
process. What a mode must change is measured there: the page faults of
touching a freed block again (minor faults, one per 4 KiB page mapped anew).
"""

import ctypes.util
import subprocess
import sys

import numpy as np
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
  result = subprocess.run(
      [sys.executable, "-c", _PROBE, mode, str(size_mib), host_allocator.__file__],
      capture_output=True, text=True, check=True, timeout=60)
  configured, faults = result.stdout.split()
  return configured, int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux") or ctypes.util.find_library("c") is None,
                    reason="glibc mallopt is Linux-only")
def test_each_mode_changes_what_a_freed_block_costs_again():
  pages = lambda mib: (mib << 20) // 4096
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


# ----------------------------------------------------------------------------- huge pages

_HUGE_PAGE = 2 << 20


def _huge_pages_here() -> bool:
  from sc_framework.primitives._row_ops import cpu_kernels_available

  return host_allocator.transparent_huge_pages() not in (None, "never") and cpu_kernels_available()


needs_huge_pages = pytest.mark.skipif(
    not _huge_pages_here(), reason="needs Linux transparent huge pages and the C++ kernels")


def _vm_flags(address: int) -> set[str]:
  """The VmFlags of the mapping that holds `address` (/proc/self/smaps); "hg": MADV_HUGEPAGE."""
  holds = False
  with open("/proc/self/smaps", encoding="ascii") as smaps:
    for line in smaps:
      head = line.split(maxsplit=1)[0]
      if head == "VmFlags:":
        if holds:
          return set(line.split()[1:])
      elif not head.endswith(":") and "-" in head:
        start, end = (int(bound, 16) for bound in head.split("-"))
        holds = start <= address < end
  raise AssertionError(f"no mapping holds address {address:#x}")


def _inner_huge_page(address: int) -> int:
  """The first 2 MiB-aligned address at or after `address`."""
  return -(-address // _HUGE_PAGE) * _HUGE_PAGE


@pytest.fixture
def huge_pages_off_after():
  yield
  host_allocator.back_tables_with_huge_pages(None)


@pytest.mark.parametrize("min_bytes", [0, -1, True, 2.5, "64M"])
def test_huge_page_threshold_must_be_a_positive_int(min_bytes):
  with pytest.raises(ValueError, match=f"min_bytes must be an int >= 1.*got {min_bytes!r}"):
    host_allocator.back_tables_with_huge_pages(min_bytes)


def test_no_huge_pages_where_the_system_has_none(monkeypatch, huge_pages_off_after):
  monkeypatch.setattr(host_allocator, "transparent_huge_pages", lambda: "never")
  buffer = np.ones(3 * _HUGE_PAGE // 4, np.float32)
  assert host_allocator.back_tables_with_huge_pages() is False
  assert host_allocator.advise_huge_pages(buffer.ctypes.data, buffer.nbytes) is False
  with pytest.raises(ValueError, match="nbytes must be >= 0, got -1"):
    host_allocator.advise_huge_pages(buffer.ctypes.data, -1)


@needs_huge_pages
def test_advise_huge_pages_marks_the_whole_huge_pages_and_keeps_the_contents():
  buffer = np.random.default_rng(0).normal(size=3 * _HUGE_PAGE // 4).astype(np.float32)
  before = buffer.copy()
  assert host_allocator.advise_huge_pages(buffer.ctypes.data, buffer.nbytes) is True
  assert "hg" in _vm_flags(_inner_huge_page(buffer.ctypes.data))
  np.testing.assert_array_equal(buffer, before)
  # Less than one whole huge page inside the range: nothing to advise.
  assert host_allocator.advise_huge_pages(_inner_huge_page(buffer.ctypes.data) + 4096,
                                          _HUGE_PAGE - 8192) is False


@needs_huge_pages
@pytest.mark.parametrize("optimizer_name", ["sgd", "adam"])
def test_a_donated_table_gets_huge_pages_at_its_update_with_the_same_bits(
    optimizer_name, huge_pages_off_after):
  """The fused update of a donated table (and slots) asks for huge pages; values do not change."""
  import functools

  import jax
  import jax.numpy as jnp

  from sc_framework.optimizers import SGD, Adam
  from sc_framework.primitives._row_ops import CPU_KERNEL_OPS

  optimizer = {"sgd": SGD(learning_rate=0.1), "adam": Adam(learning_rate=0.1)}[optimizer_name]
  rows, dim, count = 12_000, 128, 3_000  # 6 MiB per table and per slot
  rng = np.random.default_rng(1)
  table = rng.normal(size=(rows, dim)).astype(np.float32)
  index = jnp.asarray(rng.choice(rows, count, replace=False).astype(np.int32))
  grads = jnp.asarray(rng.normal(size=(count, dim)).astype(np.float32))
  dims = jnp.full((count,), dim, jnp.int32)
  slots = {spec.name: np.abs(rng.normal(size=(rows, dim))).astype(np.float32)
           for spec in optimizer.slots()}
  update = CPU_KERNEL_OPS.fused_update(optimizer, jnp.asarray(table),
                                       {n: jnp.asarray(s) for n, s in slots.items()})

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(table, slots):
    return update(table, slots, index, 0, dims, row_grads=grads)

  def run(min_bytes):
    assert host_allocator.back_tables_with_huge_pages(min_bytes) is (min_bytes is not None)
    arrays = (jnp.asarray(table), {n: jnp.asarray(s) for n, s in slots.items()})
    addresses = [a.unsafe_buffer_pointer() for a in jax.tree.leaves(arrays)]
    for _ in range(2):
      arrays = step(*arrays)
    jax.block_until_ready(arrays)
    assert [a.unsafe_buffer_pointer() for a in jax.tree.leaves(arrays)] == addresses, (
        "the donated table was not updated in place")
    return arrays, addresses

  (plain_table, plain_slots), _ = run(None)
  (huge_table, huge_slots), addresses = run(4 << 20)
  for address in addresses:
    assert "hg" in _vm_flags(_inner_huge_page(address))
  np.testing.assert_array_equal(np.asarray(huge_table), np.asarray(plain_table))
  for name in slots:
    np.testing.assert_array_equal(np.asarray(huge_slots[name]), np.asarray(plain_slots[name]))
