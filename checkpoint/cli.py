"""The `sc-checkpoint` command: inspect, verify, convert and compact embedding checkpoints.

  sc-checkpoint inspect PATH [--json]
  sc-checkpoint verify PATH [--adopt]
  sc-checkpoint convert SRC DST (--layout FILE | --num-devices G
                                 [--shards-per-device S] [--groups 'a,b;c'] | --unstacked)
                                [--table-dtype float32|bfloat16]
  sc-checkpoint compact STEP_DIR

A delta (incremental) step reads as its chain: `inspect` lists the chain
(base, deltas, rows per delta), `convert` writes its full state, and
`compact` replaces it by a full step in place.

PATH / SRC may be an embedding item, an Orbax step directory or a
CheckpointManager root (`convert` then takes its latest step that reads back;
a Trainer's checkpoints are in WORKDIR/checkpoints). The target of `convert` is a layout
JSON file (EmbeddingLayout.to_json), optionally modified by the flags, or the
source layout modified by the flags, or `--unstacked` for per-table arrays.
`convert` first checks every file it reads against the source step's
integrity manifest and refuses a step without one (`verify --adopt` gives
it one); see `checkpoint._source`.
Exit status 0 on success, 1 on a checkpoint or conversion error, 2 on bad
usage; every error is one line on stderr naming the flag or path.

A subcommand is a parser added in `_parser` and a function (args) -> exit
status in `_COMMANDS`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import warnings
from collections.abc import Sequence

from etils import epath

from checkpoint._chain import open_reader
from checkpoint._compact import compact
from checkpoint._convert import check_destination, convert
from checkpoint._errors import CheckpointError, CorruptCheckpointError, NotACheckpointError
from checkpoint._format import MANIFEST_FILE
from checkpoint._integrity import INTEGRITY_FILE, is_link
from checkpoint._inspect import format_description, inspect, step_of
from checkpoint._layouts import layout_for_tables, parse_groups, relayout
from checkpoint._reader import (
    CheckpointReader,
    embedding_items,
    find_item,
    several_items_hint,
)
from checkpoint._source import verify_source
from checkpoint._steps import warn_skipped
from checkpoint._storage import StorageOptions, as_path
from checkpoint._verify import adopt_step, verify
from sc_framework.cli_types import integer_at_least
from sc_framework.stacking import EmbeddingLayout
from sc_framework.stacking._layout import MAX_SHARDS_PER_DEVICE


class _Parser(argparse.ArgumentParser):
  """Reports bad usage as one line naming the flag (no usage block); exit status 2."""

  def error(self, message: str):
    self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
  parser = _Parser(
      prog="sc-checkpoint",
      description="Inspect, verify, convert and compact embedding-table checkpoints.",
      allow_abbrev=False,
  )
  commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
  show = commands.add_parser(
      "inspect", help="print stacks, tables, shapes, dtypes, bytes and layout", allow_abbrev=False
  )
  show.add_argument("path", help="embedding item, Orbax step directory or CheckpointManager root")
  show.add_argument("--json", action="store_true", help="print JSON instead of text")
  conv = commands.add_parser(
      "convert",
      help="write the checkpoint in another layout (streamed, bounded memory)",
      description="Convert SRC to another layout (or to per-table arrays) at DST. Every file"
      " read is first checked against the source step's integrity manifest; a step without"
      " one is refused (run `sc-checkpoint verify --adopt STEP` first).",
      allow_abbrev=False,
  )
  conv.add_argument(
      "src", help="embedding item, Orbax step directory or checkpoints root (its latest step)"
  )
  conv.add_argument("dst", help="output directory (must not exist unless --overwrite)")
  conv.add_argument("--layout", help="target layout JSON file (EmbeddingLayout.to_json)")
  conv.add_argument(
      "--num-devices", type=integer_at_least(1), help="target G (devices on the table axis)"
  )
  conv.add_argument(
      "--shards-per-device", type=integer_at_least(1, MAX_SHARDS_PER_DEVICE),
      help="target S (shards per device)",
  )
  conv.add_argument(
      "--groups", type=_groups_flag,
      help="target stacking groups: 'a,b;c' (';' between stacks), 'separate' (one table per"
      " stack) or 'same' (default: as the source)",
  )
  conv.add_argument(
      "--unstacked", action="store_true", help="write one plain array per table and slot"
  )
  conv.add_argument(
      "--compression", choices=["none", "zstd", "blosc"],
      help="chunk compression of the output, at the codec's default level (default: as the"
      " source, level included)",
  )
  conv.add_argument(
      "--checksum", choices=["crc32c", "none"],
      help="per-chunk CRC32C of the output (default: as the source)",
  )
  conv.add_argument(
      "--table-dtype", choices=["float32", "bfloat16"],
      help="dtype of the output's tables, each value rounded to nearest (default: as the"
      " source); slots are copied as they are. A Trainer resumes only tables of its"
      " table_dtype",
  )
  conv.add_argument(
      "--overwrite", action="store_true",
      help="replace DST if it exists (once the new one is complete)",
  )
  conv.add_argument(
      "--quiet", action="store_true", help="no progress lines on stderr (errors still print)"
  )
  _add_verify(commands)
  _add_compact(commands)
  return parser


def _add_verify(commands) -> None:
  check = commands.add_parser(
      "verify",
      help="check every file and chunk checksum without restoring (exit 1 on any error)",
      description="Check a checkpoint root, step or embedding item: every file against the"
      " step's integrity manifest and every chunk against its checksum. Prints one line per"
      " problem (ERROR: data that cannot be trusted; WARNING: an entry the manager did not"
      " write, left alone) and a summary; exit status 1 if there is any error.",
  )
  check.add_argument("path", help="CheckpointManager root, Orbax step directory or embedding item")
  check.add_argument(
      "--adopt", action="store_true",
      help="PATH is a step written without an integrity manifest (by an older version): check"
      " every file that can be checked and, if all are sound, write its manifest so that it"
      " restores again (default: off)",
  )


def _verify(args: argparse.Namespace) -> int:
  problems = adopt_step(args.path) if args.adopt else verify(args.path)
  for problem in problems:
    label = "ERROR" if problem.severity == "error" else "WARNING"
    _print_out(f"{label} {problem}")
  failed = sum(problem.severity == "error" for problem in problems)
  _print_out(f"{args.path}: {failed} errors, {len(problems) - failed} warnings")
  unmanifested = sorted({
      str(problem.path.parent) for problem in problems
      if problem.severity == "error" and problem.path.name == INTEGRITY_FILE
      and not problem.path.exists() and not args.adopt
  })
  for step in unmanifested:
    _print_out(f"{step} has no {INTEGRITY_FILE}: if an older version wrote it (before"
               f" integrity manifests) rather than a partial copy, `sc-checkpoint verify --adopt"
               f" {step}` checks what can be checked and gives it one.")
  hint = _not_a_checkpoint_hint(as_path(args.path, "PATH"))
  if failed and hint:
    _print_out(hint.strip())
  return 1 if failed else 0


def _add_compact(commands) -> None:
  fold = commands.add_parser(
      "compact",
      help="replace a delta step by a full step holding the same state",
      description="Fold the chain of a delta step (base + deltas) into one full step, in place.",
  )
  fold.add_argument("step_dir", help="Orbax step directory (root/<step>) of a delta step")
  fold.add_argument("--quiet", action="store_true", help="no progress output")


def _compact(args: argparse.Namespace) -> int:
  start = time.perf_counter()
  done = compact(args.step_dir, progress=None if args.quiet else _Progress())
  if not args.quiet:
    state = f"compacted in {time.perf_counter() - start:.1f} s" if done else "already full"
    print(f"{args.step_dir}: {state}", file=sys.stderr)
  return 0


def _groups_flag(text: str) -> str:
  """--groups as given, once it parses ('same', 'separate' or 'a,b;c'); which
  tables it may name is known only from the source."""
  if text not in ("same", "separate"):
    try:
      parse_groups(text)
    except ValueError as error:
      raise argparse.ArgumentTypeError(str(error).removeprefix(f"--groups {text!r} ")) from None
  return text


def _layout_flags_given(args: argparse.Namespace) -> bool:
  return (
      args.num_devices is not None or args.shards_per_device is not None or args.groups is not None
  )


def _convert_usage_error(args: argparse.Namespace) -> str | None:
  """What is wrong with convert's flags taken together (None: nothing), before any I/O."""
  layout_flags = _layout_flags_given(args)
  if args.unstacked and (layout_flags or args.layout):
    return "--unstacked takes no --layout, --num-devices, --shards-per-device or --groups"
  recoded = args.table_dtype is not None or args.compression or args.checksum
  if not (args.unstacked or layout_flags or args.layout or recoded):
    return (
        "choose a target: --layout FILE, --num-devices/--shards-per-device/--groups,"
        " --unstacked, or --table-dtype, --compression or --checksum alone (the source's"
        " layout in another dtype or encoding)"
    )
  return None


