"""The `/retrieve` HTTP service, byte-compatible with Search-R1's retrieval server.

Run it with `eviback serve INDEX_DIR` (127.0.0.1:8000 by default; `--host 0.0.0.0` to accept other
machines). Request and response, as Search-R1's `retrieval_server.py` defines them:

    POST /retrieve  {"queries": ["q1", "q2"], "topk": 3, "return_scores": true}
    200             {"result": [[{"document": {"id": "7", "contents": "\\"Title\\"\\ntext"}, "score": 12.3}, ...], ...]}

one list per query, best first, serialised as FastAPI serialises Search-R1's dict (compact separators, UTF-8
unescaped). With `"return_scores": false` each item is `{"document": {...}}` (Search-R1 itself fails on
that case). `topk` defaults to 3. `GET /health` answers `{"status": "ok", ...}` with the index's manifest
and the request counters.

Bad input never reaches the index: malformed JSON is a 400, a body over the size limit a 413, and (checked
by a pydantic model, :func:`request_model`) wrong types, a missing or empty query list, too many queries, an over-long query or a `topk` out of range a 422,
each with `{"detail": reason}`. Requests that arrive together are merged by :class:`Batcher` into one
batched search call, which is what lets many concurrent clients share one index efficiently.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import socket
import sys
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    create_model,
)

from eviback.retrieval.base import Retriever
from eviback.retrieval.config import ServerConfig
from eviback.types import Passage

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the service refuses; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


@dataclass(frozen=True)
class RetrieveRequest:
    """A validated `/retrieve` request."""

    queries: tuple[str, ...]
    topk: int
    return_scores: bool


@functools.lru_cache(maxsize=8)
def request_model(config: ServerConfig) -> type[BaseModel]:
    """The pydantic model of a `/retrieve` body under `config`'s limits: strict types (`"3"` is not a topk,
    `1` is not a boolean), unknown fields ignored as Search-R1's request model ignores them."""
    query = Annotated[StrictStr, Field(max_length=config.max_query_chars)]  # pydantic refuses lone surrogates
    return create_model(
        "RetrieveBody",
        __config__=ConfigDict(extra="ignore", strict=True),
        queries=(Annotated[list[query], Field(min_length=1, max_length=config.max_queries)], ...),
        topk=(Annotated[StrictInt, Field(ge=1, le=config.max_topk)] | None, None),
        return_scores=(StrictBool, False),  # Search-R1's default
    )


def parse_request(payload: Any, config: ServerConfig) -> RetrieveRequest:
    """Validate a decoded `/retrieve` body with :func:`request_model`. Raises RequestError (422) naming the
    field and the limit (the first problem found, in field order)."""
    try:
        body = request_model(config).model_validate(payload)
    except ValidationError as e:
        raise RequestError(422, _reason(e.errors(include_url=False)[0], payload, config)) from None
    topk = body.topk if body.topk is not None else config.default_topk  # Search-R1 falls back to its top-k too
    return RetrieveRequest(queries=tuple(body.queries), topk=topk, return_scores=body.return_scores)


def _reason(error: Mapping[str, Any], payload: Any, config: ServerConfig) -> str:
    """One pydantic error as the sentence a client reads: the field, what was wrong, the limit and the fix."""
    loc, kind, value = tuple(error["loc"]), error["type"], error.get("input")
    if not loc:
        return (f"the body must be a JSON object like {{\"queries\": [\"...\"], \"topk\": 3, \"return_scores\": "
                f"true}}, got {_json_type(payload)}")
    field_name = loc[0]
    if kind == "missing":
        return f"missing field {field_name!r} (a list of query strings)"
    if field_name == "queries":
        if len(loc) == 1:
            if kind == "too_short":
                return "'queries' is empty: send at least one query"
            if kind == "too_long":
                return (f"too many queries: {len(value)} in one request, the limit is {config.max_queries}: "
                        "split the batch (or raise the server's --max-queries)")
            return f"'queries' must be a list of strings, got {_json_type(value)}"
        where = f"queries[{loc[1]}]"
        if kind == "string_too_long":
            return (f"{where} is {len(value)} characters long, the limit is {config.max_query_chars}: shorten it "
                    "(or raise the server's --max-query-chars)")
        if kind == "string_unicode":
            return f"{where} is not valid Unicode (an unpaired surrogate escape)"
        return f"{where} must be a string, got {_json_type(value)}"
    if field_name == "topk":
        if kind in ("greater_than_equal", "less_than_equal"):
            return f"'topk' must be between 1 and {config.max_topk}, got {value}"
        return f"'topk' must be an integer, got {_json_type(value)}"
    if field_name == "return_scores":
        return f"'return_scores' must be true or false, got {_json_type(value)}"
    return f"{'.'.join(map(str, loc))}: {error['msg']}"


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
             float: "a number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def render_response(results: Sequence[Sequence[Passage]], return_scores: bool) -> bytes:
    """The response body, byte for byte what Search-R1's FastAPI server sends for the same passages."""
    if return_scores:
        body = [[{"document": {"id": p.id, "contents": p.contents}, "score": p.score} for p in passages]
                for passages in results]
    else:
        body = [[{"document": {"id": p.id, "contents": p.contents}} for p in passages] for passages in results]
    # FastAPI's JSONResponse rendering: compact separators, non-ASCII unescaped, NaN refused.
    return json.dumps({"result": body}, ensure_ascii=False, allow_nan=False, indent=None,
                      separators=(",", ":")).encode("utf-8")


