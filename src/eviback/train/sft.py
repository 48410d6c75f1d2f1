"""The warm start: supervised fine-tuning of the policy on Search-R1 trajectories, cached.

    eviback sft                              # ~200 examples from the embedded suite's training files
    eviback sft --max-examples 500 --epochs 2
    python -c "from eviback.train.sft import WarmStartConfig, warm_start; print(warm_start(WarmStartConfig()))"

`warm_start(config)` builds trajectories from the suite's *training* questions with real searches
(:mod:`eviback.train.warmstart_data`), tokenises them with the prompt built as the rollouts build it (`prompt`,
a :class:`~eviback.protocol.PromptStyle`: the model's chat template by default) and with the prompt and the
retrieved observations masked from the loss, fine-tunes with TRL's `SFTTrainer` and saves the model
(safetensors + tokenizer) under `cache_dir()/warmstart/<key>`. The key hashes the base model's files, the
selected training examples and the training settings, so a second call with the same inputs returns the
saved directory at once. The directory is an ordinary checkpoint: `resolve_model(path)`, `from_pretrained`
and vLLM load it. Next to the weights: `sft_config.json` (the resolved configuration and key),
`sft_report.json` (example counts, training time, tokens/s, peak memory, losses) and `examples.jsonl` (the
trajectories trained on).

Device (`device`, default `auto`: the local GPU when there is one, else the CPU; see `eviback.device`): the
trainer runs there. The device is not in the key, so a warm start is reused wherever it was trained; the
resolved dtype is in it (`auto` resolved for the device that trains).

Precision (`dtype`, default `auto`: bf16 where the device computes it natively, fp32 otherwise, see
`eviback.dtype`): with bfloat16 the forward and backward passes run on bf16 weights (about twice as fast
as fp32 on a CPU with bf16 instructions) while AdamW updates an fp32 master copy; pure bf16 weights lose
updates of lr 1e-4 to rounding, and fp32 weights under bf16 autocast ran at half the speed. The saved
weights are the fp32 master copy.

torch, transformers, datasets and TRL (and `eviback.train.precision`, which imports torch) are imported by
the functions that fine-tune: `eviback sft --help` and a cached warm start never load them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eviback import device as devices
from eviback import dtype as dtypes
from eviback.cache import cache_dir, file_lock
from eviback.data import DataSuite, load_suite, read_training_questions
from eviback.policy import DEFAULT_MODEL, load_tokenizer, resolve_model, set_threads
from eviback.protocol import PromptStyle
from eviback.retrieval import ClientConfig, open_retriever
from eviback.retrieval.base import Retriever
from eviback.rollout import RolloutConfig
from eviback.settings import check_fields
from eviback.train import warmstart_data as wsd
from eviback.train.gauges import peak_rss_gb
from eviback.train.step_bar import keep_bar_only
from eviback.types import Question, to_dict

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

REPORT_FILE = "sft_report.json"
CONFIG_FILE = "sft_config.json"
EXAMPLES_FILE = "examples.jsonl"


@dataclass
class WarmStartConfig:
    """Every setting of a warm start. Fields marked `(not in the key)` do not change the trained model."""

    # ---- model and data
    model: str = field(default=DEFAULT_MODEL, metadata={"help": "base policy: a built-in name, a local HF "
                       "model directory, or a cached hub name"})
    data: str | None = field(default=None, metadata={"help": "data suite directory (default: the embedded one)"})
    train_files: list[str] = field(default_factory=list, metadata={"help": "a subset of the suite's training "
                                   "files, by name (nq_train) or path; default: all of them. Evaluation files "
                                   "are refused"})
    retriever: str | None = field(default=None, metadata={"help": "index directory or /retrieve URL (default: "
                                  "BM25 over the suite's corpus)"})
    retrieval_deadline_s: float = field(default=300.0, metadata={"help": "with a /retrieve URL: seconds a search "
                                        "keeps retrying a service that does not answer (not in the key)"})
    max_examples: int = field(default=200, metadata={"help": "training examples (at most one per question)"})
    multi_search_share: float = field(default=0.3, metadata={"help": "share of examples that search twice "
                                      "(multi-hop and search-again examples), where enough exist"})
    # the rollouts' own settings, by their names and defaults: an example looks like what the policy will see
    topk: int = field(default=RolloutConfig.topk, metadata={"help": "passages per search, as in the rollouts "
                      "(RolloutConfig.topk)"})
    max_observation_tokens: int = field(default=RolloutConfig.max_observation_tokens, metadata={"help": "tokens of "
                                        "retrieved text per search, as in the rollouts "
                                        "(RolloutConfig.max_observation_tokens)"})
    prompt: PromptStyle = field(default_factory=PromptStyle, metadata={"help": "how the prompt reaches the model, "
                                "as in the rollouts (PromptStyle: chat_template auto or none, "
                                "chat_template_kwargs); in the key unless it is the default"})
    # ---- optimisation
    epochs: float = field(default=1.0, metadata={"help": "passes over the examples"})
    learning_rate: float = field(default=1e-4, metadata={"help": "peak learning rate (AdamW)"})
    batch_size: int = field(default=1, metadata={"help": "sequences per forward pass (1 wastes nothing on "
                            "padding; raise gradient_accumulation for larger effective batches)"})
    gradient_accumulation: int = field(default=4, metadata={"help": "forward passes per optimiser step"})
    warmup_ratio: float = field(default=0.05, metadata={"help": "share of steps with a linear warm-up"})
    lr_scheduler: str = field(default="cosine", metadata={"help": "learning-rate schedule (transformers name: "
                              "cosine, linear, constant, ...)"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping"})
    dtype: str = field(default="auto", metadata={"help": "compute dtype: auto (bf16 where the device computes it "
                       "natively, else fp32; resolved before the key is made, so each resolution has its own "
                       "warm start), bfloat16 (with an fp32 master copy for AdamW) or float32"})
    seed: int = field(default=0, metadata={"help": "seed for example selection, data order and initialisation"})
    # ---- where and how (not in the key)
    device: str = field(default="auto", metadata={"help": devices.HELP + " (not in the key: a warm start "
                        "trained on a GPU is reused on a CPU and the other way round)"})
    output: str | None = field(default=None, metadata={"help": "save here instead of the cache (not in the key)"})
    force: bool = field(default=False, metadata={"help": "retrain even if a saved warm start matches (not in "
                        "the key)"})
    threads: int | None = field(default=None, metadata={"help": "torch threads (default: one per core; not in "
                                "the key)"})
    logging_steps: int = field(default=5, metadata={"help": "log the loss every N optimiser steps (not in the "
                               "key)"})
    progress: bool = field(default=True, metadata={"help": "show progress bars (not in the key)"})

    def __post_init__(self) -> None:
        check_fields(self)  # types first: the checks below compare numbers
        # a mapping is the prompt style as to_dict() wrote it (the warm start's own process reads it back)
        self.prompt = PromptStyle.of(self.prompt, "WarmStartConfig.prompt")
        for name in ("max_examples", "topk", "max_observation_tokens", "batch_size", "gradient_accumulation",
                     "logging_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.multi_search_share <= 1.0:
            raise ValueError(f"multi_search_share must be between 0 and 1, got {self.multi_search_share}")
        if self.epochs <= 0:
            raise ValueError(f"epochs must be > 0, got {self.epochs}")
        if not 0.0 < self.learning_rate < 1.0:
            raise ValueError(f"learning_rate must be in (0, 1), got {self.learning_rate}; SFT uses ~1e-4")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        dtypes.check(self.dtype, allowed=dtypes.TRAINING_DTYPES)
        devices.check_device(self.device)
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1 or None, got {self.threads}")

    # Fields that do not change the trained weights, left out of the cache key.
    NOT_IN_KEY = ("output", "force", "threads", "logging_steps", "progress", "device", "retrieval_deadline_s")
    # Settings named otherwise in the key: the name they had when the key was defined, so that a warm start
    # saved before a setting took the rollouts' name is found again.
    KEY_NAMES = {"max_observation_tokens": "max_obs_tokens"}
    # Settings added after warm starts had been saved: at their default (what those builds did) they are left
    # out of the key, so that those warm starts are found again; any other value is in it.
    ADDED_LATER = {"prompt": PromptStyle()}

    def key_fields(self) -> dict[str, Any]:
        """The settings in the key, by value: a float setting given as an int (`epochs: 1` in YAML) is the
        same build as 1.0 on the command line, not another key and another warm start."""
        floats = {f.name for f in dataclasses.fields(self) if f.type in ("float", float)}
        left_out = set(self.NOT_IN_KEY) | {k for k, v in self.ADDED_LATER.items() if getattr(self, k) == v}
        return {self.KEY_NAMES.get(k, k): float(v) if k in floats and isinstance(v, int) and not isinstance(v, bool)
                else v for k, v in dataclasses.asdict(self).items() if k not in left_out}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def describe_fields() -> str:
    """One line per setting with its default and help."""
    lines = []
    for f in dataclasses.fields(WarmStartConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        lines.append(f"  {f.name:22s} {default!r:>14}  {f.metadata.get('help', '')}")
    return "\n".join(lines)


@dataclass(frozen=True)
class TrainStats:
    """What one fine-tuning run measured."""

    examples: int
    optimizer_steps: int
    tokens: int  # every token of every sequence, times the epochs (what the forward passes processed)
    trained_tokens: int  # tokens with a label (the model's own), times the epochs
    seconds: float
    tokens_per_second: float
    peak_rss_gb: float  # the process's peak resident memory so far (includes whatever ran before)
    mean_loss: float  # over the whole run
    first_loss: float | None  # the first and last logged losses (every `logging_steps` steps)
    last_loss: float | None
    losses: tuple[float, ...] = ()  # the logged training losses, in order


# --------------------------------------------------------------------------------------------------
# Data


def training_questions(config: WarmStartConfig, suite: DataSuite) -> list[Question]:
    """The questions of the chosen training files, none of them in the suite's evaluation files."""
    return read_training_questions(suite, config.train_files)


