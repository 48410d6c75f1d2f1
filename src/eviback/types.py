"""The records that cross module boundaries.

Every value passed between eviback's modules is one of these frozen dataclasses: questions, passages,
actions, turns, trajectories, groups and teacher verdicts. They are defined once, here, and serialised to
JSON with :func:`to_dict` / :func:`from_dict` (the shape of every JSONL file a run writes).
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar


class ActionKind(enum.StrEnum):
    """What a model turn asked for."""

    SEARCH = "search"
    ANSWER = "answer"
    INVALID = "invalid"  # neither a search nor an answer: Search-R1 replies with its invalid-action message


class StopReason(enum.StrEnum):
    """Why a trajectory ended."""

    ANSWERED = "answered"  # the model emitted <answer>...</answer>
    FORCED = "forced"  # the turn budget ran out without an answer (force-terminated)
    LENGTH = "length"  # the context/token budget of the trajectory ran out


class Status(enum.StrEnum):
    """A teacher's evidence-sufficiency verdict (EVIBACK.md section 4)."""

    SUFFICIENT = "S"
    INSUFFICIENT = "I"
    AMBIGUOUS = "A"


@dataclass(frozen=True)
class Question:
    """One QA item in FlashRAG's convention (`id, question, golden_answers, metadata`)."""

    id: str
    question: str
    golden_answers: tuple[str, ...]
    dataset: str = ""
    split: str = ""
    metadata: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    source: str = ""  # provenance, e.g. `github:owner/repo@commit:path` of the file it was converted from

    @property
    def gold_passage_ids(self) -> tuple[str, ...]:
        """Ids of the corpus passages that support the answer, where the data set knows them."""
        return tuple(str(i) for i in self.metadata.get("gold_passage_ids", ()))


@dataclass(frozen=True)
class Passage:
    """A corpus passage. `contents` is wiki-18's `"Title"\\ntext`, kept byte for byte (Search-R1 renders
    the first line, quotes included, as the title)."""

    id: str
    contents: str
    score: float | None = None

    @property
    def title(self) -> str:
        """The title without the corpus's surrounding double quotes."""
        return self.contents.split("\n", 1)[0].strip('"')

    @property
    def text(self) -> str:
        return "\n".join(self.contents.split("\n")[1:])

    @classmethod
    def from_title_text(cls, id: str, title: str, text: str, score: float | None = None) -> Passage:
        return cls(id=id, contents=f'"{title}"\n{text}', score=score)


@dataclass(frozen=True)
class Action:
    """The action parsed from one model turn; `content` is the stripped query or answer ("" if invalid)."""

    kind: ActionKind
    content: str = ""


@dataclass(frozen=True)
class Turn:
    """One model turn and what the environment returned for it.

    `text` is the model's own (truncated) text of the turn; `observation` is what was appended after it:
    the rendered `<information>` block for an executed search, Search-R1's invalid-action message, or ""
    (an answer, or a search in the final turn, which is not executed)."""

    text: str
    action: Action
    passages: tuple[Passage, ...] = ()
    observation: str = ""
    executed: bool = False  # True when the turn's search was sent to the retriever


@dataclass(frozen=True)
class TokenTrace:
    """The token-level view of a trajectory, for training.

    All three sequences have the length of the response (everything after the prompt):
    `ids` are the token ids (sampled ids for model tokens, tokenizer ids for observations),
    `mask` is 1 for a model token and 0 for an observation/retrieved token, `logprobs` the sampling
    log-probability of each model token (0.0 on observation tokens)."""

    prompt_ids: tuple[int, ...]
    ids: tuple[int, ...]
    mask: tuple[int, ...]
    logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class Trajectory:
    """One rollout of the search agent on one question."""

    question: Question
    turns: tuple[Turn, ...]
    answer: str | None  # from the model's own text only; None when it never answered
    stop_reason: StopReason
    sample_index: int = 0  # position in the question's group
    tokens: TokenTrace | None = None  # kept for training, dropped from evaluation dumps

    @property
    def response(self) -> str:
        """Model text and observations, in order (the decoded response after the prompt)."""
        return "".join(t.text + t.observation for t in self.turns)

    @property
    def queries(self) -> tuple[str, ...]:
        """The queries the model issued and the engine executed."""
        return tuple(t.action.content for t in self.turns if t.executed)

    @property
    def evidence(self) -> tuple[Passage, ...]:
        """Every passage this rollout retrieved, in order (what the teacher's Stage A may see)."""
        return tuple(p for t in self.turns for p in t.passages)


@dataclass(frozen=True)
class Group:
    """The G rollouts of one question."""

    question: Question
    trajectories: tuple[Trajectory, ...]


@dataclass(frozen=True)
class Verdict:
    """A teacher's judgement of one rollout.

    `status` is the final status after the gate (Stage B may lower S/A to I, never raise I);
    `stage_a_status` is Stage A's own. `answer` is the refined answer (the actor's answer when Stage B did
    not run). `error` is set (and `status` is None) when the teacher failed: such a verdict is a
    `teacher_error`, never a score of 0. The token counts are those of the replies used (cached or not);
    `calls` are the backend calls actually made (0 when every stage came from the cache)."""

    status: Status | None
    stage_a_status: Status | None = None
    answer: str | None = None
    stage_b_ran: bool = False
    reward: float | None = None
    error: str | None = None
    policy_version: str = ""
    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cache_hits: int = 0
    latency_s: float = 0.0
    rationale: str = ""
    retries: int = 0  # backend calls repeated after a transient failure or a malformed reply
    schema_violations: int = 0  # replies that did not parse into the stage's output schema
    # the refined answer was a non-answer or was not found in the evidence as the actor saw it, so the status
    # was lowered to I (a policy with `grounded_answer`); counted as `teacher/stage_b_ungrounded`
    ungrounded: bool = False

    @property
    def teacher_error(self) -> bool:
        return self.error is not None


# --------------------------------------------------------------------------------------------------
# JSON (de)serialisation of the records above.

T = TypeVar("T")


def to_dict(record: Any) -> Any:
    """A record (or a container of records) as plain JSON-serialisable values."""
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        return {f.name: to_dict(getattr(record, f.name)) for f in dataclasses.fields(record)}
    if isinstance(record, enum.Enum):
        return record.value
    if isinstance(record, Mapping):
        return {str(k): to_dict(v) for k, v in record.items()}
    if isinstance(record, list | tuple):
        return [to_dict(v) for v in record]
    return record


def from_dict(cls: type[T], data: Any) -> T:
    """Rebuild a record of type `cls` from :func:`to_dict`'s output, following the field annotations.

    Raises `ValueError` naming the field when a required field is missing."""
    return _decode(cls, data, cls.__name__)


def _decode(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        return _decode(options[0], value, where)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ValueError(f"{where}: expected an object, got {type(value).__name__}")
        hints = typing.get_type_hints(tp)
        kwargs = {}
        for f in dataclasses.fields(tp):
            if f.name in value:
                kwargs[f.name] = _decode(hints[f.name], value[f.name], f"{where}.{f.name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ValueError(f"{where}: missing field {f.name!r}")
        return tp(**kwargs)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp(value)
    if origin is tuple:
        args = typing.get_args(tp)
        return tuple(_decode(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin in (Mapping, dict) or tp in (dict, Mapping):
        return dict(value)
    if tp is float and isinstance(value, int):
        return float(value)
    return value
