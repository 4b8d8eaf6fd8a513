"""TensorStore storage of one 2-D array: zarr v3, row chunks, optional codecs.

Every array of a checkpoint (a stacked table [V_s, D'], a stacked slot
[V_s, D'] or [V_s, w], or a per-table array [V, D] / [V, w]) is one zarr v3
array written through TensorStore:

  chunk shape  [c, width]: whole rows. For a stacked array c divides the rows
               per shard R, so every chunk lies inside one shard (hence inside
               one device's block of S * R rows) and any shard, or any row
               range, is read back without touching other chunks.
  codecs       bytes (little endian) -> optional compression (zstd or blosc)
               -> optional crc32c checksum of every chunk, verified on read.
  reads        never fill in missing chunks: a deleted chunk file is an error,
               not a block of zeros.
  direct reads local arrays of the default encoding are read without
               TensorStore's slow crc32c decode (`checkpoint._direct`).

Paths are `etils.epath` paths; local, gs:// and s3:// paths map to the
TensorStore file, gcs and s3 key-value stores.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Literal

import numpy as np
import tensorstore as ts
from etils import epath

from sc_framework._scalars import python_scalar_fields

Compression = Literal["none", "zstd", "blosc"]
Checksum = Literal["crc32c", "none"]

_DEFAULT_CHUNK_BYTES = 4 << 20
_CONTEXT = None


# The levels each codec accepts (TensorStore's zarr v3 zstd and blosc codecs).
_LEVELS = {"zstd": (-131072, 22), "blosc": (0, 9)}


@dataclasses.dataclass(frozen=True)
class StorageOptions:
  """How the arrays of an embedding checkpoint are encoded.

  Measured with benchmarks/bench_checkpoint.py (2 GiB of float32 tables):
  zstd and blosc shrink trained-looking (random) embeddings by only 6-8% and
  slow saves and restores, hence no compression by default. The crc32c
  checksum is on by default. Restores of the default encoding read each chunk
  straight into place and check it with hardware CRC32C (`checkpoint._direct`):
  1.3x numpy.load's rate (2 GiB, loaded 2-core machine), where TensorStore's
  own decode of the codec (still used for compressed arrays and cloud paths)
  halved it. On save it costs little (TensorStore writes 128 MiB at the same
  rate with and without it), and the training loop is blocked for under 1%
  of a save either way.

  Attributes:
    compression: 'none' (default), 'zstd' or 'blosc' (lz4 with byte shuffle).
    compression_level: the codec's level, None for its default: zstd
      -131072..22 (default 1), blosc 0..9 (default 5); unused with 'none'.
    checksum: 'crc32c' (default) stores a CRC32C of every chunk and verifies
      it on every read, so silent corruption becomes an error; 'none' skips it
      (truncated and missing chunks are still detected, and a
      CheckpointManager step's integrity manifest then checksums the chunk
      files instead).
    chunk_bytes: the target size of one chunk; the chunk row count is the
      largest divisor of the rows per shard that fits.
  """

  compression: Compression = "none"
  compression_level: int | None = None
  checksum: Checksum = "crc32c"
  chunk_bytes: int = _DEFAULT_CHUNK_BYTES

  def __post_init__(self):
    python_scalar_fields(self)
    if self.compression not in ("none", "zstd", "blosc"):
      raise ValueError(
          "StorageOptions: compression must be 'none', 'zstd' or 'blosc', got"
          f" {self.compression!r}."
      )
    if self.checksum not in ("crc32c", "none"):
      raise ValueError(
          f"StorageOptions: checksum must be 'crc32c' or 'none', got {self.checksum!r}."
      )
    if (
        isinstance(self.chunk_bytes, bool)
        or not isinstance(self.chunk_bytes, int)
        or self.chunk_bytes < 1024
    ):
      raise ValueError(
          f"StorageOptions: chunk_bytes must be an int >= 1024, got {self.chunk_bytes!r}."
      )
    level = self.compression_level
    if level is not None and (isinstance(level, bool) or not isinstance(level, int)):
      raise ValueError(f"StorageOptions: compression_level must be an int or None, got {level!r}.")
    bounds = _LEVELS.get(self.compression)
    if level is not None and bounds is not None and not bounds[0] <= level <= bounds[1]:
      raise ValueError(
          f"StorageOptions: compression_level {level} is outside {self.compression}'s levels"
          f" {bounds[0]}..{bounds[1]}; pass one of them, or None for the codec's default."
      )

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, data: dict) -> "StorageOptions":
    return cls(
        **{field.name: data[field.name] for field in dataclasses.fields(cls) if field.name in data}
    )

  def codecs(self, itemsize: int) -> list[dict]:
    """The zarr v3 codec chain."""
    codecs: list[dict] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if self.compression == "zstd":
      level = 1 if self.compression_level is None else self.compression_level
      codecs.append({"name": "zstd", "configuration": {"level": level}})
    elif self.compression == "blosc":
      level = 5 if self.compression_level is None else self.compression_level
      codecs.append(
          {
              "name": "blosc",
              "configuration": {
                  "cname": "lz4",
                  "clevel": level,
                  "shuffle": "shuffle",
                  "typesize": itemsize,
              },
          }
      )
    if self.checksum == "crc32c":
      codecs.append({"name": "crc32c"})
    return codecs

  @property
  def direct_readable(self) -> bool:
    """Whether chunk files hold raw little-endian rows + a CRC32C trailer."""
    return self.compression == "none" and self.checksum == "crc32c"


def context() -> ts.Context:
  """The TensorStore context shared by every checkpoint read and write."""
  global _CONTEXT
  if _CONTEXT is None:
    _CONTEXT = ts.Context({"file_io_concurrency": {"limit": 64}})
  return _CONTEXT


def as_path(value: epath.PathLike, what: str = "path") -> epath.Path:
  """`value` as an etils path; a file:///... URL becomes the local path it names,
  and a leading ~ the home directory (os.path.expanduser).

  Raises:
    TypeError: a value that is no path (None, a number, bytes).
    ValueError: a URL of a scheme etils has no handler for (etils itself
      raises a bare KeyError of the scheme), or a file:// URL that names no
      absolute local path; the message names `what` and the value.
  """
  try:
    text = os.fspath(value)
  except TypeError:
    raise TypeError(f"{what} must be a path (a str or os.PathLike), got {value!r}.") from None
  if isinstance(text, bytes):
    raise TypeError(f"{what} must be a path as a str, got bytes {text!r}.")
  if not text:
    raise ValueError(f"{what} is empty; give a path ('.' for the current directory).")
  if text.startswith("file://"):
    local = text[len("file://"):]
    if not local.startswith("/"):
      raise ValueError(
          f"{what} {text!r}: a file:// URL must name an absolute local path, as"
          " file:///data/checkpoints; or pass the local path itself."
      )
    return epath.Path(local)
  if text.startswith("~"):  # As a shell would: not a directory named '~' here.
    return epath.Path(os.path.expanduser(text))
  try:
    return epath.Path(value)
  except KeyError:
    scheme = text.partition("://")[0]
    raise ValueError(
        f"{what} {text!r}: etils.epath has no handler for {scheme}:// paths. Pass a local path,"
        " or a gs:// or s3:// URL (with that filesystem's package installed)."
    ) from None


def kvstore_spec(path: epath.PathLike) -> dict:
  """The TensorStore key-value store of a directory (local, gs:// or s3://)."""
  text = os.fspath(path)
  for scheme, driver in (("gs://", "gcs"), ("s3://", "s3")):
    if text.startswith(scheme):
      bucket, _, key = text[len(scheme) :].partition("/")
      return {"driver": driver, "bucket": bucket, "path": key.rstrip("/") + "/"}
  if "://" in text:
    raise ValueError(
        f"unsupported path {text!r}: use a local path, gs://bucket/... or s3://bucket/...."
    )
  check_local_path(text)
  return {"driver": "file", "path": os.path.abspath(text).rstrip("/") + "/"}


def orbax_path(path: epath.Path) -> epath.Path:
  """`path` as Orbax's handlers take it: a local path made absolute (they refuse relative
  ones), a gs:// or s3:// path as it is."""
  return path if "://" in os.fspath(path) else path.absolute()


def check_local_path(path: epath.PathLike) -> None:
  """Raises if TensorStore cannot address a local path as it is written.

  TensorStore's file driver reads a backslash as a path separator on every
  platform: the arrays of a checkpoint under '/data/a\\b' would be written
  to '/data/a/b', outside the checkpoint, and never found there again.
  """
  text = os.fspath(path)
  if "://" in text:
    return
  text = os.path.abspath(text)  # A relative path lies under the working directory.
  if "\\" in text:
    raise ValueError(
        f"checkpoint path {text!r} contains a backslash, which TensorStore reads as a path"
        " separator: the arrays would be written outside it (to"
        f" {text.replace(chr(92), '/')!r}). Choose a directory whose path has no backslash."
    )


def chunk_rows_for(rows_per_shard: int, row_bytes: int, chunk_bytes: int) -> int:
  """Rows per chunk: the largest divisor of R whose chunk fits in `chunk_bytes`.

  When R has no useful divisor (R = 8p with p a large prime, say) and a whole
  shard is at most 16 chunk sizes, the whole shard is one chunk instead.
  """
  target = max(1, chunk_bytes // max(row_bytes, 1))
  if rows_per_shard <= target:
    return rows_per_shard
  best = 1
  divisor = 1
  while divisor * divisor <= rows_per_shard:
    if rows_per_shard % divisor == 0:
      for candidate in (divisor, rows_per_shard // divisor):
        if best < candidate <= target:
          best = candidate
    divisor += 1
  if best * 16 < target and rows_per_shard * row_bytes <= 16 * chunk_bytes:
    return rows_per_shard
  return best


def create_spec(
    path: epath.Path,
    shape: tuple[int, int],
    dtype: np.dtype,
    chunk_rows: int,
    options: StorageOptions,
) -> dict:
  """The spec that creates the zarr v3 array of one checkpoint array."""
  dtype = np.dtype(dtype)
  return {
      "driver": "zarr3",
      "kvstore": kvstore_spec(path),
      "metadata": {
          "shape": list(shape),
          "data_type": dtype.name,
          "chunk_grid": {
              "name": "regular",
              "configuration": {"chunk_shape": [chunk_rows, shape[1]]},
          },
          "chunk_key_encoding": {"name": "default"},
          "fill_value": 0,
          "codecs": options.codecs(dtype.itemsize),
      },
      "store_data_equal_to_fill_value": True,
      "fill_missing_data_reads": False,
  }


def open_for_write(spec: dict) -> ts.Future:
  """Creates (or opens, if another process created it identically) an array."""
  return ts.open(spec, create=True, open=True, context=context())


def open_for_read(path: epath.Path) -> ts.Future:
  """Opens an existing array for reading; missing chunks read as errors."""
  spec = {"driver": "zarr3", "kvstore": kvstore_spec(path), "fill_missing_data_reads": False}
  return ts.open(spec, open=True, read=True, context=context())


def host_buffer(shape: tuple[int, int], dtype, fill: float | None = None) -> np.ndarray:
  """A C-contiguous host array aligned to 64 bytes (optionally filled).

  On CPU, `jax.device_put` adopts a 64-byte-aligned numpy array without
  copying it, so a restored block costs one copy (chunk -> block), not two.
  """
  dtype = np.dtype(dtype)
  nbytes = int(np.prod(shape)) * dtype.itemsize
  raw = np.empty(nbytes + 64, np.uint8)
  offset = -raw.ctypes.data % 64
  out = raw[offset : offset + nbytes].view(dtype).reshape(shape)
  if fill is not None:
    out.fill(fill)
  return out


def copy_rows(
    store: ts.TensorStore, rows: np.ndarray, out: np.ndarray, out_rows: np.ndarray, columns: int
) -> list[ts.Future]:
  """Starts copying stored rows `rows`, columns [0, columns), into `out[out_rows]`.

  The (row, out_row) pairs are sorted by row and cut into runs in which both
  advance by constant positive steps; each run is one strided copy (a shard's
  slab of a table scattered with stride N into a per-table array, say), and
  rows that fit no run are copied with one index-array copy. TensorStore
  decodes each chunk straight into `out` (no intermediate array) and reads
  only the chunks holding the rows.

  Returns:
    The futures of the copies; `out` is complete when all are done.
  """
  rows = np.asarray(rows, dtype=np.int64).reshape(-1)
  out_rows = np.asarray(out_rows, dtype=np.int64).reshape(-1)
  if rows.size == 0:
    return []
  if np.any(rows[1:] < rows[:-1]):
    order = np.argsort(rows, kind="stable")
    rows, out_rows = rows[order], out_rows[order]
  target = ts.array(out)
  runs, scattered = strided_runs(rows, out_rows, max_runs=max(16, rows.size // 64))
  futures = [
      target[int(out_rows[a]) : int(out_rows[b - 1]) + 1 : out_step, :columns].write(
          store[int(rows[a]) : int(rows[b - 1]) + 1 : step, :columns]
      )
      for a, b, step, out_step in runs
  ]
  if scattered.size:
    futures.append(target[out_rows[scattered], :columns].write(store[rows[scattered], :columns]))
  return futures


def strided_runs(rows: np.ndarray, out_rows: np.ndarray, max_runs: int):
  """Cuts sorted (row, out_row) pairs into runs of constant positive steps.

  Returns:
    (runs, scattered): runs as (start, stop, step, out_step) over the
    positions; `scattered` the positions left for an index-array copy (all of
    them when more than `max_runs` runs would be needed).
  """
  n = rows.size
  if n == 1:
    return [(0, 1, 1, 1)], np.zeros((0,), np.int64)
  steps = np.stack([np.diff(rows), np.diff(out_rows)])
  changes = np.flatnonzero(np.any(steps[:, 1:] != steps[:, :-1], axis=0)) + 1
  if changes.size + 1 > max_runs:
    return [], np.arange(n)
  runs, scattered, position = [], [], 0
  # Pairs [first, end) share their steps, so positions first..end form a run;
  # a run whose first position is taken by the previous run starts one later.
  for first, end in zip(np.concatenate([[0], changes]), np.concatenate([changes, [n - 1]])):
    start, end = max(int(first), position), int(end)
    if start >= end:
      continue
    step, out_step = int(steps[0, first]), int(steps[1, first])
    if step > 0 and out_step > 0:
      runs.append((start, end + 1, step, out_step))
    else:
      scattered.extend(range(start, end + 1))
    position = end + 1
  runs.extend((p, p + 1, 1, 1) for p in range(position, n))
  return runs, np.asarray(scattered, dtype=np.int64)
