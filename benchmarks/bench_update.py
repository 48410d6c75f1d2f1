"""Where a GRPO step's update goes, TRL's path (plain) vs eviback's fast path, on the same batch.

The batch is one real training step of a recorded run: the rollouts of `--groups` (a run's groups.jsonl, e.g.
results/experiment/eviback, 2 questions x G = 4) are re-tokenised as the rollout engine builds them (the chat
prompt, then each turn's model text and its observation, observations capped at `--max-obs-tokens` and
masked from the loss). The trainer is eviback's `EviBackTrainer` (TRL's GRPOTrainer) set up as
`eviback train` sets it up: bf16 policy with fp32 master weights and AdamW, a bf16 reference model, one
micro-batch per question (per_device_train_batch_size = G, gradient_accumulation_steps = questions per
step), KL beta, DAPO token-mean loss. Weights: the base SmolLM2 (`--model`); the update's cost depends on
the shapes, not on the weights.

Variants: `plain` (TRL's own path), `fast` (eviback's, rows of similar length batched with at most 20%
padding), `fast_per_row` (every row alone), and `plain_1thread` / `fast_1thread` with one torch thread: on
a CPU shared with other busy processes, two OpenMP threads spend most of each small kernel waiting for each
other, which penalises the path with more (smaller) kernels. One update = what TRL does after the rollouts:
the policy's "old" log-probabilities of the whole batch for the behaviour correction (no grad; the fast
variants take them from the loss pass instead, `ScoringSettings.defer_old_pass`), the reference model's
log-probabilities of the whole batch (no grad), then per micro-batch the policy's forward (log-probs, loss) and backward, then gradient clipping
and the optimiser step. Plain and fast repetitions alternate; the bf16 matmul peak (2048 x 2048) is measured
before each pair. FLOPs count what each variant runs (:func:`flops_run`): 2 x decoder parameters per token
through the decoder and 2 x LM-head parameters per position through the LM head, for a forward; three
times that for a forward with its backward; the decoder's tokens include the padding each path runs (TRL's
full-width batches; the fast path's length buckets), and the LM head runs on every position TRL keeps but
only on the scored positions in the fast path. The old-log-prob pass counts where it runs (TRL's path).
roofline share = FLOPs / (seconds x peak). The useful FLOPs, the same for every variant, count the real
tokens through the decoder and the scored positions through the LM head, once per reference pass and once
per trained pass: padding and positions nobody scores are work a path does, not work the update needs.

`--recount FILE` recomputes the FLOPs and roofline shares of a written JSON (its batch is rebuilt from the
recorded groups and step; no model is run) into FILE_recounted.json.

It also checks, before timing, that the fast path gives the plain path's loss and gradients on this batch.

    python benchmarks/bench_update.py --groups results/experiment/eviback/groups.jsonl --out results/update
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from eviback.train.scoring import ScoringSettings

log = logging.getLogger("bench_update")


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def rss_gb() -> float:
    return psutil.Process().memory_info().rss / 1e9


def trim() -> None:
    """Give freed heap back to the OS, so that each phase's peak is its own."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class PeakRss:
    """Samples this process's RSS every `every` seconds while active; `.peak` is the max seen (GB)."""

    def __init__(self, every: float = 0.02) -> None:
        self.every, self.peak, self._stop = every, 0.0, threading.Event()

    def __enter__(self) -> PeakRss:
        self.peak = rss_gb()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.peak = max(self.peak, rss_gb())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_gb())


def bf16_peak_gflops(n: int = 2048, reps: int = 10) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16)
    b = torch.randn(n, n, dtype=torch.bfloat16)
    for _ in range(2):
        a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n ** 3 * reps / (time.perf_counter() - t) / 1e9


# --------------------------------------------------------------------------------------------------
# The batch


@dataclass(frozen=True)
class Row:
    prompt: list[int]
    completion: list[int]
    tool_mask: list[int]  # 1 model token, 0 observation
    advantage: float