@dataclass
class _Pending:
    queries: tuple[str, ...]
    topk: int
    future: asyncio.Future


@dataclass
class BatchStats:
    """Counters shown by `/health` (how well batching works under load)."""

    requests: int = 0
    queries: int = 0
    batches: int = 0  # search calls made
    refused: int = 0  # requests answered with a 4xx
    failed: int = 0  # requests whose search raised (5xx)
    search_seconds: float = 0.0
    started: float = field(default_factory=time.time)


class Batcher:
    """Merges the queries of requests that arrive together into one `retriever.search` call.

    One worker takes everything queued (optionally waiting `wait_s` for more), searches it in a thread
    (one call per distinct topk, so a result never depends on what else was in the batch) and hands each
    request its slice. While a search runs, new requests queue up and form the next batch."""

    def __init__(self, retriever: Retriever, max_batch_queries: int, wait_s: float = 0.0) -> None:
        self.retriever = retriever
        self.max_batch_queries = max_batch_queries
        self.wait_s = wait_s
        self.stats = BatchStats()
        self._queue: asyncio.Queue[_Pending] | None = None
        self._worker: asyncio.Task | None = None

    async def start(self) -> None:
        self._queue = asyncio.Queue()
        self._worker = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker

    async def search(self, queries: tuple[str, ...], topk: int) -> list[list[Passage]]:
        assert self._queue is not None, "Batcher.start() was not awaited"
        future = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Pending(queries, topk, future))
        return await future

    async def _run(self) -> None:
        assert self._queue is not None
        while True:
            batch = [await self._queue.get()]
            size = len(batch[0].queries)
            deadline = time.monotonic() + self.wait_s
            while size < self.max_batch_queries:
                if self._queue.empty():
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    try:
                        item = await asyncio.wait_for(self._queue.get(), remaining)
                    except TimeoutError:
                        break
                else:
                    item = self._queue.get_nowait()
                batch.append(item)
                size += len(item.queries)
            await self._search(batch)

    async def _search(self, batch: list[_Pending]) -> None:
        by_topk: dict[int, list[_Pending]] = defaultdict(list)
        for pending in batch:
            by_topk[pending.topk].append(pending)
        for topk, group in by_topk.items():
            queries = [q for pending in group for q in pending.queries]
            started = time.perf_counter()
            try:
                results = await asyncio.to_thread(self.retriever.search, queries, topk)
            except Exception as e:  # any error: one failed search must fail its requests, not the service
                log.exception("search of %d queries failed", len(queries))
                for pending in group:
                    if not pending.future.done():
                        pending.future.set_exception(e)
                continue
            finally:
                self.stats.batches += 1
                self.stats.search_seconds += time.perf_counter() - started
            offset = 0
            for pending in group:
                if not pending.future.done():  # the client may have gone away
                    pending.future.set_result(results[offset:offset + len(pending.queries)])
                offset += len(pending.queries)


