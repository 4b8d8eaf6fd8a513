"""Direct chunk reads of the default encoding, each chunk checked with hardware CRC32C.

A local array stored as [bytes (little endian), crc32c] (the default
`StorageOptions`) is read chunk by chunk straight into the destination, each
chunk's CRC32C checked with google-crc32c (hardware CRC32C, ~10 GB/s).
TensorStore's own decode of the crc32c codec runs at well under 1 GB/s in its
wheels, which halved the restore rate; it still reads compressed arrays and
cloud paths. A save writes every array through TensorStore (there the checksum
is not the bottleneck: writing through TensorStore with and without it, and
directly with google-crc32c, measured the same rate); a conversion writes the
chunk files of such arrays itself (`ChunkWriter`), which saves a copy
of every byte. TensorStore opens (or creates) every array before a direct
read (or write), which checks (or writes) its zarr.json.

The format read here is zarr v3's, written by TensorStore: the file of row
chunk i is `<array>/c/<i>/0` (default chunk key encoding, one column chunk),
holding the chunk's rows as raw little-endian bytes followed by 4 bytes, the
little-endian CRC32C of those bytes (the zarr v3 `crc32c` codec). Nothing is
read through a symbolic link.
"""

from __future__ import annotations

import collections
import ctypes
import os
import sys
import threading

import google_crc32c
import numpy as np
from etils import epath

from checkpoint._errors import CorruptCheckpointError
from checkpoint._storage import strided_runs


def chunk_file(path: epath.Path, chunk: int) -> epath.Path:
  """The file of row chunk `chunk` of an array (zarr v3 default keys, one column chunk)."""
  return path / "c" / str(chunk) / "0"


