"""Search queries written by rule, for trajectories the model did not write itself.

The warm start (`eviback.train.warmstart_data`) and the evidence judge's training examples search the way
a scripted agent would. The evidence judge searches the question itself (:func:`search_query`), then, when
that missed, a shorter reformulation (:func:`retry_query`: subject and relation where the data set records
them, else the question's keywords), or, for a multi-hop question, an entity that the first results mention
(:func:`entity_candidates`: runs of capitalised words the question does not name).

The warm start writes its queries in several forms (:class:`QueryForm`, :func:`query_forms`), one drawn per
example by a seeded draw (:func:`draw_form`), so that the model it trains does not learn one way to search:
a policy that always searches the question verbatim retrieves the same passages in every rollout of a
group, and a teacher that judges the evidence then has nothing to tell apart. Text only: no retriever, no
model.
"""

from __future__ import annotations

import enum
import random
import re
from collections.abc import Iterable, Mapping, Sequence

from eviback.metrics import normalize_answer
from eviback.types import Question

# Where a sentence ends: after . ! or ? and white space, before what can start a sentence.
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")

_ENTITY = re.compile(r"[A-Z0-9][\w'’&.\-]*(?:\s+(?:(?:of|the|de|and|la|von|van|du|del)\s+)*[A-Z0-9][\w'’&.\-]*)*")
# Words that begin a capitalised run without being part of the name ("In", "The", "It", ...).
_LEADING = frozenset((
    "a", "an", "the", "in", "on", "at", "of", "it", "he", "she", "they", "his", "her", "its", "their", "this",
    "that", "these", "those", "there", "after", "before", "during", "when", "while", "as", "by", "for", "from",
    "with", "and", "but", "or", "if", "since",
))
_STOPWORDS = frozenset((
    "a", "an", "the", "of", "in", "on", "at", "to", "for", "by", "with", "from", "and", "or", "is", "was", "are",
    "were", "be", "been", "what", "who", "whom", "whose", "which", "when", "where", "why", "how", "did", "does",
    "do", "that", "this", "these", "those", "as", "into", "than", "then", "it", "its", "his", "her", "their",
    "there",
))


def entity_candidates(text: str, question: str, exclude: Iterable[str] = ()) -> list[str]:
    """Named-entity-like spans of `text` (runs of capitalised words) that the question does not mention."""
    q = f" {normalize_answer(question)} "
    excluded = {normalize_answer(x) for x in exclude}
    out: list[str] = []
    for sentence in SENTENCE_END.split(text):
        for match in _ENTITY.finditer(sentence):
            words = re.sub(r"['’]s?$", "", match.group().rstrip(".,;:-")).split()
            while words and words[0].lower() in _LEADING:
                words = words[1:]
            span = " ".join(words)
            norm = normalize_answer(span)
            if len(norm) < 3 or norm in _STOPWORDS or f" {norm} " in q or norm in excluded:
                continue
            if span not in out:
                out.append(span)
    return out


def contains_words(haystack: str, needle: str) -> bool:
    """Whole-word containment after SQuAD normalisation."""
    needle = normalize_answer(needle)
    return bool(needle) and f" {needle} " in f" {normalize_answer(haystack)} "


def retry_query(question: Question) -> str:
    """A shorter reformulation: subject + relation where the data set records them, else the keywords."""
    subject = question.metadata.get("subj")
    relation = {"occupation": "occupation", "place of birth": "born", "genre": "genre", "country": "country",
                "capital": "capital", "author": "author", "director": "director", "producer": "producer",
                "composer": "composer", "father": "father", "mother": "mother", "religion": "religion",
                "sport": "sport", "color": "color", "capital of": "capital"}
    if subject and question.metadata.get("prop"):
        return f"{subject} {relation.get(str(question.metadata['prop']), str(question.metadata['prop']))}"
    words = [w for w in re.findall(r"[\w'’\-]+", question.question) if w.lower() not in _STOPWORDS]
    return " ".join(words)


def search_query(question: Question) -> str:
    """The first query: the question itself, without its question mark."""
    return question.question.strip().rstrip("?").strip()


# --------------------------------------------------------------------------------------------------
# The forms of a query (the warm start's)


