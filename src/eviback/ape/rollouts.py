"""The rollouts E2E-APE judges: loading, sufficiency labels, the deterministic split, and perturbations.

- :func:`read_dump` reads rollout dumps of the actor (training rollout dumps ``rollouts/step-<N>.jsonl.gz``:
  group records with a ``rollouts`` (or ``trajectories``) list; bare trajectories); gzip is transparent.
- :func:`evidence_label`: the objective label of a rollout, the S/A/I evidence label of
  :mod:`eviback.teacher.labels` (from the gold answers, the supporting passages and the evidence as the actor
  saw it); ``sufficient`` is True for S, False for I and None for A (an A rollout counts for every gate but
  not for the S-vs-I objective).
- :func:`split_rollouts`: train / validation / sealed test, by a salted hash of the **question id**, so every
  rollout of a question lands in the same split and the assignment never depends on file order. The test
  split is a :class:`SealedSplit`: its size and hash are public, its rollouts are handed out only once a
  winner has been selected.
- :func:`reorder_evidence` and :func:`paraphrase_question`: the perturbations of the stability checks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from eviback.ape.records import Split, SplitInfo
from eviback.data import DataError, read_jsonl
from eviback.metrics import exact_match
from eviback.protocol import join_observation, split_observation
from eviback.teacher.judge import read_trajectories
from eviback.teacher.labels import trajectory_label
from eviback.types import Passage, Status, Trajectory, from_dict, to_dict


@dataclass(frozen=True)
class Rollout:
    """A rollout to judge, with its stable key and its evidence label."""

    key: str  # "<question id>#<12 hex digits of the trajectory's content hash>": unique, order-independent
    trajectory: Trajectory
    sufficient: bool | None  # the objective: True for label S, False for I, None for A
    label: Status | None = None  # the S/A/I evidence label (eviback.teacher.labels)

    @property
    def question_id(self) -> str:
        return self.trajectory.question.id


def trajectory_sha256(trajectory: Trajectory) -> str:
    text = json.dumps(to_dict(dataclasses.replace(trajectory, tokens=None)), sort_keys=True,
                      separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def evidence_label(trajectory: Trajectory) -> Status:
    """The S/A/I label of the evidence the actor saw (:func:`eviback.teacher.labels.trajectory_label`)."""
    return trajectory_label(trajectory)


def sufficiency_label(trajectory: Trajectory) -> bool | None:
    """The objective's label: True when the evidence label is S, False when I, None when A."""
    return {Status.SUFFICIENT: True, Status.INSUFFICIENT: False}.get(evidence_label(trajectory))


def as_rollouts(trajectories: Iterable[Trajectory]) -> tuple[list[Rollout], int]:
    """Keyed, labelled rollouts; exact duplicates are dropped (returned: the rollouts, how many dropped)."""
    out: dict[str, Rollout] = {}
    duplicates = 0
    for t in trajectories:
        t = dataclasses.replace(t, tokens=None)  # token ids never reach a teacher; keep memory small
        key = f"{t.question.id}#{trajectory_sha256(t)[:12]}"
        if key in out:
            duplicates += 1
            continue
        label = evidence_label(t)
        out[key] = Rollout(key, t, {Status.SUFFICIENT: True, Status.INSUFFICIENT: False}.get(label), label)
    return list(out.values()), duplicates


def read_dump(path: str | Path) -> list[Trajectory]:
    """Trajectories of one dump: lines are trajectories, records with a `trajectory` key (evaluation), or
    group records with a `trajectories` (or `rollouts`) list of either (training's groups.jsonl)."""
    first = next(iter(read_jsonl(path)), None)
    if not (isinstance(first, dict) and any(isinstance(first.get(k), list) for k in ("trajectories", "rollouts"))):
        return read_trajectories(path)
    out = []
    for number, obj in enumerate(read_jsonl(path), start=1):
        items = obj.get("trajectories", obj.get("rollouts")) if isinstance(obj, dict) else None
        if not isinstance(items, list):
            raise DataError(path, number, "expected a group record with a 'trajectories' list")
        for item in items:
            if isinstance(item, dict) and isinstance(item.get("trajectory"), dict):
                item = item["trajectory"]
            try:
                out.append(from_dict(Trajectory, item))
            except (ValueError, TypeError, KeyError) as e:
                raise DataError(path, number, f"malformed trajectory in the group: {e}") from None
    return out