def create_app(retriever: Retriever, config: ServerConfig | None = None,
               info: Mapping[str, Any] | None = None) -> FastAPI:
    """The FastAPI application serving `retriever`. `info` (e.g. the index manifest) is shown by /health.

    The caller owns `retriever` and closes it after the app stops."""
    config = config or ServerConfig()
    batcher = Batcher(retriever, config.max_batch_queries, config.batch_wait_ms / 1000)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        warm_up = getattr(retriever, "warm_up", None)
        if warm_up is not None:  # compile / load models before the first request, not during it
            await asyncio.to_thread(warm_up)
        await batcher.start()
        yield
        await batcher.stop()

    app = FastAPI(title="eviback retrieval", description="Search-R1-compatible /retrieve service",
                  lifespan=lifespan)
    app.state.batcher = batcher

    def refuse(status: int, reason: str) -> JSONResponse:
        batcher.stats.refused += 1
        return JSONResponse({"detail": reason}, status_code=status)

    @app.post("/retrieve")
    async def retrieve(request: Request) -> Response:
        batcher.stats.requests += 1
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > config.max_body_bytes:
            return refuse(413, f"request body of {declared} bytes is over the limit of {config.max_body_bytes}")
        # Read in pieces so a body sent without a length (chunked) cannot grow past the limit in memory.
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > config.max_body_bytes:
                return refuse(413, f"request body of more than {config.max_body_bytes} bytes is over the limit")
            parts.append(part)
        try:
            payload = json.loads(b"".join(parts))
        except UnicodeDecodeError:
            return refuse(400, "malformed JSON: the body is not UTF-8")
        except json.JSONDecodeError as e:
            return refuse(400, f"malformed JSON: {e.msg} at line {e.lineno} column {e.colno}")
        except RecursionError:
            return refuse(400, "malformed JSON: nested too deeply")
        try:
            parsed = parse_request(payload, config)
        except RequestError as e:
            return refuse(e.status, str(e))
        batcher.stats.queries += len(parsed.queries)
        try:
            results = await batcher.search(parsed.queries, parsed.topk)
        except Exception as e:  # any error is reported to the client; the service keeps running
            batcher.stats.failed += 1
            return JSONResponse({"detail": f"search failed: {type(e).__name__}: {e}"}, status_code=500)
        return Response(render_response(results, parsed.return_scores), media_type="application/json")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        stats = batcher.stats
        return {
            "status": "ok",
            "index": dict(info or {}),
            "limits": {"default_topk": config.default_topk, "max_topk": config.max_topk,
                       "max_queries": config.max_queries, "max_query_chars": config.max_query_chars},
            "stats": {"requests": stats.requests, "queries": stats.queries, "batches": stats.batches,
                      "refused": stats.refused, "failed": stats.failed,
                      "search_seconds": round(stats.search_seconds, 3),
                      "uptime_seconds": round(time.time() - stats.started, 1)},
        }

    return app


def serve(retriever: Retriever, config: ServerConfig | None = None, info: Mapping[str, Any] | None = None) -> None:
    """Serve `retriever` until interrupted (blocking). Prints the URL once the service accepts requests."""
    import uvicorn  # the server alone: `create_app` (and the tests' client) run the app without it

    config = config or ServerConfig()
    # Searches run in a worker thread while the event loop parses requests. With Python's default 5 ms
    # GIL switch interval a finished search waits for the loop thread to yield: measured ~3 ms per batch
    # on a BM25 search that takes 0.1 ms. This process is the service, so a short interval is cheap.
    sys.setswitchinterval(0.0005)
    app = create_app(retriever, config, info)
    listener = _listen(config.host, config.port)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5))

    async def run() -> None:
        task = asyncio.create_task(server.serve(sockets=[listener]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:  # print the real port (--port 0 asks for a free one)
            host, port = listener.getsockname()[:2]
            print(f"serving on http://{host}:{port}/retrieve", flush=True)
        await task

    asyncio.run(run())


def _listen(host: str, port: int) -> socket.socket:
    """A bound listening socket, or an OSError that says what to do (uvicorn would exit with a traceback)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # rebind at once after a restart
    # Accepted connections inherit this. Without it, Nagle's algorithm holds the response body (written
    # after its headers) until the client's delayed ACK: a constant ~40 ms per request (measured).
    listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        listener.bind((host, port))
    except OSError as e:
        listener.close()
        raise OSError(f"cannot listen on {host}:{port} ({e.strerror}): choose another --port, or stop what is "
                      "using it") from None
    listener.listen(2048)
    return listener
