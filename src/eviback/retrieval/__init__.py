"""Retrieval: BM25 and dense indexes, the Search-R1-compatible `/retrieve` service and its client.

All of them implement :class:`eviback.retrieval.base.Retriever` (batched `search(queries, topk)` and
`close()`). Get one with :func:`load_retriever` (an index directory or a service URL),
:func:`suite_retriever` (a data suite's corpus, indexed once and cached), or :func:`open_retriever`, which
chooses between the two as every command's `retriever` setting does. Heavy libraries (bm25s, FAISS,
sentence-transformers, FastAPI, httpx) are imported only by the parts that use them.
"""

from eviback.retrieval.base import Retriever
from eviback.retrieval.config import BM25Config, ClientConfig, DenseConfig, IndexKind, ServerConfig
from eviback.retrieval.index import build_index, load_index, load_retriever, open_retriever, suite_retriever
from eviback.retrieval.manifest import IndexMismatchError, Manifest, read_manifest


def __getattr__(name: str):
    # The client needs httpx; import it only when asked for.
    if name in ("RetrievalClient", "RetrievalError", "RetrieverUnavailable"):
        from eviback.retrieval import client

        return getattr(client, name)
    raise AttributeError(f"module 'eviback.retrieval' has no attribute {name!r}")


__all__ = [
    "BM25Config",
    "ClientConfig",
    "DenseConfig",
    "IndexKind",
    "IndexMismatchError",
    "Manifest",
    "RetrievalClient",
    "RetrievalError",
    "RetrieverUnavailable",
    "Retriever",
    "ServerConfig",
    "build_index",
    "load_index",
    "load_retriever",
    "open_retriever",
    "read_manifest",
    "suite_retriever",
]
