"""What a run did, in a few plain sentences and a small table: the top of its report, read from its directory.

    from eviback.train.report_summary import summarize_run
    summary = summarize_run("runs/demo")
    print("\\n".join(summary.sentences()))

It answers, from the files a run writes (config.yaml, metrics.jsonl, groups.jsonl, teacher.json, eval/ and
eval-start/), the questions a reader of the run asks first:

- what was trained, and for how long;
- how many groups had a verified hit, how many fell back (to the teacher, or to the F1 rule), and how many of
  those got an informative reward (rewards that differ inside the group, so advantages that are not all 0);
- for the fallback groups, how many held rollouts that retrieved different passages, and how many whose
  evidence labels differ (a gold answer in some rollouts' evidence and not in others: the most any evidence
  judge, even a perfect one, could tell apart), and how often the teacher turned that into a signal;
- the evidence judge's measured gate (its held-out figures, from teacher.json or else its record in the
  cache, and its agreement with the evidence labels in this run), and whether it is weak;
- where the held-out questions evaluated during training (`val_every`: metrics.jsonl's `val/*`) started, ended
  and peaked;
- the held-out figures before and after training, with paired bootstrap intervals (:mod:`eviback.stats`),
  and whether those include 0.

Pure reading: nothing here loads a model. A part whose files are missing (an older run, no held-out
evaluation, no teacher) is None and left out of the sentences.
"""

from __future__ import annotations

import gzip
import json
import math
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from eviback.backoff import BackoffConfig
from eviback.evaluate import ITEMS_FILE
from eviback.metrics import normalize_answer
from eviback.stats import PairedInterval, paired_bootstrap
from eviback.teacher.evidence_judge import CLASSIFIER_PREFIX, JUDGE_FILE, competence, find_judge
from eviback.teacher.labels import gate_balanced_accuracy

BOOTSTRAP_SAMPLES = 2000
BOOTSTRAP_SEED = 0
HIT = BackoffConfig().hit_threshold  # the EM of a verified hit


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of `path`, or of `path.gz` when only the archived copy exists (committed results); [] when
    neither does. A line that does not parse (the torn last line of a killed writer) is skipped."""
    for candidate in (path, path.with_name(path.name + ".gz")):
        if candidate.exists():
            raw = gzip.decompress(candidate.read_bytes()) if candidate.suffix == ".gz" else candidate.read_bytes()
            records = []
            for line in raw.decode("utf-8").splitlines():
                if not line.strip():
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
            return records
    return []


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


# --------------------------------------------------------------------------------------------------
# The parts


@dataclass(frozen=True)
class Training:
    """What was trained and for how long (from config.yaml and metrics.jsonl)."""

    mode: str
    model: str
    warm_start: bool
    steps: int
    questions_per_step: int | None
    group_size: int | None
    learning_rate: float | None
    lam: float | None
    seconds: float | None  # the sum of the steps' time/step
    final_kl: float | None  # train/kl of the last step


@dataclass(frozen=True)
class Groups:
    """Counts over every group of every step (groups.jsonl; metrics.jsonl when a run has no group records)."""

    groups: int
    verified: int  # some rollout with EM 1
    all_zero: int  # no verified hit
    unused: int  # all-zero groups that trained on nothing: no fallback reward (grpo), advantage 0
    fallback: int  # all-zero groups given fallback rewards (judged without error, or the F1 rule)
    informative: int  # fallback groups whose advantages are not all 0
    teacher_error: int
    dropped: int  # DAPO: groups whose rollouts all scored alike
    informative_steps: tuple[int, ...]  # the steps with an informative group
    fallback_by_step: Mapping[int, tuple[int, int]]  # step -> (fallback, informative)
    # From the group records only (None without them):
    evidence_differs: int | None = None  # fallback groups whose rollouts retrieved different passages
    informative_where_evidence_differs: int | None = None
    labelled: int | None = None  # fallback groups whose records carry the rollouts' evidence labels
    labels_differ: int | None = None  # of those, the ones whose labels differ: a perfect evidence judge's ceiling
    informative_where_labels_differ: int | None = None
    all_zero_labelled: int | None = None
    all_zero_labels_alike: int | None = None  # the gold in every rollout's evidence, or in none
    all_zero_rollouts: int | None = None
    first_query_is_question: int | None = None  # all-zero rollouts whose first search was the question as written
    all_zero_same_passages: int | None = None  # all-zero groups whose rollouts all retrieved the same passages


@dataclass(frozen=True)
class JudgeGate:
    """Stage A as a gate (I against not-I): the judge's held-out figures and its agreement in this run."""

    judge: str | None  # the judge's sha256 (first 12), None when Stage A was not a trained judge
    oracle: bool  # Stage A was the oracle: the evidence labels, computed from the gold (a ceiling)
    heldout_gate: float | None  # balanced accuracy I vs not-I on the judge's held-out training questions
    heldout_n: int | None
    heldout_rollout_gate: float | None  # the same on held-out actor rollouts, where a build has them
    floor: float | None  # the held-out gate below which a judge is weak (where the record says)
    found: bool  # whether the judge's held-out figures were found (teacher.json, or its record in the cache)
    run_gate: float | None  # against the evidence labels of the rollouts it judged in this run (metrics)
    run_closed_on_i: int
    run_label_i: int
    run_open_on_open: int
    run_label_open: int
    weak: bool | None = None  # the judge's own held-out figures call it weak (None: not recorded)
    weak_accepted: bool | None = None  # the run trained with it although weak (accept_weak_judge)