def _target(args: argparse.Namespace, reader: CheckpointReader):
  """The target layout of convert (or "unstacked"); its flags were checked by main."""
  if args.unstacked:
    return "unstacked"
  if not _layout_flags_given(args) and not args.layout:
    # The dtype or chunk encoding only.
    return reader.layout if reader.layout is not None else "unstacked"
  base = reader.layout
  if args.layout:
    path = as_path(args.layout, "--layout")
    if not path.exists():
      raise ValueError(f"--layout {path}: no such file.")
    if path.is_dir():
      raise ValueError(f"--layout {path}: a directory; give the layout's JSON file.")
    try:
      base = EmbeddingLayout.from_json(path.read_text())
    except ValueError as error:
      raise ValueError(f"--layout {path}: {error}") from error
  groups = None
  if args.groups not in (None, "same"):
    names = base.table_names if base is not None else reader.table_names
    try:
      groups = [[name] for name in names] if args.groups == "separate" else parse_groups(
          args.groups)
    except ValueError as error:
      raise ValueError(f"--groups {args.groups!r}: {error}") from error
    unknown = sorted({name for group in groups for name in group} - set(names))
    if unknown:
      raise ValueError(
          f"--groups names tables {unknown}, which the {'--layout' if args.layout else 'source'}"
          f" does not hold; its tables: {sorted(names)}."
      )
  if base is None:
    if args.num_devices is None:
      raise ValueError(
          "the source is unstacked: give --num-devices (and optionally --shards-per-device,"
          " --groups)."
      )
    tables = {name: reader.table_shape(name) for name in reader.table_names}
    return layout_for_tables(
        tables,
        num_devices=args.num_devices,
        shards_per_device=args.shards_per_device or 1,
        groups=groups,
    )
  return relayout(
      base, num_devices=args.num_devices, shards_per_device=args.shards_per_device, groups=groups
  )


