"""The optional C++ loops of host preprocessing (`_host_kernels.cc`), or None.

setup.py builds them where a C++17 compiler is available (optional: without
one, installing still succeeds). Every caller keeps its numpy code and uses
it when `host_kernels()` is None; the two give the same results bit for bit
(the tests run both). The C++ loops replace what numpy can only express with
a sort, a scatter or extra temporaries:

  fill_keys       `_assemble`: keys b * V_s + global row and samples, one pass
  merge_samples   `_dedup.merge`: each sample's keys sorted stably (weights
                  alongside), the positions of repeated keys, and the rows and
                  samples of the entries (repeats left out), in one pass
  rank_rows       `_locate`: a device's ascending distinct rows and every
                  entry's rank among them, from a bit map that stays in the
                  cache (numpy: a byte map, then a [V_s] table of ranks)
  rank_kept_rows  `_dropping._locate_within_limits` (dropping allowed):
                  rank_rows with the overflow rules (a) and (b) applied in its
                  marking pass, which also compacts the kept entries; the
                  distinct rows and ranks are then those of the kept entries
  compact_padded  `_inputs._to_csr`: dense [B, L] ids with a padding id to
                  their CSR form (the ids kept, the row splits) in one pass,
                  where numpy compares, counts, indexes and sums
  drop_device     `_dropping._drop` (dropping after the sort of step 2): the
                  rules in one pass over a device's entries (a bit map of the
                  kept rows), compacting the kept entries; then their new
                  unique indices and the kept rows from the map

They release the GIL while they loop, so preprocessing threads (e.g. a
prefetching input pipeline) run them concurrently with the training step.
"""

from __future__ import annotations

import functools
from types import ModuleType


@functools.cache
def host_kernels() -> ModuleType | None:
  """The built extension module, or None when it was not built here."""
  try:
    from sc_framework.preprocessing import _host_kernels  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return _host_kernels
