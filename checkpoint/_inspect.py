"""Describing a checkpoint without reading its arrays.

`inspect` accepts an embedding item directory, an Orbax step directory (the
embedding item is found inside; the other items are listed) or a
CheckpointManager root directory (its steps are listed and the latest one is
described). The result is JSON-friendly; `format_description` renders it.

What it describes is read from the item's JSON files, so those are checked
first against the integrity manifest of the step holding them (sizes and
checksums, as `verify_source` does at the structure depth), and the earlier
steps of a delta chain likewise: a damaged step is refused, never described
as saved; a bare item is checked against its own manifest. A step that lost
its integrity manifest is refused too (its item records that it had one); a
step that never had one (written by an older version or by Orbax's own
managers, or not yet adopted) is described as it is.
"""

from __future__ import annotations

import os
from typing import Any

from etils import epath

from checkpoint._errors import CheckpointError, CheckpointReadError, NotACheckpointError
from checkpoint._format import MANIFEST_FILE
from checkpoint._chain import (
    ChainReader,
    chain_summary,
    open_reader,
    raise_if_step_lost_its_manifest,
    save_id_of,
)
from checkpoint import _integrity
from checkpoint._integrity import is_link
from checkpoint._optimizers import common_name
from checkpoint._source import step_of_item, verify_source
from checkpoint._steps import manifest_problem
from checkpoint._storage import as_path

_TMP_MARK = ".orbax-checkpoint-tmp"


def describe_item(directory: epath.PathLike) -> dict[str, Any]:
  """Stacks, tables, shapes, dtypes, bytes and layout of one embedding item."""
  reader = open_reader(directory)
  manifest = reader.manifest
  groups = []
  for group in manifest.groups:
    arrays = [
        {
            "array": "table",
            "shape": list(group.table.shape),
            "dtype": group.table.dtype,
            "chunk_rows": group.table.chunk_rows,
            "bytes": group.table.nbytes,
        }
    ]
    for spec in group.slot_specs:
      info = group.slots[spec.name]
      arrays.append(
          {
              "array": f"slot {spec.name}",
              "shape": list(info.shape),
              "dtype": info.dtype,
              "chunk_rows": info.chunk_rows,
              "bytes": info.nbytes,
              "width": spec.width,
              "initial_value": spec.initial_value,
          }
      )
    entry: dict[str, Any] = {"name": group.name, "arrays": arrays, "bytes": group.nbytes}
    if reader.layout is not None:
      stack = reader.layout.stack(group.name)
      entry["rows_per_shard"] = stack.rows_per_shard
      entry["padded_embedding_dim"] = stack.padded_embedding_dim
      entry["tables"] = [
          {
              "name": t.name,
              "vocabulary_size": t.vocabulary_size,
              "embedding_dim": t.embedding_dim,
              "padded_vocabulary_size": t.padded_vocabulary_size,
              "row_offset": t.row_offset,
              "shard_rotation": t.shard_rotation,
              "optimizer": reader.optimizer_name(t.name),
          }
          for t in stack.tables
      ]
    else:
      vocab, dim = group.table.shape
      entry["tables"] = [
          {
              "name": group.name,
              "vocabulary_size": vocab,
              "embedding_dim": dim,
              "optimizer": reader.optimizer_name(group.name),
          }
      ]
    # The optimizer owning the slots (None: not recorded, as in older checkpoints).
    entry["optimizer"] = common_name({t["name"]: t["optimizer"] for t in entry["tables"]})
    groups.append(entry)
  out: dict[str, Any] = {
      "path": str(epath.Path(directory)),
      "kind": manifest.kind,
      "save_id": save_id_of(epath.Path(directory)),
      "storage": manifest.storage.to_dict(),
      "bytes": manifest.nbytes,
      "groups": groups,
  }
  if isinstance(reader, ChainReader):
    out["chain"] = chain_summary(directory)
  if reader.layout is not None:
    out["layout"] = {
        "num_devices": reader.layout.num_devices,
        "shards_per_device": reader.layout.shards_per_device,
        "num_shards": reader.layout.num_shards,
    }
  return out


def step_of(directory: epath.Path) -> int | None:
  """The step number a step directory's name ends in ("12", "ckpt_12"), None for another."""
  name = directory.name
  digits = name.rsplit("_", 1)[-1]
  return int(digits) if digits.isdigit() else None


