"""Whether a plan's tables and slots fit the memory of the host holding its CPU devices.

On CPU devices the tables live in host memory. Linux hands out memory it does
not have (overcommit) and, when the rows are first written, its out-of-memory
killer ends the process: no exception a user could catch or read. So before
tables are created on CPU devices, their bytes on this process's devices are
compared with the host's memory (physical memory and swap, or the container's
cgroup limit where lower), and a plan that cannot fit is refused by name.
Accelerators report their own out-of-memory errors and are not checked.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

import jax
import numpy as np

from sc_framework.primitives._plan import EmbeddingPlan

if TYPE_CHECKING:  # _state calls this module
  from sc_framework.primitives._state import EmbeddingVariables

_GIB = float(1 << 30)


def _read_int(path: str) -> int | None:
  try:
    with open(path, encoding="ascii") as f:
      return int(f.read().split()[0])
  except (OSError, ValueError, IndexError):
    return None  # absent ("max" for no limit, or not Linux)


def host_memory_bytes() -> int | None:
  """Physical memory plus swap, capped by a cgroup v2 limit; None where unknown."""
  try:
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (AttributeError, ValueError, OSError):
    return None
  try:
    with open("/proc/meminfo", encoding="ascii") as f:
      swap = next((int(line.split()[1]) * 1024 for line in f if line.startswith("SwapTotal:")), 0)
  except (OSError, ValueError, IndexError):
    swap = 0
  limit = _read_int("/sys/fs/cgroup/memory.max")
  if limit is not None:  # a container's memory, and its swap where limited ("max": the host's)
    swap_limit = _read_int("/sys/fs/cgroup/memory.swap.max")
    return min(total + swap, limit + (swap if swap_limit is None else min(swap, swap_limit)))
  return total + swap


def _bytes_per_stack(shapes: EmbeddingVariables) -> dict[str, int]:
  """Stack name -> bytes of its table and slots on all of the plan's devices."""
  nbytes = lambda array: math.prod(array.shape) * np.dtype(array.dtype).itemsize
  return {name: nbytes(table) + sum(nbytes(slot) for slot in shapes.slots[name].values())
          for name, table in shapes.tables.items()}


def check_fits_host_memory(plan: EmbeddingPlan, shapes: EmbeddingVariables) -> None:
  """Raises MemoryError when the plan's tables and slots (`shapes`, as
  `embedding_variable_shapes` gives them) on this process's CPU devices exceed
  the host's memory (see the module doc); nothing otherwise.

  Each of the G devices holds 1 / G of every stack, so this process's
  L CPU devices hold L / G of the bytes.
  """
  devices = [d for d in plan.mesh.devices.flat if d.process_index == jax.process_index()]
  local_cpu = sum(d.platform == "cpu" for d in devices)
  if not local_cpu:
    return
  limit = host_memory_bytes()
  per_stack = _bytes_per_stack(shapes)
  needed = sum(per_stack.values()) * local_cpu // plan.num_devices
  if limit is None or needed <= limit:
    return
  largest = max(per_stack, key=per_stack.get)
  stack = plan.layout.stack(largest)
  raise MemoryError(
      f"the embedding tables and slots need {needed / _GIB:,.1f} GiB on this process's"
      f" {local_cpu} CPU device(s), more than this host's {limit / _GIB:,.1f} GiB of memory"
      f" (physical and swap, or its container's limit); creating them would get the process"
      f" killed. The largest is stack {largest!r} (tables {list(stack.table_names)}, "
      f"{stack.vocabulary_size:,} rows x {stack.padded_embedding_dim:,} columns with its"
      f" slots: {per_stack[largest] / _GIB:,.1f} GiB in all). Check the vocabulary sizes and"
      " embedding dims, store the tables as bfloat16, or shard them over more hosts."
  )
