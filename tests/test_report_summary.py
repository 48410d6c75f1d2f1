"""The top of a run's report: what the run did, in sentences and a small table, read from recorded run
directories; the paired bootstrap of the held-out change; the report page laid out to fit a laptop's width."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from eviback.stats import paired_bootstrap
from eviback.train.plots import write_report
from eviback.train.report_summary import summarize_run

ROOT = Path(__file__).resolve().parents[1]
ROUND2 = ROOT / "results" / "experiment-cpu-round2"
DEMO = Path(__file__).resolve().parent / "fixtures" / "demo-run"  # a small demo's run directory (its README)


@pytest.fixture(scope="module")
def round2_run(tmp_path_factory) -> Path:
    """Round 2's EviBack seed 0 as a run directory: its recorded files, with the warm start's evaluation on the
    same 500 questions as its `eval-start/` (an experiment evaluates the warm start once for every arm)."""
    run = tmp_path_factory.mktemp("round2") / "eviback-seed-0"
    shutil.copytree(ROUND2 / "eviback" / "seed-0", run)
    (run / "eval-start").mkdir()
    shutil.copy(ROUND2 / "warm-start" / "eval" / "items.jsonl.gz", run / "eval-start" / "items.jsonl.gz")
    return run


def test_the_summary_counts_what_round_2_counted(round2_run, monkeypatch, tmp_path):
    monkeypatch.setenv("EVIBACK_CACHE", str(tmp_path))  # the judge's record is not in this cache
    summary = summarize_run(round2_run)
    g = summary.groups
    # results/experiment-cpu-round2/README.md: 10 of the 79 fallback groups informative; all five rollouts
    # retrieved the same passages in 52 of the 79
    assert (g.groups, g.verified, g.fallback, g.informative) == (120, 41, 79, 10)
    assert g.evidence_differs == 79 - 52 and g.informative_steps[0] == 10
    # ... and 354 of the 395 all-zero rollouts (90%) searched first for the question as written
    assert (g.all_zero, g.all_zero_rollouts, g.first_query_is_question, g.all_zero_same_passages) == (79, 395, 354, 52)
    assert g.labels_differ is None  # round 2's group records predate the evidence labels
    # the gate against the evidence labels: closed 57 of 128 I rollouts, let through 262 of 267
    gate = summary.gate
    assert gate.judge == "910e9f486fb4" and not gate.found and gate.run_gate == pytest.approx(0.71, abs=0.005)
    assert (gate.run_closed_on_i, gate.run_label_i, gate.run_open_on_open, gate.run_label_open) == (57, 128, 262, 267)
    # the paired intervals are the experiment's own ("eviback seed 0 - warm start": F1 +0.068 [+0.043, +0.094],
    # EM +0.066 [+0.040, +0.090]), from the same items, resamples and seed
    h = summary.held_out
    assert h.items == 500 and h.benchmarks == 5
    assert (round(h.f1.diff, 3), round(h.f1.lo, 3), round(h.f1.hi, 3)) == (0.068, 0.043, 0.094)
    assert (round(h.em.diff, 3), round(h.em.lo, 3), round(h.em.hi, 3)) == (0.066, 0.040, 0.090)
    assert not h.f1.includes_zero
    text = " ".join(summary.sentences())
    assert "Of its 120 groups, 41 had a verified hit" in text and "to 10 of 79" in text
    assert "27 held rollouts that retrieved different passages" in text
    assert "+0.068 (95% interval +0.043 to +0.094)" in text and "Both intervals exclude 0" in text


def test_the_report_opens_with_the_summary_and_its_tables_fit_the_page(round2_run):
    page = write_report([round2_run], round2_run).read_text()
    assert page.index("What happened") < page.index("Means over training steps") < page.index("Curves")
    assert "<th>held-out F1, start -&gt; trained (500 questions)</th><td>0.236 -&gt; 0.304, +0.068 [+0.043, " \
           "+0.094]</td>" in page
    # the step means: one metric per row, the run as the column (no longer 10+ raw names in one header row)
    header = page[page.index("<table class='means'>"):].split("</tr>")[0]
    assert header.count("<th>") == 2
    assert "informative fallback share (of fallback groups) <span class='key'>backoff/informative_fallback_share" in page


@pytest.fixture
def demo_run(tmp_path) -> Path:
    run = tmp_path / "demo"
    shutil.copytree(DEMO, run)
    return run


def test_a_demo_run_says_its_teacher_had_nothing_to_tell_apart_and_its_change_is_noise(demo_run):
    summary = summarize_run(demo_run)
    g = summary.groups
    assert (g.groups, g.verified, g.fallback, g.informative, g.informative_steps) == (4, 0, 4, 1, (2,))
    assert (g.evidence_differs, g.labelled, g.labels_differ) == (3, 4, 0)
    assert (g.all_zero_labels_alike, g.all_zero_labelled) == (4, 4)
    # the judge as teacher.json records it (no cache needed): weak, accepted by the run
    gate = summary.gate
    assert gate.judge == "134125f8fbcd" and gate.found and gate.heldout_gate == 0.5 and gate.heldout_n == 45
    assert gate.weak and gate.weak_accepted and gate.floor == 0.6
    assert gate.run_gate is None  # every rollout it judged had evidence of one kind
    h = summary.held_out
    assert (h.items, h.benchmarks, h.answers_changed) == (30, 3, 4)
    assert (round(h.f1_before, 3), round(h.f1_after, 3)) == (0.056, 0.063)  # the printed table's overall row
    assert h.f1.includes_zero and h.em.includes_zero
    text = " ".join(summary.sentences())
    assert "Of its 4 groups, 0 had a verified hit" in text and "to 1 of 4 (step 2; none before)" in text
    assert "even a perfect evidence judge could have told no group's rollouts apart" in text
    assert "In 4 of 4 (100%) every rollout's evidence had the same label" in text
    assert "The judge is weak by its own held-out figures, and the run accepted it" in text
    assert "The F1 and EM intervals include 0" in text and "cannot be told apart from noise" in text


def test_the_run_report_opens_with_the_summary_above_its_tables(demo_run):
    from eviback.evaluate import read_summary
    from eviback.train.run import RunDir
    from eviback.train.runner import write_run_report

    page = write_run_report(RunDir(demo_run), read_summary(demo_run / "eval" / "summary.json"),
                            read_summary(demo_run / "eval-start" / "summary.json")).read_text()
    order = [page.index(h) for h in ("What happened", "Means over training steps", "Curves", "Held-out evaluation")]
    assert order == sorted(order)
    assert "<th>held-out F1, start -&gt; trained (30 questions)</th><td>0.056 -&gt; 0.063, +0.007 [+0.000, " in page
    assert "The F1 and EM intervals include 0" in page
    assert "<th>judge weak (by its held-out figures)</th><td>yes, accepted by the run</td>" in page


def test_the_bootstrap_pairs_items_and_says_when_the_interval_includes_zero():
    before = {("nq", str(i)): 0.0 for i in range(30)} | {("popqa", str(i)): 0.0 for i in range(30)}
    after = dict(before) | {("nq", "0"): 1.0}  # one answer of 60 fixed: no evidence of a change
    one = paired_bootstrap(before, after)
    assert one.includes_zero and one.diff == pytest.approx(1 / 30 / 2) and one.items == 60
    assert paired_bootstrap(before, after) == one  # seeded
    many = dict(before) | {(b, str(i)): 1.0 for b in ("nq", "popqa") for i in range(15)}
    assert not paired_bootstrap(before, many).includes_zero
    with pytest.raises(ValueError, match="share no item"):
        paired_bootstrap(before, {("hotpotqa", "0"): 1.0})
