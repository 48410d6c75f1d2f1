"""Warm-start training data: Search-R1 trajectories built from training questions with real searches.

The bundled SmolLM2 never emits `<search>` on its own, so before RL it is fine-tuned on trajectories
written in the exact protocol the rollout engine speaks. Each example is a :class:`~eviback.types.Trajectory`
whose model turns end at `</search>` or `</answer>` and whose observations are exactly
:func:`eviback.protocol.render_observation` of what the retriever returned for the query, capped at
`max_obs_tokens` tokens as the rollout engine caps them. Three kinds are built:

- `single`: search, answer. Kept only when a gold answer appears in the visible part of the passages that
  query retrieved; the `<think>` quotes the sentence that holds it and the `<answer>` is that gold answer as
  the passage writes it (its exact match with the gold answers is checked).
- `multi` (multi-hop training questions): search, then search an entity that the first results mention (a
  supporting-passage title found in them, else a named entity from them). Kept only when the second search
  brings a supporting passage that the first did not, which names the entity searched for and holds the
  answer. Supporting passages are known by id, or by title where the data names them by title only (the
  release's multi-hop training files), as the teacher's labels know them.
- `retry` (single-hop questions whose first search missed): search again with a query of other terms; kept
  only when the second search brings the answer. These teach the model that an unhelpful search is not the
  end.

The queries are written in several forms (:class:`eviback.queries.QueryForm`), drawn per example: the first
query from the forms the question gives (:func:`eviback.queries.query_forms`: the question as written, its
keywords, the question without its wh-word, subject and relation where the data records them, a name of
the question, the keywords with that name first), the question as written with probability
:data:`FIRST_SHARE`; a second hop as the entity alone or the entity with the question's first keywords; a
search again by one rule (:func:`retry_form`): the question as written after any other first query, the
shorter query (subject and relation, else the entity) after the question. Each draw is seeded by the build
seed and the question (:func:`eviback.queries.draw_form`), so a build is deterministic, and a question's form
does not depend on which other questions are built. A model trained on one form (the question verbatim, builder 1)
searched it in 90% of its training rollouts, so the rollouts of a group saw the same passages and a teacher
judging their evidence had nothing to tell apart; one trained on a uniform draw (builder 2) searched in
varied forms, but its greedy searches blended them and its held-out F1 fell (the constants below).

Only the model's own tokens are trained: :func:`tokenize_trajectory` returns the prompt ids and the
response ids with a mask that is 1 on model tokens and 0 on observation tokens (`TokenTrace`), and
:func:`labels_for` turns that into causal-LM labels with -100 on the prompt and the observations.

The training questions come from :func:`eviback.data.read_training_questions` (never an evaluation
question); the queries of the searches from :mod:`eviback.queries`.

Run `eviback sft --dry-run` to build the examples and print counts without training.
"""

from __future__ import annotations

import enum
import hashlib
import random
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tqdm import tqdm

from eviback.data import BENCHMARKS_MULTI_HOP
from eviback.metrics import exact_match, normalize_answer
from eviback.protocol import PromptStyle, parse_action, prompt_text, render_observation
from eviback.queries import (
    HOP_FORMS,
    SENTENCE_END,
    QueryForm,
    contains_words,
    draw_form,
    entity_candidates,
    hop_query,
    query_forms,
    query_terms,
)
from eviback.retrieval.base import Retriever
from eviback.teacher.labels import supporting_titles
from eviback.types import ActionKind, Passage, Question, StopReason, TokenTrace, Trajectory, Turn

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Bumped whenever the text of the built examples changes, so that cached warm starts are rebuilt.
# 2: queries drawn from several forms (builder 1 searched the question as written first, always).
# 3: the question as written is the first query of half the examples, the other forms share the rest; a
#    search again prefers the subject and relation, else the entity (builder 2 drew both uniformly).
# 4: a <think> names the passage by its title first, then its number ("Ada Lovelace (Doc 2) says: ..."):
#    builder 3's seed-0 policy, writing the number first, cited Doc 2 in half its answers where the gold was at
#    Doc 1 as often as for builder 1. Over two SFT seeds each, +0.013 [+0.000, +0.026] held-out F1 over
#    builder 3; the seed alone moves it by 0.03-0.04 (results/warmstart.md).
# 5: a search again follows one rule (RETRY_AFTER_QUESTION) instead of a draw, and says which way it changes
#    the query ("with the whole question" / "with a shorter query"); a question whose data names its supporting
#    passages by title only (the release's multi-hop training files) has them matched by title, as the teacher's
#    labels match them: builder 4 looked for ids only and made no multi-hop example from the release.
BUILDER_VERSION = 5

