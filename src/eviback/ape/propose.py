"""Proposing candidates: round 0 (seeds and systematic variants), then controller rounds refining the best
candidate so far; every controller reply is validated before any teacher call."""

from __future__ import annotations

from eviback.ape.candidates import (
    NotApplicable,
    ProposalError,
    apply_mutation,
    mutation_names,
    parse_proposal,
    seed_policy,
)
from eviback.ape.context import StageContext
from eviback.ape.controller import EXAMPLE_TEXTS, ChatController, controller_messages
from eviback.ape.evaluate import evaluate
from eviback.ape.events import CandidateProposed, ProposalRejected, RoundFinished, RoundStarted
from eviback.ape.feedback import failures_of
from eviback.ape.records import Candidate, Origin, RejectedProposal, structure_key
from eviback.ape.selection import scored
from eviback.teacher.chat import TeacherCallError


def propose(ctx: StageContext, candidate: Candidate) -> Candidate | None:
    """Log a new valid candidate (unless its slot is taken or the budget is spent)."""
    if candidate.id in ctx.state.candidates or candidate.id in ctx.state.rejected:
        return ctx.state.candidates.get(candidate.id)
    if len(ctx.state.candidates) >= ctx.spec.search.max_candidates:
        return None
    ctx.emit(CandidateProposed(candidate))
    return candidate


def reject_proposal(ctx: StageContext, proposal: RejectedProposal) -> None:
    if proposal.id not in ctx.state.rejected and proposal.id not in ctx.state.candidates:
        ctx.progress(f"{proposal.id}: proposal rejected: {proposal.reason}")
        ctx.emit(ProposalRejected(proposal))


def mutations_of(ctx: StageContext, parent: Candidate, count: int, round_: int, prefix: str) -> list[Candidate]:
    out: list[Candidate] = []
    taken = {o.structure for o in ctx.state.candidates.values()}
    index = 0
    for name in mutation_names(ctx.spec.search.mutations):
        if len(out) >= count:
            break
        slot = f"{prefix}m{index}"
        if slot in ctx.state.candidates:
            out.append(ctx.state.candidates[slot])
            index += 1
            continue
        try:
            policy = apply_mutation(name, parent.policy)
        except NotApplicable:
            continue
        if structure_key(policy) in taken:
            continue
        candidate = propose(ctx, Candidate(slot, policy, Origin.MUTATION, parent.id, round_, name))
        index += 1
        if candidate is None:
            break
        out.append(candidate)
    return out


def round_zero(ctx: StageContext) -> None:
    seeds = []
    for i, ref in enumerate(ctx.spec.search.seeds):
        c = propose(ctx, Candidate(f"s{i}", seed_policy(ref), Origin.SEED, "", 0, ref))
        if c is not None:
            seeds.append(c)
    base = next((c for c in seeds if refinable(c) and not c.policy.boundary_violations()), None)
    if base is not None and 0 not in ctx.state.rounds:
        mutations_of(ctx, base, len(mutation_names(ctx.spec.search.mutations)), 0, "")
    for c in list(ctx.state.candidates.values()):
        if c.round == 0:
            evaluate(ctx, c)
    if 0 not in ctx.state.rounds:
        ctx.emit(RoundFinished(0, base.id if base is not None else ""))


def refinable(candidate: Candidate) -> bool:
    """Whether a round can refine `candidate`: its status is decided by a prompt. The verdicts of a status
    stage with a `backend` of its own (a trained classifier, a rule) do not depend on any prompt, so no
    proposal or prompt variant of it can change the objective; it competes in selection but does not parent
    a round."""
    return not candidate.policy.status_stage.own_backend


def best_so_far(ctx: StageContext) -> Candidate | None:
    """The best refinable candidate so far: the selected feasible one; else the best objective among those
    with base metrics; else the first compliant seed."""
    pool = {cid for cid, c in ctx.state.candidates.items() if refinable(c)}
    selection = ctx.selector.select([s for s in scored(ctx) if s.id in pool], ctx.spec)
    if selection.winner is not None:
        return ctx.state.candidates[selection.winner]
    measured = [(d.metrics.objective(ctx.spec.objective.metric), -ctx.state.order(ctx.state.candidates[cid]), cid)
                for cid, d in ctx.state.decided.items() if cid in pool and d.metrics is not None
                and d.metrics.objective(ctx.spec.objective.metric) is not None]
    if measured:
        return ctx.state.candidates[max(measured)[2]]
    return next((c for c in ctx.state.candidates.values() if refinable(c) and not c.policy.boundary_violations()),
                None)


def controller_round(ctx: StageContext, round_: int) -> None:
    started = ctx.state.round_parents.get(round_)
    parent = ctx.state.candidates[started] if started else best_so_far(ctx)
    if parent is None:
        return
    if not started:  # logged, so that a resumed round refines the same parent
        ctx.emit(RoundStarted(round_, parent.id))
    prefix = f"r{round_}."
    ctx.progress(f"round {round_}: refining {parent.id} {parent.policy.name}")
    controller = ctx.controller()
    if controller is not None and ctx.spec.search.proposals_per_round:
        summary, failures = failures_of(ctx, parent, round_)
        whole = not (isinstance(controller, ChatController) and controller.settings.skeletons)
        messages = controller_messages(parent.policy, summary, failures, whole_workflow=whole)
        for p in range(ctx.spec.search.proposals_per_round):
            slot = f"{prefix}p{p}"
            if slot in ctx.state.candidates or slot in ctx.state.rejected:
                continue
            if len(ctx.state.candidates) >= ctx.spec.search.max_candidates:
                break
            ctx.progress(f"{slot}: asking the controller {controller.controller_id} for a proposal")
            try:
                reply = controller.propose(messages, slot=round_ * 100 + p, stage=parent.policy.status_stage.name)
            except TeacherCallError as e:
                reject_proposal(ctx, RejectedProposal(slot, Origin.CONTROLLER, parent.id, round_,
                                                      f"controller call failed: {e}"))
                continue
            try:
                policy = parse_proposal(reply.text, parent.policy, f"{parent.policy.name}~{slot}")
                copied = [t for s in policy.stages for t in (s.system_prompt, s.user_template)
                          if t.strip() in EXAMPLE_TEXTS]
                if copied:
                    raise ProposalError(f"the reply copies the prompt's example ({copied[0]!r}) instead of "
                                        f"proposing a workflow")
            except ProposalError as e:
                reject_proposal(ctx, RejectedProposal(slot, Origin.CONTROLLER, parent.id, round_, str(e),
                                                      reply.text[:300]))
                continue
            propose(ctx, Candidate(slot, policy, Origin.CONTROLLER, parent.id, round_, "controller proposal"))
    mutations_of(ctx, parent, ctx.spec.search.mutations_per_round, round_, prefix)
    for c in [c for c in ctx.state.candidates.values() if c.round == round_]:
        evaluate(ctx, c)
    ctx.emit(RoundFinished(round_, parent.id))
