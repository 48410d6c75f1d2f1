"""Test doubles for the E2E-APE controller: :class:`ScriptedController` replays fixed replies in process;
:class:`ReplayChatServer` replays free-form replies from a real local OpenAI-compatible HTTP server."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler

from eviback.teacher.chat import ChatMessage, ChatReply
from teacher_fakes import LocalHttpServer, send_json


class ScriptedController:
    """A controller with scripted replies, for tests only: `script(messages, slot)` if given, else the
    `replies` in call order (the last one repeats). `seen` records every prompt it was shown."""

    def __init__(self, *replies: str, script: Callable[[Sequence[ChatMessage], int], str] | None = None,
                 controller_id: str = "scripted-controller") -> None:
        self.replies = list(replies) or ["{}"]
        self.script = script
        self._id = controller_id
        self.seen: list[tuple[ChatMessage, ...]] = []
        self._lock = threading.Lock()

    @property
    def controller_id(self) -> str:
        return self._id

    def propose(self, messages: Sequence[ChatMessage], slot: int, stage: str = "A") -> ChatReply:
        with self._lock:
            self.seen.append(tuple(messages))
            text = self.script(messages, slot) if self.script is not None else \
                self.replies[min(len(self.seen) - 1, len(self.replies) - 1)]
        return ChatReply(text=text, prompt_tokens=sum(len(m.content.split()) for m in messages),
                         completion_tokens=len(text.split()))

    def close(self) -> None:
        pass


class ReplayChatServer(LocalHttpServer):
    """A real OpenAI-compatible chat server on 127.0.0.1 that replays `replies` (free text) in call order, the
    last one repeating; `bodies` records every request body it received. Use as a context manager."""

    def __init__(self, *replies: str) -> None:
        self.replies = list(replies) or ["{}"]
        self.bodies: list[dict] = []
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # silence the default stderr log
                pass

            def do_GET(self) -> None:
                send_json(self, 200, json.dumps({"object": "list", "data": [{"id": "replay", "object": "model"}]}))

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                with server._lock:
                    server.bodies.append(body)
                    text = server.replies[min(len(server.bodies), len(server.replies)) - 1]
                send_json(self, 200, json.dumps({
                    "id": f"replay-{len(server.bodies)}", "object": "chat.completion", "model": "replay",
                    "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}))

        self._serve(Handler)
