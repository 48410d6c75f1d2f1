"""One training run from configuration to report: `eviback train` and the demo call :func:`run_training`.

    from eviback.train.config import resolve_config
    from eviback.train.runner import run_training
    result = run_training(resolve_config("eviback", overrides=["max_steps=10"]), "runs/eviback")

Steps: prepare (or resume) the run directory; warm-start the policy (cached); open the retriever, the
generation engine and, for EviBack, the teacher; train with :class:`~eviback.train.grpo.EviBackTrainer`,
logging every step; save the final policy; evaluate it on held-out questions; draw the report.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eviback import dtype as dtypes
from eviback.data import load_suite, read_training_questions
from eviback.train.config import TrainConfig
from eviback.train.run import RunDir

log = logging.getLogger(__name__)

# TRL's log keys -> eviback's namespaced metric keys
TRL_KEYS = {"loss": "train/loss", "kl": "train/kl", "grad_norm": "train/grad_norm",
            "entropy": "train/entropy", "reward": "train/reward",
            "clip_ratio/region_mean": "train/clip_ratio", "step_time": "time/step",
            "completions/clipped_ratio": "rollout/length_cut_share",
            # |trainer log-prob - engine log-prob| over the sampled tokens (behaviour-policy mismatch)
            "sampling/sampling_logp_difference/mean": "train/engine_logp_diff_mean",
            "sampling/sampling_logp_difference/max": "train/engine_logp_diff_max",
            "sampling/importance_sampling_ratio/min": "train/is_ratio_min",
            "sampling/importance_sampling_ratio/mean": "train/is_ratio_mean",
            "sampling/importance_sampling_ratio/max": "train/is_ratio_max"}


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    final_model: Path
    steps: int
    resumed_from: int | None
    eval_summary: Any | None  # eviback.evaluate.EvalSummary when held-out benchmarks were evaluated
    report: Path
    start_summary: Any | None = None  # the starting policy (the warm start) on the same questions


class Precision(enum.StrEnum):
    """How the trainer computes, from `dtype` and the device."""

    MASTERS = "bf16 model + fp32 masters"  # CPU, bfloat16: bf16 forward/backward, fp32 sums and AdamW
    AUTOCAST = "fp32 model + bf16 autocast"  # GPU, bfloat16: accelerate's mixed precision
    FLOAT32 = "float32"


def training_precision(dtype: str, cuda: bool) -> Precision:
    """CPUs with bf16 instructions run a bf16 copy fastest (autocast there is about half as fast); on GPUs
    accelerate's mixed precision is the usual, well-tested way."""
    if dtype == "float32":
        return Precision.FLOAT32
    return Precision.AUTOCAST if cuda else Precision.MASTERS


def check_teacher(config: TrainConfig) -> dict[str, Any] | None:
    """The teacher policy's identity and evidence-boundary verdict (None when the mode has no teacher).

    A policy whose status stage sees the gold answers is refused unless `allow_leaky_teacher` is set:
    EviBack's claim rests on a gold-blind Stage A, and a leaky policy must never run by accident. The oracle
    (its status is the evidence label, computed from the gold) is such a policy: the `eviback-oracle` preset
    opts in, and the record says `"oracle": true`."""
    if config.backoff.mode.value != "eviback":
        return None
    from eviback.teacher import load_policy

    policy = load_policy(config.teacher.policy)
    violations = list(policy.boundary_violations())
    if violations and not config.teacher.allow_leaky:
        opt_in = ("the eviback-oracle preset does" if policy.is_oracle
                  else "the eviback-single-prompt preset does")
        raise ValueError(
            f"teacher policy {config.teacher.policy!r} (version {policy.short_version}) breaks the evidence boundary: "
            f"{'; '.join(violations)}. EviBack needs a status stage that never sees the gold answers; to run "
            f"this policy on purpose as a baseline, set allow_leaky_teacher=true ({opt_in})")
    if policy.is_oracle:
        log.warning("teacher %r is an ORACLE: its status is the evidence label, computed from the gold answers. "
                    "This run measures the ceiling of teacher backoff, not a teacher", policy.name)
    return {"policy": config.teacher.policy, "name": policy.name, "version": policy.version,
            "boundary_compliant": not violations, "boundary_violations": violations,
            "allowed_leaky": bool(violations), "oracle": policy.is_oracle}


