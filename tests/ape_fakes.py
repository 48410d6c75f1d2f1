"""Test doubles for the E2E-APE controller: :class:`ScriptedController` replays fixed replies."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from eviback.teacher.chat import ChatMessage, ChatReply


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