class QueryForm(enum.StrEnum):
    """How a query is written from the question (or, for a second hop, from an entity the results named)."""

    QUESTION = "question"  # the question as written, without its question mark
    KEYWORDS = "keywords"  # its words without stopwords and wh-words, in order
    NO_WH = "no_wh"  # the question without its wh-word (and the auxiliary that follows it)
    SUBJECT_RELATION = "subject_relation"  # subject + relation, where the data records them (PopQA)
    ENTITY = "entity"  # a name of the question (a second hop: the entity the first results named)
    ENTITY_FIRST = "entity_first"  # the keywords reordered: the entity first, then the other keywords
    ENTITY_KEYWORDS = "entity_keywords"  # a second hop: the entity and the question's first keywords


# The forms a first query is drawn from, and those of a second hop (the entity it searches is given).
FIRST_FORMS = (QueryForm.QUESTION, QueryForm.KEYWORDS, QueryForm.NO_WH, QueryForm.SUBJECT_RELATION,
               QueryForm.ENTITY, QueryForm.ENTITY_FIRST)
HOP_FORMS = (QueryForm.ENTITY, QueryForm.ENTITY_KEYWORDS)

_WH = frozenset(("what", "who", "whom", "whose", "which", "when", "where", "why", "how"))
_AUXILIARY = frozenset(("is", "was", "are", "were", "do", "does", "did", "has", "have", "had"))
# Words that split a lower-cased question into phrases (stopwords, pronouns, auxiliaries and modals): a
# phrase of two or more of the words between them stands in for the name a lower-cased question cannot mark.
_FUNCTION = _STOPWORDS | _WH | _AUXILIARY | frozenset((
    "i", "you", "we", "me", "my", "your", "our", "he", "she", "him", "they", "them", "will", "would", "can", "could",
    "should", "shall", "may", "might", "must", "not", "no", "all", "about", "up", "out", "over", "after", "before",
    "between", "during", "under", "name", "many", "much", "s",
))
_PREPOSITIONS = frozenset(("in", "on", "at", "of", "for", "by", "from", "to", "with", "during", "since"))
_WORD = re.compile(r"[\w'’\-]+")
# What the BM25 retriever searches with (eviback.retrieval.bm25: bm25s's tokenizer, lower-cased words of two
# or more characters, without Lucene's English stopwords): two queries with the same terms retrieve the same
# passages.
_TERM = re.compile(r"(?u)\b\w\w+\b")
_RETRIEVER_STOPWORDS = frozenset((
    "a", "an", "and", "are", "as", "at", "be", "but", "by", "for", "if", "in", "into", "is", "it", "no", "not", "of",
    "on", "or", "such", "that", "the", "their", "then", "there", "these", "they", "this", "to", "was", "will", "with",
))


def _keywords(text: str) -> list[str]:
    return [w for w in _WORD.findall(text) if w.lower() not in _STOPWORDS and w.lower() not in _WH]


def question_entity(question: Question) -> str:
    """A name the question holds: the subject where the data records it, else its longest run of capitalised
    words (the first word only when it is not a question or function word), else, in a lower-cased question
    (NQ's), its longest phrase of two or more content words, the word after the wh-word left out (it mostly
    names the relation: "sang", "plays", "part"), the last of equal length (the topic mostly comes last).
    Empty when there is none."""
    subject = question.metadata.get("subj")
    if subject:
        return str(subject).strip()
    text = search_query(question)
    names = []
    for match in _ENTITY.finditer(text):
        words = re.sub(r"['’]s?$", "", match.group().rstrip(".,;:-")).split()
        while words and (words[0].lower() in _LEADING or words[0].lower() in _WH
                         or words[0].lower() in _AUXILIARY):
            words = words[1:]
        name = " ".join(words)
        if words and normalize_answer(name) not in _STOPWORDS and any(c.isupper() for c in name):
            names.append(name)  # a number alone ("2017") is no name
    if names:
        return max(names, key=lambda n: len(n.split()))  # the first of the longest
    runs: list[list[str]] = [[]]
    after_wh = False
    for token in _WORD.findall(text):
        word = re.sub(r"['’]s$", "", token)
        low = word.lower()
        if low in _WH:
            after_wh = True
        if low in _FUNCTION or (after_wh and low not in _WH):
            after_wh = after_wh and (low in _FUNCTION)  # the first content word after the wh-word is skipped
            runs.append([])
        else:
            runs[-1].append(word)
    longest = max((len(r) for r in runs), default=0)
    if longest < 2:
        return ""
    return " ".join([r for r in runs if len(r) == longest][-1])