def keep_all_zero(trajectories: Sequence[Trajectory]) -> list[Trajectory]:
    """Only the rollouts of questions none of whose rollouts is a verified hit (EM 1)."""
    hit = {t.question.id for t in trajectories if exact_match(t.answer, t.question.golden_answers) == 1.0}
    return [t for t in trajectories if t.question.id not in hit]


# --------------------------------------------------------------------------------------------------
# The split


def split_of(question_id: str, salt: str, train: float, validation: float) -> Split:
    """The split of a question: a salted SHA-256 of its id mapped to [0, 1)."""
    digest = hashlib.sha256(f"{salt}\x00{question_id}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    if u < train:
        return Split.TRAIN
    if u < train + validation:
        return Split.VALIDATION
    return Split.TEST


def split_info(name: Split, rollouts: Sequence[Rollout]) -> SplitInfo:
    keys = sorted(r.key for r in rollouts)
    return SplitInfo(
        name=name, questions=len({r.question_id for r in rollouts}), rollouts=len(rollouts),
        labelled=sum(r.sufficient is not None for r in rollouts), sufficient=sum(r.sufficient is True for r in rollouts),
        sha256=hashlib.sha256("\n".join(keys).encode("utf-8")).hexdigest())


class SealedError(RuntimeError):
    """The sealed test split was asked for before a winner was selected, or for another selection."""


class SealedSplit:
    """The test split. Its rollouts are handed out only by :meth:`unseal`, for one recorded selection: the
    choice of the winner can never have seen them."""

    def __init__(self, rollouts: Sequence[Rollout]) -> None:
        self._rollouts = tuple(sorted(rollouts, key=lambda r: r.key))
        self.info = split_info(Split.TEST, self._rollouts)
        self._opened_for: str | None = None

    def __len__(self) -> int:
        return len(self._rollouts)

    def unseal(self, selection: str) -> tuple[Rollout, ...]:
        """The test rollouts, for the selection identified by `selection` (e.g. the selection event's digest).
        Asking again for the same selection (a resumed run) is allowed; for another one it is refused."""
        if not selection:
            raise SealedError("the sealed test split opens only for a recorded selection")
        if self._opened_for is not None and self._opened_for != selection:
            raise SealedError("the sealed test split was already read for another selection; a test split is "
                              "read once: start a new run (another --out) to select again")
        self._opened_for = selection
        return self._rollouts


@dataclass(frozen=True)
class RolloutSplits:
    train: tuple[Rollout, ...]
    validation: tuple[Rollout, ...]
    test: SealedSplit

    def infos(self) -> tuple[SplitInfo, ...]:
        return (split_info(Split.TRAIN, self.train), split_info(Split.VALIDATION, self.validation), self.test.info)


def split_rollouts(rollouts: Sequence[Rollout], *, salt: str, train: float, validation: float) -> RolloutSplits:
    """Split by question (see :func:`split_of`); each split sorted by key, so input order never matters."""
    parts: dict[Split, list[Rollout]] = {s: [] for s in Split}
    for r in rollouts:
        parts[split_of(r.question_id, salt, train, validation)].append(r)
    key = lambda r: r.key  # noqa: E731
    return RolloutSplits(tuple(sorted(parts[Split.TRAIN], key=key)),
                         tuple(sorted(parts[Split.VALIDATION], key=key)), SealedSplit(parts[Split.TEST]))


def subset(rollouts: Sequence[Rollout], n: int, salt: str) -> tuple[Rollout, ...]:
    """A deterministic subset of `n` rollouts (all when fewer): the smallest salted hashes of their keys."""
    ranked = sorted(rollouts, key=lambda r: hashlib.sha256(f"{salt}\x00{r.key}".encode()).hexdigest())
    return tuple(sorted(ranked[:n], key=lambda r: r.key))


# --------------------------------------------------------------------------------------------------
# Perturbations for the stability checks


def _seen_docs(trajectory: Trajectory) -> list[tuple[int, Passage, str]]:
    """(turn index, passage, text seen) for each passage whose header survived the observation cut, in the
    distinct observations of the executed searches (a repeated identical result once, as
    :func:`eviback.teacher.workflow.evidence_as_seen` shows it)."""
    out, observations = [], set()
    for t, turn in enumerate(trajectory.turns):
        if not turn.executed or not turn.passages or turn.observation in observations:
            continue
        observations.add(turn.observation)
        docs = split_observation(turn.observation, len(turn.passages)).docs
        out.extend((t, passage, doc) for passage, doc in zip(turn.passages, docs, strict=False))
    return out


def reorder_evidence(trajectory: Trajectory, salt: str = "") -> Trajectory | None:
    """The same rollout with the passages it saw in another order: a seeded permutation across all its
    searches of each passage's text *as the actor saw it* (a passage the observation cut shortened stays
    shortened; one cut away entirely stays unseen), each search keeping its number of seen passages. A
    repeated identical search result is permuted once and repeated. None when fewer than 2 distinct seen
    passages exist: such a rollout has no other order, and counting it would inflate agreement."""
    seen = _seen_docs(trajectory)
    original = [doc for _, _, doc in seen]
    if len(set(original)) < 2:
        return None
    digest = hashlib.sha256(f"{salt}\x00{trajectory_sha256(trajectory)}".encode()).digest()
    order = sorted(range(len(seen)), key=lambda i: hashlib.sha256(digest + i.to_bytes(4, "big")).digest())
    for shift in range(len(seen)):
        permuted = [seen[order[(i + shift) % len(seen)]] for i in range(len(seen))]
        turns, start, rebuilt = list(trajectory.turns), 0, {}
        for t, turn in enumerate(trajectory.turns):
            if turn.observation in rebuilt:  # a repeated result: repeated as rebuilt
                turns[t] = dataclasses.replace(turn, passages=rebuilt[turn.observation].passages,
                                               observation=rebuilt[turn.observation].observation)
                continue
            count = sum(1 for u, _, _ in seen if u == t)
            if not count:
                continue
            chunk = permuted[start:start + count]
            start += count
            parts = split_observation(turn.observation, len(turn.passages))
            turns[t] = dataclasses.replace(
                turn, passages=tuple(p for _, p, _ in chunk) + turn.passages[count:],
                observation=join_observation(dataclasses.replace(parts, docs=tuple(d for _, _, d in chunk))))
            rebuilt[turn.observation] = turns[t]
        candidate = dataclasses.replace(trajectory, turns=tuple(turns))
        after = [doc for _, _, doc in _seen_docs(candidate)]
        if after != original and sorted(after) == sorted(original):
            return candidate
    return None


_REWORDINGS = (
    "Can you tell me: {core}?",
    "Here is a question: {core}?",
    "Please answer the following question. {core}?",
    "I would like to know the answer to this: {core}?",
)
_CONTRACTIONS = {"what's": "what is", "who's": "who is", "where's": "where is", "when's": "when is",
                 "how's": "how is", "isn't": "is not", "wasn't": "was not", "didn't": "did not"}


def reword(question: str, key: str) -> str:
    """A rule-based rewording that keeps the meaning: contractions expanded and one of a few neutral
    framings, chosen by a hash of `key`. Always differs from `question`."""
    words = [_CONTRACTIONS.get(w.lower(), w) for w in question.strip().split()]
    core = " ".join(words).rstrip(" ?.")
    if core[:1].isupper() and not core[1:2].isupper():
        core = core[0].lower() + core[1:]  # "Who wrote..." -> "who wrote..." after a framing
    index = int(hashlib.sha256(key.encode()).hexdigest(), 16) % len(_REWORDINGS)
    return _REWORDINGS[index].format(core=core)


def load_paraphrases(path: str | Path) -> dict[str, str]:
    """{question id: paraphrase} from a JSONL file of `{"id", "paraphrase"}` lines."""
    out = {}
    for number, obj in enumerate(read_jsonl(path), start=1):
        if not isinstance(obj, dict) or not isinstance(obj.get("id"), str | int) or not isinstance(
                obj.get("paraphrase"), str) or not obj["paraphrase"].strip():
            raise DataError(path, number, "expected {\"id\": ..., \"paraphrase\": \"...\"}")
        out[str(obj["id"])] = obj["paraphrase"].strip()
    return out


def paraphrase_question(trajectory: Trajectory, paraphrases: Mapping[str, str] | None = None) -> Trajectory:
    """The same rollout with its question reworded (a given paraphrase for its id, else :func:`reword`)."""
    question = trajectory.question
    text = (paraphrases or {}).get(question.id) or reword(question.question, question.id)
    return dataclasses.replace(trajectory, question=dataclasses.replace(question, question=text))
