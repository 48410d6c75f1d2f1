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
