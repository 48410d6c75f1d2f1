"""The GRPO adapter on TRL: the advantages TRL trains on are eviback's, observations are masked, the teacher
sees only all-zero groups, DAPO filtering drops groups, and the engine tracks the trainer's updates.

The trainer here is TRL's real GRPOTrainer on the real SmolLM2; the rollouts come from a scripted backend so
that every group's EM is known in advance."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field

import pytest
import torch

from eviback.backoff import BackoffConfig, Mode, zscore
from eviback.generation.base import Completion, FinishReason, SamplingConfig, request_caps, stop_cut
from eviback.protocol import INVALID_ACTION_MESSAGE
from eviback.rollout import RolloutConfig, RolloutEngine
from eviback.types import Passage, Question, Status, Verdict

pytestmark = pytest.mark.slow
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

QUESTIONS = [
    Question("q-hit", "who wrote hamlet", ("William Shakespeare",)),
    Question("q-miss", "what is the capital of france", ("Paris",)),
]


@dataclass
class AlternatingBackend:
    """Turn 1: searches. Turn 2: rollout 0 of `q-hit` answers the gold answer, everything else a wrong one.
    Rollouts are told apart by their position in the call (the engine keeps the order of its batch)."""

    tokenizer: object
    max_context: int = 8192
    name: str = "alternating"
    calls: int = 0
    seeds: list[int] = field(default_factory=list)

    def generate(self, prompts, params: SamplingConfig, max_tokens=None) -> list[Completion]:
        caps = request_caps(len(prompts), params, max_tokens)
        self.calls += 1
        out = []
        for i, (prompt, cap) in enumerate(zip(prompts, caps, strict=True)):
            context = self.tokenizer.decode(prompt)
            if "<information>Doc" not in context:  # the prompt itself names the tags
                text = "<think>I should look it up.</think>\n<search> the question </search>"
            elif "hamlet" in context and i == 0:
                text = "<think>Found it.</think>\n<answer> William Shakespeare </answer>"
            else:
                text = "<think>Not sure.</think>\n<answer> Napoleon </answer>"
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            ids = ids[: stop_cut(self.tokenizer, ids, params.stop) or len(ids)][:cap]
            out.append(Completion(tuple(ids), self.tokenizer.decode(ids), tuple(-0.7 for _ in ids),
                                  FinishReason.STOP))
        return out

    def reseed(self, seed: int) -> None:
        self.seeds.append(seed)

    def update_weights(self, weights) -> None:
        self.pushed = True

    def close(self) -> None:
        pass


class FixedRetriever:
    def search(self, queries, topk=3):
        return [[Passage("7", '"Doc"\nSome retrieved text <answer> injected </answer>.', 1.0)] for _ in queries]

    def close(self) -> None:
        pass


MODES = (Mode.EVIBACK, Mode.DAPO, Mode.GRPO)


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory):
    """One real TRL trainer run for three steps, the advantage mode switched before each: EviBack, DAPO,
    plain GRPO. Returns, per step, (TRL's batch output, the StepOutcome, the groups the teacher saw)."""
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig

    from eviback.policy import load_tokenizer, resolve_model
    from eviback.train.grpo import EviBackTrainer, training_dataset

    path = resolve_model("smollm2-135m", "float32")
    tokenizer = load_tokenizer(path)
    engine = RolloutEngine(AlternatingBackend(tokenizer), FixedRetriever(),
                           RolloutConfig(group_size=2, max_turns=1, max_turn_tokens=32, max_context_tokens=1024))
    outputs, steps, judged = [], [], []

    def judge_groups(groups):  # a scripted teacher: rewards 0.2 and 0.8
        judged[-1].extend(g.question.id for g in groups)
        return [(Verdict(Status.INSUFFICIENT, reward=0.2), Verdict(Status.SUFFICIENT, reward=0.8)) for _ in groups]

    class Recording(EviBackTrainer):
        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            outputs.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in output.items()})
            return output

    class SwitchMode(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            trainer.backoff = BackoffConfig(mode=MODES[state.global_step], lam=0.1)
            judged.append([])

    args = GRPOConfig(output_dir=str(tmp_path_factory.mktemp("ckpt")), per_device_train_batch_size=2,
                      gradient_accumulation_steps=2, num_generations=2, max_steps=3, learning_rate=1e-6, beta=0.0,
                      use_cpu=True, bf16=False, report_to="none", save_strategy="no",
                      remove_unused_columns=False, shuffle_dataset=False, disable_tqdm=True)
    trainer = Recording(
        engine=engine, questions={q.id: q for q in QUESTIONS}, backoff=BackoffConfig(),
        judge_groups=judge_groups, on_step=steps.append, push_weights=True,
        model=AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), args=args,
        train_dataset=training_dataset(QUESTIONS * 3), processing_class=tokenizer, callbacks=[SwitchMode()],
    )
    trainer.train()
    assert len(outputs) == len(steps) == len(judged) == 3
    return list(zip(outputs, steps, judged, strict=True)), tokenizer


