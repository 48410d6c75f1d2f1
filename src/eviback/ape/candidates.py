"""Candidate teacher workflows: the systematic structural variants, controller proposals parsed into
policies, and the static checks that reject a candidate before any call is spent on it.

A candidate (:class:`~eviback.ape.records.Candidate`) is a plain structure: a
:class:`~eviback.teacher.policy.TeacherPolicy` (stages, what each sees, prompts, output schema, gating,
decoding, weights) plus where it came from. Three sources:

- **seeds**: built-in (or frozen) policies named in the spec, e.g. `two-stage` and the leaky
  `single-prompt-dual-task` (rejected statically, kept in the report as the manual baseline);
- **mutations**: named, pure functions policy -> policy (:data:`MUTATIONS`): gated two-stage vs a single
  gold-blind dual-task prompt, label sets, output order (extract-then-judge, rationale-first), what Stage A
  sees, gating, instructions, decoding. They make the search meaningful even when the controller is weak;
- **controller proposals**: JSON from the controller LLM, parsed by :func:`parse_proposal` into a policy:
  a full policy object, or a patch of the parent (`{"stages": [{"name": "A", "user_template": ...}]}`;
  stages matched by name, missing fields kept from the parent; a bare stage object patches Stage A).

:func:`static_rejections` runs before any call: gold reaching the status-deciding stage (the evidence
boundary), too many stages, a Stage A that cannot see or is not shown the evidence, a label set without S
and I, a duplicate of an earlier candidate.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from eviback.teacher.config import register_judge_beside
from eviback.teacher.policy import (
    Input,
    OutputField,
    PolicyError,
    StageSpec,
    TeacherPolicy,
    load_policy,
)
from eviback.teacher.workflow import first_json_object
from eviback.types import Status, from_dict, to_dict

# --------------------------------------------------------------------------------------------------
# Static checks: no call is spent on a candidate that fails one


def static_rejections(policy: TeacherPolicy, *, max_stages: int) -> tuple[str, ...]:
    """Reasons to reject `policy` without judging anything (empty: it may be evaluated)."""
    reasons = [f"evidence boundary: {r}" for r in policy.boundary_violations()]
    if len(policy.stages) > max_stages:
        reasons.append(f"{len(policy.stages)} stages; the spec allows at most {max_stages} (search.max_stages)")
    first = policy.status_stage
    if Input.EVIDENCE not in first.sees or "evidence" not in first.placeholders():
        reasons.append(f"stage {first.name!r} decides the status but is not shown the evidence ($evidence)")
    if Input.QUESTION not in first.sees or "question" not in first.placeholders():
        reasons.append(f"stage {first.name!r} decides the status but is not shown the question ($question)")
    if not {Status.SUFFICIENT, Status.INSUFFICIENT} <= set(first.statuses):
        reasons.append(f"stage {first.name!r} cannot say both S and I (statuses {[s.value for s in first.statuses]})")
    return tuple(reasons)


# --------------------------------------------------------------------------------------------------
# Systematic structural variants


class NotApplicable(ValueError):
    """The mutation does not apply to this policy (e.g. gating a Stage B that does not exist)."""


@dataclass(frozen=True)
class Mutation:
    name: str
    description: str
    apply: Callable[[TeacherPolicy], TeacherPolicy]


MUTATIONS: dict[str, Mutation] = {}


def register_mutation(name: str, description: str) -> Callable[[Callable[[TeacherPolicy], TeacherPolicy]],
                                                                 Callable[[TeacherPolicy], TeacherPolicy]]:
    def wrap(fn: Callable[[TeacherPolicy], TeacherPolicy]) -> Callable[[TeacherPolicy], TeacherPolicy]:
        if name in MUTATIONS:
            raise ValueError(f"mutation {name!r} is already registered")
        MUTATIONS[name] = Mutation(name, description, fn)
        return fn
    return wrap


def mutation_names(selection: Sequence[str]) -> tuple[str, ...]:
    """The mutations named in the spec (`all` for every registered one), validated."""
    if "all" in selection:
        return tuple(MUTATIONS)
    unknown = [n for n in selection if n not in MUTATIONS]
    if unknown:
        raise ValueError(f"unknown mutation(s) {unknown}; known: {', '.join(MUTATIONS)} (or 'all')")
    return tuple(selection)


def apply_mutation(name: str, policy: TeacherPolicy) -> TeacherPolicy:
    """`policy` with mutation `name` applied; named `<parent>+<name>`. Raises NotApplicable, also when the
    variant would not be a valid workflow (e.g. a prompt change to a trained classifier's stage)."""
    try:
        mutated = MUTATIONS[name].apply(policy)
    except PolicyError as e:
        raise NotApplicable(f"the variant is not a valid workflow: {e}") from e
    return dataclasses.replace(mutated, name=f"{policy.name}+{name}",
                               description=f"{policy.description} [E2E-APE variant: {MUTATIONS[name].description}]".strip())


def _replace_stage(policy: TeacherPolicy, index: int, **changes: Any) -> TeacherPolicy:
    stages = list(policy.stages)
    stages[index] = dataclasses.replace(stages[index], **changes)
    return dataclasses.replace(policy, stages=tuple(stages))


def _append_instruction(stage: StageSpec, text: str) -> str:
    return stage.user_template.rstrip() + "\n" + text


@register_mutation("binary-status", "Stage A chooses between S and I only (no A)")
def _binary(policy: TeacherPolicy) -> TeacherPolicy:
    a = policy.status_stage
    if set(a.statuses) == {Status.SUFFICIENT, Status.INSUFFICIENT}:
        raise NotApplicable("Stage A already has only S and I")
    return _replace_stage(policy, 0, statuses=(Status.SUFFICIENT, Status.INSUFFICIENT),
                          user_template=_append_instruction(a, "Use only S or I: there is no A in this version."))


@register_mutation("extract-then-judge", "Stage A first extracts the answer span from the passages, then judges")
def _extract(policy: TeacherPolicy) -> TeacherPolicy:
    a = policy.status_stage
    if a.outputs and a.outputs[0] is OutputField.ANSWER:
        raise NotApplicable("Stage A already extracts first")
    outputs = (OutputField.ANSWER, OutputField.STATUS) + tuple(
        f for f in a.outputs if f not in (OutputField.ANSWER, OutputField.STATUS))
    text = ('First copy into "answer" the shortest phrase of the passages that answers the question, or "none" '
            'if no passage does; then give the status.')
    return _replace_stage(policy, 0, outputs=outputs, user_template=_append_instruction(a, text),
                          decoding=dataclasses.replace(a.decoding, max_tokens=max(a.decoding.max_tokens, 48)))


@register_mutation("rationale-first", "Stage A writes a one-sentence rationale before its status")
def _rationale(policy: TeacherPolicy) -> TeacherPolicy:
    a = policy.status_stage
    if a.outputs and a.outputs[0] is OutputField.RATIONALE:
        raise NotApplicable("Stage A already writes its rationale first")
    outputs = (OutputField.RATIONALE,) + tuple(f for f in a.outputs if f is not OutputField.RATIONALE)
    text = ('First explain in one short sentence in "rationale" which passage, if any, states the answer; '
            'then give the status.')
    return _replace_stage(policy, 0, outputs=outputs, user_template=_append_instruction(a, text),
                          decoding=dataclasses.replace(a.decoding, max_tokens=max(a.decoding.max_tokens, 96)))


_ANSWER_LINE = re.compile(r"^.*\$\{?answer\}?.*(\n|$)", re.MULTILINE)


@register_mutation("hide-actor-answer", "Stage A sees only the question and the evidence, not the actor's answer")
def _hide_answer(policy: TeacherPolicy) -> TeacherPolicy:
    a = policy.status_stage
    if Input.ANSWER not in a.sees:
        raise NotApplicable("Stage A does not see the actor's answer")
    return _replace_stage(policy, 0, sees=tuple(i for i in a.sees if i is not Input.ANSWER),
                          system_prompt=_ANSWER_LINE.sub("", a.system_prompt),
                          user_template=_ANSWER_LINE.sub("", a.user_template).replace(
                              "Judge the passages, not the agent's answer. ", ""))


@register_mutation("gate-b-on-s", "the gold-aware stage runs only on S (not on A): cheaper")
def _gate_on_s(policy: TeacherPolicy) -> TeacherPolicy:
    if len(policy.stages) < 2:
        raise NotApplicable("there is no later stage to gate")
    stages = [policy.stages[0]] + [dataclasses.replace(s, run_on=(Status.SUFFICIENT,)) for s in policy.stages[1:]]
    if all(s.run_on == (Status.SUFFICIENT,) for s in policy.stages[1:]):
        raise NotApplicable("later stages already run only on S")
    return dataclasses.replace(policy, stages=tuple(stages))


@register_mutation("single-prompt-blind", "one gold-blind prompt returns the status and the answer the passages "
                                          "support (no gold-aware stage): the cheapest compliant dual task")
def _single_blind(policy: TeacherPolicy) -> TeacherPolicy:
    if len(policy.stages) < 2:
        raise NotApplicable("already a single stage")
    a = policy.status_stage
    outputs = tuple(dict.fromkeys(a.outputs + (OutputField.ANSWER,)))
    text = 'Also give in "answer" the shortest answer to the question that the passages state.'
    return dataclasses.replace(policy, stages=(dataclasses.replace(
        a, outputs=outputs, user_template=_append_instruction(a, text),
        decoding=dataclasses.replace(a.decoding, max_tokens=max(a.decoding.max_tokens, 64))),))


@register_mutation("strict-criteria", "Stage A says S only when a passage states the answer word for word")
def _strict(policy: TeacherPolicy) -> TeacherPolicy:
    a = policy.status_stage
    text = "Be strict: say S only if one passage states the answer word for word; if you are unsure, say I."
    if text in a.user_template:
        raise NotApplicable("already strict")
    return _replace_stage(policy, 0, user_template=_append_instruction(a, text))


@register_mutation("system-in-user", "the system prompt is moved into the user message (small models often "
                                     "follow the user turn more closely)")
def _system_in_user(policy: TeacherPolicy) -> TeacherPolicy:
    a = policy.status_stage
    if not a.system_prompt.strip():
        raise NotApplicable("Stage A has no system prompt")
    return _replace_stage(policy, 0, system_prompt="", user_template=a.system_prompt.strip() + "\n\n" + a.user_template)


@register_mutation("sampled", "every stage samples at temperature 0.7 (seeded) instead of greedy decoding")
def _sampled(policy: TeacherPolicy) -> TeacherPolicy:
    # A stage with its own backend (a trained classifier, a rule) does not sample: its decoding is left as it is.
    if all(s.decoding.temperature > 0 or s.own_backend for s in policy.stages):
        raise NotApplicable("every LLM stage already samples")
    return dataclasses.replace(policy, stages=tuple(
        s if s.own_backend else
        dataclasses.replace(s, decoding=dataclasses.replace(s.decoding, temperature=0.7, seed=s.decoding.seed or 0))
        for s in policy.stages))


# --------------------------------------------------------------------------------------------------
# Seeds and controller proposals


def seed_policy(reference: str) -> TeacherPolicy:
    """A seed: a built-in name or a frozen policy file (optionally @VERSION). A policy file inside an evidence
    judge's directory makes that judge known, wherever the directory is (not only under the cache)."""
    register_judge_beside(reference)
    return load_policy(reference)


class ProposalError(ValueError):
    """A controller reply that cannot become a candidate; the message is the recorded reason."""


# `grounded_answer` is accepted (a full policy echoed back holds it) but ignored: the parent's grounding rule
# stands, a proposal cannot loosen the evidence boundary
_TOP_KEYS = {"name", "description", "stages", "weights", "grounded_answer"}
_STAGE_KEYS = {f.name for f in dataclasses.fields(StageSpec)}


def parse_proposal(text: str, parent: TeacherPolicy, name: str) -> TeacherPolicy:
    """The policy a controller reply proposes, built over `parent` and named `name`.

    Raises :class:`ProposalError` with the reason when the reply holds no JSON object, unknown keys, or a
    structure that is not a valid policy (e.g. a template using an input its stage does not see)."""
    obj = first_json_object(text)
    if obj is None:
        raise ProposalError("no JSON object in the reply" + (" (it was cut at the token budget?)" if "{" in text else ""))
    if isinstance(obj.get("policy"), dict):
        obj = obj["policy"]
    if "stages" not in obj and set(obj) & _STAGE_KEYS and not set(obj) - _STAGE_KEYS:
        obj = {"stages": [{"name": parent.status_stage.name, **obj}]}  # a bare stage patches Stage A
    unknown = sorted(set(obj) - _TOP_KEYS)
    if unknown:
        raise ProposalError(f"unknown key(s) {unknown}; a proposal has {sorted(_TOP_KEYS)}")
    doc = copy.deepcopy(to_dict(parent))
    if "weights" in obj:
        if not isinstance(obj["weights"], dict):
            raise ProposalError("'weights' must be an object")
        doc["weights"].update(obj["weights"])
    if "description" in obj and isinstance(obj["description"], str):
        doc["description"] = obj["description"]
    if "stages" in obj:
        if not isinstance(obj["stages"], list) or not obj["stages"]:
            raise ProposalError("'stages' must be a non-empty list of stage objects")
        by_name = {s["name"]: s for s in doc["stages"]}
        order = [s["name"] for s in doc["stages"]]
        full_list = all(isinstance(s, dict) and set(s) >= {"name", "sees", "user_template", "outputs"}
                        for s in obj["stages"])
        if full_list:
            order = []  # a complete list of stages replaces the parent's workflow (it may drop a stage)
        for patch in obj["stages"]:
            if not isinstance(patch, dict) or not isinstance(patch.get("name"), str):
                raise ProposalError("every stage in 'stages' needs a string 'name'")
            bad = sorted(set(patch) - _STAGE_KEYS)
            if bad:
                raise ProposalError(f"stage {patch['name']!r}: unknown key(s) {bad}; stage keys: {sorted(_STAGE_KEYS)}")
            base = by_name.get(patch["name"], {})
            merged = {**base, **patch}
            if isinstance(patch.get("decoding"), dict) and base:
                merged["decoding"] = {**base["decoding"], **patch["decoding"]}
            by_name[patch["name"]] = merged
            if patch["name"] not in order:
                order.append(patch["name"])
        doc["stages"] = [by_name[n] for n in order]
    doc["name"] = name
    try:
        return from_dict(TeacherPolicy, doc)
    except PolicyError as e:
        raise ProposalError(f"not a valid policy: {e}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ProposalError(f"not a valid policy: {type(e).__name__}: {e}") from None
