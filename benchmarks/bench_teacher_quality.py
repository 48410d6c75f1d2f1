"""Stage A against the evidence labels on held-out questions: balanced accuracy, Cohen's kappa, confusion.

    python benchmarks/bench_teacher_quality.py --backend local --per-label 40 \
        --heldout results/teacher-signal/rollouts/heldout.jsonl \
        --policies two-stage single-prompt-dual-task JUDGE_DIR/policy.json \
        --out results/teacher-signal/quality.json

Evidence items, all on held-out questions of the embedded suite (NQ and PopQA dev splits, HotpotQA,
2WikiMultiHopQA and MuSiQue dev questions with contexts; a training question is refused):

- the rollouts of `--heldout` (real rollouts of the warm-started actor), each with its evidence as seen;
- real BM25 searches for each held-out question (the question, a shorter reformulation, the question with
  its gold answer, and a same-topic negative of retrieved passages without the answer), rendered and cut
  at `--max-obs-tokens` as the rollout engine cuts an observation.

Each item is labelled S/A/I by eviback.teacher.labels; up to `--per-label` items per label are drawn
(seeded), the rollouts first. Each policy is run up to its status stage (Stage A of two-stage; the single
prompt of the dual-task baseline, which sees the gold answers; Stage A of a judge policy is the trained
judge) and its statuses are compared with the labels. Also reported: teacher seconds and prompt tokens
per judged item.

`--probe` adds the frozen-feature probe floor, "frozen-feature-probe": a logistic regression (3 classes,
standardised features, balanced class weights) on the mean over tokens of one decoder layer's output of the
frozen SmolLM2-135M-Instruct policy (float32, no gradients), reading "Question: ...\n\nEvidence: ..." cut at
512 tokens. It is fitted on examples of the suite's TRAINING questions only (those of `eviback build-judge`,
labelled by the same rule; up to `--probe-train-per-label` per label, seeded), with the layer (among
`--probe-layer`) and the inverse regularisation C chosen by cross-validated balanced accuracy on those
examples (folds grouped by question), then scored on the same held-out items as the policies. Without
policies (`--policies` given no value) only the probe runs:

    python benchmarks/bench_teacher_quality.py --backend local --per-label 40 --questions-per-benchmark 20 \
        --policies --probe --out results/teacher-signal/quality_probe_search.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
from teacher_backends import add_backend_arguments, open_backend

from eviback.data import load_suite, read_questions
from eviback.teacher.judge import JudgeConfig, Teacher, read_trajectories
from eviback.teacher.labels import agreement, trajectory_label
from eviback.teacher.policy import TeacherPolicy, load_policy
from eviback.teacher.workflow import evidence_as_seen, render_seen
from eviback.train.judge_builder import JudgeExample
from eviback.types import Status, Trajectory, to_dict

HELDOUT = ("nq", "popqa", "hotpotqa", "2wikimultihopqa", "musique")
PROBE = "frozen-feature-probe"
PROBE_MODEL = "smollm2-135m"
PROBE_MAX_TOKENS = 512
PROBE_C_GRID = (0.001, 0.01, 0.1, 1.0, 10.0)
PROBE_FOLDS = 5
LABELS = (Status.SUFFICIENT, Status.AMBIGUOUS, Status.INSUFFICIENT)


def status_stage_only(policy: TeacherPolicy) -> TeacherPolicy:
    return TeacherPolicy(name=f"{policy.name}/status", stages=policy.stages[:1], weights=policy.weights)


def open_policy(ref: str) -> TeacherPolicy:
    from eviback.teacher.config import register_judge_beside

    register_judge_beside(ref)
    return load_policy(ref)


def items(args: argparse.Namespace) -> list[tuple[str, object]]:
    """(source, trajectory) of every held-out evidence item, rollouts first."""
    from eviback.data import training_files
    from eviback.policy import load_tokenizer
    from eviback.queries import retry_query, search_query
    from eviback.retrieval import suite_retriever
    from eviback.teacher.workflow import answer_in_evidence
    from eviback.train.judge_builder import seen_trajectory

    suite = load_suite()
    training = {q.id for path in training_files(suite) for q in read_questions(path)}
    out = []
    for path in args.heldout:
        for t in read_trajectories(path):
            if t.question.id in training:
                raise ValueError(f"{path}: rollout on training question {t.question.id}; use held-out questions")
            out.append(("rollout", t))
    rng = random.Random(args.seed)
    questions = []
    for name in HELDOUT:
        qs = [q for q in read_questions(suite.eval[name]) if q.gold_passage_ids]
        rng.shuffle(qs)
        questions += qs[: args.questions_per_benchmark]
    assert not {q.id for q in questions} & training
    tokenizer = load_tokenizer()
    retriever = suite_retriever(suite)
    for q in questions:
        pool = {}
        for source, query in (("search", search_query(q)), ("reformulated", retry_query(q)),
                              ("answer-search", f"{search_query(q)} {q.golden_answers[0]}")):
            passages = list(retriever.search([query], args.topk)[0])
            pool.update({p.id: p for p in passages})
            out.append((source, seen_trajectory(q, passages, tokenizer, args.max_obs_tokens)))
        negatives = [p for p in pool.values() if not any(answer_in_evidence(g, p.contents) for g in q.golden_answers)]
        if negatives:
            out.append(("negative", seen_trajectory(q, negatives[: args.topk], tokenizer, args.max_obs_tokens)))
    retriever.close()
    return out


def scored(chosen: Sequence[tuple[str, Trajectory, Status]], predicted: Sequence[Status | None]) -> dict[str, Any]:
    """Agreement of the `predicted` statuses (None: an error) with the labels of `chosen`, overall and by source."""
    ok = [(x[2], p) for x, p in zip(chosen, predicted, strict=True) if p]
    a = agreement([label for label, _ in ok], [p for _, p in ok])
    by_source = {}
    for source in sorted({x[0] for x in chosen}):
        pairs = [(x[2], p) for x, p in zip(chosen, predicted, strict=True) if x[0] == source and p]
        sa = agreement([label for label, _ in pairs], [p for _, p in pairs])
        by_source[source] = {"n": sa.n, "accuracy": sa.accuracy}
    return {"errors": len(predicted) - len(ok), **to_dict(a), "by_source": by_source}


# --------------------------------------------------------------------------------------------------
# (d) The frozen-feature probe floor


def probe_text(question: str, evidence: str) -> str:
    """What the probe's frozen model reads for one (question, evidence as seen) pair."""
    return f"Question: {question}\n\nEvidence: {evidence}"


