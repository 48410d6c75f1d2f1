"""How to choose a bi-encoder evidence judge's gate threshold: calibrated on what, and does it transfer to
held-out questions.

    python benchmarks/bench_judge_calibration.py --max-questions 200 --seeds 0 1 2 3 4 \
        --out results/judge-calibration/embedded_200.json

For each seed: the examples of `eviback build-judge` with that seed (`build_example_sets`: the question
sample and the held-out split depend on it), every distinct question and passage embedded once, the head
fitted as the builder fits it (`fit_head`), and the threshold chosen by each rule below; then the held-out
gate (I vs not-I balanced accuracy over the held-out questions' whole evidence, as `judge.json`'s
`heldout.gate_balanced_accuracy`) at that threshold, with a 95% interval from 2,000 bootstrap resamples of
the held-out QUESTIONS (their evidence texts are not independent); with `--rollouts`, also on the
search-built and the rollouts' held-out evidence apart.

Rules (all but the last choose on the training questions only):

- `fixed-0.5`: no calibration (builders 1-4);
- `in-sample`: the head trained on all training questions scores their evidence, the threshold maximises the
  gate there (the head has seen these passages: its scores are more confident than on new questions);
- `cross-fitted-K`: each training question's evidence scored by a head fitted without its fold (K folds by
  question), the threshold chosen on those scores, the head on all questions shipped (the builder's rule with
  K = 5);
- `held-back-20`: a head fitted on 80% of the training questions, the threshold chosen on the other 20%'s
  evidence, the 80% head shipped (`held-back-20/full-head`: the same threshold with the head on all);
- `pair-cross-fitted-5`: a per-status pair: the evidence is not-I when some passage has P(S) >= t_S or
  P(A) >= t_A, (t_S, t_A) chosen on a grid of the cross-fitted scores' quantiles;
- `heldout-best` (a reference, not a rule: chosen on the held-out questions themselves): the ceiling of any
  single threshold for the shipped head, the "best threshold" an offline sweep reports.

Embeddings are cached by text under `--embedding-cache` (a .pt file) between seeds and runs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from eviback.teacher.evidence_judge import QUESTION_LENGTH, calibrate_threshold, split_passages
from eviback.train.judge_builder import (
    Embedded,
    EvidenceJudgeConfig,
    Head,
    JudgeExample,
    base_model_dir,
    evidence_relevance,
    fit_head,
    question_fold,
)
from eviback.types import Status


def embeddings(texts: Sequence[str], length: int, cache: dict[tuple[str, int], Any]) -> None:
    """Embed the texts not yet in `cache` (keyed by (text, wordpieces))."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from eviback.teacher.evidence_judge import embed_texts

    todo = [t for t in dict.fromkeys(texts) if (t, length) not in cache]
    if not todo:
        return
    base = base_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModel.from_pretrained(base).eval()
    with torch.inference_mode():
        vectors = embed_texts(model, tokenizer, todo, length).float().cpu()
    for text, vector in zip(todo, vectors, strict=True):
        cache[(text, length)] = vector


def embedded_of(questions: Sequence[str], texts: Sequence[str], length: int,
                cache: dict[tuple[str, int], Any]) -> Embedded:
    import torch

    questions, texts = list(dict.fromkeys(questions)), list(dict.fromkeys(texts))
    return Embedded({q: i for i, q in enumerate(questions)}, {t: i for i, t in enumerate(texts)},
                    torch.stack([cache[(q, QUESTION_LENGTH)] for q in questions]),
                    torch.stack([cache[(t, length)] for t in texts]))


def head_on(embedded: Embedded, examples: Sequence[JudgeExample]) -> Head:
    return fit_head(embedded.features([(e.question, e.evidence) for e in examples]), examples)


def status_maxima(embedded: Embedded, head: Head, evidence: Sequence[JudgeExample]) -> np.ndarray:
    """[n, 2]: the largest P(S) and P(A) over each evidence text's passages (0, 0 without passages)."""
    out = np.zeros((len(evidence), 2))
    for k, e in enumerate(evidence):
        passages = split_passages(e.evidence)
        if passages:
            probs = np.array(head.probabilities(embedded.features([(e.question, p) for p in passages])))
            out[k] = probs[:, 0].max(), probs[:, 1].max()
    return out


def gate(opened: np.ndarray, closed_label: np.ndarray) -> float | None:
    """I vs not-I balanced accuracy: `opened` the judge's not-I calls, `closed_label` the I labels."""
    if closed_label.all() or not closed_label.any():
        return None
    return float(((~opened & closed_label).sum() / closed_label.sum()
                  + (opened & ~closed_label).sum() / (~closed_label).sum()) / 2)


