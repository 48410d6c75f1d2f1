"""The generation-backend contract: token ids in, sampled token ids (with their log-probabilities) out.

Every backend (vLLM, HF `generate`) takes a batch of prompts as *token ids* and returns, per prompt, the
exact ids it sampled. The rollout engine never decodes the model's text and re-encodes it: it continues
the next turn from `prompt ids + response ids so far`, so the ids a trainer sees are the ids that were
sampled, and their log-probabilities belong to them.

Stop strings follow vLLM's rule on both backends: generation stops after the first token whose decoded
text completes a stop string. That token may carry a few characters past the stop string (e.g. a token
`>.` completing `</answer>`); the ids are kept as sampled, and `Completion.text` is their decoding.

torch is imported by the functions that use it: the contract and its records are read by every module that
handles rollouts, most of which never load a model.
"""

from __future__ import annotations

import contextlib
import enum
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from eviback.protocol import STOP_STRINGS
from eviback.settings import check_fields

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

# The choices of the engines' settings, here (no torch) so that a BackendConfig checks them when it is built
EXECUTORS = ("inprocess", "multiprocess", "external_launcher")  # how a vLLM engine runs (VllmConfig.executor)
HF_CACHES = ("auto", "dynamic", "static")  # the KV cache of the HF backend (BackendConfig.hf_cache)
SLEEP_LEVELS = (1, 2)  # what a sleeping vLLM engine on a GPU gives back (VllmConfig.sleep_level)


class FinishReason(enum.StrEnum):
    """Why one sequence of a `generate` call stopped."""

    STOP = "stop"  # a stop string was completed (its token is the last id)
    EOS = "eos"  # the model sampled its end-of-sequence token (kept as the last id)
    LENGTH = "length"  # the token cap of the request was reached


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample one turn. Temperature 0 means greedy decoding."""

    max_tokens: int = field(default=500, metadata={"help": "cap on new tokens per sequence (Search-R1: 500 per turn)"})
    temperature: float = field(default=1.0, metadata={"help": "0 for greedy; Search-R1 trains at 1.0"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling mass (1.0: off)"})
    stop: tuple[str, ...] = field(default=STOP_STRINGS, metadata={"help": "stop after the token completing one of these"})
    min_tokens: int = field(default=0, metadata={"help": "no EOS or stop string before this many tokens (benchmarks)"})
    logprobs: bool = field(default=True, metadata={"help": "return the log-probability of every sampled token"})

    def __post_init__(self) -> None:
        check_fields(self)  # types first: the checks below compare numbers
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}; use 1.0 to turn nucleus sampling off")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class Completion:
    """What one prompt of a `generate` call produced.

    `token_ids`: the sampled ids, shape (n,), ending with the stop-string token or EOS when one stopped it.
    `logprobs`: shape (n,), log-probability of each sampled id under the distribution it was sampled from
    (after temperature and top-p, as TRL computes them; for greedy decoding the model's own distribution);
    empty when the request asked for none. `text`: `token_ids` decoded without special tokens."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[float, ...]
    finish_reason: FinishReason
    cached_prompt_tokens: int = 0  # prompt tokens served from a prefix cache (vLLM), not recomputed


@runtime_checkable
class GenerationBackend(Protocol):
    """A policy that continues batches of token-id prompts.

    Contract: `generate(prompts, params, max_tokens)` returns one Completion per prompt, in order;
    `max_tokens`, when given, overrides `params.max_tokens` per prompt. `reseed(seed)` makes the following
    calls reproducible (the same prompts in the same order give the same samples) and never touches the
    process's global RNG (see :class:`SamplerRNG`). `update_weights`
    loads new policy weights without restarting the engine and invalidates any cache computed with the
    old ones. `max_context` is the longest prompt + completion the backend accepts.

    Optional (call them through :func:`sleep_backend` / :func:`wake_backend`, which skip a backend without
    them): `sleep()` frees the accelerator memory the engine holds between rollouts (its KV cache, and
    its weights where the engine can take them back from the next `update_weights`), so that a trainer
    sharing the GPU can use it for its update; `wake()` makes the engine ready to generate again and
    drops any prefix cache. A training step calls them in this order:

        rollouts (generate ...) -> sleep() -> optimiser step -> update_weights(new) -> wake() -> rollouts

    Both are idempotent, and no-ops where there is nothing to free (the CPU, an engine without sleep
    mode). A sleeping engine's `update_weights` wakes only the weights it loads into, so the KV cache
    comes back after the new weights are in (no peak with both); `generate` on a sleeping engine wakes
    it itself. An engine that discarded its weights in `sleep()` refuses to `generate` until
    `update_weights` has given it new ones."""

    name: str
    tokenizer: object
    max_context: int

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingConfig, max_tokens: Sequence[int] | None = None
    ) -> list[Completion]: ...

    def reseed(self, seed: int) -> None: ...

    def update_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def close(self) -> None: ...


