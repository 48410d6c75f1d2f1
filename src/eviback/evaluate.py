"""Benchmark evaluation: greedy, one rollout per question, on the same rollout engine training uses.

Two entry points:

- :func:`evaluate` (library): a backend, a retriever and questions in; one :class:`EvalItem` per question
  and the metrics out. Training calls it on held-out questions.
- :func:`run_eval` (`eviback eval`): the seven benchmarks of a data suite (or any QA files) into an output
  directory: `items.jsonl` (one record per question: the whole trajectory, its scores and statistics),
  `summary.json` and `summary.md` (per benchmark, single-hop / multi-hop / overall macro averages) and
  `viewer.html`. An interrupted run resumes: items already in `items.jsonl` are skipped, and the summary is
  always recomputed from that file.

    eviback eval --data DIR --limit 200 --out runs/eval/baseline
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from eviback import device as devices
from eviback import dtype as dtypes
from eviback import retrieval
from eviback.data import BENCHMARKS_MULTI_HOP, BENCHMARKS_SINGLE_HOP, DataError, load_suite, read_questions
from eviback.generation import BACKENDS, BackendConfig, EngineSettings, load_backend
from eviback.generation.base import GenerationBackend
from eviback.generation.memory import STANDALONE_UTILIZATION
from eviback.generation.server import VllmServerBackend
from eviback.metrics import (
    METRIC_NOTE,
    AnswerScores,
    RolloutMetrics,
    TrajectoryStats,
    rollout_metrics,
    score_answer,
    trajectory_stats,
)
from eviback.policy import DEFAULT_MODEL, resolve_model
from eviback.protocol import PromptStyle
from eviback.retrieval.base import Retriever
from eviback.rollout import RolloutBatch, RolloutConfig, RolloutEngine
from eviback.settings import check_fields
from eviback.templates import render
from eviback.types import Question, Trajectory, from_dict, to_dict
from eviback.viewer import write_viewer

log = logging.getLogger(__name__)

ITEMS_FILE = "items.jsonl"
SUMMARY_JSON = "summary.json"
SUMMARY_MD = "summary.md"
CONFIG_FILE = "config.json"
VIEWER_FILE = "viewer.html"
SCHEMA_VERSION = 1


def items_path(out: str | os.PathLike) -> Path:
    """The per-item records of an evaluation directory: `items.jsonl`, else the compressed copy an experiment
    keeps (`items.jsonl.gz`). Raises FileNotFoundError naming the directory when it holds neither."""
    for name in (ITEMS_FILE, ITEMS_FILE + ".gz"):
        if (Path(out) / name).exists():
            return Path(out) / name
    raise FileNotFoundError(f"{out} holds no {ITEMS_FILE} or {ITEMS_FILE}.gz: not an evaluation's directory")


@dataclass(frozen=True)
class EvalTask:
    """One question to evaluate, and the benchmark it belongs to."""

    benchmark: str
    question: Question


@dataclass(frozen=True)
class EvalItem:
    """The evaluation of one question: its greedy trajectory (without token ids), scores and statistics."""

    benchmark: str
    trajectory: Trajectory
    scores: AnswerScores
    stats: TrajectoryStats

    @classmethod
    def of(cls, benchmark: str, trajectory: Trajectory) -> EvalItem:
        trajectory = dataclasses.replace(trajectory, tokens=None)
        return cls(benchmark, trajectory, score_answer(trajectory.answer, trajectory.question.golden_answers),
                   trajectory_stats(trajectory))

    @property
    def key(self) -> tuple[str, str]:
        return self.benchmark, self.trajectory.question.id

    def to_json(self) -> dict[str, Any]:
        """The JSONL record: flat fields for quick filtering, then the whole trajectory."""
        t = self.trajectory
        return {
            "schema": SCHEMA_VERSION,
            "benchmark": self.benchmark,
            "id": t.question.id,
            "question": t.question.question,
            "golden_answers": list(t.question.golden_answers),
            "answer": t.answer,
            "stop_reason": t.stop_reason.value,
            **to_dict(self.scores),
            **to_dict(self.stats),
            "trajectory": to_dict(t),
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> EvalItem:
        trajectory = from_dict(Trajectory, obj["trajectory"])
        return cls(
            benchmark=obj["benchmark"],
            trajectory=trajectory,
            scores=AnswerScores(em=obj["em"], f1=obj["f1"], sub_em=obj["sub_em"]),
            # recomputed, not read: a record written under older definitions reads as the current ones
            stats=trajectory_stats(trajectory),
        )


# Evaluation lets a policy search more often than training does: RolloutConfig's default (2) is Search-R1's
# training setting, and Search-R1 evaluates with up to 4 searches, so a policy is measured on what it answers
# with more searches than it was trained with, not cut at the training budget. The only rollout setting in
# which evaluation's default differs from training's.
EVAL_MAX_TURNS = 4


def greedy(config: RolloutConfig | None = None) -> RolloutConfig:
    """The evaluation variant of a rollout config: greedy, one rollout per question, no log-probs (default:
    RolloutConfig's limits with `EVAL_MAX_TURNS`)."""
    config = config or RolloutConfig(max_turns=EVAL_MAX_TURNS)
    return dataclasses.replace(config, temperature=0.0, top_p=1.0, group_size=1, logprobs=False)


def evaluate_tasks(
    engine: RolloutEngine,
    tasks: Sequence[EvalTask],
    *,
    batch_size: int = 64,
    on_batch: Callable[[list[EvalItem]], None] | None = None,
    throughput: Throughput | None = None,
) -> list[EvalItem]:
    """Roll out every task once with `engine` (which should be greedy, see :func:`greedy`), `batch_size`
    questions per batched rollout; `on_batch` sees each batch's items as soon as they exist, and `throughput`
    (when given) adds up each batch's tokens and times."""
    items: list[EvalItem] = []
    for start in range(0, len(tasks), batch_size):
        chunk = tasks[start : start + batch_size]
        batch = engine.rollout([t.question for t in chunk], group_size=1)
        new = [EvalItem.of(task.benchmark, traj) for task, traj in zip(chunk, batch.trajectories, strict=True)]
        items.extend(new)
        if throughput is not None:
            throughput.add(batch)
        if on_batch is not None:
            on_batch(new)
    return items


@dataclass
class Throughput:
    """Where an evaluation's time went: the questions rolled out, the tokens the policy generated, and the
    seconds of generation, retrieval and the whole rollouts (`throughput.json`; a resumed evaluation's file
    covers the questions of its last invocation)."""

    questions: int = 0
    batches: int = 0
    generated_tokens: int = 0
    generate_s: float = 0.0
    retrieve_s: float = 0.0
    rollout_s: float = 0.0

    def add(self, batch: RolloutBatch) -> None:
        self.questions += len(batch.groups)
        self.batches += 1
        self.generated_tokens += batch.generated_tokens
        self.generate_s += batch.generate_s
        self.retrieve_s += batch.retrieve_s
        self.rollout_s += batch.wall_s

    @property
    def tokens_per_s(self) -> float | None:
        """Generated tokens per second of generation (the engine's own rate, retrieval excluded)."""
        return self.generated_tokens / self.generate_s if self.generate_s > 0 else None

    def to_dict(self) -> dict[str, Any]:
        rate = self.tokens_per_s
        return {**dataclasses.asdict(self), "generated_tokens_per_s": round(rate, 1) if rate is not None else None}

    def line(self) -> str:
        rate = self.tokens_per_s
        return (f"{self.generated_tokens:,} generated tokens, {rate:,.0f} tokens/s of generation "
                f"(generation {self.generate_s:.0f} s, retrieval {self.retrieve_s:.0f} s)" if rate is not None
                else "no tokens generated")


@dataclass(frozen=True)
class EvalResult:
    items: tuple[EvalItem, ...]
    metrics: RolloutMetrics


def evaluate(
    backend: GenerationBackend,
    retriever: Retriever,
    questions: Sequence[Question],
    *,
    config: RolloutConfig | None = None,
    prompt: PromptStyle | None = None,
    benchmark: str = "",
    batch_size: int = 64,
) -> EvalResult:
    """Greedy evaluation of `backend`'s current policy on `questions` (one rollout each).

    `config` supplies the turn and token limits (default: :func:`greedy`'s); its sampling settings are
    replaced by greedy ones. `prompt`: how the prompt reaches the model (default: the chat template)."""
    engine = RolloutEngine(backend, retriever, greedy(config), prompt=prompt)
    items = evaluate_tasks(engine, [EvalTask(benchmark, q) for q in questions], batch_size=batch_size)
    return EvalResult(tuple(items), rollout_metrics(i.trajectory for i in items))


# --------------------------------------------------------------------------------------------------
# Summaries


@dataclass(frozen=True)
class BenchmarkMetrics:
    name: str
    metrics: RolloutMetrics


@dataclass(frozen=True)
class EvalSummary:
    """Metrics per benchmark, and macro averages (each benchmark weighs the same; `n` is the total)."""

    benchmarks: tuple[BenchmarkMetrics, ...]
    single_hop: RolloutMetrics | None
    multi_hop: RolloutMetrics | None
    overall: RolloutMetrics


def hop_kind(benchmark: str) -> str | None:
    """"single" or "multi" for the known benchmarks and files named after them (`hotpotqa_ctx`), else None."""
    for kind, names in (("single", BENCHMARKS_SINGLE_HOP), ("multi", BENCHMARKS_MULTI_HOP)):
        if any(benchmark == n or benchmark.startswith(n + "_") for n in names):
            return kind
    return None


def macro_average(metrics: Sequence[RolloutMetrics]) -> RolloutMetrics:
    """The unweighted mean of each metric over `metrics`; `n` is their total."""
    if not metrics:
        return rollout_metrics([])
    fields = [f.name for f in dataclasses.fields(RolloutMetrics) if f.name != "n"]
    means = {name: sum(getattr(m, name) for m in metrics) / len(metrics) for name in fields}
    return RolloutMetrics(n=sum(m.n for m in metrics), **means)


def summarize(items: Iterable[EvalItem], order: Sequence[str] | None = None) -> EvalSummary:
    """Per-benchmark metrics (in `order`, else first-seen order) recomputed from the trajectories."""
    by_benchmark: dict[str, list[Trajectory]] = {}
    for item in items:
        by_benchmark.setdefault(item.benchmark, []).append(item.trajectory)
    names = [n for n in (order or []) if n in by_benchmark] + [n for n in by_benchmark if n not in (order or [])]
    rows = tuple(BenchmarkMetrics(n, rollout_metrics(by_benchmark[n])) for n in names)
    single = [r.metrics for r in rows if hop_kind(r.name) == "single"]
    multi = [r.metrics for r in rows if hop_kind(r.name) == "multi"]
    return EvalSummary(
        benchmarks=rows,
        single_hop=macro_average(single) if single else None,
        multi_hop=macro_average(multi) if multi else None,
        overall=macro_average([r.metrics for r in rows]),
    )


METRIC_COLUMNS = ("n", "EM", "F1", "sub-EM", "valid answer", "avg searches", "duplicate queries", "forced")


def summary_rows(summary: EvalSummary) -> list[tuple[str, RolloutMetrics]]:
    """(name, metrics) per benchmark, then the macro averages that exist."""
    rows = [(r.name, r.metrics) for r in summary.benchmarks]
    if summary.single_hop is not None:
        rows.append(("single-hop (macro)", summary.single_hop))
    if summary.multi_hop is not None:
        rows.append(("multi-hop (macro)", summary.multi_hop))
    rows.append(("overall (macro)", summary.overall))
    return rows


def _cells(m: RolloutMetrics) -> list[str]:
    return [str(m.n), f"{m.em:.3f}", f"{m.f1:.3f}", f"{m.sub_em:.3f}", f"{m.valid_answer_rate:.3f}",
            f"{m.avg_searches:.2f}", f"{m.duplicate_query_rate:.3f}", f"{m.forced_termination_rate:.3f}"]


def summary_markdown(summary: EvalSummary, title: str = "") -> str:
    """The summary as a markdown table."""
    return comparison_markdown({"": summary}, title)


def comparison_markdown(summaries: Mapping[str, EvalSummary], title: str = "") -> str:
    """One markdown table of several policies on the same benchmarks (a `policy` column when there are
    several): rows benchmark by benchmark, each policy's row beside the others."""
    named = len(summaries) > 1
    head = ("| benchmark | " + ("policy | " if named else "") + " | ".join(METRIC_COLUMNS) + " |\n"
            + "|---|" + ("---|" if named else "") + "---:|" * len(METRIC_COLUMNS) + "\n")
    per_policy = {name: summary_rows(s) for name, s in summaries.items()}
    lines = [f"## {title}\n\n" if title else "", head]
    for i, (row_name, _) in enumerate(next(iter(per_policy.values()))):
        label = f"**{row_name}**" if "macro" in row_name else row_name
        for policy, rows in per_policy.items():
            cells = _cells(rows[i][1])
            lines.append(f"| {label} | " + (f"{policy} | " if named else "") + " | ".join(cells) + " |\n")
    lines.append(f"\n{METRIC_NOTE}.\n")
    return "".join(lines)


def comparison_html(summaries: Mapping[str, EvalSummary]) -> str:
    """The same table as :func:`comparison_markdown`, as an HTML fragment (templates/eval_table.html.j2)."""
    per_policy = {name: summary_rows(s) for name, s in summaries.items()}
    rows = [{"name": row_name, "policy": policy, "bold": "macro" in row_name, "cells": _cells(rows[i][1])}
            for i, (row_name, _) in enumerate(next(iter(per_policy.values()))) for policy, rows in per_policy.items()]
    return render("eval_table.html.j2", named=len(summaries) > 1, columns=METRIC_COLUMNS, rows=rows)


# --------------------------------------------------------------------------------------------------
# The `eviback eval` job: files in, an output directory out, resumable.


CPU_EVAL_BATCH, GPU_EVAL_BATCH = 64, 256  # questions per batched rollout when `batch_size` is 0
# The rollout settings a resumed evaluation must share with the first run (the sampling ones are greedy's).
ROLLOUT_IDENTITY = ("topk", "max_turns", "max_turn_tokens", "max_observation_tokens", "max_context_tokens")
PLACEMENTS_FILE = "placements.json"  # where the evaluation's models computed (eviback.device.placements)
THROUGHPUT_FILE = "throughput.json"  # the last invocation's generated tokens and times (Throughput)


@dataclass(frozen=True)
class EvalConfig:
    """An evaluation run. Fields marked `identity` must match when a run resumes in the same directory."""

    out: str = field(default="", metadata={"help": "output directory (default: runs/eval/<model>)"})
    data: str | None = field(default=None, metadata={"help": "data suite directory (default: the embedded suite)", "identity": True})
    benchmarks: tuple[str, ...] = field(default=(), metadata={"help": "benchmarks of the suite (default: all; none when --qa is given)", "identity": True})
    qa_files: tuple[str, ...] = field(default=(), metadata={"help": "extra QA JSONL files, named by their stem", "identity": True})
    limit: int | None = field(default=None, metadata={"help": "first N questions of each benchmark"})
    retriever: str | None = field(default=None, metadata={"help": "index directory or http URL (default: BM25 over the suite's corpus)", "identity": True})
    retrieval_deadline_s: float = field(default=300.0, metadata={"help": "with an http retriever: seconds a search "
                                        "keeps retrying a service that does not answer before the evaluation stops"})
    model: str = field(default=DEFAULT_MODEL, metadata={"help": "model name or checkpoint directory", "identity": True})
    dtype: str = field(default="auto", metadata={"help": "model dtype: auto (bf16 where the device computes it "
                       "natively, else fp32: eviback.dtype), bfloat16, float32, float16; the resolved one is part "
                       "of the identity", "identity": True})
    device: str = field(default="auto", metadata={"help": devices.HELP})
    backend: str = field(default="vllm", metadata={"help": "vllm, hf, or vllm-server (the policy served at policy_url; "
                         "model names it, for its tokenizer)", "identity": True})
    engine: EngineSettings = field(default_factory=EngineSettings, metadata={"help": "the engine's own settings "
                                   "(the policy server's URL and timeout, the GPU memory share)"})
    rollout: RolloutConfig = field(default_factory=greedy, metadata={
        "help": f"turn and token limits (RolloutConfig; max_turns {EVAL_MAX_TURNS} by default); its sampling "
                "settings are always greedy's"})
    prompt: PromptStyle = field(default_factory=PromptStyle, metadata={
        "help": "how the prompt reaches the model (PromptStyle: chat_template auto or none, chat_template_kwargs); "
                "a policy is evaluated with the prompt style it was trained with", "identity": True})
    batch_size: int = field(default=0, metadata={"help": "questions per batched rollout (and per resume checkpoint); "
                            f"0: {CPU_EVAL_BATCH} on the CPU, {GPU_EVAL_BATCH} on a GPU"})
    kv_cache_gib: float | None = field(default=None, metadata={"help": "vLLM CPU KV cache in GiB"})
    threads: int | None = field(default=None, metadata={"help": "torch threads"})
    progress: bool = field(default=True, metadata={"help": "show a progress bar"})

    def __post_init__(self) -> None:
        check_fields(self)  # a wrong type is refused by name; the ranges below compare numbers
        if not isinstance(self.rollout, RolloutConfig):
            raise ValueError(f"EvalConfig.rollout must be a RolloutConfig, got {type(self.rollout).__name__}")
        if not isinstance(self.engine, EngineSettings):
            raise ValueError(f"EvalConfig.engine must be an EngineSettings, got {type(self.engine).__name__}")
        if not isinstance(self.prompt, PromptStyle):
            raise ValueError(f"EvalConfig.prompt must be a PromptStyle, got {type(self.prompt).__name__}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.kv_cache_gib is not None and not self.kv_cache_gib > 0:
            raise ValueError(f"kv_cache_gib must be > 0 (or None: the default), got {self.kv_cache_gib}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1 (or None: torch's default), got {self.threads}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1, got {self.limit}")
        if self.batch_size < 0:
            raise ValueError(f"batch_size must be >= 1 (0: {CPU_EVAL_BATCH} on the CPU, {GPU_EVAL_BATCH} on a GPU), "
                             f"got {self.batch_size}")
        if not self.retrieval_deadline_s > 0 or self.retrieval_deadline_s == float("inf"):
            raise ValueError(f"retrieval_deadline_s must be > 0, got {self.retrieval_deadline_s}")
        dtypes.check(self.dtype)
        devices.check_device(self.device)
        # what runs is recorded: a rollout given with sampling settings is evaluated (and saved) as greedy
        object.__setattr__(self, "rollout", greedy(self.rollout))

    def out_dir(self) -> Path:
        if self.out:
            return Path(self.out)
        return Path("runs") / "eval" / re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(self.model).name)

    def identity(self) -> dict[str, Any]:
        """The settings that must match on resume; `dtype` as resolved on this machine, so a run resumed on a
        machine where `auto` means another dtype is refused instead of mixing precisions."""
        identity = {f.name: to_dict(getattr(self, f.name)) for f in dataclasses.fields(self) if f.metadata.get("identity")}
        identity.update({name: getattr(self.rollout, name) for name in ROLLOUT_IDENTITY})
        identity["dtype"] = devices.place(self.device, self.dtype).dtype
        return identity


def load_tasks(config: EvalConfig) -> list[EvalTask]:
    """The questions of a run, benchmark by benchmark, the first `limit` of each."""
    files: dict[str, Path] = {}
    if config.benchmarks or not config.qa_files:
        files.update(load_suite(config.data).eval_files(config.benchmarks or None))
    for path in config.qa_files:
        name = Path(path).name.split(".")[0]
        if name in files:
            raise ValueError(f"two QA files are both named {name!r}; rename one (the benchmark name is the file stem)")
        files[name] = Path(path)
    if not files:
        raise ValueError("nothing to evaluate: the data suite has no benchmark files and no --qa file was given")
    tasks = []
    for name, path in files.items():
        questions = read_questions(path)
        tasks.extend(EvalTask(name, q) for q in questions[: config.limit])
    return tasks


def read_items(path: str | os.PathLike, *, repair: bool = False) -> list[EvalItem]:
    """The records of an items file. A last line cut short by an interruption is skipped (with `repair`,
    also removed from the file, so that appending continues cleanly); a bad line elsewhere is an error."""
    path = Path(path)
    if not path.exists():
        return []
    if path.suffix == ".gz":  # an archived run (e.g. committed results): read-only
        raw, repair = gzip.decompress(path.read_bytes()), False
    else:
        raw = path.read_bytes()
    lines = raw.split(b"\n")
    items, good_bytes = [], 0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            good_bytes += len(line) + 1
            continue
        try:
            items.append(EvalItem.from_json(json.loads(line)))
        except (json.JSONDecodeError, KeyError, ValueError) as e:
            if number == len(lines):  # no newline after it: the write was interrupted
                log.warning("%s: skipping an incomplete last record (%s)", path, e)
                if repair:
                    with open(path, "r+b") as f:
                        f.truncate(good_bytes)
                break
            raise DataError(path, number, f"unreadable eval record ({e}); delete the line or rerun with --overwrite") from None
        good_bytes += len(line) + 1
    return items


def _append_items(path: Path, items: Sequence[EvalItem]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        for item in items:
            f.write(json.dumps(item.to_json(), ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _check_resume(out: Path, config: EvalConfig, overwrite: bool) -> None:
    saved = out / CONFIG_FILE
    if overwrite:
        for name in (ITEMS_FILE, SUMMARY_JSON, SUMMARY_MD, VIEWER_FILE):
            (out / name).unlink(missing_ok=True)
    elif saved.exists() and (out / ITEMS_FILE).exists():
        before = json.loads(saved.read_text()).get("identity", {})
        before.setdefault("prompt", to_dict(PromptStyle()))  # written before the setting: the chat template
        changed = {k: (before.get(k), v) for k, v in config.identity().items() if before.get(k) != v}
        if changed:
            detail = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items())
            raise ValueError(f"{out} holds an evaluation with other settings ({detail}); "
                             "use another --out, or --overwrite to start it again")
    out.mkdir(parents=True, exist_ok=True)
    _write_atomic(saved, json.dumps({"identity": config.identity(), "config": to_dict(config),
                                     "dtype": devices.place(config.device, config.dtype).to_dict()}, indent=2) + "\n")


def open_retriever(config: EvalConfig) -> Retriever:
    return retrieval.open_retriever(config.retriever, load_suite(config.data),
                                    client=retrieval.ClientConfig(deadline_s=config.retrieval_deadline_s))


def run_eval(
    config: EvalConfig,
    *,
    overwrite: bool = False,
    backend: GenerationBackend | None = None,
    retriever: Retriever | None = None,
) -> EvalSummary:
    """Evaluate, resuming whatever `config.out_dir()` already holds, and write the summary files.

    `backend` / `retriever` default to those `config` names (the cached vLLM engine, the suite's BM25)."""
    out = config.out_dir()
    _check_resume(out, config, overwrite)
    tasks = load_tasks(config)
    items_path = out / ITEMS_FILE
    done = {item.key for item in read_items(items_path, repair=True)}
    pending = [t for t in tasks if (t.benchmark, t.question.id) not in done]
    log.info("%d questions in %d benchmarks; %d already done, %d to run",
             len(tasks), len({t.benchmark for t in tasks}), len(tasks) - len(pending), len(pending))
    if pending:
        own_retriever = retriever is None
        retriever = retriever or open_retriever(config)
        backend = backend or _load_backend(config)
        engine = RolloutEngine(backend, retriever, config.rollout, prompt=config.prompt)
        started = time.perf_counter()
        throughput = Throughput()
        batch_size = eval_batch_size(config)
        with tqdm(total=len(pending), desc="eval", unit="q", disable=not config.progress) as bar:
            def on_batch(new: list[EvalItem]) -> None:
                _append_items(items_path, new)
                bar.update(len(new))

            # Longer questions together would pad less, but input order keeps resume and logs simple.
            evaluate_tasks(engine, pending, batch_size=batch_size, on_batch=on_batch, throughput=throughput)
        log.info("evaluated %d questions in %.0f s: %s", len(pending), time.perf_counter() - started,
                 throughput.line())
        _write_atomic(out / THROUGHPUT_FILE, json.dumps({**throughput.to_dict(), "backend": config.backend,
                                                         "batch_size": batch_size}, indent=2) + "\n")
        if own_retriever:
            retriever.close()
    _write_atomic(out / PLACEMENTS_FILE, json.dumps(
        {"models": devices.placements(), "off_device": devices.off_device()}, indent=2) + "\n")
    return write_summary(out, tasks)


def eval_batch_size(config: EvalConfig) -> int:
    """Questions per batched rollout: the setting, or by device (a GPU decodes a larger batch for the price
    of a small one: it reads the weights once per step for the whole batch)."""
    if config.batch_size:
        return config.batch_size
    return GPU_EVAL_BATCH if devices.place(config.device, config.dtype).accelerator else CPU_EVAL_BATCH


def _load_backend(config: EvalConfig) -> GenerationBackend:
    backend = load_backend(BackendConfig(
        backend=config.backend, model=config.model, dtype=config.dtype, device=config.device,
        max_model_len=max(4096, config.rollout.max_context_tokens), kv_cache_gib=config.kv_cache_gib, threads=config.threads,
        # an evaluation's engine shares its GPU with no trainer: it takes most of it unless told
        engine=dataclasses.replace(config.engine, gpu_memory_utilization=config.engine.gpu_memory_utilization
                                   or STANDALONE_UTILIZATION),
    ))
    if isinstance(backend, VllmServerBackend) and backend.info.root != resolve_model(config.model, config.dtype):
        log.warning("the policy server at %s serves %s, and this evaluation names %s: the results are the served "
                    "model's (the two share a tokenizer)", backend.url, backend.info.root, config.model)
    return backend


def write_summary(out: Path, tasks: Sequence[EvalTask] | None = None) -> EvalSummary:
    """Recompute the summary of `out/items.jsonl` (restricted to `tasks` when given) and write
    `summary.json`, `summary.md` and `viewer.html`."""
    items = read_items(out / ITEMS_FILE)
    order = list(dict.fromkeys(t.benchmark for t in tasks)) if tasks is not None else None
    if tasks is not None:
        wanted = {(t.benchmark, t.question.id) for t in tasks}
        items = [i for i in items if i.key in wanted]
    summary = summarize(items, order)
    _write_atomic(out / SUMMARY_JSON, json.dumps(to_dict(summary), indent=2) + "\n")
    _write_atomic(out / SUMMARY_MD, summary_markdown(summary, f"Evaluation: {out.name}"))
    write_viewer(items, out / VIEWER_FILE, title=f"Evaluation: {out.name}")
    return summary


def read_summary(path: str | os.PathLike) -> EvalSummary:
    """A summary.json back as an EvalSummary."""
    return from_dict(EvalSummary, json.loads(Path(path).read_text()))
