"""When a save is full or a delta, and which steps retention must keep for chains.

`IncrementalPolicy` decides each save of a `CheckpointManager` opened with
`incremental=IncrementalPolicy()`:

  full   when no chain is open (the first save, after a failed save, or when
         the manager has not saved or restored the state it saves), when
         requested (`save(..., save_kind="full")`), when the chain already
         holds `full_every - 1` deltas, when the updated rows exceed
         `max_delta_share` of the stacked rows, or when the state keeps
         other slots, dtypes or optimizers than the chain (`continues_chain`;
         e.g. after a restore that reset the slots);
  delta  otherwise.

A long chain costs restore time (one read of each delta's rows) and keeps
its base alive; a large delta costs nearly a full save's bytes. The
defaults come from benchmarks/bench_incremental.py (see the README).

`ChainPreservation` wraps Orbax's retention policy: every step that a kept
step's chain reaches (its parents up to the base) is kept too, so retention
never breaks a chain.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
from etils import epath

from checkpoint import _save
from checkpoint._chain import continues_chain, delta_manifest, save_id_of, walk_chain
from checkpoint._delta import Delta
from checkpoint._errors import CheckpointError, CheckpointReadError
from checkpoint._format import MANIFEST_FILE, new_save_id
from checkpoint._handler import EmbeddingSave
from checkpoint._rows_tracker import UpdatedRows
from sc_framework._scalars import python_scalar_fields
from sc_framework.stacking import EmbeddingLayout

SaveKind = Literal["auto", "full", "delta"]


@dataclasses.dataclass(frozen=True)
class IncrementalPolicy:
  """Full or delta saves (see the module docstring).

  Attributes:
    full_every: every chain is at most this many saves long: a full save
      followed by up to `full_every - 1` deltas (>= 1; 1 makes every save
      full).
    max_delta_share: a save whose updated rows exceed this share of all
      stacked rows is full (in (0, 1]); near that share a delta costs about
      as much as a full save and lengthens the chain for nothing.
  """

  full_every: int = 10
  max_delta_share: float = 0.25

  def __post_init__(self):
    python_scalar_fields(self)
    if isinstance(self.full_every, bool) or not isinstance(self.full_every, int):
      raise ValueError(
          f"IncrementalPolicy: full_every must be an int >= 1, got {self.full_every!r}."
      )
    if self.full_every < 1:
      raise ValueError(f"IncrementalPolicy: full_every must be >= 1, got {self.full_every}.")
    share = self.max_delta_share
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
      raise ValueError(
          f"IncrementalPolicy: max_delta_share must be a number in (0, 1], got {share!r}."
      )

  def choose(self, deltas_in_chain: int | None, updated_share: float) -> Literal["full", "delta"]:
    """The kind of the next save.

    Args:
      deltas_in_chain: deltas after the open chain's base; None if no chain
        is open.
      updated_share: updated rows / stacked rows since the previous save.
    """
    if deltas_in_chain is None or deltas_in_chain + 1 >= self.full_every:
      return "full"
    return "full" if updated_share > self.max_delta_share else "delta"


@dataclasses.dataclass
class ChainPreservation:
  """An Orbax preservation policy: `inner`'s kept steps plus every step their chains need.

  Attributes:
    inner: the retention policy (latest N, best N, ...).
    parent_of: step -> the step its embedding item's delta names as parent,
      or None (a full step, or a step without an embedding item).
  """

  inner: Any
  parent_of: Callable[[int], int | None]

  def should_preserve(self, checkpoints: Sequence[Any], *, context: Any) -> Sequence[bool]:
    keep = list(self.inner.should_preserve(checkpoints, context=context))
    position = {info.step: index for index, info in enumerate(checkpoints)}
    for index in [i for i, kept in enumerate(keep) if kept]:
      step = checkpoints[index].step
      while (parent := self.parent_of(step)) is not None and parent < step:
        if parent not in position:
          break  # Already deleted: the chain is broken, restore skips it.
        keep[position[parent]] = True
        step = parent
    return keep


class IncrementalSaves:
  """A manager's chain bookkeeping: the open chain, each step's parent, the next kind.

  Args:
    policy: the policy (None: every save is full).
    root: the manager's root directory.
    item: the embedding item name.
  """

  def __init__(self, policy: IncrementalPolicy | None, root: epath.Path, item: str):
    self.policy = policy
    self._root = root
    self._item = item
    self._parents: dict[int, int | None] = {}
    # (parent step, base step, deltas after the base) of the state last saved or restored.
    self._open: tuple[int, int, int] | None = None
    # The save id of that state, as this manager saved or restored it (None: unknown).
    self._open_id: str | None = None
    # When (time.monotonic()) a restore last opened the chain: a tracker older than that
    # holds rows changed since another state.
    self._restored_at: float | None = None

  def item_dir(self, step: int) -> epath.Path:
    return self._root / str(step) / self._item

  def parent_of(self, step: int) -> int | None:
    """The parent a step's delta names (None for a full step); read once per step."""
    if step not in self._parents:
      if not (self.item_dir(step) / MANIFEST_FILE).exists():
        return None  # Not (yet) an embedding item; asked again later.
      try:
        manifest = delta_manifest(self.item_dir(step))
      except CheckpointReadError:
        raise  # The storage refused or did not answer: not a damaged step.
      except CheckpointError:
        manifest = None  # A damaged step; restore skips it (`broken`).
      self._parents[step] = None if manifest is None else manifest.parent_step
    return self._parents[step]

  def args_for(
      self,
      step: int,
      embedding: EmbeddingSave,
      updated_rows: UpdatedRows | Mapping[str, np.ndarray] | None,
      save_kind: SaveKind,
  ) -> EmbeddingSave:
    """The save args of step `step`: `embedding` itself, or a delta of it.

    A delta needs its parent (the state last saved or restored) to be an
    earlier step, and an `UpdatedRows` tracker made or cleared since that
    state was restored (else it holds rows changed since another state, e.g.
    an older step restored for an evaluation while training went on); if
    not, 'auto' saves in full and 'delta' raises.
    """
    if save_kind not in ("auto", "full", "delta"):
      raise ValueError(f"save_kind must be 'auto', 'full' or 'delta', got {save_kind!r}.")
    # This save's id, remembered: the next delta records it as its parent's. Its
    # step gets an integrity manifest (the manager's commit writes it).
    embedding = dataclasses.replace(embedding, save_id=embedding.save_id or new_save_id(),
                                    step_integrity=True)
    if self._open is not None and not (self.item_dir(self._open[0]) / MANIFEST_FILE).exists():
      self._open = None  # The parent is gone (deleted, or its save failed): start a chain.
    if save_kind == "delta" and (self.policy is None or updated_rows is None or self._open is None):
      raise ValueError(
          "save_kind='delta' needs a manager opened with incremental=IncrementalPolicy(...),"
          " updated_rows, and a previous save or restore of this state by this manager (the"
          " delta's parent)."
      )
    if self.policy is None or updated_rows is None or save_kind == "full":
      return embedding
    if isinstance(updated_rows, UpdatedRows):
      _check_tracker_layout(updated_rows.layout, embedding.layout)
    unsure = self._why_no_delta(step, updated_rows)
    if unsure is not None:
      if save_kind == "delta":
        raise ValueError(f"save_kind='delta' for step {step}: {unsure} Save it in full"
                         " (save_kind='full' or 'auto').")
      return embedding
    rows = updated_rows.handed() if isinstance(updated_rows, UpdatedRows) else dict(updated_rows)
    total = sum(stack.vocabulary_size for stack in embedding.layout.stacks)
    share = sum(np.asarray(r).size for r in rows.values()) / max(1, total)
    chain = None if self._open is None else self._open[2]
    if save_kind == "auto" and self.policy.choose(chain, share) == "full":
      return embedding
    parent, base, _ = self._open
    state = _save.state_manifest(embedding)
    if not continues_chain(self.item_dir(parent), state, embedding.layout):
      if save_kind == "delta":
        raise ValueError(
            f"save_kind='delta': the state keeps other slots, dtypes or optimizers than the"
            f" chain of step {parent} it would continue (after a restore that reset the"
            " slots, or with another optimizer), so the delta would not read back. Save a"
            " full checkpoint (save_kind='full' or 'auto')."
        )
      return embedding
    # The save this manager wrote or restored, not whatever holds the step now: a
    # step replaced since (another run's) then fails the delta's restore, never mixes.
    parent_id = self._open_id
    if parent_id is None:
      parent_id = save_id_of(self.item_dir(parent))
    return dataclasses.replace(embedding, delta=Delta(rows, parent, base, parent_id))

  def _why_no_delta(self, step: int, updated_rows) -> str | None:
    """Why step `step` cannot be a delta of the open chain's state, or None."""
    if self._open is not None and self._open[0] >= step:
      return (f"the state it would be a delta of is step {self._open[0]}, not an earlier step"
              " (a chain runs forward).")
    if (isinstance(updated_rows, UpdatedRows) and self._restored_at is not None
        and updated_rows.since < self._restored_at):
      return (f"updated_rows was last cleared before step {self._open[0]} was restored, so it"
              " holds the rows changed since another state; clear it (or make a new one) when"
              " the restored state becomes the one trained.")
    return None

  def starting(self, step: int, args) -> None:
    """Records the parent of a save about to start.

    Before Orbax's save, whose retention decides which steps to delete while
    the new step is not yet on disk: it must keep the new step's parent.
    """
    delta = getattr(args, "delta", None)
    self._parents[step] = None if delta is None else delta.parent_step

  def saved(self, step: int, args) -> None:
    """Records a started save."""
    if args.delta is not None:
      self._open = (step, args.delta.base_step, self._open[2] + 1)
    else:
      self._open = (step, step, 0)
    self._open_id = args.save_id

  def not_started(self, step: int) -> None:
    """The save of `step` recorded by `starting` did not start (not due)."""
    self._parents.pop(step, None)

  def failed(self, step: int | None = None) -> None:
    """A save (of `step`, if known) failed: it may be missing, so the next save starts a chain."""
    if step is not None:
      self._parents.pop(step, None)
    self._open, self._open_id = None, None

  def restored(self, step: int) -> None:
    """The live state is now `step`'s: the next delta's parent is `step`."""
    chain = walk_chain(self.item_dir(step))
    self._open = (step, int(chain[0][0].parent.name), len(chain) - 1)
    self._open_id = save_id_of(self.item_dir(step))
    self._restored_at = time.monotonic()

  def later_deltas_reading(self, step: int) -> list[int]:
    """The steps after `step` on disk whose delta chains name `step` by number only.

    Their delta on top of `step` records no parent id (written before ids
    existed): a new step of that number would silently become part of their
    chains. A delta that records its parent's id refuses any other save of
    that number, so it is not listed. Reads manifests only.
    """
    later = sorted(int(child.name) for child in self._root.iterdir()
                   if child.name.isdigit() and int(child.name) > step)
    found = []
    for candidate in later:
      child, parent = candidate, self.parent_of(candidate)
      while parent is not None and parent > step:
        child, parent = parent, self.parent_of(parent)
      if parent == step and _parent_id_of(self.item_dir(child)) is None:
        found.append(candidate)
    return found

  def chain_steps(self, step: int) -> list[int]:
    """The steps a restore of `step`'s embedding item reads, base first (manifests only).

    [step] for a step without an embedding item or a full one.

    Raises:
      CheckpointError: the chain cannot be walked (a link is missing,
        unreadable or replaced: `BrokenChainError`).
    """
    if not (self.item_dir(step) / MANIFEST_FILE).exists():
      return [step]
    return [int(link.parent.name) for link, _ in walk_chain(self.item_dir(step))]