def inspect(path: epath.PathLike) -> dict[str, Any]:
  """Describes an embedding item, an Orbax step directory or a manager root.

  Returns:
    A JSON-friendly dict: for a root, {"steps", "latest_step", "unfinished",
    "incomplete", "unreadable", "latest"} ("latest" describes the newest step
    that can be read, "latest_step"; "unreadable" names each newer one and why);
    for a step, {"step", "items", "embedding": describe_item(...)} (the
    embedding entry absent if the step has none, and "embedding_items", their
    names, instead if it has several); for an item,
    describe_item(...).

  Raises:
    NotACheckpointError: the path is none of these.
  """
  path = as_path(path, "inspect path")
  if not path.exists():
    raise NotACheckpointError(f"{path} does not exist.")
  if (path / MANIFEST_FILE).exists():
    _check_step_holding(path, path)
    return describe_item(path)
  if not path.is_dir():
    raise NotACheckpointError(f"{path} is a file, not a checkpoint directory.")
  # Nothing is read through a link (a linked step or item is not described).
  children = [child for child in path.iterdir() if child.is_dir() and not is_link(child)]
  items = sorted(child.name for child in children if not child.name.startswith("."))
  embedding = [child for child in children if (child / MANIFEST_FILE).exists()]
  if _integrity.holds_a_save(path) or embedding:
    _check_step_holding(path, embedding[0] if len(embedding) == 1 else None)
    out: dict[str, Any] = {"path": str(path), "step": step_of(path), "items": items}
    if len(embedding) == 1:
      out["embedding_item"] = embedding[0].name
      out["embedding"] = describe_item(embedding[0])
    elif embedding:  # one per embedding layer of a model: each is described by its path
      out["embedding_items"] = sorted(child.name for child in embedding)
    return out
  candidates = {
      child: step
      for child in children
      if _TMP_MARK not in child.name
      and (step := step_of(child)) is not None
      and _integrity.holds_a_save(child)
  }
  incomplete = {child: manifest_problem(child) for child in candidates}
  steps = sorted(step for child, step in candidates.items() if incomplete[child] is None)
  if not steps:
    skipped = "; ".join(f"{child}: {why}" for child, why in incomplete.items() if why)
    raise NotACheckpointError(
        f"{path} is not a checkpoint: no {MANIFEST_FILE} (embedding item), no Orbax step"
        f" metadata or {_integrity.INTEGRITY_FILE}, and no complete step directories."
        + (f" Incomplete: {skipped}" if skipped else "")
    )
  # The newest step that can be described, as a restore of the latest takes the newest
  # that restores: a step whose delta chain is broken is named, not the end of the listing.
  unreadable: dict[str, str] = {}
  for step in reversed(steps):
    child = next(child for child, number in candidates.items() if number == step)
    try:
      latest = inspect(child)
      break
    except CheckpointReadError:
      raise  # The storage refused or failed a read: nothing says the step is damaged.
    except CheckpointError as error:
      unreadable[child.name] = str(error)
  else:
    (newest, why), *older = unreadable.items()
    raise NotACheckpointError(
        f"{path} holds no step that can be described: step {newest}: {why}" + (
            f" Nor can the older steps {', '.join(name for name, _ in older)} be described"
            f" (`sc-checkpoint verify {path}` names the problem of each)." if older else ""))
  unfinished = sorted(child.name for child in children if _TMP_MARK in child.name)
  return {
      "path": str(path),
      "steps": steps,
      "latest_step": step,
      "unfinished": unfinished,
      "incomplete": {child.name: why for child, why in sorted(incomplete.items()) if why},
      "unreadable": unreadable,
      "latest": latest,
  }


def _check_step_holding(src: epath.Path, item: epath.Path | None) -> None:
  """Raises CorruptCheckpointError naming every damaged file when the step holding
  `src` (a step, or embedding item `item` in one), or an earlier step of its delta
  chain, fails its integrity manifest at the structure depth, or holds another step's
  save; a bare item against its own manifest. See the module doc. A step named
  through a symbolic link to it (a `latest` link) is checked where the link points."""
  if item is not None and item == src and is_link(src.parent):  # <link>/embedding
    src = item = epath.Path(os.path.realpath(src.parent)) / src.name
  elif is_link(src):  # <link> to a step, or to an item
    real = epath.Path(os.path.realpath(src))
    item = None if item is None else real if item == src else real / item.name
    src = real
  step = src if item is None or item != src else step_of_item(item)
  if step is None or is_link(step / _integrity.INTEGRITY_FILE) or (
      step / _integrity.INTEGRITY_FILE).exists():
    verify_source(src, item, depth="structure", purpose="inspected")
  elif item is not None:
    raise_if_step_lost_its_manifest(item)


