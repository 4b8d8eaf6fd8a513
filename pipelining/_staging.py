"""`BatchStager`: a raw batch checked, preprocessed and placed on the devices.

One stager per Trainer, shared by fit (from the prefetch threads), evaluate
and predict. It counts the ids `allow_id_dropping` drops (thread-safe) and
warns the first time; a partition overflow gets advice in the Trainer's terms.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import jax

from pipelining._batch_check import BatchChecker, BatchUse, batch_name
from pipelining._config import TrainerConfig
from pipelining._features import FeatureTree
from pipelining._in_flight import DroppedIds, Staged, kept_inputs
from pipelining._placement import global_batch
from pipelining._prefetch import detached
from pipelining._steps import DeviceBatch
from sc_framework._error_place import name_the_place
from sc_framework.preprocessing import (
    PartitionOverflowError,
    kept_id_masks,
    preprocess,
    stack_capacities,
)
from sc_framework.primitives import EmbeddingPlan

_LOG = logging.getLogger("pipelining")


class BatchStager:
  """Turns this process's slice of a raw batch into a `DeviceBatch` of the plan's layout."""

  def __init__(self, plan: EmbeddingPlan, features: FeatureTree, config: TrainerConfig,
               local_devices: list[Any]):
    self._plan = plan
    self._features = features
    self._config = config
    self._local_devices = local_devices
    # Every batch's entries, rows, and shapes against the first batch's.
    self._checker = BatchChecker([f.batch_size for f in plan.feature_specs],
                                 len(local_devices), plan.num_devices)
    self._dropped_ids = 0
    self._dropped_by_use: dict[BatchUse, int] = {}
    self._dropped_lock = threading.Lock()

  @property
  def dropped_ids(self) -> int:
    """Ids dropped from every batch staged so far (prefetched but unused ones too)."""
    return self._dropped_ids

  def dropped_ids_of(self, use: BatchUse) -> int:
    """Ids dropped from the batches of one use staged so far."""
    return self._dropped_by_use.get(use, 0)

  def stage(self, raw: Any, use: BatchUse, index: int | None) -> Staged:
    """The placed batch, with the raw ids for a layout-free checkpoint of a batch in flight.

    The batch is checked first (`pipelining._batch_check`); errors name it as
    batch `index` of the `use` data. A prediction batch's labels are not read.
    """
    self._checker.check(raw, use, index)
    try:
      sparse = self._features.ids_by_name(raw["sparse"])
      preprocessed, dropped = self.preprocess(sparse)
    except (ValueError, TypeError) as error:  # it names the feature, sample and id
      if index is not None:
        name_the_place(error, batch_name(use, index))
      raise
    if use == "training" and self._config.pipelining and self._config.workdir is not None:
      # Saved with the batch in flight, maybe after the data loader refilled its arrays.
      sparse = detached(sparse)
    if dropped:
      with self._dropped_lock:
        self._dropped_by_use[use] = self._dropped_by_use.get(use, 0) + dropped
      if use == "training":  # An in-flight checkpoint stores the ids it kept.
        sparse = DroppedIds(sparse, preprocessed)
    labels = None if use == "prediction" else raw["labels"]
    return Staged(self.place(preprocessed, raw.get("dense"), labels), sparse, dropped)

  def preprocess(self, sparse: Any) -> tuple[dict[str, Any], int]:
    """(the preprocessed batch, how many of its ids were dropped)."""
    plan, config = self._plan, self._config
    try:
      batch, stats = preprocess(
          sparse, plan.feature_specs, plan.layout, padding_id=config.padding_id,
          allow_id_dropping=config.allow_id_dropping, devices=self._local_devices,
      )
    except PartitionOverflowError as error:  # Its advice names preprocess's options.
      raise error.with_advice(overflow_advice(
          error, stack_capacities(plan.feature_specs, plan.layout)[error.stack],
          [table.name for table in plan.layout.stack(error.stack).tables])) from None
    if stats.num_dropped_ids:
      self._count_dropped(stats)
    return batch, stats.num_dropped_ids

  def place(self, sparse, dense, labels) -> DeviceBatch:
    """This process's preprocessed slice (and dense features, labels) as global arrays."""
    return global_batch(sparse, dense, labels, self._plan.row_sharding(),
                        self._plan.num_devices, len(self._local_devices))

  def kept_ids(self, ids: DroppedIds) -> dict[str, Any]:
    """The ids a batch that dropped some kept: its lookup read these, and another
    layout's partitions would drop others of its raw ids."""
    plan, padding_id = self._plan, self._config.padding_id
    masks = kept_id_masks(ids.raw, plan.feature_specs, plan.layout, ids.batch,
                          padding_id=padding_id, devices=self._local_devices)
    return kept_inputs(ids.raw, plan.feature_specs, masks, padding_id=padding_id,
                       share=len(self._local_devices), num_devices=plan.num_devices)

  def _count_dropped(self, stats) -> None:
    with self._dropped_lock:
      first = self._dropped_ids == 0
      self._dropped_ids += stats.num_dropped_ids
    if first:
      stacks = {name: s.num_dropped_ids for name, s in stats.stacks.items() if s.num_dropped_ids}
      _LOG.warning(
          "process %d: %d ids of a batch were dropped to fit the partition limits"
          " (allow_id_dropping=True; per stack %s). Later drops are only counted"
          " (trainer.dropped_ids, history.dropped_ids); raise the tables' limits"
          " (size_limits_from_stats) to drop none.",
          jax.process_index(), stats.num_dropped_ids, stacks)


def overflow_advice(error: PartitionOverflowError, limits, tables: list[str]) -> str:
  """The Trainer's advice for a partition overflow: the limits that were exceeded only."""
  names = ("max_ids_per_partition", "max_unique_ids_per_partition")
  exceeded = [name for name in names
              if getattr(error.needed, name) > getattr(limits, name)] or list(names)
  raise_ = [f"{name} to at least {getattr(error.needed, name)}" for name in exceeded]
  return (f"Raise the {' and '.join(raise_)} on the stack's tables {tables} (with headroom for"
          " burstier batches: size_limits_from_stats(..., headroom=1.2) computes them from a"
          " few batches), or pass allow_id_dropping=True to the Trainer to drop the excess"
          " ids deterministically (counted in trainer.dropped_ids).")
