"""The Search-R1 text protocol, byte for byte, in one place.

Strings and rules quoted from PeterGriffinJin/Search-R1 (Apache-2.0): `scripts/data_process/nq_search.py`
(`make_prefix`) and `search_r1/llm_agent/generation.py`. Tests pin every string here.

One deliberate difference: :func:`extract_answer` reads the model's *response only*. Search-R1 scores the
last `<answer>` match of the decoded prompt + response, and its prompt contains two matches of its own
(" and " and " Beijing "), so a rollout that never answers is scored as if it had answered "Beijing".
:func:`extract_answer_search_r1_compat` reproduces that for score parity.

How the prompt reaches the model is a setting, :class:`PromptStyle` (`chat_template`, `chat_template_kwargs`),
and every part that builds the actor's prompt builds it with :func:`prompt_text`: the rollout engine (training
and evaluation), the warm start. Search-R1 itself gives the prompt as one user message through the
tokenizer's chat template when the tokenizer has one, and as the plain text otherwise
(`verl/utils/dataset/rl_dataset.py`, tokenised without special tokens in both cases).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from eviback.settings import check_fields
from eviback.types import Action, ActionKind, Passage

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PROMPT_PREFIX = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time "
    "you get new information. After reasoning, if you find you lack some knowledge, you can call a search "
    "engine by <search> query </search> and it will return the top searched results between <information> "
    "and </information>. You can search as many times as your want. If you find no further external "
    "knowledge needed, you can directly provide the answer inside <answer> and </answer>, without detailed "
    "illustrations. For example, <answer> Beijing </answer>. Question: "
)

INVALID_ACTION_MESSAGE = (
    "\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
    "</search>. If I want to give the final answer, I should put the answer between <answer> and </answer>. "
    "Let me try again.\n"
)

SEARCH_STOP = "</search>"
ANSWER_STOP = "</answer>"
STOP_STRINGS = (SEARCH_STOP, ANSWER_STOP)

_ACTION_RE = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def normalize_question(question: str) -> str:
    """Search-R1's question rule: strip; append `?` if the last character is not one."""
    question = question.strip()
    if not question.endswith("?"):
        question += "?"
    return question


def build_prompt(question: str) -> str:
    """Search-R1's instruction prompt for `question` (its typo "as your want" included)."""
    return PROMPT_PREFIX + normalize_question(question) + "\n"


def chat_messages(question: str) -> list[dict[str, str]]:
    """The prompt as Search-R1 sends it: one user message, no system message of its own."""
    return [{"role": "user", "content": build_prompt(question)}]


