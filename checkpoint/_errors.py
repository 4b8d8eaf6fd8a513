"""The exceptions a checkpoint read or write raises.

All derive from `CheckpointError`, itself a `ValueError`, so callers that
catch `ValueError` keep working; each message names the checkpoint path, the
stack, table or slot involved, the expected and the actual value, and what to
do about it.
"""

from __future__ import annotations


class CheckpointError(ValueError):
  """Base class of every error raised by the `checkpoint` package."""


class NotACheckpointError(CheckpointError):
  """The directory holds no (complete) embedding checkpoint."""


class MissingItemError(CheckpointError):
  """A step asked for holds no item of the requested name: it was never saved there."""


class MissingTableError(CheckpointError):
  """A table asked for is not in the checkpoint."""


class IncompatibleCheckpointError(CheckpointError):
  """The checkpoint cannot go where it was asked to: vocabulary, dimension or dtype differ."""


class SlotMismatchError(CheckpointError):
  """The target optimizer keeps other slot variables than the checkpoint holds."""


class CorruptCheckpointError(CheckpointError):
  """An array of the checkpoint is corrupt, truncated or missing."""
