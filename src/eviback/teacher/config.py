"""One configuration record for a teacher, and the factory that builds it.

Training, `eviback judge` and E2E-APE describe their teacher with a :class:`TeacherConfig` (YAML holds its
values; `eviback.types.from_dict(TeacherConfig, data)` reads it) and get a ready :class:`Teacher` from
:func:`build_teacher`::

    teacher = build_teacher(TeacherConfig(policy="two-stage", backend="http",
                                          http=HttpBackendConfig(base_url="http://127.0.0.1:8001/v1")))
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from eviback.cache import cache_dir
from eviback.settings import check_fields
from eviback.teacher.cache import ReplyCache, SqliteCache
from eviback.teacher.evidence_judge import JUDGE_FILE, load_judge
from eviback.teacher.judge import JudgeConfig, Teacher
from eviback.teacher.local import LocalBackendConfig, LocalClient
from eviback.teacher.openai_http import HttpBackendConfig, OpenAIChatClient
from eviback.teacher.policy import TeacherPolicy, load_policy
from eviback.teacher.rules import NoModelClient

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_CACHE = "default"


class Backend(enum.StrEnum):
    LOCAL = "local"  # an in-process transformers model (no server; the demo's teacher)
    HTTP = "http"  # any OpenAI-compatible endpoint (vLLM, llama.cpp, a hosted API)


@dataclass(frozen=True)
class TeacherConfig:
    """Everything that decides how rollouts are judged."""

    policy: str = "two-stage"  # a built-in name or a frozen policy file, optionally pinned: NAME@VERSION
    backend: Backend = Backend.LOCAL
    http: HttpBackendConfig = field(default_factory=HttpBackendConfig)  # used when backend is "http"
    local: LocalBackendConfig = field(default_factory=LocalBackendConfig)  # used when backend is "local"
    judge: JudgeConfig = field(default_factory=JudgeConfig)  # concurrency and retries
    cache: str = DEFAULT_CACHE  # SQLite reply cache path; "default": <eviback cache>/teacher/replies.sqlite; "": none

    def __post_init__(self) -> None:
        check_fields(self)  # types first: `backend` a Backend (or its name)
        for name, section in (("http", HttpBackendConfig), ("local", LocalBackendConfig), ("judge", JudgeConfig)):
            if not isinstance(getattr(self, name), section):
                raise ValueError(f"TeacherConfig.{name} must be a {section.__name__}, got {getattr(self, name)!r}; "
                                 "read a teacher's YAML with eviback.types.from_dict(TeacherConfig, data)")
        if not self.policy.strip():
            raise ValueError("policy must name a teacher policy: a built-in name (two-stage, "
                             "single-prompt-dual-task) or a frozen policy file, optionally NAME@VERSION")


def open_cache(spec: str) -> ReplyCache | None:
    if not spec:
        return None
    if spec == DEFAULT_CACHE:
        return SqliteCache(cache_dir() / "teacher" / "replies.sqlite")
    return SqliteCache(spec)


def build_teacher(
    config: TeacherConfig, *, policy: TeacherPolicy | None = None, model: PreTrainedModel | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> Teacher:
    """A Teacher for `config`. Pass `policy` to judge with an unfrozen candidate instead of `config.policy`;
    pass `model`/`tokenizer` to let the local backend share an already loaded model. A policy whose every
    stage has its own backend (a trained classifier, a rule) loads no LLM at all. The teacher owns its
    client and cache: `teacher.close()` closes them."""
    policy = policy if policy is not None else load_policy(config.policy)
    register_judge_beside(config.policy)
    if not policy.needs_llm:  # every stage has its own backend (a classifier, a rule): load no model
        client = NoModelClient()
    elif config.backend is Backend.LOCAL:
        client = LocalClient(config.local, model=model, tokenizer=tokenizer)
    else:
        client = OpenAIChatClient(config.http)
    # a stage with a model of its own (the trained evidence judge) computes where the local backend does
    return Teacher(policy, client, config.judge, cache=open_cache(config.cache), owns_resources=True,
                   device=config.local.device)


def register_judge_beside(ref: str) -> None:
    """A policy file inside an evidence judge's directory (`eviback build-judge` writes one there): make
    that judge known to this process, wherever the directory is."""
    path = Path(ref.rsplit("@", 1)[0]) if "@" in ref else Path(ref)
    if path.is_file() and (path.parent / JUDGE_FILE).exists():
        load_judge(path.parent)