def _without_wh(text: str) -> str:
    """`text` without its wh-words, a preposition just before one ("In what city"), "many"/"much" after
    "how", and the auxiliary that follows one ("was", "did")."""
    tokens = text.split()
    out: list[str] = []
    dropped = ""  # the wh-word just dropped
    for i, token in enumerate(tokens):
        low = token.strip(",;:").lower()
        if low in _WH:
            dropped = low
            if out and i and out[-1] == tokens[i - 1] and out[-1].lower() in _PREPOSITIONS:
                out.pop()
            continue
        if dropped == "how" and low in ("many", "much"):
            dropped = "how-many"
            continue
        if dropped and low in _AUXILIARY:
            dropped = ""
            continue
        dropped = ""
        out.append(token)
    return " ".join(out)


def query_forms(question: Question) -> dict[QueryForm, str]:
    """The first queries this question can be searched with, by form (in :data:`FIRST_FORMS` order).

    A form the question cannot give (no subject recorded, no name found) is absent, and a form whose query is
    the same text as an earlier form's (after SQuAD normalisation) is left out, so that a draw over the forms
    does not favour one query written twice."""
    asked = search_query(question)
    entity = question_entity(question)
    words = _keywords(asked)
    entity_words = {normalize_answer(w) for w in entity.split()}
    rest = [w for w in words if normalize_answer(w) not in entity_words]
    subject, relation = question.metadata.get("subj"), question.metadata.get("prop")
    candidates = {
        QueryForm.QUESTION: asked,
        QueryForm.KEYWORDS: " ".join(words),
        QueryForm.NO_WH: _without_wh(asked),
        QueryForm.SUBJECT_RELATION: retry_query(question) if subject and relation else "",
        QueryForm.ENTITY: entity,
        QueryForm.ENTITY_FIRST: " ".join([entity, *rest]) if entity and rest else "",
    }
    out: dict[QueryForm, str] = {}
    seen: set[str] = set()
    for form, query in candidates.items():
        norm = normalize_answer(query)
        if norm and norm not in seen:
            seen.add(norm)
            out[form] = query.strip()
    return out


def hop_query(entity: str, question: Question, form: QueryForm, max_keywords: int = 2) -> str:
    """A second hop's query for `entity` (found in the first results) in `form`: the entity alone, or the
    entity followed by the first `max_keywords` keywords of the question that the entity does not hold (the
    question's first keywords mostly name what is asked: "city", "airport", "population")."""
    if form is QueryForm.ENTITY:
        return entity
    if form is not QueryForm.ENTITY_KEYWORDS:
        raise ValueError(f"a second hop is written as one of {', '.join(HOP_FORMS)}, not {form!r}")
    held = {normalize_answer(w) for w in entity.split()}
    extra = [w for w in _keywords(search_query(question)) if normalize_answer(w) not in held][:max_keywords]
    return " ".join([entity, *extra])


def query_terms(query: str) -> frozenset[str]:
    """The terms the BM25 retriever searches `query` with (lower-cased words of two or more characters,
    without its English stopwords). Two queries with the same terms retrieve the same passages (BM25 ignores
    word order), so a search again must change them to see anything new."""
    return frozenset(w for w in _TERM.findall(query.lower()) if w not in _RETRIEVER_STOPWORDS)


def draw_form(forms: Sequence[QueryForm] | Mapping[QueryForm, str], seed: int, question: Question,
              purpose: str, prefer: Sequence[QueryForm] = (), share: float = 0.0) -> QueryForm:
    """One of `forms`, drawn by a generator seeded with `seed`, the question (id and text) and `purpose` (a
    first query and a second one are separate draws): the same build seed and question always give the same
    form, whatever else the build holds, in any process (string seeds are hashed by SHA-512, not by Python's
    per-process hash).

    The first of `prefer` that `forms` holds is drawn with probability `share` and the others uniformly
    with the rest; without one (or with `share` 0) the draw is uniform over `forms`."""
    choices = list(forms)
    if not choices:
        raise ValueError(f"no query form to draw from for question {question.id!r}")
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share must be in [0, 1], not {share!r}")
    rng = random.Random(f"{seed}\x1f{question.id}\x1f{question.question}\x1f{purpose}")
    preferred = next((form for form in prefer if form in choices), None)
    if preferred is None or share == 0.0 or len(choices) == 1:
        return choices[rng.randrange(len(choices))]
    if rng.random() < share:
        return preferred
    rest = [form for form in choices if form is not preferred]
    return rest[rng.randrange(len(rest))]


__all__ = [
    "FIRST_FORMS", "HOP_FORMS", "SENTENCE_END", "QueryForm", "contains_words", "draw_form", "entity_candidates",
    "hop_query", "query_forms", "query_terms", "question_entity", "retry_query", "search_query",
]
