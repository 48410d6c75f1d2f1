"""The client of a `/retrieve` service (`eviback serve`, or Search-R1's own retrieval server).

    from eviback.retrieval import load_retriever
    retriever = load_retriever("http://127.0.0.1:8000")      # a RetrievalClient
    retriever.search(["who wrote hamlet"], topk=3)           # [[Passage(id, contents, score), ...]]

Same interface as the in-process indexes, so the rollout engine takes either. It keeps a pool of
connections (safe to share between threads), puts a timeout on every request, and retries connection
errors, timeouts, 429 and 5xx answers with exponential backoff (with jitter, so many trainers do not
reconnect in lockstep) a bounded number of times; then it raises :class:`RetrievalError` saying what
failed. A 4xx answer is not retried: the same request would be refused again.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from typing import Any

import httpx

from eviback.retrieval.config import ClientConfig
from eviback.types import Passage

log = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class RetrievalError(RuntimeError):
    """The retrieval service could not answer (after the retries), or refused the request."""


class RetrievalClient:
    """A :class:`eviback.retrieval.Retriever` backed by a remote `/retrieve` service."""

    def __init__(self, url: str, config: ClientConfig | None = None, *,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.config = config or ClientConfig()
        base = url.rstrip("/")
        if base.endswith("/retrieve"):
            base = base[: -len("/retrieve")]
        self.url = base
        limits = httpx.Limits(max_connections=self.config.max_connections,
                              max_keepalive_connections=self.config.max_connections)
        timeout = httpx.Timeout(self.config.timeout_s, connect=self.config.connect_timeout_s)
        self._http = httpx.Client(base_url=base, timeout=timeout, limits=limits, transport=transport)

    def search(self, queries: Sequence[str], topk: int = 3) -> list[list[Passage]]:
        """Top-`topk` passages per query, best first, `score` set; `[]` for an empty query (not sent)."""
        if topk < 1:
            raise ValueError(f"topk must be at least 1, got {topk}")
        results: list[list[Passage]] = [[] for _ in queries]
        live = [i for i, query in enumerate(queries) if query.strip()]
        step = self.config.batch_queries
        for start in range(0, len(live), step):
            rows = live[start:start + step]
            for i, passages in zip(rows, self._retrieve([queries[i] for i in rows], topk), strict=True):
                results[i] = passages
        return results

    def health(self) -> dict[str, Any]:
        """The service's `/health` answer (one attempt, no retries: for readiness checks)."""
        response = self._http.get("/health")
        response.raise_for_status()
        return response.json()

    def _retrieve(self, queries: list[str], topk: int) -> list[list[Passage]]:
        payload = {"queries": queries, "topk": topk, "return_scores": True}
        attempts = self.config.retries + 1
        started = time.monotonic()
        last_error = ""
        for attempt in range(attempts):
            if attempt:
                delay = min(self.config.max_backoff_s, self.config.backoff_s * 2 ** (attempt - 1))
                time.sleep(delay * random.uniform(0.5, 1.0))
            try:
                response = self._http.post("/retrieve", json=payload)
            except httpx.TransportError as e:  # connection refused/reset, timeouts, protocol errors
                last_error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                log.warning("retrieval attempt %d/%d to %s failed: %s", attempt + 1, attempts, self.url, last_error)
                continue
            if response.status_code in RETRYABLE_STATUS:
                last_error = f"HTTP {response.status_code}: {_reason(response)}"
                log.warning("retrieval attempt %d/%d to %s failed: %s", attempt + 1, attempts, self.url, last_error)
                continue
            if response.status_code >= 400:
                raise RetrievalError(f"{self.url}/retrieve refused the request (HTTP {response.status_code}): "
                                     f"{_reason(response)}")
            return self._parse(response, len(queries))
        raise RetrievalError(
            f"retrieval service {self.url} failed {attempts} times in {time.monotonic() - started:.1f} s "
            f"(last error: {last_error}): check that `eviback serve` is running there, or raise "
            "ClientConfig.retries / timeout_s")

    def _parse(self, response: httpx.Response, expected: int) -> list[list[Passage]]:
        try:
            lists = response.json()["result"]
            if not isinstance(lists, list) or len(lists) != expected:
                raise ValueError(f"{expected} result lists expected")
            return [[_passage(item) for item in items] for items in lists]
        except (ValueError, KeyError, TypeError) as e:
            raise RetrievalError(f"{self.url}/retrieve answered something that is not a /retrieve response "
                                 f"({type(e).__name__}: {e}): {response.text[:200]!r}") from None

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RetrievalClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _passage(item: dict[str, Any]) -> Passage:
    """A result item. Search-R1's own BM25 server sends `{"title", "text", "contents"}` without an id."""
    document = item["document"]
    contents = document.get("contents")
    if contents is None:
        contents = f'"{document["title"]}"\n{document["text"]}'
    score = item.get("score")
    return Passage(id=str(document.get("id", "")), contents=contents,
                   score=float(score) if score is not None else None)


def _reason(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        body = None
    detail = body.get("detail") if isinstance(body, dict) else None
    return str(detail) if detail else response.text[:200]
