"""The policy served by vLLM's own server: TRL's server mode behind eviback's backend contract.

Generation runs in a separate `vllm serve` process, usually on GPUs of its own, and the trainer (one process
or many under `accelerate launch`) reaches it over HTTP; after each optimiser step the main process streams
the new weights into it over NCCL, through TRL's maintained client (`trl.generation.vllm_client.VLLMClient`).
This is the set-up TRL tests on GPUs (its `vllm_mode="server"`): the engine never shares a GPU with the
update, so it needs no sleep mode and keeps its CUDA graphs and its whole KV cache.

    eviback serve-policy smollm2-135m --port 8002           # prints and runs the `vllm serve` command below
    VLLM_SERVER_DEV_MODE=1 vllm serve DIR --port 8002 --weight-transfer-config '{"backend": "nccl"}' \\
        --logprobs-mode processed_logprobs
    eviback train --set backend=vllm-server --set policy_url=http://localhost:8002 ...
    eviback eval --backend vllm-server --policy-url http://localhost:8002 --model DIR ...

What this backend does, and why:

- **Token ids in and out.** Each prompt goes to the OpenAI-compatible `/v1/completions` endpoint as token ids
  with `return_token_ids`, so the ids a trainer sees are the ids the server sampled (the contract of
  :mod:`eviback.generation.base`). Stop strings, EOS and the length cap end a sequence as they do in the
  in-process vLLM backend (the same engine), and the text is decoded here from the ids.
- **One request per prompt, sampled from the server's own stream.** The server batches concurrent requests
  itself (continuous batching), and a group's G identical first-turn prompts sample G different rollouts.
  No request carries a seed by default: vLLM samples a seeded request with a generator of its own, one row
  at a time, which on a GPU serialises the sampling of a whole batch. `ServerConfig.seeded` gives each prompt
  `hash(reseed seed, call, row)` instead, so that :meth:`reseed` reproduces a rollout, at that cost.
- **Neutral sampling.** Every sampling field a request leaves out is filled by the server from the model's
  `generation_config.json` (a Qwen3 checkpoint brings `top_k=20, top_p=0.95`): each request sets them all
  (top-k, min-p and the penalties off), so rollouts are sampled from the distribution the trainer scores.
- **Log-probabilities after temperature and top-p** (`--logprobs-mode processed_logprobs`), as the
  in-process engine and TRL's importance-sampling correction read them; checked on connect.
- **Checked before any work**: the server answers, its model's tokenizer gives the local tokenizer's ids
  (a probe text with the protocol's tags), and a training run's server has the weight-transfer engine and
  the log-probability mode it needs. Each refusal says how to start the server right.
- **Weights over NCCL**, streamed tensor by tensor in the server's dtype (no full copy). NCCL needs the
  trainer on a CUDA GPU, so a CPU trainer is refused at start; evaluation needs no push and runs from any
  machine that can reach the server.

Tested on the CPU against a real `vllm serve` of the bundled model (generation, stop strings, seeds, the
checks). The NCCL push needs CUDA on both sides and has not been run here (docs/rollout.md says so).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from eviback.generation.base import (
    Completion,
    SamplingConfig,
    check_prompt_lengths,
    iter_weights,
    request_caps,
    vllm_finish_reason,
)
from eviback.protocol import ANSWER_STOP, SEARCH_STOP
from eviback.settings import check_fields
from eviback.unavailable import ServiceUnavailable

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

NAME = "vllm-server"
DEFAULT_PORT = 8002  # retrieval 8000 (Search-R1's port), the teacher 8001, the policy 8002
DEFAULT_URL = f"http://localhost:{DEFAULT_PORT}"
UNAVAILABLE_STATUS = frozenset({502, 503, 504})
GROUP_PORT = 51216  # the NCCL rendezvous port of TRL's client (its default)
LOGPROBS_MODE = "processed_logprobs"
# The flags a training server needs, as `trl vllm-serve` sets them (TRL 1.16 runs `vllm serve` with them).
WEIGHT_TRANSFER_FLAGS = ("--weight-transfer-config", '{"backend": "nccl"}')
TRAINING_FLAGS = (*WEIGHT_TRANSFER_FLAGS, "--logprobs-mode", LOGPROBS_MODE)
# Every sampling field vLLM's OpenAI server fills from the served model's generation_config.json when a request
# leaves it out, at its neutral value: the request's temperature and top-p are then the only sampling settings.
NEUTRAL_SAMPLING = {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                    "frequency_penalty": 0.0}
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"  # vLLM serves its weight-transfer and cache endpoints only with it set
# A probe the tokenizer check encodes on both sides: words, digits, punctuation and the protocol's tags.
PROBE = f"Who wrote Hamlet in 1601?{SEARCH_STOP} <information>Doc 1(Title: \"Hamlet\") ...</information>{ANSWER_STOP}"


LOOPBACK = "127.0.0.1"  # where `eviback serve-policy` listens unless told: its weight-push endpoints are open


def is_loopback(host: str) -> bool:
    """Whether `host` is an address of this machine only (127.x.x.x, ::1, localhost)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve_command(model_dir: str, *, port: int = DEFAULT_PORT, host: str = LOOPBACK, training: bool = True,
                  extra: Sequence[str] = ()) -> list[str]:
    """The `vllm serve` command line for `model_dir` (run it with ``VLLM_SERVER_DEV_MODE=1`` in the
    environment when `training`: the weight push and the prefix-cache reset are dev-mode endpoints)."""
    command = ["vllm", "serve", model_dir, "--host", host, "--port", str(port), "--logprobs-mode", LOGPROBS_MODE]
    if training:
        command += list(WEIGHT_TRANSFER_FLAGS)
    return command + list(extra)


