"""Retrieval: BM25 and dense indexes, the Search-R1-compatible `/retrieve` service and its client.

All of them implement :class:`eviback.retrieval.base.Retriever`."""

from eviback.retrieval.base import Retriever

__all__ = ["Retriever"]
