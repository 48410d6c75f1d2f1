"""Teacher policies: typed workflows, and their frozen, content-hashed artifacts.

A :class:`TeacherPolicy` is data, not code: the stages of the workflow, what each stage sees, its prompts,
its output schema, the gate that decides whether it runs, its decoding parameters, and the reward weights
`v[S]`, `v[A]`, `v[I]`. The code that runs a policy (``workflow.py``) is the same for every policy, so a
candidate proposed by E2E-APE is evaluated exactly like a built-in one.

A policy's **version** is the SHA-256 of its canonical JSON: any change to a prompt, a gate or a weight is a
new version. A policy is frozen by writing it once to a JSON artifact that records that version; loading an
artifact whose content no longer hashes to its recorded version is refused. References may pin a version:
``two-stage@3f2a9c1b`` or ``path/to/policy.json@3f2a9c1b`` (a prefix of at least 8 hex digits).

The evidence boundary (EVIBACK.md section 4) in terms of this structure:

- the first stage decides the status (it is "Stage A"); a policy is *boundary-compliant* when that stage
  does not see the gold answers (:meth:`TeacherPolicy.boundary_violations`);
- a later stage runs only when the status so far is one of its ``run_on`` statuses, which may never include
  I; whatever it answers, it can only lower the status to I, never raise it (enforced in ``workflow.py``).

A stage is answered by the teacher's LLM, or by a ``backend`` of its own, named in the policy (so part of
its version): a trained classifier (``evidence-judge:<sha256>``), or a deterministic rule computed in
process (:data:`RULES`: ``extractive-span:max_words=8``, the extractive gold-aware Stage B; ``evidence-label``,
the oracle's Stage A, which reads the gold answers).
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from eviback.types import Status, from_dict, to_dict

ARTIFACT_FORMAT = "eviback-teacher-policy"
CLASSIFIER_PREFIX = "evidence-judge:"  # a stage backend that is a trained classifier (evidence_judge.py)
# The layout a classifier stage's request must have: the question, a blank line, the evidence as seen.
CLASSIFIER_TEMPLATE = "$question\n\n$evidence"
ARTIFACT_FORMAT_VERSION = 1
MIN_VERSION_PREFIX = 8
# Rule backends (eviback.teacher.rules): a name, then optionally its parameters, "name:key=value,key=value".
EXTRACTIVE_SPAN = "extractive-span"  # the gold-aware span of the evidence with the best F1 (teacher/extractive.py)
EVIDENCE_LABEL = "evidence-label"  # the S/A/I evidence label computed from the gold (teacher/labels.py): an oracle


class PolicyError(ValueError):
    """A policy is malformed, or an artifact failed its integrity check. The message names the fix."""


class Input(enum.StrEnum):
    """What a stage may see. Templates refer to them as `$question`, `$evidence`, `$answer`, `$gold`."""

    QUESTION = "question"  # the question text (never its id or metadata)
    EVIDENCE = "evidence"  # the rollout's search results as the actor saw them (after its observation cut)
    ANSWER = "answer"  # the actor's final answer, or a placeholder when it never answered
    GOLD = "gold"  # the gold answers: crossing this into the status decision is reference leakage


class OutputField(enum.StrEnum):
    """The fields of a stage's JSON reply."""

    STATUS = "status"  # one of the stage's `statuses` labels
    ANSWER = "answer"  # the refined answer
    RATIONALE = "rationale"  # free text, kept for inspection only; never scored


@dataclass(frozen=True)
class Decoding:
    """Sampling parameters of one stage's LLM call."""

    temperature: float = 0.0  # 0 = greedy; > 0 samples (teacher sample k gets seed + k when seed is set)
    max_tokens: int = 64  # completion budget of the reply
    top_p: float = 1.0
    seed: int | None = None  # sent to the server only when set (some CPU servers reject per-request seeds)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise PolicyError(f"decoding.temperature={self.temperature} must be >= 0 (0 is greedy)")
        if self.max_tokens < 1:
            raise PolicyError(f"decoding.max_tokens={self.max_tokens} must be >= 1")
        if not 0 < self.top_p <= 1:
            raise PolicyError(f"decoding.top_p={self.top_p} must be in (0, 1]")


