"""The source of a conversion, verified against its integrity manifests before it is read.

A conversion writes a fresh integrity manifest for its output, so whatever
it reads unverified would come out looking sound. Before anything is read,
every file a conversion of `src` reads is checked against the manifest of
the step that holds it (`_integrity.check_step`):

  src a step directory     every item of the step (the embedding item, and
                           the items copied as they are);
  src an item in a step    that item, against its step's manifest (a step:
                           its parent holds integrity.json, or Orbax's
                           `_CHECKPOINT_METADATA`);
  src a bare item          (written by `convert` to a directory of its own)
                           against its own manifest (`bare_item_problems`);
                           one written before bare items carried one: its
                           chunks' own CRC32C trailers, checked as they are
                           read, as `verify` does;
  a delta item             also the embedding item of every earlier step of
                           its chain (base and earlier deltas), which the
                           conversion reads too: at depth 'full', every
                           chunk's CRC32C included, since the conversion
                           skips the chunks whose rows later deltas rewrote
                           (damage there would vanish from the output).

Depth 'items' (what `convert` asks for) checks every file's size and, where
the manifest records one, its CRC32C: the JSON files (the item's manifest,
layout, zarr metadata), the copied items' files and the chunk files stored
without the zarr crc32c codec. Chunks stored with that codec are checked for
size only here: their CRC32C is their trailer, checked as the conversion
reads them (`_direct`, TensorStore), so they are read once.

A step without an integrity manifest (written before manifests existed, or
copied without it) is refused, as a restore refuses it: `sc-checkpoint
verify --adopt STEP` checks it and writes its manifest.
"""

from __future__ import annotations

from etils import epath

from checkpoint import _integrity
from checkpoint._chain import bare_item_problems, chain_problems, walk_chain
from checkpoint._errors import NotACheckpointError
from checkpoint._integrity import Depth, Problem


def verify_source(
    src: epath.Path, item: epath.Path | None, *, depth: Depth = "items",
    purpose: str = "converted",
) -> list[Problem]:
  """Checks every file a conversion of `src` (embedding item `item`) reads; see the module doc.

  Args:
    src: the source: a step directory or an embedding item.
    item: the embedding item (`src` itself, or the one inside the step);
      None when there is none, which the reader reports (after the step's
      own check where `src` is a step with a manifest: an item that lost its
      manifest.json is damage, named as such).
    depth: `_integrity.Depth`; 'structure' checks sizes and small files
      only (a cheap check before the source's layout is read).
    purpose: what the source is read for, in messages ("being converted").

  Returns:
    The source step's foreign entries (files its manifest does not list),
    which a conversion leaves out of its output.

  Raises:
    CorruptCheckpointError: a file is missing, truncated, changed or a
      symbolic link, or a manifest is damaged; naming every such file.
    NotACheckpointError: a step without an integrity manifest.
  """
  if item is None:
    if (src / _integrity.INTEGRITY_FILE).exists():
      _check(src, None, depth, purpose)
    return []
  if item != src:
    step, items = src, None
  else:
    step, items = step_of_item(item), [item.name]
  if step is None:  # A bare item (a full one: convert writes no deltas).
    problems = bare_item_problems(item, depth)
    _integrity.raise_for(problems, f"the embedding item {item} being {purpose}",
                         _integrity.ITEM_ADVICE)
    return [problem for problem in problems if problem.severity == "foreign"]
  problems = _check(step, items, depth, purpose)
  # The earlier steps must have manifests too (a replaced one is named after damaged ones).
  for link, _ in walk_chain(item, check_ids=False)[:-1]:
    _require_manifest(link.parent, purpose, f", an earlier step of the delta chain of {item},")
  earlier_depth: Depth = "structure" if depth == "structure" else "full"
  _integrity.raise_for(chain_problems(item, earlier_depth),
                       f"the delta chain of {item} being {purpose} (its earlier steps)")
  return [problem for problem in problems if problem.severity == "foreign"]


def step_of_item(item: epath.Path) -> epath.Path | None:
  """The step directory holding an embedding item, or None for a bare item."""
  step = item.parent
  integrity = step / _integrity.INTEGRITY_FILE
  if _integrity.is_link(integrity) or integrity.exists():
    return step
  return step if (step / _integrity.ORBAX_STEP_METADATA).exists() else None


def _check(step: epath.Path, items: list[str] | None, depth: Depth,
           purpose: str) -> list[Problem]:
  _require_manifest(step, purpose)
  problems = _integrity.check_step(step, depth=depth, items=items)
  _integrity.raise_for(problems, f"the checkpoint step {step} being {purpose}")
  return problems


def _require_manifest(step: epath.Path, purpose: str, role: str = "") -> None:
  """Raises NotACheckpointError unless `step` has an integrity manifest; `role`: how
  the step relates to the source (", an earlier step of ...,"), for the message."""
  integrity = step / _integrity.INTEGRITY_FILE
  if not _integrity.is_link(step) and not _integrity.is_link(integrity) and not integrity.exists():
    raise NotACheckpointError(
        f"checkpoint step {step}{role} has no {_integrity.INTEGRITY_FILE} (written by a version"
        " without integrity checks, or copied without it), so its files cannot be verified; it"
        f" is not {purpose}, as it is not restored. Check it and write its manifest with"
        f" `sc-checkpoint verify --adopt {step}` (the step directory must be named by its step"
        " number), then try again."
    )
