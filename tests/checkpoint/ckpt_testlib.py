"""Shared builders for the checkpoint tests (imported by the test modules).

The oracle is always the logical per-table numpy arrays: random (never
zeros) tables and slots are stacked on the host with
`sc_framework.stacking.stack`, placed on a mesh with `jax.device_put`, and
everything restored is unstacked and compared bit for bit with them.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sc_framework import FeatureSpec, TableSpec, stack_tables
from sc_framework.optimizers import SGD, OptimizerSpec
from sc_framework.stacking import EmbeddingLayout, logical_to_global_rows, stack, unstack
from tests.numerics import assert_same_bits

AXIS = "table"


@dataclasses.dataclass
class Model:
  """Logical tables and slots of a small model, and the specs that made them."""

  tables: dict[str, TableSpec]
  features: list[FeatureSpec]
  logical: dict[str, np.ndarray]
  slots: dict[str, dict[str, np.ndarray]]

  def layout(self, groups, num_devices: int, shards_per_device: int = 1) -> EmbeddingLayout:
    return stack_tables(self.features, groups, num_devices, shards_per_device)

  def slot_specs(self, layout: EmbeddingLayout) -> dict:
    return {name: optimizer.slots() for name, optimizer in self.optimizers(layout).items()}

  def optimizers(self, layout: EmbeddingLayout) -> dict:
    """Stack -> the optimizer of its tables."""
    return {s.name: self.tables[s.tables[0].name].optimizer for s in layout.stacks}

  def state(self, layout: EmbeddingLayout, mesh: Mesh | None = None):
    """Stacked (tables, slots) on `mesh` (default: all devices of layout.num_devices)."""
    mesh = mesh or make_mesh(layout.num_devices)
    sharding = NamedSharding(mesh, PartitionSpec(AXIS, None))
    tables = {
        name: jax.device_put(array, sharding) for name, array in stack(self.logical, layout).items()
    }
    slots = {name: {} for name in layout.stack_names}
    for stack_layout in layout.stacks:
      for spec in self.slot_specs(layout)[stack_layout.name]:
        arrays = {t: self.slots[t][spec.name] for t in stack_layout.table_names}
        sub = EmbeddingLayout(layout.num_devices, layout.shards_per_device, (stack_layout,))
        stacked = stack(arrays, sub, row_width=spec.width, fill=spec.initial_value)[
            stack_layout.name
        ]
        slots[stack_layout.name][spec.name] = jax.device_put(stacked, sharding)
    return tables, slots

  def check(self, layout: EmbeddingLayout, tables, slots=None, *, table_names=None) -> None:
    """Unstacks device state and compares it bit for bit with the logical arrays.

    `slots` None checks the tables only.
    """
    names = list(table_names or layout.table_names)
    host = {name: np.asarray(array) for name, array in tables.items()}
    for name, array in unstack(host, layout, tables=names).items():
      assert_same_bits(array, self.logical[name], err_msg=f"table {name}")
      assert array.dtype == self.logical[name].dtype
    for stack_layout in layout.stacks if slots is not None else ():
      sub = EmbeddingLayout(layout.num_devices, layout.shards_per_device, (stack_layout,))
      assert set(slots[stack_layout.name]) == {
          s.name for s in self.slot_specs(layout)[stack_layout.name]
      }
      for spec in self.slot_specs(layout)[stack_layout.name]:
        stacked = {stack_layout.name: np.asarray(slots[stack_layout.name][spec.name])}
        for name, array in unstack(stacked, sub, row_width=spec.width).items():
          if name in names:
            assert_same_bits(
                array, self.slots[name][spec.name], err_msg=f"{name}/{spec.name}"
            )


def touch_rows(model: Model, layout: EmbeddingLayout, tracker, rng, share: float) -> None:
  """Changes random rows of every table and slot in place (at least one per table, `share`
  of them); records them in `tracker` (an UpdatedRows of `layout`)."""
  for name, table in model.logical.items():
    count = max(1, int(share * table.shape[0]))
    rows = rng.choice(table.shape[0], size=count, replace=False)
    table[rows] += rng.standard_normal((count, table.shape[1])).astype(table.dtype)
    for slot in model.slots[name].values():
      slot[rows] += rng.random((count, slot.shape[1])).astype(slot.dtype)
    tracker.add(layout.stack_of_table(name).name, logical_to_global_rows(layout, name, rows))


def make_mesh(num_devices: int) -> Mesh:
  return Mesh(np.array(jax.devices()[:num_devices]), (AXIS,))


def make_model(specs, *, seed: int = 0, dtype=np.float32) -> Model:
  """specs: (name, V, D[, optimizer]) per table."""
  rng = np.random.default_rng(seed)
  tables, features, logical, slots = {}, [], {}, {}
  for entry in specs:
    name, vocab, dim = entry[:3]
    optimizer: OptimizerSpec = entry[3] if len(entry) > 3 else SGD()
    table = TableSpec(name, vocab, dim, optimizer=optimizer)
    tables[name] = table
    features.append(FeatureSpec(f"f_{name}", table, (16,)))
    logical[name] = (rng.standard_normal((vocab, dim)) + 0.5).astype(dtype)
    slots[name] = {
        spec.name: (rng.random((vocab, dim if spec.width is None else spec.width)) + 0.25).astype(
            np.float32
        )
        for spec in optimizer.slots()
    }
  return Model(tables, features, logical, slots)
