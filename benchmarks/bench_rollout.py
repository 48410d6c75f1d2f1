"""Rollout engine benchmarks: backends, batching, multi-turn cost.

Parts (all on the same questions, the first `--questions` of one benchmark, `--group-size` rollouts each):

- `engines`: the batched engine on vLLM vs on HF `generate`, sampling at temperature 1 (training's setting):
  trajectories/s and generated tokens/s.
- `batching`: on vLLM, greedy, the batched engine (all questions x G at once) vs a one-trajectory-at-a-time
  loop over the same engine; the loop runs on the first `--sequential-questions` questions (x G) and its
  rate is per trajectory, so the ratio compares like with like; the trajectories of the two are compared
  token for token on those questions.
- `multiturn`: (a) the cost of turns 2 and 3 relative to turn 1 at an equal number of generated tokens:
  every sequence generates exactly `--turn-tokens` tokens per turn (no stop), then gets real retrieved
  passages as the observation (a different three each turn), and the next turn continues from the whole
  history; each later turn is also timed from its observation alone (same new tokens, no history), which
  isolates what the history costs; HF `generate` on the same turns is the contrast; (b) the engine's
  generated tokens/s (from `engines`) vs the backend's raw single-turn throughput on the same batch
  (the questions x G prompts, one `generate` call with the engine's turn settings).

Speeds are ratios measured within one process, one after the other; on a shared machine absolute figures
move with the load, so each part records the load average next to its numbers.

    python benchmarks/bench_rollout.py --data DATA_SUITE_DIR --out results/bench_rollout.json
    python benchmarks/bench_rollout.py --data DIR --parts multiturn --questions 64
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

from eviback.data import load_suite, read_questions
from eviback.generation import BackendConfig, load_backend
from eviback.generation.base import SamplingConfig
from eviback.generation.hf import HFBackend
from eviback.generation.vllm import VllmConfig, get_vllm_backend
from eviback.protocol import render_observation
from eviback.rollout import RolloutBatch, RolloutConfig, RolloutEngine

log = logging.getLogger("bench_rollout")


def load_avg() -> float:
    return round(os.getloadavg()[0], 2)


def batch_figures(batch: RolloutBatch) -> dict:
    n = len(batch.trajectories)
    return {
        "trajectories": n,
        "wall_s": round(batch.wall_s, 2),
        "generated_tokens": batch.generated_tokens,
        "trajectories_per_s": round(n / batch.wall_s, 4),
        "generated_tokens_per_s": round(batch.generated_tokens / batch.wall_s, 2),
        "generate_s": round(batch.generate_s, 2),
        "retrieve_s": round(batch.retrieve_s, 3),
        "turns": [dataclasses.asdict(t) for t in batch.turns],
        "stop_reasons": {r: sum(t.stop_reason.value == r for t in batch.trajectories)
                         for r in ("answered", "forced", "length")},
        "searches": sum(len(t.queries) for t in batch.trajectories),
        "load_avg": load_avg(),
    }


def part_engines(args, questions, retriever, vllm) -> dict:
    config = RolloutConfig(group_size=args.group_size, max_turns=args.max_turns, max_turn_tokens=args.max_turn_tokens,
                           temperature=1.0)
    out = {}
    engine = RolloutEngine(vllm, retriever, config)
    engine.rollout(questions[:2], seed=1)  # warm-up: the first calls of a fresh engine are slower
    log.info("engines: vLLM, %d questions x G=%d", len(questions), args.group_size)
    out["vllm"] = batch_figures(engine.rollout(questions, seed=0))
    log.info("vllm: %s", {k: v for k, v in out["vllm"].items() if k != "turns"})
    hf = HFBackend.load(args.model, args.dtype, batch_size=args.hf_batch_size)
    out["hf_thread_probe"] = hf_thread_probe(hf, [engine.prompt_ids(q) for q in questions[: args.hf_batch_size]])
    hf.threads = args.hf_threads or min(out["hf_thread_probe"], key=out["hf_thread_probe"].get)
    engine = RolloutEngine(hf, retriever, config)
    engine.rollout(questions[:1], group_size=1, seed=1)
    hf_questions = questions[: args.hf_questions]
    log.info("engines: HF (%d threads, micro-batch %d), %d questions x G=%d", hf.threads, args.hf_batch_size,
             len(hf_questions), args.group_size)
    out["hf"] = batch_figures(engine.rollout(hf_questions, seed=0))
    out["hf"]["threads"] = hf.threads
    log.info("hf: %s", {k: v for k, v in out["hf"].items() if k != "turns"})
    out["speedup_tokens_per_s"] = round(out["vllm"]["generated_tokens_per_s"] / out["hf"]["generated_tokens_per_s"], 2)
    out["speedup_trajectories_per_s"] = round(out["vllm"]["trajectories_per_s"] / out["hf"]["trajectories_per_s"], 2)
    del hf
    return out


def hf_thread_probe(hf: HFBackend, prompts: list[list[int]]) -> dict[int, float]:
    """Seconds for one micro-batch of 32 tokens with 1 and with 2 torch threads (the faster one is used:
    on a loaded 2-core machine, two OpenMP threads can stall each other)."""
    params = SamplingConfig(max_tokens=32, min_tokens=32, temperature=1.0, stop=())
    seconds = {}
    for threads in (1, 2):
        hf.threads = threads
        started = time.perf_counter()
        hf.generate(prompts, params)
        seconds[threads] = round(time.perf_counter() - started, 2)
    log.info("HF thread probe (s per %d x 32 tokens): %s", len(prompts), seconds)
    return seconds


def part_batching(args, questions, retriever, vllm) -> dict:
    config = RolloutConfig(group_size=args.group_size, max_turns=args.max_turns, max_turn_tokens=args.max_turn_tokens,
                           temperature=0.0)
    engine = RolloutEngine(vllm, retriever, config)
    log.info("batching: batched greedy, %d questions x G=%d", len(questions), args.group_size)
    batched = engine.rollout(questions)
    out = {"batched": batch_figures(batched)}
    log.info("batched: %s", {k: v for k, v in out["batched"].items() if k != "turns"})
    subset = questions[: args.sequential_questions]
    log.info("batching: sequential loop, %d questions x G=%d one at a time", len(subset), args.group_size)
    started = time.perf_counter()
    sequential, tokens = [], 0
    for q in subset:
        for _ in range(args.group_size):
            one = engine.rollout([q], group_size=1)
            sequential.append(one.trajectories[0])
            tokens += one.generated_tokens
    wall = time.perf_counter() - started
    out["sequential"] = {
        "trajectories": len(sequential), "wall_s": round(wall, 2), "generated_tokens": tokens,
        "trajectories_per_s": round(len(sequential) / wall, 4), "generated_tokens_per_s": round(tokens / wall, 2),
        "load_avg": load_avg(),
    }
    log.info("sequential: %s", out["sequential"])
    reference = batched.trajectories[: len(sequential)]
    same = [a.tokens.ids == b.tokens.ids for a, b in zip(reference, sequential, strict=True)]
    same_text = [a.response == b.response for a, b in zip(reference, sequential, strict=True)]
    first_diff = []
    for a, b in zip(reference, sequential, strict=True):
        if a.tokens.ids != b.tokens.ids:
            first_diff.append(next(i for i, (x, y) in enumerate(zip(a.tokens.ids, b.tokens.ids, strict=False)) if x != y)
                              if any(x != y for x, y in zip(a.tokens.ids, b.tokens.ids, strict=False))
                              else min(len(a.tokens.ids), len(b.tokens.ids)))
    out["identical_trajectories"] = f"{sum(same)}/{len(same)}"
    out["identical_text"] = f"{sum(same_text)}/{len(same_text)}"
    out["first_divergence_token"] = first_diff
    out["speedup_trajectories_per_s"] = round(out["batched"]["trajectories_per_s"] / out["sequential"]["trajectories_per_s"], 2)
    # The loop runs the first questions only, whose trajectories may be longer or shorter than the average:
    # tokens/s compares like with like when they differ.
    out["speedup_tokens_per_s"] = round(out["batched"]["generated_tokens_per_s"] / out["sequential"]["generated_tokens_per_s"], 2)
    return out


def fixed_turns(backend, prompts: list[list[int]], observations: list[list[list[int]]], tokens: int,
                split_prefill: bool = False) -> list[dict]:
    """Time turns of exactly `tokens` new tokens each. After turn k every sequence gets observation k
    (`observations[k][i]`, a different one each turn) and turn k+1 continues from the whole history. For
    turns after the first, the same generation from the observation alone (a fresh prompt of the same new
    tokens, no history) is timed too: the difference is what the history costs.

    `split_prefill` (vLLM): afterwards, each turn's prefill alone (one new token) is timed again with the
    prefix cache as the rollout left it before that turn (the previous turns' contexts and generated tokens
    cached, nothing else), with history and fresh; the rest of a turn's time is decoding."""
    params = SamplingConfig(max_tokens=tokens, min_tokens=tokens, temperature=1.0, stop=(), logprobs=True)
    contexts = [list(p) for p in prompts]
    out, history = [], []
    for turn in range(len(observations) + 1):
        started = time.perf_counter()
        completions = backend.generate(contexts, params)
        seconds = time.perf_counter() - started
        row = {"turn": turn + 1, "context_tokens": sum(len(c) for c in contexts),
               "generated_tokens": sum(len(c.token_ids) for c in completions),
               "cached_prompt_tokens": sum(c.cached_prompt_tokens for c in completions),
               "seconds": round(seconds, 2), "load_avg": load_avg()}
        if turn > 0:
            started = time.perf_counter()
            backend.generate(observations[turn - 1], params)
            row["fresh_seconds"] = round(time.perf_counter() - started, 2)
            row["with_history_vs_fresh"] = round(seconds / row["fresh_seconds"], 3)
        out.append(row)
        history.append((contexts, [list(c.token_ids) for c in completions]))
        log.info("fixed turns: %s", row)
        if turn < len(observations):
            contexts = [c + list(done.token_ids) + obs
                        for c, done, obs in zip(contexts, completions, observations[turn], strict=True)]
    for row in out:
        row["relative_to_turn_1"] = round(row["seconds"] / out[0]["seconds"], 3)
    if split_prefill:
        one = SamplingConfig(max_tokens=1, temperature=1.0, stop=())
        for k, row in enumerate(out):
            backend.reset_prefix_cache()
            if k > 0:  # the cache as turn k found it: earlier contexts and their generated tokens
                before, generated = history[k - 1]
                backend.generate([c + g for c, g in zip(before, generated, strict=True)], one)
            started = time.perf_counter()
            done = backend.generate(history[k][0], one)
            row["prefill_seconds"] = round(time.perf_counter() - started, 2)
            row["prefill_cached_tokens"] = sum(c.cached_prompt_tokens for c in done)
            row["decode_seconds"] = round(row["seconds"] - row["prefill_seconds"], 2)
            if k > 0:
                started = time.perf_counter()
                backend.generate(observations[k - 1], one)
                row["fresh_prefill_seconds"] = round(time.perf_counter() - started, 2)
                row["fresh_decode_seconds"] = round(row["fresh_seconds"] - row["fresh_prefill_seconds"], 2)
            log.info("prefill split: %s", row)
    return out


