"""Process-local host data <-> global device arrays sharded over the table axis.

With P processes, process p holds positions [first, stop) of the G devices on
the table axis (L = stop - first of them, `EmbeddingPlan.local_devices`) and
feeds only their share of every global batch of B samples:

  StackBatch buffers  [L, ...]          -> global [G, ...]
  dense, labels       [B * L / G, ...]  -> global [B, ...]

each sharded PartitionSpec(axis) over the table axis. One process (L = G) is
the special case where local and global coincide. Results travel the other
way with `to_host`: every process gets the whole global array. Decisions
that every process must take alike (is there another batch? stop now?) go
through `any_process`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from pipelining._steps import DeviceBatch
from sc_framework._byte_order import native_byte_order
from sc_framework.preprocessing import PreprocessedBatch


def _global_shape(shape: tuple[int, ...], num_devices: int, local_devices: int,
                  what: str) -> tuple[int, ...]:
  if not shape:
    raise ValueError(f"{what}: got a scalar; batch arrays need a leading batch dimension.")
  if shape[0] % local_devices:
    raise ValueError(
        f"{what}: this process's slice has {shape[0]} rows, which its {local_devices} devices"
        " cannot split evenly. Feed each process B * L / G rows of a global batch of B (L of"
        f" the G={num_devices} devices are local)."
    )
  return (shape[0] // local_devices * num_devices,) + tuple(shape[1:])


def to_global(tree: Any, sharding: NamedSharding, num_devices: int, local_devices: int,
              what: str) -> Any:
  """Process-local arrays (leading axis over the L local devices) -> global arrays.

  Args:
    tree: a pytree of host arrays, or None.
    sharding: the batch sharding over the G positions of the table axis.
    num_devices: G.
    local_devices: L, this process's positions on that axis.
    what: names the tree in error messages ("dense", "labels", ...).

  Returns:
    The pytree of global jax.Arrays (leading axis scaled by G / L).
  """
  if tree is None:
    return None
  leaves, treedef = jax.tree.flatten(tree)
  leaves = [native_byte_order(leaf) for leaf in leaves]  # '>f4' data read from files
  # Flat lists: jax reads a tuple in global_shape as a shape, also a NamedTuple.
  shapes = [_global_shape(np.shape(x), num_devices, local_devices, what) for x in leaves]
  return treedef.unflatten(jax.make_array_from_process_local_data(sharding, leaves, shapes))


def _owned_copies(tree: Any) -> Any:
  """The tree with every host array copied (jax arrays, which never change, kept).

  On CPU a jax array made from a host array may share its memory, and a data
  loader may refill its arrays for the next batch while this one is still to
  be trained on.
  """
  return jax.tree.map(lambda leaf: leaf if isinstance(leaf, jax.Array) else np.array(leaf), tree)


def global_batch(sparse: PreprocessedBatch, dense: Any, labels: Any, sharding: NamedSharding,
                 num_devices: int, local_devices: int) -> DeviceBatch:
  """A process's preprocessed stacks, dense features and labels as one global batch.

  The dense features and labels are the user's arrays, copied first
  (`_owned_copies`); the preprocessed stacks are this library's own.
  """
  return DeviceBatch(*(
      to_global(tree, sharding, num_devices, local_devices, what)
      for tree, what in ((sparse, "preprocessed ids"), (_owned_copies(dense), "dense"),
                         (_owned_copies(labels), "labels"))
  ))


def to_host(array: Any) -> np.ndarray:
  """The whole value of a (possibly multi-process) array, on every process."""
  if not isinstance(array, jax.Array) or array.is_fully_addressable:
    return np.asarray(jax.device_get(array))
  return np.asarray(multihost_utils.process_allgather(array, tiled=True))


@functools.lru_cache(maxsize=16)  # a few meshes per process; a sweep of many keeps the newest
def _max_over_positions(sharding: NamedSharding):
  replicated = NamedSharding(sharding.mesh, PartitionSpec())
  return jax.jit(lambda flags: jnp.max(flags, axis=0), out_shardings=replicated)


def any_process(flags: Sequence[bool], sharding: NamedSharding, num_devices: int,
                local_devices: int) -> tuple[bool, ...]:
  """For each flag, whether any process set it: one tiny collective.

  Every process must call it at the same point with as many flags; all get
  the same answer. With one process it returns the flags unchanged.
  """
  if jax.process_count() == 1:
    return tuple(bool(f) for f in flags)
  local = np.tile(np.asarray(flags, np.int32)[None, :], (local_devices, 1))
  array = jax.make_array_from_process_local_data(sharding, local, (num_devices, len(flags)))
  return tuple(bool(v) for v in np.asarray(_max_over_positions(sharding)(array)))
