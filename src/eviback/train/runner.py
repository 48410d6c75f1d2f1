"""One training run from configuration to report: `eviback train` and the demo call :func:`run_training`.

    from eviback.train.config import resolve_config
    from eviback.train.runner import run_training
    result = run_training(resolve_config("eviback", overrides=["max_steps=10"]), "runs/eviback")

Steps, one function each: :func:`prepare_run` (or resume) the run directory; :func:`build_training`:
warm-start the policy (cached), open the retriever and the generation engine; :func:`evaluate_start`;
open the teacher (EviBack); :func:`make_trainer`: an :class:`~eviback.train.grpo.EviBackTrainer` on
:func:`trl_arguments`, logging every step (:class:`~eviback.train.step_log.StepLog`); train, closing the
teacher however training ends; :func:`finish_run`: save the final policy, evaluate it on held-out questions,
draw the report.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eviback import device as devices
from eviback.data import load_suite, read_training_questions
from eviback.device import Placement, off_device, pin_trainer, place, placements, record
from eviback.disk import RunFootprint, checkpoint_parameters
from eviback.evaluate import EvalConfig, EvalSummary, comparison_html, run_eval
from eviback.generation import VLLM_SERVER, BackendConfig, load_backend
from eviback.generation.base import GenerationBackend, push_weights, sleep_backend
from eviback.generation.memory import ModelShape, cpu_rollout_kv_cache_gib, engine_share
from eviback.generation.server import VllmServerBackend
from eviback.log_format import configure_logging, quiet
from eviback.policy import load_tokenizer, resolve_model
from eviback.retrieval import ClientConfig, open_retriever
from eviback.retrieval.base import Retriever
from eviback.retrieval.client import RetrieverUnavailable
from eviback.rollout import RolloutConfig, RolloutEngine
from eviback.teacher import Teacher, TeacherPolicy, build_teacher, load_policy
from eviback.teacher.evidence_judge import judge_policy
from eviback.teacher.extractive import with_max_words
from eviback.train import lora
from eviback.train.config import TrainConfig
from eviback.train.judge_builder import EvidenceJudgeConfig, build_judge, check_stage_a, stage_a_record
from eviback.train.launch import check_launch
from eviback.train.memory import release_free_heap, trainer_bytes
from eviback.train.plots import write_report
from eviback.train.run import RunDir
from eviback.train.sft import WarmStartConfig, model_fingerprint, warm_start
from eviback.train.step_bar import keep_bar_only
from eviback.types import Question

# torch, transformers, TRL and accelerate (and the trainer modules built on them: grpo, step_log, masters,
# precision) take seconds to import: they are imported where a run first needs them, so that `eviback train`
# checks its settings and refuses a bad one at once.
if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch
    from accelerate import PartialState
    from transformers import PreTrainedModel, PreTrainedTokenizerBase
    from trl import GRPOConfig

    from eviback.train.grpo import EviBackTrainer

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    final_model: Path
    steps: int
    resumed_from: int | None
    eval_summary: EvalSummary | None  # when held-out benchmarks were evaluated
    report: Path
    start_summary: EvalSummary | None = None  # the starting policy (the warm start) on the same questions
    main: bool = True  # this is the main process (the one that wrote the run directory)


class Precision(enum.StrEnum):
    """How the trainer computes, from `dtype` and the device."""

    MASTERS = "bf16 model + fp32 masters"  # CPU, bfloat16: bf16 forward/backward, fp32 sums and AdamW
    AUTOCAST = "fp32 model + bf16 autocast"  # GPU, bfloat16: accelerate's mixed precision
    FLOAT32 = "float32"
    # LoRA, bfloat16: the frozen base in bf16, PEFT's adapter in fp32 (its own master copy; train/lora.py); on a
    # GPU under accelerate's bf16 autocast, on a CPU without (as MASTERS computes)
    LORA = "bf16 frozen base + fp32 LoRA adapter"


def training_precision(dtype: str, cuda: bool, lora: bool = False) -> Precision:
    """CPUs with bf16 instructions run a bf16 copy fastest (autocast there is about half as fast); on GPUs
    accelerate's mixed precision is the usual, well-tested way. With LoRA (`lora`) only the adapter trains: it
    is fp32 and the base, which never changes, stays in bf16 on either device."""
    if dtype == "float32":
        return Precision.FLOAT32
    if lora:
        return Precision.LORA
    return Precision.AUTOCAST if cuda else Precision.MASTERS


def check_teacher(config: TrainConfig) -> dict[str, Any] | None:
    """The teacher policy's identity and evidence-boundary verdict (None when the mode has no teacher).

    A policy whose status stage sees the gold answers is refused unless `allow_leaky_teacher` is set:
    EviBack's claim rests on a gold-blind Stage A, and a leaky policy must never run by accident. The oracle
    (its status is the evidence label, computed from the gold) is such a policy: the `eviback-oracle` preset
    opts in, and the record says `"oracle": true`."""
    if config.backoff.mode.value != "eviback":
        return None

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

    return load_policy(config.teacher.policy).is_oracle


def initial_policy(config: TrainConfig) -> str:
    """The checkpoint GRPO starts from: the (cached) warm start, or the base model itself."""

    if not config.warm_start:
        return resolve_model(config.model, "float32")

    warm = warm_start_config(config)
    # a tokenizer the prompt style cannot serve is refused here, in one line, not in the warm start's process
    config.prompt.check(load_tokenizer(config.model, "float32"), config.model)
    # Fine-tuning peaks at several GB that the allocator keeps after it returns: train in a child process,
    # so that memory is given back before the engine, the trainer and the teacher load. The child saves the
    # model in the cache and writes its directory to `answer`.
    level = logging.getLogger().getEffectiveLevel()
    with tempfile.TemporaryDirectory() as tmp:
        answer = Path(tmp) / "path"
        code = (f"from eviback.train.runner import _warm_start_child; "
                f"_warm_start_child({warm.to_dict()!r}, {level}, {str(answer)!r})")
        done = subprocess.run([sys.executable, "-c", code], check=False)
        unavailable = answer.with_suffix(UNAVAILABLE_SUFFIX)
        if done.returncode != 0 and unavailable.exists():  # said by the command, with how to resume
            raise RetrieverUnavailable(*json.loads(unavailable.read_text()))
        if done.returncode != 0:
            raise RuntimeError(f"the warm start failed in its process (exit code {done.returncode}); its error "
                               "is printed above")
        return answer.read_text()


def warm_start_config(config: TrainConfig) -> WarmStartConfig:
    """The warm start of a run: its model, data and build seed, the rollouts' search settings and prompt style."""
    return WarmStartConfig(
        model=config.model, data=config.data, retriever=config.retriever,
        retrieval_deadline_s=config.retrieval_deadline_s,
        max_examples=config.warm_start_examples, topk=config.rollout.topk,
        max_observation_tokens=config.rollout.max_observation_tokens, prompt=config.prompt,
        seed=config.build_seed, dtype=config.dtype, device=config.device,
    )