def build_training_set(
    config: WarmStartConfig, tokenizer: PreTrainedTokenizerBase, retriever: Retriever | None = None,
) -> tuple[list[wsd.WarmStartExample], wsd.BuildReport]:
    """(selected examples, build report): trajectories from the training questions, then the selection."""
    suite = load_suite(config.data)
    questions = training_questions(config, suite)
    own_retriever = retriever is None
    retriever = (open_retriever(config.retriever, suite, client=ClientConfig(deadline_s=config.retrieval_deadline_s))
                 if own_retriever else retriever)
    try:
        examples, report = wsd.build_examples(
            questions, retriever, tokenizer, topk=config.topk, max_obs_tokens=config.max_observation_tokens,
            show_progress=config.progress, seed=config.seed,
        )
    finally:
        if own_retriever:
            retriever.close()
    selected = wsd.select_examples(examples, config.max_examples, config.multi_search_share, config.seed)
    if not selected:
        raise ValueError(f"no warm-start example could be built from {len(questions)} training questions: "
                         "the retriever found none of their answers; check the corpus and retriever")
    return selected, report


# --------------------------------------------------------------------------------------------------
# The cache key


def model_fingerprint(model_dir: str | os.PathLike) -> str:
    """A hash of a checkpoint's config and weights (a hub name that is not a directory hashes as its name)."""
    path = Path(model_dir)
    digest = hashlib.sha256()
    if not path.is_dir():
        digest.update(str(model_dir).encode())
        return digest.hexdigest()
    for file in sorted(path.iterdir()):
        if file.suffix in (".safetensors", ".bin") or file.name == "config.json":
            digest.update(file.name.encode())
            with open(file, "rb") as f:
                for block in iter(lambda: f.read(1 << 22), b""):
                    digest.update(block)
    return digest.hexdigest()


