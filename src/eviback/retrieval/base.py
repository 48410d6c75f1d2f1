"""The retriever contract shared by the in-process indexes and the HTTP client."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from eviback.types import Passage


@runtime_checkable
class Retriever(Protocol):
    """Batched top-k retrieval.

    Contract: `search(queries, topk)` returns one list per query, in the order of `queries`, each with at
    most `topk` passages sorted by decreasing score (`Passage.score` set). An empty query gets an empty
    list. Implementations are safe to call from several threads."""

    def search(self, queries: Sequence[str], topk: int = 3) -> list[list[Passage]]: ...

    def close(self) -> None: ...


def live_queries(queries: Sequence[str], topk: int) -> tuple[list[list[Passage]], list[int]]:
    """The start of every retriever's `search`: one empty result per query, and the positions of the
    queries to search (an empty or blank query gets `[]`). A `topk` below 1 is refused."""
    if topk < 1:
        raise ValueError(f"topk must be at least 1, got {topk}")
    return [[] for _ in queries], [i for i, query in enumerate(queries) if query.strip()]