def teacher_is_oracle(config: TrainConfig) -> bool:
    """Whether the run's teacher is an oracle (it reads the gold answers to decide the status)."""
    if config.backoff.mode.value != "eviback":
        return False
    from eviback.teacher import load_policy

    return load_policy(config.teacher.policy).is_oracle


def initial_policy(config: TrainConfig) -> str:
    """The checkpoint GRPO starts from: the (cached) warm start, or the base model itself."""
    from eviback.policy import resolve_model

    if not config.warm_start:
        return resolve_model(config.model, "float32")
    from eviback.train.sft import WarmStartConfig

    warm = WarmStartConfig(
        model=config.model, data=config.data, retriever=config.retriever,
        max_examples=config.warm_start_examples, topk=config.rollout.topk,
        max_obs_tokens=config.rollout.max_observation_tokens,
        seed=config.build_seed, dtype=config.dtype,
    )
    # Fine-tuning peaks at several GB that the allocator keeps after it returns: train in a child process,
    # so that memory is given back before the engine, the trainer and the teacher load. The child saves the
    # model in the cache and writes its directory to `answer`.
    level = logging.getLogger().getEffectiveLevel()
    with tempfile.TemporaryDirectory() as tmp:
        answer = Path(tmp) / "path"
        code = (f"from eviback.train.runner import _warm_start_child; "
                f"_warm_start_child({warm.to_dict()!r}, {level}, {str(answer)!r})")
        done = subprocess.run([sys.executable, "-c", code], check=False)
        if done.returncode != 0:
            raise RuntimeError(f"the warm start failed in its process (exit code {done.returncode}); its error "
                               "is printed above")
        return answer.read_text()


def _warm_start_child(settings: dict, level: int, answer: str) -> None:
    """The warm start of `initial_policy`, in its own process (settings: a WarmStartConfig as a dict); the
    trained model's directory is written to the file `answer`."""
    from eviback.cli import configure_logging
    from eviback.train.sft import WarmStartConfig, warm_start

    configure_logging(level)
    Path(answer).write_text(str(warm_start(WarmStartConfig(**settings))))


