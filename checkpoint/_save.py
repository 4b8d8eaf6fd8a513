"""Saving stacked tables and slots: validation, device-to-host snapshot, write.

A save has two parts. `snapshot` runs on the caller's thread: it copies every
addressable shard (replica 0 only, so each row is written once) to host
memory; that copy is all an asynchronous save blocks the training loop for.
`write` runs in the background: it creates one zarr v3 array per table and
slot (`_storage`), writes every host block into it, then writes layout.json
and, last, manifest.json (`_format`). The atomic commit itself (temporary
directory, rename) is Orbax's, done after `write` returns.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts
from etils import epath

from checkpoint import _optimizers, _storage
from checkpoint._format import (
    LAYOUT_FILE,
    MANIFEST_FILE,
    ArrayInfo,
    GroupInfo,
    Manifest,
    array_dir,
    numpy_dtype,
)
from checkpoint._names import check_unique_components
from checkpoint._storage import StorageOptions
from sc_framework.optimizers import SlotSpec
from sc_framework.stacking import EmbeddingLayout


@dataclasses.dataclass(frozen=True)
class HostBlock:
  """A block of one array, copied to host memory, waiting to be written."""

  group: str
  slot: str | None
  rows: slice
  columns: slice
  data: np.ndarray


def check_state(
    layout: EmbeddingLayout,
    tables: Mapping[str, jax.Array],
    slots: Mapping[str, Mapping[str, jax.Array]],
    slot_specs: Mapping[str, Sequence[SlotSpec]],
) -> dict[str, tuple[SlotSpec, ...]]:
  """Checks device state against the layout and slot declarations.

  Returns:
    stack name -> its slot specs (empty for stacks not in `slot_specs`).

  Raises:
    ValueError: naming the stack or slot whose array is missing, unexpected,
      or has the wrong shape or a non-float dtype.
  """
  stacks = set(layout.stack_names)
  for what, keys in (("tables", tables), ("slots", slots), ("slot_specs", slot_specs)):
    extra = sorted(set(keys) - stacks)
    if extra:
      raise ValueError(
          f"EmbeddingSave: {what} names stacks {extra} that the layout does not have; its"
          f" stacks are {sorted(stacks)}."
      )
  missing = sorted(stacks - set(tables))
  if missing:
    raise ValueError(f"EmbeddingSave: no table array for stacks {missing}.")
  check_unique_components("stack", stacks)
  resolved = {}
  for stack in layout.stacks:
    specs = tuple(slot_specs.get(stack.name, ()))
    _check_array(f"stack {stack.name!r} table", tables[stack.name], stack.shape)
    given = dict(slots.get(stack.name, {}))
    declared = [spec.name for spec in specs]
    if sorted(given) != sorted(declared):
      raise ValueError(
          f"EmbeddingSave: stack {stack.name!r} declares slots {declared} but got slot arrays"
          f" {sorted(given)}. Pass one array per declared slot (the optimizer's slots())."
      )
    check_unique_components(f"stack {stack.name!r} slot", declared)
    for spec in specs:
      shape = (stack.vocabulary_size, spec.stacked_width(stack.padded_embedding_dim))
      _check_array(f"stack {stack.name!r} slot {spec.name!r}", given[spec.name], shape)
    resolved[stack.name] = specs
  return resolved


def _check_array(what: str, array, shape: tuple[int, int]) -> None:
  if not isinstance(array, jax.Array):
    raise TypeError(
        f"EmbeddingSave: {what} is a {type(array).__name__}, not a jax.Array; place it on"
        " the mesh with jax.device_put first."
    )
  actual = tuple(getattr(array, "shape", ()))
  if actual != shape:
    raise ValueError(f"EmbeddingSave: {what} has shape {actual}, expected {shape} from the layout.")
  if not jnp.issubdtype(array.dtype, jnp.floating):
    raise ValueError(
        f"EmbeddingSave: {what} has dtype {array.dtype}; tables and slots must be floating point."
    )


def state_manifest(args) -> Manifest:
  """The manifest of the state an `EmbeddingSave` holds, after checking it (`check_state`).

  Its groups name the optimizers of `args.optimizers` (`_optimizers.resolve`).
  """
  slot_specs, names = _optimizers.resolve(
      "EmbeddingSave", args.layout.stack_names, args.slot_specs, args.optimizers
  )
  specs = check_state(args.layout, args.tables, args.slots, slot_specs)
  dtypes = {(name, None): np.dtype(array.dtype) for name, array in args.tables.items()}
  for stack, group in args.slots.items():
    dtypes.update({(stack, slot): np.dtype(array.dtype) for slot, array in group.items()})
  manifest = stacked_manifest(args.layout, dtypes, specs, args.storage, names)
  return dataclasses.replace(manifest, step_integrity=bool(args.step_integrity))


def stacked_manifest(
    layout: EmbeddingLayout,
    dtypes: Mapping[tuple[str, str | None], np.dtype],
    slot_specs: Mapping[str, Sequence[SlotSpec]],
    storage: StorageOptions,
    optimizers: Mapping[str, str | None] | None = None,
) -> Manifest:
  """The manifest of a stacked checkpoint of `layout`.

  Args:
    dtypes: (stack, None) -> table dtype; (stack, slot) -> slot dtype.
    optimizers: stack -> the name of the optimizer owning its slots
      (`_optimizers.optimizer_name`); stacks left out, or None, are unknown.
  """
  optimizers = optimizers or {}
  groups = []
  for stack in layout.stacks:

    def info(slot: str | None, width: int, stack=stack) -> ArrayInfo:
      dtype = np.dtype(dtypes[(stack.name, slot)])
      rows = _storage.chunk_rows_for(
          stack.rows_per_shard, width * dtype.itemsize, storage.chunk_bytes
      )
      return ArrayInfo((stack.vocabulary_size, width), dtype.name, rows)

    specs = tuple(slot_specs.get(stack.name, ()))
    groups.append(
        GroupInfo(
            stack.name,
            info(None, stack.padded_embedding_dim),
            specs,
            {
                spec.name: info(spec.name, spec.stacked_width(stack.padded_embedding_dim))
                for spec in specs
            },
            optimizers.get(stack.name),
        )
    )
  return Manifest("stacked", tuple(groups), storage)


def unstacked_manifest(
    tables: Mapping[str, tuple[int, int]],
    dtypes: Mapping[tuple[str, str | None], np.dtype],
    slot_specs: Mapping[str, Sequence[SlotSpec]],
    storage: StorageOptions,
    optimizers: Mapping[str, str | None] | None = None,
) -> Manifest:
  """The manifest of an unstacked checkpoint: table -> (V, D) arrays of its own.

  `optimizers`: table -> optimizer name, as for `stacked_manifest`.
  """
  check_unique_components("table", tables)
  optimizers = optimizers or {}
  groups = []
  for name, (vocab, dim) in tables.items():

    def info(slot: str | None, width: int, name=name, vocab=vocab) -> ArrayInfo:
      dtype = np.dtype(dtypes[(name, slot)])
      rows = max(1, min(vocab, storage.chunk_bytes // max(1, width * dtype.itemsize)))
      return ArrayInfo((vocab, width), dtype.name, rows)

    specs = tuple(slot_specs.get(name, ()))
    groups.append(
        GroupInfo(
            name,
            info(None, dim),
            specs,
            {s.name: info(s.name, s.stacked_width(dim)) for s in specs},
            optimizers.get(name),
        )
    )
  return Manifest("unstacked", tuple(groups), storage)


def snapshot(
    tables: Mapping[str, jax.Array], slots: Mapping[str, Mapping[str, jax.Array]]
) -> list[HostBlock]:
  """Copies every addressable shard (replica 0) of every array to host memory.

  All transfers start before the first is awaited. On accelerators the
  result is a host copy. On CPU, `np.asarray` is a read-only view of the
  device buffer: no copy, and JAX declines to donate a buffer while such a
  view is alive, so a training step that donates the tables while the write
  runs gets fresh buffers and the snapshot stays intact.
  """
  pending = []
  arrays = [(stack, None, array) for stack, array in tables.items()]
  arrays += [
      (stack, slot, array) for stack, group in slots.items() for slot, array in group.items()
  ]
  for group, slot, array in arrays:
    for shard in array.addressable_shards:
      if shard.replica_id != 0:
        continue
      shard.data.copy_to_host_async()
      pending.append((group, slot, array.shape, shard))
  blocks = []
  for group, slot, shape, shard in pending:
    data = np.asarray(shard.data)
    rows, columns = (_normalize(index, size) for index, size in zip(shard.index, shape))
    blocks.append(HostBlock(group, slot, rows, columns, data))
  return blocks


def _normalize(index: slice, size: int) -> slice:
  start, stop, step = index.indices(size)
  if step != 1:
    raise ValueError(f"unsupported strided shard index {index}.")
  return slice(start, stop)


async def create_arrays(
    directory: epath.Path, manifest: Manifest
) -> dict[tuple[str, str | None], ts.TensorStore]:
  """Creates every array of the manifest (concurrently) and returns them opened."""
  keys, futures = [], []
  for group in manifest.groups:
    for slot, info in [(None, group.table)] + list(group.slots.items()):
      path = array_dir(directory, manifest.kind, group.name, slot)
      dtype = numpy_dtype(info.dtype)
      spec = _storage.create_spec(path, info.shape, dtype, info.chunk_rows, manifest.storage)
      keys.append((group.name, slot))
      futures.append(_storage.open_for_write(spec))
  stores = [await future for future in futures]
  return dict(zip(keys, stores))


def write_metadata(
    directory: epath.Path, manifest: Manifest, layout: EmbeddingLayout | None
) -> None:
  """Writes layout.json (stacked) and then manifest.json, which marks completion."""
  if layout is not None:
    (directory / LAYOUT_FILE).write_text(layout.to_json())
  (directory / MANIFEST_FILE).write_text(manifest.to_json())


async def write(
    directory: epath.Path,
    manifest: Manifest,
    layout: EmbeddingLayout | None,
    blocks: list[HostBlock],
    *,
    primary: bool,
) -> None:
  """Writes host blocks into freshly created arrays, then the metadata."""
  stores = await create_arrays(directory, manifest)
  futures = [
      stores[(block.group, block.slot)][block.rows, block.columns].write(
          block.data, can_reference_source_data_indefinitely=True
      )
      for block in blocks
  ]
  blocks.clear()  # TensorStore keeps each block alive only until it is written.
  await asyncio.gather(*(_commit(future) for future in futures))
  if primary:
    write_metadata(directory, manifest, layout)


async def _commit(future) -> None:
  await future.commit


def run_sync(coroutine: Coroutine[Any, Any, Any]) -> Any:
  """Runs a coroutine to completion, also from a thread with a running event loop."""
  try:
    asyncio.get_running_loop()
  except RuntimeError:
    return asyncio.run(coroutine)
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    return pool.submit(asyncio.run, coroutine).result()
