"""LoRA training (`lora_rank` > 0, :mod:`eviback.train.lora`): a step trains the adapter alone against the base as
its reference, the engines generate with the merged weights, the fast scoring path gives TRL's step, a resumed
trainer continues from the checkpoint's adapter, and the final model is saved merged.

The trainer is TRL's real GRPOTrainer with eviback's adapter, on the 2-layer SmolLM2-shaped policy of
test_train_grpo.py (milliseconds a step) and its scripted rollouts; the vLLM check uses the session's engine and the
real SmolLM2; `eviback train` with LoRA runs end to end once."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from eviback.backoff import BackoffConfig, Mode
from eviback.generation.base import SamplingConfig
from eviback.rollout import RolloutConfig, RolloutEngine
from eviback.train.config import BehaviourCorrection, TrainConfig
from eviback.train.lora import LoraSettings, MergedWeights, adapter_parameters, engine_weights, save_final
from test_train_grpo import QUESTIONS, AlternatingBackend, FixedRetriever, tiny_policy

pytestmark = pytest.mark.slow
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

RANK = 2
SCALE = 2.0  # lora_alpha 0: twice the rank


class RecordingBackend(AlternatingBackend):
    """The scripted backend, keeping a copy of every push (name -> tensor)."""

    def update_weights(self, weights) -> None:
        pushed = getattr(self, "pushes", [])
        pushed.append({name: t.detach().clone() for name, t in dict(weights).items()})
        self.pushes = pushed


def lora_trainer(tmp_path, tokenizer, dtype, *, steps, beta=0.04, callbacks=(), save=False, scoring=None,
                 name="run"):
    """An EviBackTrainer on the tiny policy with TRL's peft_config, its optimiser built as make_trainer builds it:
    AdamW over the adapter once TRL has put it on the model."""
    from trl import GRPOConfig

    from eviback.train.grpo import EviBackTrainer, training_dataset
    from eviback.train.runner import adamw

    backend = RecordingBackend(tokenizer)
    engine = RolloutEngine(backend, FixedRetriever(),
                           RolloutConfig(group_size=2, max_turns=1, max_turn_tokens=32, max_context_tokens=1024))
    args = GRPOConfig(output_dir=str(tmp_path / name), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                      num_generations=2, max_steps=steps, learning_rate=1e-2, beta=beta, use_cpu=True, bf16=False,
                      report_to="none", save_strategy="steps" if save else "no", save_steps=1, logging_steps=1,
                      remove_unused_columns=False, shuffle_dataset=False, disable_tqdm=True, seed=0)
    # the scripted engine's log-probs (-0.7) are far from the random policy's: a truncated importance ratio of
    # exp(-10) would shrink every gradient to where AdamW's epsilon decides the update. Measured, not applied.
    trainer = EviBackTrainer(
        engine=engine, questions={q.id: q for q in QUESTIONS}, backoff=BackoffConfig(mode=Mode.GRPO),
        judge_groups=None, on_step=lambda _: None, push_weights=True, model=tiny_policy(tokenizer, dtype), args=args,
        correction=BehaviourCorrection(enabled=False),
        train_dataset=training_dataset(QUESTIONS * steps), processing_class=tokenizer, callbacks=list(callbacks),
        peft_config=LoraSettings(rank=RANK).peft_config())
    trainer.optimizer = adamw(adapter_parameters(trainer.model), args.learning_rate, accelerator=False)
    if scoring is not None:
        trainer.scoring = scoring
    return trainer, backend


def logs_and_adapter():
    """A callback recording every log line and, at each step's end, the adapter's tensors by layer."""
    from transformers import TrainerCallback

    class Record(TrainerCallback):
        logged: list = []
        adapters: list = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logged.append(dict(logs or {}))

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.adapters.append({n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n})

    record = Record()
    record.logged, record.adapters = [], []
    return record


@pytest.fixture(scope="module")
def tokenizer():
    from eviback.policy import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model("smollm2-135m", "float32"))


def expected_merge(base: dict, adapter: dict, layer: str, dtype) -> torch.Tensor:
    """W + scale x B @ A of `layer`, from the base weight and the adapter's tensors (computed in fp32)."""
    a = adapter[f"base_model.model.{layer}.lora_A.default.weight"].float()
    b = adapter[f"base_model.model.{layer}.lora_B.default.weight"].float()
    return (base[f"{layer}.weight"].float() + (b @ a) * SCALE).to(dtype)