def trajectory_evidence(trajectory: Trajectory) -> str:
    """The evidence text of a rollout as the actor saw it (as a judge example's evidence is made)."""
    return render_seen(evidence_as_seen(trajectory)).strip()


class FrozenFeatures:
    """Mean over tokens of the outputs of some decoder layers of the frozen policy, one text at a time.

    Layer k is the output of the k-th decoder layer (1-based; before the final norm); only the layers up to
    the deepest one asked for are run. One text per forward pass: no padding, so the mean is over the text's
    own tokens (batching does not pay on one CPU thread)."""

    def __init__(self, layers: Sequence[int], threads: int = 1) -> None:
        import torch
        import transformers
        from transformers import AutoModel

        from eviback.policy import load_tokenizer, resolve_model, set_threads

        set_threads(threads)
        self.layers = tuple(sorted(set(layers)))
        path = resolve_model(PROBE_MODEL, "float32")
        self.tokenizer = load_tokenizer(PROBE_MODEL, "float32")
        total = transformers.AutoConfig.from_pretrained(path).num_hidden_layers
        if not self.layers or self.layers[0] < 1 or self.layers[-1] > total:
            raise ValueError(f"--probe-layer must be in 1..{total}, not {list(layers)}")
        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()  # the unused deeper layers' weights are reported otherwise
        try:
            self.model = AutoModel.from_pretrained(path, dtype=torch.float32, num_hidden_layers=self.layers[-1])
        finally:
            transformers.logging.set_verbosity(verbosity)
        self.model.eval()
        self._outputs: dict[int, torch.Tensor] = {}
        for k in self.layers:
            self.model.layers[k - 1].register_forward_hook(self._keep(k))

    def _keep(self, layer: int) -> Callable[..., None]:
        def hook(module: Any, inputs: Any, output: Any) -> None:
            self._outputs[layer] = output[0] if isinstance(output, tuple) else output
        return hook

    def embed(self, texts: Sequence[str], what: str) -> tuple[dict[int, np.ndarray], list[int]]:
        """({layer: array (len(texts), hidden)}, tokens read per text), logging progress."""
        import torch

        rows: dict[int, list[np.ndarray]] = {k: [] for k in self.layers}
        tokens = []
        start = time.perf_counter()
        with torch.inference_mode():
            for i, text in enumerate(texts, start=1):
                ids = self.tokenizer(text, truncation=True, max_length=PROBE_MAX_TOKENS, return_tensors="pt")
                self._outputs.clear()
                self.model(**ids)
                for k in self.layers:
                    rows[k].append(self._outputs[k][0].mean(dim=0).numpy().copy())
                tokens.append(int(ids["input_ids"].shape[1]))
                if i % 25 == 0 or i == len(texts):
                    spent = time.perf_counter() - start
                    print(f"probe: embedded {i}/{len(texts)} {what} ({spent:.0f}s, "
                          f"about {spent / i * (len(texts) - i):.0f}s left)", flush=True)
        return {k: np.stack(v) for k, v in rows.items()}, tokens


