"""Judge rollouts with a teacher policy, and manage teacher policies.

  eviback judge DUMP --base-url URL [--model NAME]      judge through an OpenAI-compatible server
  eviback judge DUMP --backend local [--local-model M]  judge with an in-process transformers model
  eviback judge --list-policies                         built-in policies and their versions
  eviback judge --show-policy REF                       print a policy (a starting point for a draft)
  eviback judge --freeze DRAFT.json --out POLICY.json   freeze a draft policy into a versioned artifact

DUMP is a JSONL file of trajectories (one `to_dict(Trajectory)` per line) or of evaluation/training records
with a `trajectory` key. The policy is a built-in name or a frozen file, optionally pinned with `@VERSION`
(`--policy two-stage@84c3f1f9`). Verdicts go to `--out` (JSONL, one per rollout, in input order) and a summary
(status distribution, Stage B run rate, S/A->I lowerings, rewards, calls, tokens, cache hits, errors) to
`--summary` and the terminal. Teacher replies are cached (`--cache`, default in the eviback cache directory):
a re-run pays only for what it has not asked before.
"""

from __future__ import annotations

import argparse
import json
import sys

HELP = "judge rollouts with the evidence-constrained teacher; list, show and freeze teacher policies"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from eviback import device as devices

    parser.add_argument("dump", nargs="?", help="JSONL of trajectories (or records with a 'trajectory' key)")
    parser.add_argument("--policy", default="two-stage",
                        help="built-in name or frozen policy file, optionally @VERSION (default: two-stage)")
    parser.add_argument("--out", help="verdicts JSONL to write (with --freeze: the frozen artifact)")
    parser.add_argument("--summary", help="summary JSON to write")
    parser.add_argument("--limit", type=int, help="judge only the first N rollouts")
    parser.add_argument("--labels", action="store_true",
                        help="write each rollout's evidence label (S/A/I from the gold answers and supporting "
                             "passages; never shown to the teacher) beside its verdict, and Stage A's "
                             "agreement with the labels in the summary")
    parser.add_argument("--teacher-sample", type=int, default=0,
                        help="teacher sample index (repeated sampling: each index is cached separately)")
    backend = parser.add_argument_group("backend")
    backend.add_argument("--backend", choices=("http", "local"), default="http",
                         help="http: an OpenAI-compatible server; local: an in-process transformers model")
    backend.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="server URL, ending in /v1")
    backend.add_argument("--model", default="", help="served model name (default: the server's first model)")
    backend.add_argument("--api-key-env", default="OPENAI_API_KEY",
                         help="environment variable holding the API key (default: OPENAI_API_KEY)")
    backend.add_argument("--structured-output", default="response_format",
                         choices=("response_format", "structured_outputs", "json_object", "none"),
                         help="how to ask for the JSON schema (vLLM: response_format or structured_outputs; "
                              "llama-cpp-python: json_object; none: parse the reply leniently)")
    backend.add_argument("--timeout", type=float, default=60.0, help="seconds per call (default 60)")
    backend.add_argument("--local-model", default="smollm2-135m", help="model of the local backend")
    backend.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32", "float16"),
                         help="dtype of the local backend's model (auto: bf16 where native, else fp32)")
    backend.add_argument("--threads", type=int, help="torch threads of the local backend")
    backend.add_argument("--device", default="auto",
                         help="the local backend's model: " + devices.HELP + " (default: %(default)s)")
    run = parser.add_argument_group("judging")
    run.add_argument("--concurrency", type=int, default=8, help="rollouts judged at once (default 8)")
    run.add_argument("--max-attempts", type=int, default=3, help="attempts per stage call (default 3)")
    run.add_argument("--backoff", type=float, default=0.5, help="first retry wait in seconds, doubled after")
    run.add_argument("--cache", help="SQLite reply cache (default: <eviback cache>/teacher/replies.sqlite)")
    run.add_argument("--no-cache", action="store_true", help="do not read or write the reply cache")
    manage = parser.add_argument_group("policies")
    manage.add_argument("--list-policies", action="store_true", help="list the built-in policies")
    manage.add_argument("--show-policy", metavar="REF", help="print a policy's JSON (to start a draft from)")
    manage.add_argument("--freeze", metavar="DRAFT", help="freeze a draft policy JSON into --out")


def run(args: argparse.Namespace) -> int:
    from eviback.teacher import policy as policies

    if args.list_policies:
        for name in policies.builtin_policy_names():
            p = policies.load_policy(name)
            leak = "; ".join(p.boundary_violations()) or "boundary-compliant"
            print(f"{name:26s} {p.short_version}  stages: {', '.join(s.name for s in p.stages)}  ({leak})")
        return 0
    if args.show_policy:
        print(json.dumps(json.loads(policies.load_policy(args.show_policy).canonical_json()), indent=2,
                         ensure_ascii=False))
        return 0
    if args.freeze:
        if not args.out:
            raise ValueError("--freeze needs --out PATH for the frozen artifact")
        with open(args.freeze, encoding="utf-8") as f:
            draft = policies.policy_from_json(f.read(), args.freeze)
        path = policies.freeze_policy(draft, args.out, {"frozen_from": args.freeze})
        print(f"froze {draft.name} version {draft.version} -> {path}")
        for reason in draft.boundary_violations():
            print(f"warning: evidence boundary: {reason}", file=sys.stderr)
        return 0
    if not args.dump:
        raise ValueError("give a DUMP file to judge (or --list-policies / --show-policy / --freeze)")
    return _judge(args)