class _Progress:
  """Prints one line per second (and the last) to stderr."""

  def __init__(self):
    self._start = time.perf_counter()
    self._last = 0.0

  def __call__(self, done: int, total: int, what: str) -> None:
    now = time.perf_counter()
    if now - self._last < 1.0 and done < total:
      return
    self._last = now
    rate = done / max(now - self._start, 1e-9) / 2**20
    percent = 100.0 * done / max(total, 1)
    print(
        f"  {percent:5.1f}%  {done / 2**20:9.1f} / {total / 2**20:.1f} MiB"
        f"  {rate:7.1f} MiB/s  {what}",
        file=sys.stderr,
        flush=True,
    )


def _not_a_checkpoint_hint(path: epath.Path) -> str:
  """A hint when `path` looks like a Trainer workdir (it holds a checkpoints folder)."""
  if (path / "checkpoints").is_dir():
    return (f" It looks like a Trainer workdir, which keeps its checkpoints in"
            f" {path / 'checkpoints'}: pass that.")
  return ""


def _refuse_several_items(step: epath.Path) -> None:
  """Raises NotACheckpointError if `step` holds several embedding items (one per layer)."""
  items = embedding_items(step)
  if len(items) > 1:
    raise NotACheckpointError(f"{step} cannot be converted as one checkpoint."
                              f"{several_items_hint(items)} Convert each item directory on its"
                              " own.")


