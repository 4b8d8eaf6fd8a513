"""The Trainer's options: one frozen, validated value."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Iterator, Mapping, Sized
from typing import Any, Literal

import jax.numpy as jnp
from etils import epath

from checkpoint import IncrementalPolicy
from checkpoint._storage import as_path
from sc_framework._renamed import SHARDS_RENAMED, refusing_renamed, use_instead
from sc_framework._scalars import python_scalar, python_scalar_fields
from sc_framework.preprocessing import PaddingId
from sc_framework.primitives import EmbeddingBackend
from sc_framework.stacking import Stacking, normalize_stacking


# CheckpointManager's name for the steps it retains.
_RENAMED = {**SHARDS_RENAMED, "keep_latest": use_instead("keep", "keep_latest")}


@refusing_renamed(_RENAMED)
@dataclasses.dataclass(frozen=True)
class TrainerConfig:
  """Options of `Trainer`; every field has a working default.

  Attributes:
    pipelining: overlap the lookup of batch k+1 with the dense step of batch k
      (lookups one update stale, see `pipelining._fit_loop`); False gives synchronous
      training.
    prefetch_depth: batches prepared ahead on the host (>= 1).
    prefetch_workers: host threads preparing batches at once (>= 1). More
      than one pays where the host has idle cores and preprocessing paces
      training, as on an accelerator's host: its device step is often far
      shorter than the preprocessing of its batch (see the README's GPU
      figures). Each worker keeps its own scratch buffers, and up to
      prefetch_depth + 1 batches are held; give prefetch_depth >=
      prefetch_workers to keep them all busy. The batches and the results
      are the same for any number. With several, each worker gets a copy of
      its batch's numpy arrays, which the data loader may refill meanwhile.
    shards_per_device: S, shards of every stack per device.
    stacking: which tables share a stack: "auto" (every group of compatible
      tables, `auto_stack_tables`), "separate" (a stack per table), groups of
      table names such as [["a", "b"], ["c"]] (`stack_tables`; the notion of
      `sc-checkpoint convert --groups`), or a complete `EmbeddingLayout`
      (e.g. `EmbeddingLayout.from_json`, as `--layout`), whose G and S must
      be the mesh axis size and shards_per_device. Checked against the specs
      when the Trainer is created. Resuming works across stackings (the
      checkpoints are layout-free).
    table_dtype: "float32" or "bfloat16" (jnp dtypes are accepted too): the
      dtype of the stacked tables (half their memory in bfloat16); optimizer
      slots stay float32, each updated row is rounded to the table dtype,
      and the model receives activations in the table dtype.
      Checkpoints store the tables in this dtype, and a checkpoint of the
      other dtype is refused (convert it first: `sc-checkpoint convert
      --table-dtype`).
    backend: the embedding backend of every lookup and sparse update: "auto"
      (the best registered one for the mesh's devices), a registered name
      ("xla", "cpu", ...) or an `sc_framework.primitives.EmbeddingBackend`
      value (e.g. `XLA_BACKEND`). Resolved and checked against the devices
      when the Trainer is created; the start-up line names it.
    seed: seeds the embedding and dense initialisation.
    workdir: directory for checkpoints and metrics.jsonl (any etils.epath
      path, cloud paths included; a relative local path is made absolute);
      None disables both. With several processes, one directory that every
      process reaches (the same on one machine; shared storage for hosts).
    save_every: checkpoint every K steps (needs workdir); None saves only at
      the end of fit and on SIGTERM/SIGINT.
    keep: checkpoints to retain (the newest).
    log_every: steps between log lines / metrics.jsonl records.
    progress: "auto" (a bar on a terminal, log lines otherwise), "bar",
      "log" or "off".
    eval_metrics: host metrics computed by evaluate besides the loss:
      "auc" (the default; for binary classifiers: every label 0 or 1, one
      score or logit per label; other labels raise, naming the shapes or
      the label). Pass () for any other model.
    padding_id: an id meaning "no id" in dense inputs (e.g. -1), skipped by
      preprocessing; None: every id is real. A dict feature name -> id (or
      None) gives each feature its own (a feature left out has none).
    allow_id_dropping: passed to preprocessing; when False an overflowing
      partition raises.
    host_memory: "system" (default) leaves the process's malloc alone. On
      CPU devices, "keep" makes glibc keep freed memory for reuse, and serve
      every thread from one heap, so each step's large temporaries do not
      page-fault anew (faster embedding steps on large tables; the resident
      memory stays at its peak). Threads that allocated before the Trainer
      was built keep their own heaps: build it before other programs run. It is a
      process-wide setting (`sc_framework.host_allocator`), so it is only
      made when asked for here.
    save_on_nonfinite: save a checkpoint of the last finite state before
      raising on a NaN or infinite loss. Its data position is past the
      offending batch, which the checkpoint records as skipped: a resume
      continues with the next batch and reports the skip (a warning and
      `History.skipped_batches`), as the same Trainer's next fit does.
    incremental: a `checkpoint.IncrementalPolicy` makes periodic saves
      deltas (only the rows updated since the previous save, tracked from
      the preprocessed batches) when the policy says so; None (default):
      every save is full. Resuming from a delta step is exact, as from a
      full one.
  """

  pipelining: bool = True
  prefetch_depth: int = 2
  prefetch_workers: int = 1
  shards_per_device: int = 1
  stacking: Stacking = "auto"
  table_dtype: Literal["float32", "bfloat16"] = "float32"
  backend: str | EmbeddingBackend = "auto"
  seed: int = 0
  workdir: epath.PathLike | None = None
  save_every: int | None = None
  keep: int = 3
  log_every: int = 50
  progress: Literal["auto", "bar", "log", "off"] = "auto"
  eval_metrics: tuple[str, ...] = ("auc",)
  padding_id: PaddingId = None
  allow_id_dropping: bool = False
  host_memory: Literal["keep", "system"] = "system"
  save_on_nonfinite: bool = False
  incremental: IncrementalPolicy | None = None

  def __post_init__(self):
    python_scalar_fields(self)
    for name in ("pipelining", "allow_id_dropping", "save_on_nonfinite"):
      value = getattr(self, name)
      if not isinstance(value, bool):
        # A truthy string such as "False" would silently turn the option on.
        raise TypeError(f"TrainerConfig.{name} must be True or False, got {value!r}.")
    for name in ("prefetch_depth", "prefetch_workers", "shards_per_device", "keep", "log_every"):
      check_count(f"TrainerConfig.{name}", getattr(self, name), minimum=1)
    check_count("TrainerConfig.save_every", self.save_every, minimum=1, optional=True)
    if self.save_every is not None and self.workdir is None:
      raise ValueError("TrainerConfig.save_every needs a workdir to save checkpoints in.")
    if self.incremental is not None and not isinstance(self.incremental, IncrementalPolicy):
      raise TypeError(
          "TrainerConfig.incremental must be a checkpoint.IncrementalPolicy or None, got"
          f" {self.incremental!r}."
      )
    if not isinstance(self.backend, (str, EmbeddingBackend)):
      raise TypeError(
          "TrainerConfig.backend must be a backend name ('auto', 'xla', 'cpu', ...) or an"
          f" EmbeddingBackend, got {self.backend!r}."
      )
    object.__setattr__(self, "padding_id", _checked_padding_id(self.padding_id))
    object.__setattr__(self, "stacking", normalize_stacking(self.stacking))
    object.__setattr__(self, "table_dtype", _table_dtype(self.table_dtype))
    if self.host_memory not in ("keep", "system"):
      raise ValueError(
          f"TrainerConfig.host_memory must be 'keep' or 'system', got {self.host_memory!r}."
      )
    if self.progress not in ("auto", "bar", "log", "off"):
      raise ValueError(
          f"TrainerConfig.progress must be 'auto', 'bar', 'log' or 'off', got {self.progress!r}."
      )
    if isinstance(self.seed, bool) or not isinstance(self.seed, int):  # numpy ints: made ints above
      raise TypeError(
          f"TrainerConfig.seed must be an int (it seeds the tables' and the dense parameters'"
          f" initialisation), got {self.seed!r}."
      )
    if not -2**31 <= self.seed < 2**32:
      raise ValueError(
          f"TrainerConfig.seed must be in [-2**31, 2**32): JAX's PRNG key keeps 32 bits of a"
          f" seed, so seeds further apart would start the same run; got {self.seed}."
      )
    object.__setattr__(self, "eval_metrics", _metric_names(self.eval_metrics))
    unknown = [m for m in self.eval_metrics if m not in ("auc",)]
    if unknown:
      raise ValueError(f"TrainerConfig.eval_metrics: unknown metrics {unknown}; known: ['auc'].")
    if self.workdir is not None:
      if isinstance(self.workdir, str) and not self.workdir:
        raise ValueError(
            "TrainerConfig.workdir is '': pass None for no checkpoints and metrics, or a"
            " directory ('.' for the current one)."
        )
      workdir = as_path(self.workdir, "TrainerConfig.workdir")
      if "://" not in str(workdir):
        # Orbax writes multi-process checkpoints only to absolute paths.
        workdir = epath.Path(os.path.abspath(workdir))
      object.__setattr__(self, "workdir", workdir)


def check_count(name: str, value: Any, *, minimum: int, optional: bool = False) -> None:
  """Raises ValueError unless `value` is an int >= minimum (or None if optional).

  bool is refused although it is an int: `save_every=True` is a mistake.
  """
  if optional and value is None:
    return
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    none = "None or " if optional else ""
    raise ValueError(f"{name} must be {none}an int >= {minimum}, got {value!r}.")


def _metric_names(value: Any) -> tuple[str, ...]:
  """TrainerConfig.eval_metrics as a tuple of names (a config stays hashable)."""
  try:
    names = () if isinstance(value, str) else tuple(value)
  except TypeError:
    names = None
  if isinstance(value, str) or names is None or not all(isinstance(m, str) for m in names):
    raise TypeError(
        "TrainerConfig.eval_metrics must be a sequence of metric names, e.g. ('auc',) or (),"
        f" got {value!r}."
    )
  return names


def _table_dtype(value: Any) -> str:
  """The name of a table dtype ("float32" or "bfloat16") from a name or a dtype."""
  try:
    name = jnp.dtype(value).name
  except TypeError:
    name = None
  if name not in ("float32", "bfloat16"):
    raise ValueError(
        f"TrainerConfig.table_dtype must be 'float32' or 'bfloat16' (or the jnp dtype), got"
        f" {value!r}."
    )
  return name


def _checked_padding_id(padding_id) -> PaddingId:
  """padding_id as an int, None, or a dict feature name -> int or None (0-d numpy and JAX
  integers become ints); TypeError for anything else."""

  def is_id(value) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool))

  if isinstance(padding_id, Mapping):
    ids = {name: python_scalar(value) for name, value in padding_id.items()}
    bad = {name: value for name, value in ids.items()
           if not isinstance(name, str) or not is_id(value)}
    if bad:
      raise TypeError(
          "TrainerConfig.padding_id: a dict must map feature names to an int id (e.g. -1) or"
          f" None, got {bad}."
      )
    return ids
  if not is_id(padding_id):
    raise TypeError(
        "TrainerConfig.padding_id must be an int id (e.g. -1), None, or a dict feature name"
        f" -> id, got {padding_id!r} ({type(padding_id).__name__})."
    )
  return padding_id


def fit_arguments(num_steps: int | None, epochs: int | None, eval_data: Iterable[Any] | None,
                  eval_every: int | None) -> tuple[int | None, int | None, int | None]:
  """fit's num_steps, epochs and eval_every as Python ints (or None), checked."""
  num_steps, epochs, eval_every = (python_scalar(v) for v in (num_steps, epochs, eval_every))
  check_count("num_steps", num_steps, minimum=0, optional=True)
  check_count("eval_every", eval_every, minimum=1, optional=True)
  if eval_every is not None and eval_data is None:
    raise ValueError("eval_every needs eval_data.")
  if eval_every is not None and isinstance(eval_data, Iterator):
    # The second evaluation would find it exhausted, in the middle of fit.
    raise ValueError(
        f"eval_every={eval_every} evaluates eval_data several times, which needs a"
        f" re-iterable (a list, or a dataset whose __iter__ starts over); got a one-shot"
        f" {type(eval_data).__name__}. Pass list(eval_data) or the dataset itself."
    )
  if isinstance(eval_data, Sized) and len(eval_data) == 0:
    raise ValueError(
        "eval_data is empty: fit would fail at its first evaluation, after training. Pass"
        " batches to evaluate, or eval_data=None."
    )
  return num_steps, epochs, eval_every