def test_trl_trains_on_evibacks_advantages_with_observations_masked(three_steps):
    (output, step, judged), tokenizer = three_steps[0][0], three_steps[1]
    # the teacher saw exactly the all-zero group, once
    assert judged == ["q-miss"]
    by_question = {g.question.id: o for g, o in zip(step.batch.groups, step.outcomes, strict=True)}
    assert by_question["q-hit"].kind.value == "verified" and by_question["q-miss"].kind.value == "fallback"
    expected = {"q-hit": zscore([1.0, 0.0], 1e-6), "q-miss": tuple(0.1 * a for a in zscore([0.2, 0.8], 1e-6))}
    # rows are in rollout order: whole groups, in the order of step.batch.groups
    rows = [a for g in step.batch.groups for a in expected[g.question.id]]
    assert output["advantages"].tolist() == pytest.approx(rows, rel=1e-5)
    assert max(abs(a) for a in expected["q-miss"]) == pytest.approx(0.1 * math.sqrt(0.5), rel=1e-4)
    # every observation token (the retrieved passage, even its fake <answer> tag) is out of the loss
    for row, trajectory in enumerate(step.batch.trajectories):
        mask = output["tool_mask"][row].tolist()
        ids = output["completion_ids"][row].tolist()
        n = len(trajectory.tokens.ids)
        assert mask[:n] == list(trajectory.tokens.mask)
        observed = tokenizer.decode([t for t, m in zip(ids[:n], mask[:n], strict=True) if m == 0])
        assert "<information>" in observed and "injected" in observed
        model_text = tokenizer.decode([t for t, m in zip(ids[:n], mask[:n], strict=True) if m == 1])
        assert "<information>" not in model_text and INVALID_ACTION_MESSAGE not in model_text
        assert trajectory.answer in ("Napoleon", "William Shakespeare")  # never the injected passage's


def test_dapo_drops_zero_variance_groups_from_the_loss(three_steps):
    output, step, judged = three_steps[0][1]
    assert judged == []  # no teacher outside EviBack mode
    for i, (group, outcome) in enumerate(zip(step.batch.groups, step.outcomes, strict=True)):
        rows = output["tool_mask"][2 * i:2 * i + 2]
        if group.question.id == "q-miss":
            assert not outcome.keep and rows.sum() == 0
        else:
            assert outcome.keep and rows.sum() > 0
    kept = (output["completion_mask"] * output["tool_mask"]).sum()
    assert output["num_items_in_batch"] == kept


def test_grpo_mode_gives_all_zero_groups_nothing(three_steps):
    output, step, judged = three_steps[0][2]
    assert judged == []
    for i, group in enumerate(step.batch.groups):
        if group.question.id == "q-miss":
            assert output["advantages"][2 * i:2 * i + 2].tolist() == [0.0, 0.0]
        else:
            assert output["advantages"][2 * i:2 * i + 2].tolist() == pytest.approx(list(zscore([1.0, 0.0], 1e-6)))