def _config(args: argparse.Namespace):  # noqa: ANN202 - a TeacherConfig
    from eviback.teacher import HttpBackendConfig, JudgeConfig, RetryConfig, TeacherConfig
    from eviback.teacher.config import DEFAULT_CACHE
    from eviback.teacher.local import LocalBackendConfig

    return TeacherConfig(
        policy=args.policy,
        backend=args.backend,
        http=HttpBackendConfig(base_url=args.base_url, model=args.model, api_key_env=args.api_key_env,
                               structured_output=args.structured_output, timeout_s=args.timeout,
                               max_connections=max(args.concurrency, 1)),
        local=LocalBackendConfig(model=args.local_model, dtype=args.dtype, threads=args.threads,
                                 device=args.device),
        judge=JudgeConfig(concurrency=args.concurrency,
                          retry=RetryConfig(max_attempts=args.max_attempts, backoff_s=args.backoff)),
        cache="" if args.no_cache else (args.cache or DEFAULT_CACHE),
    )


def _judge(args: argparse.Namespace) -> int:
    import dataclasses
    import time

    from eviback.data import write_jsonl
    from eviback.teacher import OpenAIChatClient, build_teacher, load_policy, read_trajectories, summarize
    from eviback.teacher.judge import judged_rollouts, stage_a_agreement
    from eviback.types import to_dict

    config = _config(args)
    load_policy(config.policy)  # a missing or edited policy fails before anything is loaded
    trajectories = read_trajectories(args.dump, limit=args.limit)
    with build_teacher(config) as teacher:
        if isinstance(teacher.client, OpenAIChatClient):
            teacher.client.list_models()  # fail now, with the fix named, rather than once per rollout
        policy = teacher.policy
        print(f"judging {len(trajectories)} rollouts with {policy.name} {policy.short_version} on "
              f"{teacher.client.backend_id} (concurrency {args.concurrency})", file=sys.stderr)
        start = time.perf_counter()
        verdicts = teacher.judge(trajectories, sample_index=args.teacher_sample)
        wall = time.perf_counter() - start
        summary = summarize(verdicts, policy, teacher.stats(), backend=teacher.client.backend_id, wall_s=wall)
    if args.labels:
        summary = dataclasses.replace(summary, stage_a_agreement=stage_a_agreement(trajectories, verdicts))
    if args.out:
        records = judged_rollouts(trajectories, verdicts, args.teacher_sample, labels=args.labels)
        write_jsonl(args.out, (to_dict(r) for r in records))
    if args.summary:
        with open(args.summary, "w", encoding="utf-8") as f:
            f.write(json.dumps(to_dict(summary), indent=2) + "\n")
    print(_table(summary))
    return 1 if verdicts and summary.errors == len(verdicts) else 0


def _table(summary) -> str:  # noqa: ANN001 - a JudgeSummary
    t = summary.total
    lines = [
        f"policy {summary.policy} {summary.policy_version[:12]}  backend {summary.backend}",
        f"rollouts {summary.rollouts}  errors {summary.errors}  wall {summary.wall_s:.1f}s  "
        f"({summary.rollouts_per_s:.2f} rollouts/s)",
        "status   " + "  ".join(f"{k}={v}" for k, v in summary.status.items()),
        "stage A  " + "  ".join(f"{k}={v}" for k, v in summary.stage_a_status.items())
        + f"   stage B ran {summary.stage_b_runs} ({summary.stage_b_run_rate:.0%})  lowered "
        + "  ".join(f"{k}={v}" for k, v in summary.lowered.items()) + f"  ungrounded={summary.ungrounded}",
        "reward   " + (f"mean {summary.reward_mean:.3f}  " if summary.reward_mean is not None else "")
        + "  ".join(f"{k}:{v}" for k, v in summary.reward_histogram.items()),
        f"calls {t.calls} (retries {t.retries}, schema violations {t.schema_violations})  cache hits "
        f"{t.cache_hits}/{t.requests}  tokens {t.prompt_tokens}+{t.completion_tokens} "
        f"(paid {t.paid_prompt_tokens}+{t.paid_completion_tokens})",
    ]
    if (a := summary.stage_a_agreement) is not None:
        def fmt(x: float | None) -> str:
            return "n/a" if x is None else f"{x:.3f}"
        lines.append(f"labels   stage A vs label on {a.n}: gate (I vs not-I) {fmt(a.gate_balanced_accuracy)}  "
                     f"balanced accuracy {fmt(a.balanced_accuracy)}  S-vs-I {fmt(a.s_vs_i_balanced_accuracy)}  kappa {fmt(a.kappa)}  confusion (label: "
                     + "  ".join(f"{k}->" + "/".join(str(v) for v in row.values()) for k, row in a.confusion.items())
                     + " as S/A/I)")
    lines += [f"error: {e}" for e in summary.error_examples]
    return "\n".join(lines)
