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


class CheckpointReadError(CheckpointError):
  """The storage refused or did not answer a read (access denied, unavailable, timed out).

  Not damage: nothing was read that could be wrong, so the step is not marked
  damaged, a restore does not fall back past it, and it is left as it is.
  Fix the access (credentials, permissions) or wait for the storage, then retry.
  """


# TensorStore error messages start with the absl status code. These codes say
# that the storage refused or did not answer, not that the bytes it returned are
# wrong (DATA_LOSS, FAILED_PRECONDITION, INVALID_ARGUMENT, NOT_FOUND, ...).
_STORAGE_FAILURE_CODES = ("PERMISSION_DENIED", "UNAUTHENTICATED", "UNAVAILABLE",
                          "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "CANCELLED", "ABORTED")
# The same for file system errors (reading a manifest through epath).
_STORAGE_FAILURE_TYPES = (PermissionError, ConnectionError, TimeoutError)


def storage_failure(error: BaseException) -> str | None:
  """What an access or transient storage failure `error` is (its status code or type), or None.

  None means the read itself went through (or the error does not say
  otherwise): its failure is the data's, i.e. damage.
  """
  if isinstance(error, _STORAGE_FAILURE_TYPES):
    return type(error).__name__
  code = str(error).split(":", 1)[0].strip()
  return code if code in _STORAGE_FAILURE_CODES else None


def read_error(error: BaseException, what: str, damage_advice: str = "") -> CheckpointError:
  """The error to raise for a read that failed with `error`: "<what>: <error>." then, when
  the storage refused or did not answer (`storage_failure`), a CheckpointReadError saying so,
  else a CorruptCheckpointError ending with `damage_advice`."""
  failure = storage_failure(error)
  if failure is None:
    return CorruptCheckpointError(f"{what}: {error}. {damage_advice.strip()}")
  return CheckpointReadError(
      f"{what}: {error}. The storage refused or did not answer the read ({failure}):"
      " nothing says the checkpoint is damaged, and it is left as it is. Check the access to"
      " it (credentials, permissions) or the storage service, then retry."
  )


def read_text(path) -> str:
  """`path.read_text()` of one of a checkpoint's small files (a manifest, a layout, a marker).

  A read the storage refused or did not answer (`storage_failure`) raises
  CheckpointReadError naming the file; any other error propagates unchanged,
  for the caller to judge (a missing or unreadable file is usually damage).
  """
  try:
    return path.read_text()
  except OSError as error:
    if storage_failure(error) is None:
      raise
    raise read_error(error, f"reading {path} failed") from error
