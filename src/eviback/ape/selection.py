"""Selection on the validation split: the best feasible candidate (ties to the cheaper), logged once."""

from __future__ import annotations

from eviback.ape.context import StageContext
from eviback.ape.events import CandidateEvaluated, Selected
from eviback.ape.gates import Scored, stability_floor
from eviback.ape.records import Selection


def scored(ctx: StageContext) -> list[Scored]:
    out = []
    for cid in ctx.state.candidates:
        d = ctx.state.decided.get(cid)
        if isinstance(d, CandidateEvaluated):
            m = d.metrics
            out.append(Scored(cid, True, m.objective(ctx.spec.objective.metric), m.cost.tokens_per_rollout,
                              m.cost.requests_per_rollout, stability_floor(m)))
    return out


def select(ctx: StageContext) -> tuple[int, Selection]:
    if ctx.state.selected is None:
        selection = ctx.selector.select(scored(ctx), ctx.spec)
        ctx.emit(Selected(selection))
        ctx.progress(f"selected: {selection.winner or 'none'} ({selection.reason})")
    assert ctx.state.selected is not None
    return ctx.state.selected
