"""The configuration of an E2E-APE run: where it reads its rollouts, its teacher and controller backends,
where it writes; and how it reports progress."""

from __future__ import annotations

import dataclasses
import enum
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from eviback import dtype as dtypes
from eviback.device import check_device
from eviback.policy import DEFAULT_MODEL
from eviback.settings import check_fields
from eviback.teacher.config import TeacherConfig
from eviback.teacher.openai_http import HttpBackendConfig, StructuredOutput


class ControllerKind(enum.StrEnum):
    LOCAL = "local"  # the local model, free-text generation
    HTTP = "http"  # an OpenAI-compatible endpoint
    NONE = "none"  # no controller: seeds and systematic variants only


@dataclass(frozen=True)
class ControllerConfig:
    """The controller LLM."""

    kind: ControllerKind = ControllerKind.LOCAL
    http: HttpBackendConfig = field(default_factory=lambda: HttpBackendConfig(structured_output=StructuredOutput.NONE))
    local_model: str = DEFAULT_MODEL  # a bundled name or a local HF checkpoint directory
    dtype: str = "auto"  # auto: bf16 where the device computes it natively, else fp32 (eviback.dtype)
    # where the local model computes: auto (the local GPU when there is one, else the CPU), cpu, cuda or
    # cuda:N (eviback.device)
    device: str = "auto"

    def __post_init__(self) -> None:
        check_fields(self)  # `kind` becomes a ControllerKind, or is refused naming the kinds
        if not isinstance(self.http, HttpBackendConfig):
            raise ValueError(f"ControllerConfig.http must be an HttpBackendConfig, got {type(self.http).__name__}")
        if not self.local_model:
            raise ValueError("the controller's local_model must name a model (a bundled name or a directory)")
        dtypes.check(self.dtype, what="controller dtype")
        check_device(self.device, what="controller device")
        if self.http.structured_output is not StructuredOutput.NONE:
            # the controller writes free JSON: a stage reply schema would constrain it to nothing useful
            object.__setattr__(self, "http", dataclasses.replace(self.http, structured_output=StructuredOutput.NONE))


@dataclass(frozen=True)
class ApeConfig:
    """Where an E2E-APE run reads its rollouts, which backends it uses and where it writes."""

    out: str  # the run directory (events, cache, report, frozen policy)
    dumps: tuple[str, ...] = ()  # the actor's rollout dumps on training questions (rollouts/step-<N>.jsonl.gz)
    suite: str | None = None  # the data suite whose evaluation questions are refused (default: the embedded one)
    teacher: TeacherConfig = field(default_factory=lambda: TeacherConfig(cache=""))  # `policy` is unused
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    cache: str = "cache.sqlite"  # reply cache, relative to `out` (or absolute); "" for none
    frozen_name: str = "teacher.json"  # the frozen winner, relative to `out`

    def __post_init__(self) -> None:
        check_fields(self)
        if not isinstance(self.teacher, TeacherConfig):
            raise ValueError(f"ApeConfig.teacher must be a TeacherConfig, got {type(self.teacher).__name__}")
        if not isinstance(self.controller, ControllerConfig):
            raise ValueError(f"ApeConfig.controller must be a ControllerConfig, got {type(self.controller).__name__}")
        if not self.out:
            raise ValueError("an E2E-APE run needs an output directory (out)")
        if not self.frozen_name:
            raise ValueError("frozen_name must name the frozen policy's file")
        if not self.dumps:
            raise ValueError("no rollouts: give the actor's rollout dumps on training questions "
                             "(a training run's rollouts/step-<N>.jsonl.gz)")


Progress = Callable[[str], None]


def stderr_progress(message: str) -> None:
    print(f"[ape {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
