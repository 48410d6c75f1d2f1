"""Freeze a confirmed winner as a content-hashed teacher policy with its provenance (gates, metrics, the
sealed-test confirmation, data hashes)."""

from __future__ import annotations

from pathlib import Path

from eviback.ape.context import StageContext
from eviback.ape.events import CandidateEvaluated, PolicyFrozen, RunIdentity
from eviback.ape.records import Candidate
from eviback.teacher.policy import freeze_policy
from eviback.types import to_dict


def freeze(ctx: StageContext, winner: Candidate, path: Path, identity: RunIdentity) -> PolicyFrozen:
    """Freeze `winner` to `path` (once, logged), its provenance naming the run's backends and inputs from
    `identity`."""
    if ctx.state.frozen is None:
        decided = ctx.state.decided[winner.id]
        assert isinstance(decided, CandidateEvaluated)
        test = ctx.state.tests.get(winner.id)
        provenance = {
            "method": "E2E-APE (EVIBACK.md section 5)",
            "candidate": winner.id, "origin": winner.origin.value, "parent": winner.parent, "note": winner.note,
            "spec_sha256": ctx.spec.sha256,
            "splits": [to_dict(i) for i in ctx.splits.infos()],
            "teacher_backend": identity.teacher_backend, "controller": identity.controller,
            "gate_report": to_dict(decided.report),
            "validation_metrics": to_dict(decided.metrics),
            "sealed_test_metrics": to_dict(test.metrics) if test is not None else None,
            "selection": to_dict(ctx.state.selected[1]) if ctx.state.selected else None,
            "sealed_test_confirmation": to_dict(ctx.state.confirmation) if ctx.state.confirmation else None,
            "inputs": list(identity.inputs),
        }
        path = freeze_policy(winner.policy, path, provenance)
        ctx.emit(PolicyFrozen(str(path), winner.policy.version))
        ctx.progress(f"froze {winner.policy.name} version {winner.policy.short_version} -> {path}")
    assert ctx.state.frozen is not None
    return ctx.state.frozen
