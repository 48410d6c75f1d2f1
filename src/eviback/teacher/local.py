"""The local in-process backend: a transformers causal LM answering stage requests without a server.

The reply is built field by field inside a fixed JSON skeleton, so it always parses:

- a status field is chosen by comparing the model's likelihood of each allowed label as the continuation
  of `{"status": "` (the label plus its closing quote): it can never be malformed. At temperature 0 the most
  likely label wins; above 0 a label is drawn from the renormalised label distribution (seeded);
- a free-text field (answer, rationale) is decoded greedily (or sampled above temperature 0) until its
  closing quote, a newline or the token budget.

The prompt is prefilled once; every label and field continues from the same KV cache. Calls are serialised
with a lock (one model, one forward at a time); the judge's thread pool still overlaps them with other work.
This is the teacher of `eviback demo`: no server needed.

torch is imported by the methods that run the model: a teacher configuration (which every command naming a
teacher builds) does not load it.
"""

from __future__ import annotations

import copy
import hashlib
import json
import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from eviback import dtype as dtypes
from eviback.device import check_device, place
from eviback.policy import DEFAULT_MODEL, load_model, load_tokenizer, set_threads
from eviback.settings import check_fields
from eviback.teacher.chat import ChatReply, ChatRequest, PermanentError
from eviback.teacher.policy import OutputField

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass(frozen=True)
class LocalBackendConfig:
    """Which model the local backend loads."""

    model: str = DEFAULT_MODEL  # a bundled name or a local Hugging Face checkpoint directory
    dtype: str = "auto"  # auto: bf16 where the device computes it natively, else fp32 (eviback.dtype)
    # torch intra-op threads, process-wide; None leaves torch's setting. On a busy small machine 1 can be an
    # order of magnitude faster than 2 (OpenMP threads spinning against other processes).
    threads: int | None = None
    # where the model computes: auto (the local GPU when there is one, else the CPU), cpu, cuda or cuda:N
    # (eviback.device); the reply does not depend on it beyond the arithmetic of the device's kernels
    device: str = "auto"

    def __post_init__(self) -> None:
        check_fields(self)  # types first: the checks below compare numbers
        check_device(self.device, what="local teacher device")
        dtypes.check(self.dtype, what="local teacher dtype")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"local teacher threads (the --threads option) must be >= 1, or None to leave torch's "
                             f"setting, got {self.threads}")


# Upper bound on the tokens of one field's JSON skeleton (`{"status": "`, the label, the closing quote).
_SKELETON_TOKENS_PER_FIELD = 16