def rows_from_groups(path: Path, step: int | None, tokenizer, max_obs_tokens: int) -> tuple[int, list[Row]]:
    """One step's rollouts as token rows (the step with the median token count when `step` is None)."""
    from eviback.protocol import apply_chat_template

    steps: dict[int, list[dict]] = {}
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            steps.setdefault(record["step"], []).append(record)

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def rows(records: list[dict]) -> list[Row]:
        out = []
        for group in records:
            prompt = encode(apply_chat_template(tokenizer, group["question"]))
            for rollout, advantage in zip(group["rollouts"], group["advantages"], strict=True):
                ids, mask = [], []
                for turn in rollout["turns"]:
                    text = encode(turn["text"])
                    obs = encode(turn.get("observation") or "")[:max_obs_tokens]
                    ids += text + obs
                    mask += [1] * len(text) + [0] * len(obs)
                out.append(Row(prompt, ids, mask, float(advantage)))
        return out

    if step is None:
        sizes = {s: sum(len(r.prompt) + len(r.completion) for r in rows(recs)) for s, recs in steps.items()}
        ordered = sorted(sizes, key=sizes.get)
        step = ordered[len(ordered) // 2]
    return step, rows(steps[step])


def generation_batch(rows: list[Row], pad: int) -> dict[str, torch.Tensor]:
    """The tensors TRL's `_generate_and_score_completions` builds: prompts left-padded, completions and
    their masks right-padded (tool mask padded with 1, as TRL does)."""
    p_len = max(len(r.prompt) for r in rows)
    c_len = max(len(r.completion) for r in rows)
    n = len(rows)
    prompt_ids = torch.full((n, p_len), pad)
    prompt_mask = torch.zeros(n, p_len, dtype=torch.long)
    completion_ids = torch.full((n, c_len), pad)
    completion_mask = torch.zeros(n, c_len, dtype=torch.long)
    tool_mask = torch.ones(n, c_len, dtype=torch.long)
    for b, r in enumerate(rows):
        prompt_ids[b, p_len - len(r.prompt):] = torch.tensor(r.prompt)
        prompt_mask[b, p_len - len(r.prompt):] = 1
        completion_ids[b, :len(r.completion)] = torch.tensor(r.completion)
        completion_mask[b, :len(r.completion)] = 1
        tool_mask[b, :len(r.completion)] = torch.tensor(r.tool_mask)
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "tool_mask": tool_mask,
            "advantages": torch.tensor([r.advantage for r in rows]),
            "num_items_in_batch": (completion_mask * tool_mask).sum()}


