"""E2E-APE: constraint-driven automatic construction of the teacher policy (EVIBACK.md section 5).

    eviback ape rollouts/step-*.jsonl.gz --out runs/ape [--spec my-spec.yaml]

- `spec`: the constraint spec (hard gates, stability gates on confidence bounds, cost budget, objective,
  data split, search budget), a YAML file of values (`default.yaml`);
- `config`: the run's inputs and backends; `data`: the actor's rollouts on training questions (evaluation
  questions refused), labelled by `eviback.teacher.labels`, split by question with a sealed test split;
- `records`: what a run persists (splits, candidates, per-rollout outcomes, metrics, gate reports, the
  selection, the sealed test's confirmation), below the logic that produces it;
- `rollouts`: reading dumps, labels, the split, the perturbations of the stability checks;
- `candidates`: systematic structural variants, controller proposals parsed into policies, the static checks
  that reject a candidate before any call;
- `controller`: the controller LLM and the gold-free view of failures it is shown;
- `measure`: judging a candidate under each condition with the teacher machinery, and its metrics;
- `stats`: Wilson and bootstrap lower bounds, Fleiss' kappa; `gates`: gates, acceptance and selection;
- the run's stages: `propose` (with `feedback`), `paraphrase` (the controller's paraphrases), `evaluate` (gate by gate on validation), `selection`,
  `sealed` (the sealed test, with `confirm`: the freeze rule), `freeze`;
- `events`: the append-only event log that makes a run resumable; `pipeline`: the run as the sequence of
  those stages; `report`: its result and the Markdown report.
"""

from eviback.ape.candidates import MUTATIONS, parse_proposal, static_rejections
from eviback.ape.config import ApeConfig, ControllerConfig, ControllerKind
from eviback.ape.confirm import confirm
from eviback.ape.controller import ChatController, Controller, LocalChatClient
from eviback.ape.gates import ACCEPTANCE, SELECTION
from eviback.ape.pipeline import run_ape
from eviback.ape.records import (
    Candidate,
    CandidateMetrics,
    Condition,
    Confirmation,
    GateReport,
    GateResult,
    Origin,
    RejectedProposal,
    RolloutOutcome,
    Selection,
    Split,
)
from eviback.ape.report import ApeResult, render_markdown
from eviback.ape.rollouts import SealedSplit, split_rollouts, sufficiency_label
from eviback.ape.spec import ConstraintSpec, SpecError, default_spec_text, load_spec
from eviback.ape.stats import bootstrap_lower_bound, fleiss_kappa, wilson_lower_bound

__all__ = [
    "ACCEPTANCE", "MUTATIONS", "SELECTION", "ApeConfig", "ApeResult", "Candidate", "CandidateMetrics",
    "ChatController", "Condition", "Confirmation", "ConstraintSpec", "Controller", "ControllerConfig", "ControllerKind",
    "GateReport", "GateResult", "LocalChatClient", "Origin", "RejectedProposal", "RolloutOutcome",
    "SealedSplit", "Selection", "SpecError", "Split", "bootstrap_lower_bound",
    "confirm", "default_spec_text", "fleiss_kappa", "load_spec", "parse_proposal", "render_markdown", "run_ape",
    "split_rollouts", "static_rejections", "sufficiency_label", "wilson_lower_bound",
]