@dataclass(frozen=True)
class StageSpec:
    """One stage of the workflow: an LLM call, or a call to the stage's own `backend` (a classifier, a rule).

    `user_template` (and `system_prompt`) are `string.Template` texts: `$question`, `$evidence`, `$answer`,
    `$gold` are replaced by the inputs the stage `sees`; a literal dollar sign is `$$`. A template may only
    use inputs the stage sees; this is checked when the policy is built."""

    name: str
    sees: tuple[Input, ...]
    system_prompt: str
    user_template: str
    outputs: tuple[OutputField, ...]
    statuses: tuple[Status, ...] = (Status.SUFFICIENT, Status.INSUFFICIENT, Status.AMBIGUOUS)
    run_on: tuple[Status, ...] = ()  # gate: () for the first stage (always runs); else statuses it runs on
    decoding: Decoding = field(default_factory=Decoding)
    # "" = the teacher's LLM backend. Else what answers this stage in its place, part of the policy's version:
    # a classifier artifact identified by content hash, e.g. "evidence-judge:<sha256>"
    # (eviback.teacher.evidence_judge), so a policy names exactly which trained judge decides its status; or a
    # rule with its parameters, e.g. "extractive-span:max_words=8" (RULES, eviback.teacher.rules).
    backend: str = ""

    @property
    def sees_gold(self) -> bool:
        return Input.GOLD in self.sees

    @property
    def decides_status(self) -> bool:
        return OutputField.STATUS in self.outputs

    @property
    def is_classifier(self) -> bool:
        """A trained classifier answers it (`backend` `evidence-judge:<sha256>`)."""
        return self.backend.startswith(CLASSIFIER_PREFIX)

    @property
    def is_rule(self) -> bool:
        """A deterministic rule answers it (`backend` names one of :data:`RULES`)."""
        return rule_name(self.backend) in RULES

    @property
    def own_backend(self) -> bool:
        """A classifier or a rule answers it, not the teacher's LLM: no prompt or decoding setting changes its
        verdicts."""
        return bool(self.backend)

    @property
    def deterministic(self) -> bool:
        """Its reply repeats exactly for the same request: greedy decoding, a classifier or a rule."""
        return self.decoding.temperature == 0 or self.own_backend

    def placeholders(self) -> set[str]:
        """The `$names` its templates use."""
        names: set[str] = set()
        for text in (self.system_prompt, self.user_template):
            for match in string.Template.pattern.finditer(text):
                name = match.group("named") or match.group("braced")
                if name:
                    names.add(name)
                elif match.group("invalid") is not None:
                    raise PolicyError(f"stage {self.name!r}: a lone '$' in a template; write '$$' for a dollar sign")
        return names


@dataclass(frozen=True)
class RuleShape:
    """What a stage answered by a rule must look like. A rule reads the inputs it sees from its request
    (``workflow.rule_request``: JSON, no prompt), so its stage has no templates."""

    sees: frozenset[Input]
    outputs: tuple[OutputField, ...]
    statuses: tuple[Status, ...]
    status_stage: bool  # True: it decides the status (the first stage); False: a later, gated stage
    params: Mapping[str, int] = field(default_factory=dict)  # integer parameters and their defaults (>= 1)


RULES: Mapping[str, RuleShape] = {
    EXTRACTIVE_SPAN: RuleShape(
        sees=frozenset({Input.EVIDENCE, Input.GOLD}), outputs=(OutputField.STATUS, OutputField.ANSWER),
        statuses=(Status.SUFFICIENT, Status.INSUFFICIENT), status_stage=False, params={"max_words": 8}),
    EVIDENCE_LABEL: RuleShape(
        sees=frozenset({Input.QUESTION, Input.EVIDENCE, Input.GOLD}), outputs=(OutputField.STATUS,),
        statuses=(Status.SUFFICIENT, Status.INSUFFICIENT, Status.AMBIGUOUS), status_stage=True),
}


