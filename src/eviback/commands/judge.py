"""Judge rollouts with a teacher policy, and manage teacher policies.

  eviback judge DUMP --backend local                    judge with the teacher `eviback train` uses
  eviback judge DUMP --backend local --judge KEY        ... with a cached evidence judge as Stage A
  eviback judge DUMP --base-url URL [--model NAME]      judge through an OpenAI-compatible server
  eviback judge DUMP --backend local --policy two-stage the prompted two-stage policy on SmolLM2, as named
  eviback judge --list-judges                           the cached evidence judges and their held-out gate
  eviback judge --list-policies                         built-in policies and their versions
  eviback judge --show-policy REF                       print a policy (a starting point for a draft)
  eviback judge --freeze DRAFT.json --out POLICY.json   freeze a draft policy into a versioned artifact

DUMP is a JSONL file of trajectories (one `to_dict(Trajectory)` per line) or of evaluation/training records
with a `trajectory` key.

The teacher is by default the one `eviback train` judges with (`eviback.train.runner.teacher_policy`) for
the same backend: with `--backend local`, the trained evidence judge as Stage A (the one training builds from
its training questions, found in the cache or built now) and the extractive Stage B; over http, the two-stage
policy. `--preset` and `--set` give the training settings whose teacher it is (`--preset demo`: the demo's
judge; `--set data=DIR`, `--set judge_max_questions=200`, `--set teacher_stage_a=prompted`). `--judge` names a built
judge instead (its cache key or sha256, as `--list-judges` shows them, or its directory): it becomes Stage A of
that teacher. `--policy` judges with exactly the policy named: a built-in name or a frozen file, optionally
pinned with `@VERSION` (`--policy two-stage@84c3f1f9`). A run whose Stage A is a trained judge prints the
judge's held-out figures and says when it is weak (`eviback train` refuses a weak judge unless
`accept_weak_judge=true`).

Verdicts go to `--out` (JSONL, one per rollout, in input order) and a summary (status distribution, Stage B
run rate, S/A->I lowerings, rewards, calls, tokens, cache hits, errors, the evidence judge's figures) to
`--summary` and the terminal. Teacher replies are cached (`--cache`, default in the eviback cache directory):
a re-run pays only for what it has not asked before.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from eviback import device as devices
from eviback import dtype as dtypes
from eviback.cache import cache_dir
from eviback.data import write_jsonl
from eviback.policy import DEFAULT_MODEL
from eviback.teacher import (
    HttpBackendConfig,
    JudgeConfig,
    JudgeSummary,
    OpenAIChatClient,
    RetryConfig,
    TeacherConfig,
    build_teacher,
    load_policy,
    read_trajectories,
    summarize,
)
from eviback.teacher import policy as policies
from eviback.teacher.config import DEFAULT_CACHE, register_judge_beside
from eviback.teacher.evidence_judge import (
    JUDGE_FILE,
    Competence,
    cached_judges,
    competence,
    find_judge,
    judge_policy,
    resolve_judge,
    stage_a_judge,
)
from eviback.teacher.judge import judged_rollouts, stage_a_agreement
from eviback.teacher.local import LocalBackendConfig
from eviback.teacher.openai_http import DEFAULT_BASE_URL
from eviback.teacher.policy import TeacherPolicy
from eviback.train.config import resolve_config
from eviback.train.runner import teacher_policy
from eviback.types import to_dict

HELP = "judge rollouts with the evidence-constrained teacher; list, show and freeze teacher policies"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dump", nargs="?", help="JSONL of trajectories (or records with a 'trajectory' key)")
    parser.add_argument("--policy", default=None,
                        help="built-in name or frozen policy file, optionally @VERSION, judged as named (default: "
                             "the teacher `eviback train` uses: see above)")
    parser.add_argument("--judge", metavar="REF",
                        help="a built evidence judge as Stage A: its cache key or sha256 (6+ leading hex digits; "
                             "--list-judges) or its directory")
    parser.add_argument("--preset", help="the training preset whose teacher to judge with (default: `eviback "
                                         "train`'s defaults), e.g. demo")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a training setting of that teacher, as `eviback train --set` takes it (data, "
                             "train_files, judge_max_questions, judge_epochs, teacher_stage_a, ...)")
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
    backend.add_argument("--base-url", default=DEFAULT_BASE_URL, help="server URL, ending in /v1 (default: %(default)s)")
    backend.add_argument("--model", default="", help="served model name (default: the server's first model)")
    backend.add_argument("--api-key-env", default="OPENAI_API_KEY",
                         help="environment variable holding the API key (default: OPENAI_API_KEY)")
    backend.add_argument("--structured-output", default="response_format",
                         choices=("response_format", "structured_outputs", "json_object", "none"),
                         help="how to ask for the JSON schema (vLLM: response_format or structured_outputs; "
                              "llama-cpp-python: json_object; none: parse the reply leniently)")
    backend.add_argument("--timeout", type=float, default=60.0, help="seconds per call (default 60)")
    backend.add_argument("--local-model", default=DEFAULT_MODEL, help="model of the local backend")
    backend.add_argument("--dtype", default="auto", choices=dtypes.CHOICES,
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
    manage.add_argument("--list-judges", action="store_true",
                        help="list the evidence judges in the cache, with their held-out gate")
    manage.add_argument("--show-policy", metavar="REF", help="print a policy's JSON (to start a draft from)")
    manage.add_argument("--freeze", metavar="DRAFT", help="freeze a draft policy JSON into --out")


def run(args: argparse.Namespace) -> int:
    if args.list_policies:
        for name in policies.builtin_policy_names():
            p = policies.load_policy(name)
            leak = "; ".join(p.boundary_violations()) or "boundary-compliant"
            print(f"{name:26s} {p.short_version}  stages: {', '.join(s.name for s in p.stages)}  ({leak})")
        return 0
    if args.list_judges:
        print(_judges_table())
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
            print(f"eviback judge: warning: evidence boundary: {reason}", file=sys.stderr)
        return 0
    if not args.dump:
        raise ValueError("give a DUMP file to judge (or --list-policies / --show-policy / --freeze)")
    return _judge(args)


def _config(args: argparse.Namespace) -> TeacherConfig:
    return TeacherConfig(
        policy=args.policy or "two-stage",
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
    config = _config(args)
    if args.policy:
        load_policy(args.policy)  # a missing or edited policy fails before anything is read
    trajectories = read_trajectories(args.dump, limit=args.limit)
    policy = _policy(args)  # the default teacher's judge is found, or built, once the dump has been read
    judge = _stage_a_judge(policy, config.policy)
    with build_teacher(config, policy=policy) as teacher:
        if isinstance(teacher.client, OpenAIChatClient):
            teacher.client.list_models()  # fail now, with the fix named, rather than once per rollout
        policy = teacher.policy
        print(f"eviback judge: judging {len(trajectories)} rollouts with {policy.name} {policy.short_version} on "
              f"{teacher.client.backend_id} (concurrency {args.concurrency})", file=sys.stderr)
        start = time.perf_counter()
        verdicts = teacher.judge(trajectories, sample_index=args.teacher_sample)
        wall = time.perf_counter() - start
        summary = summarize(verdicts, policy, teacher.stats(), backend=teacher.client.backend_id, wall_s=wall)
    if judge is not None:
        summary = dataclasses.replace(summary, evidence_judge=judge.to_dict())
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


def _policy(args: argparse.Namespace) -> TeacherPolicy:
    """The policy to judge with: `--policy` as named; else the teacher `eviback train` uses for these settings
    (`--preset`, `--set`, the backend), its Stage A the judge `--judge` names when given."""
    if args.policy and not args.judge:
        return load_policy(args.policy)
    if args.policy:
        base = load_policy(args.policy)
    else:
        # the training config whose teacher this is; a weak judge is judged with all the same (and said so)
        settings = [f"teacher_backend={args.backend}", "accept_weak_judge=true"]
        if args.backend == "http":
            settings.append(f"teacher_url={args.base_url}")
        if args.device != "auto":
            settings.append(f"device={args.device}")
        if args.judge:  # the named judge replaces the one training would build: build none
            settings.append("teacher_stage_a=prompted")
        train_config = resolve_config(args.preset, None, list(args.set) + settings)
        if not args.judge:
            print(f"eviback judge: teacher: the one `eviback train{f' --preset {args.preset}' if args.preset else ''}` uses with "
                  f"the {args.backend} backend"
                  + (" (its evidence judge is found in the cache, or built now as training builds it; --judge names "
                     "a cached one, --list-judges lists them)" if train_config.teacher.stage_a == "judge" and
                     args.backend == "local" else ""), file=sys.stderr)
        base = teacher_policy(train_config)
        if not args.judge:
            return base
    return judge_policy(resolve_judge(args.judge).sha256, base=base)


def _stage_a_judge(policy: TeacherPolicy, ref: str) -> Competence | None:
    """The held-out figures of the trained judge deciding `policy`'s Stage A (None: no trained judge), said
    on the terminal when the judge is weak."""
    sha = stage_a_judge(policy)
    if sha is None:
        return None
    register_judge_beside(ref)
    check = competence(find_judge(sha))
    if check.weak:
        print(f"eviback judge: warning: the evidence judge {check.judge} is weak: {check.figures()}; below the floor "
              f"{check.floor}, `eviback train` refuses it as Stage A (unless accept_weak_judge=true)", file=sys.stderr)
    return check


def _judges_table() -> str:
    """One line per cached evidence judge: its cache key, hash, what it was built from, its held-out gate."""
    lines = []
    for directory in cached_judges():
        try:
            doc = json.loads((directory / JUDGE_FILE).read_text())
            check = competence(directory)
        except (OSError, ValueError, KeyError):
            continue
        counts, built = doc.get("counts", {}), doc.get("config", {})
        gate = "not measured" if check.gate is None else f"{check.gate:.3f}"
        sources = ", ".join(f"{k} {'n/a' if v is None else f'{v:.3f}'}" for k, v in check.by_source.items())
        architecture = doc.get("architecture", "cross-encoder")  # judges before builder 4 are cross-encoders
        if architecture == "cross-encoder":
            architecture += f" of {built.get('epochs', '?')} epochs"
        lines.append(f"{check.judge}  sha256 {check.sha256[:12]}  {architecture}, {counts.get('questions', '?')} "
                     f"questions + {counts.get('rollouts', 0)} rollouts  gate {gate}"
                     + (f" ({sources})" if sources else "") + ("  WEAK" if check.weak else ""))
    return "\n".join(lines) or f"no evidence judge under {cache_dir() / 'judges'} (`eviback build-judge` builds one)"


def _table(summary: JudgeSummary) -> str:
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
    if (j := summary.evidence_judge) is not None:
        check = Competence(**{k: v for k, v in j.items() if k != "weak"})
        lines.append(f"judge    evidence judge {check.judge} (sha256 {check.sha256[:12]}) as Stage A: "
                     f"{check.figures()}" + (f"  WEAK: below the floor {check.floor}" if check.weak else ""))
    lines += [f"error: {e}" for e in summary.error_examples]
    return "\n".join(lines)