@dataclass(frozen=True)
class HeldOut:
    """The starting and the trained policy on the same held-out questions (overall macro average)."""

    items: int
    benchmarks: int
    f1_before: float
    f1_after: float
    em_before: float
    em_after: float
    f1: PairedInterval
    em: PairedInterval
    answers_changed: int  # items whose normalised final answer differs between the two policies


@dataclass(frozen=True)
class ValidationPoint:
    step: int
    em: float
    f1: float


@dataclass(frozen=True)
class Validation:
    """The held-out questions evaluated during training (metrics.jsonl's `val/em`, `val/f1`, `val/questions`)."""

    every: int | None  # val_every (config.yaml); None when not recorded
    questions: int | None  # questions of the last validation (every one evaluates the same)
    points: tuple[ValidationPoint, ...]  # in step order, at least one

    @property
    def first(self) -> ValidationPoint:
        return self.points[0]

    @property
    def last(self) -> ValidationPoint:
        return self.points[-1]

    @property
    def best(self) -> ValidationPoint:
        """The highest EM (the earliest such step on a tie)."""
        return max(self.points, key=lambda p: (p.em, -p.step))


@dataclass(frozen=True)
class RunSummary:
    name: str
    training: Training
    groups: Groups | None
    gate: JudgeGate | None
    held_out: HeldOut | None
    teacher: bool  # the run's fallback rewards came from a teacher (mode eviback)
    validation: Validation | None = None  # None: the run did not validate during training

    def sentences(self) -> list[str]:
        """The summary in plain sentences, most important first."""
        return summary_sentences(self)

    def table(self) -> list[tuple[str, str]]:
        """(what, figure) rows of the small table beside the sentences."""
        return summary_table(self)


# --------------------------------------------------------------------------------------------------
# Reading a run directory


def summarize_run(run_dir: str | Path, *, samples: int = BOOTSTRAP_SAMPLES, seed: int = BOOTSTRAP_SEED) -> RunSummary:
    root = Path(run_dir)
    config = {}
    if (root / "config.yaml").exists():
        config = yaml.safe_load((root / "config.yaml").read_text(encoding="utf-8")) or {}
    metrics = read_jsonl(root / "metrics.jsonl")
    group_records = read_jsonl(root / "groups.jsonl")
    teacher = _read_json(root / "teacher.json")
    mode = str(config.get("mode", "eviback"))
    return RunSummary(
        name=root.name,
        training=_training(config, metrics),
        groups=_groups(group_records) if group_records else _groups_from_metrics(metrics),
        gate=_gate(teacher, metrics) if mode == "eviback" else None,
        held_out=_held_out(root / "eval-start", root / "eval", samples, seed),
        teacher=mode == "eviback",
        validation=_validation(config, metrics),
    )


