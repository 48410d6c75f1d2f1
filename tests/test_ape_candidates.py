"""E2E-APE candidates: static rejection before any call, structural variants, controller proposals parsed into
policies (or rejected with a reason), and the gold-free view of failures shown to the controller."""

import pytest

from eviback.ape.candidates import (
    MUTATIONS,
    NotApplicable,
    ProposalError,
    apply_mutation,
    mutation_names,
    parse_proposal,
    register_mutation,
    static_rejections,
)
from eviback.ape.controller import FailureExample, ParentSummary, controller_messages
from eviback.ape.records import structure_key
from eviback.teacher.boundary import plant_canaries
from eviback.teacher.policy import Input, OutputField, load_policy
from eviback.teacher.probes import build_probes
from eviback.teacher.workflow import blind_view, stage_request
from eviback.types import Status

TWO = load_policy("two-stage")


def test_static_rejections():
    assert static_rejections(TWO, max_stages=2) == ()
    leaky = static_rejections(load_policy("single-prompt-dual-task"), max_stages=2)
    assert len(leaky) == 1 and leaky[0].startswith("evidence boundary")
    assert any("at most 1" in r for r in static_rejections(TWO, max_stages=1))
    blind = parse_proposal('{"stages": [{"name": "A", "sees": ["question", "answer"], '
                           '"user_template": "$question $answer"}]}', TWO, "x")
    assert any("not shown the evidence" in r for r in static_rejections(blind, max_stages=2))
    s_only = parse_proposal('{"stages": [{"name": "A", "statuses": ["S", "A"]}]}', TWO, "x")
    assert any("cannot say both S and I" in r for r in static_rejections(s_only, max_stages=2))


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_every_mutation_gives_a_valid_compliant_new_workflow(name):
    mutated = apply_mutation(name, TWO)
    assert static_rejections(mutated, max_stages=2) == ()
    assert structure_key(mutated) != structure_key(TWO) and mutated.name == f"two-stage+{name}"
    probe = build_probes(1, seed=2)[0].trajectory
    for stage in mutated.stages:  # every template renders on a real rollout
        assert stage_request(stage, probe).messages


def test_mutation_specifics_and_registry():
    assert apply_mutation("single-prompt-blind", TWO).stages[0].outputs == (OutputField.STATUS, OutputField.ANSWER)
    assert len(apply_mutation("single-prompt-blind", TWO).stages) == 1
    assert Input.ANSWER not in apply_mutation("hide-actor-answer", TWO).stages[0].sees
    assert apply_mutation("extract-then-judge", TWO).stages[0].outputs[0] is OutputField.ANSWER
    assert apply_mutation("binary-status", TWO).stages[0].statuses == (Status.SUFFICIENT, Status.INSUFFICIENT)
    with pytest.raises(NotApplicable):
        apply_mutation("gate-b-on-s", apply_mutation("single-prompt-blind", TWO))
    with pytest.raises(ValueError, match="already registered"):
        register_mutation("binary-status", "again")(lambda p: p)
    with pytest.raises(ValueError, match="unknown mutation"):
        mutation_names(["nope"])
    assert mutation_names(["all"]) == tuple(MUTATIONS)


def test_parse_proposal_patches_and_full_policies():
    patched = parse_proposal('Sure! {"stages": [{"name": "A", "user_template": "Q: $question\\nP: $evidence\\nS or I?"}]}',
                             TWO, "cand")
    assert patched.name == "cand" and patched.stages[0].user_template.startswith("Q: $question")
    assert patched.stages[1] == TWO.stages[1] and patched.stages[0].sees == TWO.stages[0].sees
    bare = parse_proposal('{"system_prompt": "Judge the evidence.", "user_template": "$question $evidence"}', TWO, "b")
    assert bare.stages[0].system_prompt == "Judge the evidence." and len(bare.stages) == 2
    full = parse_proposal(load_policy("two-stage").canonical_json().replace('"two-stage"', '"renamed"'), TWO, "f")
    assert structure_key(full) == structure_key(TWO)
    single = parse_proposal('{"stages": [{"name": "A", "sees": ["question", "evidence"], "outputs": ["status"], '
                            '"user_template": "$question $evidence"}]}', TWO, "one")
    assert len(single.stages) == 1  # a complete list of stages replaces the workflow
    decoding = parse_proposal('{"stages": [{"name": "A", "decoding": {"temperature": 0.5}}]}', TWO, "d")
    assert decoding.stages[0].decoding.temperature == 0.5 and decoding.stages[0].decoding.max_tokens == 32