def cache_key(config: WarmStartConfig, base_fingerprint: str, examples: list[wsd.WarmStartExample]) -> str:
    """Hash of the base model, the exact training examples and the settings that shape training."""
    digest = hashlib.sha256()
    payload = {"builder": wsd.BUILDER_VERSION, "base": base_fingerprint, "config": config.key_fields()}
    # The data suite and retriever matter only through the examples they produced.
    payload["config"].pop("data", None)
    payload["config"].pop("retriever", None)
    digest.update(json.dumps(payload, sort_keys=True).encode())
    for e in examples:
        digest.update(e.kind.value.encode())
        digest.update(e.question.id.encode())
        digest.update(json.dumps(to_dict(e.trajectory.turns), sort_keys=True).encode())
    return digest.hexdigest()[:20]


def is_complete(directory: Path) -> bool:
    return (directory / REPORT_FILE).exists() and (directory / "config.json").exists()


def saved_key(directory: Path) -> str | None:
    try:
        return json.loads((directory / CONFIG_FILE).read_text()).get("key")
    except (FileNotFoundError, json.JSONDecodeError):
        return None


# --------------------------------------------------------------------------------------------------
# Entry point


def warm_start(config: WarmStartConfig | None = None, retriever: Retriever | None = None) -> Path:
    """The directory of the warm-started model for `config`, training it unless a matching one is saved.

    `retriever` (optional) is an open retriever to build the examples with; by default the one
    `config.retriever` names is opened and closed here. Concurrent calls with the same inputs train once:
    the others wait on a file lock and then reuse the result."""
    config = config or WarmStartConfig()
    # `auto` is resolved before the key, for the device that trains: a bf16 and an fp32 build are different
    # weights, never one cache entry (the device itself is not in the key)
    placement = devices.place(config.device, config.dtype)
    choice = placement.dtype_choice
    config = dataclasses.replace(config, dtype=choice.dtype)
    set_threads(config.threads)
    base_dir = resolve_model(config.model, "float32")
    tokenizer = load_tokenizer(base_dir)
    config.prompt.check(tokenizer, config.model)  # before the searches that build the examples
    t0 = time.perf_counter()
    examples, report = build_training_set(config, tokenizer, retriever)
    build_seconds = time.perf_counter() - t0
    key = cache_key(config, model_fingerprint(base_dir), examples)
    target = Path(config.output) if config.output else cache_dir() / "warmstart" / key
    with file_lock(cache_dir() / "locks" / f"warmstart-{key}.lock"):
        if not config.force and is_complete(target) and saved_key(target) == key:
            log.info("warm start %s already trained: reusing %s", key, target)
            return target
        if target.exists() and config.output and not is_complete(target) and any(target.iterdir()):
            raise FileExistsError(f"{target} exists and is not a warm start; choose another --output")
        tmp = target.with_name(target.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        counts = {k.value: sum(e.kind is k for e in examples) for k in wsd.ExampleKind}
        log.info("warm start %s: %d examples (%s) from %d training questions in %.1fs; training",
                 key, len(examples), ", ".join(f"{v} {k}" for k, v in counts.items()),
                 sum(report.considered.values()), build_seconds)
        (tmp / CONFIG_FILE).write_text(json.dumps(
            {"key": key, "base_model": base_dir, "builder_version": wsd.BUILDER_VERSION, **config.to_dict(),
             "dtype_choice": choice.to_dict(), "placement": placement.to_dict()},
            indent=2) + "\n")
        with open(tmp / EXAMPLES_FILE, "w", encoding="utf-8") as f:
            for e in examples:
                f.write(json.dumps({"kind": e.kind.value, **to_dict(e.trajectory)}, ensure_ascii=False) + "\n")
        stats = finetune(examples, tokenizer, base_dir, tmp, config)
        (tmp / REPORT_FILE).write_text(json.dumps({
            "key": key,
            "examples": {"total": len(examples), **counts},
            "build": {"seconds": round(build_seconds, 2), **dataclasses.asdict(report)},
            "train": dataclasses.asdict(stats),
        }, indent=2) + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    log.info("warm start saved to %s (%.0fs, %.0f tokens/s, peak RSS %.1f GB)", target, stats.seconds,
             stats.tokens_per_second, stats.peak_rss_gb)
    return target


# --------------------------------------------------------------------------------------------------
# Fine-tuning


def tokenized_dataset(examples: list[wsd.WarmStartExample], tokenizer: PreTrainedTokenizerBase,
                      max_obs_tokens: int, prompt: PromptStyle | None = None) -> Dataset:
    """A `datasets.Dataset` with `input_ids` and `labels` (-100 on the prompt and observations); the prompt in
    the `prompt` style (default: the chat template)."""
    from datasets import Dataset

    rows = []
    for e in examples:
        input_ids, labels = wsd.labels_for(wsd.tokenize_trajectory(e.trajectory, tokenizer, max_obs_tokens,
                                                                   prompt=prompt))
        rows.append({"input_ids": input_ids, "labels": labels})
    return Dataset.from_list(rows)


def finetune(examples: list[wsd.WarmStartExample], tokenizer: PreTrainedTokenizerBase, base_dir: str,
             out_dir: Path, config: WarmStartConfig) -> TrainStats:
    """Fine-tune `base_dir` on `examples` with TRL's SFTTrainer on `config.device` and save the model into
    `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    from eviback.train.precision import MasterWeightAdamW

    placement = devices.place(config.device, config.dtype)
    torch.manual_seed(config.seed)
    dataset = tokenized_dataset(examples, tokenizer, config.max_observation_tokens, config.prompt)
    # The models are on the device before the optimiser is made: its state (and the fp32 masters the bf16
    # copy's gradients are added into) must be where the gradients are.
    master = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).to(placement.torch_device)
    if config.dtype == "bfloat16":
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16).to(placement.torch_device)
        optimizer = MasterWeightAdamW(model, master, lr=config.learning_rate, weight_decay=config.weight_decay)
    else:
        model = master
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay,
                                      fused=True)
    model.config.use_cache = False  # no KV cache during training
    devices.record("warm start", model, placement)

    args = SFTConfig(
        output_dir=str(out_dir / "trainer"),
        num_train_epochs=config.epochs,
        per_device_train_batch_size=config.batch_size,
        gradient_accumulation_steps=config.gradient_accumulation,
        learning_rate=config.learning_rate,
        lr_scheduler_type=config.lr_scheduler,
        warmup_steps=config.warmup_ratio,  # a float below 1 is a ratio of the total steps
        weight_decay=config.weight_decay,
        max_grad_norm=config.max_grad_norm,
        logging_steps=config.logging_steps,
        seed=config.seed,
        data_seed=config.seed,
        use_cpu=not placement.accelerator,
        # Precision is handled here (bf16 weights + fp32 master copy), not by autocast.
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,  # 135M parameters fit easily; checkpointing would cost ~30% speed
        max_length=None,  # examples are never truncated: the observation cap already bounds them
        packing=False,
        save_strategy="no",
        report_to="none",
        disable_tqdm=not config.progress,
        dataloader_num_workers=0,
    )
    devices.pin_trainer(args, placement)
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                         optimizers=(optimizer, None))
    keep_bar_only(trainer)  # the step bar without the trainer's dict of raw figures at each logging step
    start = time.perf_counter()
    output = trainer.train()
    seconds = time.perf_counter() - start

    # With bf16 compute, `master` holds the trained weights at full precision (the optimiser updated it).
    master.config.use_cache = True
    master.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    shutil.rmtree(out_dir / "trainer", ignore_errors=True)

    losses = tuple(float(r["loss"]) for r in trainer.state.log_history if "loss" in r)
    tokens = int(sum(len(x) for x in dataset["input_ids"]) * config.epochs)
    trained = int(sum(sum(t != wsd.IGNORE_INDEX for t in x) for x in dataset["labels"]) * config.epochs)
    return TrainStats(
        examples=len(dataset),
        optimizer_steps=trainer.state.global_step,
        tokens=tokens,
        trained_tokens=trained,
        seconds=round(seconds, 1),
        tokens_per_second=round(tokens / seconds, 1) if seconds else 0.0,
        peak_rss_gb=round(peak_rss_gb(), 2),
        mean_loss=float(output.training_loss),
        first_loss=losses[0] if losses else None,
        last_loss=losses[-1] if losses else None,
        losses=losses,
    )

