"""Stage backends that are deterministic rules, computed in process (no model, no server).

A stage whose `backend` names a rule (:data:`eviback.teacher.policy.RULES`) is answered by a
:class:`RuleClient` instead of the teacher's LLM. Its request is built by ``workflow.rule_request``: one JSON
object of exactly the inputs the stage sees (`question`; `evidence`, the search results as the actor saw
them; `answer`; `gold`, the gold answers with the data set and supporting passage ids), with no prompt. The
reply has the stage's output fields, so the workflow treats it like any other stage's: the gate, the
lower-only status rule, grounding, the reward, the accounting and the canary audit are unchanged.

- ``extractive-span:max_words=N``: the gold-aware Stage B of :mod:`eviback.teacher.extractive`. Status S
  (which keeps Stage A's S or A) with the best span as the refined answer, or I when no span matches;
- ``evidence-label``: the S/A/I evidence label of :mod:`eviback.teacher.labels` as the status. It reads the
  gold answers, so a policy deciding its status with it is an *oracle*: the ceiling of what a perfect
  evidence judge would give, never a teacher (:attr:`~eviback.teacher.policy.TeacherPolicy.is_oracle`).

Rule replies are not cached: computing one is cheaper than a cache lookup.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from typing import Any

from eviback.teacher.chat import ChatReply, ChatRequest, PermanentError
from eviback.teacher.extractive import best_span
from eviback.teacher.labels import evidence_label
from eviback.teacher.policy import EVIDENCE_LABEL, EXTRACTIVE_SPAN, parse_rule_backend
from eviback.teacher.workflow import SeenEvidence, render_seen
from eviback.types import Question, Status


def _seen(payload: Mapping[str, Any]) -> tuple[SeenEvidence, ...]:
    return tuple(SeenEvidence(text=e["text"], passage_ids=tuple(e["passage_ids"])) for e in payload["evidence"])


def extractive_reply(payload: Mapping[str, Any], params: Mapping[str, int]) -> dict[str, str]:
    span = best_span(render_seen(_seen(payload)), payload["gold"]["answers"], params["max_words"])
    if span is None:
        return {"status": Status.INSUFFICIENT.value, "answer": ""}
    return {"status": Status.SUFFICIENT.value, "answer": span.text}


def label_reply(payload: Mapping[str, Any], params: Mapping[str, int]) -> dict[str, str]:
    gold = payload["gold"]
    question = Question(id="", question=payload["question"], golden_answers=tuple(gold["answers"]),
                        dataset=gold["dataset"], metadata={"gold_passage_ids": list(gold["passage_ids"]),
                                                           "supporting_titles": list(gold.get("supporting_titles", ()))})
    return {"status": evidence_label(question, _seen(payload)).value}


RULE_REPLIES: Mapping[str, Callable[[Mapping[str, Any], Mapping[str, int]], dict[str, str]]] = {
    EXTRACTIVE_SPAN: extractive_reply,
    EVIDENCE_LABEL: label_reply,
}


class RuleClient:
    """A :class:`~eviback.teacher.chat.TeacherClient` that answers one rule backend's requests. Pure and
    thread-safe."""

    in_process = True  # a Teacher runs it in the calling thread (Teacher.in_process)
    cacheable = False  # the Teacher neither reads nor writes the reply cache for it

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.rule, self.params = parse_rule_backend(backend)
        self._reply = RULE_REPLIES[self.rule]

    @property
    def backend_id(self) -> str:
        return self.backend

    def close(self) -> None:
        pass

    def complete(self, request: ChatRequest) -> ChatReply:
        start = time.perf_counter()
        try:
            payload = json.loads(request.messages[-1].content)
            values = self._reply(payload, self.params)
        except (json.JSONDecodeError, KeyError, TypeError, IndexError) as e:
            raise PermanentError(f"stage {request.stage!r}: the rule {self.rule!r} reads a JSON request of the "
                                 f"inputs its stage sees (workflow.rule_request); got an unreadable one ({e!r})"
                                 ) from None
        return ChatReply(text=json.dumps(values, ensure_ascii=False), latency_s=time.perf_counter() - start)


class NoModelClient:
    """The teacher's LLM backend of a policy whose every stage has its own backend (a classifier or a rule):
    nothing to load. Asked anyway, it fails permanently (a teacher error, never a silent score)."""

    in_process = True

    @property
    def backend_id(self) -> str:
        return "none"

    def close(self) -> None:
        pass

    def complete(self, request: ChatRequest) -> ChatReply:
        raise PermanentError(f"stage {request.stage!r} asks the teacher's LLM, but this teacher loaded none: "
                             f"every stage of its policy has its own backend")