def start_help(url: str) -> str:
    return (f"start the policy server first, e.g. `eviback serve-policy MODEL --port {port_of(url)}` (it prints "
            f"the `vllm serve` command it runs: {DEV_MODE_ENV}=1 vllm serve DIR {' '.join(_quoted(TRAINING_FLAGS))})")


def port_of(url: str) -> int:
    return httpx.URL(url).port or DEFAULT_PORT


def _quoted(flags: Sequence[str]) -> list[str]:
    return [f"'{f}'" if "{" in f else f for f in flags]


@dataclass(frozen=True)
class ServerInfo:
    """What a policy server says of itself. The dev-mode fields are None when it runs without dev mode."""

    model: str  # the served model's id (what requests name)
    root: str  # the directory or hub name it loaded
    max_model_len: int
    dev_mode: bool  # its /server_info (and the weight-transfer endpoints) are served
    logprobs_mode: str | None = None
    weight_transfer: str | None = None  # the weight-transfer engine's backend (nccl), None: none
    dtype: str | None = None  # the dtype its weights are held in

    @classmethod
    def parse(cls, models: Mapping[str, Any], server_info: Mapping[str, Any] | None) -> ServerInfo:
        card = models["data"][0]
        config = (server_info or {}).get("vllm_config") or {}
        model_config = config.get("model_config") or {}
        transfer = config.get("weight_transfer_config")
        dtype = model_config.get("dtype")
        return cls(model=card["id"], root=card.get("root") or card["id"], max_model_len=int(card["max_model_len"]),
                   dev_mode=server_info is not None, logprobs_mode=model_config.get("logprobs_mode"),
                   weight_transfer=transfer.get("backend") if isinstance(transfer, Mapping) else None,
                   dtype=str(dtype).removeprefix("torch.") if dtype else None)

    def training_problems(self) -> list[str]:
        """What keeps this server from serving a training run (empty: nothing)."""
        problems = []
        if not self.dev_mode:
            problems.append(f"it runs without {DEV_MODE_ENV}=1, so it serves no weight-transfer endpoint")
        elif self.weight_transfer is None:
            problems.append("it has no weight-transfer engine (--weight-transfer-config '{\"backend\": \"nccl\"}')")
        if self.dev_mode and self.logprobs_mode != LOGPROBS_MODE:
            problems.append(f"its log-probabilities are {self.logprobs_mode!r}, not {LOGPROBS_MODE!r} (the "
                            "distribution sampled from, which the importance-sampling correction compares with)")
        return problems