UNAVAILABLE_SUFFIX = ".unavailable"  # the warm-start child's report of a retrieval service that did not answer


def _warm_start_child(settings: dict, level: int, answer: str) -> None:
    """The warm start of `initial_policy`, in its own process (settings: a WarmStartConfig as a dict); the
    trained model's directory is written to the file `answer`. A retrieval service that does not answer until
    the deadline is written beside it (no traceback), for the parent to raise again."""

    configure_logging(level)
    try:
        Path(answer).write_text(str(warm_start(WarmStartConfig(**settings))))
    except RetrieverUnavailable as e:
        Path(answer).with_suffix(UNAVAILABLE_SUFFIX).write_text(json.dumps([e.url, e.last_error, e.attempts,
                                                                            e.waited_s]))
        raise SystemExit(e.exit_code) from None


def load_policy_for_training(path: str, precision: Precision,
                             resume_from: Path | None) -> tuple[PreTrainedModel, PreTrainedModel | None]:
    """(model, master) for `precision`: with masters the model is a bf16 copy trained with fp32 master
    weights (pure bf16 updates lose lr-sized changes); otherwise the fp32 model itself and no master. A
    resumed run loads its checkpoint's weights (what the engine is first given, e.g. a policy server) and
    restores the masters saved there; the trainer loads the checkpoint again when it resumes, to the same
    values. LoRA: the frozen base in bf16 (`Precision.LORA`) or fp32; a LoRA checkpoint holds the adapter
    alone, which the trainer puts on the model and loads, so `resume_from` is None for a LoRA run."""
    import torch
    from transformers import AutoModelForCausalLM

    from eviback.train.masters import MASTER_WEIGHTS

    if precision is Precision.LORA:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16), None
    source = str(resume_from) if resume_from is not None else path
    if precision is not Precision.MASTERS:
        return AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32), None
    master = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if resume_from is not None:
        saved = resume_from / MASTER_WEIGHTS
        if saved.exists():
            from safetensors.torch import load_model

            load_model(master, saved)
        else:
            log.warning("%s has no fp32 master weights; resuming from its bf16 weights", resume_from)
            master = AutoModelForCausalLM.from_pretrained(resume_from, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    return model, master


def teacher_policy(config: TrainConfig) -> TeacherPolicy:
    """The teacher policy a run uses: `config.teacher.policy`, except for a local teacher on the two-stage policy,
    whose Stage B is the extractive rule by default (`teacher_stage_b=extractive`: the two-stage-extractive
    policy, no model) and whose Stage A is the trained evidence judge by default (`teacher_stage_a=judge`:
    built from the run's training questions on first use, then cached). A served (http) teacher keeps the
    policy as named. `teacher_span_words` > 0 bounds every extractive stage at that many words. A trained judge
    as Stage A that its own held-out questions show weak is refused (ValueError naming its figures and the fix)
    unless `accept_weak_judge` (:func:`eviback.train.judge_builder.check_stage_a`)."""

    t = config.teacher
    policy = load_policy(t.policy)
    if t.backend == "local" and t.policy == "two-stage":
        if t.stage_b == "extractive":
            policy = load_policy("two-stage-extractive")
            log.info("teacher: Stage B is the extractive span of the evidence the actor saw (teacher_stage_b="
                     "prompted keeps the LLM Stage B)")
        if t.stage_a == "judge":
            judge = build_judge(EvidenceJudgeConfig(
                data=config.data, train_files=tuple(config.train_files), max_questions=t.judge_max_questions,
                architecture=t.judge_architecture, epochs=t.judge_epochs, rollouts=tuple(t.judge_rollouts),
                topk=config.rollout.topk,
                max_observation_tokens=config.rollout.max_observation_tokens, seed=config.build_seed,
                base_model=t.judge_base_model, actor_model=config.model, device=config.device))
            log.info("teacher: the trained evidence judge %s as Stage A (teacher_stage_a=prompted keeps the "
                     "prompted Stage A)", judge.sha256[:12])
            policy = judge_policy(judge.sha256, base=policy)
    if t.span_words:
        policy = with_max_words(policy, t.span_words)

    # a trained judge as Stage A (built here, or named by a policy file) is refused when its own held-out
    # questions show it weak, unless accept_weak_judge
    check_stage_a(policy, accept_weak=t.accept_weak_judge, ref=t.policy, device=config.device)
    return policy


def open_teacher(config: TrainConfig) -> Teacher | None:
    if config.backoff.mode.value != "eviback":
        return None

    return build_teacher(config.teacher.teacher_config(config.dtype, config.device), policy=teacher_policy(config))


# --------------------------------------------------------------------------------------------------
# One run: prepare the directory, build what trains, train, finish


@dataclass(frozen=True)
class RunStart:
    """The run directory, prepared (or resumed), and the processes that train it."""

    state: PartialState  # the process group (one process: nothing set up)
    run: RunDir
    resumed_from: int | None  # the checkpoint step resumed from (None: a fresh run)
    checkpoint: Path | None  # the checkpoint directory resumed from
    placement: Placement  # where and in what every model of the run computes (the `device` and `dtype` settings)

    @property
    def main(self) -> bool:
        return self.state.is_main_process


@dataclass(frozen=True)
class Training:
    """What a run trains with: its questions, retriever, policy (and fp32 masters), optimiser and engine."""

    questions: list[Question]
    retriever: Retriever
    policy_path: str  # the checkpoint training starts from (the warm start)
    tokenizer: PreTrainedTokenizerBase
    precision: Precision
    model: PreTrainedModel  # the trained model (bf16 with masters on CPU)
    master: PreTrainedModel | None  # the fp32 master weights AdamW updates, or None
    # None with LoRA: AdamW over the adapter, built once TRL has put it on the model (make_trainer)
    optimizer: torch.optim.Optimizer | None
    backend: GenerationBackend  # the generation backend: the engine's own copy of the policy
    engine: RolloutEngine


def run_training(config: TrainConfig, output: str | Path, *, resume: bool = False) -> TrainResult:
    """One run, in one process or several (torchrun / accelerate launch): every process rolls out, judges
    and trains on its own whole groups; the main process alone writes the run directory, saves the final
    policy and evaluates it. The teacher is closed however training ends."""
    check_launch()  # FSDP / ZeRO-3 would shard the weights the generation engine is refreshed from
    teacher_record = check_teacher(config)  # a leaky policy is refused before anything is written
    # a policy server that cannot serve the run (down, wrong flags, another tokenizer, a CPU trainer) is refused
    # before anything is written
    server = connect_policy_server(config) if config.backend == VLLM_SERVER else None
    # a disk too small for the first checkpoint is refused before the judge, the warm start and the engine
    check_disk_first(config, output, resume)
    # The teacher before anything is written or warmed up: a weak evidence judge is refused now, not after the
    # warm start. Several processes may build the cached judge at once: its lock lets one build, the others reuse.
    teacher = open_teacher(config)
    try:
        start = prepare_run(config, output, resume, teacher_record)
        training = build_training(config, start, server)
        start_summary = evaluate_start(config, start, training)
        if start.main and teacher is not None:
            record_teacher(start.run, teacher_record, teacher)
        trainer = make_trainer(config, start, training, teacher)
        started = time.perf_counter()
        trainer.train(resume_from_checkpoint=str(start.checkpoint) if start.checkpoint else None)
        log.info("trained %d steps in %.0f s", trainer.state.global_step, time.perf_counter() - started)
    finally:
        if teacher is not None:
            teacher.close()
    summary = finish_run(config, start, training, start_summary, trainer.accelerator.unwrap_model(trainer.model))
    return TrainResult(start.run.root, start.run.final, trainer.state.global_step, start.resumed_from, summary,
                       start.run.report, start_summary, start.main)


def prepare_run(config: TrainConfig, output: str | Path, resume: bool,
                teacher_record: dict[str, Any] | None) -> RunStart:
    """Form the process group, and prepare (or resume) the run directory on the main process; the others
    wait for it, then read it."""
    from accelerate import PartialState

    # Where this process computes: its own GPU under torchrun/accelerate launch (LOCAL_RANK), decided once.
    placement = place(config.device, config.dtype)
    # The process group under torchrun/accelerate (one process: nothing to set up). On CPU accelerate forms
    # the group only when told it is a CPU run, as TRL's Accelerator (use_cpu) is told later.
    state = PartialState(cpu=not placement.accelerator)
    run = RunDir(output)
    if state.is_main_process:
        resumed_from = run.start(config, resume)
        if teacher_record is not None:
            run.write_teacher(teacher_record)
    state.wait_for_everyone()  # the other processes read the directory only once it is prepared
    if not state.is_main_process:
        resumed_from = run.last_checkpoint_step()
    checkpoint = run.last_checkpoint()
    if resumed_from:
        log.info("resuming %s from step %d", run.root, resumed_from)
    if resumed_from is not None and resumed_from > config.max_steps:
        raise ValueError(f"{run.root} has a checkpoint at step {resumed_from}, past max_steps={config.max_steps}; "
                         f"resume with max_steps >= {resumed_from}")
    if resumed_from is not None and resumed_from == config.max_steps:
        log.info("%s already finished %d steps", run.root, resumed_from)
    return RunStart(state, run, resumed_from, checkpoint, placement)


def build_training(config: TrainConfig, start: RunStart, server: VllmServerBackend | None = None) -> Training:
    """The questions, the retriever, the starting policy (warm-started, cached), the trainer's model and
    optimiser in the run's precision, and the rollout engine with its own copy of the policy."""
    import torch

    from eviback.train.precision import MasterWeightAdamW

    run, main = start.run, start.main
    torch.manual_seed(config.seed)
    suite = load_suite(config.data)
    questions = read_training_questions(suite, config.train_files)
    # a /retrieve service that stops answering is waited for until the deadline (commands/train.py then says
    # how to resume)
    retriever = open_retriever(config.retriever, suite,
                               client=ClientConfig(deadline_s=config.retrieval_deadline_s))
    with start.state.main_process_first():  # one process builds the cached warm start, the others reuse it
        policy_path = initial_policy(config)
    if main:
        write_start_record(run.start_path, policy_path, resuming=start.resumed_from is not None)
    tokenizer = load_tokenizer(policy_path)
    placement = start.placement
    dtype = placement.dtype_choice
    precision = training_precision(dtype.dtype, placement.accelerator, lora=config.lora.enabled)
    if main:
        earlier = run.write_dtype({**placement.to_dict(), "precision": precision.value})
        if earlier is not None:
            log.warning("%s ran in %s before and resumes in %s here (%s): the steps from here on compute in "
                        "another precision", run.root, earlier["dtype"], dtype.dtype, dtype.reason)
    log.info("compute dtype %s (%s) on %s: %s", dtype.dtype, precision.value, placement.device, dtype.reason)
    # a LoRA checkpoint holds the adapter alone: the base comes from the policy, the trainer loads the adapter
    model, master = load_policy_for_training(policy_path, precision,
                                             None if config.lora.enabled else start.checkpoint)
    optimizer: torch.optim.Optimizer | None
    if config.lora.enabled:
        log.info("%s: %d adapter parameters train, the model's %d stay frozen", config.lora.describe(),
                 lora.adapter_parameter_count(policy_path, config.lora), sum(p.numel() for p in model.parameters()))
        optimizer = None  # over the adapter, which TRL puts on the model (make_trainer)
    elif master is not None:
        optimizer = MasterWeightAdamW(model, master, lr=config.learning_rate, weight_decay=0.0)
    else:
        optimizer = adamw(model.parameters(), config.learning_rate, placement.accelerator)

    # The engine holds its own copy of the policy on the run's device, refreshed before each rollout step: the
    # trainer's model runs in training mode, in fp32 under autocast on a GPU and with gradient checkpointing on
    # large models, which generation must not share; a bf16 copy on the same GPU costs 2 bytes a parameter and
    # a device-to-device copy per step. Its KV cache is sized to one step's rollouts (train/memory.py) instead
    # of vLLM's CPU default of 2 GiB.
    rollout = config.rollout
    engine_settings = config.engine
    kv_cache = None
    if not placement.accelerator:
        kv_cache = cpu_rollout_kv_cache_gib(rollout.group_size * config.questions_per_step,
                                            rollout.max_context_tokens, policy_path, dtype.dtype)
    elif config.backend == "vllm" and engine_settings.gpu_memory_utilization is None:
        share = gpu_engine_share(config, policy_path, placement.device, sum(p.numel() for p in model.parameters()))
        log.info("%s", share.describe())
        engine_settings = dataclasses.replace(engine_settings, gpu_memory_utilization=share.utilization)
    backend = server or load_backend(BackendConfig(backend=config.backend, model=policy_path, dtype=dtype.dtype,
                                                   device=placement.device,
                                                   max_model_len=max(2048, rollout.max_context_tokens),
                                                   kv_cache_gib=kv_cache, engine=engine_settings))
    if server is not None:
        # The server holds the model it was started with: the run's policy goes in (a resumed run's model holds
        # its checkpoint's weights), each tensor staged on the trainer's GPU for NCCL on its way.
        push_weights(server, model, start.state, device=placement.device)
    engine = rollout_engine(config, backend, retriever)
    return Training(questions, retriever, policy_path, tokenizer, precision, model, master, optimizer, backend,
                    engine)


def adamw(parameters: Iterable[torch.nn.Parameter], learning_rate: float, accelerator: bool) -> torch.optim.AdamW:
    """The run's AdamW (no weight decay, as Search-R1) over `parameters`: the model's, or a LoRA adapter's. Fused on
    a GPU: one kernel per step, no transient copy of the parameters (foreach AdamW holds one the size of a
    parameter group: 16 GB more at the peak of a 4B update)."""
    import torch

    return torch.optim.AdamW(parameters, lr=learning_rate, weight_decay=0.0, fused=accelerator or None)


def check_disk_first(config: TrainConfig, output: str | Path, resume: bool) -> None:
    """Before any work (the judge, the warm start, the engine): refuse a run whose disk cannot take its first
    checkpoint (or its final model), and warn when it cannot take all the run may write (eviback.disk). The
    sizes come from the policy's parameter count (its checkpoint's tensor shapes: nothing is loaded) and the
    run's precision. Only the process that writes checks (the main one under a launcher)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    placement = place(config.device, config.dtype)
    precision = training_precision(placement.dtype, placement.accelerator, lora=config.lora.enabled)
    run = RunDir(output)
    resumed_from = run.last_checkpoint_step() if resume else None
    model = resolve_model(config.model, "float32")
    parameters = checkpoint_parameters(model)
    steps_left = config.max_steps - (resumed_from or 0)
    if config.lora.enabled:  # checkpoints of the adapter alone; also refuses a target module the model lacks
        footprint = lora.run_footprint(parameters, lora.adapter_parameter_count(model, config.lora),
                                       merged=config.lora.save_merged, steps_left=steps_left,
                                       save_steps=config.save_steps, save_total_limit=config.save_total_limit)
    else:
        footprint = RunFootprint.planned(parameters, masters=precision is Precision.MASTERS, steps_left=steps_left,
                                         save_steps=config.save_steps, save_total_limit=config.save_total_limit)
    if resumed_from is None:
        retry = ("Free space there and run the same command with --resume (nothing was trained yet), or train into "
                 "a directory on another disk (--output)")
    else:
        retry = "Free space there and run the same command again"
    warning = footprint.check(run.root, retry=retry)
    if warning:
        log.warning("%s", warning)


def gpu_engine_share(config: TrainConfig, policy_path: str, device: str, parameters: int):
    """The share of the GPU the in-process vLLM engine takes beside this run's trainer
    (:func:`eviback.generation.memory.engine_share`): its bf16 weights and one step's rollouts at full length,
    beside the trainer's fp32 weights, AdamW's moments and, with a KL term, its fp32 reference model."""
    shape = ModelShape.from_checkpoint(policy_path)
    if shape is None:
        raise ValueError(f"cannot read the shape of {policy_path} (config.json) to size the rollout engine's share "
                         "of the GPU: set gpu_memory_utilization")
    rollout = config.rollout
    kv = rollout.group_size * config.questions_per_step * rollout.max_context_tokens * shape.kv_bytes_per_token(2)
    resident = trainer_bytes(accelerator=True, masters=False, reference=config.beta > 0).resident_bytes(parameters)
    if config.lora.enabled:  # the frozen base in the run's dtype, the fp32 adapter and its moments; no reference
        base_bytes = 2 if place(config.device, config.dtype).dtype == "bfloat16" else 4
        resident = lora.trainer_resident_bytes(parameters, lora.adapter_parameter_count(policy_path, config.lora),
                                               base_bytes=base_bytes)
    _, total = devices.memory(device)
    return engine_share(total_bytes=total, engine_weight_bytes=2 * parameters, kv_bytes=kv,
                        trainer_resident_bytes=resident)


def connect_policy_server(config: TrainConfig) -> VllmServerBackend:
    """The policy server of `backend=vllm-server`, checked before any long work (the warm start, the judge): the
    trainer is on a GPU (the weight push runs on NCCL), the server answers, its model tokenises as the run's
    does, and it can take a weight push."""
    placement = place(config.device, config.dtype)
    if not placement.accelerator:
        raise ValueError("backend=vllm-server pushes the trainer's weights into the server over NCCL, which needs "
                         f"the trainer on a CUDA GPU; this run computes on {placement.device}. On a CPU, train "
                         "with backend=vllm (in this process) or hf")
    return VllmServerBackend.connect(config.model, config.engine.server_config(), config.dtype, training=True)


def rollout_engine(config: TrainConfig, backend: GenerationBackend, retriever: Retriever) -> RolloutEngine:
    """The run's rollout engine on `backend`: its rollout settings as the engine runs them, its prompt style."""
    return RolloutEngine(backend, retriever, engine_rollout_config(config, backend.max_context), prompt=config.prompt)


def engine_rollout_config(config: TrainConfig, backend_max_context: int) -> RolloutConfig:
    """The run's rollout settings as the engine runs them: the context cap lowered to what the generation
    backend holds, when that is less."""
    return dataclasses.replace(config.rollout, max_context_tokens=min(backend_max_context,
                                                                      config.rollout.max_context_tokens))


def evaluate_start(config: TrainConfig, start: RunStart, training: Training) -> EvalSummary | None:
    """The starting policy (the engine holds it now) on the held-out questions the trained policy will be
    evaluated on (main process; resumable, so a resumed run does not redo it). None when not asked for."""
    if not (start.main and config.eval_benchmarks and config.eval_warm_start):
        return None

    log.info("evaluating the starting policy on the held-out questions")
    summary = run_eval(held_out_eval_config(config, start.run.eval_start_dir, training.policy_path,
                                            max_context_tokens=training.engine.config.max_context_tokens),
                       backend=training.backend, retriever=training.retriever)
    sleep_backend(training.backend)  # vLLM on a GPU: the evaluation woke it; the first update needs the memory
    release_free_heap()  # the evaluation's freed heap, before the first step allocates
    return summary


def record_teacher(run: RunDir, teacher_record: dict[str, Any] | None, teacher: Teacher) -> None:
    """What judged this run into teacher.json: the policy actually loaded (e.g. the two-stage policy with
    the trained judge), beside the named policy's record; and the trained judge of its Stage A, if any, with
    its held-out figures (`evidence_judge.weak_accepted`: a weak judge the run accepted, accept_weak_judge)."""

    run.write_teacher({**(teacher_record or {}), "policy_used": teacher.policy.name,
                       "version_used": teacher.policy.version,
                       "boundary_violations_used": list(teacher.policy.boundary_violations()),
                       "oracle_used": teacher.policy.is_oracle,
                       "evidence_judge": stage_a_record(teacher.policy),
                       # the whole policy: it may be composed for the run (judge, extractive Stage B)
                       "policy_used_content": json.loads(teacher.policy.canonical_json())})


CHECKPOINTING_PARAMETERS = 1_000_000_000  # on a GPU, models this large recompute activations by default


def gradient_checkpointing(setting: bool | None, accelerator: bool, parameters: int) -> bool:
    """Whether the update recomputes activations in the backward pass: the setting when given, else on for
    models of 1B parameters and more on a GPU (their activations, not their weights, decide whether a step of
    Search-R1's size fits: docs/training.md's memory arithmetic)."""
    if setting is not None:
        return setting
    return accelerator and parameters >= CHECKPOINTING_PARAMETERS


def trl_arguments(config: TrainConfig, output_dir: str | Path, precision: Precision, cuda: bool,
                  checkpointing: bool | None = None) -> GRPOConfig:
    """TRL's GRPOConfig for the run: one optimiser step per generation batch (questions_per_step groups of
    group_size rollouts), scored in micro-batches; the sampling settings TRL needs to score the engine's
    tokens (temperature, top_p) are the rollout's own. `cuda`: the run computes on a GPU; `checkpointing`:
    the resolved gradient checkpointing (None: the setting, off when unset)."""
    from trl import GRPOConfig

    rollout = config.rollout
    # On CPU one rollout per pass: the eviback preset's peak fell from 15.4 to 10.3 GB at the same update
    # time (results/update.md); on a GPU one group per pass keeps the matmuls large.
    rows = config.micro_batch_rows or (rollout.group_size if cuda else 1)
    return GRPOConfig(
        output_dir=str(output_dir),
        # One optimiser step per generation batch (questions_per_step groups), scored in micro-batches of
        # `rows` rollouts.
        per_device_train_batch_size=rows,
        gradient_accumulation_steps=config.questions_per_step * rollout.group_size // rows,
        num_generations=rollout.group_size,
        max_steps=config.max_steps,
        learning_rate=config.learning_rate,
        lr_scheduler_type=config.lr_scheduler_type,
        # a whole number of steps (transformers reads a value below 1 as a share of max_steps and rounds it up)
        warmup_steps=config.warmup_steps,
        beta=config.beta,
        loss_type=config.loss_type,
        temperature=rollout.temperature,  # TRL scales logits by it when computing log-probabilities
        top_p=rollout.top_p,
        max_completion_length=rollout.max_context_tokens,
        max_grad_norm=config.max_grad_norm,
        save_strategy="steps" if config.save_steps else "no",
        save_steps=config.save_steps or 1,
        save_total_limit=config.save_total_limit,
        logging_steps=1,
        report_to=config.report_to or "none",
        seed=config.seed,
        use_cpu=not cuda,
        # CPU: precision is the bf16 copy + fp32 masters, not autocast; GPU: accelerate's bf16 autocast (LoRA too)
        bf16=precision is Precision.AUTOCAST or (precision is Precision.LORA and cuda),
        fp16=False,
        remove_unused_columns=False,
        # No model_init_kwargs: the policy is passed loaded, and TRL builds the reference in the policy's own dtype
        # and attention (fp32 under the same autocast on a GPU; the bf16 copy with masters on the CPU), so that the
        # KL term is 0 at the first step (tests/test_train_build.py). With LoRA TRL builds none: the reference is
        # the policy itself with its adapter disabled.
        gradient_checkpointing=bool(config.gradient_checkpointing if checkpointing is None else checkpointing),
        disable_tqdm=False,
    )


def make_trainer(config: TrainConfig, start: RunStart, training: Training, teacher: Teacher | None) -> EviBackTrainer:
    """The EviBackTrainer of the run, logging every step into the run directory (:class:`StepLog`)."""
    from eviback.train.grpo import EviBackTrainer, training_dataset
    from eviback.train.step_log import StepLog, log_first

    step_log = StepLog(start.run, config.backoff, keep_rollout_steps=config.keep_rollout_steps,
                       max_steps=config.max_steps, processes=start.state.num_processes, main=start.main)
    args = trl_arguments(config, start.run.checkpoints, training.precision, start.placement.accelerator,
                         gradient_checkpointing(config.gradient_checkpointing, start.placement.accelerator,
                                                sum(p.numel() for p in training.model.parameters())))
    pin_trainer(args, start.placement)  # one process: the placement's GPU, not cuda:0 and DataParallel
    with quiet("trl-rollout-func"):  # TRL's experimental-API warning: eviback uses rollout_func on purpose
        trainer = EviBackTrainer(
            engine=training.engine,
            questions={q.id: q for q in training.questions},
            backoff=config.backoff,
            judge_groups=teacher.judge_groups if teacher is not None else None,
            on_step=step_log.on_rollouts,
            push_weights=True,
            master=training.master,
            rollout_seed=config.seed,
            correction=config.correction,
            model=training.model,
            args=args,
            train_dataset=training_dataset(training.questions),
            processing_class=training.tokenizer,
            optimizers=(training.optimizer, None),
            callbacks=[step_log],
            # LoRA: TRL puts the adapter on the model (PEFT, in place) and freezes the rest
            peft_config=config.lora.peft_config() if config.lora.enabled else None,
        )
    if config.lora.enabled:  # the adapter exists now: AdamW over it alone, in fp32 (train/lora.py)
        trainer.optimizer = adamw(lora.adapter_parameters(trainer.model), config.learning_rate,
                                  start.placement.accelerator)
    keep_bar_only(trainer)  # the step bar without TRL's per-step dict of raw metrics
    log_first(trainer, step_log)  # every metrics.jsonl figure joins the step's log before report_to reads it
    if config.val_every:  # held-out questions every val_every steps, on this engine (train/validation.py)
        from eviback.train.validation import VAL_DIR, Validation, validation_eval_config

        held_out = held_out_eval_config(config, start.run.root / VAL_DIR, training.policy_path,
                                        max_context_tokens=training.engine.config.max_context_tokens)
        trainer.add_callback(Validation(
            every=config.val_every, eval_config=validation_eval_config(config, held_out), backend=training.backend,
            retriever=training.retriever, push=trainer.push_policy, record=step_log.add_figures,
            processes=start.state, keep=config.keep_rollout_steps))
    # Accelerate put the trainer's model (and TRL its reference model) on the device: record where they are.
    # With fp32 masters on the CPU the trained model is the bf16 copy; the masters stay beside it.
    record("trainer", trainer.model, start.placement)
    if getattr(trainer, "ref_model", None) is not None:
        record("reference model", trainer.ref_model, start.placement)
    return trainer


def finish_run(config: TrainConfig, start: RunStart, training: Training,
               start_summary: EvalSummary | None, trained: Any = None) -> EvalSummary | None:
    """Save the final policy (the fp32 masters where there are some; with LoRA the adapter of `trained`, the
    trainer's unwrapped PeftModel, and the merged model: :func:`eviback.train.lora.save_final`), evaluate it on
    the held-out questions and write the report (main process); then release the run directory. Returns the
    evaluation summary."""
    run, main = start.run, start.main
    summary = None
    if main:
        if config.lora.enabled:
            lora.save_final(trained, run.final, base_path=training.policy_path, merged=config.lora.save_merged)
        else:
            final = training.master if training.master is not None else training.model
            final.save_pretrained(run.final)
        training.tokenizer.save_pretrained(run.final)
        if config.eval_benchmarks:  # with LoRA, the merged weights
            training.backend.update_weights(lora.engine_weights(training.model).named_parameters())
            summary = run_eval(held_out_eval_config(config, run.eval_dir, str(run.final),
                                                    max_context_tokens=training.engine.config.max_context_tokens),
                               backend=training.backend, retriever=training.retriever)
        write_run_report(run, summary, start_summary)
    write_placements(run.root / PLACEMENTS_FILE, start.placement, start.state.process_index)
    start.state.wait_for_everyone()
    if main:
        run.unlock()
    return summary


PLACEMENTS_FILE = "placements.json"


def write_placements(path: Path, placement: Placement, rank: int = 0) -> None:
    """Where this process's models computed (`eviback.device.placements()`): one file per process, the main
    process's as `path`, the others' beside it with their global rank (`placements.rank1.json`, ...)."""

    records = placements()
    target = path if rank == 0 else path.with_name(f"{path.stem}.rank{rank}{path.suffix}")
    target.write_text(json.dumps({"placement": placement.device, "dtype": placement.dtype,
                                  "models": records, "off_device": off_device(records)}, indent=2) + "\n")


class StartChanged(ValueError):
    """A run would resume from checkpoints trained from another starting policy than the one it would start
    from now."""


def write_start_record(path: Path, policy_path: str, *, resuming: bool = False) -> None:
    """Which policy a run started from, by name and by a hash of its weights: runs compared as "from the same
    warm start" can be checked to be so, even when the warm start was rebuilt on another machine.

    `resuming`: the run continues from its checkpoints, so its start must be the one recorded. A policy of
    another name (a warm start of another builder version, base model or settings: the name is their cache
    key) raises :class:`StartChanged`, naming both, rather than mixing a policy trained from one start with a
    reference model and a record of the other. The same name with other weights is a rebuild on another
    machine (the CPU fine-tune is not bitwise reproducible): the record keeps the weights the run began from,
    and a warning says so."""
    name, fingerprint = Path(policy_path).name, model_fingerprint(policy_path)
    if resuming and path.exists():
        before = json.loads(path.read_text())
        if before.get("policy") != name:
            raise StartChanged(
                f"{path.parent} began from the policy {before.get('policy')!r}, and would now start from {name!r}: "
                "the warm start changed since the run began (another warm-start builder version, base model or "
                "setting), so its checkpoints cannot be continued. Train it afresh in another directory (or "
                "delete this one); the finished runs of an experiment are kept apart from its work directory")
        if before.get("fingerprint") != fingerprint:
            log.warning("%s began from %s with weights %s; this machine's copy of that warm start has weights %s "
                        "(rebuilt here): the run goes on from its checkpoint, its record keeps the weights it "
                        "began from", path.parent, name, str(before.get("fingerprint"))[:12], fingerprint[:12])
        return
    path.write_text(json.dumps({"policy": name, "fingerprint": fingerprint}, indent=2) + "\n")


def held_out_eval_config(config: TrainConfig, out: str | Path, model: str, *, max_context_tokens: int | None = None,
                         **overrides: Any) -> EvalConfig:
    """The EvalConfig of a run's held-out evaluation: its benchmarks and limit, with its rollout settings.
    `max_context_tokens`: the cap of the engine it runs on (default: evaluation's own, RolloutConfig's)."""

    limits = EvalConfig().rollout  # greedy, evaluation's context cap; the run's turns and token limits
    return EvalConfig(
        out=str(out), data=config.data, benchmarks=tuple(config.eval_benchmarks), limit=config.eval_limit,
        model=model, backend=config.backend, dtype=place(config.device, config.dtype).dtype,
        device=config.device, retriever=config.retriever,
        rollout=dataclasses.replace(
            limits, topk=config.rollout.topk, max_turns=config.rollout.max_turns,
            max_turn_tokens=config.rollout.max_turn_tokens, max_observation_tokens=config.rollout.max_observation_tokens,
            max_context_tokens=max_context_tokens or limits.max_context_tokens),
        prompt=config.prompt,
        **overrides,
    )


def write_run_report(run: RunDir, summary: EvalSummary | None, start_summary: EvalSummary | None = None) -> Path:
    """The run's HTML report: training curves, and the held-out evaluation (beside the starting policy's,
    when it was evaluated) as an HTML table."""

    extra = ""
    if summary is not None:
        tables = {"start": start_summary, "trained": summary} if start_summary is not None else {"trained": summary}
        extra = ("<h2>Held-out evaluation</h2>" + comparison_html(tables)
                 + "<p><a href='eval/viewer.html'>Trajectories of the evaluation, turn by turn</a></p>")
    return write_report([run.root], run.root, extra_html=extra)