@pytest.mark.parametrize("reply, reason", [
    ("I would make the prompt clearer.", "no JSON object"),
    ('{"stages": [{"name": "A", "user_template": "$question $evidence $gold"}]}', "does not see"),
    ('{"stages": [{"name": "A", "user_template": "$question $evidence $foo"}]}', "unknown template"),
    ('{"prompt": "x"}', "unknown key"),
    ('{"stages": [{"name": "A", "sees": ["question", "everything"]}]}', "not a valid policy"),
    ('{"stages": [{"name": "B", "run_on": ["I"]}]}', "I verdict is final"),
    ('{"stages": "A"}', "non-empty list"),
    ('{"stages": [{"name": "A", "user_template": "$question $evidence costs $5"}]}', "lone"),
])
def test_unusable_proposals_are_rejected_with_a_reason(reply, reason):
    with pytest.raises(ProposalError, match=reason):
        parse_proposal(reply, TWO, "x")


def test_a_proposal_letting_gold_reach_stage_a_is_caught_statically():
    leaky = parse_proposal('{"stages": [{"name": "A", "sees": ["question", "evidence", "gold"], '
                           '"user_template": "$question $evidence $gold"}]}', TWO, "leaky")
    assert any(r.startswith("evidence boundary") for r in static_rejections(leaky, max_stages=2))


def test_what_the_controller_is_shown_never_contains_gold():
    planted, canaries = plant_canaries([p.trajectory for p in build_probes(12, seed=4)], seed=1)
    failures = [FailureExample.of(blind_view(t), Status.SUFFICIENT, False) for t in planted]
    summary = ParentSummary(12, 12, 0.5, 6, 0, (("S", 12), ("A", 0), ("I", 0)))
    messages = controller_messages(TWO, summary, failures)
    text = "".join(m.content for m in messages)
    assert "Question:" in text and "correct: I" in text
    assert not any(c in text for c in canaries)


def test_a_skeleton_controller_fills_one_string_and_caches_the_reply():
    from eviback.ape.controller import ChatController, ControllerSettings
    from eviback.teacher.cache import MemoryCache
    from teacher_fakes import ScriptedClient

    client = ScriptedClient(lambda request: "Judge only whether a passage states the answer.")
    controller = ChatController(client, ControllerSettings(skeletons=True), MemoryCache())
    messages = controller_messages(TWO, ParentSummary(1, 1, 0.5, 1, 0, (("S", 1),)), [])
    reply = controller.propose(messages, slot=0)
    assert client.requests[0].messages[-1].role == "assistant"  # the prefill
    policy = parse_proposal(reply.text, TWO, "x")
    assert policy.stages[0].system_prompt == "Judge only whether a passage states the answer."
    other = parse_proposal(controller.propose(messages, slot=1).text, TWO, "y")  # the instruction skeleton
    assert other.stages[0].user_template.startswith("Question: $question\n\nRetrieved passages:\n$evidence\n\n")
    assert static_rejections(other, max_stages=2) == ()
    assert controller.propose(messages, slot=0) == reply and controller.calls == 2  # cached, not asked again


def test_a_controller_paraphrase_is_used_only_when_usable():
    from eviback.ape.controller import paraphrase_messages, paraphrase_of

    q = "Who wrote the novel Dracula?"
    assert paraphrase_of("Which author is the novel Dracula by?\n(extra)", q) == "Which author is the novel Dracula by?"
    assert paraphrase_of('Question: "Which writer created Dracula?"', q) == "Which writer created Dracula?"
    for unusable in ("", "{}", '{"q": "x y z"}', "who wrote the novel   Dracula", "Bram", "x " * 200):
        assert paraphrase_of(unusable, q) is None, unusable
    assert q in paraphrase_messages(q)[-1].content