# The mode of the first query's draw, and its share. Greedy decoding follows a policy's mode: with a uniform
# draw (builder 2) the greedy warm-started policy searched 36% of held-out questions in a form that matched
# none of the forms (a blend of them) and lost 0.042 F1 against builder 1 (results/warmstart.md). With the
# question as the mode, greedy searches it for 65% of held-out questions (blends 20%), while a group's rollouts
# at temperature 1 search in other forms more than half the time. Builder 3 still trails builder 1 by 0.033 F1,
# in answering rather than searching (results/warmstart.md).
FIRST_PREFERRED: tuple[QueryForm, ...] = (QueryForm.QUESTION,)
FIRST_SHARE = 0.5
# A search again follows one rule, so that the model can learn what to change from what it searched: after
# any query other than the question as written, the question as written; after the question, the shorter query
# (the first of these that the question gives). Builder 3 and 4 took the shorter query for half the retries and
# drew the rest from every other form; on the release (200 examples, all 60 multi-search ones retries) builder
# 4's greedy policy searched the same query twice for 15% of held-out questions (results/warmstart.md).
RETRY_AFTER_QUESTION: tuple[QueryForm, ...] = (QueryForm.SUBJECT_RELATION, QueryForm.ENTITY)

IGNORE_INDEX = -100  # the label of a token excluded from the loss (PyTorch's cross-entropy default)


class ExampleKind(enum.StrEnum):
    SINGLE = "single"  # one search, then the answer
    MULTI = "multi"  # a multi-hop question: a second search for an entity found by the first
    RETRY = "retry"  # the first search missed; a reformulated second search found the answer


@dataclass(frozen=True)
class WarmStartExample:
    """One training trajectory and how it was made."""

    trajectory: Trajectory
    kind: ExampleKind
    forms: tuple[QueryForm, ...] = ()  # the form of each search's query, in order

    @property
    def question(self) -> Question:
        return self.trajectory.question


@dataclass(frozen=True)
class BuildReport:
    """What the builder looked at and what it kept.

    `considered`: questions per data set; `kept`: examples per kind; `rejected`: questions that yielded no
    example, per reason (`answer_not_retrieved`, `no_second_hop`, ...). `drawn`: the first query's form drawn
    per considered question; `forms`: the forms of the kept examples, per kind, `first` and `second` search
    (`{"single": {"first": {"keywords": 12, ...}}, "retry": {"first": {...}, "second": {...}}, ...}`). Kept
    over drawn, per form, is how often a form's first search led to an example: a form whose searches fail
    more often changes which questions survive."""

    considered: Mapping[str, int] = field(default_factory=dict)
    kept: Mapping[str, int] = field(default_factory=dict)
    rejected: Mapping[str, int] = field(default_factory=dict)
    drawn: Mapping[str, int] = field(default_factory=dict)
    forms: Mapping[str, Mapping[str, Mapping[str, int]]] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------------
# Observations as the rollout engine shows them