def head_parameters(model_path: str | Path) -> tuple[int, bool]:
    """(vocabulary x hidden size, whether the input embeddings are tied to the LM head), from the config."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    return config.vocab_size * config.hidden_size, bool(getattr(config, "tie_word_embeddings", False))


def flops_run(batch: dict[str, torch.Tensor], parameters: int, head: int, tied: bool, *, fast: bool,
              old_pass: bool, parts: int, seed: int, max_padding: float = 0.2, token_budget: int = 16384) -> dict:
    """The FLOPs of one update as the variant runs it (see the module doc). `parameters`: the model's
    parameter count; `head`: its LM head's (vocabulary x hidden); the input embedding (a lookup) costs
    nothing. Returns the FLOPs and the tokens and positions they were counted on."""
    from eviback.train.update import length_buckets, score_plan

    decoder = parameters - head * (1 if tied else 2)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    keep = batch["completion_ids"].shape[1]
    score = batch["completion_mask"] * batch["tool_mask"]

    def one_pass(rows: torch.Tensor) -> tuple[int, int]:
        """(tokens through the decoder, positions through the LM head) of one pass over `rows`."""
        if not fast:  # TRL: full-width rows; the head on the last `keep + 1` positions of each
            return int(rows.numel()) * ids.shape[1], int(rows.numel()) * (keep + 1)
        plan = score_plan(attention[rows], keep, score[rows])
        lengths = [end - start for _, start, end in plan.rows]
        buckets = length_buckets(lengths, token_budget=token_budget, max_padding=max_padding)
        return sum(lengths[b[0]] * len(b) for b in buckets), plan.tokens

    everything = torch.arange(ids.shape[0])
    no_grad = [one_pass(everything)] * (2 if old_pass else 1)  # reference (and TRL's old log-probs)
    n = ids.shape[0]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))  # as micro_batches() splits
    trained = [one_pass(order[i * (n // parts):(i + 1) * (n // parts)]) for i in range(parts)]
    flops = sum(2 * (decoder * t + head * h) for t, h in no_grad) + sum(6 * (decoder * t + head * h)
                                                                          for t, h in trained)
    # the work every variant must do: real tokens through the decoder, scored positions through the head
    real, scored = int(attention.sum()), score_plan(attention, keep, score).tokens
    useful = 8 * (decoder * real + head * scored)
    return {"flops": flops, "flops_useful": useful, "decoder_tokens_no_grad": sum(t for t, _ in no_grad),
            "head_positions_no_grad": sum(h for _, h in no_grad),
            "decoder_tokens_trained": sum(t for t, _ in trained), "head_positions_trained": sum(h for _, h in trained)}


# --------------------------------------------------------------------------------------------------
# The trainer and one update


def build_trainer(args: argparse.Namespace, out: Path, group_size: int, questions_per_step: int):
    from trl import GRPOConfig

    from eviback.backoff import BackoffConfig
    from eviback.policy import load_tokenizer, resolve_model
    from eviback.train.grpo import EviBackTrainer, training_dataset
    from eviback.train.precision import MasterWeightAdamW
    from eviback.train.runner import Precision, load_policy_for_training
    from eviback.types import Question

    path = resolve_model(args.model, "float32")
    tokenizer = load_tokenizer(path)
    model, master = load_policy_for_training(path, Precision.MASTERS, None)
    optimizer = MasterWeightAdamW(model, master, lr=args.lr, weight_decay=0.0)
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench_update_"), per_device_train_batch_size=group_size,
        gradient_accumulation_steps=questions_per_step, num_generations=group_size, max_steps=1,
        learning_rate=args.lr, lr_scheduler_type="constant", beta=args.beta, loss_type="dapo",
        temperature=args.temperature, max_completion_length=args.max_completion_length, use_cpu=True,
        bf16=False, fp16=False, remove_unused_columns=False, report_to="none", save_strategy="no",
        disable_tqdm=True,
    )
    questions = [Question(f"q{i}", "q", ("a",)) for i in range(questions_per_step)]
    trainer = EviBackTrainer(
        engine=None, questions={}, backoff=BackoffConfig(), judge_groups=None, on_step=lambda _: None,
        push_weights=False, master=master, model=model, args=config, train_dataset=training_dataset(questions),
        processing_class=tokenizer, optimizers=(optimizer, None),
    )
    trainer.current_gradient_accumulation_steps = questions_per_step
    model.train()
    return trainer, model, optimizer, tokenizer


def micro_batches(batch: dict[str, torch.Tensor], parts: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """TRL's shuffle of the generation batch, then its split into `parts` micro-batches."""
    n = batch["advantages"].shape[0]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    size = n // parts
    out = []
    for i in range(parts):
        idx = order[i * size:(i + 1) * size]
        out.append({k: (v if v.dim() == 0 else v[idx]) for k, v in batch.items()})
    return out


def reference_logps(trainer, batch: dict[str, torch.Tensor], rollout_masks: list[list[int]]) -> torch.Tensor:
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    trainer._fast_rollout_masks = rollout_masks  # what `_generate` leaves for the no-grad passes
    with torch.no_grad():
        ref, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.ref_model, ids, attention, batch["completion_ids"].shape[1],
            batch_size=trainer.args.per_device_train_batch_size)
    return ref


def behaviour_correction(trainer, batch: dict[str, torch.Tensor], rollout_masks: list[list[int]]) -> dict:
    """The importance-ratio inputs of the loss, as `eviback train` sets the correction up: TRL's way (one
    more no-grad pass of the policy for the old log-probs, `trainer.scoring.defer_old_pass` False) or eviback's
    (deferred to the loss pass). The engine's log-probs are not in the recorded groups: the batch carries
    zeros, which changes the ratio's values, not the cost."""
    from eviback.train.update import importance_ratio

    sampling = torch.zeros(batch["completion_ids"].shape, dtype=torch.float32)
    if trainer.scoring.defer_old_pass:
        return {"sampling_per_token_logps": sampling,
                "deferred_is": torch.ones(batch["completion_ids"].shape[0], dtype=torch.bool)}
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    trainer._scoring_state.rollout_masks = rollout_masks
    with torch.no_grad():
        old, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, attention, batch["completion_ids"].shape[1],
            batch_size=trainer.args.per_device_train_batch_size)
    mask = batch["completion_mask"] * batch["tool_mask"]
    ratio, _ = importance_ratio(old, sampling, mask, cap=2.0)
    return {"sampling_per_token_logps": sampling, "old_per_token_logps": old, "importance_sampling_ratio": ratio}


