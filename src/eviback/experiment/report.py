"""The comparison of an experiment, from what `<out>` holds (the finished runs, whichever they are):

    comparison.json   every number below
    comparison.md     held-out tables (per set and macro), paired differences with 95% intervals, training cost
    comparison.html   the same tables and the training curves, in one self-contained page
    plots/curves.png  per-step curves of every arm (mean over its seeds; a 5-step trailing mean over the points)

Redrawn after every finished run, and at any time with `eviback experiment CONFIG --report-only`.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from eviback.data import read_jsonl
from eviback.experiment.compare import (
    CURVES,
    DIVERSITY_KINDS,
    ITEM_METRICS,
    all_zero_anatomy,
    changed_share,
    item_scores,
    mean_curves,
    paired_bootstrap,
    trailing_mean,
    training_summary,
)
from eviback.experiment.config import ExperimentConfig
from eviback.experiment.run import DONE, START, run_dir, start_fingerprint
from eviback.metrics import METRIC_NOTE, answer_key
from eviback.templates import render

EVAL_COLUMNS = (("em", "EM"), ("f1", "F1"), ("valid_answer_rate", "valid answer"), ("avg_searches", "searches"),
                ("duplicate_query_rate", "duplicate queries"), ("forced_termination_rate", "forced termination"))
SMOOTHING = 5  # steps in the curves' trailing mean (drawn over the faint per-step points)
DIFF_LABELS = {"f1": "F1", "em": "EM", "valid_answer": "valid answer", "searches": "searches",
               "duplicate_searches": "duplicate queries per item", "forced": "forced termination"}


def _records(directory: Path) -> list[dict]:
    return list(read_jsonl(directory / "eval" / "items.jsonl.gz"))


def _items(directory: Path) -> dict:
    return item_scores(_records(directory))


def _answers(directory: Path) -> dict:
    return {(r["benchmark"], str(r["id"])): answer_key(r["answer"]) if r["answer"] is not None else None
            for r in _records(directory)}


def _metrics(directory: Path) -> list[dict]:
    return list(read_jsonl(directory / "metrics.jsonl"))


def _groups(directory: Path) -> list[dict]:
    """The run's compact group records (none for a run kept without them)."""
    path = directory / "groups.jsonl.gz"
    return list(read_jsonl(path)) if path.exists() else []


def _summary(directory: Path) -> dict:
    return json.loads((directory / "eval" / "summary.json").read_text())


def load_finished(config: ExperimentConfig) -> dict[str, list[tuple[int, Path]]]:
    """Per arm, its finished runs (seed, directory), in the config's order; arms with none are left out."""
    finished: dict[str, list[tuple[int, Path]]] = {}
    for arm in config.arms:
        runs = [(s, run_dir(config.out, arm.name, s)) for s in arm.seeds
                if (run_dir(config.out, arm.name, s) / DONE).exists()]
        if runs:
            finished[arm.name] = runs
    return finished


def eval_rows(summaries: list[dict]) -> dict[str, dict[str, float]]:
    """Per set and "macro", each metric averaged over the given runs' summaries (one per seed)."""
    rows: dict[str, dict[str, float]] = {}
    names = [b["name"] for b in summaries[0]["benchmarks"]]
    for name in names:
        per_seed = [next(b["metrics"] for b in s["benchmarks"] if b["name"] == name) for s in summaries]
        rows[name] = {k: sum(m[k] for m in per_seed) / len(per_seed) for k, _ in EVAL_COLUMNS}
    rows["macro"] = {k: sum(rows[n][k] for n in names) / len(names) for k, _ in EVAL_COLUMNS}
    return rows


