"""Scripted stand-ins for the rollout engine's tests: a backend that replays turn texts per question and
a retriever that returns fixed passages. Both follow the real contracts (`eviback.generation.base`,
`eviback.retrieval.base`) and use the real SmolLM2 tokenizer, so token-level checks are real."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from eviback.generation.base import Completion, FinishReason, SamplingConfig, request_caps, stop_cut
from eviback.types import Passage


@dataclass
class ScriptedBackend:
    """Replies with the next scripted turn of the question whose text the context contains.

    `script[question]` is a list of turn texts (the last one repeats when they run out); a text is
    tokenised with the real tokenizer, or taken as given when it is a list of ids. A reply without a stop
    string ends with EOS, as a model's would. Every call's contexts are recorded."""

    tokenizer: object
    script: Mapping[str, Sequence[str | Sequence[int]]]
    max_context: int = 8192
    name: str = "scripted"
    calls: list[list[list[int]]] = field(default_factory=list)
    seen: list[tuple[tuple[int, ...], int]] = field(default_factory=list)  # (context, its turn index)
    seeds: list[int] = field(default_factory=list)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingConfig,
                 max_tokens: Sequence[int] | None = None) -> list[Completion]:
        caps = request_caps(len(prompts), params, max_tokens)
        self.calls.append([list(p) for p in prompts])
        out = []
        for prompt, cap in zip(prompts, caps, strict=True):
            context = self.tokenizer.decode(prompt)
            question = next(q for q in self.script if q in context)
            turns = self.script[question]
            # the turn index: one more than that of the longest earlier context this one extends
            index = max((i + 1 for ctx, i in self.seen if len(ctx) < len(prompt) and tuple(prompt[: len(ctx)]) == ctx),
                        default=0)
            self.seen.append((tuple(prompt), index))
            reply = turns[min(index, len(turns) - 1)]
            ids = list(reply) if not isinstance(reply, str) else self.tokenizer(reply, add_special_tokens=False)["input_ids"]
            cut = stop_cut(self.tokenizer, ids, params.stop)
            reason = FinishReason.STOP
            if cut is None:
                ids, reason = ids + [self.tokenizer.eos_token_id], FinishReason.EOS
            else:
                ids = ids[:cut]
            if len(ids) > cap:
                ids, reason = ids[:cap], FinishReason.LENGTH
            out.append(Completion(tuple(ids), self.tokenizer.decode(ids, skip_special_tokens=True),
                                  tuple(-0.5 for _ in ids), reason))
        return out

    def reseed(self, seed: int) -> None:
        self.seeds.append(seed)

    def update_weights(self, weights: Mapping | Iterable) -> None:
        """Nothing to update: the script is the policy."""

    def close(self) -> None:
        """Nothing to release."""


@dataclass
class ScriptedRetriever:
    """Returns `passages(query)` for each query; records every batched call."""

    passages: Callable[[str], list[Passage]]
    calls: list[list[str]] = field(default_factory=list)

    def search(self, queries: Sequence[str], topk: int = 3) -> list[list[Passage]]:
        self.calls.append(list(queries))
        return [self.passages(q)[:topk] if q else [] for q in queries]

    def close(self) -> None:
        """Nothing to release."""


def wiki(query: str) -> list[Passage]:
    """Two plausible passages about the query."""
    return [
        Passage.from_title_text("d1", f"About {query}", f"Some facts about {query}.", score=2.0),
        Passage.from_title_text("d2", "Other", "Unrelated text.", score=1.0),
    ]
