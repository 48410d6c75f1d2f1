"""The E2E-APE run end to end with a scripted teacher and a scripted controller (the logic, not the model):
static rejection before any call, gates, selection, the sealed test split, canaries, the frozen winner, the
report, and resuming (also after an interruption) without repeating a paid call."""

import dataclasses
import hashlib
import json

import pytest

from ape_fakes import ReplayChatServer, ScriptedController
from eviback.ape import ApeConfig, ControllerConfig, run_ape
from eviback.ape.events import EventLog, QuestionsParaphrased, Selected, UnsealedTest
from eviback.ape.records import Phase
from eviback.ape.report import ProposalCounts, comparison_rows
from eviback.ape.rollouts import as_rollouts, split_rollouts
from eviback.ape.spec import spec_from_mapping
from eviback.data import write_jsonl
from eviback.teacher.config import TeacherConfig
from eviback.teacher.judge import JudgeConfig
from eviback.teacher.openai_http import HttpBackendConfig
from eviback.teacher.policy import load_policy, read_artifact
from eviback.teacher.probes import build_probes
from eviback.types import to_dict
from teacher_fakes import ScriptedClient, default_reply

SPEC = {"stability": {"rollouts": 16, "bootstrap_resamples": 200},
        "search": {"rounds": 2, "max_candidates": 20, "proposals_per_round": 2},
        "objective": {"min_labelled": 5}}
MARKER = "LEAK-MARKER-7"
BASELINE_STAGE = load_policy("single-prompt-dual-task").status_stage.name
PROPOSALS = {
    100: "I think the prompt should be clearer.",  # no JSON: rejected with the reason
    101: '{"stages": [{"name": "A", "sees": ["question", "evidence", "gold"], "user_template": '
         '"' + MARKER + ' $question $evidence $gold"}]}',  # gold in Stage A: rejected before any call
    200: '{"stages": [{"name": "A", "user_template": "Q: $question\\nP: $evidence\\nEnough? S or I."}]}',
    201: '{"stages": [{"name": "A", "user_template": "Q: $question\\nP: $evidence\\nEnough? S or I."}]}',
}


class Oracle:
    """A scripted teacher that says S exactly when a gold passage is in the request; sampled stages flip a
    third of their verdicts on samples > 0; the manual single-prompt baseline's stage always says S (so the
    sealed test can confirm a winner). Records what it was asked, and whether a selection had happened."""

    def __init__(self, trajectories, *, constant=None, stop_after=None):
        self.gold = {p.text[:60] for t in trajectories for p in t.evidence if p.id in t.question.gold_passage_ids}
        self.constant = constant
        self.stop_after = stop_after
        self.selected = False
        self.log = []  # (request, selected yet?)
        self.client = ScriptedClient(self.script)
        self.paid = 0

    def script(self, request):
        if self.stop_after is not None and self.paid >= self.stop_after:
            raise KeyboardInterrupt  # the run is killed in the middle of a condition
        self.paid += 1
        self.log.append((request, self.selected))
        user = request.messages[-1].content
        status = self.constant or ("S" if any(g in user for g in self.gold) else "I")
        if request.stage == BASELINE_STAGE:
            status = "S"
        if request.decoding.temperature > 0 and request.sample_index > 0 and \
                int(hashlib.sha256(user.encode()).hexdigest(), 16) % 3 == 0:
            status = "I" if status == "S" else "S"
        if request.schema.statuses and status not in [s.value for s in request.schema.statuses]:
            status = request.schema.statuses[-1].value
        # a refined answer copied from the evidence the request shows, so the grounding rule never lowers it
        # (this scripted teacher is about the search, not about grounding)
        at = user.find("(Title: ")
        answer = " ".join(user[at + len("(Title: "):].split()[:4]) if at != -1 else "an answer"
        return default_reply(request, status=status, answer=answer)

    def progress(self, message):
        if message.startswith("selected"):
            self.selected = True