def test_a_lora_step_trains_the_adapter_alone_against_the_base_and_the_engine_gets_the_merge(tmp_path, tokenizer):
    """bf16 on a CPU (the runner's Precision.LORA): the base stays bf16 and bit-identical, the adapter (fp32) is
    all AdamW holds and all that moves; the reference is the base with the adapter off (no second model, KL 0 at
    the first step); each push gives the engine the base model's names, holding W + scale x B @ A of the adapter
    as the last step left it."""
    record = logs_and_adapter()
    trainer, backend = lora_trainer(tmp_path, tokenizer, torch.bfloat16, steps=2, callbacks=[record])
    model = trainer.model
    base = {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" not in n}
    names = [n for n, _ in tiny_policy(tokenizer, torch.bfloat16).named_parameters()]
    assert trainer.ref_model is None
    assert {id(p) for g in trainer.optimizer.param_groups for p in g["params"]} == \
        {id(p) for n, p in model.named_parameters() if ".lora_" in n}
    trainer.train()

    for name, p in model.named_parameters():
        if ".lora_" in name:
            assert p.dtype == torch.float32 and p.requires_grad
        else:
            assert p.dtype == torch.bfloat16 and torch.equal(p, base[name]), name  # frozen, bit for bit
    first = record.adapters[0]
    assert all(t.abs().max() > 0 for n, t in first.items() if "lora_B" in n)  # step 1 moved every B from 0
    kl = [e["kl"] for e in record.logged if "kl" in e]
    assert kl[0] == 0.0 and kl[1] > 0  # the reference is the starting policy: the base, adapter off

    # push 1 (B = 0): the base weights under the base model's names; push 2: merged with step 1's adapter
    assert len(backend.pushes) == 2 and all(list(p) == names for p in backend.pushes)
    short = {n.removeprefix("base_model.model.").replace(".base_layer", ""): t for n, t in base.items()}
    for name, tensor in backend.pushes[0].items():
        assert torch.equal(tensor, short[name]), name
    layer = "model.layers.1.mlp.down_proj"
    for name in (f"{layer}.weight", "model.layers.0.self_attn.q_proj.weight"):
        merged = expected_merge(short, first, name.removesuffix(".weight"), torch.bfloat16)
        assert backend.pushes[1][name].dtype == torch.bfloat16
        torch.testing.assert_close(backend.pushes[1][name].float(), merged.float(), rtol=0, atol=0)
    assert not torch.equal(backend.pushes[1][f"{layer}.weight"], short[f"{layer}.weight"])
    assert torch.equal(backend.pushes[1]["model.embed_tokens.weight"], short["model.embed_tokens.weight"])


def test_the_fast_scoring_path_gives_trls_lora_step(tmp_path, tokenizer):
    """Under LoRA the padding-free passes run (through the transformers model inside the PeftModel) and TRL's
    extra old pass is deferred to the loss pass, as without LoRA; with the KL term on, TRL's reference pass
    through the same model (adapter disabled) is computed, not taken for the old pass. Two steps (the second with
    an adapter that differs from the reference) match TRL's own passes: loss, KL, gradient norm, the importance
    ratio's figures and the trained adapter."""
    from eviback.train.scoring import ScoringSettings

    runs = {}
    for way, scoring in (("trl", ScoringSettings.trl()), ("ours", None)):
        record = logs_and_adapter()
        trainer, _ = lora_trainer(tmp_path, tokenizer, torch.float32, steps=2, callbacks=[record], scoring=scoring,
                                  name=way)
        assert trainer._can_defer_old_logps() is (way == "ours")
        assert trainer._padding_free_applies(trainer.model, False, False, {}) is (way == "ours")
        trainer.train()
        runs[way] = [e for e in record.logged if "loss" in e], record.adapters[-1]
    (theirs, their_adapter), (ours, our_adapter) = runs["trl"], runs["ours"]
    assert len(theirs) == len(ours) == 2 and theirs[1]["kl"] > 0
    for step, (t, o) in enumerate(zip(theirs, ours, strict=True)):
        for key in ("loss", "kl", "grad_norm", "sampling/sampling_logp_difference/mean",
                    "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/max"):
            assert o[key] == pytest.approx(t[key], rel=1e-4, abs=1e-9), (step, key)
    for name, t in their_adapter.items():
        # AdamW divides by the gradients' own scale: last-bit differences of the passes become ~1e-6 here, of
        # updates of ~1e-2 (lr)
        torch.testing.assert_close(our_adapter[name], t, rtol=1e-3, atol=1e-5)


def test_a_resumed_lora_trainer_continues_from_the_checkpoints_adapter(tmp_path, tokenizer):
    """A checkpoint holds the adapter (not the model) and AdamW's state over it; a new trainer resumed from it
    (the base fresh from its source, the optimiser built over the adapter as make_trainer does) pushes the
    checkpoint's merged weights before its first rollout and continues the same AdamW."""
    from safetensors.torch import load_file

    record = logs_and_adapter()
    trainer, _ = lora_trainer(tmp_path, tokenizer, torch.float32, steps=1, callbacks=[record], save=True)
    trainer.train()
    checkpoint = tmp_path / "run" / "checkpoint-1"
    files = {p.name for p in checkpoint.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "optimizer.pt"} <= files
    assert not any(f.startswith("model") for f in files)  # no copy of the frozen model
    saved = load_file(checkpoint / "adapter_model.safetensors")
    assert len(saved) == len(record.adapters[0])

    resumed, backend = lora_trainer(tmp_path, tokenizer, torch.float32, steps=2, save=True)
    optimizer = resumed.optimizer  # make_trainer's AdamW over the adapter: the one the resumed run steps
    resumed.train(resume_from_checkpoint=str(checkpoint))
    base = {n: p for n, p in tiny_policy(tokenizer, torch.float32).state_dict().items()}
    layer = "model.layers.0.mlp.gate_proj"
    # the first push of the resumed trainer: the checkpoint's adapter, merged
    torch.testing.assert_close(backend.pushes[0][f"{layer}.weight"],
                               expected_merge(base, record.adapters[0], layer, torch.float32), rtol=1e-6, atol=1e-6)
    assert resumed.optimizer.optimizer is optimizer  # accelerate's wrapper around it
    # AdamW's state came back from the checkpoint (step 1) and took step 2
    assert all(optimizer.state[p]["step"] == 2 for g in optimizer.param_groups for p in g["params"])


def test_the_hf_engine_generates_with_the_merged_weights(tokenizer):
    """An HF engine on the base model, pushed the merged weights of a perturbed adapter, decodes greedily what
    the PeftModel itself decodes (and no longer what the base does)."""
    from peft import get_peft_model

    from eviback.generation.hf import HFBackend

    engine = HFBackend(tiny_policy(tokenizer, torch.float32), tokenizer, threads=1)
    trained = get_peft_model(tiny_policy(tokenizer, torch.float32), LoraSettings(rank=RANK).peft_config())
    torch.manual_seed(1)
    for name, p in trained.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    prompt = tokenizer("who wrote hamlet", add_special_tokens=False)["input_ids"]
    params = SamplingConfig(max_tokens=12, temperature=0, stop=())

    def greedy(model) -> tuple[int, ...]:
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(12):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        return tuple(ids[len(prompt):])

    [before] = engine.generate([prompt], params)
    engine.update_weights(engine_weights(trained).named_parameters())
    [after] = engine.generate([prompt], params)
    assert after.token_ids == greedy(trained)[:len(after.token_ids)] and len(after.token_ids) > 1
    assert after.token_ids != before.token_ids
    assert engine_weights(engine.model) is engine.model  # a model without adapters is pushed as it is


def test_the_vllm_engine_takes_the_merged_weights(vllm_backend):
    """vLLM's weight loader takes the merged tensors under the checkpoint's names (its fused qkv and gate/up
    layers included): after the push its sampled log-probabilities are the merged model's, not the base's."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from eviback.policy import load_tokenizer, resolve_model
    from eviback.protocol import apply_chat_template

    path = resolve_model("smollm2-135m", "bfloat16")
    tokenizer = load_tokenizer(path)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    original = {k: v.clone() for k, v in base.state_dict().items()}
    trained = get_peft_model(copy.deepcopy(base), LoraSettings(rank=8).peft_config())
    torch.manual_seed(0)
    for name, p in trained.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.2)  # ~1.7 nats a token from the base (one sample)
    merged = dict(MergedWeights(trained).named_parameters())
    prompt = tokenizer(apply_chat_template(tokenizer, "who wrote hamlet"), add_special_tokens=False)["input_ids"]
    params = SamplingConfig(max_tokens=24, temperature=1.0, stop=())
    engine_dtype = getattr(torch, vllm_backend.config.dtype)

    def gap(state, sample) -> float:
        base.load_state_dict({k: v.to(engine_dtype).float() for k, v in state.items()}, strict=False)
        ids = list(sample.token_ids)
        with torch.no_grad():
            logits = base(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
        logps = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)
        return float((logps - torch.tensor(sample.logprobs)).abs().mean())

    try:
        vllm_backend.update_weights(engine_weights(trained).named_parameters())
        vllm_backend.reseed(0)
        [after] = vllm_backend.generate([prompt], params)
        assert gap(merged, after) < 0.1
        assert gap(original, after) > 0.5
    finally:
        vllm_backend.update_weights(original.items())


def test_the_final_model_is_saved_merged_beside_its_adapter(tmp_path, tokenizer):
    """save_final: the adapter in final/adapter (PEFT's files), and the merged model in final: the base's stored
    fp32 weights plus scale x B @ A, what PEFT's own merge of the saved adapter gives; loadable as any model."""
    from peft import PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    base_dir = tmp_path / "base"
    tiny_policy(tokenizer, torch.float32).save_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16)  # the trainer's bf16 base
    trained = get_peft_model(model, LoraSettings(rank=RANK).peft_config())
    torch.manual_seed(2)
    for name, p in trained.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    save_final(trained, tmp_path / "final", base_path=str(base_dir), merged=True)

    final = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert all(p.dtype == torch.float32 for p in final.parameters())
    assert not (tmp_path / "final" / "adapter_config.json").exists()  # not read as an adapter directory
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                          tmp_path / "final" / "adapter").merge_and_unload()
    for name, p in reference.state_dict().items():
        torch.testing.assert_close(final.state_dict()[name], p, rtol=1e-6, atol=1e-6)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(final.state_dict()[q], AutoModelForCausalLM.from_pretrained(base_dir).state_dict()[q])

    save_final(trained, tmp_path / "adapter-only", base_path=str(base_dir), merged=False)
    assert sorted(p.name for p in (tmp_path / "adapter-only").iterdir()) == ["adapter"]


