"""Stand-ins for the teacher's backends, for tests of logic and of failure handling.

- :class:`ScriptedClient`: replies decided by a function of the request, or queued with `.enqueue()`;
  an exception in the script is raised as the backend's error. It records every request it saw.
- :class:`FaultyChatServer`: a real OpenAI-compatible HTTP server on 127.0.0.1 that misbehaves on purpose
  (hangs, HTTP 500, garbage bodies, malformed replies, or fails only the first n calls), to exercise the
  HTTP client's timeouts and the judge's retries through real sockets.

These never replace the real backends in a path a user runs; they pin the logic around them.
"""

from __future__ import annotations

import collections
import enum
import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self

from eviback.teacher.chat import ChatReply, ChatRequest
from eviback.teacher.policy import OutputField

Script = Callable[[ChatRequest], "str | BaseException"]


def default_reply(request: ChatRequest, status: str = "S", answer: str = "scripted answer") -> str:
    """A well-formed reply for any stage: `status` (if the stage has one) and `answer`."""
    values = {}
    for f in request.schema.fields:
        if f is OutputField.STATUS:
            values[f.value] = status
        elif f is OutputField.ANSWER:
            values[f.value] = answer
        else:
            values[f.value] = "scripted rationale"
    return json.dumps(values)


class ScriptedClient:
    """A backend whose replies are scripted. Queued replies (`enqueue`) are used first, in order; then
    `script(request)`. A reply that is an exception is raised. Thread-safe; `requests` lists every request."""

    def __init__(self, script: Script | None = None, *, backend_id: str = "scripted") -> None:
        self.script = script or (lambda request: default_reply(request))
        self._backend_id = backend_id
        self._queue: collections.deque[str | BaseException] = collections.deque()
        self._lock = threading.Lock()
        self.requests: list[ChatRequest] = []

    @property
    def backend_id(self) -> str:
        return self._backend_id

    def enqueue(self, *replies: str | BaseException) -> ScriptedClient:
        with self._lock:
            self._queue.extend(replies)
        return self

    def complete(self, request: ChatRequest) -> ChatReply:
        with self._lock:
            self.requests.append(request)
            reply = self._queue.popleft() if self._queue else None
        if reply is None:
            reply = self.script(request)
        if isinstance(reply, BaseException):
            raise reply
        prompt_tokens = sum(len(m.content.split()) for m in request.messages)
        return ChatReply(text=reply, prompt_tokens=prompt_tokens, completion_tokens=len(reply.split()))

    def close(self) -> None:
        pass


class Fault(enum.StrEnum):
    """How :class:`FaultyChatServer` answers `/v1/chat/completions`."""

    OK = "ok"  # a well-formed verdict reply (status S, a short answer)
    HANG = "hang"  # never answers within any sane timeout (sleeps `hang_s`)
    ERROR_500 = "500"  # HTTP 500 with an error body
    GARBAGE = "garbage"  # HTTP 200 whose body is not JSON at all
    MALFORMED = "malformed"  # HTTP 200, valid OpenAI envelope, but the message is prose with no verdict
    FLAKY = "flaky"  # the first `fail_first` calls get HTTP 500, the rest are OK
    NO_SCHEMA = "no_schema"  # HTTP 400 to any request asking for structured output; prose+JSON otherwise


class LocalHttpServer:
    """A real HTTP server on 127.0.0.1, serving a handler class on a free port in a daemon thread (the chat
    servers of the tests). Subclasses call `_serve(Handler)` in `__init__`; `base_url` ends in /v1. Use as a
    context manager."""

    def _serve(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self._server = _Server(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/v1"

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def send_json(handler: BaseHTTPRequestHandler, code: int, text: str) -> None:
    """Answer a request with `text` as JSON; a client that has already gone (a timeout) is not an error."""
    data = text.encode("utf-8", "replace")
    try:
        handler.send_response(code)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)
    except (BrokenPipeError, ConnectionResetError):
        pass


class FaultyChatServer(LocalHttpServer):
    """An OpenAI-compatible server on 127.0.0.1 that answers every chat call with `fault`. Use as a
    context manager; `base_url` ends in /v1; `calls` counts chat requests received. A HANG lasts `hang_s`
    (None: until the server closes); `hangs_ended` counts the hangs that ended before the server closed."""

    def __init__(self, fault: Fault | str = Fault.OK, *, hang_s: float | None = 30.0, fail_first: int = 1) -> None:
        self.fault = Fault(fault)
        self.hang_s = hang_s
        self.fail_first = fail_first
        self.calls = 0
        self.hangs_ended = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # silence the default stderr log
                pass

            def do_GET(self) -> None:
                if self.path.rstrip("/").endswith("/models"):
                    self._send(200, json.dumps({"object": "list", "data": [{"id": "faulty", "object": "model"}]}))
                else:
                    self._send(404, "{}")

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                with server._lock:
                    server.calls += 1
                    number = server.calls
                fault = server.fault
                if fault is Fault.FLAKY:
                    fault = Fault.ERROR_500 if number <= server.fail_first else Fault.OK
                if fault is Fault.NO_SCHEMA:
                    if "response_format" in body or "structured_outputs" in body:
                        self._send(400, json.dumps({"error": {"message": "response_format is not supported"}}))
                    else:
                        self._send(200, _envelope("Here is my verdict: " + _ok_content(body)))
                elif fault is Fault.HANG:
                    if not server._stop.wait(server.hang_s):
                        with server._lock:
                            server.hangs_ended += 1
                    self._send(200, _envelope(_ok_content(body)))
                elif fault is Fault.ERROR_500:
                    self._send(500, json.dumps({"error": {"message": "internal error (injected)"}}))
                elif fault is Fault.GARBAGE:
                    self._send(200, "<html>502 Bad Gateway</html>\x00\xff garbage")
                elif fault is Fault.MALFORMED:
                    self._send(200, _envelope("I think the evidence is probably fine, hard to say."))
                else:
                    self._send(200, _envelope(_ok_content(body)))

            def _send(self, code: int, text: str) -> None:
                send_json(self, code, text)  # a client that gave up (timeout) is expected for HANG

        self._serve(Handler)

    def close(self) -> None:
        self._stop.set()  # release hanging handlers
        super().close()


class _Server(ThreadingHTTPServer):
    request_queue_size = 128  # the default backlog (5) drops connections under a concurrent judge


def _ok_content(body: dict) -> str:
    """A verdict that satisfies whatever schema the request asked for (status S when allowed)."""
    schema = {}
    response_format = body.get("response_format") or {}
    if "json_schema" in response_format:
        schema = response_format["json_schema"].get("schema", {})
    elif "structured_outputs" in body:
        schema = body["structured_outputs"].get("json", {})
    values = {}
    for name, spec in (schema.get("properties") or {"status": {"enum": ["S"]}, "answer": {}}).items():
        values[name] = spec.get("enum", ["S"])[0] if "enum" in spec else "an answer"
    return json.dumps(values)


def _envelope(content: str) -> str:
    return json.dumps({
        "id": f"chatcmpl-{time.time_ns()}", "object": "chat.completion", "model": "faulty",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
    })
