"""Selection on the validation split: the best feasible candidate (ties to the cheaper), logged once."""

from __future__ import annotations

from typing import TYPE_CHECKING

from eviback.ape.events import CandidateEvaluated, Selected
from eviback.ape.gates import Scored, Selection, stability_floor

if TYPE_CHECKING:
    from eviback.ape.pipeline import ApeRun


def scored(run: ApeRun) -> list[Scored]:
    out = []
    for cid in run.candidates:
        d = run.decided.get(cid)
        if isinstance(d, CandidateEvaluated):
            m = d.metrics
            out.append(Scored(cid, True, m.objective(run.spec.objective.metric), m.cost.tokens_per_rollout,
                              m.cost.requests_per_rollout, stability_floor(m)))
    return out


def select(run: ApeRun) -> tuple[int, Selection]:
    if run.selected is None:
        selection = run.selector.select(scored(run), run.spec)
        run.emit(Selected(selection))
        run.progress(f"selected: {selection.winner or 'none'} ({selection.reason})")
    assert run.selected is not None
    return run.selected