def _parent_id_of(item: epath.Path) -> str | None:
  """The parent save id a delta item records, or None (none recorded, or unreadable)."""
  try:
    manifest = delta_manifest(item)
  except CheckpointReadError:
    raise
  except CheckpointError:
    return None
  return None if manifest is None else manifest.parent_id


def _check_tracker_layout(tracked: EmbeddingLayout, saved: EmbeddingLayout) -> None:
  """An UpdatedRows tracker holds global rows of its own layout: only that one can be saved.

  Its rows in another layout are other logical rows, so a delta would keep
  old values of rows that were updated (after a restore into a new layout,
  a tracker kept from before it).
  """
  if tracked == saved:
    return

  def describe(layout: EmbeddingLayout) -> str:
    return (f"G={layout.num_devices}, S={layout.shards_per_device}, stacks"
            f" {[(stack.name, stack.table_names) for stack in layout.stacks]}")

  difference = (f"{describe(tracked)} against {describe(saved)}"
                if describe(tracked) != describe(saved)
                else "the same devices and stacks, but other table sizes, offsets or rotations")
  raise ValueError(
      f"updated_rows tracks the rows of another layout than the state being saved"
      f" ({difference}): its global rows would name other rows of these tables, and the delta"
      " would miss updates. Give the tracker the layout of the tables it follows"
      " (UpdatedRows(embedding.layout), made again after a restore into another layout), or"
      " save this step in full (save_kind='full')."
  )
