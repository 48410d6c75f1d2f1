"""What passes between the teacher workflow and an LLM backend, and the backend contract.

A :class:`ChatRequest` is everything a backend needs for one stage call: the messages, the reply's schema,
the decoding parameters and the teacher sample index. It is also exactly what the cache key hashes, so two
calls share a cached reply only when every byte sent would have been the same.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from eviback.teacher.policy import Decoding, OutputField
from eviback.types import Status, to_dict


@dataclass(frozen=True)
class ChatMessage:
    role: str  # "system" | "user"
    content: str


@dataclass(frozen=True)
class ReplySchema:
    """The JSON object a stage must reply with: `fields` in order; `statuses` are the allowed labels."""

    fields: tuple[OutputField, ...]
    statuses: tuple[Status, ...] = ()

    def json_schema(self) -> dict[str, Any]:
        """A JSON Schema (draft 2020-12 subset accepted by OpenAI strict mode, vLLM and llama.cpp)."""
        properties: dict[str, Any] = {}
        for f in self.fields:
            if f is OutputField.STATUS:
                properties[f.value] = {"type": "string", "enum": [s.value for s in self.statuses]}
            else:
                properties[f.value] = {"type": "string"}
        return {"type": "object", "properties": properties, "required": [f.value for f in self.fields],
                "additionalProperties": False}


@dataclass(frozen=True)
class ChatRequest:
    """One stage call. `stage` names the stage (for accounting and the boundary checks); it is not sent."""

    stage: str
    messages: tuple[ChatMessage, ...]
    schema: ReplySchema
    decoding: Decoding
    sample_index: int = 0  # teacher sample k: repeated sampling of the same request (E2E-APE stability)

    def canonical_json(self) -> str:
        return json.dumps(to_dict(self), sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    def cache_key(self, policy_version: str, backend: str) -> str:
        """The cache key: (backend model, policy version, stage, exact request, sample index)."""
        material = json.dumps([backend, policy_version, self.canonical_json()], ensure_ascii=False)
        return hashlib.sha256(material.encode("utf-8")).hexdigest()

    @property
    def seed(self) -> int | None:
        """The seed to send: the policy's seed shifted by the sample index (None when the policy sets none)."""
        return None if self.decoding.seed is None else self.decoding.seed + self.sample_index


@dataclass(frozen=True)
class ChatReply:
    """A backend's raw reply. Token counts are the server's (`usage`), or 0 where it reports none."""

    text: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_s: float = 0.0
    truncated: bool = False  # generation stopped at max_tokens (finish_reason "length")


class TeacherCallError(Exception):
    """A backend call failed. `retryable` says whether trying again may help."""

    retryable: bool = True

    def __init__(self, message: str, *, retryable: bool | None = None) -> None:
        super().__init__(message)
        if retryable is not None:
            self.retryable = retryable


class TransientError(TeacherCallError):
    """Timeouts, refused connections, HTTP 408/429/5xx, a body that is not JSON: retried."""


class PermanentError(TeacherCallError):
    """The request itself is wrong (e.g. HTTP 401 bad key, 404 unknown model): not retried."""

    retryable = False


class SchemaViolation(TeacherCallError):
    """The reply did not hold the stage's fields with allowed values: retried, then a teacher_error."""


@runtime_checkable
class TeacherClient(Protocol):
    """An LLM backend.

    Contract: `complete(request)` returns the reply text (expected to be the JSON object of
    `request.schema`) or raises :class:`TeacherCallError`; it never returns None. It must be safe to call
    from several threads. `backend_id` names the model behind it (it is part of the cache key, so replies of
    different models are never mixed up). A client that computes in this process with torch says so with a
    class attribute `in_process = True` (see :attr:`~eviback.teacher.judge.Teacher.in_process`)."""

    @property
    def backend_id(self) -> str: ...

    def complete(self, request: ChatRequest) -> ChatReply: ...

    def close(self) -> None: ...