def summary_text(run_dir: str | Path, width: int = 110) -> str:
    """The summary's sentences as a terminal prints them: a bulleted list, wrapped at `width`."""
    return "\n".join(textwrap.fill(sentence, width=width, initial_indent="- ", subsequent_indent="  ")
                     for sentence in summarize_run(run_dir).sentences())


def _number(x: Any) -> float | None:
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def _training(config: Mapping[str, Any], metrics: Sequence[Mapping[str, Any]]) -> Training:
    times = [float(r["time/step"]) for r in metrics if r.get("time/step") is not None]
    kl = next((r["train/kl"] for r in reversed(metrics) if r.get("train/kl") is not None), None)
    return Training(
        mode=str(config.get("mode", "eviback")), model=str(config.get("model", "?")),
        warm_start=bool(config.get("warm_start", True)),
        steps=max((int(r["step"]) for r in metrics), default=0),
        questions_per_step=config.get("questions_per_step"), group_size=config.get("group_size"),
        learning_rate=_number(config.get("learning_rate")), lam=_number(config.get("lam")),
        seconds=sum(times) if times else None, final_kl=_number(kl))


def _validation(config: Mapping[str, Any], metrics: Sequence[Mapping[str, Any]]) -> Validation | None:
    points = tuple(ValidationPoint(int(r["step"]), float(r["val/em"]), float(r.get("val/f1") or 0.0))
                   for r in sorted(metrics, key=lambda r: int(r["step"])) if r.get("val/em") is not None)
    if not points:
        return None
    questions = next((int(r["val/questions"]) for r in reversed(metrics) if r.get("val/questions") is not None),
                     None)
    every = config.get("val_every")
    return Validation(every=int(every) if every else None, questions=questions, points=points)


def _passages(rollout: Mapping[str, Any]) -> frozenset:
    return frozenset(pid for ids in rollout.get("passage_ids") or () for pid in ids)


def _groups(records: Sequence[Mapping[str, Any]]) -> Groups:
    counts = dict.fromkeys(("groups", "verified", "all_zero", "unused", "fallback", "informative", "teacher_error", "dropped",
                            "evidence_differs", "informative_where_evidence_differs", "all_zero_rollouts",
                            "first_query_is_question", "all_zero_same_passages"), 0)
    labelled = dict.fromkeys(("labelled", "labels_differ", "informative_where_labels_differ", "all_zero_labelled",
                              "all_zero_labels_alike"), 0)
    by_step: dict[int, list[int]] = {}
    for g in records:
        kind = g.get("kind")
        counts["groups"] += 1
        counts["verified"] += kind == "verified"
        counts["teacher_error"] += kind == "teacher_error"
        counts["dropped"] += kind == "dropped"
        counts["unused"] += kind == "all_zero"
        rollouts = g.get("summaries") or ()
        labels = g.get("labels") or []
        same_passages = len({_passages(r) for r in rollouts}) <= 1
        if not any(float(e) >= HIT for e in g.get("em") or ()):
            counts["all_zero"] += 1
            counts["all_zero_rollouts"] += len(rollouts)
            counts["all_zero_same_passages"] += same_passages
            question = normalize_answer(str(g.get("question", "")))
            counts["first_query_is_question"] += sum(bool(r.get("queries")) and
                                                     normalize_answer(r["queries"][0]) == question for r in rollouts)
            if labels:
                labelled["all_zero_labelled"] += 1
                labelled["all_zero_labels_alike"] += len(set(labels)) == 1
        if kind != "fallback":
            continue
        informative = any(float(a) != 0.0 for a in g.get("advantages") or ())
        step = by_step.setdefault(int(g.get("step", 0)), [0, 0])
        step[0] += 1
        step[1] += informative
        counts["fallback"] += 1
        counts["informative"] += informative
        if not same_passages:
            counts["evidence_differs"] += 1
            counts["informative_where_evidence_differs"] += informative
        if labels:
            labelled["labelled"] += 1
            if len(set(labels)) > 1:
                labelled["labels_differ"] += 1
                labelled["informative_where_labels_differ"] += informative
    # without labels or passage ids in the records (runs logged before they were kept), those counts are
    # unknown, not 0
    if not any("passage_ids" in r for g in records for r in g.get("summaries") or ()):
        counts.update(dict.fromkeys(("evidence_differs", "informative_where_evidence_differs", "all_zero_rollouts",
                                     "first_query_is_question", "all_zero_same_passages")))
    fallback_labels = {k: (v if labelled["labelled"] else None) for k, v in labelled.items() if "all_zero" not in k}
    all_zero_labels = {k: (v if labelled["all_zero_labelled"] else None) for k, v in labelled.items() if "all_zero" in k}
    return Groups(**counts, **fallback_labels, **all_zero_labels,
                  informative_steps=tuple(s for s, (_, i) in sorted(by_step.items()) if i),
                  fallback_by_step={s: (f, i) for s, (f, i) in sorted(by_step.items())})