def load_policy_for_training(path: str, precision: Precision, resume_from: Path | None):  # noqa: ANN201
    """(model, master) for `precision`: with masters the model is a bf16 copy trained with fp32 master
    weights (pure bf16 updates lose lr-sized changes); otherwise the fp32 model itself and no master. A
    resumed run restores the masters saved in its checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    from eviback.train.grpo import MASTER_WEIGHTS

    master = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if precision is not Precision.MASTERS:
        return master, None
    if resume_from is not None:
        saved = resume_from / MASTER_WEIGHTS
        if saved.exists():
            from safetensors.torch import load_model

            load_model(master, saved)
        else:
            log.warning("%s has no fp32 master weights; resuming from its bf16 weights", resume_from)
            master = AutoModelForCausalLM.from_pretrained(resume_from, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    return model, master


def teacher_policy(config: TrainConfig):  # noqa: ANN201 - an eviback.teacher.TeacherPolicy
    """The teacher policy a run uses: `config.teacher.policy`, except for a local teacher on the two-stage policy,
    whose Stage B is the extractive rule by default (`teacher_stage_b=extractive`: the two-stage-extractive
    policy, no model) and whose Stage A is the trained evidence judge by default (`teacher_stage_a=judge`:
    built from the run's training questions on first use, then cached). A served (http) teacher keeps the
    policy as named. `teacher_span_words` > 0 bounds every extractive stage at that many words."""
    from eviback.teacher import load_policy

    t = config.teacher
    policy = load_policy(t.policy)
    if t.backend == "local" and t.policy == "two-stage":
        if t.stage_b == "extractive":
            policy = load_policy("two-stage-extractive")
            log.info("teacher: Stage B is the extractive span of the evidence the actor saw (teacher_stage_b="
                     "prompted keeps the LLM Stage B)")
        if t.stage_a == "judge":
            from eviback.teacher.evidence_judge import EvidenceJudgeConfig, build_judge, judge_policy

            judge = build_judge(EvidenceJudgeConfig(
                data=config.data, train_files=tuple(config.train_files), max_questions=t.judge_max_questions,
                epochs=t.judge_epochs, topk=config.rollout.topk, max_obs_tokens=config.rollout.max_observation_tokens,
                seed=config.build_seed))
            log.info("teacher: the trained evidence judge %s as Stage A (teacher_stage_a=prompted keeps the "
                     "prompted Stage A)", judge.sha256[:12])
            warn_if_uninformative(judge.path)
            policy = judge_policy(judge.sha256, base=policy)
    if t.span_words:
        from eviback.teacher.extractive import with_max_words

        policy = with_max_words(policy, t.span_words)
    return policy


def warn_if_uninformative(judge_dir: Path, min_kappa: float = 0.1) -> bool:
    """Warn when a judge's own held-out training questions show it at chance (kappa below `min_kappa`, e.g.
    one status for everything): its Stage A then passes every rollout on to Stage B and carries no
    evidence signal. Returns whether it warned."""
    import json

    from eviback.teacher.evidence_judge import JUDGE_FILE

    record = Path(judge_dir) / JUDGE_FILE
    if not record.exists():
        return False
    heldout = json.loads(record.read_text()).get("heldout") or {}
    kappa = heldout.get("kappa")
    if kappa is None or kappa >= min_kappa:
        return False
    log.warning("the evidence judge %s is at chance on its held-out training questions (kappa %.2f, n %s): its "
                "Stage A verdicts carry no evidence signal. Build a larger one (`eviback build-judge`, more "
                "questions or epochs; judge_max_questions / judge_epochs here)", Path(judge_dir).name, kappa,
                heldout.get("n"))
    return True


def teacher_config(config: TrainConfig):  # noqa: ANN201 - an eviback.teacher.TeacherConfig
    """The teacher's own configuration, from the run's teacher settings."""
    from eviback.teacher import HttpBackendConfig, JudgeConfig, TeacherConfig
    from eviback.teacher.local import LocalBackendConfig

    t = config.teacher
    return TeacherConfig(
        policy=t.policy,
        backend=t.backend,
        local=LocalBackendConfig(model=t.model, dtype=config.dtype),
        http=HttpBackendConfig(base_url=t.url, model="" if t.model == "smollm2-135m" else t.model)
        if t.url else HttpBackendConfig(),
        judge=JudgeConfig(concurrency=t.concurrency),
    )


def open_teacher(config: TrainConfig):  # noqa: ANN201 - an eviback.teacher.Teacher or None
    if config.backoff.mode.value != "eviback":
        return None
    from eviback.teacher import build_teacher

    return build_teacher(teacher_config(config), policy=teacher_policy(config))


def run_training(config: TrainConfig, output: str | Path, *, resume: bool = False) -> TrainResult:  # noqa: C901
    """One run, in one process or several (torchrun / accelerate launch): every process rolls out, judges
    and trains on its own whole groups; the main process alone writes the run directory, saves the final
    policy and evaluates it."""
    import torch
    from accelerate import PartialState
    from trl import GRPOConfig

    from eviback.generation import BackendConfig, load_backend
    from eviback.policy import load_tokenizer
    from eviback.retrieval import open_retriever
    from eviback.rollout import RolloutEngine
    from eviback.train.gauges import cpu_gauges, cpu_snapshot, peak_rss_gb, process_gauges
    from eviback.train.grpo import (
        BehaviourCorrection,
        EviBackTrainer,
        compact_group_record,
        group_records,
        step_metrics,
        training_dataset,
    )
    from eviback.train.precision import MasterWeightAdamW

    teacher_record = check_teacher(config)  # a leaky policy is refused before anything is written
    # The process group under torchrun/accelerate (one process: nothing to set up). On CPU accelerate forms
    # the group only when told it is a CPU run, as TRL's Accelerator (use_cpu) is told later.
    state = PartialState(cpu=not torch.cuda.is_available())
    main = state.is_main_process
    run = RunDir(output)
    if main:
        resumed_from = run.start(config, resume)
        if teacher_record is not None:
            run.write_teacher(teacher_record)
    state.wait_for_everyone()  # the other processes read the directory only once it is prepared
    if not main:
        resumed_from = run.last_checkpoint_step()
    checkpoint = run.last_checkpoint()
    if resumed_from:
        log.info("resuming %s from step %d", run.root, resumed_from)
    if resumed_from is not None and resumed_from > config.max_steps:
        raise ValueError(f"{run.root} has a checkpoint at step {resumed_from}, past max_steps={config.max_steps}; "
                         f"resume with max_steps >= {resumed_from}")
    if resumed_from is not None and resumed_from == config.max_steps:
        log.info("%s already finished %d steps", run.root, resumed_from)
    torch.manual_seed(config.seed)

    suite = load_suite(config.data)
    questions = read_training_questions(suite, config.train_files)
    retriever = open_retriever(config.retriever, suite)
    with state.main_process_first():  # one process builds the cached warm start, the others reuse it
        policy_path = initial_policy(config)
    if main:
        write_start_record(run.start_path, policy_path)
    tokenizer = load_tokenizer(policy_path)
    dtype = dtypes.choose(config.dtype)
    precision = training_precision(dtype.dtype, torch.cuda.is_available())
    if main:
        earlier = run.write_dtype({**dtype.to_dict(), "precision": precision.value})
        if earlier is not None:
            log.warning("%s ran in %s before and resumes in %s here (%s): the steps from here on compute in "
                        "another precision", run.root, earlier["dtype"], dtype.dtype, dtype.reason)
    log.info("compute dtype %s (%s): %s", dtype.dtype, precision.value, dtype.reason)
    model, master = load_policy_for_training(policy_path, precision, checkpoint)
    if master is not None:
        optimizer = MasterWeightAdamW(model, master, lr=config.learning_rate, weight_decay=0.0)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=0.0)

    max_context = config.rollout.max_context_tokens
    # The engine holds its own copy of the policy, refreshed before each rollout step: the trainer's model
    # runs in training mode (and, on GPUs, with gradient checkpointing), which generation must not share.
    # Its KV cache is sized to one step's rollouts (train/memory.py) instead of vLLM's CPU default of 2 GiB.
    from eviback.train.memory import rollout_kv_cache_gib

    kv_cache = rollout_kv_cache_gib(config.rollout.group_size * config.questions_per_step, max_context, policy_path,
                                    dtype.dtype)
    backend = load_backend(BackendConfig(backend=config.backend, model=policy_path, dtype=dtype.dtype,
                                         max_model_len=max(2048, max_context), kv_cache_gib=kv_cache))
    # The run's own rollout settings, with the context cap lowered to what the backend holds
    engine = RolloutEngine(backend, retriever, dataclasses.replace(
        config.rollout, max_context_tokens=min(backend.max_context, max_context)))

    start_summary = None
    if main and config.eval_benchmarks and config.eval_warm_start:
        # The engine holds the starting policy now: evaluate it on the held-out questions the trained policy
        # will be evaluated on (resumable, so a resumed run does not redo it).
        from eviback.evaluate import run_eval

        log.info("evaluating the starting policy on the held-out questions")
        start_summary = run_eval(held_out_eval_config(config, run.eval_start_dir, policy_path,
                                                      max_context_tokens=engine.config.max_context_tokens),
                                 backend=backend, retriever=retriever)
    with state.main_process_first():  # one process builds the cached evidence judge, the others reuse it
        teacher = open_teacher(config)
    if main and teacher is not None:
        # what judged this run: the policy actually loaded (e.g. the two-stage policy with the trained judge)
        run.write_teacher({**(teacher_record or {}), "policy_used": teacher.policy.name,
                           "version_used": teacher.policy.version,
                           "boundary_violations_used": list(teacher.policy.boundary_violations()),
                           "oracle_used": teacher.policy.is_oracle,
                           # the whole policy: it may be composed for the run (judge, extractive Stage B)
                           "policy_used_content": json.loads(teacher.policy.canonical_json())})

    pending: dict[int, dict[str, Any]] = {}
    backoff = config.backoff

    def on_step(outcome) -> None:  # noqa: ANN001 - a StepOutcome (called on the main process only)
        pending[outcome.step] = step_metrics(outcome, backoff)
        records = group_records(outcome)
        run.log_groups(compact_group_record(r) for r in records)
        run.log_rollouts(outcome.step, records, config.keep_rollout_steps)

    from transformers import TrainerCallback

    class LogCallback(TrainerCallback):
        """Merge TRL's per-step logs with the step's rollout metrics into one metrics.jsonl record."""

        def __init__(self) -> None:
            self.step_started = time.perf_counter()
            self.cpu_started = cpu_snapshot()

        def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            self.step_started = time.perf_counter()
            self.cpu_started = cpu_snapshot()

        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001, ANN201
            if not main or not logs or "loss" not in logs:
                return
            record = pending.pop(state.global_step, {"step": state.global_step})
            for key, name in TRL_KEYS.items():
                if key in logs:
                    record[name] = logs[key]
            scheduler = kwargs.get("lr_scheduler")
            if scheduler is not None:
                record["train/learning_rate"] = scheduler.get_last_lr()[0]
            spent = sum(record.get(k) or 0.0 for k in ("time/rollout", "time/retrieval", "time/teacher",
                                                         "time/weight_sync"))
            record["time/step"] = time.perf_counter() - self.step_started
            record["time/update"] = max(0.0, record["time/step"] - spent)
            record["memory/peak_rss_gb"] = round(peak_rss_gb(), 3)
            record.update(process_gauges())
            record.update(cpu_gauges(self.cpu_started, cpu_snapshot()))  # was the machine this run's alone?
            record["run/dir_mb"] = run.size_mb()
            record["processes"] = state_processes
            run.log_metrics(record)
            log.info("step %d/%d  em %.3f  all-zero %.2f  fallback %d (informative %d)  loss %.4f  %.0fs",
                     state.global_step, config.max_steps, record.get("rollout/em", 0),
                     record.get("backoff/all_zero_share", 0), record.get("backoff/fallback_groups", 0),
                     record.get("backoff/informative_fallback_groups", 0),
                     record.get("train/loss", 0), record["time/step"])

    state_processes = state.num_processes
    # On CPU one rollout per pass: the eviback preset's peak fell from 15.4 to 10.3 GB at the same update
    # time (results/update.md); on a GPU one group per pass keeps the matmuls large.
    rows = config.micro_batch_rows or (config.rollout.group_size if torch.cuda.is_available() else 1)
    args = GRPOConfig(
        output_dir=str(run.checkpoints),
        # One optimiser step per generation batch (questions_per_step groups), scored in micro-batches of
        # `rows` rollouts.
        per_device_train_batch_size=rows,
        gradient_accumulation_steps=config.questions_per_step * config.rollout.group_size // rows,
        num_generations=config.rollout.group_size,
        max_steps=config.max_steps,
        learning_rate=config.learning_rate,
        lr_scheduler_type="constant",
        beta=config.beta,
        loss_type=config.loss_type,
        temperature=config.rollout.temperature,  # TRL scales logits by it when computing log-probabilities
        top_p=config.rollout.top_p,
        max_completion_length=max_context,
        max_grad_norm=config.max_grad_norm,
        save_strategy="steps",
        save_steps=config.save_steps,
        save_total_limit=config.save_total_limit,
        logging_steps=1,
        report_to=config.report_to or "none",
        seed=config.seed,
        use_cpu=not torch.cuda.is_available(),
        # CPU: precision is the bf16 copy + fp32 masters, not autocast; GPU: accelerate's bf16 autocast
        bf16=precision is Precision.AUTOCAST,
        fp16=False,
        remove_unused_columns=False,
        gradient_checkpointing=config.gradient_checkpointing,
        disable_tqdm=False,
    )
    trainer = EviBackTrainer(
        engine=engine,
        questions={q.id: q for q in questions},
        backoff=backoff,
        judge_groups=teacher.judge_groups if teacher is not None else None,
        on_step=on_step,
        push_weights=True,
        master=master,
        rollout_seed=config.seed,
        correction=BehaviourCorrection(enabled=config.is_correction, cap=config.is_cap,
                                       mode=f"{config.is_level}_truncate"),
        model=model,
        args=args,
        train_dataset=training_dataset(questions),
        processing_class=tokenizer,
        optimizers=(optimizer, None),
        callbacks=[LogCallback()],
    )
    started = time.perf_counter()
    trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    log.info("trained %d steps in %.0f s", trainer.state.global_step, time.perf_counter() - started)
    if teacher is not None:
        teacher.close()

    summary = None
    if main:
        final = master if master is not None else model
        final.save_pretrained(run.final)
        tokenizer.save_pretrained(run.final)
        if config.eval_benchmarks:
            from eviback.evaluate import run_eval

            backend.update_weights(model.named_parameters())
            summary = run_eval(held_out_eval_config(config, run.eval_dir, str(run.final),
                                                    max_context_tokens=engine.config.max_context_tokens),
                               backend=backend, retriever=retriever)
        write_run_report(run, summary, start_summary)
    state.wait_for_everyone()
    if main:
        run.unlock()
    return TrainResult(run.root, run.final, trainer.state.global_step, resumed_from, summary, run.report,
                       start_summary)


def write_start_record(path: Path, policy_path: str) -> None:
    """Which policy a run started from, by name and by a hash of its weights: runs compared as "from the same
    warm start" can be checked to be so, even when the warm start was rebuilt on another machine."""
    from eviback.train.sft import model_fingerprint

    path.write_text(json.dumps({"policy": Path(policy_path).name, "fingerprint": model_fingerprint(policy_path)},
                               indent=2) + "\n")