def _sources(path: str, quiet: bool) -> list[epath.Path]:
  """The checkpoint to convert: an item or a step directory ([it]), or a root's complete
  steps, newest first from its latest that can be read (the next is converted when one
  fails a chunk's checksum, which only reading it shows, as a restore of the latest
  step falls back).

  Raises:
    NotACheckpointError: `path` is none of these (with a hint for a workdir).
  """
  src = as_path(path, "SRC")
  if (src / MANIFEST_FILE).exists() or find_item(src) is not None:
    return [src]
  _refuse_several_items(src)
  try:
    info = inspect(src)
  except NotACheckpointError as error:
    raise NotACheckpointError(f"{error}{_not_a_checkpoint_hint(src)}") from None
  if "latest_step" not in info:  # a step directory without an embedding item
    verify_source(src, None)  # a step whose item lost its manifest.json: damage, named
    raise NotACheckpointError(
        f"{src} has no embedding item (no subdirectory with {MANIFEST_FILE}); give the step"
        " directory of an embedding checkpoint or its embedding item."
    )
  latest = epath.Path(info["latest"]["path"])
  _refuse_several_items(latest)
  # Newer steps skipped, incomplete or unreadable (a broken delta chain, a step
  # directory holding another step's save): said even when quiet.
  for name, why in {**info["incomplete"], **info["unreadable"]}.items():
    if int(name.rsplit("_", 1)[-1]) > info["latest_step"]:
      warn_skipped(src / name, why)
  if not quiet:
    print(f"{src} is a checkpoints root: converting its latest step {info['latest_step']}"
          f" ({latest})", file=sys.stderr, flush=True)
  older = [child for child in src.iterdir() if not is_link(child)
           and (step_of(child) or -1) in info["steps"] and step_of(child) < info["latest_step"]]
  return [latest, *sorted(older, key=step_of, reverse=True)]


def _inspect(args: argparse.Namespace) -> int:
  path = as_path(args.path, "PATH")
  try:
    info = inspect(path)
  except NotACheckpointError as error:
    raise NotACheckpointError(f"{error}{_not_a_checkpoint_hint(path)}") from None
  _print_out(json.dumps(info, indent=1) if args.json else format_description(info))
  return 0


_RELISTS = 3  # A root whose steps a running job keeps deleting is listed again at most so often.


def _convert(args: argparse.Namespace) -> int:
  """Converts SRC; of a root, the newest step that reads back (see `_sources`).

  A root's step deleted while it is converted (the retention of a job still
  writing there) has the root listed again and its newest step converted, as a
  restore of the latest step does; a step whose chunk fails its checksum has
  the step before it converted.
  """
  sources = _sources(args.src, args.quiet)
  root = sources[0] != as_path(args.src, "SRC")
  relists = 0
  while True:
    src, older = sources[0], sources[1:]
    try:
      return _convert_step(args, src)
    except (CheckpointError, OSError) as error:
      if root and relists < _RELISTS and not src.exists():
        relists += 1
        if not args.quiet:
          print(f"{src} was deleted while it was converted (a job writing {args.src} keeps only"
                " its latest steps): listing the steps again", file=sys.stderr, flush=True)
        sources = _sources(args.src, args.quiet)
        continue
      # The bytes of a chunk, known once read; not a read the storage failed.
      if not older or not isinstance(error, CorruptCheckpointError):
        raise
      warn_skipped(src, str(error))
      if not args.quiet:
        print(f"converting the step before it instead: {older[0]}", file=sys.stderr, flush=True)
      sources = older


def _convert_step(args: argparse.Namespace, src: epath.Path) -> int:
  """Converts one item or step directory `src` to args.dst."""
  if as_path(args.dst, "DST").exists() and not args.overwrite:
    raise FileExistsError(
        f"{args.dst} already exists; choose another destination or pass --overwrite to replace"
        " it."
    )
  check_destination(src, as_path(args.dst, "DST"))  # Before anything is read or printed.
  item = src if (src / MANIFEST_FILE).exists() else find_item(src)
  # Sizes and small files (the layout read next) against the step's manifest
  # first; `convert` checks the rest.
  verify_source(src, item, depth="structure")
  reader = open_reader(src if item is None else item)  # A delta step reads as its chain.
  target = _target(args, reader)
  storage = reader.manifest.storage
  if args.compression or args.checksum:
    storage = StorageOptions(
        compression=args.compression or storage.compression,
        compression_level=storage.compression_level if not args.compression else None,
        checksum=args.checksum or storage.checksum,
        chunk_bytes=storage.chunk_bytes,
    )
  description = (
      "unstacked arrays"
      if target == "unstacked"
      else (
          f"G={target.num_devices} S={target.shards_per_device} stacks {list(target.stack_names)}"
      )
  )
  if not args.quiet:
    print(
        f"converting {src if item is None else item} -> {args.dst} ({description})",
        file=sys.stderr, flush=True
    )
  start = time.perf_counter()
  written = convert(
      src,
      args.dst,
      target,
      storage=storage,
      table_dtype=args.table_dtype,
      progress=None if args.quiet else _Progress(),
      overwrite=args.overwrite,
      host_memory="return",  # A process of its own: keep its peak memory flat.
  )
  if not args.quiet:
    print(f"done in {time.perf_counter() - start:.1f} s: {written}", file=sys.stderr)
  return 0