def build(config: ExperimentConfig) -> dict[str, Any]:
    """Every number of the comparison, from the finished runs."""
    finished = load_finished(config)
    start = config.out / START
    result: dict[str, Any] = {"experiment": config.name, "steps": config.steps, "baseline": config.baseline,
                              "arms": {}, "differences": {}, "difference_seeds": {}}
    if (start / DONE).exists():
        result["warm_start"] = {"eval": eval_rows([_summary(start)])}
    items = {arm: [_items(d) for _, d in runs] for arm, runs in finished.items()}
    start_items = [_items(start)] if (start / DONE).exists() else []
    # every evaluated start by its fingerprint: the experiment's, and any other warm start a run began from
    # (rebuilt on another machine; `<out>/warm-start-<fingerprint>/`), so that each run is measured from its own
    evaluated = {fp: d for d in [start, *sorted(config.out.glob(f"{START}-*"))]
                 if (d / DONE).exists() and (fp := start_fingerprint(d)) is not None}
    main = start_fingerprint(start) if start_items else None
    others = {fp: d for fp, d in evaluated.items() if fp != main}
    if others:
        result["other_starts"] = {fp[:16]: {"eval": eval_rows([_summary(d)])} for fp, d in others.items()}
    answers = {d: _answers(d) for d in evaluated.values()}
    start_scores = {d: _items(d) for d in evaluated.values() if d != start}  # held-out scores of each start
    if start_items:
        start_scores[start] = start_items[0]
    began = {d: start_fingerprint(d) for runs in finished.values() for _, d in runs}  # each run's start

    def own_start(run: Path) -> Path | None:
        return evaluated.get(began[run], start if start_items else None)

    for arm, runs in finished.items():
        metrics = [_metrics(d) for _, d in runs]
        changed = [changed_share(_answers(d), answers[own]) for _, d in runs if (own := own_start(d)) is not None]
        result["arms"][arm] = {
            "seeds": [s for s, _ in runs],
            "eval": eval_rows([_summary(d) for _, d in runs]),
            "eval_per_seed": {str(s): eval_rows([_summary(d)])["macro"] for s, d in runs},
            "training": training_summary(metrics),
            "all_zero": all_zero_anatomy([g for _, d in runs for g in _groups(d)]),
            "answers_changed": sum(changed) / len(changed) if changed else None,
            "curves": {key: dict(zip(*mean_curves(metrics, key), strict=True)) for key, _ in CURVES},
        }

    def compare(label: str, a: list, b: list, seeds: str, paired_seeds: bool = False) -> None:
        result["difference_seeds"][label] = seeds  # which runs: "0, 1 paired", "0, 1 - 0", ...
        result["differences"][label] = {
            m: {k: v.to_json() for k, v in paired_bootstrap(a, b, m, samples=config.bootstrap_samples,
                                                            seed=config.bootstrap_seed,
                                                            paired_seeds=paired_seeds).items()}
            for m in ITEM_METRICS}

    starts: dict[str, list[str]] = {}
    for label, directory in [("warm start", start), *((f"warm start {fp[:16]}", d) for fp, d in others.items()),
                             *((f"{a} seed {s}", d) for a, runs in finished.items() for s, d in runs)]:
        if (fingerprint := start_fingerprint(directory)) is not None:
            starts.setdefault(fingerprint[:16], []).append(label)
    result["start_policies"] = starts  # one entry when every run started from the same weights

    def against(arm: str, other: str) -> None:
        # Run s of every arm shares its questions and sampling seeds: two arms are compared on the seeds both
        # ran, run s against run s (a seed only one of them ran adds only seed noise); apart when they share none.
        pick = {s: i for i, (s, _) in enumerate(finished[other])}
        common = [s for s, _ in finished[arm] if s in pick]
        if common:
            own = {s: i for i, (s, _) in enumerate(finished[arm])}
            # runs of one seed share their path only from the same weights: say so when they did not
            apart = any(began[finished[arm][own[s]][1]] != began[finished[other][pick[s]][1]] for s in common)
            compare(f"{arm} - {other}", [items[arm][own[s]] for s in common],
                    [items[other][pick[s]] for s in common],
                    f"{_seeds(common)} paired" + (", from different starts" if apart else ""), paired_seeds=True)
        else:
            compare(f"{arm} - {other}", items[arm], items[other],
                    f"{_seeds(s for s, _ in finished[arm])} - {_seeds(s for s, _ in finished[other])}")

    base = items.get(config.baseline)
    base_seeds = [s for s, _ in finished.get(config.baseline, [])]
    for arm in items:
        if base is not None and arm != config.baseline:
            against(arm, config.baseline)
    for arm, other in config.contrasts:
        if arm in items and other in items:
            against(arm, other)
    if base is not None and len(base) >= 2:  # the noise floor: one seed of the baseline against another
        first, second = base_seeds[:2]
        compare(f"{config.baseline} seed {second} - {config.baseline} seed {first}", base[1:2], base[:1],
                f"{second} - {first}")
    for fp, directory in others.items() if start_items else ():
        compare(f"warm start {fp[:16]} - warm start", [start_scores[directory]], start_items, "")
    for arm, runs in finished.items():  # each run against the start it began from
        by_start: dict[Path, list[int]] = {}
        for i, (_, d) in enumerate(runs):
            if (own := own_start(d)) is not None:
                by_start.setdefault(own, []).append(i)
        for own, picked in by_start.items():
            label = "warm start" if own == start else f"warm start {began[runs[picked[0]][1]][:16]}"
            compare(f"{arm} - {label}", [items[arm][i] for i in picked], [start_scores[own]],
                    _seeds(runs[i][0] for i in picked))
    return result