def planted_rollouts(directory):
    """Rollouts on training questions, each question's gold answers extended by a unique canary (the original
    gold answers kept, so the evidence labels are those of the real data), written to `directory`/dump.jsonl:
    (path, rollouts, canaries). With :class:`Oracle` as the teacher, the sealed test confirms the winner."""
    trajectories = [p.trajectory for p in build_probes(80, seed=3, source="train", datasets=("nq", "popqa"))]
    planted, canaries = [], []
    for i, t in enumerate(trajectories):
        canary = f"CANARY{hashlib.sha256(f'{i}:{t.question.id}'.encode()).hexdigest()[:16]}"
        question = dataclasses.replace(t.question, golden_answers=(*t.question.golden_answers, canary))
        planted.append(dataclasses.replace(t, question=question))
        canaries.append(canary)
    path = directory / "dump.jsonl"
    write_jsonl(path, (to_dict(t) for t in planted))
    return path, planted, canaries


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return planted_rollouts(tmp_path_factory.mktemp("ape"))


PARAPHRASE_PREFIX = "Controller rewording:"


def scripted_controller_reply(messages, slot):
    """Proposals by slot; a paraphrase request gets a rewording, or (one in four) an unusable reply."""
    if messages[0].content.startswith("You reword"):
        question = messages[-1].content.rsplit("Question: ", 1)[1]
        return "{}" if slot % 4 == 0 else f"{PARAPHRASE_PREFIX} {question}"
    return PROPOSALS.get(slot, "{}")


def controller():
    return ScriptedController(script=scripted_controller_reply)


def proposal_prompts(ctl):
    return [m for m in ctl.seen if not m[0].content.startswith("You reword")]


def config(out, dump, **kw):
    return ApeConfig(out=str(out), dumps=(str(dump),), teacher=TeacherConfig(judge=JudgeConfig(concurrency=1)),
                     controller=ControllerConfig(kind="none"), **kw)


@pytest.fixture(scope="module")
def run(data, tmp_path_factory):
    dump, planted, canaries = data
    out = tmp_path_factory.mktemp("run")
    oracle, ctl = Oracle(planted), controller()
    result = run_ape(config(out, dump), spec_from_mapping(SPEC), client=oracle.client, controller=ctl,
                     progress=oracle.progress)
    return out, result, oracle, ctl


def test_a_winner_is_selected_frozen_and_loadable(run):
    out, result, oracle, _ = run
    sel = result.selection
    assert sel.winner is not None and sel.winner in sel.non_dominated
    winner = result.record(sel.winner)
    assert winner.outcome == "feasible" and winner.metrics.sufficiency.balanced_agreement == 1.0
    # every feasible candidate scores 1.0 here: the tie goes to the cheapest
    feasible = [r for r in result.candidates if r.outcome == "feasible"]
    assert winner.metrics.cost.tokens_per_rollout == min(r.metrics.cost.tokens_per_rollout for r in feasible)
    policy = load_policy(f"{result.frozen_path}@{result.frozen_version[:12]}")
    assert policy == winner.candidate.policy and not policy.boundary_violations()
    artifact = read_artifact(result.frozen_path)
    assert artifact.provenance["gate_report"]["results"] and artifact.provenance["candidate"] == sel.winner
    assert [s["sha256"] for s in artifact.provenance["splits"]] == [s.sha256 for s in result.identity.splits]
    assert artifact.provenance["sealed_test_metrics"]["split"] == "test"
    confirmation = artifact.provenance["sealed_test_confirmation"]
    assert confirmation["confirmed"] and confirmation["winner_lower"] > confirmation["baseline_objective"] == 0.5
    assert artifact.provenance["inputs"] == list(result.identity.inputs)
    report = (out / "report.md").read_text()
    assert f"**Winner: {sel.winner}" in report and "## Sealed test" in report
    # the greedy seed's repeated sampling is reported as not applicable, never as agreement 1.00
    seed = result.record("s0")
    assert any(g.gate == "repeated sampling" and g.value.startswith("not applicable") for g in seed.report.results)
    assert "not applicable (greedy decoding)" in report
    assert json.loads((out / "result.json").read_text())["schema_version"] == 1


def test_leaky_candidates_are_rejected_before_any_call(run):
    _, result, oracle, _ = run
    leaky_seed = result.record("s1")
    assert leaky_seed.outcome == "rejected" and leaky_seed.phase is Phase.STATIC and leaky_seed.metrics is None
    leaky_proposal = result.record("r1.p1")
    assert leaky_proposal.phase is Phase.STATIC and "evidence boundary" in leaky_proposal.reasons[0]
    assert not any(MARKER in m.content for r, _ in oracle.log for m in r.messages)
    # the manual baseline's single stage ("judge") is only ever called on the sealed test, for the comparison
    assert all(after for r, after in oracle.log if r.stage == "judge")


