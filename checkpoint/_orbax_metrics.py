"""Orbax's per-write TensorStore byte counters, not queried.

Orbax (0.12) asks TensorStore for its kvstore byte counters before and after
each batch of arrays it writes or reads (`get_tensorstore_raw_bytes`), only to
log a raw-throughput line. TensorStore's `experimental_collect_matching_metrics`
never frees what it returns (about 4 KB a call, with tensorstore 0.1.86): a
checkpoint save of the dense and in-flight items lost about 100 KB, so a job
saving every 1,000 steps for a week grew by about 1 GB.

`stop_raw_byte_queries()` replaces the query with one that answers None, which
Orbax reads as "not measured": it skips that log line and nothing else. It
changes Orbax in the whole process; `CheckpointManager` calls it when it opens,
and an Orbax without the query is left as it is.
"""

from __future__ import annotations


def _not_measured(*args, **kwargs) -> None:
  """Orbax's get_tensorstore_raw_bytes, answering "not measured" without asking TensorStore."""
  del args, kwargs
  return None


def stop_raw_byte_queries() -> bool:
  """Makes Orbax's raw-byte query answer None; True where this Orbax has the query."""
  try:
    from orbax.checkpoint._src.serialization import tensorstore_utils  # pylint: disable=g-import-not-at-top
  except ImportError:  # another Orbax layout: nothing to change
    return False
  if not callable(getattr(tensorstore_utils, "get_tensorstore_raw_bytes", None)):
    return False
  tensorstore_utils.get_tensorstore_raw_bytes = _not_measured
  return True
