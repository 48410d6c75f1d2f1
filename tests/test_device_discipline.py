"""Device discipline of the GPU path, checked on a CPU: no tensor work mixes the accelerator with the host.

On a CPU every tensor lives on one device, so a CPU tensor indexing a GPU tensor, or a CPU tensor handed to
an NCCL gather, never fails here, and fails at once on a GPU. torch's FakeTensorMode raises
`FakeTensorDeviceMismatchError` for an op that mixes devices, as a GPU would. A CPU-only build of torch cannot
back fake *cuda* tensors through autograd or a transformers forward pass (its CUDA device guard is absent), so
the accelerator is played by the `meta` device: every model, input and index below lives on fake `meta`
tensors, which mix with CPU tensors exactly as CUDA tensors would (tested first).

What the GPU path does with tensors is kept apart from its data-dependent decisions (which tokens are scored,
where a row's tokens are: `update.score_plan`, made on the host from one copy of the masks), so the tensor
work after them runs here whole: the padding-free scoring (decoder, chunked LM head, forward and backward,
with and without scored tokens), the importance ratio, the trainer's gathers and DAPO's token count, the HF
engine's batch building, its sampler and stop criterion, and the weight push's staging. tests/test_rules.py
adds a rule: every tensor factory in train/ and generation/ names its device."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError, FakeTensorMode

from eviback.generation.base import staged_parameters
from eviback.generation.hf import TokenSampler, _StopOnIds, left_padded
from eviback.generation.stops import StopMatcher
from eviback.train.update import importance_ratio, padding_free_logprobs, score_plan

ACCELERATOR = "meta"


@contextlib.contextmanager
def on_accelerator():
    with FakeTensorMode(allow_non_fake_inputs=True):
        yield


def tiny_model(tied: bool):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=tied)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config)


def test_the_stand_in_accelerator_refuses_host_tensors_as_a_gpu_does():
    with on_accelerator():
        x = torch.empty(4, 8, device=ACCELERATOR)
        with pytest.raises(FakeTensorDeviceMismatchError):
            x.index_select(0, torch.arange(2, device="cpu"))
        with pytest.raises(FakeTensorDeviceMismatchError):
            torch.cat([x, torch.zeros(1, 8, device="cpu")])


def batch_layout() -> tuple[torch.Tensor, torch.Tensor, int]:
    """A generation batch as TRL lays it out: left-padded prompts, right-padded completions (C = 5)."""
    attention = torch.tensor([[0, 1, 1, 1, 1, 1, 0, 0],
                              [1, 1, 1, 1, 1, 1, 1, 1],
                              [0, 0, 1, 1, 1, 1, 1, 0]], device="cpu")
    ids = torch.arange(attention.numel(), device="cpu").view_as(attention) % 300
    return ids, attention, 5


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("scored", ["some", "none"])
def test_padding_free_scoring_runs_on_the_accelerator(tied, scored):
    """The loss pass of a micro-batch, forward and backward, on the accelerator: with scored tokens, and with
    none (on a GPU a micro-batch is one group, and a group DAPO dropped has no scored token)."""
    ids, attention, keep = batch_layout()
    score_mask = torch.ones(3, keep, dtype=torch.long, device="cpu")
    if scored == "none":
        score_mask.zero_()
    plan = score_plan(attention, keep, score_mask)  # decided on the host, from the masks' values
    model = tiny_model(tied)
    with on_accelerator():
        model.to_empty(device=ACCELERATOR)
        device_plan = plan.to(ACCELERATOR)
        out = padding_free_logprobs(model, ids.to(ACCELERATOR), device_plan, temperature=0.7, chunk_tokens=2)
        assert out.logps.device.type == ACCELERATOR and tuple(out.logps.shape) == (3, keep)
        out.logps.sum().backward()
        assert model.get_output_embeddings().weight.grad.device.type == ACCELERATOR
    assert out.scored_tokens == (0 if scored == "none" else plan.tokens) and (scored == "none") == (plan.tokens == 0)


def test_the_plans_indices_follow_the_masks_device():
    ids, attention, keep = batch_layout()
    empty = score_plan(attention, keep, torch.zeros(3, keep, dtype=torch.long, device="cpu"))
    assert empty.tokens == 0 and empty.hidden_index.device == attention.device
    with on_accelerator():
        moved = empty.to(ACCELERATOR)
        assert {t.device.type for t in (moved.hidden_index, moved.target_column, moved.out_index)} == {ACCELERATOR}


def test_the_importance_ratio_runs_on_the_accelerator():
    with on_accelerator():
        old = torch.zeros(2, 4, device=ACCELERATOR)
        sampling = torch.zeros(2, 4, device=ACCELERATOR)
        mask = torch.ones(2, 4, device=ACCELERATOR)
        ratio, stats = importance_ratio(old, sampling, mask, mode="token_truncate", cap=2.0)
        assert ratio.device.type == ACCELERATOR and stats.device.type == "cpu"  # its figures go to the host


class Processes:
    """accelerate's Accelerator as the trainer uses it, with the stand-in accelerator as the process's device:
    `gather` is a collective that, like NCCL, takes only tensors on that device (and answers with a host
    tensor, so that the figures read from it can be read here)."""

    device = torch.device(ACCELERATOR)
    num_processes = 2

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        assert tensor.device == self.device, f"a collective was handed a tensor on {tensor.device}"
        return torch.ones(2 * max(1, tensor.numel()), device="cpu")


def test_the_trainers_gathers_take_tensors_on_the_accelerator():
    """The clipped-ratio figure and DAPO's token count go through collectives: each tensor is made on the
    process's device (a CPU tensor handed to NCCL fails at step 1 of a multi-GPU run)."""
    from eviback.backoff import GroupAdvantages, GroupKind
    from eviback.train.grpo import EviBackTrainer
    from eviback.types import StopReason

    trajectories = [SimpleNamespace(stop_reason=StopReason.LENGTH), SimpleNamespace(stop_reason=StopReason.ANSWERED)]
    trainer = SimpleNamespace(accelerator=Processes(), num_generations=2,
                              _metrics={"train": {"completions/clipped_ratio": [1.0]}})
    EviBackTrainer._fix_clipped_ratio(trainer, SimpleNamespace(trajectories=trajectories))
    assert trainer._metrics["train"]["completions/clipped_ratio"] == [1.0]
    outcomes = (GroupAdvantages(GroupKind.DROPPED, em=(0.0, 0.0), rewards=(0.0, 0.0), advantages=(0.0, 0.0),
                                keep=False),)
    trainer._generation = SimpleNamespace(outcomes=outcomes)
    output = {"completion_mask": torch.ones(2, 3, device=ACCELERATOR)}
    EviBackTrainer._drop_groups(trainer, output)
    assert output["tool_mask"].device.type == ACCELERATOR


