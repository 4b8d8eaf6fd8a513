"""The small model, data and Trainer shared by the multi-process workers and tests.

Every process builds the same global batches (from a seed) and feeds its own
slice of them: the samples of its positions on the table axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

from pipelining import Trainer
from sc_framework import FeatureSpec, TableSpec
from sc_framework.optimizers import Adagrad

BATCH = 16
SEED = 11  # of the jobs' global batches
BATCHES = 6  # in a job's data
# Processes x devices reorder the cross-device sums: a row of table "a" sums
# the gradients of all its ids in a global batch (BATCH * 4), over up to
# BATCHES chained steps.
TERMS = BATCH * 4


class Head(nn.Module):
  @nn.compact
  def __call__(self, activations, dense):
    x = jnp.concatenate([activations["fa"], activations["fb"], activations["fa2"], dense], axis=1)
    return nn.Dense(1)(jnp.tanh(nn.Dense(6)(x)))[:, 0]


def mse(predictions, labels):
  return jnp.mean((predictions - labels) ** 2)


def make_specs(learning_rate: float = 0.3):
  optimizer = Adagrad(learning_rate)
  kw = dict(optimizer=optimizer, max_ids_per_partition=64, max_unique_ids_per_partition=64)
  table_a = TableSpec("a", 64, 4, **kw)
  table_b = TableSpec("b", 40, 4, **kw)
  return [FeatureSpec("fa", table_a, (BATCH, 3)), FeatureSpec("fb", table_b, (BATCH, 2)),
          FeatureSpec("fa2", table_a, (BATCH, 1))]


def make_batches(count: int, seed: int) -> list[dict]:
  """`count` global batches of BATCH samples."""
  rng = np.random.default_rng(seed)
  batches = []
  for _ in range(count):
    fa = rng.integers(0, 64, (BATCH, 3))
    fa[rng.uniform(size=fa.shape) < 0.2] = -1
    fa[:, 0] = rng.integers(0, 64, BATCH)
    batches.append({
        "sparse": {"fa": fa, "fb": rng.integers(0, 40, (BATCH, 2)),
                   "fa2": rng.integers(0, 64, (BATCH, 1))},
        "dense": rng.normal(size=(BATCH, 3)).astype(np.float32),
        "labels": rng.normal(size=BATCH).astype(np.float32),
    })
  return batches


def local_slice(batch: dict, devices: range, num_devices: int) -> dict:
  """The samples of table-axis positions `devices` (of `num_devices`) of a global batch."""
  per_device = BATCH // num_devices
  part = slice(devices.start * per_device, devices.stop * per_device)
  return jax.tree.map(lambda x: x[part], batch)


def make_trainer(workdir=None, *, seed: int = 0, pipelining: bool = True,
                 learning_rate: float = 0.3, mesh=None, save_every: int | None = None,
                 incremental=None) -> Trainer:
  return Trainer(Head(), make_specs(learning_rate), mse, optax.adam(0.05), pipelining=pipelining,
                 progress="off", padding_id=-1, workdir=workdir, seed=seed, mesh=mesh,
                 save_every=save_every, incremental=incremental,
                 eval_metrics=())  # regression labels: AUC does not apply


def local_batches(trainer: Trainer, batches: list[dict]) -> list[dict]:
  """This process's slices of `batches`."""
  devices = trainer.plan.local_devices()
  return [local_slice(b, devices, trainer.plan.num_devices) for b in batches]


def logical_arrays(arrays: dict[str, np.ndarray], layout) -> dict[str, np.ndarray]:
  """`state_arrays` with the stacked tables and slots as per-table arrays (layout removed)."""
  from sc_framework.stacking import unstack

  stacked = [(f"{prefix}['{stack.name}']", prefix, stack) for stack in layout.stacks
             for prefix in (".embeddings.tables", ".embeddings.slots")]
  out = {}
  for name, value in arrays.items():
    match = next((m for m in stacked if name.startswith(m[0])), None)
    if match is None:
      out[name] = value
      continue
    key, prefix, stack = match
    for table, rows in unstack({stack.name: value}, layout, tables=stack.table_names).items():
      out[f"{prefix}['{table}']{name[len(key):]}"] = rows
  return out


def state_arrays(trainer: Trainer) -> dict[str, np.ndarray]:
  """Tables, slots, dense parameters and step as flat host arrays (global values)."""
  from pipelining._placement import to_host

  leaves = jax.tree_util.tree_flatten_with_path(trainer.state)[0]
  return {jax.tree_util.keystr(path): to_host(leaf) for path, leaf in leaves}
