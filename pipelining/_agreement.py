"""What every process of a multi-process Trainer must agree on, checked before it matters.

Every process builds the same Trainer and runs the same programs on its
slice of every global batch. A process that differs (another layout,
optimizer, option or backend; other batch or parameter shapes) or that has
no batch would otherwise wait for the others in a collective until the
distributed timeout, or compute something else. These checks run before any
such collective and raise `DistributedError` naming the difference. With
one process they return at once.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from pipelining._config import TrainerConfig
from pipelining._distributed import allgather_json, check_agreement
from pipelining._prefetch import Prefetcher, Prepared
from sc_framework.primitives import EmbeddingPlan

_LOG = logging.getLogger("pipelining")

# Options that may differ between processes: they change no computation, or
# (workdir) name one shared directory by a path that may differ per host.
_LOCAL_OPTIONS = ("progress", "log_every", "prefetch_depth", "prefetch_workers", "workdir")


def _describe(value: Any) -> str:
  """repr without memory addresses (a schedule function's repr differs per process)."""
  return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))


def check_same_setup(plan: EmbeddingPlan, config: TrainerConfig, backend_name: str) -> None:
  """The same layout, sparse optimizers, options and backend on every process."""
  if jax.process_count() == 1:
    return
  check_agreement("trainer setup", {
      "layout": plan.layout.to_dict(),
      "optimizers": {s.name: _describe(plan.optimizer(s.name)) for s in plan.layout.stacks},
      "config": {k: _describe(v) for k, v in dataclasses.asdict(config).items()
                 if k not in _LOCAL_OPTIONS},
      # Its path may differ per host; whether there is one may not (saves are collective).
      "workdir given": config.workdir is not None,
  })
  # Chosen per process ("auto"): processes with different backends would run
  # different programs and wait for each other forever.
  check_agreement("embedding backend", {"backend": backend_name},
                  hint="A process whose C++ CPU kernels are not built chooses the 'xla' backend"
                       " where the others choose 'cpu': build the kernels on every host, or"
                       " pass the same backend=.")


def check_same_shapes(example: Any, params: Any) -> None:
  """The same global batch shapes (of `example`) and dense parameter shapes everywhere."""
  if jax.process_count() == 1:
    return
  leaves = jax.tree_util.tree_flatten_with_path((example, jax.device_get(params)))[0]
  check_agreement("batch and parameter shapes", {
      jax.tree_util.keystr(path): [list(np.shape(x)), str(getattr(x, "dtype", ""))]
      for path, x in leaves
  })


def every_process_has(example: Any | None) -> bool:
  """Whether every process has a batch to build from when no batch is left to train on.

  A process whose data holds no batch at all has nothing to take shapes
  from, so it cannot build or restore; the others, which could, would wait
  for it in their first exchange until the distributed timeout. As when a
  process's data ends during fit, every process stops instead (False), and
  a process that had a batch warns, naming those without.
  """
  if jax.process_count() == 1:
    return True
  have = allgather_json("fit example batch", example is not None)
  if all(have):
    return True
  if example is not None:
    _LOG.warning(
        "process %d: the data of processes %s holds no batch, so there is nothing to fit and"
        " this process's batches are not used. Give every process the same number of"
        " batches.", jax.process_index(), [p for p, has in enumerate(have) if not has])
  return False


def next_agreed(prefetcher: Prefetcher, any_process: Callable[..., tuple[bool, ...]],
                stop_requested: Callable[[], bool], use: str) -> tuple[Prepared | None, bool]:
  """The next prepared batch (None when the data of any process ended) and whether any
  process requested a stop (`stop_requested()` is asked once the batch is there).

  A global batch needs every process's slice: when one process's data ends,
  every process ends there (the others' remaining batches are not used).
  The same exchange (`any_process`: for each flag, whether any process set
  it) agrees on a stop requested on any process meanwhile (while this
  process waited for its data, say). With several passes (epochs), it also
  agrees that every process's batch is of the same pass: a process whose
  pass held fewer batches starts its next pass early, and its slices would
  join the others' of another global batch. The processes stop there
  instead, as at the end of the data.
  """
  try:
    prepared = next(prefetcher)
  except StopIteration:
    prepared = None
  odd_pass = prepared is not None and pass_of(prepared) % 2 == 1
  even_pass = prepared is not None and not odd_pass
  ended, stop, any_odd, any_even = any_process(prepared is None, stop_requested(), odd_pass,
                                               even_pass)
  if ended:
    if prepared is not None:
      warn_data_ended_elsewhere(use)
    return None, stop
  if any_odd and any_even:
    warn_passes_out_of_step(pass_of(prepared))
    return None, stop
  return prepared, stop


def data_ended_agreed(prefetcher: Prefetcher,
                      any_process: Callable[..., tuple[bool, ...]]) -> bool:
  """Whether the data of any process ends here; the next batch stays in `prefetcher`."""
  here = prefetcher.at_end()
  ended = any_process(here)[0]
  if ended and not here:
    warn_data_ended_elsewhere()
  return ended


def pass_of(prepared: Prepared) -> int:
  """The pass over the data (0-based epoch) a prepared batch belongs to."""
  position = prepared.position
  return int(position.get("epoch", 0)) if isinstance(position, Mapping) else 0


def warn_passes_out_of_step(this_pass: int) -> None:
  _LOG.warning(
      "process %d: the processes' batches are of different passes over their data (this"
      " process's is pass %d): their passes hold different numbers of batches, so the"
      " global batches would join slices of different batches. fit stops here, as at the"
      " end of the data. Give every process the same number of batches per pass.",
      jax.process_index(), this_pass)


def warn_data_ended_elsewhere(use: str = "training") -> None:
  """`use`: what the data is for ("training", "evaluation" or "prediction")."""
  covers = {"evaluation": " (the metrics cover only the batches every process had)",
            "prediction": " (the predictions cover only the batches every process had)"}
  _LOG.warning(
      "process %d: another process's data ended before this process's, in %s; the global"
      " batches end there and this process's remaining batches are not used%s. Give every"
      " process the same number of batches.", jax.process_index(), use, covers.get(use, ""))