VARIANTS = {  # name: (fast path, its max padding share per decoder batch, torch threads or None: the default)
    "plain": (False, 0.0, None),
    "fast": (True, 0.2, None),
    "fast_per_row": (True, 0.0, None),
    "plain_1thread": (False, 0.0, 1),
    "fast_1thread": (True, 0.2, 1),
}


def one_update(trainer, model, optimizer, batch, rollout_masks, parts: int, variant: str, seed: int) -> dict:
    """One update; returns its phases' seconds and the sampled peak RSS (GB) above the start."""
    fast, max_padding, threads = VARIANTS[variant]
    # the fast path skips TRL's old-log-prob pass too
    trainer.scoring = ScoringSettings(padding_free=fast, defer_old_pass=fast, max_padding=max_padding)
    default_threads = torch.get_num_threads()
    torch.set_num_threads(threads or default_threads)
    try:
        return _timed_update(trainer, model, optimizer, batch, rollout_masks, parts, seed)
    finally:
        torch.set_num_threads(default_threads)


def _timed_update(trainer, model, optimizer, batch, rollout_masks, parts: int, seed: int) -> dict:
    gc_before = rss_gb()
    times: dict[str, float] = {"old_logps_s": 0.0, "reference_s": 0.0, "policy_forward_s": 0.0, "backward_s": 0.0,
                               "optimizer_s": 0.0}
    with PeakRss() as peak:
        t0 = time.perf_counter()
        correction = behaviour_correction(trainer, batch, rollout_masks)
        times["old_logps_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        ref = reference_logps(trainer, batch, rollout_masks)
        times["reference_s"] = time.perf_counter() - t0
        full = dict(batch, ref_per_token_logps=ref, **correction)
        losses = []
        for mb in micro_batches(full, parts, seed):
            t0 = time.perf_counter()
            loss = trainer._compute_loss(model, mb)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            times["policy_forward_s"] += t1 - t0
            times["backward_s"] += t2 - t1
            losses.append(float(loss.detach()))
        t0 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), trainer.args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times["optimizer_s"] = time.perf_counter() - t0
    times["update_s"] = sum(times.values())
    times["peak_rss_above_start_gb"] = round(peak.peak - gc_before, 3)
    times["loss"] = sum(losses)
    return times


