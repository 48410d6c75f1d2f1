"""The passages of an index, stored inside the index directory and read on demand.

`passages.jsonl` holds one `{"id", "contents"}` line per passage in index order (row i of the BM25 matrix
or the FAISS index is line i); `passages.offsets.npy` holds the byte offset of every line. Reading maps the
file into memory, so a 1M-passage index costs no Python objects until passages are returned, and several
threads can read at once.

The index keeps its own copy because corpora come compressed (`.gz`) or on another machine: an index
directory is self-contained and can be copied and served anywhere.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from eviback.data import DataError, iter_corpus
from eviback.types import Passage

PASSAGES_FILE = "passages.jsonl"
OFFSETS_FILE = "passages.offsets.npy"


def write_store(corpus: str | os.PathLike, directory: Path, *, progress: bool = False) -> Iterator[Passage]:
    """Copy `corpus` into `directory` as a passage store while yielding its passages (streaming).

    Raises DataError on a malformed line or a duplicate id (both name the corpus file and line), and on
    an empty corpus. The files appear only when the whole corpus was read (written under temporary names
    and renamed), so an interrupted build never leaves a store that looks complete."""
    from tqdm import tqdm

    directory.mkdir(parents=True, exist_ok=True)
    tmp_passages = directory / (PASSAGES_FILE + ".tmp")
    offsets = [0]
    first_line: dict[str, int] = {}
    with open(tmp_passages, "wb") as out, tqdm(desc="read corpus", unit=" passages", disable=not progress,
                                               mininterval=1.0) as bar:
        for number, passage in enumerate(iter_corpus(corpus), start=1):
            if passage.id in first_line:
                # Ids must be unique: gold passage ids (recall, the teacher's Stage B) refer to them.
                raise DataError(corpus, None, f"duplicate passage id {passage.id!r} (passage {number}, first "
                                              f"seen as passage {first_line[passage.id]})")
            first_line[passage.id] = number
            line = json.dumps({"id": passage.id, "contents": passage.contents}, ensure_ascii=False) + "\n"
            offsets.append(offsets[-1] + out.write(line.encode("utf-8")))
            bar.update(1)
            yield passage
    if len(offsets) == 1:
        tmp_passages.unlink()
        raise DataError(corpus, None, "the corpus has no passages")
    tmp_offsets = directory / (OFFSETS_FILE + ".tmp.npy")
    np.save(tmp_offsets, np.asarray(offsets, dtype=np.int64))
    os.replace(tmp_passages, directory / PASSAGES_FILE)
    os.replace(tmp_offsets, directory / OFFSETS_FILE)


def store_exists(directory: Path) -> bool:
    return (directory / PASSAGES_FILE).exists() and (directory / OFFSETS_FILE).exists()


class PassageStore:
    """Read-only, thread-safe access to the passages of an index by row number."""

    def __init__(self, directory: str | os.PathLike) -> None:
        directory = Path(directory)
        self._offsets = np.load(directory / OFFSETS_FILE, mmap_mode="r")
        self._file = open(directory / PASSAGES_FILE, "rb")  # noqa: SIM115 - kept open for the mapping
        size = os.fstat(self._file.fileno()).st_size
        if size != int(self._offsets[-1]):
            self._file.close()
            raise ValueError(f"{directory}: {PASSAGES_FILE} does not match {OFFSETS_FILE} (the index is damaged): "
                             "rebuild it with `eviback index ... --force`")
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def get(self, row: int, score: float | None = None) -> Passage:
        start, end = int(self._offsets[row]), int(self._offsets[row + 1])
        obj = json.loads(self._map[start:end])
        return Passage(id=obj["id"], contents=obj["contents"], score=score)

    def __iter__(self) -> Iterator[Passage]:
        for row in range(len(self)):
            yield self.get(row)

    def texts(self, rows: Iterable[int]) -> list[str]:
        return [self.get(row).contents for row in rows]

    def close(self) -> None:
        self._map.close()
        self._file.close()