def _groups_from_metrics(metrics: Sequence[Mapping[str, Any]]) -> Groups | None:
    """The counts a run without group records still has, from its step metrics."""
    if not metrics:
        return None

    def total(key: str) -> int:
        return int(sum(r.get(key) or 0 for r in metrics))

    groups = total("backoff/groups")
    all_zero = round(sum((r.get("backoff/all_zero_share") or 0) * (r.get("backoff/groups") or 0) for r in metrics))
    by_step = {int(r["step"]): (int(r.get("backoff/fallback_groups") or 0),
                                int(r.get("backoff/informative_fallback_groups") or 0)) for r in metrics}
    return Groups(
        groups=groups,
        verified=round(sum((r.get("backoff/verified_share") or 0) * (r.get("backoff/groups") or 0) for r in metrics)),
        all_zero=all_zero,
        unused=max(0, all_zero - total("backoff/fallback_groups") - total("backoff/teacher_error_groups")
                   - total("backoff/dropped_groups")),
        fallback=total("backoff/fallback_groups"), informative=total("backoff/informative_fallback_groups"),
        teacher_error=total("backoff/teacher_error_groups"), dropped=total("backoff/dropped_groups"),
        informative_steps=tuple(s for s, (_, i) in sorted(by_step.items()) if i),
        fallback_by_step={s: v for s, v in sorted(by_step.items()) if v[0]},
    )


def _judge_sha(teacher: Mapping[str, Any]) -> str | None:
    """The sha256 of the trained judge that decided Stage A: from the run's record of it, else from the stage
    backend of the policy it used (runs recorded before teacher.json named the judge)."""
    record = teacher.get("evidence_judge")
    if isinstance(record, dict) and record.get("sha256"):
        return str(record["sha256"])
    for stage in (teacher.get("policy_used_content") or {}).get("stages") or ():
        backend = str(stage.get("backend") or "") if isinstance(stage, dict) else ""
        if backend.startswith(CLASSIFIER_PREFIX):
            return backend[len(CLASSIFIER_PREFIX):]
    return None


def _held_out_figures(teacher: Mapping[str, Any], sha: str) -> dict[str, Any] | None:
    """The judge's held-out figures as :class:`eviback.teacher.evidence_judge.Competence` names them: from the
    run's teacher.json (`evidence_judge`), else from the judge's record in this machine's cache."""
    record = teacher.get("evidence_judge")
    if isinstance(record, dict) and "gate" in record:
        return record
    try:
        directory = find_judge(sha)
    except FileNotFoundError:
        return None
    if _read_json(directory / JUDGE_FILE) is None:
        return None
    return competence(directory).to_dict()


def _gate(teacher: Mapping[str, Any] | None, metrics: Sequence[Mapping[str, Any]]) -> JudgeGate | None:
    counts = {k: int(sum(r.get(f"teacher/gate_{k}") or 0 for r in metrics))
              for k in ("label_i", "closed_on_i", "label_open", "open_on_open")}
    sha = _judge_sha(teacher) if teacher else None
    if sha is None and not any(counts.values()):
        return None
    figures = _held_out_figures(teacher or {}, sha) if sha else None
    found = figures is not None
    figures = figures or {}
    weak = figures.get("weak")
    accepted = figures.get("weak_accepted")
    return JudgeGate(
        judge=sha[:12] if sha else None, oracle=bool((teacher or {}).get("oracle_used")), heldout_gate=_number(figures.get("gate")), heldout_n=figures.get("n"),
        heldout_rollout_gate=_number((figures.get("by_source") or {}).get("rollout")),
        floor=_number(figures.get("floor")), found=found, run_gate=gate_balanced_accuracy(**counts),
        run_closed_on_i=counts["closed_on_i"], run_label_i=counts["label_i"],
        run_open_on_open=counts["open_on_open"], run_label_open=counts["label_open"],
        weak=None if weak is None else bool(weak), weak_accepted=None if accepted is None else bool(accepted))


def _item_scores(eval_dir: Path) -> dict[tuple[str, str], Mapping[str, Any]]:
    return {(str(r["benchmark"]), str(r["id"])): r for r in read_jsonl(eval_dir / ITEMS_FILE)
            if "benchmark" in r and "id" in r}


def _macro(items: Mapping[tuple[str, str], Mapping[str, Any]], keys: Sequence[tuple[str, str]], metric: str) -> float:
    by_benchmark: dict[str, list[float]] = {}
    for key in keys:
        by_benchmark.setdefault(key[0], []).append(float(items[key][metric]))
    return sum(sum(v) / len(v) for v in by_benchmark.values()) / len(by_benchmark)


def _answer(record: Mapping[str, Any]) -> str | None:
    answer = record.get("answer")
    return None if answer is None else normalize_answer(str(answer))


def _held_out(before_dir: Path, after_dir: Path, samples: int, seed: int) -> HeldOut | None:
    before, after = _item_scores(before_dir), _item_scores(after_dir)
    keys = sorted(set(before) & set(after))
    if not keys:
        return None

    def interval(metric: str) -> PairedInterval:
        return paired_bootstrap({k: float(before[k][metric]) for k in keys}, {k: float(after[k][metric]) for k in keys},
                                samples=samples, seed=seed)

    return HeldOut(items=len(keys), benchmarks=len({k[0] for k in keys}),
                   f1_before=_macro(before, keys, "f1"), f1_after=_macro(after, keys, "f1"),
                   em_before=_macro(before, keys, "em"), em_after=_macro(after, keys, "em"),
                   f1=interval("f1"), em=interval("em"),
                   answers_changed=sum(_answer(before[k]) != _answer(after[k]) for k in keys))


# --------------------------------------------------------------------------------------------------
# Rendering: sentences and a table (the report and the terminal share them)


def _of(part: int, whole: int) -> str:
    return f"{part} of {whole}"


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "n/a"


def _signed(x: float) -> str:
    return f"{x:+.3f}"


def _interval(i: PairedInterval) -> str:
    return f"{_signed(i.diff)} [{_signed(i.lo)}, {_signed(i.hi)}]"


def _steps(steps: Sequence[int]) -> str:
    words = [str(s) for s in steps]
    if len(words) == 1:
        return f"step {words[0]}"
    if len(words) > 4:
        return f"in {len(words)} steps, the first at step {words[0]}"
    return "steps " + ", ".join(words[:-1]) + " and " + words[-1]


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} minutes" if seconds >= 60 else f"{seconds:.0f} s"


def _rate(x: float | None) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]


def _who(summary: RunSummary) -> str:
    return "the teacher" if summary.teacher else "the F1 rule"


def summary_sentences(s: RunSummary) -> list[str]:
    t, g, gate, h = s.training, s.groups, s.gate, s.held_out
    out = []
    shape = (f" of {_n(t.questions_per_step, 'question')} x {_n(t.group_size, 'rollout')}"
             if t.questions_per_step and t.group_size else "")
    took = f", {_minutes(t.seconds)} of training" if t.seconds else ""
    lr = f" at learning rate {t.learning_rate:g}" if t.learning_rate is not None else ""
    lam = f" (lambda {t.lam:g})" if t.lam is not None and t.mode in ("eviback", "f1-fallback") else ""
    start = "from its warm start" if t.warm_start else "from the base model"
    out.append(f"This run trained {t.model} {start} with {t.mode}{lam} for {_n(t.steps, 'step')}{shape}{lr}{took}.")
    if g is not None and g.groups:
        out.append(_groups_sentence(s, g))
        if g.fallback and g.evidence_differs is not None:
            out.append(_evidence_sentence(s, g))
        if g.all_zero and g.all_zero_rollouts:
            out.append(_alike_sentence(g))
    if gate is not None:
        out.append(_gate_sentence(gate))
    if s.validation is not None:
        out.append(_validation_sentence(s.validation))
    if h is not None:
        out.extend(_held_out_sentences(h))
    return out


def _validation_sentence(v: Validation) -> str:
    on = f"on {v.questions} held-out questions" if v.questions else "on held-out questions"
    if len(v.points) == 1:
        p = v.first
        return f"Validated once during training, after step {p.step}, {on} (greedy): EM {p.em:.3f}, F1 {p.f1:.3f}."
    every = f", every {_n(v.every, 'step')}" if v.every else ""
    best = v.best
    peak = (f"; its best EM was {best.em:.3f}, after step {best.step}"
            if best.step not in (v.first.step, v.last.step) else "")
    sentence = (f"Validated {len(v.points)} times during training {on} (greedy{every}): EM went from "
                f"{v.first.em:.3f} after step {v.first.step} to {v.last.em:.3f} after step {v.last.step}, F1 from "
                f"{v.first.f1:.3f} to {v.last.f1:.3f}{peak}.")
    if v.questions:
        sentence += (f" Each point is one pass over the same {v.questions} questions, where one answer moves EM by "
                     f"about {1 / v.questions:.3f}.")
    return sentence


def _alike_sentence(g: Groups) -> str:
    """Why an evidence judge is mostly silent: the all-zero groups' rollouts searched and saw alike."""
    searched = (f"In the {g.all_zero} all-zero groups, {_of(g.first_query_is_question, g.all_zero_rollouts)} "
                f"rollouts searched first for the question as written, and in {_n(g.all_zero_same_passages, 'group')} "
                "every rollout retrieved the same passages")
    if g.all_zero_labels_alike is None:
        return searched + ": an evidence judge gives such a group one verdict, so no signal."
    return (f"{searched}. In {_of(g.all_zero_labels_alike, g.all_zero_labelled)} "
            f"({_pct(g.all_zero_labels_alike, g.all_zero_labelled)}) every rollout's evidence had the same label, a "
            "gold answer in all of them or in none: an evidence judge, even a perfect one, gives such a group one "
            "verdict, so no signal.")


def _groups_sentence(s: RunSummary, g: Groups) -> str:
    parts = [f"Of its {g.groups} groups, {g.verified} had a verified hit (a rollout with EM 1)"]
    if g.dropped:
        parts.append(f"{g.dropped} were dropped (every rollout scored alike)")
    if g.fallback or s.training.mode in ("eviback", "f1-fallback"):
        parts.append(f"{g.fallback} fell back to {_who(s)}")
    if g.unused:
        parts.append(f"{g.unused} had none and trained on nothing (advantage 0)")
    if g.teacher_error:
        parts.append(f"{g.teacher_error} had a teacher error (advantage 0)")
    sentence = ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1] + "."
    if g.fallback:
        if g.informative:
            late = len(g.informative_steps) <= 4 and g.informative_steps[0] > min(g.fallback_by_step, default=1)
            when = f" ({_steps(g.informative_steps)}{'; none before' if late else ''})"
            rest = g.fallback - g.informative
            sentence += (f" {_capital(_who(s))} gave an informative reward (rewards that differ inside the group, "
                         f"so a non-zero advantage) to {_of(g.informative, g.fallback)}{when}; "
                         + (f"the other {rest} got one reward for every rollout, advantage 0, and taught nothing."
                            if rest else "every fallback group carried a signal."))
        else:
            sentence += (f" {_capital(_who(s))} gave none of them an informative reward (every rollout of a group "
                         "got the same reward): the fallback groups taught nothing.")
    return sentence


def _evidence_sentence(s: RunSummary, g: Groups) -> str:
    if not g.evidence_differs:
        return (f"In none of the {g.fallback} fallback groups did the rollouts retrieve different passages: every "
                "rollout of a group saw the same evidence, so an evidence judge could not tell them apart.")
    sentence = (f"Of the {g.fallback} fallback groups, {g.evidence_differs} held rollouts that retrieved different "
                "passages")
    if g.labels_differ is None:
        if s.teacher:
            sentence += (f"; the teacher gave an informative reward to {g.informative_where_evidence_differs} of "
                         f"those {g.evidence_differs} (this run's groups do not record evidence labels, so the "
                         "ceiling of a perfect judge is not counted)")
        return sentence + "."
    alike = g.informative - (g.informative_where_labels_differ or 0)
    if not g.labels_differ:
        sentence += (", but in none did the evidence labels differ (a gold answer in some rollouts' evidence and not "
                     "in others): even a perfect evidence judge could have told no group's rollouts apart.")
        if s.teacher and alike:
            sentence += (f" The teacher still made {_n(alike, 'group')} informative: its verdicts differed where the "
                         "evidence labels did not.")
        return sentence
    sentence += (f", and in {g.labels_differ} the evidence labels differ (a gold answer in some rollouts' evidence "
                 "and not in others): that is the most any evidence judge, even a perfect one, could have told apart.")
    if s.teacher:
        sentence += (f" The teacher gave an informative reward to {g.informative_where_labels_differ} of those "
                     f"{g.labels_differ}" + (f", and to {_n(alike, 'group')} whose evidence labels were alike"
                                             if alike else "") + ".")
    return sentence


def _gate_sentence(gate: JudgeGate) -> str:
    if gate.oracle:
        sentence = "Stage A was the oracle, the evidence labels computed from the gold (a ceiling, not a judge)"
    elif gate.judge is None:
        sentence = "Stage A was not a trained evidence judge"
    elif gate.heldout_gate is not None:
        rollout = (f", {gate.heldout_rollout_gate:.2f} on held-out actor rollouts"
                   if gate.heldout_rollout_gate is not None else "")
        floor = f"; a judge below {gate.floor:.2f} is weak" if gate.floor is not None else ""
        sentence = (f"The evidence judge {gate.judge} (Stage A) tells insufficient evidence from sufficient with a "
                    f"balanced accuracy of {gate.heldout_gate:.2f} on its held-out training questions "
                    f"(n {gate.heldout_n}{rollout}; 0.5 is chance{floor})")
    elif gate.found:
        sentence = f"The evidence judge {gate.judge} (Stage A) has no held-out gate measured"
    else:
        sentence = (f"The held-out figures of the evidence judge {gate.judge} (Stage A) are neither in teacher.json "
                    "nor in this machine's cache")
    if gate.run_gate is not None:
        sentence += (f"; in this run its gate matched the evidence labels of the rollouts it judged with a balanced "
                     f"accuracy of {gate.run_gate:.2f} (it closed {_of(gate.run_closed_on_i, gate.run_label_i)} rollouts whose evidence was "
                     f"insufficient and let through {_of(gate.run_open_on_open, gate.run_label_open)} whose evidence "
                     "held a gold answer or support)")
    elif gate.run_label_i or gate.run_label_open:
        sentence += "; in this run it judged evidence of one kind only, so its gate is not measured here"
    sentence += "."
    if gate.weak:
        sentence += (" The judge is weak by its own held-out figures"
                     + (", and the run accepted it (accept_weak_judge)" if gate.weak_accepted else "")
                     + ": its verdicts are close to chance.")
    return sentence


