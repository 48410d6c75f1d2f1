"""The controller LLM that proposes candidate workflows, and what it is shown.

The controller is any chat model: an OpenAI-compatible endpoint (`OpenAIChatClient` with structured output
off: the reply is free JSON text) or the local in-process model (:class:`LocalChatClient`: free-text
generation, not the teacher's fixed JSON skeleton). :class:`Controller` builds the prompt, asks for one
reply per proposal slot (seeded, so a re-run asks the same), caches the replies like teacher calls (a resumed
run never pays for a proposal twice), and returns the raw text; :func:`~eviback.ape.candidates.parse_proposal`
turns it into a policy or a recorded rejection.

What the controller sees of the training failures is built from :func:`~eviback.teacher.workflow.blind_view`
only (question text, retrieved passages, the actor's answer), plus the judge's status and the sufficiency
label: never the gold answers, so a proposal can never be tuned on them for Stage A.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from eviback.device import place
from eviback.policy import DEFAULT_MODEL, load_model, load_tokenizer
from eviback.settings import check_fields
from eviback.teacher.cache import ReplyCache
from eviback.teacher.chat import ChatMessage, ChatReply, ChatRequest, ReplySchema, TeacherClient
from eviback.teacher.policy import Decoding, TeacherPolicy
from eviback.teacher.workflow import BlindView
from eviback.types import Status, to_dict

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

CONTROLLER_STAGE = "controller"  # the `stage` name of controller requests (accounting and the cache)
EXCERPT_CHARS = 400


@dataclass(frozen=True)
class FailureExample:
    """A training rollout the parent judged against its sufficiency label, in gold-free form."""

    question: str
    evidence: str  # the retrieved passages as Stage A saw them (truncated)
    answer: str
    said: Status
    expected: Status  # S when the actor retrieved every gold passage, else I

    @classmethod
    def of(cls, view: BlindView, said: Status, sufficient: bool) -> FailureExample:
        values = view.values()  # a BlindView has no field that could hold gold answers
        evidence = values["evidence"]
        if len(evidence) > EXCERPT_CHARS:
            evidence = evidence[:EXCERPT_CHARS].rstrip() + " ..."
        return cls(values["question"], evidence, values["answer"], said,
                   Status.SUFFICIENT if sufficient else Status.INSUFFICIENT)


@dataclass(frozen=True)
class ParentSummary:
    """What the controller is told about the parent's results on the training feedback rollouts."""

    rollouts: int
    labelled: int
    balanced_agreement: float | None
    said_s_on_insufficient: int
    said_i_on_sufficient: int
    status_counts: tuple[tuple[str, int], ...]


EXAMPLE_TEXTS = ("...", "... $question ... $evidence ...")  # the prompt's example: a reply copying it proposes nothing
SYSTEM = ("You improve the prompts of an automatic judge. You reply with one JSON object and nothing else.")


def _workflow_json(policy: TeacherPolicy) -> str:
    stages = []
    for s in policy.stages:
        d = to_dict(s)
        stages.append({k: d[k] for k in ("name", "sees", "system_prompt", "user_template", "outputs", "statuses",
                                         "run_on")})
    return json.dumps({"stages": stages}, indent=1, ensure_ascii=False)


def _full_workflow_json(policy: TeacherPolicy) -> str:
    """The whole workflow IR: every stage (what it sees, prompts, output schema, labels, gate, decoding) and
    the reward weights."""
    d = to_dict(policy)
    stages = [{k: v for k, v in st.items() if k != "backend" or v} for st in d["stages"]]
    return json.dumps({"name": d["name"], "stages": stages, "weights": d["weights"]}, indent=1, ensure_ascii=False)


WORKFLOW_RULES = (
    "A workflow is a list of stages run in order. Each stage: name; sees (a subset of question, evidence, answer, "
    "gold); system_prompt and user_template (templates using $question, $evidence, $answer, $gold, only for "
    "inputs the stage sees; write a literal dollar sign as $$); outputs (a subset of status, answer, rationale); "
    "statuses (the labels S, A, I it may give); run_on (the first stage: []; a later stage runs only on the "
    "statuses listed, never on I: an I verdict is final); decoding (temperature, top_p, max_tokens, seed). The "
    "first stage decides the status: it must never see gold and its user_template must contain $question and "
    "$evidence. weights: the reward per status (insufficient must stay 0).")