@dataclass(frozen=True)
class ServerConfig:
    """How to reach a policy server."""

    url: str = field(default=DEFAULT_URL, metadata={"help": "the policy server's base URL (vllm serve)"})
    timeout_s: float = field(default=600.0, metadata={"help": "seconds one generation request may take"})
    concurrency: int = field(default=256, metadata={"help": "requests in flight at once (the server batches them)"})
    group_port: int = field(default=GROUP_PORT, metadata={"help": "NCCL rendezvous port of the weight push"})
    seeded: bool = field(default=False, metadata={"help": "give each request a seed, so that reseed() reproduces a "
                         "rollout; vLLM then samples those rows one at a time (slower on a GPU). False: rows are "
                         "sampled from the server's own stream, batched"})

    def __post_init__(self) -> None:
        check_fields(self)
        parsed = httpx.URL(self.url)
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ValueError(f"policy_url must be an http(s) URL such as {DEFAULT_URL}, got {self.url!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"the policy server's timeout_s must be > 0, got {self.timeout_s}")
        if self.concurrency < 1:
            raise ValueError(f"the policy server's concurrency must be >= 1, got {self.concurrency}")
        if not 0 < self.group_port < 65536:
            raise ValueError(f"group_port must be a port number, got {self.group_port}")


class ServerError(RuntimeError):
    """The policy server failed a request or cannot serve what is asked of it."""


class PolicyServerUnavailable(ServerError, ServiceUnavailable):
    """The policy server stopped answering in the middle of the work (connection refused or reset, no answer
    within the timeout, 502-504). Not retried: a restarted server holds the weights it was started with, not the
    ones last pushed, so rollouts sampled from it would not be on-policy. A training run stops instead, saying
    how to continue with `--resume`, which pushes the checkpoint's weights into the restarted server before its
    first rollout (`eviback train` exits 75)."""

    service = "the policy server"

    def __init__(self, url: str, last_error: str, hint: str = "") -> None:
        self.url, self.last_error = url, last_error
        super().__init__(f"the policy server at {url} stopped answering ({last_error})" + (f"; {hint}" if hint else ""))

    def __reduce__(self) -> tuple[type[PolicyServerUnavailable], tuple[str, str]]:
        return type(self), (self.url, self.last_error)

    def reason(self) -> str:
        return f"stopped answering (last error: {self.last_error})"

    def restart(self) -> str:
        return f"`eviback serve-policy` serving at {self.url}, started as before"


class VllmServerBackend:
    """A :class:`~eviback.generation.base.GenerationBackend` whose engine is a `vllm serve` process.

    `shared` is True: one server serves every process of a multi-process run, so the trainer pushes weights
    from its main process alone and the others wait for that push (`train/grpo.py`)."""

    name = NAME
    shared = True

    def __init__(self, tokenizer: PreTrainedTokenizerBase, config: ServerConfig | None = None, *,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.config = config or ServerConfig()
        self.url = self.config.url.rstrip("/")
        self.tokenizer = tokenizer
        self._http = httpx.Client(
            timeout=httpx.Timeout(self.config.timeout_s, connect=10.0), transport=transport,
            limits=httpx.Limits(max_connections=self.config.concurrency,
                                max_keepalive_connections=self.config.concurrency))
        self._pool = ThreadPoolExecutor(max_workers=self.config.concurrency, thread_name_prefix="policy-server")
        self._lock = threading.Lock()
        self._seed = 0
        self._calls = 0
        self._weights: Any = None  # TRL's VLLMClient, once the first push has joined the NCCL group
        try:
            self.info = self._read_info()
            self.max_context = self.info.max_model_len
            self._check_tokenizer()
        except PolicyServerUnavailable as e:  # at the start it never answered: say how to start one
            # (from None: a refusal at the start, exit 2, not a run that stopped and can be resumed)
            raise ServerError(f"no policy server answers at {e.url} ({e.last_error}); {start_help(e.url)}") from None
        log.info("policy server %s: %s (%s), max_model_len %d%s", self.url, self.info.model, self.info.root,
                 self.max_context, "" if self.info.dev_mode else ", no dev mode (generation only)")

    @classmethod
    def connect(cls, model: str, config: ServerConfig | None = None, dtype: str = "auto", *,
                training: bool = False) -> VllmServerBackend:
        """A backend for the server at `config.url`, with the tokenizer of `model` (the served model: a local
        directory or a bundled name, see `eviback.policy`); `training`: it must take weight pushes. A server that
        cannot do the job (none answers, another tokenizer, no weight-transfer engine) is a ValueError: the
        settings name the wrong server, and the commands say so in one line."""
        from eviback.policy import load_tokenizer

        try:
            backend = cls(load_tokenizer(model, dtype), config)
            if training:
                backend.check_training()
        except ServerError as e:
            raise ValueError(str(e)) from e
        return backend

    # ---- the server's own answers

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return self._http.request(method, f"{self.url}{path}", **kwargs)
        except httpx.TimeoutException as e:
            raise PolicyServerUnavailable(self.url, f"no answer to {path} within {self.config.timeout_s:g} s, "
                                          f"{type(e).__name__}", "raise policy_timeout_s if it is only slow") from e
        except httpx.TransportError as e:
            raise PolicyServerUnavailable(self.url, f"{type(e).__name__}: {e}", start_help(self.url)) from e

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._request(method, path, **kwargs)
        if response.status_code in UNAVAILABLE_STATUS:  # a proxy in front of a stopped server, or shutting down
            raise PolicyServerUnavailable(self.url, f"HTTP {response.status_code} from {path}")
        if response.status_code != 200:
            detail = response.text[:500]
            error = ValueError if response.status_code == 400 else ServerError
            raise error(f"the policy server at {self.url} refused {path} ({response.status_code}): {detail}")
        return response.json()

    def _read_info(self) -> ServerInfo:
        models = self._json("GET", "/v1/models")
        if not models.get("data"):
            raise ServerError(f"the server at {self.url} serves no model")
        response = self._request("GET", "/server_info", params={"config_format": "json"})
        return ServerInfo.parse(models, response.json() if response.status_code == 200 else None)

    def _check_tokenizer(self) -> None:
        """Refuse a server whose model tokenises differently from the local tokenizer: the ids the trainer
        scores would not be the ids the server read and sampled."""
        served = self._json("POST", "/tokenize", json={"model": self.info.model, "prompt": PROBE,
                                                        "add_special_tokens": False})["tokens"]
        local = self.tokenizer.encode(PROBE, add_special_tokens=False)
        if list(served) != list(local):
            raise ValueError(f"the policy server at {self.url} serves {self.info.root!r}, whose tokenizer gives other "
                             f"ids than the local model's ({len(served)} vs {len(local)} ids for a probe text): "
                             "serve the model being trained, or name the served model as the run's model")

    def check_training(self) -> None:
        """Refuse, with how to restart it, a server a training run cannot push weights into."""
        problems = self.info.training_problems()
        if problems:
            raise ServerError(f"the policy server at {self.url} cannot serve a training run: {'; '.join(problems)}. "
                              f"{start_help(self.url)}")

    # ---- the contract

    def reseed(self, seed: int) -> None:
        with self._lock:
            self._seed = seed
            self._calls = 0

    def _seeds(self, count: int) -> list[int]:
        with self._lock:
            call = self._calls
            self._calls += 1
            seed = self._seed
        return [request_seed(seed, call, row) for row in range(count)]

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingConfig, max_tokens: Sequence[int] | None = None
    ) -> list[Completion]:
        """One Completion per prompt (prompts: token ids, each of shape (L_i,)), all requests in flight at once."""
        caps = request_caps(len(prompts), params, max_tokens)
        check_prompt_lengths(prompts, self.max_context, f"the server's max_model_len={self.max_context}")
        if not prompts:
            return []
        seeds = self._seeds(len(prompts)) if self.config.seeded else [None] * len(prompts)
        bodies = [self._body(list(p), params, min(cap, self.max_context - len(p)), seed)
                  for p, cap, seed in zip(prompts, caps, seeds, strict=True)]
        choices = list(self._pool.map(self._complete, bodies))
        return [self._completion(choice, params) for choice in choices]

    def _body(self, prompt: list[int], params: SamplingConfig, cap: int, seed: int | None) -> dict[str, Any]:
        body = {
            "model": self.info.model,
            "prompt": prompt,
            "max_tokens": cap,
            **NEUTRAL_SAMPLING,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "stop": list(params.stop),
            "include_stop_str_in_output": True,
            "min_tokens": params.min_tokens,
            "logprobs": 0 if params.logprobs else None,  # 0: the sampled token's own log-probability
            "skip_special_tokens": True,
            "return_token_ids": True,
        }
        if seed is not None:
            body["seed"] = seed
        return body

    def _complete(self, body: dict[str, Any]) -> dict[str, Any]:
        reply = self._json("POST", "/v1/completions", json=body)
        choice = reply["choices"][0]
        details = (reply.get("usage") or {}).get("prompt_tokens_details") or {}
        choice["cached_prompt_tokens"] = details.get("cached_tokens") or 0
        return choice

    def _completion(self, choice: Mapping[str, Any], params: SamplingConfig) -> Completion:
        ids = tuple(choice["token_ids"] or ())
        try:
            reason = vllm_finish_reason(choice.get("finish_reason"), choice.get("stop_reason"))
        except ValueError as e:
            raise ServerError(f"the policy server: {e}") from None
        logprobs: tuple[float, ...] = ()
        if params.logprobs:
            values = (choice.get("logprobs") or {}).get("token_logprobs") or []
            if len(values) != len(ids) or any(v is None for v in values):
                raise ServerError(f"the policy server returned {len(values)} log-probabilities for {len(ids)} tokens")
            logprobs = tuple(float(v) for v in values)
        # decoded here, as the in-process engine does: the server's text is cut at the stop string
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return Completion(token_ids=ids, text=text, logprobs=logprobs, finish_reason=reason,
                          cached_prompt_tokens=int(choice.get("cached_prompt_tokens") or 0))

    def update_weights(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream new policy weights into the server over NCCL (TRL's client; the trainer must be on a CUDA GPU),
        in the server's dtype, then drop its prefix cache. Names in Hugging Face checkpoint form."""
        import torch

        self.check_training()
        pairs = [(name, tensor.detach()) for name, tensor in iter_weights(weights)]
        if not pairs:
            raise ValueError("update_weights was given no weights")
        device = pairs[0][1].device
        if device.type != "cuda":
            raise ServerError(f"the weight push to the policy server runs on NCCL, which needs the trainer's weights "
                              f"on a CUDA GPU; they are on {device}. On a CPU, train with backend=vllm (in process)")
        target = getattr(torch, self.info.dtype, None) if self.info.dtype else None
        target = target if isinstance(target, torch.dtype) else None
        metadata = [(name, str(target or t.dtype).removeprefix("torch."), list(t.shape)) for name, t in pairs]
        try:
            client = self._weight_client(device)
            client.update_named_params(metadata, ((name, t.to(target) if target else t) for name, t in pairs))
            client.reset_prefix_cache()
        except Exception as e:
            if self.answers():
                raise
            self._weights = None  # its NCCL group went with the server
            raise PolicyServerUnavailable(self.url, f"the weight push failed: {type(e).__name__}: {e}") from e

    def answers(self) -> bool:
        """Whether the server answers its `/health` now (one attempt, a few seconds)."""
        try:
            return self._http.get(f"{self.url}/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def _weight_client(self, device: torch.device) -> Any:
        if self._weights is None:
            from trl.generation.vllm_client import VLLMClient

            client = VLLMClient(base_url=self.url, group_port=self.config.group_port)
            client.init_communicator(device=device)
            self._weights = client
        return self._weights

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (dev mode; a server without it keeps its cache)."""
        if self.info.dev_mode:
            self._json("POST", "/reset_prefix_cache")

    def close(self) -> None:
        if self._weights is not None:
            self._weights.close_communicator()
            self._weights = None
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()


def request_seed(seed: int, call: int, row: int) -> int:
    """The sampling seed of one request: a stable hash of (the reseed seed, the call's index since, the row),
    within vLLM's int64 seed range."""
    digest = hashlib.blake2b(f"{seed}:{call}:{row}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1
