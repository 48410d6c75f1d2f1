"""Freeze a confirmed winner as a content-hashed teacher policy with its provenance (gates, metrics, the
sealed-test confirmation, data hashes)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from eviback.ape.candidates import Candidate
from eviback.ape.events import CandidateEvaluated, PolicyFrozen
from eviback.teacher.policy import freeze_policy

if TYPE_CHECKING:
    from eviback.ape.pipeline import ApeRun


def freeze(run: ApeRun, winner: Candidate) -> PolicyFrozen:
    if run.frozen is None:
        decided = run.decided[winner.id]
        assert isinstance(decided, CandidateEvaluated)
        test = run.tests.get(winner.id)
        from eviback.types import to_dict

        provenance = {
            "method": "E2E-APE (EVIBACK.md section 5)",
            "candidate": winner.id, "origin": winner.origin.value, "parent": winner.parent, "note": winner.note,
            "spec_sha256": run.spec.sha256,
            "splits": [to_dict(i) for i in run.splits.infos()],
            "teacher_backend": run.teacher_backend_id(), "controller": run.controller_id(),
            "gate_report": to_dict(decided.report),
            "validation_metrics": to_dict(decided.metrics),
            "sealed_test_metrics": to_dict(test.metrics) if test is not None else None,
            "selection": to_dict(run.selected[1]) if run.selected else None,
            "sealed_test_confirmation": to_dict(run.confirmation) if run.confirmation else None,
            "inputs": list(run.inputs),
        }
        path = freeze_policy(winner.policy, run.out / run.config.frozen_name, provenance)
        run.emit(PolicyFrozen(str(path), winner.policy.version))
        run.progress(f"froze {winner.policy.name} version {winner.policy.short_version} -> {path}")
    assert run.frozen is not None
    return run.frozen
