"""What the Trainer says about damaged checkpoint steps it resumes past or cannot.

A restore that finds a step damaged marks it (the next listing skips it) and
raises `DamagedStep`, so that fit takes the step before it. The refusals
below are raised where no step before it will do.
"""

from __future__ import annotations

from collections.abc import Mapping

from etils import epath

from checkpoint import CorruptCheckpointError

STEPS_NAMED = 5  # Unrestorable steps a refusal to start over names (the newest).
WHY_CHARS = 1000  # Of each one's reason.


class DamagedStep(Exception):
  """The checkpoint step a Trainer was restoring is damaged (and now marked so)."""

  def __init__(self, step: int, why: str):
    super().__init__(f"checkpoint step {step} is damaged: {why}")
    self.step, self.why = step, why


def none_restores_error(directory: epath.Path,
                        unrestorable: Mapping[int, str]) -> CorruptCheckpointError:
  """The refusal to start over beside steps of which none restores (step -> why)."""
  shown = list(reversed(unrestorable.items()))[:STEPS_NAMED]
  steps = "; ".join(f"step {step}: {_shortened(why.rstrip('.'))}" for step, why in shown)
  if len(unrestorable) > len(shown):
    steps += f"; and {len(unrestorable) - len(shown)} more"
  return CorruptCheckpointError(
      f"{directory} holds checkpoint steps, but none of them restores ({steps}). A Trainer"
      " does not start over beside them, nor evaluate a state at step 0 there: repair them"
      " (e.g. copy them again from their source), or move them out of"
      f" {directory} to start training from scratch."
  )


def one_shot_data_error(damaged: DamagedStep, resumes: str,
                        directory: epath.Path) -> CorruptCheckpointError:
  """The refusal to go on past a damaged step with a one-shot iterator at its position."""
  return CorruptCheckpointError(
      f"checkpoint step {damaged.step} is damaged, so fit continues from {resumes}; but"
      " train_data is a one-shot iterator, already moved to the damaged step's position, and"
      " it cannot go back. Call fit again with an iterator of the data that starts there"
      " (this Trainer skips the damaged step now; a new process would not: move the step out"
      f" of {directory} before starting one). Why step {damaged.step} is damaged:"
      f" {damaged.why}"
  )


def _shortened(text: str) -> str:
  return text if len(text) <= WHY_CHARS else text[:WHY_CHARS - 3] + "..."