def test_the_hf_engines_batch_sampler_and_stops_run_on_the_accelerator():
    matcher = StopMatcher(["a", "<", "/", "s", ">"], ("</s>",))
    with on_accelerator():
        ids, attention = left_padded([[1, 2, 3], [4]], pad_id=0, device=ACCELERATOR)
        assert ids.device.type == attention.device.type == ACCELERATOR and tuple(ids.shape) == (2, 3)
        scores = torch.zeros(2, 5, device=ACCELERATOR)
        for sampler in (TokenSampler(temperature=0.8, top_p=0.9), TokenSampler()):
            out = sampler(ids, scores)
            assert out.device.type == ACCELERATOR and sampler.logprobs(2, ids.device).device.type == ACCELERATOR
        stop = _StopOnIds(matcher.device_table(ACCELERATOR), matcher.matched)
        done = stop(torch.cat([ids, ids[:, :1]], dim=1), scores)
        assert done.device.type == ACCELERATOR


def test_the_weight_push_stages_each_tensor_on_the_trainers_device():
    """A policy loaded on the host and pushed before the trainer moved it (the policy server's first push)
    is sent tensor by tensor from the trainer's GPU, as NCCL needs."""
    model = tiny_model(tied=True)
    with on_accelerator():
        staged = list(staged_parameters(model, ACCELERATOR))
    assert [name for name, _ in staged] == [name for name, _ in model.named_parameters()]
    assert {t.device.type for _, t in staged} == {ACCELERATOR} and not any(t.requires_grad for _, t in staged)
