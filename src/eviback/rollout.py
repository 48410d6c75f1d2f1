"""The batched multi-turn rollout engine: Search-R1 search agents on a generation backend.

Every active trajectory (questions x group members) generates together each turn in one backend call;
each turn stops at `</search>`, `</answer>` or EOS; the searches of a turn go to the retriever in one
batched call; trajectories that finish leave the batch. Turn handling follows Search-R1
(`search_r1/llm_agent/generation.py`): `max_turns` turns whose actions are executed (a search is run, an
output without an action gets the invalid-action message), then one final turn in which a search is not
executed; a trajectory that has not answered by then is force-terminated. So there are at most
`max_turns` searches.

Token ids are never re-derived from text: each turn continues from `prompt ids + response ids so far`,
where the response holds the ids the backend sampled (mask 1, with their log-probabilities) and the
tokenised observations (mask 0). A trainer can use `Trajectory.tokens` as is.

    engine = RolloutEngine(load_backend(), retriever, RolloutConfig(group_size=5))
    batch = engine.rollout(questions, seed=step)          # batch.groups: one Group per question
    for group in batch.groups: ...                          # group.trajectories[i].tokens -> trainer
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from eviback.generation.base import Completion, FinishReason, GenerationBackend, SamplingConfig
from eviback.metrics import RolloutMetrics, rollout_metrics
from eviback.protocol import (
    INVALID_ACTION_MESSAGE,
    STOP_STRINGS,
    PromptStyle,
    extract_answer,
    parse_action,
    prompt_text,
    render_observation,
    truncate_turn,
)
from eviback.retrieval.base import Retriever
from eviback.settings import check_fields
from eviback.types import (
    Action,
    ActionKind,
    Group,
    Question,
    StopReason,
    TokenTrace,
    Trajectory,
    Turn,
)


@dataclass(frozen=True)
class RolloutConfig:
    """Search-R1 rollout settings (defaults: Search-R1's GRPO settings)."""

    group_size: int = field(default=5, metadata={"help": "G, rollouts per question (Search-R1: 5)"})
    max_turns: int = field(default=2, metadata={"help": "turns whose action is executed (so at most this many "
                           "searches); one final turn follows (Search-R1 trains with 2)"})
    max_turn_tokens: int = field(default=500, metadata={"help": "new tokens per turn (Search-R1: 500)"})
    max_observation_tokens: int = field(default=500, metadata={"help": "tokens of retrieved text per search: an "
                                        "observation is cut to this many tokens"})
    max_context_tokens: int = field(default=4096, metadata={"help": "prompt + response cap; a trajectory reaching it stops (LENGTH)"})
    topk: int = field(default=3, metadata={"help": "passages per search (Search-R1: 3)"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature (Search-R1: 1.0); 0 for greedy "
                               "(evaluation)"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling mass"})
    logprobs: bool = field(default=True, metadata={"help": "record sampled-token log-probabilities (training needs them)"})

    def __post_init__(self) -> None:
        check_fields(self)  # types first: the checks below compare numbers
        for name in ("group_size", "max_turn_tokens", "max_observation_tokens", "topk"):
            if getattr(self, name) < 1:
                # a training run sets max_observation_tokens as max_obs_tokens
                alias = " (the training setting max_obs_tokens)" if name == "max_observation_tokens" else ""
                raise ValueError(f"{name}{alias} must be >= 1, got {getattr(self, name)}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0 (0: greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1.0: nucleus sampling off), got {self.top_p}")
        if self.max_turns < 0:
            raise ValueError(f"max_turns must be >= 0 (0: one turn, no search), got {self.max_turns}")
        if self.max_context_tokens <= self.max_turn_tokens:
            raise ValueError(f"max_context_tokens ({self.max_context_tokens}) must exceed max_turn_tokens "
                             f"({self.max_turn_tokens}); raise it (and the engine's max_model_len)")

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(max_tokens=self.max_turn_tokens, temperature=self.temperature, top_p=self.top_p,
                              stop=STOP_STRINGS, logprobs=self.logprobs)


@dataclass(frozen=True)
class TurnTiming:
    """What one turn of a batched rollout cost. `turn` counts from 0."""

    turn: int
    active: int  # trajectories that generated in this turn
    context_tokens: int  # prompt + history tokens fed to the backend, summed over the batch
    cached_context_tokens: int  # of those, served from the backend's prefix cache (vLLM) instead of recomputed
    generated_tokens: int
    searches: int
    generate_s: float
    retrieve_s: float


@dataclass(frozen=True)
class RolloutBatch:
    """The result of one :meth:`RolloutEngine.rollout` call: one Group per question, in input order
    (each with `group_size` trajectories, `sample_index` 0..G-1), and where the time went."""

    groups: tuple[Group, ...]
    turns: tuple[TurnTiming, ...]
    wall_s: float

    @property
    def trajectories(self) -> tuple[Trajectory, ...]:
        return tuple(t for g in self.groups for t in g.trajectories)

    @property
    def generated_tokens(self) -> int:
        return sum(t.generated_tokens for t in self.turns)

    @property
    def generate_s(self) -> float:
        return sum(t.generate_s for t in self.turns)

    @property
    def retrieve_s(self) -> float:
        return sum(t.retrieve_s for t in self.turns)

    def metrics(self) -> RolloutMetrics:
        """EM, F1, valid-answer rate, searches, duplicate queries, forced terminations over all rollouts."""
        return rollout_metrics(self.trajectories)


@dataclass
class _Rollout:
    """One trajectory while it is being generated (mutable; frozen into a Trajectory at the end)."""

    question: Question
    sample_index: int
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    stop: StopReason | None = None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.ids)

    def add_model_tokens(self, completion: Completion, *, drop_eos: bool = False) -> None:
        """Append the turn's sampled ids (mask 1). With `drop_eos`, a final EOS is left out of the context,
        as Search-R1 does when the trajectory goes on (it decodes each turn without special tokens and
        re-tokenises, so an EOS never stays in mid-trajectory)."""
        ids, logprobs = list(completion.token_ids), list(completion.logprobs)
        if drop_eos and completion.finish_reason is FinishReason.EOS and ids:
            ids.pop()
            if logprobs:
                logprobs.pop()
        self.ids.extend(ids)
        self.mask.extend([1] * len(ids))
        self.logprobs.extend(logprobs if logprobs else [0.0] * len(ids))

    def add_observation(self, ids: Sequence[int]) -> None:
        self.ids.extend(ids)
        self.mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))

    def freeze(self) -> Trajectory:
        assert self.stop is not None
        return Trajectory(
            question=self.question,
            turns=tuple(self.turns),
            answer=extract_answer([t.text for t in self.turns]),  # the model's own text only
            stop_reason=self.stop,
            sample_index=self.sample_index,
            tokens=TokenTrace(tuple(self.prompt_ids), tuple(self.ids), tuple(self.mask), tuple(self.logprobs)),
        )


