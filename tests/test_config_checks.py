"""Every config dataclass of eviback checks its fields when it is built, before any work: a value of the wrong
type is refused with a ValueError naming the field, and a value out of range with one naming the field (as
the user sets it) and what it takes.

The config classes are found, not listed: every module of the package is imported and every dataclass whose
name ends in `Config` or `Settings` is checked, so a new one is covered the day it is written. A class that
does not check its fields yet is listed in PENDING with the reason; its test is expected to fail (strictly: a
class that starts checking its fields must leave the list).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import pkgutil
import re
import typing
from pathlib import Path, PurePath
from typing import Any

import pytest

import eviback
from eviback.settings import field_types, type_name

SUFFIXES = ("Config", "Settings")
# Dataclasses that carry a user's settings although their names do not say so.
ALSO = ("eviback.experiment.config.Arm", "eviback.train.config.BehaviourCorrection", "eviback.protocol.PromptStyle")
# Config classes that do not check their fields yet, and why.
PENDING: dict[str, str] = {}


def _arms() -> tuple[Any, ...]:
    from eviback.experiment.config import Arm

    return (Arm("grpo", "grpo"), Arm("eviback", "eviback", (0, 1)))


# Valid values of the fields that have no default, by class.
REQUIRED: dict[str, typing.Callable[[], dict[str, Any]]] = {
    "eviback.teacher.vllm_server.VllmServerConfig": lambda: {"model_dir": "models/teacher"},
    "eviback.experiment.config.Arm": lambda: {"name": "grpo", "preset": "grpo"},
    "eviback.experiment.config.ExperimentConfig": lambda: {
        "name": "t", "out": Path("out"), "steps": 2, "arms": _arms(), "eval_benchmarks": ("nq",), "eval_limit": 2},
    "eviback.ape.config.ApeConfig": lambda: {"out": "run", "dumps": ("rollouts/step-1.jsonl.gz",)},
    "eviback.prepare.PrepareConfig": lambda: {"out": "suite", "corpus": "wiki-18.jsonl.gz",
                                              "test": ("test.parquet",)},
}


def _path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def config_classes() -> dict[str, type]:
    """Every config dataclass of the package by its dotted path (and those of ALSO)."""
    found: dict[str, type] = {}
    for module in pkgutil.walk_packages(eviback.__path__, "eviback."):
        try:
            loaded = importlib.import_module(module.name)
        except ModuleNotFoundError as e:  # an optional dependency (an extra) not installed here
            if (e.name or "").startswith("eviback"):
                raise
            continue
        for obj in vars(loaded).values():
            if (isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == module.name
                    and (obj.__name__.endswith(SUFFIXES) or _path(obj) in ALSO)):
                found[_path(obj)] = obj
    return dict(sorted(found.items()))


CONFIGS = config_classes()


def _params() -> list[Any]:
    marks = {path: pytest.mark.xfail(reason=PENDING[path], strict=True) for path in PENDING}
    return [pytest.param(cls, id=path.removeprefix("eviback."), marks=marks.get(path, ())) for path, cls in
            CONFIGS.items()]


def valid(cls: type) -> dict[str, Any]:
    return REQUIRED[_path(cls)]() if _path(cls) in REQUIRED else {}


def wrong_value(tp: Any) -> Any:
    """A value no field of type `tp` takes (for a union, one that none of its types takes)."""
    if typing.get_origin(tp) in (typing.Union, type(int | None)):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        return wrong_value(options[0])
    origin = typing.get_origin(tp) or tp
    if origin in (list, tuple):
        return {"not": "a list"}
    if origin is dict:
        return "not a mapping"
    if tp is str:
        return {"not": "a string"}  # a number or a path is converted to its text
    if tp is bool:
        return "yes"
    if tp is int:
        return "many"
    if tp is float:
        return "abc"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "no-such-choice"
    if isinstance(tp, type) and issubclass(tp, PurePath):
        return 5
    if dataclasses.is_dataclass(tp):
        return {"not": "a config"}
    raise AssertionError(f"no wrong value for a field of type {tp!r}: add one to wrong_value")


def _names(message: str, name: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", message) is not None


def test_the_config_classes_are_found():
    assert {"eviback.rollout.RolloutConfig", "eviback.backoff.BackoffConfig", "eviback.train.config.TrainConfig",
            "eviback.retrieval.config.ClientConfig", "eviback.generation.vllm_config.VllmConfig",
            "eviback.teacher.judge.RetryConfig", "eviback.experiment.config.Arm"} <= set(CONFIGS)
    stale = sorted((set(PENDING) | set(REQUIRED) | set(ALSO)) - set(CONFIGS))
    assert not stale, f"listed here but no config class of the package: {stale}"


@pytest.mark.parametrize("cls", _params())
def test_a_value_of_the_wrong_type_is_refused_by_name(cls):
    base = valid(cls)
    cls(**base)  # the defaults (and REQUIRED's values) are valid
    missed = []
    for name, tp in field_types(cls).items():
        if tp is Any:
            continue
        value = wrong_value(tp)
        try:
            cls(**{**base, name: value})
        except ValueError as e:
            if not _names(str(e), name):
                missed.append(f"{name}={value!r}: the message does not name the field: {e}")
        except Exception as e:  # any other error is what this test is about
            missed.append(f"{name}={value!r}: {type(e).__name__} instead of a ValueError: {e}")
        else:
            missed.append(f"{name}={value!r} (not {type_name(tp)}): accepted")
    assert not missed, f"{cls.__name__}:\n" + "\n".join(missed)


# A few values out of range per class, and the message that names the field (as it is set) and what it takes.
RANGES = [
    ("generation.base.SamplingConfig", {"max_tokens": 0}, r"max_tokens must be >= 1, got 0"),
    ("generation.base.SamplingConfig", {"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ("generation.base.SamplingConfig", {"temperature": float("nan")}, r"temperature must be >= 0"),
    ("generation.BackendConfig", {"backend": "tgi"}, r"unknown backend 'tgi'; choose one of vllm, hf"),
    ("generation.EngineSettings", {"executor": "ray"}, r"unknown executor 'ray'; choose one of inprocess"),
    ("generation.EngineSettings", {"sleep_level": 3}, r"vllm_sleep_level must be 1 or 2"),
    ("generation.EngineSettings", {"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization .* in \(0, 1\]"),
    ("generation.EngineSettings", {"policy_url": "x"}, r"policy_url must be an http\(s\) URL"),
    ("generation.EngineSettings", {"policy_timeout_s": -1.0}, r"timeout_s must be > 0"),
    ("prepare.PrepareConfig", {"corpus_link": "move"}, r"unknown corpus_link \(--corpus-link\) 'move'"),
    ("generation.BackendConfig", {"hf_cache": "paged"}, r"hf_cache must be one of auto, dynamic, static"),
    ("generation.BackendConfig", {"threads": 0}, r"threads must be >= 1, or None"),
    ("generation.BackendConfig", {"max_model_len": 100}, r"max_model_len must be >= 256 for vllm"),
    ("generation.vllm_config.VllmConfig", {"max_num_seqs": 0}, r"max_num_seqs must be >= 1, got 0"),
    ("generation.vllm_config.VllmConfig", {"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization .* in \(0, 1\]"),
    ("generation.vllm_config.VllmConfig", {"sleep_level": 3}, r"sleep_level must be 1 or 2"),
    ("retrieval.config.BM25Config", {"b": 1.5}, r"b \(--b\) must be in \[0, 1\]"),
    ("retrieval.config.BM25Config", {"k1": -1.0}, r"k1 \(--k1\) must be a number >= 0"),
    ("retrieval.config.BM25Config", {"method": "okapi"}, r"method \(--method\) 'okapi'; choose one of lucene"),
    ("retrieval.config.DenseConfig", {"chunk_size": 0}, r"chunk_size \(--chunk-size\) must be >= 1, got 0"),
    ("retrieval.config.DenseConfig", {"max_seq_length": -1}, r"max_seq_length \(--max-seq-length\) must be >= 0"),
    ("retrieval.config.DenseConfig", {"device": "gpu"}, r"device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
    ("retrieval.config.FaissImportConfig", {"nprobe": 0}, r"nprobe \(--nprobe\) must be >= 1, got 0"),
    ("retrieval.config.FaissImportConfig", {"rerank": -1}, r"rerank \(--rerank\) must be >= 0, got -1"),
    ("retrieval.config.FaissImportConfig", {"compression": "pq"}, r"compression \(--compression\) 'pq'; choose "
                                                                    r"one of ivfpq, sq8, flat"),
    ("retrieval.config.ServerConfig", {"port": 70000}, r"port \(--port\) must be in 0..65535, got 70000"),
    ("retrieval.config.ServerConfig", {"default_topk": 0}, r"default_topk \(--default-topk\) must be in 1..max_topk"),
    ("retrieval.config.ServerConfig", {"batch_wait_ms": -1.0}, r"batch_wait_ms \(--batch-wait-ms\) must be a number "
                                                               r">= 0"),
    ("retrieval.config.ClientConfig", {"connect_timeout_s": 0.0}, r"connect_timeout_s must be > 0 seconds"),
    ("retrieval.config.ClientConfig", {"deadline_s": -1.0}, r"deadline_s must be > 0 .* retrieval_deadline_s"),
    ("retrieval.config.ClientConfig", {"batch_queries": 0}, r"batch_queries must be >= 1, got 0"),
    ("rollout.RolloutConfig", {"max_observation_tokens": 0}, r"max_observation_tokens \(the training setting "
                                                             r"max_obs_tokens\) must be >= 1"),
    ("rollout.RolloutConfig", {"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ("rollout.RolloutConfig", {"temperature": -0.5}, r"temperature must be a number >= 0 \(0: greedy\)"),
    ("backoff.BackoffConfig", {"mode": "ppo"}, r"setting 'mode' takes one of grpo, dapo, eviback, f1-fallback"),
    ("backoff.BackoffConfig", {"eps": 0.0}, r"eps must be > 0 and finite \(the training setting adv_eps\)"),
    ("backoff.BackoffConfig", {"hit_threshold": 0.0}, r"hit_threshold must be in \(0, 1\]"),
    ("train.config.TeacherSettings", {"backend": "grpc"}, r"teacher_backend must be 'local' or 'http'"),
    ("train.config.TeacherSettings", {"concurrency": 0}, r"teacher_concurrency must be >= 1"),
    ("train.config.BehaviourCorrection", {"level": "batch"}, r"is_level must be token or sequence"),
    ("train.config.TrainConfig", {"loss_type": "ppo"}, r"loss_type must be one of dapo, grpo"),
    ("train.config.TrainConfig", {"save_steps": -1}, r"save_steps must be >= 1 \(or 0: no checkpoints\)"),
    ("teacher.config.TeacherConfig", {"backend": "grpc"}, r"setting 'backend' takes one of local, http"),
    ("teacher.config.TeacherConfig", {"policy": " "}, r"policy must name a teacher policy"),
    ("teacher.config.TeacherConfig", {"http": {"base_url": "http://127.0.0.1:8001/v1"}},
     r"TeacherConfig.http must be a HttpBackendConfig, got \{'base_url'"),
    ("teacher.judge.JudgeConfig", {"retry": {"max_attempts": 1}}, r"JudgeConfig.retry must be a RetryConfig"),
    ("teacher.judge.RetryConfig", {"max_attempts": 0}, r"max_attempts=0 \(the --max-attempts option\) must be >= 1"),
    ("teacher.judge.RetryConfig", {"backoff_factor": 0.5}, r"backoff_factor must be >= 1"),
    ("teacher.judge.RetryConfig", {"jitter": 2.0}, r"jitter must be in \[0, 1\]"),
    ("teacher.judge.JudgeConfig", {"concurrency": 0}, r"concurrency=0 \(the --concurrency option; "
                                                      r"teacher_concurrency in a training run\) must be >= 1"),
    ("teacher.local.LocalBackendConfig", {"dtype": "fp8"}, r"local teacher dtype must be one of auto, bfloat16"),
    ("teacher.local.LocalBackendConfig", {"threads": 0}, r"local teacher threads \(the --threads option\) must be "
                                                         r">= 1"),
    ("teacher.openai_http.HttpBackendConfig", {"timeout_s": 0.0}, r"timeout_s=0.0 \(the --timeout option\) must "
                                                                  r"be > 0"),
    ("teacher.openai_http.HttpBackendConfig", {"structured_output": "xml"}, r"setting 'structured_output' takes "
                                                                            r"one of response_format"),
    ("teacher.openai_http.HttpBackendConfig", {"max_connections": 0}, r"max_connections=0 must be >= 1"),
    ("teacher.vllm_server.VllmServerConfig", {"port": -1}, r"port must be in 0..65535"),
    ("teacher.vllm_server.VllmServerConfig", {"startup_timeout_s": 0.0}, r"startup_timeout_s must be > 0 seconds"),
    ("teacher.vllm_server.VllmServerConfig", {"dtype": "fp8"}, r"dtype must be one of auto"),
    ("train.judge_builder.EvidenceJudgeConfig", {"max_questions": -1}, r"max_questions=-1 \(--max-questions; "
                                                                       r"judge_max_questions in a training run\)"),
    ("train.judge_builder.EvidenceJudgeConfig", {"max_observation_tokens": 8}, r"max_observation_tokens=8 \(--max-observation-tokens\) "
                                                                       r"must be >= 16"),
    ("train.judge_builder.EvidenceJudgeConfig", {"learning_rate": -1.0}, r"learning_rate=-1.0 \(--learning-rate\) "
                                                                         r"must be a number >= 0"),
    ("train.judge_builder.EvidenceJudgeConfig", {"epochs": 0.0}, r"epochs=0.0 \(--epochs; judge_epochs"),
    ("train.sft.WarmStartConfig", {"max_examples": 0}, r"max_examples must be >= 1"),
    ("train.sft.WarmStartConfig", {"multi_search_share": 2.0}, r"multi_search_share must be between 0 and 1"),
    ("train.sft.WarmStartConfig", {"prompt": {"template": "none"}}, r"WarmStartConfig.prompt: unknown prompt "
                                                                     r"setting\(s\) \['template'\]"),
    ("train.lora.LoraSettings", {"rank": -1}, r"lora_rank must be >= 0"),
    ("train.lora.LoraSettings", {"alpha": float("nan")}, r"lora_alpha must be a number >= 0"),
    ("train.lora.LoraSettings", {"dropout": 1.0}, r"lora_dropout must be in \[0, 1\)"),
    ("train.lora.LoraSettings", {"target_modules": []}, r"lora_target_modules must name at least one module"),
    ("train.lora.LoraSettings", {"target_modules": ["all-linear", "q_proj"]}, r"all-linear already covers"),
    ("protocol.PromptStyle", {"chat_template": "base"}, r"chat_template must be 'auto' .* or 'none'"),
    ("protocol.PromptStyle", {"chat_template_kwargs": {"tokenize": True}}, r"chat_template_kwargs may not set "
                                                                           r"'tokenize'"),
    ("evaluate.EvalConfig", {"prompt": {"chat_template": "none"}}, r"EvalConfig.prompt must be a PromptStyle"),
    ("experiment.config.ExperimentConfig", {"steps": 0}, r"steps must be >= 1, got 0"),
    ("experiment.config.ExperimentConfig", {"eval_limit": 0}, r"eval.limit must be >= 1, got 0"),
    ("experiment.config.ExperimentConfig", {"bootstrap_samples": 10}, r"bootstrap_samples must be >= 100"),
    ("experiment.config.ExperimentConfig", {"baseline": "nope"}, r"no arm named 'nope'; arms: grpo, eviback"),
    ("experiment.config.ExperimentConfig", {"contrasts": (("grpo", "grpo"),)}, r"contrasts\[0\] must be a pair of "
                                                                               r"two different arms"),
    ("experiment.config.Arm", {"seeds": (0, 0)}, r"arm 'grpo': seeds must be distinct integers"),
    ("experiment.config.Arm", {"name": "a b"}, r"arm name 'a b' must be letters, digits"),
    ("evaluate.EvalConfig", {"backend": "tgi"}, r"backend must be one of vllm, hf, vllm-server"),
    ("evaluate.EvalConfig", {"engine": {"policy_url": "x"}}, r"EvalConfig.engine must be .*EngineSettings"),
    ("generation.server.ServerConfig", {"timeout_s": 0.0}, r"timeout_s must be > 0"),
    ("generation.server.ServerConfig", {"concurrency": 0}, r"concurrency must be >= 1"),
    ("generation.server.ServerConfig", {"group_port": 0}, r"group_port must be a port number"),
    ("evaluate.EvalConfig", {"limit": 0}, r"limit must be >= 1"),
    ("evaluate.EvalConfig", {"retrieval_deadline_s": 0.0}, r"retrieval_deadline_s must be > 0"),
    ("evaluate.EvalConfig", {"rollout": {"max_turns": 2}}, r"EvalConfig.rollout must be a RolloutConfig"),
    ("ape.config.ControllerConfig", {"kind": "oracle"}, r"kind"),
    ("ape.config.ControllerConfig", {"dtype": "int8"}, r"controller dtype must be one of"),
    ("ape.config.ControllerConfig", {"http": {"base_url": "x"}}, r"ControllerConfig.http must be an HttpBackendConfig"),
    ("ape.config.ApeConfig", {"dumps": ()}, r"no rollouts"),
    ("ape.config.ApeConfig", {"controller": "local"}, r"ApeConfig.controller must be a ControllerConfig"),
    ("ape.controller.ControllerSettings", {"temperature": -0.5}, r"temperature must be >= 0"),
    ("ape.controller.ControllerSettings", {"max_tokens": 0}, r"max_tokens must be >= 1"),
    ("train.scoring.ScoringSettings", {"max_padding": 1.5}, r"max_padding must be in \[0, 1\]"),
    ("train.scoring.ScoringSettings", {"chunk_tokens": 0}, r"chunk_tokens must be >= 1"),
]


@pytest.mark.parametrize(("path", "values", "message"), RANGES, ids=[f"{p}-{next(iter(v))}" for p, v, _ in RANGES])
def test_a_value_out_of_range_is_refused_with_what_it_takes(path, values, message):
    cls = CONFIGS[f"eviback.{path}"]
    with pytest.raises(ValueError, match=message):
        cls(**{**valid(cls), **values})


def test_every_checked_class_has_range_checks_here():
    checked = {f"eviback.{p}" for p, _, _ in RANGES}
    assert not sorted(set(CONFIGS) - set(PENDING) - checked)


def test_values_are_converted_to_their_field_types():
    from eviback.backoff import BackoffConfig, Mode
    from eviback.experiment.config import ExperimentConfig
    from eviback.retrieval.config import BM25Config

    assert BackoffConfig(mode="grpo").mode is Mode.GRPO  # an enum's value
    config = ExperimentConfig(**{**valid(ExperimentConfig), "out": "results/x"})
    assert config.out == Path("results/x")  # a string where a path belongs
    bm25 = BM25Config(k1=1)  # an integer where a float belongs
    assert bm25.k1 == 1.0 and isinstance(bm25.k1, float)
    assert type_name(Mode) == "one of grpo, dapo, eviback, f1-fallback (Mode)"


def test_an_experiment_file_names_itself_and_the_key():
    from eviback.experiment.config import parse_experiment

    spec = {"name": "t", "out": "out", "steps": 0, "eval": {"benchmarks": ["nq"], "limit": 2},
            "arms": [{"name": "grpo", "preset": "grpo"}]}
    with pytest.raises(ValueError, match=r"^x\.yaml: steps must be >= 1, got 0$"):
        parse_experiment(spec, "x.yaml")
    with pytest.raises(ValueError, match=r"^x\.yaml: eval\.limit must be >= 1, got 0$"):
        parse_experiment({**spec, "steps": 2, "eval": {"benchmarks": ["nq"], "limit": 0}}, "x.yaml")