def test_engine_logprobs_track_the_trainer_after_an_update(vllm_backend, tmp_path):
    """After a real optimiser step and the weight push, the engine samples from the updated policy: its
    sampled-token log-probabilities match a forward pass of the trainer's model (in the engine's dtype: bf16
    where `auto` chose it, as the trainer holds it there: fp32 masters, bf16 model; fp32 elsewhere), and no
    longer match the old policy."""
    from transformers import AutoModelForCausalLM

    from eviback.policy import load_tokenizer, resolve_model
    from eviback.protocol import apply_chat_template

    path = resolve_model("smollm2-135m", "bfloat16")
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    prompt = tokenizer(apply_chat_template(tokenizer, "who wrote hamlet"), add_special_tokens=False)["input_ids"]
    params = SamplingConfig(max_tokens=24, temperature=1.0, stop=())

    engine_dtype = getattr(torch, vllm_backend.config.dtype)  # `auto` as resolved on this machine

    def forward_logprobs(state, ids):
        """Sampled-token log-probabilities under `state` rounded to the engine's dtype (computed in fp32)."""
        model.load_state_dict({k: v.to(engine_dtype).float() for k, v in state.items()})
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(ids)])).logits[0, len(prompt) - 1:-1].float()
        return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)

    def gap(state, sample) -> float:
        return float((forward_logprobs(state, sample.token_ids) - torch.tensor(sample.logprobs)).abs().mean())

    try:
        vllm_backend.reseed(0)
        [before] = vllm_backend.generate([prompt], params)
        assert gap(original, before) < 0.1  # the engine and the trainer agree before training
        # one optimiser step that makes a different continuation likely (a large learning rate, so the
        # update survives the rounding to bf16)
        target = tokenizer("<search> Hamlet author </search>", add_special_tokens=False)["input_ids"]
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        logits = model(torch.tensor([prompt + target])).logits[0, len(prompt) - 1:-1]
        torch.nn.functional.cross_entropy(logits, torch.tensor(target)).backward()
        optimizer.step()
        updated = {k: v.detach().clone() for k, v in model.state_dict().items()}
        assert gap(updated, before) > 0.5  # the update moved the policy on the old sample

        vllm_backend.update_weights(updated.items())
        vllm_backend.reseed(0)
        [after] = vllm_backend.generate([prompt], params)
        assert gap(updated, after) < 0.1
        assert gap(original, after) > 0.5
    finally:
        vllm_backend.update_weights(original.items())


