"""The result of an E2E-APE run as a frozen record, and its Markdown report.

:class:`ApeResult` (schema-versioned) holds every candidate with its metrics, gate report and the reason it
was rejected, the proposals that never became candidates, the selection with the non-dominated set, and the
sealed-test comparison of the winner with the manual single-prompt dual-task policy. :func:`write_outputs`
writes it as ``result.json`` and renders ``report.md`` from it alone (the report is a pure function of the
result, so it can be regenerated from the JSON).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from eviback.ape.events import RunIdentity
from eviback.ape.records import (
    NOT_APPLICABLE,
    Candidate,
    CandidateMetrics,
    Confirmation,
    GateReport,
    Phase,
    RejectedProposal,
    Selection,
    StabilityMetrics,
)
from eviback.ape.spec import ConstraintSpec
from eviback.types import to_dict

RESULT_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class CandidateRecord:
    candidate: Candidate
    outcome: str  # feasible | rejected | not evaluated
    phase: Phase | None  # where it was rejected
    reasons: tuple[str, ...]
    metrics: CandidateMetrics | None  # validation metrics measured (partial when rejected early)
    report: GateReport | None
    feedback_objective: float | None = None  # on the training feedback rollouts, when it was judged there


@dataclass(frozen=True)
class TestComparison:
    """The winner and the manual single-prompt dual-task policy on the sealed test split."""

    winner: str
    winner_name: str
    baseline: str
    baseline_name: str
    winner_metrics: CandidateMetrics
    baseline_metrics: CandidateMetrics
    winner_report: GateReport
    baseline_report: GateReport


@dataclass(frozen=True)
class ProposalCounts:
    """What became of the controller's replies (every one is validated before any teacher call)."""

    received: int  # controller replies (calls that failed included)
    invalid: int  # no valid workflow: unparseable, unknown keys, an invalid IR (e.g. I in a later run_on)
    leaky: int  # valid workflows that break the evidence boundary (gold reaches the status stage)
    other_static: int  # valid, compliant workflows rejected before any call for another reason (duplicate, ...)
    evaluated: int  # candidates that went on to be judged


@dataclass(frozen=True)
class ApeResult:
    identity: RunIdentity
    spec: ConstraintSpec
    candidates: tuple[CandidateRecord, ...]
    rejected_proposals: tuple[RejectedProposal, ...]
    selection: Selection | None
    test: TestComparison | None
    frozen_path: str
    frozen_version: str
    teacher_calls: int  # backend calls paid over the whole run (all resumptions), cache hits excluded
    confirmation: Confirmation | None = None  # the sealed test's verdict on the winner (None: no winner)
    proposals: ProposalCounts | None = None
    schema_version: int = RESULT_SCHEMA_VERSION

    def record(self, candidate_id: str) -> CandidateRecord | None:
        return next((r for r in self.candidates if r.candidate.id == candidate_id), None)


def write_outputs(result: ApeResult, out: str | Path) -> None:
    out = Path(out)
    (out / "result.json").write_text(json.dumps(to_dict(result), indent=1, ensure_ascii=False, sort_keys=True) + "\n",
                                     encoding="utf-8")
    (out / "report.md").write_text(render_markdown(result), encoding="utf-8")


# --------------------------------------------------------------------------------------------------