CHAT_TEMPLATE_AUTO = "auto"
CHAT_TEMPLATE_NONE = "none"
CHAT_TEMPLATES = (CHAT_TEMPLATE_AUTO, CHAT_TEMPLATE_NONE)
# apply_chat_template's own arguments: the protocol sets them (one user message, the generation prompt, text
# out), so a template switch of the same name would change the protocol, not switch the template
_RESERVED_KWARGS = frozenset({"conversation", "messages", "add_generation_prompt", "continue_final_message",
                              "tokenize", "chat_template", "tools", "documents", "padding", "truncation",
                              "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                              "tokenizer_kwargs"})
# how each command sets chat_template, for the messages
_HOW_TO_SET = "--set chat_template=none with eviback train, --chat-template none with eviback eval and eviback sft"


@dataclass(frozen=True)
class PromptStyle:
    """How the actor's prompt reaches the model: the one record of the prompt settings, taken by training
    (`chat_template`, `chat_template_kwargs` in a run's settings), evaluation (`EvalConfig.prompt`,
    `eviback eval --chat-template`) and the warm start (`WarmStartConfig.prompt`).

    - `chat_template: auto` (the default): :func:`chat_messages` through the tokenizer's own chat template,
      with the generation prompt (what Search-R1 does with a tokenizer that has a template). A tokenizer
      without a template is refused, naming `chat_template: none`: falling back silently would give the
      model another prompt than the run's settings say.
    - `chat_template: none`: the plain :func:`build_prompt` text, no template and no special token (what
      Search-R1 gives a tokenizer without a template): for base models.
    - `chat_template_kwargs`: the template's own switches, passed to `apply_chat_template` as TRL and vLLM
      pass theirs, e.g. `{enable_thinking: false}` for Qwen3 (its template then closes an empty
      `<think></think>` block after the generation prompt). Plain data only (they are recorded in the run's
      config), and only with `auto`.

    `to_dict()` is what config files record; :meth:`of` reads it back."""

    chat_template: str = field(default=CHAT_TEMPLATE_AUTO, metadata={"help": "auto: the Search-R1 prompt as "
                               "one user message through the tokenizer's chat template; none: the plain prompt "
                               "text, no template (Search-R1's prompt for base models)"})
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict, metadata={"help": "the chat template's own "
                                                 "switches, passed to apply_chat_template (Qwen3: {enable_thinking: "
                                                 "false}); only with chat_template auto"})

    def __post_init__(self) -> None:
        check_fields(self)  # types first: a string, a mapping
        if self.chat_template not in CHAT_TEMPLATES:
            raise ValueError(f"chat_template must be 'auto' (the tokenizer's chat template) or 'none' (Search-R1's "
                             f"plain prompt, for base models), got {self.chat_template!r}")
        kwargs = self.chat_template_kwargs
        if kwargs and self.chat_template == CHAT_TEMPLATE_NONE:
            raise ValueError(f"chat_template_kwargs {kwargs} switch a chat template, and chat_template is 'none' "
                             "(no template): set chat_template to auto, or leave chat_template_kwargs empty")
        for key, value in kwargs.items():
            if not isinstance(key, str):
                raise ValueError(f"chat_template_kwargs: a switch's name must be a string, got {key!r}")
            if key in _RESERVED_KWARGS:
                raise ValueError(f"chat_template_kwargs may not set {key!r}: it is apply_chat_template's own "
                                 "argument, which the Search-R1 protocol sets; name only the template's switches "
                                 "(such as enable_thinking)")
            _check_plain(value, f"chat_template_kwargs[{key!r}]")
        # a copy of plain data: a caller's mapping changed later does not change this frozen record
        object.__setattr__(self, "chat_template_kwargs", json.loads(json.dumps(kwargs)))

    def __hash__(self) -> int:
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    @property
    def templated(self) -> bool:
        """True when the prompt goes through the tokenizer's chat template."""
        return self.chat_template == CHAT_TEMPLATE_AUTO

    def to_dict(self) -> dict[str, Any]:
        """The settings as plain values (what a run's config records)."""
        return {"chat_template": self.chat_template, "chat_template_kwargs": json.loads(json.dumps(
            self.chat_template_kwargs))}

    @classmethod
    def of(cls, value: PromptStyle | Mapping[str, Any], where: str = "prompt") -> PromptStyle:
        """`value` as a PromptStyle: itself, or one from its :meth:`to_dict` mapping (a config read back).
        Raises ValueError naming `where` for anything else, or a mapping with other keys."""
        if isinstance(value, PromptStyle):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"{where} must be a PromptStyle or a mapping of chat_template and "
                             f"chat_template_kwargs, got {type(value).__name__}")
        unknown = sorted(str(k) for k in set(value) - {"chat_template", "chat_template_kwargs"})
        if unknown:
            raise ValueError(f"{where}: unknown prompt setting(s) {unknown}; a prompt style takes chat_template "
                             "and chat_template_kwargs")
        return cls(**value)

    def check(self, tokenizer: PreTrainedTokenizerBase, model: str = "") -> None:
        """Refuse, before any work, a tokenizer this style cannot build the prompt with (`auto` and no chat
        template); the message names the model (`model`, when given) and the setting that fixes it."""
        if self.templated and not getattr(tokenizer, "chat_template", None):
            named = f" of {model}" if model else ""
            raise ValueError(f"the tokenizer{named} has no chat template, and chat_template is 'auto'. For a "
                             f"base model, give Search-R1's plain prompt: chat_template none ({_HOW_TO_SET})")


def _check_plain(value: Any, where: str) -> None:
    """Refuse a value that is not plain data (what JSON and YAML write back as it was)."""
    if value is None or isinstance(value, bool | int | str):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where} must be a finite number, got {value}")
        return
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]")
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{where}: keys must be strings, got {key!r}")
            _check_plain(item, f"{where}[{key!r}]")
        return
    raise ValueError(f"{where} must be plain data (a string, number, boolean, null, list or mapping), got "
                     f"{type(value).__name__}")


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, question: str, **chat_template_kwargs: Any) -> str:
    """The prompt text through `tokenizer`'s chat template, ready for generation; `chat_template_kwargs` are
    the template's own switches. A tokenizer without a template is refused (see :class:`PromptStyle`)."""
    PromptStyle().check(tokenizer)
    return tokenizer.apply_chat_template(chat_messages(question), add_generation_prompt=True, tokenize=False,
                                         **chat_template_kwargs)


def prompt_text(tokenizer: PreTrainedTokenizerBase, question: str, style: PromptStyle | None = None) -> str:
    """The actor's prompt for `question` in `style` (default: the tokenizer's chat template, no switches): the
    text every part that builds the actor's prompt tokenises, without special tokens (as Search-R1 does).
    With `chat_template: none` it is :func:`build_prompt`'s text byte for byte."""
    style = style or PromptStyle()
    if not style.templated:
        return build_prompt(question)
    return apply_chat_template(tokenizer, question, **style.chat_template_kwargs)