class LocalClient:
    """A :class:`~eviback.teacher.chat.TeacherClient` on an in-process transformers model.

    Pass `model` and `tokenizer` to share an already loaded model (e.g. with a trainer); otherwise they are
    loaded from `config`, onto `config.device`. Every tensor given to the model is put where the model is."""

    in_process = True  # a Teacher runs it in the calling thread (Teacher.in_process)

    def __init__(self, config: LocalBackendConfig = LocalBackendConfig(), *, model: PreTrainedModel | None = None,
                 tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        placement = place(config.device, config.dtype)  # the dtype `auto` means on the device it runs on
        self.config = config = replace(config, dtype=placement.dtype)
        set_threads(config.threads)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model, config.dtype)
        self.model = model if model is not None else load_model(config.model, config.dtype, config.threads,
                                                                device=placement, what="local teacher")
        self._lock = threading.Lock()

    @property
    def backend_id(self) -> str:
        return f"local:{self.config.model}:{self.config.dtype}"

    def close(self) -> None:
        pass

    # ----------------------------------------------------------------------------------------------

    def _prompt_ids(self, request: ChatRequest) -> list[int]:
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    @property
    def context_tokens(self) -> int | None:
        """The model's context length (None when its config does not say)."""
        value = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        return int(value) if isinstance(value, int) else None

    def complete(self, request: ChatRequest) -> ChatReply:
        """The reply to `request`. Only a request that cannot succeed as it is (a prompt that, with the reply
        budget, does not fit the model's context: checked before running) is a :class:`PermanentError`, so a
        teacher error. Anything else the model raises (out of memory, a bug) propagates: it stops the run
        instead of being counted as a teacher error while training goes on."""
        start = time.perf_counter()
        prompt_ids = self._prompt_ids(request)
        limit = self.context_tokens
        # the reply: the field budget, plus the JSON skeleton and labels around each field
        needed = len(prompt_ids) + request.decoding.max_tokens + _SKELETON_TOKENS_PER_FIELD * len(request.schema.fields)
        if limit is not None and needed > limit:
            raise PermanentError(
                f"stage {request.stage!r}: the prompt has {len(prompt_ids)} tokens and the reply may take "
                f"{needed - len(prompt_ids)}, more than the local model's context of {limit} tokens; shorten the "
                f"evidence (a lower max_obs_tokens or topk) or use a model with a longer context")
        return self._complete(request, prompt_ids, start)

    def _complete(self, request: ChatRequest, prompt_ids: list[int], start: float) -> ChatReply:
        import torch

        with self._lock, torch.inference_mode():
            # sampling draws on the CPU (the logits are brought there): the same seed gives the same reply on
            # every device
            generator = torch.Generator().manual_seed(self._seed(request))
            state = _Continuation(self.model, prompt_ids)
            prompt_tokens = len(state.ids)
            values: dict[str, str] = {}
            budget = request.decoding.max_tokens
            for index, f in enumerate(request.schema.fields):
                opener = ("{" if index == 0 else ", ") + json.dumps(f.value) + ': "'
                state.extend(self._encode(opener))
                if f is OutputField.STATUS:
                    labels = [s.value for s in request.schema.statuses]
                    choice = self._choose(state, labels, request.decoding.temperature, generator)
                    values[f.value] = labels[choice]
                    state.extend(self._encode(labels[choice] + '"'))
                else:
                    text, used = self._generate(state, budget, request.decoding.temperature, generator)
                    budget = max(1, budget - used)
                    values[f.value] = text
                    state.extend(self._encode('"'))
            completion_tokens = len(state.ids) - prompt_tokens
        return ChatReply(text=json.dumps(values, ensure_ascii=False), prompt_tokens=prompt_tokens,
                         completion_tokens=completion_tokens, latency_s=time.perf_counter() - start)

    @staticmethod
    def _seed(request: ChatRequest) -> int:
        base = request.seed if request.seed is not None else request.sample_index
        digest = hashlib.sha256(request.canonical_json().encode()).digest()
        return (int.from_bytes(digest[:4], "little") + base) % (2**31)

    def _choose(self, state: _Continuation, labels: list[str], temperature: float,
                generator: torch.Generator) -> int:
        import torch

        scores = torch.tensor([state.logprob(self._encode(label + '"')) for label in labels])
        if temperature == 0:
            return int(scores.argmax())
        probs = torch.softmax(scores / temperature, dim=0)
        return int(torch.multinomial(probs, 1, generator=generator))

    def _generate(self, state: _Continuation, budget: int, temperature: float,
                  generator: torch.Generator) -> tuple[str, int]:
        import torch

        eos = self.tokenizer.eos_token_id
        produced: list[int] = []
        for _ in range(budget):
            logits = state.next_logits().float().cpu()  # the seeded generator is a CPU one
            if temperature == 0:
                token = int(logits.argmax())
            else:
                token = int(torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=generator))
            if token == eos:
                break
            text = self.tokenizer.decode(produced + [token])
            cut = min((i for i in (text.find('"'), text.find("\n")) if i != -1), default=-1)
            if cut != -1:
                # The field ends at its closing quote (or a newline). The token holding it may carry other
                # characters too: keep those by re-encoding them, drop the token itself.
                text = text[:cut]
                before = self.tokenizer.decode(produced)
                if text.startswith(before) and len(text) > len(before):
                    state.extend(self._encode(text[len(before):]))
                return text.rstrip("\\").strip(), len(produced) + 1
            produced.append(token)
            state.extend([token])
        return self.tokenizer.decode(produced).strip(), len(produced)


class _Continuation:
    """A token sequence with its KV cache, extendable, for scoring and greedy decoding. The ids run through
    the model are put on the model's device."""

    def __init__(self, model: PreTrainedModel, prompt_ids: list[int]) -> None:
        self.model = model
        self.device = getattr(model, "device", None)  # a transformers model's; None: torch's default (a fake)
        self.ids: list[int] = list(prompt_ids)
        out = model(self._tensor(self.ids), use_cache=True)
        self.cache = out.past_key_values
        self._last_logits = out.logits[0, -1]
        self._pending: list[int] = []  # appended ids not yet run through the model

    def _tensor(self, ids: list[int]) -> torch.Tensor:
        """`ids` as a (1, len(ids)) LongTensor on the model's device."""
        import torch

        return torch.tensor([ids], device=self.device)

    def extend(self, ids: list[int]) -> None:
        self.ids.extend(ids)
        self._pending.extend(ids)

    def _flush(self) -> None:
        if self._pending:
            out = self.model(self._tensor(self._pending), past_key_values=self.cache, use_cache=True)
            self.cache = out.past_key_values
            self._last_logits = out.logits[0, -1]
            self._pending = []

    def next_logits(self) -> torch.Tensor:
        """The (vocab,) logits of the next token."""
        self._flush()
        return self._last_logits

    def logprob(self, continuation: list[int]) -> float:
        """Log-likelihood of `continuation` after the current sequence (the cache is left unchanged)."""
        import torch

        self._flush()
        total = float(torch.log_softmax(self._last_logits.float(), -1)[continuation[0]])
        if len(continuation) > 1:
            out = self.model(self._tensor(continuation[:-1]), past_key_values=copy.deepcopy(self.cache),
                             use_cache=True)
            logprobs = torch.log_softmax(out.logits[0].float(), -1)
            total += float(sum(logprobs[i, t] for i, t in enumerate(continuation[1:])))
        return total
