"""The Search-R1 text protocol, byte for byte, in one place.

Strings and rules quoted from PeterGriffinJin/Search-R1 (Apache-2.0): `scripts/data_process/nq_search.py`
(`make_prefix`) and `search_r1/llm_agent/generation.py`. Tests pin every string here.

One deliberate difference: :func:`extract_answer` reads the model's *response only*. Search-R1 scores the
last `<answer>` match of the decoded prompt + response, and its prompt contains two matches of its own
(" and " and " Beijing "), so a rollout that never answers is scored as if it had answered "Beijing".
:func:`extract_answer_search_r1_compat` reproduces that for score parity.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

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


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, question: str) -> str:
    """The prompt text through `tokenizer`'s chat template, ready for generation."""
    return tokenizer.apply_chat_template(chat_messages(question), add_generation_prompt=True, tokenize=False)


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
