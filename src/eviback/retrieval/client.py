"""The client of a `/retrieve` service (`eviback serve`, or Search-R1's own retrieval server).

    from eviback.retrieval import load_retriever
    retriever = load_retriever("http://127.0.0.1:8000")      # a RetrievalClient
    retriever.search(["who wrote hamlet"], topk=3)           # [[Passage(id, contents, score), ...]]

Same interface as the in-process indexes, so the rollout engine takes either. It keeps a pool of
connections (safe to share between threads) and puts a timeout on every request. A service that does not
answer (connection refused or reset, a timeout, 408, 429 or 5xx) is retried with exponential backoff (with
jitter, so many trainers do not reconnect in lockstep) until `ClientConfig.deadline_s` has passed, each
attempt logged: a restarted service, even one that takes minutes to load its index, costs a training run a
pause. Past the deadline a search raises :class:`RetrieverUnavailable`, naming the service and the last
error. A 4xx answer is not retried (the same request would be refused again): it raises
:class:`RetrievalError` with the service's reason.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from typing import Any

import httpx

from eviback.retrieval.base import live_queries
from eviback.retrieval.config import ClientConfig
from eviback.types import Passage
from eviback.unavailable import ServiceUnavailable

log = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class RetrievalError(RuntimeError):
    """The retrieval service refused the request, answered something unreadable, or did not answer."""


class RetrieverUnavailable(RetrievalError, ServiceUnavailable):
    """The service did not answer until the deadline: stopped, restarting, unreachable or overloaded.

    `url` is the service's, `last_error` the last attempt's failure, `attempts` how many were made in
    `waited_s` seconds. A caller that can continue later (a training run with `--resume`) says so."""

    service = "the retrieval service"

    def __init__(self, url: str, last_error: str, attempts: int, waited_s: float) -> None:
        self.url, self.last_error, self.attempts, self.waited_s = url, last_error, attempts, waited_s
        super().__init__(
            f"retrieval service {url} did not answer for {waited_s:.0f} s ({attempts} attempts; last error: "
            f"{last_error}): check that `eviback serve` is running there, or wait longer for it "
            f"(ClientConfig.deadline_s; `eviback train --set retrieval_deadline_s=SECONDS`, "
            f"`eviback eval --retrieval-deadline-s SECONDS`)")

    def __reduce__(self) -> tuple[type[RetrieverUnavailable], tuple[str, str, int, float]]:
        # picklable with its fields (multiprocessing, torch elastic)
        return type(self), (self.url, self.last_error, self.attempts, self.waited_s)

    def reason(self) -> str:
        return f"did not answer for {self.waited_s:.0f} s ({self.attempts} attempts; last error: {self.last_error})"

    def restart(self) -> str:
        return f"`eviback serve` listening at {self.url}"


def retry_delay(attempt: int, config: ClientConfig) -> float:
    """The longest wait after failed attempt `attempt` (1, 2, ...): `backoff_s` doubled after each attempt,
    at most `max_backoff_s` (the client sleeps a random 50-100% of it)."""
    return min(config.max_backoff_s, config.backoff_s * 2 ** min(attempt - 1, 60))


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
        results, live = live_queries(queries, topk)
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
        deadline_s = self.config.deadline_s
        started = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            try:
                response = self._http.post("/retrieve", json=payload)
            except httpx.TransportError as e:  # connection refused/reset, timeouts, protocol errors
                error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            else:
                if response.status_code not in RETRYABLE_STATUS:
                    if response.status_code >= 400:
                        raise RetrievalError(f"{self.url}/retrieve refused the request (HTTP {response.status_code}): "
                                             f"{_reason(response)}")
                    return self._parse(response, len(queries))
                error = f"HTTP {response.status_code}: {_reason(response)}"
            left = deadline_s - (time.monotonic() - started)
            if left <= 0:
                raise RetrieverUnavailable(self.url, error, attempt, time.monotonic() - started)
            # The last wait ends at the deadline, so that one attempt is made there.
            delay = min(left, retry_delay(attempt, self.config) * random.uniform(0.5, 1.0))
            log.warning("retrieval attempt %d to %s failed: %s; retrying in %.1f s (%.0f s left of the %.0f s "
                        "deadline)", attempt, self.url, error, delay, left, deadline_s)
            time.sleep(delay)

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
