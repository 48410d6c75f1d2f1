"""Training curves and comparisons: PNG plots and a self-contained HTML report from a run's logs.

    eviback train ... writes them at the end of a run (and they can be redrawn at any time):
    python -m eviback.train.plots RUN_DIR [RUN_DIR ...] --out DIR

One run gives `plots/training_curves.png` and `report.html`, which opens with what the run did in a few
sentences and a small table (:mod:`eviback.train.report_summary`: groups, fallback, the teacher's signal and
its ceiling, the judge's gate, the validation curve's ends, the held-out change with paired bootstrap
intervals); a run that validated during training (`val_every`) gets the validation curves, overall and by
benchmark, beside the training rollouts' (:data:`VALIDATION_PANEL`, :func:`panels`); several runs give a
comparison figure with one line per run (e.g. plain GRPO vs EviBack vs DAPO from the same warm start).
Tables are laid out to fit a laptop's page: the step means one metric per row, one column per run.
"""

from __future__ import annotations

import argparse
import base64
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eviback.templates import Markup, render
from eviback.train.report_summary import summarize_run
from eviback.train.run import read_records

# (panel title, [(metric key, label)])
PANELS: list[tuple[str, list[tuple[str, str]]]] = [
    ("Answer quality (training rollouts)", [("rollout/em", "EM"), ("rollout/f1", "F1")]),
    ("Groups", [("backoff/all_zero_share", "all-zero share"),
                ("backoff/fallback_share", "fallback share (teacher asked)"),
                ("backoff/informative_fallback_share", "informative fallback share (of fallback groups)"),
                ("backoff/teacher_error_share", "teacher-error share")]),
    ("Answering", [("rollout/valid_answer_rate", "valid answer"),
                   ("rollout/forced_termination_rate", "forced termination")]),
    ("Searching", [("rollout/avg_searches", "searches / rollout"),
                   ("rollout/duplicate_query_rate", "duplicate-query rate")]),
    ("Teacher verdicts", [("teacher/status_S", "S"), ("teacher/status_A", "A"), ("teacher/status_I", "I"),
                          ("teacher/errors", "errors")]),
    ("Step time (s)", [("time/rollout", "rollout"), ("time/retrieval", "retrieval"),
                       ("time/teacher", "teacher"), ("time/update", "update")]),
    ("Optimisation", [("train/loss", "loss"), ("train/kl", "KL"), ("train/grad_norm", "grad norm")]),
    # could the all-zero groups carry a signal? (1: every rollout of a group alike)
    ("All-zero groups: distinct per group", [("backoff/all_zero_distinct_queries", "query sets"),
                                             ("backoff/all_zero_distinct_evidence", "evidence sets"),
                                             ("backoff/all_zero_distinct_rewards", "rewards"),
                                             ("backoff/all_zero_distinct_labels", "evidence labels"),
                                             ("backoff/all_zero_distinct_statuses", "teacher statuses")]),
]


# The held-out questions evaluated during training (`val_every`; eviback.train.validation), drawn beside the
# training rollouts' answer quality. Their per-benchmark curves are a panel of their own (`panels`).
VALIDATION_PANEL: tuple[str, list[tuple[str, str]]] = (
    "Validation (held-out questions, greedy)",
    [("val/em", "EM"), ("val/f1", "F1"), ("val/valid_answer_rate", "valid answer")])
# The panels whose means over the steps the report's table shows (a validation's mean over steps is no figure)
TABLE_PANELS = ("Answer quality (training rollouts)", "Groups", "Answering", "Searching")
_BENCHMARK_EM = re.compile(r"val/(.+)/em")