# Subcommand name -> its function (parsed arguments -> exit status).
_COMMANDS = {
    "inspect": _inspect, "convert": _convert, "verify": _verify, "compact": _compact,
}


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the CLI; returns the exit status."""
  parser = _parser()
  try:
    args = parser.parse_args(argv)
    if args.command == "convert" and (usage := _convert_usage_error(args)):
      parser.error(f"convert: {usage}")
  except SystemExit as exit_:
    return int(exit_.code or 0)
  try:
    with warnings.catch_warnings():
      warnings.showwarning = functools.partial(_show_warning, args.command)
      return _COMMANDS[args.command](args)
  except KeyboardInterrupt:
    print(f"sc-checkpoint {args.command}: interrupted; {_interrupted_leaves(args)}",
          file=sys.stderr)
    return 130
  except _StdoutClosed:
    # The reader of stdout stopped (`inspect ... | head`): not an error of ours.
    # Python's final flush of the dead pipe goes to /dev/null instead.
    try:
      os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
      pass  # stdout is no file (an embedding program's stream): nothing to redirect.
    return 0
  except (CheckpointError, ValueError, TypeError, KeyError, OSError) as error:
    message = error.args[0] if isinstance(error, KeyError) and error.args else error
    if isinstance(error, OSError) and error.errno is not None and error.filename is None:
      message = f"{_operands(args)}: {message}"  # the storage's error (ENOSPC) names no file
    print(f"sc-checkpoint {args.command}: error: {_one_line(str(message))}", file=sys.stderr)
    return 1
  except ImportError as error:
    if "://" not in _operands(args):
      raise  # a broken install, not the paths given
    # gs:// or s3:// without the package etils.epath needs for it
    print(f"sc-checkpoint {args.command}: error: {_operands(args)}: {error}", file=sys.stderr)
    return 1


def _interrupted_leaves(args: argparse.Namespace) -> str:
  """What an interrupted command leaves behind, for its message."""
  if args.command == "convert":
    return (f"{args.dst} is as it was unless the conversion had just finished; run the command"
            f" again (it names a {args.dst}.replaced an interrupted replacement left, if any).")
  if args.command == "compact":
    return (f"run it again: it finishes or undoes a compaction of {args.step_dir} that was"
            " cut short (as does a writable CheckpointManager opening its root).")
  return "nothing was changed."


def _operands(args: argparse.Namespace) -> str:
  """What a subcommand works on, to name it where the storage's error does not."""
  if args.command == "convert":
    return f"{args.src} -> {args.dst}"
  if args.command == "compact":
    return args.step_dir
  return args.path


class _StdoutClosed(Exception):
  """The reader of stdout went away (a closed pipe)."""


def _print_out(text: str) -> None:
  """Prints a result on stdout; _StdoutClosed when its reader has gone away."""
  try:
    print(text, flush=True)
  except BrokenPipeError as error:
    raise _StdoutClosed() from error


def _show_warning(command: str, message, category, filename, lineno, file=None, line=None):
  """A warning as one line on stderr, like the errors (no source file or line)."""
  del category, filename, lineno, file, line
  print(f"sc-checkpoint {command}: warning: {_one_line(str(message))}", file=sys.stderr)


def _one_line(message: str) -> str:
  """A message of several lines (a list of damaged files) as one line: '; ' between items
  (a space after one that ends a sentence or introduces the list)."""
  lines = [line.strip() for line in message.splitlines() if line.strip()]
  text = lines[0] if lines else ""
  for line in lines[1:]:
    text += (" " if text.endswith((":", ".")) else "; ") + line
  return text


if __name__ == "__main__":
  sys.exit(main())