def format_description(info: dict[str, Any]) -> str:
  """Human-readable text for an `inspect` result."""
  lines: list[str] = []
  if "steps" in info:
    lines.append(f"checkpoint root {info['path']}")
    lines.append(f"  steps: {info['steps']}  latest: {info['latest_step']}")
    if info["unfinished"]:
      lines.append(f"  unfinished (temporary) saves: {info['unfinished']}")
    for name, why in info.get("incomplete", {}).items():
      lines.append(f"  incomplete step {name} (skipped): {why}")
    for name, why in info.get("unreadable", {}).items():
      lines.append(f"  step {name} cannot be read (skipped): {why}")
    lines.append("")
    return "\n".join(lines) + format_description(info["latest"])
  if "items" in info:
    # A converted copy's directory is not named by a step number.
    step = f"step {info['step']}" if info["step"] is not None else "Orbax checkpoint"
    lines.append(f"{step} at {info['path']}")
    lines.append(f"  Orbax items: {', '.join(info['items'])}")
    if "embedding_items" in info:
      lines.append(f"  embedding items: {', '.join(info['embedding_items'])} (inspect or convert"
                   " each item directory on its own)")
      return "\n".join(lines)
    if "embedding" not in info:
      lines.append("  (no embedding item)")
      return "\n".join(lines)
    lines.append(f"  embedding item: {info['embedding_item']}")
    info = info["embedding"]
  lines.append(f"embedding checkpoint ({info['kind']}) at {info['path']}: {_bytes(info['bytes'])}")
  if info.get("save_id") is not None:
    lines.append(f"  save id: {info['save_id']}")
  if "layout" in info:
    layout = info["layout"]
    whose = f" (of base step {info['chain'][0]['step']})" if "chain" in info else ""
    lines.append(
        f"  layout{whose}: G={layout['num_devices']} devices x S={layout['shards_per_device']}"
        f" shards per device = N={layout['num_shards']} shards"
    )
  storage = info["storage"]
  lines.append(
      f"  storage: compression={storage['compression']} checksum={storage['checksum']}"
      f" chunk_bytes={storage['chunk_bytes']}"
  )
  for link in info.get("chain", ()):
    if link["kind"] == "full":
      lines.append(f"  chain: base step {link['step']} (full) at {link['path']}"
                   + _id_text(link["save_id"]))
    else:
      rows = ", ".join(f"{name}: {count}" for name, count in link["rows"].items())
      lines.append(
          f"  chain: delta step {link['step']} (parent {link['parent_step']}),"
          f" {_delta_layout(link['layout'], info)}, rows {rows}" + _id_text(link["save_id"])
          + ("" if link["parent_id"] is None else f", parent id {link['parent_id']}")
      )
  for group in info["groups"]:
    head = "stack" if info["kind"] == "stacked" else "table"
    extra = (
        f"  R={group['rows_per_shard']} D'={group['padded_embedding_dim']}"
        if "rows_per_shard" in group
        else ""
    )
    # Per stack; per table where only some tables of the stack record it (a chain can).
    optimizer = group.get("optimizer")
    if optimizer is not None:
      extra += f"  optimizer={optimizer}"
    lines.append(f"  {head} {group['name']!r}: {_bytes(group['bytes'])}{extra}")
    if info["kind"] == "stacked":
      for table in group["tables"]:
        known = table.get("optimizer")
        lines.append(
            f"    table {table['name']!r}: V={table['vocabulary_size']} D={table['embedding_dim']}"
            f" V'={table['padded_vocabulary_size']} o={table['row_offset']}"
            f" r={table['shard_rotation']}"
            + (f"  optimizer={known}" if optimizer is None and known is not None else "")
        )
    for array in group["arrays"]:
      lines.append(
          f"    {array['array']:<20} {array['dtype']:>9} {str(array['shape']):>18}"
          f" {_bytes(array['bytes']):>10}  chunk_rows={array['chunk_rows']}"
      )
  return "\n".join(lines)


def _id_text(save_id: str | None) -> str:
  return "" if save_id is None else f", id {save_id}"


def _delta_layout(layout: dict[str, Any], info: dict[str, Any]) -> str:
  """A delta's layout: G and S, and its stacks where they differ from the base's."""
  text = f"layout G={layout['num_devices']} x S={layout['shards_per_device']}"
  base = {group["name"]: [table["name"] for table in group["tables"]] for group in info["groups"]}
  if layout["stacks"] != base:
    text += " stacks " + "; ".join(
        f"{name}: {', '.join(tables)}" for name, tables in layout["stacks"].items())
  return text


def _bytes(count: int) -> str:
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if count < 1024 or unit == "TiB":
      return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
    count /= 1024
  raise AssertionError