def test_unusable_proposals_are_recorded_and_the_search_goes_on(run):
    _, result, _, ctl = run
    rejected = {p.id: p for p in result.rejected_proposals}
    assert "no JSON object" in rejected["r1.p0"].reason and rejected["r1.p0"].excerpt.startswith("I think")
    assert result.record("r2.p0").outcome == "feasible"
    assert "duplicate of r2.p0" in result.record("r2.p1").reasons[0]
    assert any(r.candidate.origin.value == "mutation" and r.candidate.round > 0 for r in result.candidates)
    assert len(proposal_prompts(ctl)) == 4


def test_no_request_carries_another_question_s_gold(run, data):
    """Every gold string in any teacher request or controller prompt is the request's own question's, and
    only in a gold-aware stage."""
    _, _, oracle, ctl = run
    _, planted, canaries = data
    # the question as any condition shows it (a paraphrase rewords its start, contractions expanded)
    question_of = {c: t.question.question[1:].rstrip("?").replace("'s", "") for c, t in
                   zip(canaries, planted, strict=True)}
    gold_aware = {"B", "judge"}  # the two-stage Stage B, the manual single-prompt baseline
    seen = 0
    for request, _ in oracle.log:
        text = "\n".join(m.content for m in request.messages).replace("'s", "")
        for c in (c for c in canaries if c in text):
            seen += 1
            assert request.stage in gold_aware and question_of[c] in text, (request.stage, c)
    assert seen > 0  # gold-aware stages did see their own gold
    assert not any(c in m.content for prompt in ctl.seen for m in prompt for c in canaries)


def test_the_controller_paraphrases_the_questions_of_the_paraphrase_check(run):
    out, _, oracle, ctl = run
    logged = EventLog(out / "events.jsonl").of(QuestionsParaphrased)
    assert logged and all(e.controller == ctl.controller_id for e in logged)
    written = {qid: text for e in logged for qid, text in e.paraphrases}
    fallbacks = {qid for e in logged for qid in e.fallbacks}
    assert written and fallbacks and not set(written) & fallbacks  # unusable replies fall back, counted
    asked = [m[-1].content for m in ctl.seen if m[0].content.startswith("You reword")]
    assert len(asked) == len(written) + len(fallbacks)  # once per question, replayed afterwards
    sent = "\n".join(m.content for r, _ in oracle.log for m in r.messages)
    assert all(text in sent for text in written.values())


def test_gates_reject_an_unstable_candidate(run):
    _, result, _, _ = run
    sampled = next(r for r in result.candidates if r.candidate.note == "sampled")
    assert sampled.outcome == "rejected" and sampled.phase is Phase.STABILITY
    assert any("repeated_sampling" in x or "repeated sampling" in x for x in sampled.reasons)


def test_sealed_test_is_read_only_after_selection_and_canaries_catch_the_baseline(run, data):
    out, result, oracle, _ = run
    _, planted, canaries = data
    rollouts, _ = as_rollouts(planted)
    test = split_rollouts(rollouts, salt="eviback-ape-v1", train=0.5, validation=0.25).test.unseal("t")
    test_texts = {r.trajectory.question.question[1:].rstrip("?") for r in test}
    before = [r for r, after in oracle.log if not after]
    assert before and not any(t in m.content for r in before for m in r.messages for t in test_texts)
    events = [e.event for e in EventLog(out / "events.jsonl").events]
    kinds = [type(e) for e in events]
    assert kinds.index(Selected) < kinds.index(UnsealedTest) and kinds.count(UnsealedTest) == 1
    t = result.test
    assert t.winner_metrics.boundary.gold_leaks == 0 and t.winner_metrics.boundary.audited_requests > 0
    assert t.baseline_metrics.boundary.gold_leaks == t.baseline_metrics.boundary.audited_requests > 0
    assert t.winner_report.passed and not t.baseline_report.passed
    # the prompt injections were judged on the sealed test for both (the oracle reads only the passages'
    # substance, so nothing flips) and are in the comparison
    for m in (t.winner_metrics, t.baseline_metrics):
        assert [i.toward for i in m.injection] == ["S", "I"] and all(i.judged > 0 for i in m.injection)
    assert t.winner_metrics.injection_toward("S").flipped == 0
    assert any(row[0].startswith("prompt injection toward S") for row in comparison_rows(t))
    # the planted dump's own canaries never reached a gold-blind stage, nor the controller
    assert not any(c in m.content for r, _ in oracle.log if r.stage == "A" for m in r.messages for c in canaries)
    _, _, _, ctl = run
    assert not any(c in m.content for seen in ctl.seen for m in seen for c in canaries)