def loss_and_grads(trainer, model, ref_model, batch, rollout_masks, parts: int, fast: bool, seed: int):
    """(loss, flat fp64 gradient, reference log-probs at the loss mask) of one update's passes, no step."""
    trainer.scoring = ScoringSettings() if fast else ScoringSettings.trl()
    saved, saved_model, trainer.ref_model, trainer.model = trainer.ref_model, trainer.model, ref_model, model
    try:
        correction = behaviour_correction(trainer, batch, rollout_masks)
        ref = reference_logps(trainer, batch, rollout_masks)
        full = dict(batch, ref_per_token_logps=ref, **correction)
        model.zero_grad(set_to_none=True)
        loss = 0.0
        for mb in micro_batches(full, parts, seed):
            step_loss = trainer._compute_loss(model, mb)
            step_loss.backward()
            loss += float(step_loss.detach())
    finally:
        trainer.ref_model, trainer.model = saved, saved_model
    grads = torch.cat([p.grad.double().flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    mask = (batch["completion_mask"] * batch["tool_mask"]).bool()
    return loss, grads, ref[mask].double()


def accuracy_check(trainer, model, batch, rollout_masks, parts: int) -> dict:
    """Plain and fast (both bf16) against an fp32 reference: the fast path on fp32 copies of the policy and
    the reference model (its math is exact in fp32, tests/test_train_update.py). The policy is first moved
    off the reference (as after a few updates) so that the KL term is not zero."""
    import copy

    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.add_(1e-2 * p.abs().mean() * torch.randn(p.shape, generator=generator).to(p.dtype))
    runs = {"plain": loss_and_grads(trainer, model, trainer.ref_model, batch, rollout_masks, parts, False, 0),
            "fast": loss_and_grads(trainer, model, trainer.ref_model, batch, rollout_masks, parts, True, 0)}
    model32, ref32 = copy.deepcopy(model).float(), copy.deepcopy(trainer.ref_model).float()
    runs["fp32"] = loss_and_grads(trainer, model32, ref32, batch, rollout_masks, parts, True, 0)
    del model32, ref32
    out: dict = {"loss": {k: v[0] for k, v in runs.items()}}
    truth = runs["fp32"]
    for name in ("plain", "fast"):
        loss, grads, ref = runs[name]
        out[f"{name}_vs_fp32"] = {
            "loss_abs_diff": abs(loss - truth[0]),
            "grad_rel_diff": float((grads - truth[1]).norm() / truth[1].norm()),
            "grad_cosine": float(torch.nn.functional.cosine_similarity(grads, truth[1], dim=0)),
            "ref_logp_mean_abs_diff": float((ref - truth[2]).abs().mean()),
            "ref_logp_max_abs_diff": float((ref - truth[2]).abs().max()),
        }
    plain, fast = runs["plain"], runs["fast"]
    out["fast_vs_plain"] = {"grad_rel_diff": float((fast[1] - plain[1]).norm() / plain[1].norm()),
                            "ref_logp_mean_abs_diff": float((fast[2] - plain[2]).abs().mean())}
    return out


def head_microbench(trainer, model, batch, reps: int) -> dict:
    """The LM head alone (forward + backward) on this batch's final hidden states: TRL's fused head over every
    position of a padded micro-batch vs eviback's chunked head over the scored positions."""
    from trl.kernels import ChunkedLogProbFunction

    from eviback.train.update import score_plan, token_logprobs

    n_rows = trainer.args.per_device_train_batch_size
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)[:n_rows]
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)[:n_rows]
    keep = batch["completion_ids"].shape[1]
    with torch.no_grad():
        hidden = model.base_model(input_ids=ids, attention_mask=attention, use_cache=False).last_hidden_state
    weight = model.get_output_embeddings().weight.detach().clone().requires_grad_(True)
    labels = ids.masked_fill(attention == 0, -100)
    labels[:, :-keep] = -100
    labels = labels[:, 1:]
    all_h = hidden[:, :-1].reshape(-1, hidden.shape[-1]).detach().requires_grad_(True)
    mask = (batch["completion_mask"] * batch["tool_mask"])[:n_rows]
    plan = score_plan(attention, keep, mask)
    scored_h = hidden.reshape(-1, hidden.shape[-1])[(plan.out_index // keep) * ids.shape[1] + plan.target_column - 1]
    scored_h = scored_h.detach().requires_grad_(True)
    target = ids.flatten()[(plan.out_index // keep) * ids.shape[1] + plan.target_column]
    out = {"plain_positions": int(all_h.shape[0]), "fast_positions": int(scored_h.shape[0])}
    for name, fn in (
        ("plain", lambda: ChunkedLogProbFunction.apply(all_h, weight, None, labels.clamp(min=0).reshape(-1),
                                                       trainer.temperature, 32768, None, 1.0,
                                                       ("log_probs", "entropy"))[0]),
        ("fast", lambda: token_logprobs(scored_h, weight, target, temperature=trainer.temperature)[0]),
    ):
        seconds = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn().sum().backward()
            seconds.append(time.perf_counter() - t0)
            all_h.grad = scored_h.grad = weight.grad = None
        out[f"{name}_s"] = statistics.median(seconds)
    return out


def variant_flops(batch: dict[str, torch.Tensor], parameters: int, head: int, tied: bool, variant: str,
                  parts: int, seed: int) -> dict:
    fast, max_padding, _ = VARIANTS[variant]
    return flops_run(batch, parameters, head, tied, fast=fast, old_pass=not fast, parts=parts, seed=seed,
                     max_padding=max_padding)


def recount(path: Path, model: str, max_obs_tokens: int) -> Path:
    """FLOPs and roofline shares of a written JSON, counted as the variants run (its batch rebuilt from the
    recorded groups and step; the old-log-prob pass counted where the JSON timed one, or, in a JSON from
    before that pass was timed, not at all). Written beside it as <name>_recounted.json."""
    from eviback.policy import load_tokenizer, resolve_model

    result = json.loads(path.read_text())
    shape = result["batch"]
    model_path = resolve_model(model, "float32")
    tokenizer = load_tokenizer(model_path)
    step, rows = rows_from_groups(Path(shape["groups"]), shape["step"], tokenizer, max_obs_tokens)
    assert step == shape["step"] and sum(len(r.prompt) + len(r.completion) for r in rows) == shape["real_tokens"]
    batch = generation_batch(rows, tokenizer.pad_token_id)
    head, tied = head_parameters(model_path)
    params, parts = shape["parameters"], shape["questions_per_step"]
    recounted = {"source": str(path), "flops_as_written": shape["flops"], "reps": []}
    for i, rep in enumerate(result.get("reps", [])):
        out = {}
        for variant in VARIANTS:
            if variant not in rep:
                continue
            times = rep[variant]
            fast = VARIANTS[variant][0]
            old_pass = not fast and times.get("old_logps_s", 0.0) > 0.001
            count = flops_run(batch, params, head, tied, fast=fast, old_pass=old_pass, parts=parts, seed=i,
                              max_padding=VARIANTS[variant][1])
            gflops = count["flops"] / times["update_s"] / 1e9
            out[variant] = count | {"old_pass_counted": old_pass, "update_s": times["update_s"], "gflops": gflops,
                                    "roofline_share": gflops / rep["bf16_peak_gflops"],
                                    "useful_roofline_share": count["flops_useful"] / times["update_s"] / 1e9
                                    / rep["bf16_peak_gflops"],
                                    "roofline_share_as_written": times["roofline_share"]}
        recounted["reps"].append(out)
    target = path.with_name(path.stem + "_recounted.json")
    target.write_text(json.dumps(recounted, indent=1))
    print(json.dumps(recounted, indent=1))
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=Path, default=Path("results/experiment/eviback/groups.jsonl"))
    parser.add_argument("--step", type=int, default=None, help="the recorded step to use (default: median size)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--reps", type=int, default=3, help="plain/fast pairs")
    parser.add_argument("--beta", type=float, default=0.001)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=2e-6)
    parser.add_argument("--max-obs-tokens", type=int, default=300)
    parser.add_argument("--max-completion-length", type=int, default=1592)
    parser.add_argument("--parts", default="check,head,timing",
                        help="comma-separated: check (plain/fast/fp32 losses and gradients), head (LM head alone), "
                             "timing (plain/fast update pairs)")
    parser.add_argument("--variants", default="plain,fast,plain_1thread,fast_1thread",
                        help=f"update variants per repetition, plain first ({', '.join(VARIANTS)})")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=Path("results/update"))
    parser.add_argument("--recount", type=Path, default=None,
                        help="recompute the FLOPs and roofline shares of this written JSON, run nothing else")
    args = parser.parse_args(argv)
    if args.recount is not None:
        recount(args.recount, args.model, args.max_obs_tokens)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    random.seed(0)

    config = json.loads(json.dumps(__import__("yaml").safe_load((args.groups.parent / "config.yaml").read_text())))
    group_size, questions_per_step = config["group_size"], config["questions_per_step"]
    trainer, model, optimizer, tokenizer = build_trainer(args, args.out, group_size, questions_per_step)
    from eviback.policy import resolve_model

    step, rows = rows_from_groups(args.groups, args.step, tokenizer, args.max_obs_tokens)
    batch = generation_batch(rows, tokenizer.pad_token_id)
    rollout_masks = [r.tool_mask for r in rows]
    params = sum(p.numel() for p in model.parameters())
    real = sum(len(r.prompt) + len(r.completion) for r in rows)
    padded_full = batch["prompt_ids"].numel() + batch["completion_ids"].numel()
    model_tokens = sum(sum(r.tool_mask) for r in rows)
    head, tied = head_parameters(resolve_model(args.model, "float32"))
    shape = {
        "groups": str(args.groups), "step": step, "rows": len(rows), "group_size": group_size,
        "questions_per_step": questions_per_step, "parameters": params,
        "prompt_tokens": sum(len(r.prompt) for r in rows),
        "completion_tokens": sum(len(r.completion) for r in rows),
        "model_tokens": model_tokens, "observation_tokens": sum(len(r.completion) for r in rows) - model_tokens,
        "real_tokens": real, "padded_tokens_per_pass": padded_full,
        "padding_share_plain": round(1 - real / padded_full, 4),
        "positions_through_lm_head_plain": len(rows) * (padded_full // len(rows) - 1),
        "positions_through_lm_head_fast": model_tokens,
        "lm_head_parameters": head, "tied_embeddings": tied,
        # what each variant runs, for the micro-batch split of repetition 0 (see flops_run)
        "flops_plain": variant_flops(batch, params, head, tied, "plain", questions_per_step, 0)["flops"],
        "flops_fast": variant_flops(batch, params, head, tied, "fast", questions_per_step, 0)["flops"],
    }
    log.info("batch: %s", shape)
    result: dict = {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
                    "batch": shape, "torch_threads": torch.get_num_threads()}

    parts = set(args.parts.split(","))
    if "check" in parts:
        trim()
        result["check"] = accuracy_check(trainer, model, batch, rollout_masks, questions_per_step)
        result["check"]["load"] = load_avg()
        log.info("check: %s", result["check"])
        trim()

    if "head" in parts:
        result["head"] = head_microbench(trainer, model, batch, reps=2)
        result["head"]["load"] = load_avg()
        log.info("head: %s", result["head"])
    if "timing" not in parts:
        (args.out / "bench_update_check.json").write_text(json.dumps(result, indent=1))
        return 0

    reps = []
    for i in range(args.reps):
        pair = {"bf16_peak_gflops": bf16_peak_gflops(), "load_before": load_avg()}
        torch.set_num_threads(1)
        pair["bf16_peak_gflops_1thread"] = bf16_peak_gflops()
        torch.set_num_threads(result["torch_threads"])
        for variant in args.variants.split(","):
            trim()
            times = one_update(trainer, model, optimizer, batch, rollout_masks, questions_per_step, variant, seed=i)
            times["load"] = load_avg()
            times |= variant_flops(batch, params, head, tied, variant, questions_per_step, i)
            times["gflops"] = times["flops"] / times["update_s"] / 1e9
            times["roofline_share"] = times["gflops"] / pair["bf16_peak_gflops"]
            times["useful_roofline_share"] = times["flops_useful"] / times["update_s"] / 1e9 / pair["bf16_peak_gflops"]
            pair[variant] = times
            log.info("rep %d %s: %s", i, variant, times)
        pair["bf16_peak_gflops_after"] = bf16_peak_gflops()
        for variant in args.variants.split(",")[1:]:
            pair[f"speedup_{variant}"] = pair["plain"]["update_s"] / pair[variant]["update_s"]
        reps.append(pair)
        (args.out / "bench_update.json").write_text(json.dumps(result | {"reps": reps}, indent=1))
    result["reps"] = reps

    def med(path: tuple[str, ...]) -> float:
        values = []
        for r in reps:
            v = r
            for k in path:
                v = v[k]
            values.append(v)
        return statistics.median(values)

    peak = statistics.median([(r["bf16_peak_gflops"] + r["bf16_peak_gflops_after"]) / 2 for r in reps])
    variants = args.variants.split(",")
    summary = {f"speedup_{v}_median": med((f"speedup_{v}",)) for v in variants[1:]}
    summary["bf16_peak_gflops_median"] = peak
    for mode in variants:
        for key in ("update_s", "old_logps_s", "reference_s", "policy_forward_s", "backward_s", "optimizer_s", "roofline_share",
                    "peak_rss_above_start_gb"):
            summary[f"{mode}_{key}_median"] = med((mode, key))
    result["summary"] = summary
    (args.out / "bench_update.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