def _seeds(seeds: Iterable[int]) -> str:
    return ", ".join(map(str, seeds))


def _f(x: float, digits: int = 3) -> str:
    return "" if x is None or x != x else f"{x:.{digits}f}"


def _tables(result: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) of every table, shared by the markdown and the HTML."""
    tables = []
    rows = []
    reference = {"warm start": result["warm_start"]["eval"]} if "warm_start" in result else {}
    reference.update({f"warm start {fp}": r["eval"] for fp, r in result.get("other_starts", {}).items()})
    policies = {**reference, **{f"{a} (mean of {len(r['seeds'])})": r["eval"] for a, r in result["arms"].items()}}
    for name, sets in policies.items():
        for split, m in sets.items():
            rows.append([name, split, *(_f(m[k]) for k, _ in EVAL_COLUMNS)])
    tables.append(("Held-out evaluation (greedy), per set and macro average", ["policy", "set",
                   *(label for _, label in EVAL_COLUMNS)], rows))
    seed_rows = [[a, s, *(_f(m[k]) for k, _ in EVAL_COLUMNS)] for a, r in result["arms"].items()
                 for s, m in r["eval_per_seed"].items()]
    tables.append(("Held-out macro average of every run", ["arm", "seed", *(label for _, label in EVAL_COLUMNS)],
                   seed_rows))
    diff_rows = []
    for label, per_metric in result["differences"].items():
        cells = []
        for m in ITEM_METRICS:
            d = per_metric[m]["macro"]
            mark = " *" if d["excludes_zero"] else ""
            cells.append(f"{d['diff']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}]{mark}")
        diff_rows.append([label, result.get("difference_seeds", {}).get(label, ""),
                          str(per_metric["f1"]["macro"]["items"]), *cells])
    tables.append(("Paired differences on the same items, macro average, 95% bootstrap interval over items and "
                   "seeds (* : the interval excludes 0; seeds 'paired': run s against run s of the same seed)",
                   ["comparison", "seeds", "items",
                                                         *(DIFF_LABELS[m] for m in ITEM_METRICS)], diff_rows))
    cost = []
    for a, r in result["arms"].items():
        t = r["training"]
        cost.append([a, str(t["runs"]), str(t["steps"]), _f(t["step_s"], 1), _f(t["rollout_s"], 1),
                     _f(t["update_s"], 1), _f(t["teacher_s"], 1), _f(t["peak_rss_gb"], 2), _f(t["train_f1"]),
                     _f(t["kl"], 4), _f(r["answers_changed"], 3), _f(t["all_zero_share"], 2),
                     f"{t['informative_fallback_groups']} / {t['fallback_groups']}", str(t["teacher_judged"]), str(t["teacher_errors"]), _f(t["teacher_tokens_per_judged"], 0)])
    tables.append(("Training (means over steps and seeds)", [
        "arm", "runs", "steps", "step s", "rollout s", "update s", "teacher s", "peak RSS GB", "train F1",
        "KL", "held-out answers changed vs warm start", "all-zero share", "informative / fallback groups",
        "teacher judged", "teacher errors", "teacher tokens / judged"], cost))
    verdicts = [[a, str(t["teacher_judged"]), str(t["stage_b_runs"]), str(t["stage_b_ungrounded"]),
                 " / ".join(str(t["teacher_status"][st]) for st in ("S", "A", "I")), str(t["teacher_errors"]),
                 f"{t['informative_fallback_groups']} / {t['fallback_groups']}",
                 _f(t.get("gate_balanced_accuracy", float("nan")), 2),
                 f"{t['evidence_open']} / {t['evidence_labelled']}" if t.get("evidence_labelled") else ""]
                for a, r in result["arms"].items() if (t := r["training"])["teacher_judged"]]
    if verdicts:
        tables.append(("What the teacher said (sums over steps and seeds)", [
            "arm", "rollouts judged", "Stage A not I (Stage B ran)", "Stage B lowered to I (answer not in the "
            "evidence)", "final S / A / I", "teacher errors", "informative / fallback groups",
            "Stage A gate balanced accuracy (I vs not-I, against evidence labels)",
            "judged rollouts whose evidence label is S or A (a gold answer or support in what they saw)"],
            verdicts))
    diversity = [[a, *(_f(r["training"]["distinct"][k], 2) for k in DIVERSITY_KINDS)]
                 for a, r in result["arms"].items()]
    tables.append(("Within-group diversity of the all-zero groups (distinct values among a group's G rollouts, "
                   "means over steps and seeds; 1: all alike)", [
                       "arm", "query sets", "evidence sets", "evidence labels (what a perfect judge could tell "
                       "apart)", "rewards (what the advantages came from)", "teacher statuses"], diversity))
    anatomy = [[a, str(z["groups"]), str(z["informative"]),
                f"{z['first_query_is_question']} / {z['rollouts']}", str(z["no_search"]), str(z["same_evidence"]),
                str(z["f1_differs"]), f"{z['labels_differ']} / {z['labelled']}" if z["labelled"] else "",
                " / ".join(str(z[k]) for k in ("judged_all_s", "judged_all_a", "judged_all_i", "judged_mixed"))
                if z["judged"] else ""]
               for a, r in result["arms"].items() if (z := r.get("all_zero")) and z["groups"]]
    if anatomy:
        tables.append(("The all-zero groups, counted from groups.jsonl (sums over steps and seeds): what could tell "
                       "their rollouts apart", [
                           "arm", "all-zero groups", "rewards differ (informative)",
                           "rollouts whose first search was the question as written", "rollouts with no search",
                           "groups whose rollouts all retrieved the same passages",
                           "groups whose rollouts' answer F1 differs (what f1-fallback rewards)",
                           "groups whose evidence labels differ / labelled (what a perfect evidence judge "
                           "could tell apart)",
                           "teacher judged all S / all A / all I / mixed"], anatomy))
    machine = [[a, _f(r["training"]["step_s"], 1), _f(r["training"]["cpu_s"], 1),
                _f(r["training"]["cpu_s"] / r["training"]["step_s"], 2) if r["training"]["step_s"] else "",
                _f(r["training"]["other_cpu_s"], 1), _f(r["training"]["steal_share"], 3)]
               for a, r in result["arms"].items()]
    tables.append(("The machine under the runs (means over steps; step times compare only where other "
                   "processes and steal took little)", ["arm", "step s", "run's CPU s", "cores used",
                                                       "other processes' CPU s", "steal share"], machine))
    return tables


def start_line(result: dict[str, Any]) -> str:
    starts = result.get("start_policies") or {}
    if len(starts) == 1:
        return f"Every run started from the same weights (fingerprint {next(iter(starts))})."
    if not starts:
        return "The runs' starting weights are not recorded."
    compared = ("; each run is compared with the start it began from where that start was evaluated "
                f"(warm start {', '.join(result['other_starts'])})" if result.get("other_starts") else "")
    return "**The runs did not all start from the same weights**: " + "; ".join(
        f"{k}: {', '.join(v)}" for k, v in starts.items()) + compared + "."


def markdown(result: dict[str, Any]) -> str:
    lines = [f"# Experiment {result['experiment']}: {result['steps']} steps per run, baseline "
             f"{result['baseline']}", "", start_line(result), "", METRIC_NOTE.capitalize() + ".", ""]
    for title, header, rows in _tables(result):
        lines += [f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows] + [""]
    return "\n".join(lines)


def plot_curves(result: dict[str, Any], path: Path) -> Path:
    # matplotlib (a second to import) and its headless backend, chosen before pyplot loads: for the figure only
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = -(-len(CURVES) // 3)
    fig, axes = plt.subplots(rows, 3, figsize=(14, 3.5 * rows), squeeze=False)
    for ax, (key, title) in zip(axes.flat, CURVES, strict=False):
        for i, (arm, r) in enumerate(result["arms"].items()):
            curve = r["curves"].get(key) or {}
            if curve:
                steps, values = [int(s) for s in curve], list(curve.values())
                ax.plot(steps, values, color=f"C{i}", marker="o", markersize=2, linewidth=0.6, alpha=0.35)
                ax.plot(steps, trailing_mean(values, SMOOTHING), color=f"C{i}", linewidth=1.8, label=arm)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def page(result: dict[str, Any], png: Path) -> str:
    """The comparison as one HTML page, the figure inlined (templates/experiment.html.j2)."""
    tables = [{"title": title, "header": header, "rows": rows} for title, header, rows in _tables(result)]
    return render("experiment.html.j2", experiment=result["experiment"], steps=result["steps"],
                  start_line=start_line(result), note=METRIC_NOTE.capitalize() + ".", tables=tables,
                  smoothing=SMOOTHING,
                  image=base64.b64encode(png.read_bytes()).decode())


def write_comparison(config: ExperimentConfig) -> list[Path]:
    """Write the comparison files of whatever runs have finished; returns their paths."""
    result = build(config)
    out = config.out
    paths = [out / "comparison.json", out / "comparison.md", out / "plots" / "curves.png", out / "comparison.html"]
    paths[0].write_text(json.dumps(result, indent=1) + "\n")
    paths[1].write_text(markdown(result))
    plot_curves(result, paths[2])
    paths[3].write_text(page(result, paths[2]), encoding="utf-8")
    return paths