def bootstrap(opened: np.ndarray, closed_label: np.ndarray, questions: Sequence[str], resamples: int = 2000,
              seed: int = 0) -> list[float]:
    """The 95% interval of the gate over resamples of the held-out questions."""
    ids = sorted(set(questions))
    rows = {q: [k for k, x in enumerate(questions) if x == q] for q in ids}
    rng = random.Random(seed)
    values = []
    for _ in range(resamples):
        chosen = [k for q in rng.choices(ids, k=len(ids)) for k in rows[q]]
        if (value := gate(opened[chosen], closed_label[chosen])) is not None:
            values.append(value)
    return [round(float(np.percentile(values, 2.5)), 3), round(float(np.percentile(values, 97.5)), 3)]


def pair_calibration(maxima: np.ndarray, closed_label: np.ndarray, grid: int = 41) -> tuple[float, float, float]:
    """(t_S, t_A, gate) maximising the gate of "not-I when max P(S) >= t_S or max P(A) >= t_A" over a grid of
    the scores' quantiles (plus 'never' for each)."""
    best = (-1.0, 0.0, 0.0)
    cands = [np.unique(np.append(np.quantile(maxima[:, j], np.linspace(0, 1, grid)), 1.01)) for j in (0, 1)]
    for t_s in cands[0]:
        for t_a in cands[1]:
            value = gate((maxima[:, 0] >= t_s) | (maxima[:, 1] >= t_a), closed_label)
            if value is not None and value > best[0]:
                best = (value, float(t_s), float(t_a))
    return best[1], best[2], best[0]


