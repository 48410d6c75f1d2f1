"""The Hugging Face `generate` backend: the fallback engine, the GPU engine where vLLM is not installed,
and the reference in tests.

It re-runs the whole prompt (history included) every call, so multi-turn rollouts re-pay their history
each turn; vLLM's prefix cache does not. How it batches depends on where the model is:

- On the CPU, prompts are left-padded and run in micro-batches of similar length (`batch_size`, 16),
  because a CPU attention over a large padded batch runs out of memory long before it gains speed.
- On a GPU, every prompt of a call (all rollouts active in a turn) is one `generate` call: decoding is bound
  by reading the weights and the KV cache, and a larger batch reads the weights once for more tokens.
  Decoding steps of a grouped-query model use :mod:`eviback.generation.attention` (no copy of the KV cache
  per step), and the KV cache is `cache` (`dynamic` grows per step; `static` is allocated once per call),
  optionally compiled (`compile`, transformers' own compilation of the decoding step).

Stop strings are found on token ids (:mod:`eviback.generation.stops`: one table look-up per row per step,
on the model's device), never by decoding the batch; the ids are the same as decoding would stop at.

    backend = HFBackend.load("smollm2-135m")   # dtype and device auto: bf16 where native, the GPU if any
    [completion] = backend.generate([prompt_ids], SamplingConfig(max_tokens=64, temperature=0))
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessorList,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

from eviback.generation.attention import use_grouped_decode_attention
from eviback.generation.base import (
    HF_CACHES,
    Completion,
    FinishReason,
    SamplerRNG,
    SamplingConfig,
    iter_weights,
    request_caps,
)
from eviback.generation.stops import StopMatcher
from eviback.policy import load_model, load_tokenizer, torch_threads

log = logging.getLogger(__name__)


class _SampledLogprobs:
    """A logits processor, run last, that records the log-probability of each sampled token.

    At step t it sees the processed scores (B, V) of step t but not yet the token drawn from them; that
    token is the last input id at step t+1, so it keeps one step of log-softmax and gathers one step late
    (memory O(B x V), not O(steps x B x V) as `output_scores` would hold)."""

    def __init__(self) -> None:
        self.previous: torch.Tensor | None = None  # (B, V) log-softmax of the last step's scores
        self.steps: list[torch.Tensor] = []  # each (B,)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.previous is not None:
            self.steps.append(self.previous.gather(1, input_ids[:, -1:]).squeeze(1))
        self.previous = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, last_ids: torch.Tensor) -> torch.Tensor:
        """(B, steps) log-probabilities, given the ids sampled at the final step, shape (B,)."""
        if self.previous is not None:
            self.steps.append(self.previous.gather(1, last_ids[:, None]).squeeze(1))
            self.previous = None
        return torch.stack(self.steps, dim=1) if self.steps else torch.zeros(last_ids.shape[0], 0)


CPU_BATCH_SIZE = 16  # sequences per generate call on the CPU (a GPU takes a whole call at once)
CACHES = HF_CACHES


class HFBackend:
    """`transformers` generate behind the backend contract (see `eviback.generation.base`).

    Construct it around any causal LM (e.g. the trainer's own model, in which case `update_weights` is
    unnecessary: generation already uses the trained weights) or with :meth:`load`. Inputs go to the
    model's device.

    Args:
        batch_size: sequences per `generate` call; None: 16 on the CPU, every prompt of a call on a GPU.
        threads: torch threads while generating (None: the process's setting).
        cache: the KV cache: `dynamic` (grown by one position per step: each step copies it) or `static`
            (allocated once per call at its longest, written in place); `auto`: static on a GPU, dynamic on
            the CPU (results/gpu.md measures both).
        compile: with a static cache, let transformers compile the decoding step (each new batch shape
            compiles again: pays only when the shapes repeat).
        grouped_attention: None (default): the grouped decoding attention on a GPU for models with grouped
            queries (:mod:`eviback.generation.attention`), the model's own attention on the CPU.
    """

    name = "hf"

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, batch_size: int | None = None,
                 threads: int | None = None, *, cache: str = "auto", compile: bool = False, grouped_attention: bool | None = None) -> None:
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 (or None: 16 on the CPU, a whole call on a GPU), got {batch_size}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1 (or None for torch's setting), got {threads}")
        if cache not in CACHES:
            raise ValueError(f"cache must be one of {', '.join(CACHES)}, got {cache!r}")
        self.model = model
        self.threads = threads
        self.tokenizer = tokenizer
        self.accelerator = self.device.type != "cpu"
        self.batch_size = batch_size or (None if self.accelerator else CPU_BATCH_SIZE)
        if cache == "auto":
            cache = "static" if self.accelerator else "dynamic"
        if compile and cache != "static":
            raise ValueError("compile=True needs cache='static' (transformers compiles the step of a static cache)")
        self.cache = cache
        self.compile = compile
        if grouped_attention is None:
            grouped_attention = self.accelerator
        if grouped_attention:
            grouped_attention = use_grouped_decode_attention(model)
        self.grouped_attention = grouped_attention
        self.max_context = int(getattr(model.config, "max_position_embeddings", 4096))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos_ids = _eos_ids(model, tokenizer)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0]) if model.get_output_embeddings() is not None else None
        # On a GPU `generate` samples from the device's CUDA generator: its state is swapped too, so that
        # `reseed` reproduces a rollout there and the trainer's CUDA stream is left as it was.
        cuda_index = (self.device.index if self.device.index is not None else torch.cuda.current_device()) \
            if self.device.type == "cuda" else None
        self.rng = SamplerRNG(cuda_device=cuda_index)

    @property
    def device(self) -> torch.device:
        """Where the model is (and where its inputs go)."""
        return next(self.model.parameters()).device

    @classmethod
    def load(cls, model: str, dtype: str = "auto", threads: int | None = None, batch_size: int | None = None, *,
             device: str = "auto", **options: object) -> HFBackend:
        """Load `model` (see `eviback.policy`) on `device` (a setting or an `eviback.device.Placement`).
        `threads`: torch threads while generating, restored after each call (None: the process's setting). On
        a 2-core machine shared with other jobs, 1 thread was several times faster than 2 (OpenMP threads
        spin-waiting for a busy core). `options`: the constructor's keyword arguments."""
        return cls(load_model(model, dtype, device=device, what="policy engine (hf)"), load_tokenizer(model, dtype),
                   batch_size, threads, **options)  # type: ignore[arg-type]

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingConfig, max_tokens: Sequence[int] | None = None
    ) -> list[Completion]:
        """One Completion per prompt (prompts: token ids, each of shape (L_i,))."""
        caps = request_caps(len(prompts), params, max_tokens)
        if params.min_tokens and params.stop:
            raise ValueError("min_tokens > 0 is for fixed-length benchmark turns: pass stop=() with it")
        # Similar lengths share a micro-batch, so little compute goes to padding.
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        results: list[Completion | None] = [None] * len(prompts)
        size = self.batch_size or max(1, len(order))
        with torch_threads(self.threads), self.rng.active():
            for start in range(0, len(order), size):
                chunk = order[start : start + size]
                outs = self._generate_batch([prompts[i] for i in chunk], params, [caps[i] for i in chunk])
                for i, out in zip(chunk, outs, strict=True):
                    results[i] = out
        return [r for r in results if r is not None]

    @torch.no_grad()
    def _generate_batch(self, prompts: list[Sequence[int]], params: SamplingConfig, caps: list[int]) -> list[Completion]:
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
            attention[row, width - len(prompt) :] = 1
        input_ids, attention = input_ids.to(self.device), attention.to(self.device)
        # Temperature and top-p are applied by our own processors, ahead of the recorder, so that the
        # recorded log-probabilities are those of the distribution actually sampled from. The
        # GenerationConfig is built from scratch: a model's saved defaults (top_k=50, ...) must not leak in.
        recorder = _SampledLogprobs()
        processors = []
        if not params.greedy:
            processors.append(TemperatureLogitsWarper(params.temperature))
            if params.top_p < 1.0:
                processors.append(TopPLogitsWarper(params.top_p))
        processors.append(recorder)
        config = GenerationConfig(
            max_new_tokens=max(caps),
            min_new_tokens=params.min_tokens or None,
            do_sample=not params.greedy,
            num_beams=1,
            top_k=None,
            top_p=None,
            temperature=None,
            pad_token_id=self.pad_id,
            eos_token_id=list(self.eos_ids),
            cache_implementation="static" if self.cache == "static" else None,
            disable_compile=not self.compile,
        )
        matcher = self._matcher(params.stop)
        criteria = StoppingCriteriaList([_StopOnIds(matcher.device_table(self.device), matcher.matched)]
                                        if matcher is not None else [])
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            generation_config=config,
            logits_processor=LogitsProcessorList(processors),
            stopping_criteria=criteria,
        )
        new = out[:, width:]  # (B, steps)
        logprobs = recorder.finish(new[:, -1]) if new.shape[1] else torch.zeros(len(prompts), 0)
        new, logprobs = new.cpu(), logprobs.float().cpu()
        completions = []
        for row, cap in enumerate(caps):
            ids = new[row].tolist()[:cap]
            completions.append(self._finish(ids, logprobs[row].tolist()[: len(ids)], params, cap, matcher))
        return completions

    def _matcher(self, stops: Sequence[str]) -> StopMatcher | None:
        return StopMatcher.for_tokenizer(self.tokenizer, tuple(stops), self.vocab_size) if stops else None

    def _finish(self, ids: list[int], logprobs: list[float], params: SamplingConfig, cap: int,
                matcher: StopMatcher | None = None) -> Completion:
        """Cut one row's ids where the sequence really stopped (a finished row is padded with pad ids,
        which here equal EOS) and name the reason."""
        reason = FinishReason.LENGTH
        end = len(ids)
        eos_at = next((i for i, t in enumerate(ids) if t in self.eos_ids and i >= params.min_tokens), None)
        if eos_at is not None:
            end, reason = eos_at + 1, FinishReason.EOS
        cut = matcher.first_stop(ids[:end]) if matcher is not None else None
        if cut is not None:
            end, reason = cut, FinishReason.STOP
        if reason is FinishReason.LENGTH and end < cap:
            raise RuntimeError(f"generation ended after {end} of {cap} tokens without EOS or a stop string")
        ids = ids[:end]
        return Completion(
            token_ids=tuple(ids),
            text=self.tokenizer.decode(ids, skip_special_tokens=True),
            logprobs=tuple(logprobs[:end]) if params.logprobs else (),
            finish_reason=reason,
        )

    def reseed(self, seed: int) -> None:
        self.rng.reseed(seed)

    def update_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy named tensors into the model (names as in its `state_dict`)."""
        state = dict(iter_weights(weights))
        result = self.model.load_state_dict(state, strict=False)
        if result.unexpected_keys:
            raise ValueError(f"weights the model does not have: {result.unexpected_keys[:5]}")

    def sleep(self) -> None:
        """Nothing to release during the update: the model stays where it is (vLLM frees its memory)."""

    def wake(self) -> None:
        """Nothing to restore (see :meth:`sleep`)."""

    def close(self) -> None:
        """Nothing to release: the model is an ordinary Python object."""


class _StopOnIds:
    """A stopping criterion: each row's stop-string state advanced by the token it just sampled, one table
    look-up on the model's device (:class:`~eviback.generation.stops.StopMatcher`); a row stops once its state
    is the absorbing "matched" one."""

    def __init__(self, table: torch.Tensor, matched: int) -> None:
        self.table = table
        self.matched = matched
        self.state: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: object) -> torch.Tensor:
        last = input_ids[:, -1].clamp(0, self.table.shape[1] - 1)
        if self.state is None:
            self.state = torch.zeros(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
        self.state = self.table[self.state, last]
        return self.state == self.matched


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))