def read_chunks_direct(
    path: epath.Path, chunk_rows: int, start: int, stop: int, total_rows: int, out: np.ndarray
) -> bool:
  """Reads rows [start, stop) of a direct-readable array into `out`, checking every chunk.

  Applies to local paths, little-endian dtypes and chunk-aligned ranges
  (start a multiple of chunk_rows; stop too, or the array's end with a whole
  last chunk); returns False (nothing read) otherwise, for TensorStore to do it.

  Raises:
    CorruptCheckpointError: naming the chunk file that is missing, has the
      wrong size, is a symbolic link or fails its CRC32C.
  """
  text = os.fspath(path)
  if (
      "://" in text
      or out.dtype.byteorder == ">"
      or not out.flags.c_contiguous
      or start % chunk_rows
      or (stop % chunk_rows and stop != total_rows)
      or total_rows % chunk_rows
  ):
    return False
  row_bytes = out.shape[1] * out.dtype.itemsize
  view = out.reshape(-1).view(np.uint8)
  for chunk in range(start // chunk_rows, -(-stop // chunk_rows)):
    file = os.path.join(text, "c", str(chunk), "0")
    a = (chunk * chunk_rows - start) * row_bytes
    b = a + chunk_rows * row_bytes
    _read_chunk(file, view[a:b])
  return True


def gather_rows_direct(
    path: epath.Path,
    shape: tuple[int, int],
    chunk_rows: int,
    rows: np.ndarray,
    out: np.ndarray,
    out_rows: np.ndarray,
    columns: int,
    cache: "ChunkCache | None" = None,
) -> bool:
  """Copies stored rows `rows`, columns [0, columns), into `out[out_rows]`, chunk by chunk.

  A chunk whose rows are all requested, in order, to consecutive output rows
  of full width is read straight into `out`. Any other chunk holding a
  requested row is read once (or taken from `cache`, which keeps chunks read
  before), checked as in `read_chunks_direct`, then its rows are copied:
  runs of rows in which the stored and output rows both advance by constant
  steps are one strided slice copy each (a shard's slab of a table is one
  run), the rest one index-array copy. Same applicability
  as `read_chunks_direct` (local, little endian, whole chunks); returns False
  (nothing read) otherwise.
  """
  text = os.fspath(path)
  if "://" in text or out.dtype.byteorder == ">" or shape[0] % chunk_rows:
    return False
  rows = np.asarray(rows, dtype=np.int64).reshape(-1)
  out_rows = np.asarray(out_rows, dtype=np.int64).reshape(-1)
  if rows.size == 0:
    return True
  if np.any(rows[1:] < rows[:-1]):
    order = np.argsort(rows, kind="stable")
    rows, out_rows = rows[order], out_rows[order]
  chunks = rows // chunk_rows
  bounds = np.concatenate([[0], np.flatnonzero(np.diff(chunks)) + 1, [rows.size]])
  scratch = None if cache is not None else np.empty((chunk_rows, shape[1]), out.dtype)
  whole_rows = columns == shape[1] == out.shape[1] and out.flags.c_contiguous
  for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
    chunk = int(chunks[a])
    file = os.path.join(text, "c", str(chunk), "0")
    if whole_rows and _whole_chunk_in_order(rows[a:b], out_rows[a:b], chunk, chunk_rows):
      # Every row of the chunk, in order, to consecutive rows: read it in place.
      start = int(out_rows[a])
      _read_chunk(file, out[start : start + chunk_rows].reshape(-1).view(np.uint8))
      continue
    if cache is None:
      _read_chunk(file, scratch.reshape(-1).view(np.uint8))
      data = scratch
    else:
      data = cache.get(file, (chunk_rows, shape[1]), out.dtype)
    _copy_runs(data, rows[a:b] - chunk * chunk_rows, out, out_rows[a:b], columns)
  return True


def copy_strided_direct(
    path: epath.Path,
    shape: tuple[int, int],
    chunk_rows: int,
    runs,
    out: np.ndarray,
    columns: int,
    cache: "ChunkCache | None" = None,
) -> bool:
  """`gather_rows_direct` of rows given as strided runs, without per-row arrays.

  Each run (row, row_step, count, out_row, out_step) copies stored rows
  row + row_step m, columns [0, columns), to out[out_row + out_step m] for
  m < count. A run is cut at chunk boundaries into pieces, each one strided
  slice copy; the pieces are visited chunk by chunk, so a chunk is read once
  per call (or taken from `cache`), and a chunk that one piece takes whole,
  in order, to consecutive full-width rows is read straight into `out`. Same
  applicability as `gather_rows_direct`; returns False (nothing read)
  otherwise, or when the runs step over more chunks than rows they copy
  (rows further apart than a chunk: `gather_rows_direct` does better).
  """
  text = os.fspath(path)
  if "://" in text or out.dtype.byteorder == ">" or shape[0] % chunk_rows:
    return False
  runs = [run for run in runs if run[2] > 0]
  spans = [(row_step * (count - 1)) // chunk_rows + 2 for _, row_step, count, _, _ in runs]
  if sum(spans) > max(16, sum(run[2] for run in runs) // 4):
    return False
  pieces = []  # (chunk, first row in the chunk, row step, count, out row, out step)
  for row, row_step, count, out_row, out_step in runs:
    m = 0
    while m < count:
      first = row + row_step * m
      chunk = first // chunk_rows
      end = min(count, -(-((chunk + 1) * chunk_rows - row) // row_step))
      offset = first - chunk * chunk_rows
      pieces.append((chunk, offset, row_step, end - m, out_row + out_step * m, out_step))
      m = end
  pieces.sort(key=lambda piece: piece[0])
  whole_rows = columns == shape[1] == out.shape[1] and out.flags.c_contiguous
  scratch = None
  index = 0
  while index < len(pieces):
    chunk = pieces[index][0]
    end = index + 1
    while end < len(pieces) and pieces[end][0] == chunk:
      end += 1
    file = os.path.join(text, "c", str(chunk), "0")
    _, offset, row_step, count, out_row, out_step = pieces[index]
    whole_chunk = offset == 0 and count == chunk_rows and row_step == out_step == 1
    if end == index + 1 and whole_rows and whole_chunk:
      _read_chunk(file, out[out_row : out_row + chunk_rows].reshape(-1).view(np.uint8))
      index = end
      continue
    if cache is not None:
      data = cache.get(file, (chunk_rows, shape[1]), out.dtype)
    else:
      if scratch is None:
        scratch = np.empty((chunk_rows, shape[1]), out.dtype)
      _read_chunk(file, scratch.reshape(-1).view(np.uint8))
      data = scratch
    for _, offset, row_step, count, out_row, out_step in pieces[index:end]:
      out[out_row : out_row + out_step * (count - 1) + 1 : out_step, :columns] = data[
          offset : offset + row_step * (count - 1) + 1 : row_step, :columns
      ]
    index = end
  return True


def _whole_chunk_in_order(
    rows: np.ndarray, out_rows: np.ndarray, chunk: int, chunk_rows: int
) -> bool:
  """Whether `rows` are all rows of chunk `chunk` in order, going to consecutive `out_rows`."""
  return (
      rows.size == chunk_rows
      and int(rows[0]) == chunk * chunk_rows
      and bool(np.all(np.diff(rows) == 1))
      and bool(np.all(np.diff(out_rows) == 1))
  )


def _copy_runs(
    data: np.ndarray, rows: np.ndarray, out: np.ndarray, out_rows: np.ndarray, columns: int
) -> None:
  """out[out_rows[k], :columns] = data[rows[k], :columns] for sorted `rows`, by strided runs."""
  runs, scattered = strided_runs(rows, out_rows, max_runs=max(16, rows.size // 64))
  for a, b, step, out_step in runs:
    o0, o1 = int(out_rows[a]), int(out_rows[b - 1]) + 1
    r0, r1 = int(rows[a]), int(rows[b - 1]) + 1
    out[o0:o1:out_step, :columns] = data[r0:r1:step, :columns]
  if scattered.size:
    out[out_rows[scattered], :columns] = data[rows[scattered], :columns]


class ChunkCache:
  """Checked chunks of direct-readable arrays, kept up to `max_bytes` (least recently used out).

  A conversion visits the target in an order where consecutive blocks need
  the same source chunks (`checkpoint._convert`); with this cache each chunk
  file is read (and its CRC32C checked) once instead of once per block that
  needs it. Thread safe. Chunks are handed out read-only; the buffer of a
  chunk dropped from the cache is reused for the next chunk read (when no
  caller still holds it), so reads do not page in fresh memory each time.
  """

  def __init__(self, max_bytes: int):
    self.max_bytes = max_bytes
    self._chunks: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()
    self._bytes = 0
    self._spare: list[np.ndarray] = []  # Dropped buffers (uint8), for reuse.
    self._lock = threading.Lock()

  def resize(self, max_bytes: int) -> None:
    """Keeps at most `max_bytes` from now on (dropping the least recently used chunks)."""
    with self._lock:
      self.max_bytes = max_bytes
      self._evict()

  def get(self, file: str, shape: tuple[int, int], dtype: np.dtype) -> np.ndarray:
    """The chunk stored in `file` as a [rows, width] array, read and checked if not kept."""
    nbytes = shape[0] * shape[1] * np.dtype(dtype).itemsize
    with self._lock:
      data = self._chunks.get(file)
      if data is not None:
        self._chunks.move_to_end(file)
        return data
      index = next((i for i, b in enumerate(self._spare) if b.nbytes == nbytes), None)
      raw = None if index is None else self._spare.pop(index)
    if raw is None:
      raw = np.empty(nbytes, np.uint8)
    _read_chunk(file, raw)
    data = raw.view(dtype).reshape(shape)
    data.flags.writeable = False
    with self._lock:
      if file not in self._chunks:
        self._chunks[file] = data
        self._bytes += data.nbytes
      self._evict(keep=1)
    return data

  def _evict(self, keep: int = 0) -> None:
    """Drops the least recently used chunks down to max_bytes, keeping `keep` (lock held)."""
    while self._bytes > self.max_bytes and len(self._chunks) > keep:
      _, dropped = self._chunks.popitem(last=False)
      self._bytes -= dropped.nbytes
      # Reused only when nothing outside holds the chunk or a view of its
      # buffer: counted are the local names, `dropped.base` and getrefcount's argument.
      buffer = dropped.base
      if sys.getrefcount(dropped) <= 2 and sys.getrefcount(buffer) <= 3 and len(self._spare) < 4:
        self._spare.append(buffer)
      del buffer


def direct_writable(path: epath.Path, dtype) -> bool:
  """Whether `ChunkWriter` applies: a local path and a little-endian dtype."""
  return "://" not in os.fspath(path) and np.dtype(dtype).byteorder != ">"


class ChunkWriter:
  """Writes the chunk files of one array created with the default encoding, piece by piece.

  The inverse of `read_chunks_direct`, for a local array whose zarr.json
  TensorStore created with codecs [bytes (little endian), crc32c]: each chunk
  file is the chunk's raw bytes followed by their CRC32C (hardware,
  google-crc32c), as the zarr v3 crc32c codec stores it, written without
  TensorStore's encode copy. A chunk's rows may come in several pieces
  (`write`), each continuing where the chunk's previous piece ended: the file
  is created (new, never through an existing file or link) with the first
  piece, appended to with the next ones, and gets its CRC32C (extended piece
  by piece) with the last. The array's last chunk, when the array ends inside
  it (`total_rows`), is stored whole, its rows past the end being the fill
  value 0. Pieces of different chunks may be written from different threads,
  those of one chunk in order.
  """

  def __init__(self, path: epath.Path, chunk_rows: int, total_rows: int):
    self.path = os.fspath(path)
    self.chunk_rows = chunk_rows
    self.total_rows = total_rows
    self._partial: dict[int, tuple[int, int]] = {}  # chunk -> (rows written, CRC32C so far)
    self._lock = threading.Lock()

  def pieces(self, start: int, stop: int) -> list[tuple[int, int, int]]:
    """(chunk, start, stop) of rows [start, stop) cut at chunk boundaries."""
    out = []
    while start < stop:
      chunk = start // self.chunk_rows
      end = min(stop, (chunk + 1) * self.chunk_rows)
      out.append((chunk, start, end))
      start = end
    return out

  def write(self, start: int, data: np.ndarray) -> None:
    """Writes rows [start, start + len(data)), which lie in one chunk, after its earlier rows."""
    chunk, offset = divmod(start, self.chunk_rows)
    rows = data.shape[0]
    with self._lock:
      written, crc = self._partial.get(chunk, (0, 0))
    if offset != written or offset + rows > self.chunk_rows:
      raise ValueError(
          f"chunk {chunk} of {self.path}: a piece must continue the chunk's rows in order and"
          f" stay inside it; got rows [{offset}, {offset + rows}) of {self.chunk_rows} after"
          f" {written} written."
      )
    folder = os.path.join(self.path, "c", str(chunk))
    if written == 0:
      os.makedirs(folder, exist_ok=True)
      flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    else:
      flags = os.O_WRONLY | os.O_APPEND
    fd = os.open(os.path.join(folder, "0"), flags | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
      view = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
      _write_all(fd, view)
      crc = crc32c_of(view, crc)
      written += rows
      end = min(self.chunk_rows, self.total_rows - chunk * self.chunk_rows)
      if written >= end:  # Complete: fill past the array's end, then the checksum.
        if written < self.chunk_rows:
          row_bytes = data.shape[1] * data.dtype.itemsize
          fill = np.zeros((self.chunk_rows - written) * row_bytes, np.uint8)
          _write_all(fd, fill)
          crc = crc32c_of(fill, crc)
        _write_all(fd, np.frombuffer(crc.to_bytes(4, "little"), np.uint8))
    finally:
      os.close(fd)
    with self._lock:
      if written >= end:
        self._partial.pop(chunk, None)
      else:
        self._partial[chunk] = (written, crc)

  def unfinished(self) -> list[int]:
    """The chunks begun but not completed."""
    with self._lock:
      return sorted(self._partial)


# Bytes per write() call. Writing a 4 MiB chunk in one call measured 3-7x
# slower (in the kernel) than the same bytes in 1 MiB calls on Linux 6.x ext4,
# and slower than `cp` of the same files; 256 KiB - 1 MiB calls match `cp`.
_WRITE_BYTES = 1 << 20


def _write_all(fd: int, data: np.ndarray) -> None:
  done = 0
  while done < data.nbytes:
    done += os.write(fd, data[done : done + _WRITE_BYTES])


def _read_chunk(file: str, target: np.ndarray) -> None:
  def fail(what: str) -> None:
    raise CorruptCheckpointError(
        f"chunk file {file} {what}. The array is corrupt, truncated or missing; restore"
        " another step (or copy this one again from a good source)."
    )

  if os.path.islink(file) or any(os.path.islink(p) for p in _parents(file, levels=2)):
    fail("is (or is reached through) a symbolic link; nothing is read through one")
  try:
    with open(file, "rb", buffering=0) as f:
      got = f.readinto(target)
      trailer = f.read(5)
  except FileNotFoundError:
    fail("is missing")
  if got != len(target) or len(trailer) != 4:
    fail(f"has {got + len(trailer)} bytes, expected {len(target) + 4}")
  if crc32c_of(target) != int.from_bytes(trailer, "little"):
    fail("fails its CRC32C checksum (its bytes changed since they were written)")


def crc32c_of(data: np.ndarray, crc: int = 0) -> int:
  """CRC32C of a C-contiguous array's bytes (extending `crc`), without copying them.

  google-crc32c's C extension takes only buffers without a release hook
  (bytes, not numpy or memoryview), so the bytes are passed as a ctypes view
  of the same memory; the array stays referenced for the duration of the
  call. Its pure-Python fallback (where no wheel with the extension exists)
  reads its input as a sequence of ints, which a byte memoryview is.
  """
  data = np.ascontiguousarray(data)
  if google_crc32c.implementation != "c":
    return google_crc32c.extend(crc, memoryview(data.reshape(-1).view(np.uint8)))
  view = (ctypes.c_char * data.nbytes).from_address(data.ctypes.data)
  return google_crc32c.extend(crc, view)


def _parents(file: str, levels: int) -> list[str]:
  out, path = [], file
  for _ in range(levels):
    path = os.path.dirname(path)
    out.append(path)
  return out
