"""BM25 retrieval with bm25s: building an index from a corpus, and batched top-k search.

Build one with `eviback index CORPUS --out DIR` (or :func:`eviback.retrieval.build_index`); load it with
:func:`eviback.retrieval.load_retriever`. Passages and queries are lower-cased, split on words and stripped of
English stopwords; scoring is Lucene's BM25 with Pyserini's defaults (k1=0.9, b=0.4), the retriever
Search-R1 uses. Passages whose score is 0 (no query word in common) are not returned, as in Lucene.

bm25s is imported where an index is built, loaded or searched: it takes about a second to import, which a
process that never touches a BM25 index should not pay.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from eviback.retrieval.base import live_queries
from eviback.retrieval.config import BM25Config
from eviback.retrieval.store import PassageStore, write_store
from eviback.types import Passage

log = logging.getLogger(__name__)

MODEL_DIR = "bm25"  # bm25s's own files, inside the index directory
_TOKENIZE_CHUNK = 10_000  # passages tokenised at a time while the corpus streams in


def _tokenizer(config: BM25Config):
    from bm25s.tokenization import Tokenizer

    return Tokenizer(lower=True, stopwords=config.stopwords or None)


def _cache_compiled_search() -> None:
    """Cache the numba-compiled search loop on disk: compiling it costs ~5-9 s in every new process
    (each server start, each CLI run); loaded from numba's cache it costs ~0.4 s.

    bm25s (pinned to 0.3.16) compiles it without caching; `enable_caching` is numba's public dispatcher
    method. If a later bm25s renames the function, search still works, only slower to start."""
    try:
        from bm25s.numba import retrieve_utils
    except ImportError:  # numba missing: bm25s falls back to numpy and there is nothing to cache
        return
    dispatcher = getattr(retrieve_utils, "_retrieve_internal_jitted_serial", None)
    if dispatcher is not None and hasattr(dispatcher, "enable_caching"):
        dispatcher.enable_caching()


def build(corpus: str | Path, directory: Path, config: BM25Config, *, progress: bool = True) -> int:
    """Write the passage store and the BM25 index of `corpus` into `directory`; return the passage count.

    The corpus is read streaming and tokenised in chunks, so memory holds token ids, not texts."""
    import bm25s
    from bm25s.tokenization import Tokenized

    tokenizer = _tokenizer(config)
    token_ids: list[list[int]] = []
    pending: list[str] = []
    for passage in write_store(corpus, directory, progress=progress):
        pending.append(passage.contents)  # title line included, as Search-R1's Pyserini index does
        if len(pending) >= _TOKENIZE_CHUNK:
            token_ids.extend(tokenizer.tokenize(pending, update_vocab=True, show_progress=False))
            pending = []
    if pending:
        token_ids.extend(tokenizer.tokenize(pending, update_vocab=True, show_progress=False))
    model = bm25s.BM25(k1=config.k1, b=config.b, method=config.method, backend="numba")
    model.index(Tokenized(ids=token_ids, vocab=tokenizer.get_vocab_dict()), show_progress=progress)
    model.save(str(directory / MODEL_DIR), show_progress=False)
    return len(token_ids)


class BM25Index:
    """An in-process BM25 retriever over an index directory (see :class:`eviback.retrieval.Retriever`).

    Thread-safe: query tokenisation only reads the vocabulary, and bm25s's single-threaded numba search
    holds no shared state and releases the GIL."""

    def __init__(self, directory: str | Path, config: BM25Config, *, mmap: bool = False) -> None:
        import bm25s

        _cache_compiled_search()
        self.directory = Path(directory)
        self.config = config
        self._store = PassageStore(self.directory)
        # mmap keeps the score matrix on disk (for indexes larger than memory), at some speed cost.
        self._model = bm25s.BM25.load(str(self.directory / MODEL_DIR), mmap=mmap, load_vocab=True)
        self._model.backend = "numba"
        self._tokenizer = _tokenizer(config)
        # The index's vocabulary is the tokenizer's (bm25s keeps the ids it was given), so queries are
        # mapped to the same ids; unknown words are dropped.
        self._tokenizer.word_to_id = self._model.vocab_dict
        self._size = len(self._store)

    def __len__(self) -> int:
        return self._size

    def search(self, queries: Sequence[str], topk: int = 3) -> list[list[Passage]]:
        """Top-`topk` passages per query, best first, `score` set; `[]` for an empty query."""
        results, live = live_queries(queries, topk)
        if not live:
            return results
        # update_vocab=False: a query never adds words, so concurrent searches share the vocabulary safely.
        ids = self._tokenizer.tokenize([queries[i] for i in live], update_vocab=False, show_progress=False)
        docs, scores = self._model.retrieve(ids, k=min(topk, self._size), n_threads=1, show_progress=False,
                                            return_as="tuple")
        for row, i in enumerate(live):
            results[i] = [self._store.get(int(doc), float(score))
                          for doc, score in zip(docs[row].tolist(), scores[row].tolist(), strict=True)
                          if score > 0]
        return results

    def warm_up(self) -> None:
        """Compile (or load from numba's cache) the search loop now rather than on the first request."""
        self.search(["warm up"], topk=1)

    def close(self) -> None:
        self._store.close()