def cap_observation(observation: str, tokenizer: PreTrainedTokenizerBase, max_tokens: int) -> str:
    """`observation` cut to its first `max_tokens` tokens (the rollout engine's cap, Search-R1's rule)."""
    ids = tokenizer(observation, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return observation
    return tokenizer.decode(ids[:max_tokens])


@dataclass(frozen=True)
class _Search:
    """One executed search: the query, the passages, the observation text and what of each passage fits."""

    query: str
    passages: tuple[Passage, ...]
    observation: str
    visible: tuple[str, ...]  # the text of each passage that survived the observation cap
    form: QueryForm  # how the query was written


def _make_search(query: str, passages: Sequence[Passage], tokenizer: PreTrainedTokenizerBase,
                 max_obs_tokens: int, form: QueryForm) -> _Search:
    full = render_observation(passages)
    shown = cap_observation(full, tokenizer, max_obs_tokens)
    # How much of `full` survived: the common prefix (decode may differ in the last, cut character).
    kept = 0
    for a, b in zip(full, shown, strict=False):
        if a != b:
            break
        kept += 1
    visible = []
    cursor = 0
    for i, passage in enumerate(passages, start=1):
        head = f"Doc {i}(Title: {passage.contents.split(chr(10))[0]}) "
        start = full.find(head, cursor) + len(head)
        cursor = start
        visible.append(passage.text[: max(0, kept - start)])
    return _Search(query, tuple(passages), shown, tuple(visible), form)


# --------------------------------------------------------------------------------------------------
# Finding a gold answer in the evidence


@dataclass(frozen=True)
class _Grounding:
    doc: int  # 1-based position in the search's passages
    title: str
    surface: str  # the answer as the passage writes it (exact match with a gold answer)
    sentence: str  # the sentence (shortened) of the passage that holds it


def _words(text: str) -> list[tuple[str, int, int]]:
    """(normalised word, start, end) of every white-space separated word that survives normalisation."""
    out = []
    for m in re.finditer(r"\S+", text):
        norm = normalize_answer(m.group())
        for piece in norm.split():  # a word like "U.S.-based" may normalise to one piece; keep offsets
            out.append((piece, m.start(), m.end()))
    return out


def find_answer(golds: Sequence[str], text: str) -> tuple[str, int, int] | None:
    """The first occurrence in `text` of a gold answer (SQuAD-normalised, whole words): (surface, start, end).

    Gold answers are tried in their listed order (the first is the data set's canonical answer)."""
    words = _words(text)
    norms = [w for w, _, _ in words]
    for gold in golds:
        target = normalize_answer(gold).split()
        if not target:
            continue
        for i in range(len(norms) - len(target) + 1):
            if norms[i : i + len(target)] == target:
                start, end = words[i][1], words[i + len(target) - 1][2]
                surface = text[start:end].strip(".,;:!?()[]\"'")
                if exact_match(surface, golds) != 1.0:
                    surface = gold  # punctuation attached to the words changed it: use the gold string
                return surface, start, end
    return None


def _sentence_around(text: str, start: int, end: int, max_words: int = 30) -> str:
    """The sentence of `text` containing [start, end), cut to about `max_words` words around the span."""
    bounds = [0] + [m.end() for m in SENTENCE_END.finditer(text)] + [len(text)]
    s = max(b for b in bounds if b <= start)
    e = min((b for b in bounds if b >= end), default=len(text))
    sentence = text[s:e].strip()
    words = sentence.split()
    if len(words) <= max_words:
        return sentence
    # Keep a window around the answer so the quoted words still contain it.
    before = len(text[s:start].split())
    lo = max(0, min(before - max_words // 3, len(words) - max_words))
    return " ".join(words[lo : lo + max_words])


def ground(golds: Sequence[str], search: _Search, allowed_ids: Iterable[str] = (),
           subject: str | None = None) -> _Grounding | None:
    """A gold answer in the visible text of one of the search's passages, or None.

    A string match alone is weak evidence (an occupation such as "actor" appears in many passages), so
    when the question's gold passages are known (`allowed_ids`) only those may be cited, and when the data
    set names the question's subject (PopQA's `subj`) the cited passage must mention it."""
    allowed = set(allowed_ids)
    for i, passage in enumerate(search.passages):
        if allowed and passage.id not in allowed:
            continue
        if subject and not contains_words(passage.contents, subject):
            continue
        found = find_answer(golds, search.visible[i])
        if found is not None:
            surface, start, end = found
            sentence = _sentence_around(search.visible[i], start, end)
            return _Grounding(i + 1, passage.title, surface, sentence)
    return None


def support_ids(question: Question, passages: Sequence[Passage]) -> set[str] | None:
    """Which of `passages` are the question's supporting passages: None when its data names no support (then
    any passage holding the answer may be cited), else their ids, by id where the data gives ids and by title
    otherwise (the release's multi-hop training files name their supporting passages by title only)."""
    if question.gold_passage_ids:
        gold = set(question.gold_passage_ids)
        return {p.id for p in passages if p.id in gold}
    titles = {normalize_answer(title) for title in supporting_titles(question)}
    if not titles:
        return None
    return {p.id for p in passages if normalize_answer(p.title) in titles}


def _ground_question(question: Question, search: _Search,
                     allowed_ids: Iterable[str] | None = None) -> _Grounding | None:
    subject = question.metadata.get("subj")
    allowed = support_ids(question, search.passages) if allowed_ids is None else set(allowed_ids)
    if allowed is not None and not allowed:
        return None  # the data names the support, and none of it was retrieved
    return ground(question.golden_answers, search, allowed or (), str(subject) if subject else None)


# --------------------------------------------------------------------------------------------------
# Text of the model's turns. Short, factual, and varied a little so the model does not learn one sentence.


_FIRST = (
    "I need to find the answer to this question. I will search for it.",
    "I do not know this for sure, so I will search for it.",
    "I should look this up before answering.",
)
_FIRST_MULTI = (
    "This question needs more than one fact. I will search for the first one.",
    "I need to find several facts to answer this. I will start with a search.",
)


def _pick(options: Sequence[str], key: str) -> str:
    return options[int(hashlib.sha256(key.encode()).hexdigest(), 16) % len(options)]


def _search_turn(think: str, query: str) -> Turn:
    text = f"<think> {think} </think>\n<search> {query} </search>"
    return Turn(text=text, action=parse_action(text))


def _answer_turn(think: str, answer: str) -> Turn:
    text = f"<think> {think} </think>\n<answer> {answer} </answer>"
    return Turn(text=text, action=parse_action(text))


def _executed(turn: Turn, search: _Search) -> Turn:
    return Turn(text=turn.text, action=turn.action, passages=search.passages, observation=search.observation,
                executed=True)


def _cite(title: str, doc: int) -> str:
    """A passage as a <think> names it: the title first, which the question's words point to, then its number,
    which then follows from the title ("Ada Lovelace (Doc 2)"), rather than a number among 1-3 chosen before
    anything ties it to the question."""
    return f"{title} (Doc {doc})"


def _evidence_think(g: _Grounding) -> str:
    return f'{_cite(g.title, g.doc)} says: "{g.sentence}" So the answer is {g.surface}.'


def _trajectory(question: Question, turns: Sequence[Turn], answer: str) -> Trajectory:
    return Trajectory(question=question, turns=tuple(turns), answer=answer, stop_reason=StopReason.ANSWERED)


# --------------------------------------------------------------------------------------------------
# The builder


def is_multi_hop(question: Question) -> bool:
    return question.dataset in BENCHMARKS_MULTI_HOP or bool(question.metadata.get("supporting_titles"))


def build_examples(
    questions: Sequence[Question],
    retriever: Retriever,
    tokenizer: PreTrainedTokenizerBase,  # counts observation tokens as the rollout engine does
    *,
    topk: int = 3,
    max_obs_tokens: int = 500,
    show_progress: bool = False,
    seed: int = 0,
) -> tuple[list[WarmStartExample], BuildReport]:
    """At most one example per question (the first kind that works), in the order of `questions`.

    Multi-hop questions try `multi` then `single`; single-hop questions try `single` then `retry`. Each
    question's queries are written in forms drawn with `seed` (the module doc). Searches are real: every
    observation is what `retriever` returned for that query."""
    considered: Counter[str] = Counter()
    kept: Counter[str] = Counter()
    rejected: Counter[str] = Counter()
    drawn: Counter[str] = Counter()
    forms: dict[str, dict[str, Counter[str]]] = {}
    examples: list[WarmStartExample] = []

    first_forms = []
    for q in questions:
        available = query_forms(q)
        form = draw_form(available, seed, q, "first", FIRST_PREFERRED, FIRST_SHARE)
        first_forms.append((form, available[form]))
    first_results = retriever.search([query for _, query in first_forms], topk=topk) if questions else []
    iterator: Iterable = zip(questions, first_forms, first_results, strict=True)
    if show_progress:
        iterator = tqdm(iterator, total=len(questions), desc="building warm-start examples", unit="question")
    for question, (form, query), passages in iterator:
        considered[question.dataset or "?"] += 1
        drawn[form.value] += 1
        first = _make_search(query, passages, tokenizer, max_obs_tokens, form)
        example = None
        reason = ""
        if is_multi_hop(question):
            example, reason = _multi_hop(question, first, retriever, tokenizer, topk, max_obs_tokens, seed)
        if example is None:
            example, single_reason = _single(question, first)
            reason = reason or single_reason
        if example is None and not is_multi_hop(question):
            example, reason = _retry(question, first, retriever, tokenizer, topk, max_obs_tokens, seed)
        if example is None:
            rejected[reason] += 1
            continue
        kept[example.kind.value] += 1
        by_search = forms.setdefault(example.kind.value, {})
        for position, used in zip(("first", "second"), example.forms, strict=False):
            by_search.setdefault(position, Counter())[used.value] += 1
        examples.append(example)
    report_forms = {kind: {position: dict(c) for position, c in by.items()} for kind, by in forms.items()}
    return examples, BuildReport(dict(considered), dict(kept), dict(rejected), dict(drawn), report_forms)


def _single(question: Question, first: _Search) -> tuple[WarmStartExample | None, str]:
    g = _ground_question(question, first)
    if g is None:
        return None, "answer_not_retrieved"
    turns = [
        _executed(_search_turn(_pick(_FIRST, question.id), first.query), first),
        _answer_turn(_evidence_think(g), g.surface),
    ]
    return WarmStartExample(_trajectory(question, turns, g.surface), ExampleKind.SINGLE, (first.form,)), ""


def _retry(question: Question, first: _Search, retriever: Retriever, tokenizer: PreTrainedTokenizerBase, topk: int,
           max_obs_tokens: int, seed: int) -> tuple[WarmStartExample | None, str]:
    # Only a query of other terms can retrieve anything else (BM25 ignores word order and stopwords).
    terms = query_terms(first.query)
    others = {form: query for form, query in query_forms(question).items()
              if query_terms(query) and query_terms(query) != terms}
    if not others:
        return None, "answer_not_retrieved"
    form = retry_form(first.form, others, seed, question)
    query = others[form]
    second = _make_search(query, retriever.search([query], topk=topk)[0], tokenizer, max_obs_tokens, form)
    g = _ground_question(question, second)
    if g is None:
        return None, "answer_not_retrieved"
    if form is QueryForm.QUESTION:
        how = "the whole question"
    elif len(query.split()) < len(first.query.split()):
        how = "a shorter query"
    else:
        how = "other words"
    turns = [
        _executed(_search_turn(_pick(_FIRST, question.id), first.query), first),
        _executed(_search_turn(f"These documents do not answer the question. I will search again with {how}.",
                               query), second),
        _answer_turn(_evidence_think(g), g.surface),
    ]
    return WarmStartExample(_trajectory(question, turns, g.surface), ExampleKind.RETRY, (first.form, form)), ""


def retry_form(first: QueryForm, others: Mapping[QueryForm, str], seed: int, question: Question) -> QueryForm:
    """The form of a search again after a first search in form `first`, among `others` (the forms whose terms
    differ from the first query's): the question as written after any other form; after the question, the
    first of :data:`RETRY_AFTER_QUESTION` that `others` holds, else a seeded draw from `others`."""
    if first is not QueryForm.QUESTION and QueryForm.QUESTION in others:
        return QueryForm.QUESTION
    preferred = next((form for form in RETRY_AFTER_QUESTION if form in others), None)
    return preferred or draw_form(others, seed, question, "second")


def _multi_hop(question: Question, first: _Search, retriever: Retriever, tokenizer: PreTrainedTokenizerBase,
               topk: int, max_obs_tokens: int, seed: int,
               max_candidates: int = 8) -> tuple[WarmStartExample | None, str]:
    seen = {p.id for p in first.passages}
    first_support = support_ids(question, first.passages) or set()
    golds_norm = [normalize_answer(a) for a in question.golden_answers]
    # The second query names something the first results mention: a supporting title found in them first
    # (the bridge entity of most HotpotQA questions), then other named entities of the results.
    candidates: dict[str, int] = {}  # query -> the 1-based doc of the first results that mentions it
    first_titles = {normalize_answer(p.title) for p in first.passages}
    for title in map(str, question.metadata.get("supporting_titles", ())):
        doc = next((i for i, text in enumerate(first.visible, start=1) if contains_words(text, title)), None)
        if doc and not contains_words(question.question, title) and normalize_answer(title) not in first_titles:
            candidates.setdefault(title, doc)
    prefer = sorted(range(len(first.passages)), key=lambda i: (first.passages[i].id not in first_support, i))
    for i in prefer:
        for entity in entity_candidates(first.visible[i], question.question,
                                        exclude=[p.title for p in first.passages]):
            candidates.setdefault(entity, i + 1)
    # The hop is written in one form for every candidate: the entity alone, or with the question's keywords.
    form = draw_form(HOP_FORMS, seed, question, "second")
    # A query that already holds the answer would teach searching for what one has just read.
    hops = [(entity, hop_query(entity, question, form)) for entity in candidates]
    hops = [(entity, query) for entity, query in hops
            if not any(g and f" {g} " in f" {normalize_answer(query)} " for g in golds_norm)][:max_candidates]
    if not hops:
        return None, "no_second_hop"
    results = retriever.search([query for _, query in hops], topk=topk)
    for (entity, query), passages in zip(hops, results, strict=True):
        # a supporting passage the first search did not bring, about the entity searched for (a passage that
        # does not name it came by chance and would teach a bridge that is not one)
        support = (support_ids(question, passages) or set()) - seen
        new_gold = [p.id for p in passages if p.id in support and contains_words(p.contents, entity)]
        if not new_gold:
            continue
        second = _make_search(query, passages, tokenizer, max_obs_tokens, form)
        g = _ground_question(question, second, new_gold)
        if g is None:
            continue
        mention = candidates[entity]
        bridge = (f"{_cite(first.passages[mention - 1].title, mention)} mentions {entity}. "
                  f"I need more information about {entity}.")
        turns = [
            _executed(_search_turn(_pick(_FIRST_MULTI, question.id), first.query), first),
            _executed(_search_turn(bridge, query), second),
            _answer_turn(_evidence_think(g), g.surface),
        ]
        return WarmStartExample(_trajectory(question, turns, g.surface), ExampleKind.MULTI, (first.form, form)), ""
    return None, "no_second_hop"


# --------------------------------------------------------------------------------------------------
# Choosing the training set


def select_examples(
    examples: Sequence[WarmStartExample], max_examples: int, multi_search_share: float, seed: int = 0
) -> list[WarmStartExample]:
    """At most `max_examples`, of which up to `multi_search_share` search more than once (multi + retry),
    the rest single-search, spread over the data sets; shuffled deterministically by `seed`."""
    rng = random.Random(seed)
    multi = [e for e in examples if e.kind is not ExampleKind.SINGLE]
    single = [e for e in examples if e.kind is ExampleKind.SINGLE]
    n_multi = min(len(multi), round(max_examples * multi_search_share))
    chosen = _round_robin(multi, n_multi, rng)
    chosen += _round_robin(single, max_examples - len(chosen), rng)
    rng.shuffle(chosen)
    return chosen


def _round_robin(examples: Sequence[WarmStartExample], n: int, rng: random.Random) -> list[WarmStartExample]:
    """`n` examples taken in turn from each data set (each set shuffled), so no set crowds out the others."""
    by_set: dict[str, list[WarmStartExample]] = {}
    for e in examples:
        by_set.setdefault(f"{e.question.dataset}/{e.kind}", []).append(e)
    for items in by_set.values():
        rng.shuffle(items)
    queues = [by_set[k] for k in sorted(by_set)]
    out: list[WarmStartExample] = []
    while len(out) < n and any(queues):
        for queue in queues:
            if queue and len(out) < n:
                out.append(queue.pop())
    return out


# --------------------------------------------------------------------------------------------------
# Tokenisation: the chat-template prompt, then the trajectory, with the model's own tokens marked


def tokenize_trajectory(
    trajectory: Trajectory, tokenizer: PreTrainedTokenizerBase, max_obs_tokens: int = 500, end_with_eos: bool = True,
    *, prompt: PromptStyle | None = None,
) -> TokenTrace:
    """Prompt ids (the prompt in the `prompt` style, as the rollout engine builds it: by default the chat
    template's, up to and including the assistant header) and response ids.

    Each turn's text and each observation are tokenised on their own, as in a rollout (the model's tokens
    are sampled, the observation is tokenised and appended, capped at `max_obs_tokens`). `mask` is 1 on
    the model's tokens and 0 on observation tokens. With `end_with_eos`, the end-of-turn token follows the
    final `</answer>` and is trained, so the model also stops where no stop string is set."""
    encode = lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    prompt_ids = encode(prompt_text(tokenizer, trajectory.question.question, prompt))
    ids: list[int] = []
    mask: list[int] = []
    for turn in trajectory.turns:
        own = encode(turn.text)
        ids += own
        mask += [1] * len(own)
        if turn.observation:
            seen = encode(turn.observation)[:max_obs_tokens]
            ids += seen
            mask += [0] * len(seen)
    if end_with_eos:
        ids.append(tokenizer.eos_token_id)
        mask.append(1)
    return TokenTrace(prompt_ids=tuple(prompt_ids), ids=tuple(ids), mask=tuple(mask))


def labels_for(trace: TokenTrace) -> tuple[list[int], list[int]]:
    """(input_ids, labels) for causal-LM training: labels are -100 on the prompt and on observations."""
    input_ids = list(trace.prompt_ids) + list(trace.ids)
    labels = [IGNORE_INDEX] * len(trace.prompt_ids) + [
        token if keep else IGNORE_INDEX for token, keep in zip(trace.ids, trace.mask, strict=True)
    ]
    return input_ids, labels


__all__ = [
    "BUILDER_VERSION", "ActionKind", "BuildReport", "ExampleKind", "WarmStartExample", "build_examples",
    "cap_observation", "find_answer", "ground", "labels_for", "retry_form", "select_examples", "support_ids",
    "tokenize_trajectory",
]