def part_multiturn(args, questions, retriever, vllm, engines: dict | None) -> dict:
    engine = RolloutEngine(vllm, retriever, RolloutConfig(max_turn_tokens=args.max_turn_tokens))
    prompts = [engine.prompt_ids(q) for q in questions]
    # Observation k: the question's passages ranked 3k+1..3k+3 (a new observation each turn, as after a
    # new search; never seen by the prefix cache before).
    ranked = retriever.search([q.question for q in questions], 6)
    tokenizer = vllm.tokenizer
    observations = [[tokenizer(render_observation(p[3 * k : 3 * k + 3]), add_special_tokens=False)["input_ids"][:500]
                     for p in ranked] for k in range(2)]
    out = {"observation_tokens_mean": round(sum(len(o) for turn in observations for o in turn)
                                            / sum(len(turn) for turn in observations), 1)}
    # Cold start, as in a rollout's first turn: the prompts of the earlier parts are in the cache.
    vllm.reset_prefix_cache()
    vllm.reseed(0)
    out["vllm_fixed_turns"] = fixed_turns(vllm, prompts, observations, args.turn_tokens, split_prefill=True)
    # Other engines on the same turns: without a prefix cache (what re-paying the history each turn costs),
    # and with other KV block sizes (the prefix cache's unit). (label, engine settings, split prefill)
    variants = [("no_prefix_cache", {"prefix_caching": False}, False)] if args.no_cache_contrast else []
    variants += [(f"block_{int(b)}", {"block_size": int(b)}, True) for b in args.block_sizes.split(",") if b]
    for label, settings, split in variants:
        other = get_vllm_backend(VllmConfig(model=args.model, dtype=args.dtype, kv_cache_gib=args.kv_cache_gib,
                                            **settings))
        other.reseed(0)
        out[f"vllm_{label}_fixed_turns"] = fixed_turns(other, prompts, observations, args.turn_tokens,
                                                       split_prefill=split)
    if args.multiturn_hf_questions:
        hf = HFBackend.load(args.model, args.dtype, batch_size=args.hf_batch_size, threads=args.hf_threads or 1)
        n = args.multiturn_hf_questions
        out["hf_fixed_turns"] = fixed_turns(hf, prompts[:n], [turn[:n] for turn in observations], args.turn_tokens)
    # (b) raw single-turn throughput on the engine's batch: questions x G prompts, the engine's settings
    batch = [p for p in prompts for _ in range(args.group_size)]
    params = RolloutConfig(max_turn_tokens=args.max_turn_tokens, temperature=1.0).sampling()
    vllm.reseed(0)
    started = time.perf_counter()
    completions = vllm.generate(batch, params)
    seconds = time.perf_counter() - started
    generated = sum(len(c.token_ids) for c in completions)
    out["raw_single_turn"] = {"sequences": len(batch), "generated_tokens": generated, "seconds": round(seconds, 2),
                              "generated_tokens_per_s": round(generated / seconds, 2), "load_avg": load_avg()}
    if engines:
        engine_rate = engines["vllm"]["generated_tokens_per_s"]
        out["engine_vs_raw"] = round(engine_rate / out["raw_single_turn"]["generated_tokens_per_s"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", help="data suite directory (default: the embedded suite)")
    parser.add_argument("--benchmark", default="nq", help="benchmark whose first questions are used")
    parser.add_argument("--retriever", help="index dir or URL (default: BM25 over the suite's corpus)")
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=5)
    parser.add_argument("--max-turns", type=int, default=2, help="Search-R1 trains with 2 or 4")
    parser.add_argument("--max-turn-tokens", type=int, default=500)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-gib", type=float, default=4)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--hf-threads", type=int, default=0, help="torch threads for HF generate (0: the faster of 1 and 2, probed)")
    parser.add_argument("--hf-questions", type=int, default=64, help="questions (x G) for the HF engine run")
    parser.add_argument("--sequential-questions", type=int, default=8, help="questions (x G) for the one-at-a-time loop")
    parser.add_argument("--turn-tokens", type=int, default=128, help="multiturn: new tokens per fixed turn")
    parser.add_argument("--no-cache-contrast", action="store_true", help="multiturn: also time an engine without prefix caching")
    parser.add_argument("--block-sizes", default="", help="multiturn: also time engines with these KV block sizes (e.g. 32,64)")
    parser.add_argument("--multiturn-hf-questions", type=int, default=16, help="multiturn: HF contrast batch (0: skip)")
    parser.add_argument("--parts", default="engines,batching,multiturn")
    parser.add_argument("--out", required=True, help="JSON file for the results")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")

    from eviback.retrieval import open_retriever

    suite = load_suite(args.data)
    questions = read_questions(suite.eval_files([args.benchmark])[args.benchmark])[: args.questions]
    retriever = open_retriever(args.retriever, suite)
    started = time.perf_counter()
    vllm = load_backend(BackendConfig(model=args.model, dtype=args.dtype, kv_cache_gib=args.kv_cache_gib))
    results: dict = {"args": vars(args), "engine_start_s": round(time.perf_counter() - started, 1),
                     "cpu_count": os.cpu_count(), "torch": torch.__version__}
    parts = args.parts.split(",")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        out.write_text(json.dumps(results, indent=2) + "\n")

    if "engines" in parts:
        results["engines"] = part_engines(args, questions, retriever, vllm)
        save()
    if "batching" in parts:
        results["batching"] = part_batching(args, questions, retriever, vllm)
        save()
    if "multiturn" in parts:
        results["multiturn"] = part_multiturn(args, questions, retriever, vllm, results.get("engines"))
        save()
    print(json.dumps({k: v for k, v in results.items() if k != "args"}, indent=1)[:4000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