def panels(runs: dict[str, Sequence[dict[str, Any]]]) -> list[tuple[str, list[tuple[str, str]]]]:
    """The panels of `runs`' figure: :data:`PANELS`, with the validation panel after the first and, when the runs
    validated on several benchmarks, one more with each benchmark's validation EM (`val/<benchmark>/em`)."""
    benchmarks = sorted({m.group(1) for records in runs.values() for r in records for k in r
                         if (m := _BENCHMARK_EM.fullmatch(k))})
    extra = [VALIDATION_PANEL]
    if len(benchmarks) > 1:
        extra.append(("Validation EM by benchmark", [(f"val/{b}/em", b) for b in benchmarks]))
    return [PANELS[0], *extra, *PANELS[1:]]


def _series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        if r.get(key) is not None:
            xs.append(int(r["step"]))
            ys.append(float(r[key]))
    return xs, ys


def plot_runs(runs: dict[str, Sequence[dict[str, Any]]], path: Path) -> Path:
    """Draw every panel; with several runs, each run is one colour. Returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    drawn = [(t, m) for t, m in panels(runs) if any(_series(rs, k)[0] for rs in runs.values() for k, _ in m)]
    cols = 2
    rows = max(1, (len(drawn) + cols - 1) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(11, 3.2 * rows), squeeze=False)
    styles = ["-", "--", ":", "-."]
    for ax, (title, metrics) in zip(axes.flat, drawn, strict=False):
        for run_index, (run_name, records) in enumerate(runs.items()):
            for metric_index, (key, label) in enumerate(metrics):
                xs, ys = _series(records, key)
                if not xs:
                    continue
                name = label if len(runs) == 1 else f"{run_name}: {label}"
                color = f"C{metric_index}" if len(runs) == 1 else f"C{run_index}"
                style = "-" if len(runs) == 1 else styles[metric_index % len(styles)]
                ax.plot(xs, ys, style, color=color, marker="o", markersize=3, label=name)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no "1.2" between steps 1 and 2
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(drawn):]:
        ax.axis("off")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _mean_rows(runs: dict[str, Sequence[dict[str, Any]]], panels: Sequence[tuple[str, list[tuple[str, str]]]],
               ) -> list[dict[str, Any]]:
    """One row per metric (grouped by panel): its label, its key and its mean over each run's steps (None:
    never logged). Metrics no run logged are left out. A metric per row keeps the table narrow however many
    metrics there are; runs are the columns."""
    rows = []
    for title, metrics in panels:
        for key, label in metrics:
            means = []
            for records in runs.values():
                _, ys = _series(records, key)
                means.append(sum(ys) / len(ys) if ys else None)
            if any(m is not None for m in means):
                rows.append({"panel": title, "label": label, "key": key, "means": means})
    return rows


def write_report(run_dirs: Sequence[Path], out_dir: Path, extra_html: str = "") -> Path:
    """Plots plus an HTML page (images inlined, so the file stands alone; templates/training_report.html.j2).
    With one run the page opens with its summary (:func:`eviback.train.report_summary.summarize_run`).
    `extra_html` is an HTML fragment appended as is (the caller's markup, e.g. an evaluation table). Returns
    the HTML path."""
    runs = {Path(d).name: read_records(Path(d) / "metrics.jsonl") for d in run_dirs}
    png = plot_runs(runs, out_dir / "plots" / ("training_curves.png" if len(runs) == 1 else "comparison.png"))
    summary = None
    if len(run_dirs) == 1:
        found = summarize_run(run_dirs[0])
        summary = {"sentences": found.sentences(), "table": found.table()}
    page = render("training_report.html.j2", runs=list(runs), steps=[len(r) for r in runs.values()],
                  rows=_mean_rows(runs, [p for p in PANELS if p[0] in TABLE_PANELS]), summary=summary,
                  image=base64.b64encode(png.read_bytes()).decode(), extra_html=Markup(extra_html))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "report.html"
    path.write_text(page, encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Plot training curves of one or more eviback runs.")
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, help="output directory (default: the single run's directory)")
    args = parser.parse_args(argv)
    out = args.out or (args.runs[0] if len(args.runs) == 1 else Path("comparison"))
    print(json.dumps({"report": str(write_report(args.runs, out))}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