def _f(x: float | None, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _stab(s: StabilityMetrics | None) -> str:
    if s is None:
        return "–"
    a, k = s.agreement, s.kappa
    kappa = f"κ {_f(k.value, 2)} (LB {_f(k.lower, 2)})" if k.value is not None else (
        f"κ undefined (all {s.constant_label})" if s.constant_label else "κ undefined")
    return f"{_f(a.rate, 2)} (LB {_f(a.lower, 2)}, n={a.n}); {kappa}"


def _stab_or_na(m: CandidateMetrics, report: GateReport | None, gate: str) -> str:
    """The stability cell, or "not applicable" where the check measures nothing for the policy."""
    results = report.results if report is not None else ()
    na = next((g for g in results if g.gate == gate and g.value.startswith(NOT_APPLICABLE)), None)
    return NOT_APPLICABLE + " (greedy decoding)" if na is not None else _stab(m.stability_of(gate.replace(" ", "_")))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _candidate_table(records: Sequence[CandidateRecord], winner: str | None, front: Sequence[str],
                     spec: ConstraintSpec) -> list[str]:
    lines = ["| id | workflow | origin | outcome | objective | S on suff. / I on insuff. | tokens / rollout | "
             "calls / rollout | schema viol. | reordered | paraphrased | repeated sampling | why rejected |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        c, m = r.candidate, r.metrics
        mark = " **(winner)**" if c.id == winner else (" (non-dominated)" if c.id in front else "")
        origin = c.origin.value + (f" of {c.parent}" if c.parent else "") + (f": {c.note}" if c.note else "")
        outcome = r.outcome + (f" ({r.phase.value})" if r.phase else "") + mark
        if m is not None:
            s = m.sufficiency
            cols = [_f(m.objective(spec.objective.metric)), f"{_f(s.on_sufficient, 2)} / {_f(s.on_insufficient, 2)}",
                    f"{m.cost.tokens_per_rollout:.0f}", f"{m.cost.requests_per_rollout:.2f}",
                    _f(m.schema_violation_rate, 3),
                    _stab(m.stability_of("reordered_evidence")), _stab(m.stability_of("paraphrased_question")),
                    _stab_or_na(m, r.report, "repeated sampling")]
        else:
            cols = ["–"] * 8
        lines.append("| " + " | ".join(_cell(x) for x in [c.id, c.policy.name, origin, outcome, *cols,
                                                          "; ".join(r.reasons)]) + " |")
    return lines


def _injection(m: CandidateMetrics, label: str) -> str:
    i = m.injection_toward(label)
    if i is None:
        return "–"
    rate = "" if i.flip_rate is None else f" ({i.flip_rate:.2f})"
    return f"{i.flipped} / {i.eligible}{rate}"


def comparison_rows(t: TestComparison) -> list[tuple[str, str, str]]:
    """(metric, winner, baseline) rows of the sealed-test comparison."""
    w, b = t.winner_metrics, t.baseline_metrics

    def leaks(m: CandidateMetrics) -> str:
        return "–" if m.boundary.gold_leaks is None else f"{m.boundary.gold_leaks} in {m.boundary.audited_requests}"

    def status(m: CandidateMetrics) -> str:
        return " / ".join(f"{k} {m.status.get(k, 0)}" for k in ("S", "A", "I", "error"))

    rows = [
        ("static boundary violations (gold reaches the status stage)", str(len(w.boundary.static_violations)),
         str(len(b.boundary.static_violations))),
        ("canary leaks in gold-blind/status requests", leaks(w), leaks(b)),
        ("I overturned", str(w.boundary.overturned_i), str(b.boundary.overturned_i)),
        ("schema-violation rate", _f(w.schema_violation_rate), _f(b.schema_violation_rate)),
        ("teacher-error rate", _f(w.error_rate), _f(b.error_rate)),
        ("stability: repeated sampling", _stab_or_na(w, t.winner_report, "repeated sampling"),
         _stab_or_na(b, t.baseline_report, "repeated sampling")),
        ("stability: reordered evidence", _stab(w.stability_of("reordered_evidence")),
         _stab(b.stability_of("reordered_evidence"))),
        ("stability: paraphrased question", _stab(w.stability_of("paraphrased_question")),
         _stab(b.stability_of("paraphrased_question"))),
        ("prompt injection toward S: flipped to S / not S before", _injection(w, "S"), _injection(b, "S")),
        ("prompt injection toward I: flipped to I / not I before", _injection(w, "I"), _injection(b, "I")),
        ("tokens per judged rollout", f"{w.cost.tokens_per_rollout:.0f}", f"{b.cost.tokens_per_rollout:.0f}"),
        ("calls per judged rollout", f"{w.cost.requests_per_rollout:.2f}", f"{b.cost.requests_per_rollout:.2f}"),
        ("Stage B run rate", _f(w.cost.stage_b_rate, 2), _f(b.cost.stage_b_rate, 2)),
        ("agreement with sufficiency labels (balanced)", _f(w.sufficiency.balanced_agreement),
         _f(b.sufficiency.balanced_agreement)),
        ("agreement with sufficiency labels (plain)", _f(w.sufficiency.agreement), _f(b.sufficiency.agreement)),
        ("  on sufficient evidence (S right) / insufficient (I right)",
         f"{_f(w.sufficiency.on_sufficient, 2)} / {_f(w.sufficiency.on_insufficient, 2)}",
         f"{_f(b.sufficiency.on_sufficient, 2)} / {_f(b.sufficiency.on_insufficient, 2)}"),
        ("final verdicts", status(w), status(b)),
        ("labelled rollouts / rollouts", f"{w.sufficiency.labelled} / {w.rollouts}",
         f"{b.sufficiency.labelled} / {b.rollouts}"),
        ("all gates passed", "yes" if t.winner_report.passed else "no", "yes" if t.baseline_report.passed else "no"),
    ]
    return rows


def render_markdown(result: ApeResult) -> str:
    ident, spec, sel = result.identity, result.spec, result.selection
    winner = sel.winner if sel else None
    front = sel.non_dominated if sel else ()
    lines = ["# E2E-APE report", ""]
    c = result.confirmation
    if winner and c is not None and not c.confirmed:
        w = result.record(winner)
        name = w.candidate.policy.name if w else winner
        lines += [f"**Nothing frozen: the sealed test did not confirm the selected winner {winner} `{name}`** "
                  f"(rule `{c.rule.value}`): " + "; ".join(c.reasons) + ".", ""]
    elif winner:
        w = result.record(winner)
        name = w.candidate.policy.name if w else winner
        lines += [f"**Winner: {winner} `{name}`**, frozen as `{Path(result.frozen_path).name}` version "
                  f"`{result.frozen_version[:12]}`. Selection: {sel.reason if sel else ''}.", ""]
    else:
        lines += ["**No candidate passed every gate: nothing was frozen.** Each candidate's reason is below; relax "
                  "the spec's thresholds only if the reasons say the gate, not the teacher, is wrong, or use a "
                  "stronger teacher model.", ""]
    lines += [f"Teacher backend `{ident.teacher_backend}`; controller `{ident.controller}`; spec sha256 "
              f"`{ident.spec_sha256[:16]}`; {result.teacher_calls} teacher calls paid over the run.", ""]
    lines += ["## Data", "", "| split | questions | rollouts | labelled | sufficient | sha256 |", "|---|---|---|---|---|---|"]
    for i in ident.splits:
        lines.append(f"| {i.name.value} | {i.questions} | {i.rollouts} | {i.labelled} | {i.sufficient} | `{i.sha256[:16]}` |")
    lines += ["", "Inputs: " + "; ".join(ident.inputs), ""]
    st = spec.stability
    lines += ["## Constraints", "",
              f"- hard gates: gold in Stage A requests = 0 (static and canaries), I overturned = 0, schema-violation "
              f"rate <= {spec.hard_gates.max_schema_violation_rate:g}, teacher-error rate <= "
              f"{spec.hard_gates.max_error_rate:g};",
              f"- stability on {st.rollouts} validation rollouts, one-sided {st.confidence:g} bounds (Wilson for "
              f"agreement, bootstrap with {st.bootstrap_resamples} resamples for Fleiss' kappa): " + "; ".join(
                  f"{k.replace('_', ' ')}: agreement LB >= {v.min_agreement:g}"
                  + (f", kappa LB >= {v.min_kappa:g}" if v.min_kappa is not None else "")
                  for k, v in st.checks().items() if v.enabled) + f"; repeated sampling uses {st.samples} samples;",
              f"- cost: <= {spec.cost.max_tokens_per_rollout:g} tokens and <= {spec.cost.max_calls_per_rollout:g} "
              f"calls per judged rollout (Stage B counted where it runs);",
              f"- objective among feasible candidates: {spec.objective.metric.value} (A earns "
              f"{spec.objective.ambiguous_credit:g}); ties within {spec.objective.tie_tolerance:g} go to the cheaper.",
              ""]
    lines += ["## Candidates (validation split)", "",
              "Objective = agreement with the sufficiency labels (balanced unless the spec says otherwise). "
              "Stability cells: agreement rate (Wilson lower bound, rollouts compared); Fleiss' κ (bootstrap lower "
              "bound). A dash: not measured, because the candidate was rejected before (no call spent on it).", ""]
    lines += _candidate_table(result.candidates, winner, front, spec)
    if front:
        lines += ["", f"Non-dominated (objective up, tokens down, stability floor up): {', '.join(front)}."]
    if result.proposals is not None and result.proposals.received:
        pc = result.proposals
        lines += ["", f"Controller proposals: {pc.received} received; {pc.invalid} invalid (no valid workflow), "
                  f"{pc.leaky} leaky (gold reaches the status stage), {pc.other_static} otherwise rejected before "
                  f"any call, {pc.evaluated} evaluated."]
    if result.rejected_proposals:
        lines += ["", "## Proposals that never became candidates", "", "| slot | from | reason | reply (start) |",
                  "|---|---|---|---|"]
        for p in result.rejected_proposals:
            lines.append(f"| {p.id} | {p.origin.value} of {p.parent} | {_cell(p.reason)} | "
                         f"`{_cell(p.excerpt[:160]).replace('`', chr(39))}` |")
    if result.test is not None:
        t = result.test
        lines += ["", "## Sealed test: the winner vs the manual single-prompt dual-task policy", "",
                  "The test split was opened once, after the selection; both policies were measured on it with "
                  "every condition (nothing short-circuits here).", "",
                  f"| metric | winner {t.winner} `{t.winner_name}` | manual `{t.baseline_name}` |", "|---|---|---|"]
        lines += [f"| {_cell(m)} | {_cell(a)} | {_cell(b)} |" for m, a, b in comparison_rows(t)]
        if c is not None:
            lines += ["", f"Freeze rule `{c.rule.value}`: the winner's objective {_f(c.winner_objective)}, one-sided "
                      f"{spec.stability.confidence:g} bootstrap lower bound {_f(c.winner_lower)}, against the "
                      f"baseline's {_f(c.baseline_objective)}" + (f" + margin {c.margin:g}" if c.margin else "")
                      + f": {'confirmed, frozen' if c.confirmed else 'not confirmed, nothing frozen'}."]
        failed = t.baseline_report.reasons()
        if failed:
            lines += ["", "Gates the manual policy fails on the test split: " + "; ".join(failed) + "."]
        wf = t.winner_report.reasons()
        if wf:
            lines += ["", "Gates the winner fails on the test split (it passed them on validation): " + "; ".join(wf) + "."]
    lines.append("")
    return "\n".join(lines)
