"""The Hugging Face `generate` backend: the fallback engine, the GPU engine where vLLM is not installed,
and the reference in tests.

It re-runs the whole prompt (history included) every call, so multi-turn rollouts re-pay their history
each turn; vLLM's prefix cache does not. How it batches depends on where the model is:

- On the CPU, prompts are left-padded and run in micro-batches of similar length (`batch_size`, 16),
  because a CPU attention over a large padded batch runs out of memory long before it gains speed.
- On a GPU, the prompts of a call (all rollouts active in a turn) go in as few `generate` calls as the memory
  free for their KV cache holds (:func:`eviback.generation.memory.hf_rows_per_call`; one call when it all
  fits): decoding is bound by reading the weights and the KV cache, and a larger batch reads the weights once
  for more tokens.
  Decoding steps of a grouped-query model use :mod:`eviback.generation.attention` (no copy of the KV cache
  per step), and the KV cache is `cache` (`dynamic` grows per step; `static` is allocated once per call),
  optionally compiled (`compile`, transformers' own compilation of the decoding step).

Sampling is eviback's own (:class:`TokenSampler`, the last logits processor): transformers decodes greedily
over scores that single out the token the sampler drew, so none of the model's generation defaults
(`top_k=50` from transformers, `top_k=20, top_p=0.95` from a Qwen3 checkpoint) truncate the distribution, and
the recorded log-probability of each token is `log_softmax(logits / temperature)` (after top-p when asked),
the trainer's own. A model whose generation defaults would add another processor is refused.

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
)

from eviback import device as devices
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
from eviback.generation.memory import GIB, ModelShape, even_batches, hf_rows_per_call
from eviback.generation.stops import StopMatcher
from eviback.policy import load_model, load_tokenizer, torch_threads

log = logging.getLogger(__name__)


class TokenSampler:
    """The logits processor that samples each step's token itself, and records its log-probability.

    transformers' own sampling reads its settings from the call's GenerationConfig with every unset field
    filled from the model's `generation_config.json` and then from its global defaults (`top_k=50`), and runs
    its warpers after any processor given to `generate`: a model that ships `top_k=20, top_p=0.95` (Qwen3)
    would be sampled from 20 tokens while the recorded log-probabilities described all of them. So `generate`
    runs greedy (no warper at all: transformers' sampling branch never runs), and this processor, last in the
    list, applies the temperature and top-p of :class:`SamplingConfig`, records the log-probability of the
    token it draws under that distribution, and returns scores whose arg-max is that token. The recorded
    log-probability is exactly `log_softmax(logits / temperature)` at the drawn token (after top-p when asked),
    what the trainer computes. It draws from torch's default generator of the scores' device (the backend's
    own stream, :class:`~eviback.generation.base.SamplerRNG`). Greedy decoding records the model's own
    distribution at its arg-max."""

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0) -> None:
        self.temperature = temperature
        self.top_p = top_p
        self.steps: list[torch.Tensor] = []  # each (B,): the drawn tokens' log-probabilities

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logits = scores.float()
        if self.temperature > 0:
            logits = logits / self.temperature
            if self.top_p < 1.0:
                logits = top_p_filter(logits, self.top_p)
        logp = torch.log_softmax(logits, dim=-1)  # (B, V)
        if self.temperature > 0:
            token = torch.multinomial(logp.exp(), 1)  # (B, 1)
        else:
            token = logp.argmax(dim=-1, keepdim=True)
        self.steps.append(logp.gather(1, token).squeeze(1))
        return torch.full_like(scores, float("-inf")).scatter_(1, token, 0.0)

    def logprobs(self, rows: int, device: torch.device) -> torch.Tensor:
        """(B, steps) log-probabilities of the drawn tokens."""
        if not self.steps:
            return torch.zeros(rows, 0, device=device)
        return torch.stack(self.steps, dim=1)


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """`logits` (B, V) with every token outside the smallest set whose probability reaches `top_p` at -inf
    (the most likely token always stays), as vLLM and TRL define nucleus sampling."""
    ordered, order = logits.sort(dim=-1, descending=True)
    mass_before = ordered.softmax(dim=-1).cumsum(dim=-1) - ordered.softmax(dim=-1)
    ordered = ordered.masked_fill(mass_before >= top_p, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, ordered)


def generation_config(params: SamplingConfig, *, max_new_tokens: int, pad_token_id: int,
                      eos_token_id: Sequence[int], cache: str = "dynamic", compile: bool = False) -> GenerationConfig:
    """The GenerationConfig of one HF `generate` call of the backend: greedy as far as transformers knows
    (:class:`TokenSampler` samples), with every field that would add a logits processor set to its neutral
    value, so that nothing of the model's own generation defaults (repetition penalty, n-gram blocking, ...)
    changes the distribution sampled from. Temperature, top-k and top-p are left unset: transformers reads them
    only when it samples, and it does not."""
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        # min_new_tokens=0 would still run a minimum-length processor (transformers adds the prompt's length to
        # it); no minimum is min_length=0, which also keeps a model's own minimum out
        **({"min_new_tokens": params.min_tokens} if params.min_tokens else {"min_length": 0}),
        do_sample=False,
        num_beams=1,
        num_return_sequences=1,
        repetition_penalty=1.0,
        encoder_repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        encoder_no_repeat_ngram_size=0,
        renormalize_logits=False,
        remove_invalid_values=False,
        pad_token_id=pad_token_id,
        eos_token_id=list(eos_token_id),
        cache_implementation="static" if cache == "static" else None,
        disable_compile=not compile,
    )


def effective_logits_processors(model: PreTrainedModel, config: GenerationConfig, own: Sequence[object],
                                prompt_length: int = 1) -> list[object]:
    """The logits processors transformers would run for `model.generate(generation_config=config,
    logits_processor=own)` on prompts of `prompt_length` tokens: the steps of `generate` that decide them (the
    model's generation defaults merged in, the special tokens, the lengths), through private API of the pinned
    transformers (tests/test_api_conformance.py keeps it honest)."""
    prompt = torch.zeros(1, prompt_length, dtype=torch.long, device="cpu")
    has_default_max = config.max_length is None and model.generation_config.max_length is None
    has_default_min = config.min_length is None and model.generation_config.min_length is None
    effective, _ = model._prepare_generation_config(config)
    model._prepare_special_tokens(effective, True, device=prompt.device, batch_size=1)
    effective = model._prepare_generated_length(
        generation_config=effective, has_default_max_length=has_default_max, has_default_min_length=has_default_min,
        model_input_name="input_ids", input_ids_length=prompt_length, inputs_tensor=prompt)
    return list(model._get_logits_processor(generation_config=effective, input_ids_seq_length=prompt_length,
                                            encoder_input_ids=prompt, logits_processor=LogitsProcessorList(own),
                                            device=prompt.device))


def check_sampling_is_ours(model: PreTrainedModel, config: GenerationConfig) -> None:
    """Refuse a model whose generation defaults would change the distribution the backend samples from (a
    processor transformers adds beside :class:`TokenSampler`), naming the processors and where they come from:
    the recorded log-probabilities would no longer be those of the trainer's distribution."""
    sampler = TokenSampler()
    extra = [p for p in effective_logits_processors(model, config, [sampler]) if p is not sampler]
    if extra:
        names = ", ".join(type(p).__name__ for p in extra)
        raise ValueError(f"the model's generation defaults add logits processors ({names}) that would change the "
                         "distribution rollouts are sampled from, and the log-probabilities the trainer compares "
                         "with: remove those fields from the model's generation_config.json (eviback sets "
                         "temperature and top_p itself)")


CPU_BATCH_SIZE = 16  # sequences per generate call on the CPU (a GPU takes as many as its memory holds)
CACHES = HF_CACHES


class HFBackend:
    """`transformers` generate behind the backend contract (see `eviback.generation.base`).

    Construct it around any causal LM (e.g. the trainer's own model, in which case `update_weights` is
    unnecessary: generation already uses the trained weights) or with :meth:`load`. Inputs go to the
    model's device.

    Args:
        batch_size: sequences per `generate` call; None: 16 on the CPU, on a GPU as few calls as its free memory
            holds.
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
        self.shape = ModelShape.from_config(model.config)
        self._sampling_checked = False

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
        if not prompts:
            return []
        self._check_sampling()
        # Similar lengths share a call, so little compute and cache go to padding.
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        results: list[Completion | None] = [None] * len(prompts)
        with torch_threads(self.threads), self.rng.active():
            start = 0
            for size in self._call_sizes([len(p) for p in prompts], caps):
                chunk = order[start : start + size]
                start += size
                outs = self._generate_batch([prompts[i] for i in chunk], params, [caps[i] for i in chunk])
                for i, out in zip(chunk, outs, strict=True):
                    results[i] = out
        return [r for r in results if r is not None]

    def _call_sizes(self, lengths: list[int], caps: list[int]) -> list[int]:
        """Rows per `generate` call, in the order of ascending prompt length: `batch_size` each when set (16 on
        the CPU); on a GPU as few calls as the memory free for their KV cache holds
        (:func:`~eviback.generation.memory.hf_rows_per_call`: every row's cache is its padded prompt + its cap,
        so 256 rows late in a 4k-token rollout of a 0.6B model would ask for about 100 GiB)."""
        if self.batch_size is not None:
            return _fixed_batches(len(lengths), self.batch_size)
        if not self.accelerator:  # batch_size=None asked for on the CPU: one call (tests of the GPU path do)
            return [len(lengths)]
        free, _ = devices.memory(str(self.device))
        most = hf_rows_per_call(rows=len(lengths), width=max(lengths), cap=max(caps), free_bytes=free, shape=self.shape,
                                dtype_bytes=self.model.dtype.itemsize)
        if most < len(lengths):
            log.debug("hf engine: %d rows in calls of at most %d (%.1f GiB free for their cache)", len(lengths), most,
                      free / GIB)
        return even_batches(len(lengths), most)

    def _check_sampling(self) -> None:
        """Once per backend: the model's generation defaults add nothing to the distribution sampled from."""
        if not self._sampling_checked:
            check_sampling_is_ours(self.model, generation_config(SamplingConfig(), max_new_tokens=1,
                                                                 pad_token_id=self.pad_id, eos_token_id=self.eos_ids))
            self._sampling_checked = True

    @torch.no_grad()
    def _generate_batch(self, prompts: list[Sequence[int]], params: SamplingConfig, caps: list[int]) -> list[Completion]:
        input_ids, attention = left_padded(prompts, self.pad_id, self.device)
        width = input_ids.shape[1]
        sampler = TokenSampler(params.temperature, params.top_p)
        config = generation_config(params, max_new_tokens=max(caps), pad_token_id=self.pad_id,
                                   eos_token_id=self.eos_ids, cache=self.cache, compile=self.compile)
        matcher = self._matcher(params.stop)
        criteria = StoppingCriteriaList([_StopOnIds(matcher.device_table(self.device), matcher.matched)]
                                        if matcher is not None else [])
        if not self.compile:
            # transformers sizes a static cache at the longest any earlier call asked for (to spare recompiles):
            # without compilation that only holds memory, so each call is sized for itself.
            self.model._previous_max_cache_length = -1
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            generation_config=config,
            logits_processor=LogitsProcessorList([sampler]),
            stopping_criteria=criteria,
        )
        new = out[:, width:]  # (B, steps)
        logprobs = sampler.logprobs(len(prompts), new.device)
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


def left_padded(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both (B, longest) long on `device`: the prompts left-padded with `pad_id`.
    Built on the host and sent in one copy each (a row at a time on a GPU would be a transfer a row)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device="cpu")
    attention = torch.zeros((len(prompts), width), dtype=torch.long, device="cpu")
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long, device="cpu")
        attention[row, width - len(prompt) :] = 1
    return input_ids.to(device), attention.to(device)


def _fixed_batches(count: int, size: int) -> list[int]:
    """`count` rows in calls of `size` (the last takes the rest)."""
    return [min(size, count - start) for start in range(0, count, size)]


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))