def render_passages(passages: Sequence[Passage]) -> str:
    """`Doc {i}(Title: {title}) {text}\\n` per passage, 1-based; the title keeps the corpus's quotes."""
    out = []
    for i, passage in enumerate(passages, start=1):
        lines = passage.contents.split("\n")
        out.append(f"Doc {i}(Title: {lines[0]}) {chr(10).join(lines[1:])}\n")
    return "".join(out)


def render_observation(passages: Sequence[Passage]) -> str:
    """The text appended after an executed search."""
    return f"\n\n<information>{render_passages(passages).strip()}</information>\n\n"


_INFORMATION_CLOSE = "</information>"


def _doc_header(number: int) -> str:
    return f"Doc {number}(Title: "


@dataclass(frozen=True)
class ObservationParts:
    """An observation as the actor saw it (after the observation cut), split at its passages' headers.

    `docs[i]` is the text of passage i+1 after its `Doc i+1(Title: ` header, up to the next header (the
    newline between passages excluded): the title, the passage text, cut where the observation was cut.
    Only passages whose header survived the cut have a doc. `head` is the text before the first header
    (`\n\n<information>`); `tail` what follows the last doc: the closing `</information>\n\n`, what the
    cut left of it, or of the next passage's header, or nothing. :func:`join_observation` inverts
    :func:`split_observation` exactly."""

    head: str
    docs: tuple[str, ...]
    tail: str


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest prefix of `marker` that `text` ends with (0: none)."""
    for k in range(len(marker), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def split_observation(observation: str, passages: int) -> ObservationParts:
    """Split the observation of a search that retrieved `passages` passages into its seen passages."""
    starts: list[int] = []
    at = 0
    for number in range(1, passages + 1):
        found = observation.find(_doc_header(number), at)
        if found == -1 or not observation[found + len(_doc_header(number)):].strip():
            break  # a header with nothing after it shows nothing of its passage (evidence_as_seen agrees)
        starts.append(found)
        at = found + len(_doc_header(number))
    if not starts:
        return ObservationParts(head=observation, docs=(), tail="")
    docs = []
    for i, start in enumerate(starts[:-1]):
        text = observation[start + len(_doc_header(i + 1)): starts[i + 1]]
        docs.append(text[:-1] if text.endswith("\n") else text)
    last = observation[starts[-1] + len(_doc_header(len(starts))):]
    close = last.rfind(_INFORMATION_CLOSE)
    if close != -1:
        cut = len(last) - close
    elif len(starts) < passages:  # the cut fell in the next passage's header, or in this passage's text
        cut = _partial_suffix(last, "\n" + _doc_header(len(starts) + 1))
    else:  # the cut fell in the closing tag, or in the last passage's text
        cut = _partial_suffix(last, _INFORMATION_CLOSE)
    docs.append(last[: len(last) - cut])
    return ObservationParts(head=observation[: starts[0]], docs=tuple(docs), tail=last[len(last) - cut:])


def join_observation(parts: ObservationParts) -> str:
    """The observation text of `parts`, its passages numbered 1.. in the order of `parts.docs`."""
    body = "\n".join(_doc_header(i) + doc for i, doc in enumerate(parts.docs, start=1))
    return parts.head + body + parts.tail


def truncate_turn(text: str) -> str:
    """Cut a generated turn after the first `</search>` if it has one, else after the first `</answer>`."""
    for stop in STOP_STRINGS:
        at = text.find(stop)
        if at != -1:
            return text[: at + len(stop)]
    return text


def parse_action(text: str) -> Action:
    """The first `<search>`/`<answer>` block of a model turn, content stripped; else an invalid action.

    `text` must be the model's own turn text: never pass observations (retrieved text is data)."""
    match = _ACTION_RE.search(text)
    if match is None:
        return Action(ActionKind.INVALID)
    return Action(ActionKind(match.group(1)), match.group(2).strip())


def extract_answer(model_texts: str | Sequence[str]) -> str | None:
    """The final answer: the last `<answer>` block of the model's own text, stripped, or None.

    Pass the model's turns (a string or the list of turn texts). Observations and the invalid-action
    message (which itself contains `<answer> and </answer>`) must not be included."""
    text = model_texts if isinstance(model_texts, str) else "".join(model_texts)
    matches = _ANSWER_RE.findall(text)
    return matches[-1].strip() if matches else None


def extract_answer_search_r1_compat(prompt: str, response: str) -> str | None:
    """Search-R1's own extraction, for score parity only (`qa_em.extract_solution` on prompt + response).

    Search-R1 takes the last `<answer>` match of the decoded prompt + response, and returns None when there
    are fewer than two matches. Its prompt holds two matches of its own, so with that prompt this never
    returns None: a response without an answer yields "Beijing" (the prompt's example), and one that ends
    with the invalid-action message yields "and"."""
    matches = _ANSWER_RE.findall(prompt + response)
    return matches[-1].strip() if len(matches) > 1 else None
