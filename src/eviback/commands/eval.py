"""Evaluate a policy on QA benchmarks: greedy, one Search-R1 rollout per question.

  eviback eval                                   the seven benchmarks of the embedded suite, vLLM, BM25
  eviback eval --data DIR --limit 200            another data suite, first 200 questions per benchmark
  eviback eval --qa dev.jsonl --model CKPT_DIR   any QA file(s), any checkpoint
  eviback eval --retriever http://host:8000      a running `eviback serve` (or an index directory)
  eviback eval --model CKPT --chat-template none a base model's policy: Search-R1's plain prompt, no template

Writes OUT/items.jsonl (one record per question: trajectory, answer, EM/F1/sub-EM, statistics),
OUT/summary.json, OUT/summary.md (the table) and OUT/viewer.html. Rerunning the same command resumes:
questions already in items.jsonl are skipped. A `/retrieve` service that stops answering is retried for
--retrieval-deadline-s seconds; past that the evaluation stops with exit code 75 and says so, as it does at
once when the policy server of `--backend vllm-server` stops answering.
"""

from __future__ import annotations

import argparse
import os
import sys

from eviback import device as devices
from eviback import dtype as dtypes
from eviback.commands import add_prompt_arguments, prompt_from_args
from eviback.evaluate import EvalConfig, run_eval, summary_markdown
from eviback.generation import BACKENDS, EngineSettings
from eviback.generation.memory import STANDALONE_UTILIZATION
from eviback.retrieval.client import RetrieverUnavailable
from eviback.rollout import RolloutConfig
from eviback.unavailable import ServiceUnavailable

# Sleeping OpenMP threads (set before torch loads): on shared cores, spinning ones stall each other.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

HELP = "evaluate a model on the QA benchmarks (EM, F1, valid answers, searches)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = EvalConfig()
    limits = defaults.rollout
    data = parser.add_argument_group("questions")
    data.add_argument("--data", help="data suite directory (default: the embedded suite)")
    data.add_argument("--benchmarks", help="comma-separated benchmarks of the suite (default: all seven)")
    data.add_argument("--qa", action="append", default=[], metavar="FILE",
                      help="a QA JSONL file to evaluate (repeatable; replaces the suite's benchmarks unless --benchmarks)")
    data.add_argument("--limit", type=int, help="first N questions of each benchmark")
    model = parser.add_argument_group("policy")
    model.add_argument("--model", default=defaults.model, help="model name or checkpoint directory (default: %(default)s)")
    model.add_argument("--dtype", default=defaults.dtype, choices=dtypes.CHOICES,
                       help="auto (default): bf16 where the device computes it natively, else fp32")
    model.add_argument("--device", default=defaults.device, help=devices.HELP + " (default: %(default)s)")
    model.add_argument("--backend", default=defaults.backend, choices=BACKENDS,
                       help="generation engine (default: %(default)s); vllm-server: the policy a `vllm serve` "
                            "process serves at --policy-url (`eviback serve-policy`), --model naming it")
    model.add_argument("--policy-url", default=defaults.engine.policy_url,
                       help="--backend vllm-server: the policy server's base URL (default: %(default)s)")
    model.add_argument("--policy-timeout-s", type=float, default=defaults.engine.policy_timeout_s,
                       help="--backend vllm-server: seconds one generation request may take before the evaluation "
                            "stops, keeping its answers so far (default: %(default)s)")
    model.add_argument("--gpu-memory-utilization", type=float, default=None,
                       help="vLLM on a CUDA GPU: the share of its memory the engine takes (default: "
                            f"{STANDALONE_UTILIZATION})")
    model.add_argument("--kv-cache-gib", type=float, help="vLLM on CPU: KV cache size in GiB (default 2)")
    model.add_argument("--threads", type=int, help="torch threads")
    add_prompt_arguments(model)  # a policy is evaluated with the prompt style it was trained with
    rollout = parser.add_argument_group("rollout")
    rollout.add_argument("--retriever", help="index directory or http(s) URL of a /retrieve service "
                                             "(default: BM25 over the suite's corpus, built once and cached)")
    rollout.add_argument("--retrieval-deadline-s", type=float, default=defaults.retrieval_deadline_s,
                         help="with an http retriever: seconds a search keeps retrying a service that does not "
                              "answer (stopped, restarting, loading its index) (default: %(default)s)")
    rollout.add_argument("--topk", type=int, default=limits.topk, help="passages per search (default: %(default)s)")
    rollout.add_argument("--max-turns", type=int, default=limits.max_turns,
                         help="executed turns before the final, no-search turn (default: %(default)s; training's "
                              f"is {RolloutConfig.max_turns})")
    rollout.add_argument("--max-turn-tokens", type=int, default=limits.max_turn_tokens, help="default: %(default)s")
    rollout.add_argument("--max-observation-tokens", type=int, default=limits.max_observation_tokens,
                         help="default: %(default)s")
    rollout.add_argument("--max-context-tokens", type=int, default=limits.max_context_tokens, help="default: %(default)s")
    rollout.add_argument("--batch-size", type=int, default=defaults.batch_size,
                         help="questions per batched rollout, and per resume checkpoint (default: 0: 64 on the "
                              "CPU, 256 on a GPU)")
    parser.add_argument("--out", help="output directory (default: runs/eval/<model>)")
    parser.add_argument("--overwrite", action="store_true", help="discard results already in --out")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    """The evaluation the options describe."""
    return EvalConfig(
        out=args.out or "",
        data=args.data,
        benchmarks=tuple(b.strip() for b in args.benchmarks.split(",") if b.strip()) if args.benchmarks else (),
        qa_files=tuple(args.qa),
        limit=args.limit,
        retriever=args.retriever,
        retrieval_deadline_s=args.retrieval_deadline_s,
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        backend=args.backend,
        engine=EngineSettings(policy_url=args.policy_url, policy_timeout_s=args.policy_timeout_s,
                              gpu_memory_utilization=args.gpu_memory_utilization),
        rollout=RolloutConfig(topk=args.topk, max_turns=args.max_turns, max_turn_tokens=args.max_turn_tokens,
                              max_observation_tokens=args.max_observation_tokens,
                              max_context_tokens=args.max_context_tokens),
        prompt=prompt_from_args(args),
        batch_size=args.batch_size,
        kv_cache_gib=args.kv_cache_gib,
        threads=args.threads,
        progress=args.progress,
    )


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    try:
        summary = run_eval(config, overwrite=args.overwrite)
    except Exception as e:
        unavailable = ServiceUnavailable.found_in(e)
        if unavailable is None or getattr(args, "verbose", False):
            raise
        if isinstance(unavailable, RetrieverUnavailable):
            patience = f" (--retrieval-deadline-s waits longer, now {config.retrieval_deadline_s:g} s)"
        else:
            patience = f" (--policy-timeout-s waits longer for a server that is only slow, now {config.engine.policy_timeout_s:g} s)"
        print(f"eviback eval: {unavailable.describe()}, so the evaluation stopped. The questions already answered "
              f"are kept in {config.out_dir() / 'items.jsonl'}: once the {unavailable.service.removeprefix('the ')} "
              f"answers again ({unavailable.restart()}), rerun the same command to evaluate the rest{patience}.",
              file=sys.stderr)
        return unavailable.exit_code
    out = config.out_dir()
    print(summary_markdown(summary))
    print(f"items: {out / 'items.jsonl'}\nsummary: {out / 'summary.md'}\nviewer: {out / 'viewer.html'}")
    return 0