def run_seed(args: argparse.Namespace, seed: int, cache: dict[tuple[str, int], Any]) -> dict[str, Any]:
    from eviback.train.judge_builder import build_example_sets

    config = EvidenceJudgeConfig(data=args.data, max_questions=args.max_questions, seed=seed,
                                 rollouts=tuple(args.rollouts))
    start = time.perf_counter()
    sets = build_example_sets(config, progress=lambda line: print(f"seed {seed}: {line}", flush=True))
    train, evidence, heldout = sets.train, sets.evidence, sets.heldout
    items = [(e.question, p) for e in list(evidence) + list(heldout) for p in split_passages(e.evidence)]
    questions = [e.question for e in train] + [q for q, _ in items]
    texts = [e.evidence for e in train] + [t for _, t in items]
    embeddings(questions, QUESTION_LENGTH, cache)
    embeddings(texts, config.length, cache)
    embedded = embedded_of(questions, texts, config.length, cache)
    print(f"seed {seed}: {len(train)} training passages, {len(evidence)} training and {len(heldout)} held-out "
          f"evidence texts embedded ({time.perf_counter() - start:.0f}s)", flush=True)

    full = head_on(embedded, train)
    h_closed = np.array([e.label is Status.INSUFFICIENT for e in heldout])
    h_questions = [e.question_id for e in heldout]
    h_scores = np.array(evidence_relevance(embedded, full, heldout))
    e_closed = [e.label is Status.INSUFFICIENT for e in evidence]
    rows: dict[str, Any] = {}

    h_rollout = np.array([e.source == "rollout" for e in heldout])

    def by_source(opened: np.ndarray) -> dict[str, Any]:
        """The gate on the search-built and on the rollouts' held-out evidence apart (as judge.json's
        `heldout.by_source`), each with its interval; only when there are rollouts."""
        if not h_rollout.any():
            return {}
        out = {}
        for name, rows_of in (("search", ~h_rollout), ("rollout", h_rollout)):
            at = np.flatnonzero(rows_of)
            out[name] = {"n": int(len(at)), "gate": gate(opened[at], h_closed[at]),
                         "ci95": bootstrap(opened[at], h_closed[at], [h_questions[k] for k in at])}
        return {"heldout_by_source": out}

    def row(name: str, threshold: float, scores: np.ndarray = h_scores, **extra: Any) -> None:
        opened = scores >= threshold
        rows[name] = {"threshold": round(threshold, 4), "heldout_gate": gate(opened, h_closed),
                      "heldout_gate_ci95": bootstrap(opened, h_closed, h_questions),
                      "heldout_i_recall": float((~opened & h_closed).sum() / h_closed.sum()),
                      "heldout_open_recall": float((opened & ~h_closed).sum() / (~h_closed).sum()), **extra,
                      **by_source(opened)}

    row("fixed-0.5", 0.5)
    in_sample = calibrate_threshold(evidence_relevance(embedded, full, evidence), e_closed)
    row("in-sample", in_sample.threshold, training_gate=in_sample.gate)
    for folds in args.folds:
        oof = [0.0] * len(evidence)
        for fold in range(folds):
            fitted = [e for e in train if question_fold(e.question_id, folds, seed) != fold]
            scored = [k for k, e in enumerate(evidence) if question_fold(e.question_id, folds, seed) == fold]
            head = head_on(embedded, fitted)
            for k, s in zip(scored, evidence_relevance(embedded, head, [evidence[k] for k in scored]), strict=True):
                oof[k] = s
        c = calibrate_threshold(oof, e_closed)
        row(f"cross-fitted-{folds}", c.threshold, training_gate=c.gate)
        if folds == 5:
            oof5 = oof
    # held back: fold 0 of 5 (20% of the training questions) calibrates a head fitted on the rest
    fitted = [e for e in train if question_fold(e.question_id, 5, seed) != 0]
    back = [e for e in evidence if question_fold(e.question_id, 5, seed) == 0]
    head80 = head_on(embedded, fitted)
    c = calibrate_threshold(evidence_relevance(embedded, head80, back), [e.label is Status.INSUFFICIENT for e in back])
    row("held-back-20", c.threshold, np.array(evidence_relevance(embedded, head80, heldout)), training_gate=c.gate,
        n_calibration=len(back))
    row("held-back-20/full-head", c.threshold, training_gate=c.gate, n_calibration=len(back))
    # a per-status pair on the cross-fitted scores (5 folds)
    oof_maxima = np.zeros((len(evidence), 2))
    for fold in range(5):
        fitted = [e for e in train if question_fold(e.question_id, 5, seed) != fold]
        scored = [k for k, e in enumerate(evidence) if question_fold(e.question_id, 5, seed) == fold]
        oof_maxima[scored] = status_maxima(embedded, head_on(embedded, fitted), [evidence[k] for k in scored])
    t_s, t_a, train_gate = pair_calibration(oof_maxima, np.array(e_closed))
    h_maxima = status_maxima(embedded, full, heldout)
    opened = (h_maxima[:, 0] >= t_s) | (h_maxima[:, 1] >= t_a)
    rows["pair-cross-fitted-5"] = {"threshold_s": round(t_s, 4), "threshold_a": round(t_a, 4),
                                   "training_gate": train_gate, "heldout_gate": gate(opened, h_closed),
                                   "heldout_gate_ci95": bootstrap(opened, h_closed, h_questions),
                                   **by_source(opened)}
    # the ceiling: the best single threshold on the held-out evidence itself
    best = calibrate_threshold(h_scores.tolist(), h_closed.tolist())
    row("heldout-best (reference)", best.threshold)
    return {"seed": seed, "counts": {"train_passages": len(train), "train_evidence": len(evidence),
                                     "heldout_evidence": len(heldout),
                                     "heldout_questions": len(set(h_questions)),
                                     "heldout_i": int(h_closed.sum()), "train_evidence_i": int(sum(e_closed)),
                                     "oof5_mean_score": float(np.mean(oof5)),
                                     "in_sample_mean_score": float(np.mean(evidence_relevance(embedded, full,
                                                                                                 evidence)))},
            "rules": rows, "seconds": round(time.perf_counter() - start, 1),
            "load_avg_1min": round(os.getloadavg()[0], 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=None, help="data suite (default: the embedded one)")
    parser.add_argument("--max-questions", type=int, default=200, help="training questions (0: all)")
    parser.add_argument("--rollouts", nargs="*", default=[], help="rollout dumps, as `eviback build-judge`")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--folds", type=int, nargs="+", default=[5, 10])
    parser.add_argument("--embedding-cache", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if 5 not in args.folds:
        parser.error("--folds must include 5 (the builder's rule)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    cache: dict[tuple[str, int], Any] = {}
    if args.embedding_cache and args.embedding_cache.exists():
        cache = torch.load(args.embedding_cache)
    results = []
    for seed in args.seeds:
        results.append(run_seed(args, seed, cache))
        if args.embedding_cache:
            torch.save(cache, args.embedding_cache)
        for name, r in results[-1]["rules"].items():
            print(json.dumps({"seed": seed, "rule": name, **r}), flush=True)
    summary = {}
    for name in results[0]["rules"]:
        values = [r["rules"][name]["heldout_gate"] for r in results]
        summary[name] = {"mean_heldout_gate": round(float(np.mean(values)), 4),
                         "sd_across_seeds": round(float(np.std(values, ddof=1)), 4) if len(values) > 1 else None,
                         "per_seed": [round(v, 4) for v in values]}
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v
                                                 for k, v in vars(args).items()},
                                        "summary": summary, "seeds": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
