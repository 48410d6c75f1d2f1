"""A FAISS flat index file read in place: its header parsed here, its vectors read by row, never loaded whole.

`faiss.write_index` writes an `IndexFlatIP` (Search-R1's `e5_Flat.index`) as, little-endian:

    offset  size  field
    0       4     fourcc: b"IxFI" (inner product; b"IxF2" is IndexFlatL2)
    4       4     d, int32
    8       8     ntotal, int64
    16      16    two int64 placeholders (1 << 20 each)
    32      1     is_trained, bool
    33      4     metric_type, int32 (0: inner product, 1: L2)
    37      8     size of the vector block in 4-byte words, uint64 (= ntotal * d)
    45      ...   ntotal * d float32, row after row

so row i starts at byte `45 + 4 * d * i`. This layout is checked against faiss itself by the tests
(`faiss.write_index` of a small index, parsed here). Reading 21M x 768 floats (64.6 GB) into RAM is what
this module avoids: rows are read by `pread` (a few scattered rows, for re-ranking) or in sequential
chunks (for building a compressed index); the pages go through the OS page cache, never into this
process's memory for good.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FOURCC_FLAT_IP = b"IxFI"
FOURCC_FLAT_L2 = b"IxF2"
_HEADER = struct.Struct("<4siqqq?iQ")  # fourcc, d, ntotal, 2 placeholders, is_trained, metric, block size
HEADER_BYTES = _HEADER.size  # 45
METRIC_INNER_PRODUCT = 0
FINGERPRINT_BYTES = 1 << 20


class FlatFileError(ValueError):
    """The file is not a FAISS flat inner-product index this module can read; the message says why."""


@dataclass(frozen=True)
class FlatFile:
    """The layout of a FAISS `IndexFlatIP` file: `count` rows of `dim` float32 from byte `offset`."""

    path: Path
    dim: int
    count: int
    offset: int = HEADER_BYTES

    @property
    def row_bytes(self) -> int:
        return 4 * self.dim

    def vectors(self) -> np.ndarray:
        """All rows as a read-only memory map of shape (count, dim): nothing is read until indexed."""
        return np.memmap(self.path, dtype="<f4", mode="r", offset=self.offset, shape=(self.count, self.dim))

    def fingerprint(self) -> str:
        """sha256 of the header, the file size, and the first and last MiB of vectors: what tells a replaced
        or rewritten file from the one an index was imported from, without reading 64 GB."""
        digest = hashlib.sha256()
        size = os.path.getsize(self.path)
        digest.update(str(size).encode())
        with open(self.path, "rb") as f:
            digest.update(f.read(self.offset + FINGERPRINT_BYTES))
            f.seek(max(self.offset, size - FINGERPRINT_BYTES))
            digest.update(f.read(FINGERPRINT_BYTES))
        return digest.hexdigest()

    def iter_chunks(self, rows: int) -> Iterator[tuple[int, np.ndarray]]:
        """`(first_row, vectors)` chunks of at most `rows` rows, in order, read sequentially with plain reads
        into one reused buffer (so this process holds one chunk, not the pages of a map)."""
        buffer = np.empty((min(rows, self.count), self.dim), dtype="<f4")
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.offset)
            for start in range(0, self.count, rows):
                n = min(rows, self.count - start)
                view = memoryview(buffer[:n]).cast("B")
                got = 0
                while got < len(view):
                    read = f.readinto(view[got:])
                    if not read:
                        raise FlatFileError(f"{self.path} ends inside row {start + got // self.row_bytes}: "
                                            "the file is truncated")
                    got += read
                yield start, buffer[:n]


class RowReader:
    """Reads scattered rows of a flat file with `pread` (thread-safe: no shared file position).

    Not a memory map on purpose: every page a map touches stays counted in the process's resident memory
    until the kernel reclaims it, so a long-running service re-ranking from a 64 GB map would show tens of
    GB of RSS; `pread` copies the few rows asked for and the rest stays in the page cache.

    Rows that are not in the page cache cost a disk read each (about 0.1 ms on an SSD), so a large request
    is split over `threads` threads (`pread` releases the GIL): an SSD serves many reads at once in about
    the time of one."""

    PARALLEL_FROM = 256  # rows; below this, threads cost more than they save on cached rows

    def __init__(self, flat: FlatFile, threads: int = 16) -> None:
        self.flat = flat
        self._fd = os.open(flat.path, os.O_RDONLY)
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def read(self, rows: np.ndarray) -> np.ndarray:
        """The vectors of `rows` (int array, any order, repeats allowed), shape (len(rows), dim), float32."""
        out = np.empty((len(rows), self.flat.dim), dtype="<f4")
        wanted = rows.tolist()
        if len(wanted) < self.PARALLEL_FROM or self._threads <= 1:
            self._read_into(out, wanted, 0, len(wanted))
            return out
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="flat-rows")
        step = -(-len(wanted) // self._threads)
        futures = [self._pool.submit(self._read_into, out, wanted, start, min(start + step, len(wanted)))
                   for start in range(0, len(wanted), step)]
        for future in futures:
            future.result()
        return out

    def _read_into(self, out: np.ndarray, rows: list[int], start: int, end: int) -> None:
        size, base = self.flat.row_bytes, self.flat.offset
        for i in range(start, end):
            data = os.pread(self._fd, size, base + rows[i] * size)
            if len(data) != size:
                raise FlatFileError(f"{self.flat.path}: row {rows[i]} is past the end of the file (truncated?)")
            out[i] = np.frombuffer(data, dtype="<f4")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_flat_header(path: str | os.PathLike) -> FlatFile:
    """Parse the header of a FAISS `IndexFlatIP` file and check it against the file's size."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"FAISS index {path} not found")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if len(head) < 4 or head[:4] not in (FOURCC_FLAT_IP, FOURCC_FLAT_L2):
        raise FlatFileError(f"{path} is not a FAISS flat index (it starts with {head[:4]!r}, an IndexFlatIP "
                            f"written by faiss.write_index starts with {FOURCC_FLAT_IP!r}); convert other index "
                            "types to IndexFlatIP first")
    if head[:4] == FOURCC_FLAT_L2:
        raise FlatFileError(f"{path} is a FAISS IndexFlatL2 (L2 distance); eviback imports inner-product flat "
                            "indexes (IndexFlatIP, as Search-R1's e5_Flat.index)")
    if len(head) < HEADER_BYTES:
        raise FlatFileError(f"{path} is {size} bytes, shorter than a FAISS flat index header")
    _, dim, count, _, _, _, metric, words = _HEADER.unpack(head)
    if metric != METRIC_INNER_PRODUCT:
        raise FlatFileError(f"{path}: metric type {metric}, expected {METRIC_INNER_PRODUCT} (inner product)")
    if dim < 1 or count < 0 or words != dim * count:
        raise FlatFileError(f"{path}: inconsistent header (d={dim}, ntotal={count}, vector block of {words} "
                            "floats): the file is damaged or not a flat index")
    expected = HEADER_BYTES + 4 * words
    if size != expected:
        raise FlatFileError(f"{path} is {size} bytes, but its header (d={dim}, ntotal={count}) says {expected}: "
                            "the file is truncated or damaged (re-download it)")
    return FlatFile(path=path.resolve(), dim=dim, count=count)
