"""The evidence-constrained teacher (EVIBACK.md section 4).

- `policy`: teacher policies as typed workflows and frozen, content-hashed artifacts; the built-ins.
- `workflow`: the per-rollout logic: gold-free views, request building, reply parsing, gate, reward;
  `answers`: the non-answer rule of grounding.
- `rules`: stage backends that are deterministic rules: `extractive` (the gold-aware span Stage B) and the
  evidence label of `labels` (the oracle's Stage A).
- `chat`: requests, replies and the backend contract; `openai_http` and `local`: the backends.
- `cache`: the reply cache; `judge`: batch judging with concurrency, retries and accounting;
  `config`: one TeacherConfig record and `build_teacher`.
- `boundary`: audits of the evidence boundary (canaries planted in gold, checked in every request);
- `probes`: rollouts with known evidence sufficiency for measuring a teacher;
  `vllm_server`: a local OpenAI-compatible server.
"""

from eviback.teacher.boundary import CanaryAudit, plant_canaries
from eviback.teacher.cache import MemoryCache, ReplyCache, SqliteCache
from eviback.teacher.chat import (
    ChatMessage,
    ChatReply,
    ChatRequest,
    PermanentError,
    ReplySchema,
    SchemaViolation,
    TeacherCallError,
    TeacherClient,
    TransientError,
)
from eviback.teacher.config import Backend, TeacherConfig, build_teacher
from eviback.teacher.judge import (
    JudgeConfig,
    JudgedRollout,
    JudgeSummary,
    RetryConfig,
    StageStats,
    Teacher,
    TeacherStats,
    read_trajectories,
    summarize,
)
from eviback.teacher.openai_http import HttpBackendConfig, OpenAIChatClient, StructuredOutput
from eviback.teacher.policy import (
    Decoding,
    Input,
    OutputField,
    PolicyArtifact,
    PolicyError,
    RewardWeights,
    StageSpec,
    TeacherPolicy,
    builtin_policy_names,
    freeze_policy,
    load_policy,
    policy_from_json,
    read_artifact,
)
from eviback.teacher.workflow import (
    BlindView,
    GoldView,
    blind_view,
    build_blind_request,
    build_gold_aware_request,
    hybrid_reward,
    run_workflow,
    stage_request,
)

__all__ = [
    "Backend", "BlindView", "CanaryAudit", "ChatMessage", "ChatReply", "ChatRequest", "Decoding",
    "GoldView", "HttpBackendConfig", "Input", "JudgeConfig", "JudgeSummary", "JudgedRollout",
    "MemoryCache", "OpenAIChatClient", "OutputField", "PermanentError", "PolicyArtifact", "PolicyError",
    "ReplyCache", "ReplySchema", "RetryConfig", "RewardWeights", "SchemaViolation", "SqliteCache",
    "StageSpec", "StageStats", "StructuredOutput", "Teacher", "TeacherCallError", "TeacherClient",
    "TeacherConfig", "TeacherPolicy", "TeacherStats", "TransientError", "blind_view",
    "build_blind_request", "build_gold_aware_request", "build_teacher", "builtin_policy_names",
    "freeze_policy", "hybrid_reward", "load_policy", "plant_canaries", "policy_from_json",
    "read_artifact", "read_trajectories", "run_workflow", "stage_request", "summarize",
]