class RolloutEngine:
    """Runs Search-R1 rollouts of `backend`'s policy against `retriever`; `prompt` says how the prompt reaches
    the model (default: through the tokenizer's chat template). A tokenizer that `prompt` cannot serve (no
    chat template, with `chat_template: auto`) is refused here, before any rollout."""

    def __init__(self, backend: GenerationBackend, retriever: Retriever, config: RolloutConfig | None = None, *,
                 prompt: PromptStyle | None = None) -> None:
        self.backend = backend
        self.retriever = retriever
        self.config = config or RolloutConfig()
        self.prompt = prompt or PromptStyle()
        self.tokenizer = backend.tokenizer
        self.prompt.check(self.tokenizer)
        if self.config.max_context_tokens > backend.max_context:
            raise ValueError(
                f"max_context_tokens={self.config.max_context_tokens} exceeds the {backend.name} backend's "
                f"context of {backend.max_context}; lower it or start the engine with a larger max_model_len"
            )
        self._invalid_ids = self._encode([INVALID_ACTION_MESSAGE])[0]

    def _encode(self, texts: Sequence[str]) -> list[list[int]]:
        return self.tokenizer(list(texts), add_special_tokens=False)["input_ids"] if texts else []

    def prompt_ids(self, question: Question) -> list[int]:
        """The token ids of `question`'s Search-R1 prompt in the engine's prompt style."""
        return self._encode([prompt_text(self.tokenizer, question.question, self.prompt)])[0]

    def rollout(self, questions: Sequence[Question], *, group_size: int | None = None,
                seed: int | None = None) -> RolloutBatch:
        """Roll out `group_size` (default: the config's) trajectories per question, all batched.

        `seed`, when given, resets the backend's sampler first, so the same call with the same seed gives
        the same trajectories (training should pass a different seed each step)."""
        cfg = self.config
        group_size = group_size or cfg.group_size
        started = time.perf_counter()
        if seed is not None:
            self.backend.reseed(seed)
        prompts = self._encode([prompt_text(self.tokenizer, q.question, self.prompt) for q in questions])
        rollouts = [_Rollout(q, g, list(p)) for q, p in zip(questions, prompts, strict=True) for g in range(group_size)]
        sampling = cfg.sampling()
        timings = []
        for turn in range(cfg.max_turns + 1):
            timing = self._turn(turn, [r for r in rollouts if r.stop is None], sampling)
            if timing is None:
                break
            timings.append(timing)
        groups = tuple(
            Group(q, tuple(r.freeze() for r in rollouts[i * group_size : (i + 1) * group_size]))
            for i, q in enumerate(questions)
        )
        return RolloutBatch(groups, tuple(timings), time.perf_counter() - started)

    def _turn(self, turn: int, active: list[_Rollout], sampling: SamplingConfig) -> TurnTiming | None:
        """Generate one turn for every active trajectory and apply its action. None when none is active."""
        cfg = self.config
        final = turn == cfg.max_turns
        runnable, caps = [], []
        for r in active:
            budget = cfg.max_context_tokens - r.length
            if budget <= 0:
                r.stop = StopReason.LENGTH
                continue
            runnable.append(r)
            caps.append(min(cfg.max_turn_tokens, budget))
        if not runnable:
            return None

        t0 = time.perf_counter()
        contexts = [r.prompt_ids + r.ids for r in runnable]
        completions = self.backend.generate(contexts, sampling, caps)
        generate_s = time.perf_counter() - t0

        searching: list[tuple[_Rollout, str, Action]] = []
        for r, completion, cap in zip(runnable, completions, caps, strict=True):
            text = completion.text
            # The action is read from the turn cut after its stop string; the ids stay as sampled (the
            # stop token may carry a few characters past `</search>`).
            action = parse_action(truncate_turn(text))
            continues = not final and action.kind is ActionKind.INVALID and not (
                completion.finish_reason is FinishReason.LENGTH and cap < cfg.max_turn_tokens)
            r.add_model_tokens(completion, drop_eos=continues)
            if action.kind is ActionKind.ANSWER:
                r.turns.append(Turn(text, action))
                r.stop = StopReason.ANSWERED
            elif completion.finish_reason is FinishReason.LENGTH and cap < cfg.max_turn_tokens:
                r.turns.append(Turn(text, action))  # cut by the context budget, not the turn cap
                r.stop = StopReason.LENGTH
            elif final:
                r.turns.append(Turn(text, action))  # a search here is not executed
                r.stop = StopReason.FORCED
            elif action.kind is ActionKind.SEARCH:
                searching.append((r, text, action))
            else:
                r.turns.append(Turn(text, action, observation=INVALID_ACTION_MESSAGE))
                r.add_observation(self._invalid_ids)

        t0 = time.perf_counter()
        if searching:
            results = self.retriever.search([a.content for _, _, a in searching], cfg.topk)
            if len(results) != len(searching):
                raise RuntimeError(f"the retriever returned {len(results)} results for {len(searching)} queries")
            observations = [render_observation(passages) for passages in results]
            for (r, text, action), passages, observation, ids in zip(
                searching, results, observations, self._encode(observations), strict=True
            ):
                ids, observation = self._cap_observation(ids, observation)
                r.turns.append(Turn(text, action, tuple(passages), observation, executed=True))
                r.add_observation(ids)
        retrieve_s = time.perf_counter() - t0
        return TurnTiming(
            turn=turn,
            active=len(runnable),
            context_tokens=sum(len(c) for c in contexts),
            cached_context_tokens=sum(c.cached_prompt_tokens for c in completions),
            generated_tokens=sum(len(c.token_ids) for c in completions),
            searches=len(searching),
            generate_s=generate_s,
            retrieve_s=retrieve_s,
        )

    def _cap_observation(self, ids: list[int], text: str) -> tuple[list[int], str]:
        """Cut a tokenised observation to the cap (Search-R1 cuts the ids, closing tag included); the
        recorded text is then the decoding of the ids kept."""
        if len(ids) <= self.config.max_observation_tokens:
            return ids, text
        ids = ids[: self.config.max_observation_tokens]
        return ids, self.tokenizer.decode(ids)