class SamplerRNG:
    """The random stream a backend samples from, kept apart from the process's global torch RNG.

    In-process engines (vLLM's CPU sampler, HF `generate`) draw from torch's default generator; on a CUDA
    device they draw from that device's default CUDA generator. A trainer sharing the process draws from
    them too (data order, dropout), so a backend that called `torch.manual_seed` on every rollout would
    reset the trainer's stream each step. Instead, the backend's own state is swapped in for the duration
    of each `generate` call (:meth:`active`) and swapped out after it: the global stream continues
    exactly as if no rollout had happened, and `reseed(seed)` makes the following calls reproducible.

    `cuda_device` (an index) adds that GPU's default generator to the swapped state, for an engine that
    samples on it; None: the CPU generator only."""

    def __init__(self, seed: int = 0, cuda_device: int | None = None) -> None:
        self._state = None
        self._cuda_state = None
        self.cuda_device = cuda_device
        self.reseed(seed)

    def reseed(self, seed: int) -> None:
        import torch

        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self._state = torch.get_rng_state()
        torch.set_rng_state(saved)
        if self.cuda_device is not None:
            self._cuda_state = self._fresh_cuda_state(seed)

    def _fresh_cuda_state(self, seed: int) -> torch.Tensor:
        """The state (a ByteTensor) of a CUDA generator seeded with `seed`, made on a generator of its own (the
        device's default generator is not touched)."""
        import torch

        return torch.Generator(device=f"cuda:{self.cuda_device}").manual_seed(seed).get_state()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Sample from this stream inside the block; the global RNG state is restored after it."""
        import torch

        saved = torch.get_rng_state()
        torch.set_rng_state(self._state)
        cuda = self.cuda_device
        if cuda is not None:
            saved_cuda = torch.cuda.get_rng_state(cuda)
            torch.cuda.set_rng_state(self._cuda_state, cuda)
        try:
            yield
        finally:
            if cuda is not None:
                self._cuda_state = torch.cuda.get_rng_state(cuda)
                torch.cuda.set_rng_state(saved_cuda, cuda)
            self._state = torch.get_rng_state()
            torch.set_rng_state(saved)


def sleep_backend(backend: object) -> None:
    """Put `backend` to sleep (free its accelerator memory until the next rollout) if it can sleep; a
    backend without `sleep()` is left as it is. See :class:`GenerationBackend` for the order of calls."""
    sleep = getattr(backend, "sleep", None)
    if callable(sleep):
        sleep()


def wake_backend(backend: object) -> None:
    """Make `backend` ready to generate (after :func:`sleep_backend` and the weight push) if it can sleep;
    a backend without `wake()` is left as it is."""
    wake = getattr(backend, "wake", None)
    if callable(wake):
        wake()


def push_weights(backend: object, model: Any, processes: Any, *, device: str | None = None) -> None:
    """Push `model`'s parameters into `backend`. One engine shared by every process (`backend.shared`: a policy
    server) is pushed by the main process alone while the others wait; a process's own engine is pushed by
    that process. `processes`: accelerate's Accelerator or PartialState (`is_main_process`,
    `wait_for_everyone`). `device`: stage each tensor there on its way (one at a time, never the whole model),
    for a model still on the CPU whose engine takes weights from a GPU (the policy server's NCCL push)."""
    if getattr(backend, "shared", False):
        if processes.is_main_process:
            backend.update_weights(staged_parameters(model, device))  # type: ignore[attr-defined]
        processes.wait_for_everyone()
    else:
        backend.update_weights(staged_parameters(model, device))  # type: ignore[attr-defined]


def staged_parameters(model: Any, device: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """`model`'s named parameters, detached, each moved to `device` as it is read (None: where they are)."""
    for name, parameter in model.named_parameters():
        tensor = parameter.detach()
        yield name, (tensor if device is None else tensor.to(device))


def iter_weights(
    weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a state dict or of an iterable of pairs, names in Hugging Face checkpoint
    form (`model.layers.0.self_attn.q_proj.weight`, as `model.named_parameters()` gives them)."""
    return weights.items() if isinstance(weights, Mapping) else weights


def check_prompt_lengths(prompts: Sequence[Sequence[int]], max_context: int, engine: str) -> None:
    """Refuse a call with a prompt that leaves no room to generate in `max_context` (the engine's longest
    prompt + completion; `engine` names where that limit comes from, e.g. "max_model_len=4096")."""
    too_long = [len(p) for p in prompts if len(p) >= max_context]
    if too_long:
        raise ValueError(f"a prompt of {max(too_long)} tokens does not fit {engine}")


def vllm_finish_reason(finish: str | None, stop_reason: object) -> FinishReason:
    """The FinishReason of a vLLM output (in-process or served: the same engine), from its `finish_reason` and
    `stop_reason` (a string: the stop string that ended it; None or a token id: EOS). Raises ValueError for
    anything else (an aborted request)."""
    if finish == "length":
        return FinishReason.LENGTH
    if finish == "stop":
        return FinishReason.STOP if isinstance(stop_reason, str) else FinishReason.EOS
    raise ValueError(f"vLLM ended a request with finish_reason={finish!r}")


def request_caps(count: int, params: SamplingConfig, max_tokens: Sequence[int] | None) -> list[int]:
    """The per-prompt token caps of a call, validated."""
    if max_tokens is None:
        return [params.max_tokens] * count
    if len(max_tokens) != count:
        raise ValueError(f"max_tokens has {len(max_tokens)} entries for {count} prompts")
    if any(m < 1 for m in max_tokens):
        raise ValueError(f"every per-prompt max_tokens must be >= 1, got {min(max_tokens)}")
    return list(max_tokens)


def stop_cut(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], stops: Sequence[str]) -> int | None:
    """The number of leading ids up to and including the first token whose decoded text completes one
    of `stops`, or None when no stop string occurs. Binary search over prefix decodings: a prefix that
    contains a stop string stays containing it when extended."""
    if not stops or not ids:
        return None

    def contains(n: int) -> bool:
        text = tokenizer.decode(ids[:n], skip_special_tokens=False)
        return any(s in text for s in stops)

    if not contains(len(ids)):
        return None
    lo, hi = 1, len(ids)  # invariant: contains(hi) is True
    while lo < hi:
        mid = (lo + hi) // 2
        if contains(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo
