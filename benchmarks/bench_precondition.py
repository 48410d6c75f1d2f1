"""Do the rollouts of a group search differently? The precondition of any reward that judges evidence.

    python benchmarks/bench_precondition.py --model current=WARM_START_DIR --out results/precondition.json
    python benchmarks/bench_precondition.py --model current=DIR1 --model new=DIR2 --out results/precondition.json

A teacher that judges the evidence a rollout saw can only tell apart rollouts whose evidence differs. For
each warm start named, G rollouts (temperature 1, the training setting) of each training question of the
data suite (never an evaluation question: `eviback.data.read_training_questions`), with the demo's rollout
settings (2 searches then a final turn, 160 tokens per turn, observations cut at 300 tokens, top 3); every
model rolls out the same questions with the same sampling seeds. Over all groups and over the all-zero
groups (no rollout with EM 1: the groups EviBack hands to its teacher), the share of groups:

- `passages_differ`: whose rollouts retrieved different passage sets (passage ids over all their searches);
- `gold_differs`: in which a gold answer is in the evidence of some rollouts (as the actor saw it, after the
  observation cut) and not of others;
- `labels_differ`: whose evidence labels (S/A/I, `eviback.teacher.labels`, from the gold: what a perfect
  evidence judge could tell apart) differ;
- `informative`: whose teacher rewards differ, the teacher being the demo's (the two-stage teacher with the
  trained evidence judge as Stage A and the extractive Stage B: `eviback.train.runner.teacher_policy` of the
  `demo` preset). Over the all-zero groups this is `eviback.backoff`'s informative fallback group (its
  advantages are not all 0); over all groups it says whether the teacher's rewards would differ had it
  judged every group (EviBack asks it only for the all-zero ones); `informative_of_all` counts only
  all-zero groups, what EviBack gets, over all groups.

And per rollout: `first_query_is_question` (the first search was the question as written, after answer
normalisation) and `no_search`. Every share has its n and a 95% Wilson interval; with two models, the
difference of the second minus the first has a 95% percentile interval from resampling the questions
(paired: the same questions and seeds), the all-zero shares within each resample's own all-zero groups.

Long parts are resumable: the rollouts of each batch of questions and the verdicts of each model are written
under `--work` as they finish, and a rerun reuses them (delete the directory to measure afresh). Run a model's
rollouts alone with `--rollouts-only` (one engine per process), then the report with every model.

An experiment's own precondition (its warm start and its judge, on its data):

    python benchmarks/bench_precondition.py --data DIR --experiment experiments/cpu-round3.yaml \
        --model round3=experiment --questions 650 --work runs/precondition-round3 --out OUT.json
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from eviback.data import load_suite, read_jsonl, read_training_questions, write_jsonl
from eviback.metrics import exact_match, normalize_answer
from eviback.types import Trajectory, Verdict, from_dict, to_dict

FIGURES = ("passages_differ", "gold_differs", "labels_differ", "informative")


# --------------------------------------------------------------------------------------------------
# Figures of one group (pure)


def group_record(group: Sequence[Trajectory], verdicts: Sequence[Verdict]) -> dict:
    """What one group of G rollouts shows: its EM, whether its rollouts differ in each respect, and the teacher's
    rewards (None where the teacher failed)."""
    from eviback.backoff import BackoffConfig, group_advantages
    from eviback.teacher.labels import trajectory_label
    from eviback.teacher.workflow import gold_in_evidence

    question = group[0].question
    em = [exact_match(t.answer, question.golden_answers) if t.answer else 0.0 for t in group]
    passages = {frozenset(p.id for turn in t.turns if turn.executed for p in turn.passages) for t in group}
    gold = [gold_in_evidence(t) for t in group]
    labels = [trajectory_label(t).value for t in group]
    errors = any(v.teacher_error or v.reward is None for v in verdicts)
    rewards = [None if v.reward is None else float(v.reward) for v in verdicts]
    all_zero = max(em) < 1.0
    informative = not errors and len(set(rewards)) > 1
    if all_zero:  # exactly the training's rule for a fallback group
        informative = group_advantages(em, verdicts, BackoffConfig()).informative
    asked = normalize_answer(question.question)
    firsts = [t.queries[0] if t.queries else None for t in group]
    return {
        "question": question.id, "dataset": question.dataset, "em": em, "all_zero": all_zero,
        "passages_differ": len(passages) > 1, "gold_differs": len(set(gold)) > 1,
        "labels_differ": len(set(labels)) > 1, "informative": informative, "teacher_error": errors,
        "gold_in_evidence": sum(gold), "labels": labels, "rewards": rewards,
        "statuses": [v.status.value if v.status else None for v in verdicts],
        "first_query_is_question": sum(q is not None and normalize_answer(q) == asked for q in firsts),
        "no_search": sum(q is None for q in firsts), "first_queries": firsts,
    }


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float | None, float | None]:
    """The 95% Wilson score interval of k successes in n (None, None for n = 0)."""
    if n == 0:
        return None, None
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def share(k: int, n: int) -> dict:
    lo, hi = wilson(k, n)
    return {"k": k, "n": n, "share": (k / n) if n else None, "lo": lo, "hi": hi}


def summarise(groups: Sequence[dict]) -> dict:
    """The shares over all groups and over the all-zero groups, and the per-rollout query counts."""
    zero = [g for g in groups if g["all_zero"]]
    rollouts = sum(len(g["em"]) for g in groups)
    zero_rollouts = sum(len(g["em"]) for g in zero)
    out = {
        "groups": len(groups), "rollouts": rollouts, "all_zero": share(len(zero), len(groups)),
        "em": sum(sum(g["em"]) for g in groups) / rollouts if rollouts else None,
        "all": {f: share(sum(g[f] for g in groups), len(groups)) for f in FIGURES},
        "all_zero_groups": {f: share(sum(g[f] for g in zero), len(zero)) for f in FIGURES},
        "informative_of_all": share(sum(g["informative"] for g in zero), len(groups)),
        "teacher_errors": sum(g["teacher_error"] for g in groups),
        "first_query_is_question": share(sum(g["first_query_is_question"] for g in groups), rollouts),
        "first_query_is_question_all_zero": share(sum(g["first_query_is_question"] for g in zero), zero_rollouts),
        "no_search": share(sum(g["no_search"] for g in groups), rollouts),
        "gold_all_or_none_all_zero": share(sum(not g["gold_differs"] for g in zero), len(zero)),
        "by_dataset": {},
    }
    for name in sorted({g["dataset"] for g in groups}):
        mine = [g for g in groups if g["dataset"] == name]
        mine_zero = [g for g in mine if g["all_zero"]]
        out["by_dataset"][name] = {
            "groups": len(mine), "all_zero": len(mine_zero),
            "all": {f: sum(g[f] for g in mine) for f in FIGURES},
            "all_zero_groups": {f: sum(g[f] for g in mine_zero) for f in FIGURES},
        }
    return out


def paired_differences(first: Sequence[dict], second: Sequence[dict], samples: int, seed: int) -> dict:
    """`second - first` of each share, with a 95% percentile interval from resampling the questions (both
    models' groups of the same question go together); the all-zero shares are taken within each resample's
    own all-zero groups of each model."""
    by_q1 = {g["question"]: g for g in first}
    by_q2 = {g["question"]: g for g in second}
    keys = sorted(set(by_q1) & set(by_q2))
    rng = random.Random(seed)

    def shares(sample: Sequence[str]) -> dict:
        out = {}
        for which in ("all", "all_zero_groups"):
            for f in FIGURES:
                values = []
                for by_q in (by_q1, by_q2):
                    chosen = [by_q[k] for k in sample if which == "all" or by_q[k]["all_zero"]]
                    values.append(sum(g[f] for g in chosen) / len(chosen) if chosen else float("nan"))
                out[f"{which}/{f}"] = values[1] - values[0]
        for f in ("first_query_is_question",):
            rates = []
            for by_q in (by_q1, by_q2):
                n = sum(len(by_q[k]["em"]) for k in sample)
                rates.append(sum(by_q[k][f] for k in sample) / n)
            out[f"rollouts/{f}"] = rates[1] - rates[0]
        return out

    point = shares(keys)
    draws = [shares([keys[rng.randrange(len(keys))] for _ in keys]) for _ in range(samples)]
    result = {}
    for name, value in point.items():
        values = sorted(d[name] for d in draws if not math.isnan(d[name]))
        lo = values[int(0.025 * (len(values) - 1))] if values else None
        hi = values[int(math.ceil(0.975 * (len(values) - 1)))] if values else None
        result[name] = {"diff": value, "lo": lo, "hi": hi}
    return {"questions": len(keys), "samples": samples, "seed": seed, "figures": result}


# --------------------------------------------------------------------------------------------------
# Rollouts and verdicts, resumable


def question_order(questions: list, seed: int, limit: int) -> list:
    order = list(questions)
    random.Random(seed).shuffle(order)
    return order[:limit] if limit else order


def check_model(folder: Path, model: str) -> None:
    """The rollouts kept under `folder` are the model's: `folder/model.json` records the weights they were
    rolled out with (their fingerprint), written with the first batch. A folder holding another model's
    rollouts, or rollouts of no recorded model, is refused: reusing them would measure the wrong policy."""
    from eviback.train.sft import model_fingerprint

    record = folder / "model.json"
    fingerprint = model_fingerprint(model)
    if record.exists():
        kept = json.loads(record.read_text())
        if kept["fingerprint"] != fingerprint:
            raise SystemExit(f"{folder} holds the rollouts of another model ({kept['model']}, weights "
                             f"{kept['fingerprint'][:12]}), not of {model} ({fingerprint[:12]}): name another "
                             "--work or label, or delete that folder to measure afresh")
        return
    if any(folder.glob("batch-*.jsonl.gz")):
        raise SystemExit(f"{folder} holds rollouts with no record of the model that made them: name another "
                         "--work or label, or delete that folder to measure afresh")
    folder.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"model": str(model), "fingerprint": fingerprint}, indent=1) + "\n")


def roll_out(label: str, model: str, questions: list, args: argparse.Namespace, work: Path) -> dict:
    """Write the rollouts of each batch of questions to `work/label/batch-NNNN.jsonl.gz`; batches already
    there are kept (when they are this model's: :func:`check_model`). Returns the timing of the batches run
    now."""
    folder = work / label
    folder.mkdir(parents=True, exist_ok=True)
    check_model(folder, model)
    batches = [(b, questions[at: at + args.batch_questions])
               for b, at in enumerate(range(0, len(questions), args.batch_questions))]
    todo = [(b, qs) for b, qs in batches if not (folder / f"batch-{b:04d}.jsonl.gz").exists()]
    if not todo:
        return {"batches_run": 0}
    from eviback.generation import BackendConfig, load_backend
    from eviback.retrieval import suite_retriever
    from eviback.rollout import RolloutConfig, RolloutEngine

    suite = load_suite(args.data)
    retriever = suite_retriever(suite)
    engine = RolloutEngine(load_backend(BackendConfig(model=model, dtype=args.dtype)), retriever, RolloutConfig(
        group_size=args.group_size, max_turns=args.max_turns, max_turn_tokens=args.max_turn_tokens,
        max_observation_tokens=args.max_obs_tokens, topk=args.topk, temperature=args.temperature))
    start = time.perf_counter()
    for done, (b, qs) in enumerate(todo, start=1):
        batch = engine.rollout(qs, seed=args.seed * 100_003 + b)  # the same seed per batch for every model
        path = folder / f"batch-{b:04d}.jsonl.gz"
        tmp = path.with_name(path.name + ".tmp.gz")
        write_jsonl(tmp, (to_dict(dataclasses.replace(t, tokens=None)) for t in batch.trajectories))
        os.replace(tmp, path)
        print(f"{label}: batch {b + 1}/{len(batches)} ({done}/{len(todo)} now), "
              f"{time.perf_counter() - start:.0f}s", flush=True)
    retriever.close()
    return {"batches_run": len(todo), "seconds": round(time.perf_counter() - start, 1),
            "rollouts": sum(len(qs) for _, qs in todo) * args.group_size}


def read_rollouts(label: str, questions: list, args: argparse.Namespace, work: Path) -> list[list[Trajectory]]:
    """The groups of every question, in question order (each sorted by sample index)."""
    by_question: dict[str, list[Trajectory]] = {}
    for path in sorted((work / label).glob("batch-*.jsonl.gz")):
        if path.name.endswith(".tmp.gz"):
            continue
        for obj in read_jsonl(path):
            t = from_dict(Trajectory, obj)
            by_question.setdefault(t.question.id, []).append(t)
    missing = [q.id for q in questions if len(by_question.get(q.id, ())) != args.group_size]
    if missing:
        raise SystemExit(f"{label}: {len(missing)} questions lack their {args.group_size} rollouts under "
                         f"{work / label}; run without --report-only to roll them out")
    return [sorted(by_question[q.id], key=lambda t: t.sample_index) for q in questions]


def teacher_run_config(args: argparse.Namespace):
    """The training configuration whose teacher judges: the demo's (its judge built from the embedded suite's
    training questions), or with `--experiment` that experiment's `--teacher-arm` run of seed 0 on `--data`
    (its judge built from that data's training questions, as the experiment's runs build it)."""
    from eviback.experiment.config import load_experiment
    from eviback.train.config import resolve_config

    if not args.experiment:
        return resolve_config("demo", None, [])
    experiment = load_experiment(args.experiment, data=args.data)
    return experiment.train_config(experiment.arm(args.teacher_arm), 0)


def experiment_warm_start(args: argparse.Namespace) -> str:
    """The warm start every run of `--experiment` starts from (the same for every arm and seed: `build_seed`),
    built and cached exactly as its runs build it, so that they reuse this one."""
    from eviback.train.runner import initial_policy

    if not args.experiment:
        raise SystemExit("--model LABEL=experiment needs --experiment FILE")
    return initial_policy(teacher_run_config(args))


def run_teacher(config):
    """The teacher `config` trains with (two-stage: the trained evidence judge as Stage A, extractive Stage
    B), and what identifies its judge."""
    from eviback.cache import cache_dir
    from eviback.teacher.config import build_teacher
    from eviback.teacher.evidence_judge import CLASSIFIER_PREFIX
    from eviback.train.runner import teacher_policy

    policy = teacher_policy(config)
    backend = policy.status_stage.backend or ""
    sha = backend[len(CLASSIFIER_PREFIX):] if backend.startswith(CLASSIFIER_PREFIX) else None
    about = {"policy": policy.name, "policy_version": policy.short_version, "stage_a_backend": backend,
             "judge_sha256": sha, "judge": None}
    for path in sorted((cache_dir() / "judges").glob("*/judge.json")):  # the cached judge of that hash
        doc = json.loads(path.read_text())
        if sha and doc.get("sha256") == sha:
            about.update(judge=path.parent.name, judge_key=doc.get("key"),
                         judge_heldout=doc.get("heldout") or doc.get("metrics"))
    teacher = build_teacher(config.teacher.teacher_config(config.dtype, config.device), policy=policy)
    return teacher, about


def judged(label: str, groups: list[list[Trajectory]], teacher, about: dict, work: Path) -> list[Verdict]:
    """The teacher's verdict on every rollout, cached per model and judge."""
    path = work / label / f"verdicts-{(about['judge_sha256'] or about['policy_version'])[:12]}.jsonl.gz"
    flat = [t for g in groups for t in g]
    if path.exists():
        verdicts = [from_dict(Verdict, obj) for obj in read_jsonl(path)]
        if len(verdicts) == len(flat):
            return verdicts
    start = time.perf_counter()
    verdicts = []
    for at in range(0, len(flat), 250):
        verdicts += teacher.judge(flat[at: at + 250])
        print(f"{label}: judged {len(verdicts)}/{len(flat)}, {time.perf_counter() - start:.0f}s", flush=True)
    tmp = path.with_name(path.name + ".tmp.gz")
    write_jsonl(tmp, (to_dict(v) for v in verdicts))
    os.replace(tmp, path)
    return verdicts


def warm_start_about(model: str) -> dict:
    directory = Path(model)
    out: dict = {"directory_name": directory.name}
    for name in ("sft_config.json", "sft_report.json"):
        if (directory / name).exists():
            doc = json.loads((directory / name).read_text())
            if name == "sft_config.json":
                out.update(key=doc.get("key"), builder_version=doc.get("builder_version"), dtype=doc.get("dtype"),
                           max_examples=doc.get("max_examples"), max_obs_tokens=doc.get("max_observation_tokens"),
                           seed=doc.get("seed"))
            else:
                out.update(examples=doc.get("examples"), build=doc.get("build"))
    weights = directory / "model.safetensors"
    if weights.exists():
        digest = hashlib.sha256()
        with open(weights, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
        out["weights_sha256"] = digest.hexdigest()
    return out


def table(report: dict) -> str:
    """The figures as a markdown table, one column per model (and the difference)."""
    labels = list(report["models"])

    def cell(s: dict) -> str:
        if s["share"] is None:
            return "n 0"
        return f"{s['share']:.3f} [{s['lo']:.3f}, {s['hi']:.3f}] ({s['k']}/{s['n']})"

    rows = [("all-zero groups", "all_zero", None)]
    for which, title in (("all", "all groups"), ("all_zero_groups", "all-zero groups")):
        for f in FIGURES:
            rows.append((f"{title}: {f.replace('_', ' ')}", which, f))
    rows += [("EviBack's informative groups over all groups", "informative_of_all", None),
             ("rollouts whose first search is the question as written", "first_query_is_question", None),
             ("rollouts with no search", "no_search", None)]
    head = "| share | " + " | ".join(labels) + (f" | {labels[1]} - {labels[0]} |" if len(labels) == 2 else " |")
    lines = [head, "|---" * (len(labels) + 1 + (len(labels) == 2)) + "|"]
    diffs = report.get("difference", {}).get("figures", {})
    for title, which, f in rows:
        cells = []
        for label in labels:
            s = report["models"][label]["summary"]
            cells.append(cell(s[which][f] if f else s[which]))
        line = f"| {title} | " + " | ".join(cells)
        if len(labels) == 2:
            key = f"{which}/{f}" if f else ("rollouts/first_query_is_question" if which == "first_query_is_question"
                                            else None)
            d = diffs.get(key) if key else None
            line += f" | {d['diff']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]" if d else " | "
        lines.append(line + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", required=True, metavar="LABEL=DIR",
                        help="a warm start to measure (eviback sft prints its directory; 'experiment': the "
                        "warm start of --experiment's runs, built if not cached); repeatable")
    parser.add_argument("--experiment", type=Path, metavar="FILE", help="judge with this experiment's teacher "
                        "(its --teacher-arm on --data) instead of the demo's")
    parser.add_argument("--teacher-arm", default="eviback", help="the arm of --experiment whose teacher judges")
    parser.add_argument("--data", default=None, metavar="DIR", help="data suite (default: the embedded one)")
    parser.add_argument("--questions", type=int, default=0, help="training questions (0: all, seeded order)")
    parser.add_argument("--group-size", type=int, default=5)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-turns", type=int, default=2)
    parser.add_argument("--max-turn-tokens", type=int, default=160)
    parser.add_argument("--max-obs-tokens", type=int, default=300)
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", help="the rollout engine's dtype (fixed, so that every "
                        "model samples alike whatever a busy machine measures for `auto`)")
    parser.add_argument("--batch-questions", type=int, default=25, help="questions per rollout batch (resume unit)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bootstrap", type=int, default=2000)
    parser.add_argument("--work", type=Path, default=Path("runs/precondition"), help="rollouts and verdicts")
    parser.add_argument("--rollouts-only", action="store_true", help="roll out, judge nothing, report nothing")
    parser.add_argument("--report-only", action="store_true", help="use the rollouts under --work, roll out none")
    parser.add_argument("--out", type=Path, help="the report (JSON)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    models = dict(item.split("=", 1) for item in args.model)
    models = {label: experiment_warm_start(args) if model == "experiment" else model
              for label, model in models.items()}
    suite = load_suite(args.data)
    questions = question_order(read_training_questions(suite), args.seed, args.questions)
    shown = [("DIR" if args.data and a == args.data else a) for a in (argv if argv is not None else sys.argv[1:])]
    report: dict = {
        "command": "python benchmarks/bench_precondition.py " + " ".join(shown),
        "settings": {k: ("DIR" if k == "data" and v else str(v)) for k, v in vars(args).items() if k != "model"},
        "questions": len(questions), "datasets": dict(Counter(q.dataset for q in questions)),
        "load_avg_start": round(os.getloadavg()[0], 2), "models": {},
    }
    timings = {}
    if not args.report_only:
        for label, model in models.items():
            timings[label] = roll_out(label, model, questions, args, args.work)
    if args.rollouts_only:
        print(json.dumps(timings, indent=2))
        return 0
    teacher, report["teacher"] = run_teacher(teacher_run_config(args))
    per_model = {}
    for label, model in models.items():
        check_model(args.work / label, model)
        groups = read_rollouts(label, questions, args, args.work)
        start = time.perf_counter()
        verdicts = judged(label, groups, teacher, report["teacher"], args.work)
        at = 0
        records = []
        for g in groups:
            records.append(group_record(g, verdicts[at: at + len(g)]))
            at += len(g)
        per_model[label] = records
        report["models"][label] = {"warm_start": warm_start_about(model), "rollout_timing": timings.get(label),
                                   "judge_seconds": round(time.perf_counter() - start, 1),
                                   "summary": summarise(records)}
    teacher.close()
    labels = list(models)
    if len(labels) == 2:
        report["difference"] = {"of": f"{labels[1]} - {labels[0]}",
                                **paired_differences(per_model[labels[0]], per_model[labels[1]], args.bootstrap,
                                                     args.seed)}
    report["load_avg_end"] = round(os.getloadavg()[0], 2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        write_jsonl(args.out.with_suffix(".groups.jsonl.gz"),
                    ({"model": label, **r} for label, records in per_model.items() for r in records))
    print(table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