def rule_name(backend: str) -> str:
    """The rule a backend names (the part before ':'); not necessarily a known one."""
    return backend.split(":", 1)[0]


def parse_rule_backend(backend: str) -> tuple[str, dict[str, int]]:
    """(rule name, parameters with the defaults filled in) of a rule backend such as
    ``extractive-span:max_words=10``; :class:`PolicyError`, naming the fix, when it is not one."""
    name, _, rest = backend.partition(":")
    if name not in RULES:
        raise PolicyError(f"backend {backend!r} names no rule; rules: {', '.join(sorted(RULES))}")
    params = dict(RULES[name].params)
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        if key not in params or not eq:
            known = ", ".join(f"{k}=<int>" for k in params) or "none"
            raise PolicyError(f"backend {backend!r}: {item!r} is not a parameter of the rule {name!r} "
                              f"(parameters: {known})")
        try:
            number = int(value)
        except ValueError:
            number = 0
        if number < 1:
            raise PolicyError(f"backend {backend!r}: {key} must be an integer >= 1, got {value!r}")
        params[key] = number
    return name, params


@dataclass(frozen=True)
class RewardWeights:
    """`v[s]` of the hybrid reward `r = v[s] * F1(refined answer, gold)` (EVIBACK.md section 4.4)."""

    sufficient: float = 1.0
    ambiguous: float = 0.5
    insufficient: float = 0.0

    def __post_init__(self) -> None:
        if self.insufficient != 0.0:
            raise PolicyError("weights.insufficient must be 0: an I rollout gets no reward (EVIBACK.md s.4.4)")
        for name in ("sufficient", "ambiguous"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise PolicyError(f"weights.{name}={value} must be in [0, 1]")

    def of(self, status: Status) -> float:
        return {Status.SUFFICIENT: self.sufficient, Status.AMBIGUOUS: self.ambiguous,
                Status.INSUFFICIENT: self.insufficient}[status]


@dataclass(frozen=True)
class TeacherPolicy:
    """A complete teacher workflow. Build one freely (E2E-APE does); freeze it with :func:`freeze_policy`."""

    name: str
    stages: tuple[StageSpec, ...]
    weights: RewardWeights = field(default_factory=RewardWeights)
    description: str = ""
    # The evidence boundary in code for the answer: a refined answer (one a stage wrote) whose normalised
    # form is not found in the normalised evidence as the actor saw it lowers the verdict to I (reward 0),
    # so an answer known only from the gold can never earn credit. Turning it off is explicit: False.
    grounded_answer: bool = True

    def __post_init__(self) -> None:
        if not self.stages:
            raise PolicyError(f"policy {self.name!r} has no stages")
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise PolicyError(f"policy {self.name!r}: stage names must be unique, got {names}")
        first = self.stages[0]
        if not first.decides_status:
            raise PolicyError(f"policy {self.name!r}: the first stage ({first.name!r}) must output 'status'")
        if first.run_on:
            raise PolicyError(f"policy {self.name!r}: the first stage always runs; set its run_on to []")
        for stage in self.stages:
            self._check_stage(stage, is_first=stage is first)
        if self.is_oracle and "oracle" not in self.name.lower():
            raise PolicyError(f"policy {self.name!r} decides its status with the evidence label, which reads the "
                              f"gold answers: it is an oracle, and its name must say so (e.g. "
                              f"'{self.name}-oracle'), so that every record naming the teacher does")

    def _check_stage(self, stage: StageSpec, *, is_first: bool) -> None:
        where = f"policy {self.name!r}, stage {stage.name!r}"
        if not stage.outputs or len(set(stage.outputs)) != len(stage.outputs):
            raise PolicyError(f"{where}: outputs must list each of status/answer/rationale at most once")
        if not stage.sees:
            raise PolicyError(f"{where}: a stage must see at least one input")
        if stage.decides_status and not stage.statuses:
            raise PolicyError(f"{where}: outputs 'status' but allows no statuses")
        unknown = stage.placeholders() - {i.value for i in Input}
        if unknown:
            raise PolicyError(f"{where}: unknown template placeholders {sorted(unknown)}; "
                              f"use only {', '.join('$' + i.value for i in Input)}")
        unseen = stage.placeholders() - {i.value for i in stage.sees}
        if unseen:
            raise PolicyError(f"{where}: its template uses {sorted(unseen)} but the stage does not see them; "
                              f"add them to 'sees' or remove them from the template")
        if stage.is_rule:
            self._check_rule_stage(stage, is_first=is_first, where=where)
        elif stage.backend:
            if not stage.backend.startswith(CLASSIFIER_PREFIX) or len(stage.backend) <= len(CLASSIFIER_PREFIX):
                raise PolicyError(f"{where}: backend {stage.backend!r} is neither a classifier reference "
                                  f"('{CLASSIFIER_PREFIX}<sha256>') nor a rule ({', '.join(sorted(RULES))}); "
                                  f"use '' for the teacher's LLM backend")
            if stage.outputs != (OutputField.STATUS,) or stage.sees_gold or Input.ANSWER in stage.sees:
                raise PolicyError(f"{where}: a classifier stage outputs only 'status' and sees only the question "
                                  f"and the evidence")
            if stage.user_template != CLASSIFIER_TEMPLATE or stage.system_prompt:
                raise PolicyError(f"{where}: a classifier stage's user_template must be {CLASSIFIER_TEMPLATE!r} "
                                  f"and its system_prompt empty (the classifier reads that layout)")
        if not is_first:
            if not stage.run_on:
                raise PolicyError(f"{where}: a later stage needs a gate; set run_on, e.g. ['S', 'A']")
            if Status.INSUFFICIENT in stage.run_on:
                raise PolicyError(f"{where}: run_on contains I, but an I verdict is final (the evidence "
                                  f"boundary); remove I from run_on")

    @staticmethod
    def _check_rule_stage(stage: StageSpec, *, is_first: bool, where: str) -> None:
        name, _ = parse_rule_backend(stage.backend)
        shape = RULES[name]
        if set(stage.sees) != shape.sees or stage.outputs != shape.outputs:
            raise PolicyError(f"{where}: the rule {name!r} sees {sorted(i.value for i in shape.sees)} and outputs "
                              f"{[f.value for f in shape.outputs]}; set the stage's sees and outputs to those")
        if stage.statuses != shape.statuses:
            raise PolicyError(f"{where}: the rule {name!r} answers the statuses "
                              f"{[s.value for s in shape.statuses]}; set the stage's statuses to those")
        if stage.system_prompt or stage.user_template:
            raise PolicyError(f"{where}: a rule stage has no prompt (the rule reads its inputs, not a text); set "
                              f"system_prompt and user_template to ''")
        if shape.status_stage and not is_first:
            raise PolicyError(f"{where}: the rule {name!r} decides the status: make it the first stage")
        if not shape.status_stage and is_first:
            raise PolicyError(f"{where}: the rule {name!r} refines an answer after the status is decided: it "
                              f"cannot be the first stage")

    # ----------------------------------------------------------------------------------------------

    def canonical_json(self) -> str:
        """The bytes the version is computed from: sorted keys, no white space, UTF-8.

        `grounded_answer=False` is left out, so a policy frozen before the field existed (which never
        grounded its answers) keeps its version and loads with exactly the behaviour it was frozen with."""
        return json.dumps(policy_dict(self), sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    @property
    def version(self) -> str:
        """SHA-256 (hex) of the canonical content: the identity of the policy, frozen or not."""
        return hashlib.sha256(self.canonical_json().encode("utf-8")).hexdigest()

    @property
    def short_version(self) -> str:
        return self.version[:12]

    @property
    def status_stage(self) -> StageSpec:
        """"Stage A": the first stage, the one that decides the status."""
        return self.stages[0]

    @property
    def is_oracle(self) -> bool:
        """Its status is the evidence label (the `evidence-label` rule), computed from the gold answers: the
        ceiling of what a perfect evidence judge would give, never a teacher. Its name says "oracle"."""
        return rule_name(self.status_stage.backend) == EVIDENCE_LABEL

    @property
    def needs_llm(self) -> bool:
        """Some stage is answered by the teacher's LLM (not by a classifier or a rule of its own)."""
        return any(not s.own_backend for s in self.stages)

    def boundary_violations(self) -> tuple[str, ...]:
        """Static reasons why gold could reach the status decision (empty: the policy is compliant).

        The single-prompt dual-task baseline has one, by design: it is the leaky manual teacher; so has the
        oracle, whose status is computed from the gold answers."""
        reasons = []
        if self.is_oracle:
            reasons.append(f"stage {self.status_stage.name!r} decides the status with the evidence label, which "
                           f"reads the gold answers (an oracle: the ceiling, never a teacher)")
        elif self.status_stage.sees_gold:
            reasons.append(f"stage {self.status_stage.name!r} decides the status and sees the gold answers")
        return tuple(reasons)


def policy_dict(policy: TeacherPolicy) -> dict[str, Any]:
    """The policy as plain JSON values (what an artifact stores and the version hashes). Fields added after
    policies were first frozen are left out at their old behaviour (`grounded_answer` false, a stage's
    `backend` ""), so older artifacts keep their versions."""
    doc = to_dict(policy)
    if not policy.grounded_answer:
        del doc["grounded_answer"]
    for stage in doc["stages"]:
        if not stage["backend"]:
            del stage["backend"]
    return doc


def policy_from_dict(doc: Any) -> TeacherPolicy:
    """A policy from a frozen artifact's JSON values. A document without `grounded_answer` predates the field: its answers
    were never grounded, so it loads with `grounded_answer=False` (and its recorded version still holds)."""
    if isinstance(doc, dict) and "grounded_answer" not in doc:
        doc = {**doc, "grounded_answer": False}
    return from_dict(TeacherPolicy, doc)


# --------------------------------------------------------------------------------------------------
# Frozen artifacts


@dataclass(frozen=True)
class PolicyArtifact:
    """A frozen policy as read from disk. `provenance` is free JSON (e.g. E2E-APE's gate report and split
    hashes); it is covered by its own hash, checked on load like the policy."""

    policy: TeacherPolicy
    version: str
    provenance: Mapping[str, Any] = field(default_factory=dict)
    path: str = ""


def _digest(obj: Any) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def artifact_json(policy: TeacherPolicy, provenance: Mapping[str, Any] | None = None) -> str:
    """The text of a frozen artifact (deterministic: the same policy and provenance give the same bytes)."""
    provenance = dict(provenance or {})
    doc = {
        "format": ARTIFACT_FORMAT,
        "format_version": ARTIFACT_FORMAT_VERSION,
        "name": policy.name,
        "version": policy.version,
        "provenance_sha256": _digest(provenance),
        "policy": policy_dict(policy),
        "provenance": provenance,
    }
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


def freeze_policy(
    policy: TeacherPolicy, path: str | os.PathLike, provenance: Mapping[str, Any] | None = None
) -> Path:
    """Write `policy` once as a frozen artifact at `path` and return the path.

    Writing the identical artifact again is a no-op; a different artifact at an existing path is refused
    (frozen files are never overwritten: choose a new path)."""
    path = Path(path)
    text = artifact_json(policy, provenance)
    if path.exists():
        if path.read_text(encoding="utf-8") == text:
            return path
        raise FileExistsError(f"{path} already holds a different frozen policy; frozen artifacts are "
                              f"written once: write version {policy.short_version} to a new path")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def parse_artifact(text: str, where: str = "<memory>") -> PolicyArtifact:
    """Parse and verify a frozen artifact: its policy must hash to its recorded version."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise PolicyError(f"{where}: not JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(doc, dict) or doc.get("format") != ARTIFACT_FORMAT:
        raise PolicyError(f"{where}: not a frozen teacher policy (no \"format\": \"{ARTIFACT_FORMAT}\"); "
                          f"freeze a policy with eviback.teacher.freeze_policy or `eviback judge --freeze`")
    if doc.get("format_version") != ARTIFACT_FORMAT_VERSION:
        raise PolicyError(f"{where}: artifact format_version {doc.get('format_version')!r} is not supported "
                          f"(this eviback reads {ARTIFACT_FORMAT_VERSION})")
    try:
        policy = policy_from_dict(doc["policy"])
    except (KeyError, TypeError, ValueError) as e:
        raise PolicyError(f"{where}: malformed policy: {e}") from None
    recorded = str(doc.get("version", ""))
    if policy.version != recorded:
        raise PolicyError(
            f"{where}: refused: the policy content hashes to {policy.short_version} but the file records "
            f"version {recorded[:12]}; the frozen file was edited. Restore it, or freeze the edited policy "
            f"as a new artifact (`eviback judge --freeze`), which gives it a new version")
    provenance = doc.get("provenance") or {}
    if _digest(provenance) != doc.get("provenance_sha256"):
        raise PolicyError(f"{where}: refused: its provenance was edited after freezing (hash mismatch); "
                          f"restore the file or freeze again")
    return PolicyArtifact(policy=policy, version=recorded, provenance=provenance, path=where)


def read_artifact(path: str | os.PathLike) -> PolicyArtifact:
    return parse_artifact(Path(path).read_text(encoding="utf-8"), str(path))


def builtin_policy_names() -> tuple[str, ...]:
    folder = resources.files("eviback.teacher") / "policies"
    return tuple(sorted(p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json")))


def _builtin_text(name: str) -> str:
    return (resources.files("eviback.teacher") / "policies" / f"{name}.json").read_text(encoding="utf-8")


def load_policy(ref: str | os.PathLike, expected_version: str | None = None) -> TeacherPolicy:
    """A policy by built-in name or frozen-file path, optionally pinned (`ref@version` or `expected_version`).

    Raises :class:`PolicyError` when the file was edited after freezing or the version does not match."""
    ref = str(ref)
    if "@" in ref and expected_version is None:
        ref, expected_version = ref.rsplit("@", 1)
    if ref in builtin_policy_names():
        artifact = parse_artifact(_builtin_text(ref), f"built-in policy {ref!r}")
    elif Path(ref).exists():
        artifact = read_artifact(ref)
    else:
        raise FileNotFoundError(f"no teacher policy {ref!r}: use a built-in name "
                                f"({', '.join(builtin_policy_names())}) or the path of a frozen policy file")
    if expected_version is not None:
        expected_version = expected_version.strip().lower()
        if len(expected_version) < MIN_VERSION_PREFIX:
            raise PolicyError(f"version pin {expected_version!r} is too short; give at least "
                              f"{MIN_VERSION_PREFIX} hex digits of the version")
        if not artifact.version.startswith(expected_version):
            raise PolicyError(f"{ref}: version {artifact.version[:12]} does not match the pinned "
                              f"{expected_version}; the policy changed since it was pinned")
    return artifact.policy


def policy_from_json(text: str, where: str = "<memory>") -> TeacherPolicy:
    """A policy from a frozen artifact or from a bare (draft) policy object, e.g. one being edited."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise PolicyError(f"{where}: not JSON ({e.msg} at line {e.lineno})") from None
    if isinstance(doc, dict) and doc.get("format") == ARTIFACT_FORMAT:
        return parse_artifact(text, where).policy
    try:
        return policy_from_dict(doc)  # as in an artifact: an absent grounded_answer means False
    except (KeyError, TypeError, ValueError) as e:
        raise PolicyError(f"{where}: malformed policy: {e}") from None
