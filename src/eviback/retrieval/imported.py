"""An existing FAISS flat index (Search-R1's wiki-18 `e5_Flat.index`) imported and served within bounded RAM.

    eviback index import-faiss e5_Flat.index wiki-18.jsonl.gz --out indexes/wiki18-e5 --model models/e5-base-v2
    eviback serve indexes/wiki18-e5

The import never loads the flat index: its header is parsed by :mod:`eviback.retrieval.flatfile` and its
vectors are read in sequential chunks. It writes, into the index directory:

- the passage store (`passages.jsonl` + `passages.offsets.npy`, read by offset from a memory map), checked
  row for row against the flat index's count;
- with `--compression ivfpq` (the default) `ivf.faiss`, an IVF-PQ index trained on a sample of the vectors
  and filled chunk by chunk: `pq_m` bytes per passage plus an 8-byte id, the only part held in RAM;
  `sq8` keeps `d` bytes per passage; `flat` writes no index and serves the original file loaded whole
  (Search-R1's exact mode, for machines with the RAM).

At search time the IVF-PQ index proposes `rerank` candidates per query and each is re-scored exactly
against its original vector, read by row from the flat file (see `flatfile.RowReader`), so the scores are
the flat index's inner products and the top-k is exact whenever the true top-k are among the candidates.
The manifest records the flat file's path and fingerprint; a moved or replaced file is refused at load.

FAISS (the `dense` extra) is imported where an index is built or opened: this module is read to dispatch on
an index's kind whether or not it is installed.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import math
import os
import shutil
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from eviback import __version__
from eviback.cache import cache_dir, file_lock
from eviback.data import file_sha256
from eviback.retrieval.base import live_queries
from eviback.retrieval.config import FaissImportConfig, IndexKind
from eviback.retrieval.encoder import E5QueryEncoder, QueryEncoder, model_dimension
from eviback.retrieval.flatfile import FlatFile, RowReader, read_flat_header
from eviback.retrieval.manifest import MANIFEST_FILE, IndexMismatchError, Manifest, read_manifest
from eviback.retrieval.manifest import write_json as _write_json
from eviback.retrieval.store import PassageStore, write_store
from eviback.types import Passage, to_dict

log = logging.getLogger(__name__)

IVF_FILE = "ivf.faiss"
SEARCH_PARAMS = ("nprobe", "rerank")  # changed in place by a re-import: no rebuild needed
MAX_TRAIN = 1_000_000


def auto_nlist(passages: int) -> int:
    """The power of two nearest 2*sqrt(passages), at most passages/39 (k-means wants 39 points a list)."""
    nlist = 2 ** round(math.log2(max(2 * math.sqrt(passages), 1)))
    while nlist > 1 and nlist > passages // 39:
        nlist //= 2
    return nlist


def train_size(config: FaissImportConfig, passages: int, nlist: int) -> int:
    size = config.train_size or min(max(65_536, 40 * nlist), MAX_TRAIN)
    return min(size, passages)


def import_faiss(
    flat_index: str | os.PathLike,
    corpus: str | os.PathLike,
    out: str | os.PathLike,
    config: FaissImportConfig | None = None,
    *,
    force: bool = False,
    progress: bool = True,
    lock: str | os.PathLike | None = None,
) -> Manifest:
    """Import the FAISS flat index `flat_index` and its corpus (row i = passage i) into the index directory
    `out` and return its manifest.

    Refused before any work: a flat file that is not an inner-product IndexFlat, an encoder whose width is
    not the index's, a `pq_m` that does not divide it. Refused after reading the corpus: a passage count
    other than the index's vector count. The same import into an up-to-date `out` does nothing (a changed
    `nprobe` or `rerank` is written into its manifest); `out` holding something else is refused unless
    `force`."""
    config = config or FaissImportConfig()
    flat = read_flat_header(flat_index)
    corpus = Path(corpus)
    if not corpus.is_file():
        raise FileNotFoundError(f"corpus {corpus} not found")
    corpus = corpus.resolve()
    out = Path(out)
    if not config.model:
        raise ValueError("give the query encoder the index was built with: --model PATH, a local model "
                         "directory (for Search-R1's e5_Flat.index, a download of intfloat/e5-base-v2)")
    model = str(Path(config.model).resolve())
    width = model_dimension(model)
    if width != flat.dim:
        raise IndexMismatchError(f"the query encoder {model} makes {width}-dimensional vectors but the FAISS "
                                 f"index {flat.path} holds {flat.dim}-dimensional ones: give the model the index "
                                 "was built with")
    if config.compression == "ivfpq" and flat.dim % config.pq_m:
        raise ValueError(f"--pq-m {config.pq_m} does not divide the dimension {flat.dim} of {flat.path}: choose a "
                         f"divisor (e.g. {', '.join(str(m) for m in (48, 64, 96, 128, 192) if flat.dim % m == 0)})")
    nlist = config.nlist or auto_nlist(flat.count)
    if config.compression != "flat" and nlist * 39 > flat.count:
        raise ValueError(f"--nlist {nlist} is too many lists for {flat.count} vectors (k-means needs 39 per list): "
                         f"use at most {max(1, flat.count // 39)}, or 0 for the default")
    config = replace(config, model=model, nlist=nlist if config.compression != "flat" else 0)
    params = {**config.index_params(), "dim": flat.dim, "source": str(flat.path),
              "source_fingerprint": flat.fingerprint(), "nprobe": config.nprobe, "rerank": config.rerank}
    if lock is None:
        lock = cache_dir() / "locks" / f"index-{hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:16]}.lock"
    with file_lock(Path(lock)):
        sha = file_sha256(corpus)
        if out.exists() and not (out / MANIFEST_FILE).exists() and (not out.is_dir() or any(out.iterdir())):
            raise FileExistsError(f"{out} exists and is not an index directory: choose another --out")
        if (out / MANIFEST_FILE).exists() and not force:
            existing = read_manifest(out)
            fixed = {k: v for k, v in params.items() if k not in SEARCH_PARAMS}
            if (existing.kind, existing.corpus_sha256) == (IndexKind.FAISS_IMPORT, sha) and fixed == {
                    k: v for k, v in existing.params.items() if k not in SEARCH_PARAMS}:
                if dict(existing.params) != params:
                    existing = replace(existing, params=params)
                    _write_json(out / MANIFEST_FILE, to_dict(existing))
                log.info("index %s is up to date (%d passages)", out, existing.passages)
                return existing
            raise IndexMismatchError(f"{out} already holds an index of another corpus, flat file or parameters: "
                                     "rerun with --force to replace it, or choose another --out")
        work = out.with_name(out.name + ".partial")
        if work.exists():
            shutil.rmtree(work)  # an import is not resumable: its steps are streamed, not saved
        work.mkdir(parents=True)
        started = time.perf_counter()
        count = sum(1 for _ in write_store(corpus, work, progress=progress))
        if count != flat.count:
            shutil.rmtree(work)
            raise IndexMismatchError(
                f"the corpus {corpus} has {count} passages but the FAISS index {flat.path} holds {flat.count} "
                "vectors: row i of the index must be passage i of the corpus; give the corpus the index was "
                "built from")
        if config.compression != "flat":
            index = _build_compressed(flat, config, progress=progress)
            import faiss

            faiss.write_index(index, str(work / IVF_FILE))
            del index
        manifest = Manifest(
            kind=IndexKind.FAISS_IMPORT,
            corpus_path=str(corpus),
            corpus_sha256=sha,
            passages=count,
            params=params,
            model=model,
            built_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            build_seconds=round(time.perf_counter() - started, 3),
            eviback_version=__version__,
        )
        _write_json(work / MANIFEST_FILE, to_dict(manifest))
        if out.exists():
            shutil.rmtree(out)
        os.replace(work, out)
        log.info("imported %s (%d x %d) into %s as %s in %.1f s", flat.path, flat.count, flat.dim, out,
                 config.compression, manifest.build_seconds)
        return manifest


def _build_compressed(flat: FlatFile, config: FaissImportConfig, *, progress: bool) -> Any:
    """Train IVF-PQ / IVF-SQ8 on a random sample of the flat file's rows, then add every row, chunk by chunk."""
    import faiss

    # "np": no polysemous training (a slow reordering of the PQ centroids for Hamming filtering, unused here).
    codes = f"PQ{config.pq_m}np" if config.compression == "ivfpq" else "SQ8"
    index = faiss.index_factory(flat.dim, f"IVF{config.nlist},{codes}", faiss.METRIC_INNER_PRODUCT)
    size = train_size(config, flat.count, config.nlist)
    rows = np.sort(np.random.default_rng(config.seed).choice(flat.count, size=size, replace=False))
    reader = RowReader(flat)
    try:
        sample = np.empty((size, flat.dim), dtype=np.float32)
        with tqdm(total=size, desc="read training sample", unit=" vectors", disable=not progress,
                  mininterval=1.0) as bar:
            for start in range(0, size, 8192):
                sample[start:start + 8192] = reader.read(rows[start:start + 8192])
                bar.update(min(8192, size - start))
    finally:
        reader.close()
    log.info("training IVF%d,%s on %d vectors (k-means, one step without a progress bar)", config.nlist, codes, size)
    started = time.perf_counter()
    index.train(sample)
    log.info("trained in %.1f s", time.perf_counter() - started)
    del sample
    with tqdm(total=flat.count, desc="add vectors", unit=" vectors", disable=not progress, mininterval=1.0) as bar:
        for _, chunk in flat.iter_chunks(config.chunk_size):
            index.add(chunk)
            bar.update(len(chunk))
    return index