def controller_messages(parent: TeacherPolicy, summary: ParentSummary, failures: Sequence[FailureExample], *,
                        whole_workflow: bool = False) -> tuple[ChatMessage, ...]:
    """The controller's prompt: the parent workflow, its results, a few gold-free failures, the rules.

    `whole_workflow` (a capable controller): it is shown the whole workflow IR and asked for a complete
    candidate (stages, what each sees, instructions, output schema, decoding, gating rule, reward weights);
    otherwise (a small model filling a skeleton) it is shown the prompts and asked for a patch of Stage A."""
    status = ", ".join(f"{k}={v}" for k, v in summary.status_counts)
    agreement = "n/a" if summary.balanced_agreement is None else f"{summary.balanced_agreement:.2f}"
    lines = [
        "A judge reads a question and the passages a search agent retrieved, and decides whether the passages "
        "are enough to answer the question: S (sufficient), A (ambiguous) or I (insufficient).",
        "",
        "Its current workflow (JSON):",
        _full_workflow_json(parent) if whole_workflow else _workflow_json(parent),
        "",
        f"On {summary.rollouts} training rollouts its verdicts were {status}. Agreement with the true "
        f"sufficiency (balanced, 0.5 = chance): {agreement}. It said S on {summary.said_s_on_insufficient} "
        f"rollouts whose passages were insufficient and I on {summary.said_i_on_sufficient} whose passages "
        f"were sufficient.",
    ]
    if failures:
        lines += ["", "Rollouts it judged wrongly:"]
        for i, f in enumerate(failures, start=1):
            lines += [f"{i}. Question: {f.question}", f"   Passages: {f.evidence}", f"   Agent's answer: {f.answer}",
                      f"   The judge said {f.said.value}; correct: {f.expected.value}."]
    if whole_workflow:
        lines += ["", WORKFLOW_RULES,
                  "Propose a complete new workflow that makes the judge say S exactly when the passages state the "
                  "answer. Reply with one JSON object only, of the same form as the current workflow (name, "
                  "stages, weights)."]
        return (ChatMessage("system", SYSTEM), ChatMessage("user", "\n".join(lines)))
    lines += [
        "",
        "Rules: stage \"A\" decides the status; it must never see \"gold\" and its user_template must contain "
        "$question and $evidence. Templates may use $question, $evidence, $answer (and $gold only in a later "
        "stage). Write a literal dollar sign as $$.",
        "Improve the workflow so that the judge says S exactly when the passages state the answer. Reply with "
        "one JSON object only, for example:",
        '{"stages": [{"name": "A", "system_prompt": "' + EXAMPLE_TEXTS[0] + '", "user_template": "'
        + EXAMPLE_TEXTS[1] + '"}]}',
    ]
    return (ChatMessage("system", SYSTEM), ChatMessage("user", "\n".join(lines)))


PARAPHRASE_SLOT = 1_000_000  # paraphrase requests use slots from here (proposal slots are round * 100 + p)


def paraphrase_messages(question: str) -> tuple[ChatMessage, ...]:
    """The controller's prompt for one paraphrase: the question alone (never its answers)."""
    return (ChatMessage("system", "You reword questions. You reply with the reworded question only."),
            ChatMessage("user", "Reword this question with different words and the same meaning. Add no "
                                "information and do not answer it.\nQuestion: " + question))


def paraphrase_of(reply: str, question: str) -> str | None:
    """The paraphrase in a controller reply, or None when it is unusable (empty, JSON, the question itself,
    not a single line of reasonable length)."""
    lines = [x.strip() for x in reply.strip().splitlines() if x.strip()]
    if not lines:
        return None
    text = lines[0].removeprefix("Question:").strip().strip('"').strip()
    if not text or "{" in text or len(text.split()) < 3 or len(text) > 3 * len(question) + 40:
        return None
    if " ".join(text.lower().split()).rstrip("?") == " ".join(question.lower().split()).rstrip("?"):
        return None
    return text


