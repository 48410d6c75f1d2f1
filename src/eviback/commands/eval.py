"""Evaluate a policy on QA benchmarks: greedy, one Search-R1 rollout per question.

  eviback eval                                   the seven benchmarks of the embedded suite, vLLM, BM25
  eviback eval --data DIR --limit 200            another data suite, first 200 questions per benchmark
  eviback eval --qa dev.jsonl --model CKPT_DIR   any QA file(s), any checkpoint
  eviback eval --retriever http://host:8000      a running `eviback serve` (or an index directory)

Writes OUT/items.jsonl (one record per question: trajectory, answer, EM/F1/sub-EM, statistics),
OUT/summary.json, OUT/summary.md (the table) and OUT/viewer.html. Rerunning the same command resumes:
questions already in items.jsonl are skipped.
"""

from __future__ import annotations

import argparse
import os

# Sleeping OpenMP threads (set before torch loads): on shared cores, spinning ones stall each other.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

HELP = "evaluate a model on the QA benchmarks (EM, F1, valid answers, searches)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from eviback import device as devices
    from eviback.evaluate import EvalConfig

    defaults = EvalConfig()
    data = parser.add_argument_group("questions")
    data.add_argument("--data", help="data suite directory (default: the embedded suite)")
    data.add_argument("--benchmarks", help="comma-separated benchmarks of the suite (default: all seven)")
    data.add_argument("--qa", action="append", default=[], metavar="FILE",
                      help="a QA JSONL file to evaluate (repeatable; replaces the suite's benchmarks unless --benchmarks)")
    data.add_argument("--limit", type=int, help="first N questions of each benchmark")
    model = parser.add_argument_group("policy")
    model.add_argument("--model", default=defaults.model, help="model name or checkpoint directory (default: %(default)s)")
    model.add_argument("--dtype", default=defaults.dtype, choices=["auto", "bfloat16", "float32", "float16"],
                       help="auto (default): bf16 where the device computes it natively, else fp32")
    model.add_argument("--device", default=defaults.device, help=devices.HELP + " (default: %(default)s)")
    model.add_argument("--backend", default=defaults.backend, choices=["vllm", "hf"],
                       help="generation engine (default: %(default)s)")
    model.add_argument("--kv-cache-gib", type=float, help="vLLM on CPU: KV cache size in GiB (default 2)")
    model.add_argument("--threads", type=int, help="torch threads")
    rollout = parser.add_argument_group("rollout")
    rollout.add_argument("--retriever", help="index directory or http(s) URL of a /retrieve service "
                                             "(default: BM25 over the suite's corpus, built once and cached)")
    rollout.add_argument("--topk", type=int, default=defaults.topk, help="passages per search (default: %(default)s)")
    rollout.add_argument("--max-turns", type=int, default=defaults.max_turns,
                         help="executed turns before the final, no-search turn (default: %(default)s)")
    rollout.add_argument("--max-turn-tokens", type=int, default=defaults.max_turn_tokens, help="default: %(default)s")
    rollout.add_argument("--max-observation-tokens", type=int, default=defaults.max_observation_tokens,
                         help="default: %(default)s")
    rollout.add_argument("--max-context-tokens", type=int, default=defaults.max_context_tokens, help="default: %(default)s")
    rollout.add_argument("--batch-size", type=int, default=defaults.batch_size,
                         help="questions per batched rollout, and per resume checkpoint (default: 0: 64 on the "
                              "CPU, 256 on a GPU)")
    parser.add_argument("--out", help="output directory (default: runs/eval/<model>)")
    parser.add_argument("--overwrite", action="store_true", help="discard results already in --out")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from eviback.evaluate import EvalConfig, run_eval, summary_markdown

    config = EvalConfig(
        out=args.out or "",
        data=args.data,
        benchmarks=tuple(b.strip() for b in args.benchmarks.split(",") if b.strip()) if args.benchmarks else (),
        qa_files=tuple(args.qa),
        limit=args.limit,
        retriever=args.retriever,
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        backend=args.backend,
        topk=args.topk,
        max_turns=args.max_turns,
        max_turn_tokens=args.max_turn_tokens,
        max_observation_tokens=args.max_observation_tokens,
        max_context_tokens=args.max_context_tokens,
        batch_size=args.batch_size,
        kv_cache_gib=args.kv_cache_gib,
        threads=args.threads,
        progress=args.progress,
    )
    summary = run_eval(config, overwrite=args.overwrite)
    out = config.out_dir()
    print(summary_markdown(summary))
    print(f"items: {out / 'items.jsonl'}\nsummary: {out / 'summary.md'}\nviewer: {out / 'viewer.html'}")
    return 0