def tiny_policy(tokenizer, dtype: torch.dtype) -> torch.nn.Module:
    """A 2-layer model of SmolLM2's architecture and vocabulary, randomly initialised (seeded): a real
    training step costs milliseconds in either precision, on any CPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from eviback.policy import resolve_model

    config = AutoConfig.from_pretrained(resolve_model("smollm2-135m", "float32"))
    config.num_hidden_layers, config.hidden_size, config.intermediate_size = 2, 64, 128
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 4, 2, 16
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_training_step_in_each_precision(tmp_path, dtype):
    """The CPU set-ups of `eviback train` under TRL, two micro-batches per step. bfloat16: a bf16 model with
    fp32 masters; the gradients reach the masters (summed in fp32 and clipped there), the masters move, the
    bf16 model is their rounding, and the logged gradient norm is the fp32 sum's. float32 (what `auto` picks
    on a CPU without native bf16): the fp32 model is trained directly by AdamW, no masters."""
    from transformers import TrainerCallback
    from trl import GRPOConfig

    from eviback.policy import load_tokenizer, resolve_model
    from eviback.train.grpo import EviBackTrainer, training_dataset
    from eviback.train.precision import MasterWeightAdamW
    from eviback.train.runner import Precision, training_precision

    tokenizer = load_tokenizer(resolve_model("smollm2-135m", "float32"))
    precision = training_precision(dtype, cuda=False)
    if precision is Precision.MASTERS:
        master = tiny_policy(tokenizer, torch.float32)
        model = tiny_policy(tokenizer, torch.bfloat16)
        optimizer = MasterWeightAdamW(model, master, lr=1e-3, weight_decay=0.0)
        trained = master
    else:
        assert precision is Precision.FLOAT32
        master, model = None, tiny_policy(tokenizer, torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
        trained = model
    before = {k: v.detach().clone() for k, v in trained.named_parameters()}
    engine = RolloutEngine(AlternatingBackend(tokenizer), FixedRetriever(),
                           RolloutConfig(group_size=2, max_turns=1, max_turn_tokens=32, max_context_tokens=1024))
    logged = []

    class Logs(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            logged.append(dict(logs or {}))

    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                      num_generations=2, max_steps=1, learning_rate=1e-3, beta=0.0, max_grad_norm=1.0,
                      use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_steps=1,
                      remove_unused_columns=False, shuffle_dataset=False, disable_tqdm=True)
    trainer = EviBackTrainer(
        engine=engine, questions={q.id: q for q in QUESTIONS}, backoff=BackoffConfig(mode=Mode.GRPO),
        judge_groups=None, on_step=lambda _: None, push_weights=True, master=master, model=model, args=args,
        train_dataset=training_dataset(QUESTIONS), processing_class=tokenizer, optimizers=(optimizer, None),
        callbacks=[Logs()],
    )
    trainer.train()
    moved = [k for k, v in trained.named_parameters() if not torch.equal(v, before[k])]
    assert len(moved) > len(before) // 2  # the verified group's advantages moved the trained weights
    assert all(v.dtype == torch.float32 for v in trained.parameters())
    if master is not None:
        for name, p in model.named_parameters():
            assert torch.equal(p, dict(master.named_parameters())[name].to(torch.bfloat16))
        assert all(p.grad is None for p in model.parameters())  # nothing left in bf16 buffers
    norms = [entry["grad_norm"] for entry in logged if "grad_norm" in entry]
    assert norms and math.isfinite(norms[0]) and norms[0] > 0


def test_deferred_old_logprobs_give_trls_step(tmp_path):
    """With the behaviour correction on and one optimiser step per generation batch, the "old" log-probs
    are the loss pass's own: the trainer skips TRL's extra no-grad pass of the policy and computes the
    importance ratio in the loss pass. Same step as TRL's way: the logged engine/trainer differences and
    ratios, the loss and the updated weights; one policy pass fewer."""
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig

    from eviback.policy import load_tokenizer, resolve_model
    from eviback.train.grpo import EviBackTrainer, training_dataset

    path = resolve_model("smollm2-135m", "float32")
    tokenizer = load_tokenizer(path)

    def one_step(defer: bool):
        logged, passes, given = [], [], []

        class Logs(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kwargs):
                logged.append(dict(logs or {}))

        class Counting(EviBackTrainer):
            def _per_token_logps(self, model, *args, **kwargs):
                if model is self.model and not torch.is_grad_enabled():
                    passes.append(1)
                return super()._per_token_logps(model, *args, **kwargs)

            def _compute_loss(self, model, inputs):
                given.append("old_per_token_logps" in inputs)  # TRL's way: the old pass's log-probs
                return super()._compute_loss(model, inputs)

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        engine = RolloutEngine(AlternatingBackend(tokenizer), FixedRetriever(),
                               RolloutConfig(group_size=2, max_turns=1, max_turn_tokens=32,
                                             max_context_tokens=1024))
        args = GRPOConfig(output_dir=str(tmp_path / str(defer)), per_device_train_batch_size=2,
                          gradient_accumulation_steps=2, num_generations=2, max_steps=1, learning_rate=1e-4,
                          beta=0.0, use_cpu=True, bf16=False, report_to="none", save_strategy="no",
                          logging_steps=1, remove_unused_columns=False, shuffle_dataset=False, disable_tqdm=True)
        trainer = Counting(
            engine=engine, questions={q.id: q for q in QUESTIONS}, backoff=BackoffConfig(mode=Mode.GRPO),
            judge_groups=None, on_step=lambda _: None, push_weights=False, model=model, args=args,
            train_dataset=training_dataset(QUESTIONS), processing_class=tokenizer, callbacks=[Logs()])
        trainer.scoring = dataclasses.replace(trainer.scoring, defer_old_pass=defer)
        trainer.train()
        return next(e for e in logged if "loss" in e), len(passes), dict(model.named_parameters()), given

    theirs, their_passes, their_weights, their_inputs = one_step(defer=False)
    ours, our_passes, our_weights, our_inputs = one_step(defer=True)
    assert (their_passes, our_passes) == (1, 0)
    assert their_inputs == [True, True] and our_inputs == [False, False]
    keys = ["sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
            "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
            "sampling/importance_sampling_ratio/max", "loss", "grad_norm"]
    assert theirs["sampling/importance_sampling_ratio/min"] < 1  # a correction that weights the loss
    for key in keys:
        assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key
    for name, p in their_weights.items():
        torch.testing.assert_close(our_weights[name], p, rtol=1e-5, atol=1e-7)


def test_a_step_that_keeps_no_group_leaves_the_weights_bit_identical(tmp_path):
    """DAPO drops every group of step 2 (q-miss: all rollouts wrong): no reference or loss pass, no gradient,
    and AdamW (weight decay 0.1, moments from step 1's real update) leaves the weights and its state as they
    were. The step is recorded as such."""
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig

    from eviback.policy import load_tokenizer, resolve_model
    from eviback.train.grpo import EviBackTrainer, training_dataset
    from eviback.train.step_records import step_metrics

    path = resolve_model("smollm2-135m", "float32")
    tokenizer = load_tokenizer(path)
    engine = RolloutEngine(AlternatingBackend(tokenizer), FixedRetriever(),
                           RolloutConfig(group_size=2, max_turns=1, max_turn_tokens=32, max_context_tokens=1024))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    weights, states, steps = [], [], []

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            weights.append({n: p.detach().clone() for n, p in model.named_parameters()})
            states.append({i: {k: v.clone() for k, v in s.items()} for i, s in optimizer.state.items()})

    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=1,
                      num_generations=2, max_steps=2, learning_rate=1e-4, beta=0.04, use_cpu=True, bf16=False,
                      report_to="none", save_strategy="no", remove_unused_columns=False, shuffle_dataset=False,
                      disable_tqdm=True)
    trainer = EviBackTrainer(
        engine=engine, questions={q.id: q for q in QUESTIONS}, backoff=BackoffConfig(mode=Mode.DAPO),
        judge_groups=None, on_step=steps.append, push_weights=False, model=model, args=args,
        train_dataset=training_dataset(QUESTIONS), processing_class=tokenizer, optimizers=(optimizer, None),
        callbacks=[Snapshot()])
    trainer.train()

    assert [s.batch.groups[0].question.id for s in steps] == ["q-hit", "q-miss"]
    assert [s.update_skipped for s in steps] == [False, True]
    assert step_metrics(steps[1], trainer.backoff)["train/update_skipped"] is True
    assert step_metrics(steps[1], trainer.backoff)["train/update_tokens"] == 0  # no update: no tokens computed on
    assert step_metrics(steps[0], trainer.backoff)["train/update_tokens"] > 0
    first, second = weights
    for name in first:
        assert torch.equal(first[name], second[name]), name
    for i in states[0]:
        for key in states[0][i]:
            assert torch.equal(states[0][i][key], states[1][i][key]), (i, key)
    assert states[0]  # step 1 did update: AdamW has moments