def test_lora_settings_are_checked_and_reach_peft(tmp_path):
    config = TrainConfig.from_settings(lora_rank=16, lora_target_modules=["q_proj", "v_proj"], lora_dropout=0.05)
    peft = config.lora.peft_config()
    assert (peft.r, peft.lora_alpha, peft.lora_dropout, sorted(peft.target_modules)) == (16, 32.0, 0.05,
                                                                                         ["q_proj", "v_proj"])
    assert TrainConfig.from_settings(lora_rank=4).lora.peft_config().target_modules == "all-linear"
    assert not TrainConfig().lora.enabled
    for bad, fix in ((dict(lora_rank=-1), "lora_rank must be >= 0"),
                     (dict(lora_rank=4, lora_target_modules=["lm_head"]), "may not name lm_head"),
                     (dict(lora_rank=4, lora_target_modules=["all-linear", "q_proj"]), "give it alone"),
                     (dict(lora_rank=4, lora_dropout=1.0), "lora_dropout must be in [0, 1)"),
                     (dict(lora_rank=4, lora_target_modules=[]), "at least one module")):
        with pytest.raises(ValueError, match=fix.replace("[", r"\[").replace(")", r"\)")):
            TrainConfig.from_settings(**bad)


def test_eviback_train_with_lora_checkpoints_the_adapter_resumes_and_saves_the_merged_model(tmp_path):
    """`eviback train --set lora_rank=2` as a user runs it, one step then resumed for a second: the checkpoints
    hold the adapter (megabytes), the resumed run continues from its step, and RUN/final is the merged model
    (loadable as any model) with the adapter beside it."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from eviback.policy import resolve_model

    settings = {"backend": "hf", "warm_start": False, "group_size": 2, "questions_per_step": 1, "max_turns": 1,
                "max_turn_tokens": 16, "max_obs_tokens": 48, "save_steps": 1, "mode": "grpo",
                "train_files": ["popqa_train"], "lora_rank": RANK}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def train(steps: int, *extra: str) -> subprocess.CompletedProcess:
        (tmp_path / "lora.yaml").write_text(yaml.safe_dump({**settings, "max_steps": steps}))
        return subprocess.run([sys.executable, "-m", "eviback.cli", "train", "--config", str(tmp_path / "lora.yaml"),
                               "--output", str(tmp_path / "run"), *extra], capture_output=True, text=True, env=env,
                              timeout=1500)

    first = train(1)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "LoRA rank 2" in first.stderr and "adapter parameters train" in first.stderr
    second = train(2, "--resume")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming" in second.stderr
    run = tmp_path / "run"
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    checkpoint = run / "checkpoints" / "checkpoint-2"
    assert (checkpoint / "adapter_model.safetensors").exists() and not (checkpoint / "model.safetensors").exists()
    assert sum(f.stat().st_size for f in checkpoint.iterdir()) < 50e6  # the adapter and its moments, not 1.9 GB
    assert json.loads((run / "dtype.json").read_text())["precision"] in ("float32", "bf16 frozen base + fp32 LoRA "
                                                                                    "adapter")
    final = run / "final"
    assert (final / "adapter" / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(final)  # what `eviback eval --model RUN/final` loads
    adapter = load_file(final / "adapter" / "adapter_model.safetensors")
    layer = "model.layers.3.self_attn.v_proj"
    a, b = (adapter[f"base_model.model.{layer}.lora_{x}.weight"] for x in "AB")
    base = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2-135m", "float32"), dtype=torch.float32)
    torch.testing.assert_close(merged.get_submodule(layer).weight,
                               base.get_submodule(layer).weight + (b @ a) * SCALE, rtol=1e-6, atol=1e-6)