def held_out_eval_config(config: TrainConfig, out: str | Path, model: str, **overrides: Any):  # noqa: ANN201
    """The EvalConfig of a run's held-out evaluation: its benchmarks and limit, with its rollout settings."""
    from eviback.evaluate import EvalConfig

    return EvalConfig(
        out=str(out), data=config.data, benchmarks=tuple(config.eval_benchmarks), limit=config.eval_limit,
        model=model, backend=config.backend, dtype=dtypes.resolve(config.dtype), retriever=config.retriever,
        topk=config.rollout.topk, max_turns=config.rollout.max_turns, max_turn_tokens=config.rollout.max_turn_tokens,
        max_observation_tokens=config.rollout.max_observation_tokens, **overrides,
    )


def write_run_report(run: RunDir, summary: Any | None, start_summary: Any | None = None) -> Path:
    """The run's HTML report: training curves, and the held-out evaluation (beside the starting policy's,
    when it was evaluated) as an HTML table."""
    from eviback.train.plots import write_report

    extra = ""
    if summary is not None:
        from eviback.evaluate import comparison_html

        tables = {"start": start_summary, "trained": summary} if start_summary is not None else {"trained": summary}
        extra = ("<h2>Held-out evaluation</h2>" + comparison_html(tables)
                 + "<p><a href='eval/viewer.html'>Trajectories of the evaluation, turn by turn</a></p>")
    return write_report([run.root], run.root, extra_html=extra)