def probe_training(args: argparse.Namespace) -> tuple[list[JudgeExample], dict[str, Any]]:
    """Up to `--probe-train-per-label` examples per label (seeded) of the suite's training questions."""
    from eviback.train.judge_builder import EvidenceJudgeConfig, build_examples

    config = EvidenceJudgeConfig(unit="evidence", heldout_share=0.0, max_questions=args.probe_max_questions, topk=args.topk,
                                 max_obs_tokens=args.max_obs_tokens, seed=args.seed)
    examples, _, counts = build_examples(config, progress=lambda line: print(f"probe: {line}", flush=True))
    rng = random.Random(args.seed)
    train = []
    for label in LABELS:
        of_label = [e for e in examples if e.label is label]
        rng.shuffle(of_label)
        train += of_label[: args.probe_train_per_label]
    return train, counts


def fit_probe(features: dict[int, np.ndarray], labels: Sequence[str], groups: Sequence[str],
              seed: int) -> tuple[int, Any, dict[str, Any]]:
    """(layer, fitted pipeline, CV record): for each layer the C of best grouped-CV balanced accuracy; the
    layer of best such score wins, refitted on all the examples."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import GridSearchCV, StratifiedGroupKFold
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    searches = {}
    for layer, x in sorted(features.items()):
        pipeline = make_pipeline(StandardScaler(),
                                 LogisticRegression(class_weight="balanced", max_iter=10000))
        search = GridSearchCV(pipeline, {"logisticregression__C": list(PROBE_C_GRID)}, scoring="balanced_accuracy",
                              cv=StratifiedGroupKFold(PROBE_FOLDS, shuffle=True, random_state=seed))
        search.fit(x, list(labels), groups=list(groups))
        searches[layer] = search
        print(f"probe: layer {layer}: CV balanced accuracy {search.best_score_:.3f} at "
              f"C={search.best_params_['logisticregression__C']}", flush=True)
    layer = max(searches, key=lambda k: (searches[k].best_score_, -k))
    record = {"folds": PROBE_FOLDS, "grouped_by": "question", "scoring": "balanced_accuracy",
              "c_grid": list(PROBE_C_GRID),
              "by_layer": {str(k): {"best_c": s.best_params_["logisticregression__C"], "best_score": s.best_score_,
                                    "scores": [float(v) for v in s.cv_results_["mean_test_score"]]}
                           for k, s in searches.items()}}
    return layer, searches[layer].best_estimator_, record


def run_probe(args: argparse.Namespace, chosen: Sequence[tuple[str, Trajectory, Status]]) -> dict[str, Any]:
    """The probe's row of the report (see the module doc)."""
    start = time.perf_counter()
    train, counts = probe_training(args)
    heldout_ids = {x[1].question.id for x in chosen}
    if heldout_ids & {e.question_id for e in train}:
        raise ValueError("a probe training example is on a held-out question")
    build_seconds = time.perf_counter() - start
    print(f"probe: {len(train)} training examples {dict(Counter(e.label.value for e in train))} "
          f"from {counts['questions']} training questions ({build_seconds:.0f}s)", flush=True)
    features = FrozenFeatures(args.probe_layer, args.threads)
    at = time.perf_counter()
    train_x, train_tokens = features.embed([probe_text(e.question, e.evidence) for e in train], "training examples")
    train_embed_seconds = time.perf_counter() - at
    at = time.perf_counter()
    layer, model, cv = fit_probe(train_x, [e.label.value for e in train], [e.question_id for e in train], args.seed)
    fit_seconds = time.perf_counter() - at
    print(f"probe: layer {layer} chosen by CV ({fit_seconds:.0f}s)", flush=True)
    at = time.perf_counter()
    test_x, test_tokens = features.embed([probe_text(x[1].question.question, trajectory_evidence(x[1]))
                                          for x in chosen], "held-out items")
    predicted = [Status(v) for v in model.predict(test_x[layer])]
    wall = time.perf_counter() - at
    return {"policy": PROBE, "name": PROBE, "version": None,
            "stage_a_backend": f"logistic regression on {PROBE_MODEL} float32 layer {layer} (mean over tokens)",
            "sees_gold": False, **scored(chosen, predicted),
            "seconds_per_item": round(wall / len(chosen), 4),
            "prompt_tokens_per_item": round(sum(test_tokens) / len(chosen), 1),
            "load_avg_1min": round(os.getloadavg()[0], 2),
            "probe": {"model": PROBE_MODEL, "dtype": "float32", "pooling": "mean over tokens",
                      "max_tokens": PROBE_MAX_TOKENS, "layers_tried": list(features.layers), "layer": layer,
                      "c": model.get_params()["logisticregression__C"],
                      "cv_balanced_accuracy": cv["by_layer"][str(layer)]["best_score"], "cv": cv,
                      "train_size": len(train), "train_labels": dict(Counter(e.label.value for e in train)),
                      "train_sources": dict(Counter(e.source for e in train)),
                      "train_tokens_per_item": round(sum(train_tokens) / len(train), 1),
                      "train_truncated": sum(n >= PROBE_MAX_TOKENS for n in train_tokens),
                      "heldout_truncated": sum(n >= PROBE_MAX_TOKENS for n in test_tokens),
                      "examples_built": counts, "max_questions": args.probe_max_questions,
                      "seconds": {"examples": round(build_seconds, 1), "embed_train": round(train_embed_seconds, 1),
                                  "fit": round(fit_seconds, 1), "embed_and_predict_heldout": round(wall, 1)}}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_backend_arguments(parser)
    parser.add_argument("--heldout", nargs="*", default=[], help="rollout dumps on held-out questions")
    parser.add_argument("--questions-per-benchmark", type=int, default=20)
    parser.add_argument("--per-label", type=int, default=40)
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--max-obs-tokens", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--policies", nargs="*", default=["two-stage", "single-prompt-dual-task"],
                        help="teacher policies to score (none: only the probe, with --probe)")
    parser.add_argument("--probe", action="store_true", help="also score the frozen-feature probe (module doc)")
    parser.add_argument("--probe-train-per-label", type=int, default=150)
    parser.add_argument("--probe-max-questions", type=int, default=300,
                        help="training questions searched for the probe's examples")
    parser.add_argument("--probe-layer", type=int, nargs="+", default=[15, 20, 25],
                        help="decoder layer(s) of SmolLM2 (1..30) to pool; with several, chosen by CV")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if not args.policies and not args.probe:
        parser.error("nothing to score: give --policies or --probe")

    pool = [(source, t, trajectory_label(t)) for source, t in items(args)]
    pool = [x for x in pool if x[1].turns and any(turn.executed for turn in x[1].turns)]
    rng = random.Random(args.seed)
    chosen = []
    for label in (Status.SUFFICIENT, Status.AMBIGUOUS, Status.INSUFFICIENT):
        rollouts = [x for x in pool if x[2] is label and x[0] == "rollout"]
        searched = [x for x in pool if x[2] is label and x[0] != "rollout"]
        rng.shuffle(rollouts)
        rng.shuffle(searched)
        chosen += (rollouts + searched)[: args.per_label]
    labels = [x[2] for x in chosen]
    report = {
        "command": "python benchmarks/bench_teacher_quality.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "items": len(chosen), "labels": dict(Counter(s.value for s in labels)),
        "sources": dict(Counter(x[0] for x in chosen)),
        "pool": {"items": len(pool), "labels": dict(Counter(x[2].value for x in pool)),
                 "rollout_labels": dict(Counter(x[2].value for x in pool if x[0] == "rollout"))},
        "policies": [],
    }
    summary = ("policy", "n", "gate_balanced_accuracy", "balanced_accuracy", "s_vs_i_balanced_accuracy", "kappa",
               "seconds_per_item")
    if args.policies:
        with open_backend(args) as client:
            for ref in args.policies:
                policy = open_policy(ref)
                teacher = Teacher(status_stage_only(policy), client, JudgeConfig(concurrency=args.concurrency))
                start = time.perf_counter()
                verdicts = teacher.judge([x[1] for x in chosen])
                wall = time.perf_counter() - start
                stats = teacher.stats().total
                teacher.close()
                row = {"policy": ref, "name": policy.name, "version": policy.short_version,
                       "stage_a_backend": policy.status_stage.backend or client.backend_id,
                       "sees_gold": policy.status_stage.sees_gold,
                       **scored(chosen, [v.stage_a_status for v in verdicts]),
                       "seconds_per_item": round(wall / len(chosen), 4),
                       "prompt_tokens_per_item": round(stats.prompt_tokens / len(chosen), 1),
                       "load_avg_1min": round(os.getloadavg()[0], 2)}
                print(json.dumps({k: row[k] for k in summary}), flush=True)
                report["policies"].append(row)
    if args.probe:
        row = run_probe(args, chosen)
        print(json.dumps({k: row[k] for k in summary}), flush=True)
        report["policies"].append(row)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