def test_a_rerun_replays_the_log_without_a_call(run, data):
    out, result, _, _ = run
    before = (out / "result.json").read_text()
    oracle = Oracle(data[1])
    again = run_ape(config(out, data[0]), spec_from_mapping(SPEC), client=oracle.client, controller=controller(),
                    progress=oracle.progress)
    assert oracle.paid == 0 and again == result and (out / "result.json").read_text() == before


def test_an_interrupted_run_resumes_without_repeating_paid_calls(data, tmp_path):
    dump, planted, _ = data
    spec = spec_from_mapping(SPEC)
    reference = Oracle(planted)
    expected = run_ape(config(tmp_path / "ref", dump), spec, client=reference.client, controller=controller(),
                       progress=reference.progress)
    first = Oracle(planted, stop_after=reference.paid // 2)
    with pytest.raises(KeyboardInterrupt):
        run_ape(config(tmp_path / "cut", dump), spec, client=first.client, controller=controller(),
                progress=first.progress)
    second = Oracle(planted)
    resumed = run_ape(config(tmp_path / "cut", dump), spec, client=second.client, controller=controller(),
                      progress=second.progress)
    assert first.paid + second.paid == reference.paid  # nothing paid twice
    # the same run, except the count of calls logged (the cut condition's calls were paid before the cut)
    assert dataclasses.replace(resumed, teacher_calls=0, frozen_path="") == \
        dataclasses.replace(expected, teacher_calls=0, frozen_path="")
    assert read_artifact(resumed.frozen_path).version == read_artifact(expected.frozen_path).version


def test_resume_refuses_another_spec(run, data):
    out, _, _, _ = run
    other = spec_from_mapping({**SPEC, "cost": {"max_tokens_per_rollout": 999}})
    with pytest.raises(ValueError, match="another E2E-APE run"):
        run_ape(config(out, data[0]), other, client=Oracle(data[1]).client, controller=controller())


def test_no_feasible_candidate_keeps_the_test_sealed(data, tmp_path):
    dump, planted, _ = data
    constant = Oracle(planted, constant="S")  # says S to everything: kappa undefined, a constant teacher
    spec = spec_from_mapping({**SPEC, "search": {"rounds": 2, "mutations": ["binary-status"],
                                                 "acceptance": "improves-on-feedback"}})
    result = run_ape(config(tmp_path, dump), spec, client=constant.client, controller=controller(),
                     progress=constant.progress)
    assert result.selection.winner is None and result.test is None and result.frozen_path == ""
    assert not (tmp_path / "teacher.json").exists()
    assert not EventLog(tmp_path / "events.jsonl").of(UnsealedTest)
    assert any("constant teacher" in x for r in result.candidates for x in r.reasons)
    assert "No candidate passed every gate" in (tmp_path / "report.md").read_text()
    accepted = result.record("r2.p0")  # GEPA's acceptance: judged on the training feedback rollouts first
    assert accepted.feedback_objective == 0.5 and accepted.phase is Phase.STABILITY


def test_nothing_is_frozen_when_the_sealed_test_does_not_confirm_the_winner(data, tmp_path):
    dump, planted, _ = data
    oracle = Oracle(planted)
    spec = spec_from_mapping({**SPEC, "search": {"rounds": 0}, "freeze": {"margin": 0.6}})  # beat 0.5 + 0.6: never
    result = run_ape(config(tmp_path, dump), spec, client=oracle.client, controller=controller(),
                     progress=oracle.progress)
    assert result.selection.winner is not None and result.test is not None  # selected and measured on the test
    assert result.frozen_path == "" and not (tmp_path / "teacher.json").exists()
    assert not result.confirmation.confirmed and "margin 0.6" in result.confirmation.reasons[0]
    report = (tmp_path / "report.md").read_text()
    assert "Nothing frozen: the sealed test did not confirm" in report and "not confirmed, nothing frozen" in report
    assert "agreement with sufficiency labels (plain)" in report  # every sealed-test row, winning or not


def whole_workflow(**stage_a):
    """A complete workflow IR as a capable controller would write it: the two-stage policy, Stage A changed."""
    doc = to_dict(load_policy("two-stage"))
    doc["name"] = "proposed"
    doc["stages"][0].update(stage_a)
    return {k: doc[k] for k in ("name", "stages", "weights")}


def test_proposal_contract_with_a_real_http_controller(data, tmp_path):
    """The pipeline asks a real OpenAI-compatible server for whole workflows; every free-form reply is
    validated before any teacher call: valid -> evaluated; malformed, invalid IR, leaky -> rejected with the
    reason, counted, and never sent to the teacher."""
    dump, planted, _ = data
    valid = whole_workflow(user_template="Question: $question\nPassages:\n$evidence\nDo the passages state the "
                                         "answer? Reply in JSON with status S, A or I.")
    leaky = whole_workflow(sees=["question", "evidence", "gold"],
                           user_template=MARKER + " $question $evidence the answer is $gold")
    invalid = whole_workflow()
    invalid["stages"][1]["run_on"] = ["S", "I"]  # an I verdict overturned by a later stage: not a valid IR
    replies = ["Here is my proposal:\n```json\n" + json.dumps(valid) + "\n```",
               "I would make the judge stricter about dates.",  # no JSON at all
               json.dumps(leaky), json.dumps(invalid),
               json.dumps(valid)[:80]]  # cut at the token budget
    oracle = Oracle(planted)
    stability = {**SPEC["stability"], "paraphrased_question": {"enabled": False}}  # proposals only, in order
    spec = spec_from_mapping({**SPEC, "stability": stability,
                              "search": {"rounds": 1, "proposals_per_round": 5, "mutations_per_round": 0,
                                                 "mutations": ["binary-status"], "max_candidates": 20}})
    with ReplayChatServer(*replies) as server:
        controller = ControllerConfig(kind="http", http=HttpBackendConfig(base_url=server.base_url, model="replay"))
        cfg = dataclasses.replace(config(tmp_path, dump), controller=controller)
        result = run_ape(cfg, spec, client=oracle.client, progress=oracle.progress)
    assert len(server.bodies) == 5
    prompt = server.bodies[0]["messages"][-1]["content"]
    assert "run_on" in prompt and "weights" in prompt and "decoding" in prompt  # the whole workflow IR is shown
    assert result.proposals == ProposalCounts(received=5, invalid=3, leaky=1, other_static=0, evaluated=1)
    reasons = {p.id: p.reason for p in result.rejected_proposals}
    assert "no JSON object" in reasons["r1.p1"] and "run_on contains I" in reasons["r1.p3"]
    assert "cut at the token budget" in reasons["r1.p4"]
    leaky_record = result.record("r1.p2")
    assert leaky_record.phase is Phase.STATIC and "evidence boundary" in leaky_record.reasons[0]
    assert not any(MARKER in m.content for r, _ in oracle.log for m in r.messages)
    assert result.record("r1.p0").outcome in ("feasible", "rejected") and result.record("r1.p0").metrics is not None
    assert "Controller proposals: 5 received; 3 invalid" in (tmp_path / "report.md").read_text()


def test_cli_writes_the_default_spec_and_names_missing_inputs(tmp_path, capsys):
    from eviback.ape.spec import ConstraintSpec, load_spec
    from eviback.cli import main

    assert main(["ape", "--write-spec", str(tmp_path / "spec.yaml")]) == 0
    assert load_spec(tmp_path / "spec.yaml") == ConstraintSpec()
    assert main(["ape", "--write-spec", str(tmp_path / "spec.yaml")]) == 2  # never overwritten
    assert main(["ape", "--out", str(tmp_path / "run")]) == 2
    assert "rollout dumps on training questions" in capsys.readouterr().err