class Controller(Protocol):
    """Proposes workflows. Contract: `propose` returns the raw reply text for one proposal slot, or raises
    :class:`~eviback.teacher.chat.TeacherCallError`; the same (messages, slot) gives the same text."""

    @property
    def controller_id(self) -> str: ...

    def propose(self, messages: Sequence[ChatMessage], slot: int, stage: str = "A") -> ChatReply: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class ControllerSettings:
    temperature: float = 0.8
    max_tokens: int = 700
    seed: int = 0
    # Reply skeletons (for a weak local controller): the reply is prefilled with the start of a proposal and
    # the model writes one string value (Stage A's instructions), closed by the skeleton. Slots alternate
    # between the skeletons. A strong controller writes the whole JSON itself (skeletons off).
    skeletons: bool = False

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.temperature >= 0:
            raise ValueError(f"the controller's temperature must be >= 0, got {self.temperature}")
        if self.max_tokens < 1:
            raise ValueError(f"the controller's max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(frozen=True)
class Skeleton:
    """A proposal with one JSON string value left open: `prefix` + the model's text + `suffix`."""

    prefix: str
    suffix: str


def skeletons(stage: str) -> tuple[Skeleton, ...]:
    """The skeletons for the status stage named `stage`: a new system prompt, or new instructions after the
    question and the evidence (so the template keeps the placeholders Stage A needs)."""
    head = json.dumps(stage)
    return (
        Skeleton('{"stages": [{"name": ' + head + ', "system_prompt": "', '"}]}'),
        Skeleton('{"stages": [{"name": ' + head + ', "user_template": '
                 '"Question: $question\\n\\nRetrieved passages:\\n$evidence\\n\\n', '"}]}'),
    )


class ChatController:
    """A controller on a chat client (HTTP or local), with a reply cache."""

    def __init__(self, client: TeacherClient, settings: ControllerSettings, cache: ReplyCache | None = None) -> None:
        self.client = client
        self.settings = settings
        self.cache = cache
        self.calls = 0  # backend calls made by this process (cache hits excluded)

    @property
    def controller_id(self) -> str:
        return self.client.backend_id

    def request(self, messages: Sequence[ChatMessage], slot: int, skeleton: Skeleton | None = None) -> ChatRequest:
        decoding = Decoding(temperature=self.settings.temperature, max_tokens=self.settings.max_tokens,
                            seed=self.settings.seed)
        if skeleton is not None:  # a trailing assistant message is the prefill (part of the cache key)
            messages = (*messages, ChatMessage("assistant", skeleton.prefix))
        return ChatRequest(stage=CONTROLLER_STAGE, messages=tuple(messages), schema=ReplySchema(fields=()),
                           decoding=decoding, sample_index=slot)

    def propose(self, messages: Sequence[ChatMessage], slot: int, stage: str = "A") -> ChatReply:
        skeleton = None
        if self.settings.skeletons:
            options = skeletons(stage)
            skeleton = options[slot % len(options)]
        request = self.request(messages, slot, skeleton)
        key = request.cache_key(CONTROLLER_STAGE, self.client.backend_id)
        reply = self.cache.get(key) if self.cache is not None else None
        if reply is None:
            reply = self.client.complete(request)
            self.calls += 1
            if self.cache is not None:
                self.cache.put(key, reply, stage=CONTROLLER_STAGE)
        if skeleton is not None:
            return dataclasses.replace(reply, text=skeleton.prefix + reply.text + skeleton.suffix)
        return reply

    def close(self) -> None:
        self.client.close()


class LocalChatClient:
    """Free-text chat generation on an in-process transformers model (the local controller).

    The model writes the proposal itself. A trailing assistant message is a prefill (a reply skeleton that
    leaves a JSON string open): generation continues it and stops at the string's closing quote, and the
    reply is that string's text. Sampling is seeded per request (`seed` + sample index); calls are
    serialised (one model). The model is loaded onto `device` (a setting, see :data:`eviback.device.HELP`)
    unless a loaded one is shared (`model`, `tokenizer`); the prompt follows the model, wherever it is."""

    in_process = True  # a Teacher runs it in the calling thread (Teacher.in_process)

    def __init__(self, model_name: str = DEFAULT_MODEL, dtype: str = "auto", *,
                 model: PreTrainedModel | None = None, tokenizer: PreTrainedTokenizerBase | None = None,
                 device: str = "auto") -> None:
        placement = place(device, dtype)  # the dtype `auto` means on the device it runs on
        self.model_name = model_name
        self.dtype = dtype = placement.dtype
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_name, dtype)
        self.model = model if model is not None else load_model(model_name, dtype, device=placement,
                                                                what="APE controller")
        self._lock = threading.Lock()

    @property
    def backend_id(self) -> str:
        return f"local-chat:{self.model_name}:{self.dtype}"

    def complete(self, request: ChatRequest) -> ChatReply:
        import torch  # heavy: loaded only once the local controller generates, never on import

        start = time.perf_counter()
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        prefill = ""
        if messages and messages[-1]["role"] == "assistant":
            prefill = messages.pop()["content"]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) + prefill
        ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids.to(self.model.device)
        decoding = request.decoding
        with self._lock, torch.inference_mode():
            torch.manual_seed(request.seed if request.seed is not None else request.sample_index)
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=decoding.max_tokens,
                do_sample=decoding.temperature > 0, temperature=decoding.temperature or None,
                top_p=decoding.top_p if decoding.temperature > 0 else None, top_k=None,
                pad_token_id=self.tokenizer.pad_token_id,
                stop_strings=['"'] if prefill else None, tokenizer=self.tokenizer if prefill else None)
        new = out[0, ids.shape[1]:].cpu()
        reply = self.tokenizer.decode(new, skip_special_tokens=True)
        if prefill:
            # the prefill leaves a JSON string open: its value ends at the first unescaped quote
            match = re.match(r'((?:[^"\\]|\\.)*)', reply)
            reply = match.group(1) if match else ""
        return ChatReply(text=reply, prompt_tokens=int(ids.shape[1]), completion_tokens=int(new.shape[0]),
                         latency_s=time.perf_counter() - start,
                         truncated=int(new.shape[0]) >= decoding.max_tokens)

    def close(self) -> None:
        pass
