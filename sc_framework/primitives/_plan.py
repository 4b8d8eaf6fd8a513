"""`EmbeddingPlan`: everything static about a model's embeddings.

A plan bundles the feature specs, the stacked layout, and the mesh axis that
holds the tables. It is frozen and hashable, so jitted functions take it as a
static argument. Tables are sharded PartitionSpec(axis, None) over the G
devices of `axis`; batches are sharded data-parallel over the same devices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sc_framework._renamed import SHARDS_RENAMED, refusing_renamed_keywords
from sc_framework.optimizers import OptimizerSpec, SlotSpec
from sc_framework.optimizers._base import check_schedule_at_start
from sc_framework.preprocessing._batch import StackSignature, stack_signature
from sc_framework.specs import FeatureSpec, TableSpec, tables_of, validate_feature_specs
from sc_framework.stacking import (
    EmbeddingLayout,
    StackLayout,
    auto_stack_tables,
    check_layout_fits_specs,
    check_rows_addressable,
)

DEFAULT_AXIS_NAME = "devices"


def process_major_devices(devices: Sequence[jax.Device] | None = None) -> list[jax.Device]:
  """Devices sorted by (process_index, id): the device order of a table axis.

  On a 1-D axis in this order each process holds one contiguous block of
  positions, so it feeds one contiguous slice of every global batch
  (`EmbeddingPlan.local_devices`). With one process it is jax.devices().

  Args:
    devices: the devices to order; None: all devices of every process.
  """
  if devices is None:
    check_devices_per_process()
  return sorted(jax.devices() if devices is None else devices,
                key=lambda d: (d.process_index, d.id))


def check_devices_per_process() -> None:
  """Checks that this process holds its equal share of the job's devices.

  A job of P processes must give each the same number of devices: JAX's
  multi-process utilities and Orbax's checkpoints reshape the devices to
  [P, devices per process]. With a different count here, the total is not P
  times this process's count. A no-op for one process.

  Raises:
    ValueError: naming this process's count, the job's total and what to change.
  """
  processes, mine, total = jax.process_count(), jax.local_device_count(), jax.device_count()
  if processes > 1 and total != processes * mine:
    raise ValueError(
        f"process {jax.process_index()} has {mine} devices, but the job's {processes} processes"
        f" have {total} in all: every process must have the same number of devices (JAX's"
        " multi-process utilities and Orbax checkpoints assume it). Start every process with"
        " the same device count: on CPU the same jax_num_cpu_devices (the examples'"
        " --cpu-devices) or --xla_force_host_platform_device_count in XLA_FLAGS."
    )


def default_mesh(axis_name: str = DEFAULT_AXIS_NAME) -> Mesh:
  """A 1-D mesh of every device of every process, in `process_major_devices` order."""
  return Mesh(np.array(process_major_devices()), (axis_name,))


def mesh_axis_size(mesh: Mesh, axis_name: str) -> int:
  """The number of devices along `axis_name` of `mesh`.

  Raises:
    ValueError: the mesh has no such axis (naming the axes it has).
  """
  if axis_name not in mesh.axis_names:
    raise ValueError(
        f"mesh has no axis {axis_name!r}; its axes are {mesh.axis_names}. Pass"
        f" axis_name= the axis that holds the tables and the batch (one of {mesh.axis_names})."
    )
  return mesh.shape[axis_name]


@dataclasses.dataclass(frozen=True)
class EmbeddingPlan:
  """Feature specs + layout + the table axis of a mesh.

  Attributes:
    feature_specs: the model's features.
    layout: the stacked layout; its num_devices must equal the mesh axis size.
    mesh: the device mesh.
    axis_name: the mesh axis over which tables (rows) and batches (samples)
      are sharded.
  """

  feature_specs: tuple[FeatureSpec, ...]
  layout: EmbeddingLayout
  mesh: Mesh
  axis_name: str = DEFAULT_AXIS_NAME

  def __post_init__(self):
    features = validate_feature_specs(self.feature_specs)
    object.__setattr__(self, "feature_specs", features)
    axis_size = mesh_axis_size(self.mesh, self.axis_name)
    if axis_size != self.layout.num_devices:
      raise ValueError(
          f"the layout is for G={self.layout.num_devices} devices but mesh axis"
          f" {self.axis_name!r} has {axis_size}. Build the layout with"
          f" num_devices={axis_size}."
      )
    check_layout_fits_specs(self.layout, features)
    check_rows_addressable(self.layout)
    for feature in features:
      if feature.batch_size % self.layout.num_devices:
        raise ValueError(
            f"feature {feature.name!r}: batch size {feature.batch_size} is not divisible by"
            f" the {self.layout.num_devices} devices of axis {self.axis_name!r}."
        )

  @classmethod
  @refusing_renamed_keywords(SHARDS_RENAMED)
  def create(
      cls,
      feature_specs: Sequence[FeatureSpec],
      *,
      mesh: Mesh | None = None,
      axis_name: str = DEFAULT_AXIS_NAME,
      shards_per_device: int | None = None,
      layout: EmbeddingLayout | None = None,
  ) -> "EmbeddingPlan":
    """A plan with automatic stacking; by default over all devices in one axis.

    The default mesh orders the devices by (process, id)
    (`process_major_devices`), so each process holds a contiguous block.

    Args:
      feature_specs: the model's features.
      mesh: the device mesh; default `default_mesh(axis_name)`.
      axis_name: the mesh axis that holds the tables.
      shards_per_device: S for the automatic stacking; default 1. With a
        `layout`, which has its own S, it may be left out or must equal it.
      layout: an explicit stacked layout; default automatic stacking.

    Raises:
      ValueError: `shards_per_device` disagrees with the layout's, or the
        layout does not fit the mesh or the specs.
    """
    feature_specs = validate_feature_specs(feature_specs)
    if mesh is None:
      mesh = default_mesh(axis_name)
    if layout is None:
      layout = auto_stack_tables(
          feature_specs, mesh_axis_size(mesh, axis_name),
          shards_per_device=1 if shards_per_device is None else shards_per_device,
      )
    elif shards_per_device is not None and shards_per_device != layout.shards_per_device:
      raise ValueError(
          f"shards_per_device={shards_per_device!r} disagrees with the given layout, which has"
          f" S={layout.shards_per_device} shards per device. Leave shards_per_device out (the"
          f" layout's S is used), pass shards_per_device={layout.shards_per_device}, or build"
          " the layout with the S you want."
      )
    for table in tables_of(feature_specs):
      check_schedule_at_start(f"table {table.name!r} ({table.optimizer.owner_name()})",
                              table.optimizer.learning_rate)
    return cls(feature_specs, layout, mesh, axis_name)

  # --- derived, per stack ---------------------------------------------------

  @property
  def num_devices(self) -> int:
    return self.layout.num_devices

  def tables(self) -> dict[str, TableSpec]:
    return {table.name: table for table in tables_of(self.feature_specs)}

  def first_table(self, stack: StackLayout) -> TableSpec:
    return self.tables()[stack.tables[0].name]

  def optimizer(self, stack_name: str) -> OptimizerSpec:
    return self.first_table(self.layout.stack(stack_name)).optimizer

  def combiner(self, stack_name: str) -> str:
    return self.first_table(self.layout.stack(stack_name)).combiner

  def optimizers(self) -> dict[str, OptimizerSpec]:
    """Stack name -> the sparse optimizer of its tables, as `checkpoint.EmbeddingSave` and
    `EmbeddingRestore` take them (`optimizers=`: the checkpoint records which optimizer
    owns the slots, and a restore into another refuses them)."""
    return {stack.name: self.optimizer(stack.name) for stack in self.layout.stacks}

  def slot_specs(self) -> dict[str, tuple[SlotSpec, ...]]:
    """Stack name -> the slot variables of the stack's optimizer."""
    return {stack.name: self.optimizer(stack.name).slots() for stack in self.layout.stacks}

  def batch_signature(self, stack_name: str) -> StackSignature:
    """The signature of the batches stack `stack_name` takes (`preprocess` with this
    plan's specs and layout gives them)."""
    sequence = [f.name for f in self.feature_specs if f.sequence_length is not None]
    return stack_signature(self.layout.stack(stack_name), self.num_devices,
                           self.combiner(stack_name), sequence)

  def feature(self, name: str) -> FeatureSpec:
    for feature in self.feature_specs:
      if feature.name == name:
        return feature
    raise KeyError(f"no feature {name!r}; features are {[f.name for f in self.feature_specs]}.")

  def local_devices(self) -> range:
    """The positions [first, stop) of this process's devices on the table axis.

    This process feeds samples [first * B_f / G, stop * B_f / G) of every
    feature f (its share of the global batch; the batch is split over the
    axis) and holds the table rows of those positions. With one process:
    range(G).

    Raises:
      ValueError: this process's devices are not one contiguous block of the
        axis; build the mesh from `process_major_devices()`.
    """
    axis = self.mesh.axis_names.index(self.axis_name)
    grid = np.moveaxis(self.mesh.devices, axis, 0).reshape(self.num_devices, -1)
    here = jax.process_index()
    positions = [g for g in range(self.num_devices)
                 if any(d.process_index == here for d in grid[g])]
    if not positions:
      raise ValueError(
          f"process {here} has no device on mesh axis {self.axis_name!r} (the mesh's devices"
          f" belong to processes {sorted({d.process_index for d in self.mesh.devices.flat})}),"
          " so it can feed no samples and hold no table rows. Every process of the job must"
          " hold devices of the table axis: build the mesh from process_major_devices() (all"
          " devices of every process), as default_mesh() does."
      )
    if positions != list(range(positions[0], positions[-1] + 1)):
      raise ValueError(
          f"process {here} holds positions {positions} of mesh axis {self.axis_name!r}, not one"
          " contiguous block, so it cannot feed one contiguous slice of the batch. Build the"
          " mesh from process_major_devices() (devices sorted by process, then id)."
      )
    return range(positions[0], positions[-1] + 1)

  # --- shardings -------------------------------------------------------------

  def row_sharding(self) -> NamedSharding:
    """Tables, slots and batch buffers: leading axis split over the devices."""
    return NamedSharding(self.mesh, PartitionSpec(self.axis_name))

  def replicated_sharding(self) -> NamedSharding:
    return NamedSharding(self.mesh, PartitionSpec())