class ImportedIndex:
    """The retriever of an imported index directory (see :class:`eviback.retrieval.Retriever`).

    RAM: the compressed index (`ivf.faiss`) and the encoder; passages and re-ranking vectors are read by
    offset. `encoder` replaces the manifest's query encoder (tests use a scripted one); `nprobe` and
    `rerank` override the manifest's search settings. Thread-safe (one search at a time)."""

    def __init__(self, directory: str | os.PathLike, params: Mapping[str, Any], *,
                 encoder: QueryEncoder | None = None, nprobe: int | None = None, rerank: int | None = None) -> None:
        import faiss

        self.directory = Path(directory)
        self.params = dict(params)
        self.compression = self.params["compression"]
        self.nprobe = int(nprobe if nprobe is not None else self.params["nprobe"])
        self.rerank = int(rerank if rerank is not None else self.params["rerank"])
        dim = int(self.params["dim"])
        self._reader: RowReader | None = None
        needs_source = self.compression == "flat" or self.rerank > 0
        flat = _check_source(self.directory, self.params) if needs_source else None
        self._store = PassageStore(self.directory)
        try:
            if self.compression == "flat":
                assert flat is not None
                log.info("loading the flat index %s whole (%.1f GB)", flat.path, flat.count * flat.row_bytes / 1e9)
                self._index = faiss.read_index(str(flat.path))
            else:
                self._index = faiss.read_index(str(self.directory / IVF_FILE))
                faiss.extract_index_ivf(self._index).nprobe = self.nprobe
                if flat is not None:
                    self._reader = RowReader(flat)
            self._encoder = encoder if encoder is not None else E5QueryEncoder(
                self.params["model"], prefix=self.params["query_prefix"], pooling=self.params["pooling"],
                max_length=self.params["max_length"], normalize=self.params["normalize"])
        except BaseException:
            self.close()
            raise
        if self._encoder.dim != dim:
            self.close()
            raise IndexMismatchError(f"the query encoder {self.params['model']} makes {self._encoder.dim}-dimensional "
                                     f"vectors but the index {self.directory} holds {dim}-dimensional ones")
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return int(self._index.ntotal)

    def search_vectors(self, vectors: np.ndarray, topk: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-`topk` `(scores, rows)` for query vectors of shape (q, dim), each (q, topk); row -1 and
        score -inf pad a query with fewer results. With re-ranking, scores are exact inner products."""
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        k = min(topk, len(self))
        if self._reader is None:
            scores, rows = self._index.search(vectors, k)
            return scores, rows
        candidates = min(max(self.rerank, k), len(self))
        _, rows = self._index.search(vectors, candidates)
        valid = rows >= 0
        unique, inverse = np.unique(np.where(valid, rows, 0), return_inverse=True)
        exact = self._reader.read(unique)[inverse.reshape(rows.shape)]  # (q, candidates, dim)
        scores = np.einsum("qcd,qd->qc", exact, vectors)
        scores[~valid] = -np.inf
        order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        rows = np.take_along_axis(np.where(valid, rows, -1), order, axis=1)
        return np.take_along_axis(scores, order, axis=1), rows

    def search(self, queries: Sequence[str], topk: int = 3) -> list[list[Passage]]:
        """Top-`topk` passages per query, best first, `score` (inner product) set; `[]` for an empty query."""
        results, live = live_queries(queries, topk)
        if not live:
            return results
        with self._lock:
            vectors = self._encoder.encode([queries[i] for i in live])
            scores, rows = self.search_vectors(vectors, topk)
        for j, i in enumerate(live):
            results[i] = [self._store.get(row, score) for row, score in
                          zip(rows[j].tolist(), scores[j].tolist(), strict=True) if row >= 0]
        return results

    def warm_up(self) -> None:
        self.search(["warm up"], topk=1)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
        store = getattr(self, "_store", None)
        if store is not None:
            store.close()
            self._store = None


def _check_source(directory: Path, params: Mapping[str, Any]) -> FlatFile:
    """The flat file an index re-ranks from (or loads whole), refused if it moved or changed since the import."""
    source = Path(params["source"])
    again = (f"re-import it with `eviback index import-faiss {source} CORPUS --out {directory} --force`")
    if not source.is_file():
        raise FileNotFoundError(f"index {directory} reads vectors from the FAISS index {source}, which is not "
                                f"there: put it back, or {again} from where it is now (or serve without "
                                "re-ranking: --rerank 0 at import)")
    flat = read_flat_header(source)
    if flat.fingerprint() != params["source_fingerprint"]:
        raise IndexMismatchError(f"the FAISS index {source} changed since index {directory} was imported from it "
                                 f"(another file of the same name?): {again}")
    if flat.dim != params["dim"]:
        raise IndexMismatchError(f"{source} now holds {flat.dim}-dimensional vectors, the index {directory} "
                                 f"{params['dim']}-dimensional ones: {again}")
    return flat


def describe(manifest: Manifest) -> str:
    """One line on what an imported index holds and costs (printed by the command line)."""
    p = manifest.params
    if p["compression"] == "flat":
        ram = manifest.passages * p["dim"] * 4
        how = "flat (the original file loaded whole)"
    else:
        per = p["pq_m"] if p["compression"] == "ivfpq" else p["dim"]
        ram = manifest.passages * (per + 8)
        how = f"IVF{p['nlist']},{'PQ' + str(p['pq_m']) if p['compression'] == 'ivfpq' else 'SQ8'}, nprobe {p['nprobe']}, " + (
            f"re-ranking {p['rerank']} candidates from {p['source']}" if p["rerank"] else "no re-ranking")
    return f"{manifest.passages} passages x {p['dim']}: {how}; index in RAM about {ram / 1e9:.2f} GB"