def _held_out_sentences(h: HeldOut) -> list[str]:
    def change(i: PairedInterval) -> str:
        return f"{_signed(i.diff)} ({i.confidence:.0%} interval {_signed(i.lo)} to {_signed(i.hi)})"

    first = (f"On {h.items} held-out questions ({h.benchmarks} benchmarks, macro average), F1 went from "
             f"{h.f1_before:.3f} to {h.f1_after:.3f}, {change(h.f1)}, and EM from {h.em_before:.3f} to "
             f"{h.em_after:.3f}, {change(h.em)}; {_of(h.answers_changed, h.items)} final answers changed. The "
             f"intervals are paired bootstrap intervals over the questions ({h.f1.samples} resamples): the changes "
             "another draw of such questions could show.")
    zero = [name for name, i in (("F1", h.f1), ("EM", h.em)) if i.includes_zero]
    if zero:
        second = (f"The {' and '.join(zero)} interval{'s include' if len(zero) > 1 else ' includes'} 0: on these "
                  f"{h.items} questions the change cannot be told apart from noise, so this run does not show that "
                  "training moved the held-out score.")
        if len(zero) == 1:
            other = "EM" if zero[0] == "F1" else "F1"
            second += f" The {other} interval excludes 0."
    else:
        second = ("Both intervals exclude 0: on these questions the trained policy differs from the start beyond "
                  "what resampling the questions moves (one run: a second seed may move more).")
    return [first, second]


def summary_table(s: RunSummary) -> list[tuple[str, str]]:
    t, g, gate, h = s.training, s.groups, s.gate, s.held_out
    rows = [("trained", f"{t.mode}, {t.steps} steps"
             + (f" x {_n(t.questions_per_step, 'question')} x {_n(t.group_size, 'rollout')}"
                if t.questions_per_step and t.group_size
                else "") + (f", lr {t.learning_rate:g}" if t.learning_rate is not None else ""))]
    if g is not None and g.groups:
        rows.append(("groups with a verified hit", _of(g.verified, g.groups)))
        if g.dropped:
            rows.append(("groups dropped (all alike)", _of(g.dropped, g.groups)))
        if g.fallback or t.mode in ("eviback", "f1-fallback"):
            rows.append((f"groups that fell back to {_who(s)}", _of(g.fallback, g.groups)))
            rows.append(("... with an informative reward", _of(g.informative, g.fallback)))
        if g.fallback and g.evidence_differs is not None:
            rows.append(("... whose rollouts retrieved different passages", _of(g.evidence_differs, g.fallback)))
        if g.fallback and g.labels_differ is not None:
            rows.append(("... whose evidence labels differ (a perfect judge's ceiling)", _of(g.labels_differ, g.fallback)))
            if s.teacher and g.labels_differ:
                rows.append(("... of those, made informative by the teacher",
                             _of(g.informative_where_labels_differ or 0, g.labels_differ)))
        if g.teacher_error:
            rows.append(("groups with a teacher error", _of(g.teacher_error, g.groups)))
        if g.all_zero and g.all_zero_same_passages is not None:
            rows.append(("all-zero groups whose rollouts all retrieved the same passages",
                         _of(g.all_zero_same_passages, g.all_zero)))
        if g.all_zero_labels_alike is not None:
            rows.append(("all-zero groups with one evidence label for every rollout",
                         _of(g.all_zero_labels_alike, g.all_zero_labelled)))
    if gate is not None:
        if gate.heldout_gate is not None:
            rows.append((f"judge gate, held out (balanced accuracy, n {gate.heldout_n})", _rate(gate.heldout_gate)))
        if gate.run_gate is not None:
            rows.append(("judge gate, this run (against evidence labels)", _rate(gate.run_gate)))
        if gate.weak is not None:
            rows.append(("judge weak (by its held-out figures)",
                         ("yes, accepted by the run" if gate.weak_accepted else "yes") if gate.weak else "no"))
    if s.validation is not None:
        v = s.validation
        on = f" ({v.questions} questions)" if v.questions else ""
        rows.append((f"validation EM, first -> last{on}",
                     f"{v.first.em:.3f} (step {v.first.step}) -> {v.last.em:.3f} (step {v.last.step}), best "
                     f"{v.best.em:.3f} (step {v.best.step})"))
        rows.append((f"validation F1, first -> last{on}",
                     f"{v.first.f1:.3f} (step {v.first.step}) -> {v.last.f1:.3f} (step {v.last.step})"))
    if h is not None:
        rows.append((f"held-out F1, start -> trained ({h.items} questions)",
                     f"{h.f1_before:.3f} -> {h.f1_after:.3f}, {_interval(h.f1)}"))
        rows.append((f"held-out EM, start -> trained ({h.items} questions)",
                     f"{h.em_before:.3f} -> {h.em_after:.3f}, {_interval(h.em)}"))
    return rows
