"""Padding-free scoring under DistributedDataParallel (several GPUs or processes): it runs through the DDP
wrapper, so each process's backward pass all-reduces the gradients as TRL's own path does, instead of leaving
every process with its own (or, as before, silently switching to TRL's full-logits path). Two processes on
the CPU (gloo), each scoring its own batch: their gradients must be equal, and equal to the mean of the
gradients each batch gives on its own."""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# only torch and the update's own module in the processes (TRL takes seconds to import)
from eviback.train.update import call_through_wrapper, padding_free_logprobs, score_plan


def tiny_model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config)


def rank_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    generator = torch.Generator().manual_seed(100 + rank)
    attention = torch.ones(2, 9, dtype=torch.long)
    attention[0, :rank + 1] = 0  # left padding differs by rank
    ids = torch.randint(0, 200, (2, 9), generator=generator)
    return ids, attention, 4


def scored_gradients(model, rank: int, wrapper=None) -> torch.Tensor:
    ids, attention, keep = rank_batch(rank)
    plan = score_plan(attention, keep)

    def score():
        out = padding_free_logprobs(model, ids, plan, temperature=0.9)
        return out.logps, out.entropy

    logps, _ = score() if wrapper is None else call_through_wrapper(wrapper, model, score)
    logps.sum().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _worker(rank: int, world: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = tiny_model()
        wrapper = torch.nn.parallel.DistributedDataParallel(model)
        # a plain list: a tensor in a queue is shared through the sending process, which exits right after
        results.put((rank, scored_gradients(model, rank, wrapper).tolist()))
    finally:
        dist.destroy_process_group()


def test_padding_free_scoring_all_reduces_under_ddp():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_worker, args=(rank, 2, port, results)) for rank in range(2)]
    for p in processes:
        p.start()
    got = {rank: torch.tensor(grads) for rank, grads in (results.get(timeout=300) for _ in processes)}
    for p in processes:
        p.join(timeout=60)
        assert p.exitcode == 0
    expected = (scored_gradients(tiny_model(), 0) + scored_gradients(tiny_model(), 1)) / 2
    alone = scored_gradients(tiny_model(), 0)
    torch.testing.assert_close(got[0], got[1])
    torch.testing.assert_close(got[0], expected, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(alone, expected)  # the ranks' batches differ: the all-reduce is what made them equal


def test_the_padding_free_path_applies_to_a_ddp_wrapped_model():
    """The trainer takes the padding-free path for a model in a DDP wrapper (it used to switch to TRL's
    full-logits path there), and still leaves other wrappers (DeepSpeed's engine) to TRL."""
    from eviback.train.scoring import FastScoring, ScoringSettings

    model = tiny_model()
    wrapper = torch.nn.parallel.DistributedDataParallel.__new__(torch.nn.parallel.DistributedDataParallel)
    torch.nn.Module.__init__(wrapper)
    wrapper.module = model  # a DDP wrapper as the trainer sees it (no process group is needed to ask)
    other = torch.nn.Module()
    other.module = model
    trainer = SimpleNamespace(scoring=ScoringSettings(), accelerator=SimpleNamespace(unwrap_model=lambda m: getattr(m, "module", m)))
    assert FastScoring._padding_free_applies(trainer, wrapper, False, False, {})
    assert FastScoring._padding_free_applies(trainer, model, False, False, {})
    assert not FastScoring._padding_free_applies(trainer, other, False, False, {})
