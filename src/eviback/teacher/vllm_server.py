"""Start and stop a local vLLM OpenAI-compatible server for the teacher (tests, benchmarks, one-box runs).

    with VllmServer(resolve_model("smollm2-135m")) as server:
        client = OpenAIChatClient(HttpBackendConfig(base_url=server.base_url, model=server.served_name))

The server is bound to 127.0.0.1 and started by eviback's one vLLM launcher (`eviback.vllm_process`, which
also runs it where `vllm serve` cannot start: the CPU build). Its KV cache is kept small
(`VLLM_CPU_KVCACHE_SPACE`, GiB) because teacher prompts are short and the machine is shared. Startup takes
about 1-2 minutes on a small CPU (vLLM compiles the model each start).
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
from dataclasses import dataclass

from eviback.dtype import check as check_dtype
from eviback.dtype import resolve as resolve_dtype
from eviback.settings import check_fields
from eviback.vllm_process import ServerProcess, vllm_argv


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class VllmServerConfig:
    """Options of the local vLLM server."""

    model_dir: str  # a local safetensors checkpoint (e.g. resolve_model("smollm2-135m"))
    served_name: str = "teacher"  # the model name clients send
    port: int = 0  # 0 picks a free port
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE
    max_model_len: int = 4096  # teacher prompts are ~1k tokens; a modest limit keeps memory small
    dtype: str = "auto"  # eviback's auto (bf16 where native, else fp32), resolved before vLLM sees it
    startup_timeout_s: float = 600.0
    log_path: str = ""  # file for the server's output ("": discarded)
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_fields(self)  # types first: the checks below compare numbers
        if not self.model_dir:
            raise ValueError("model_dir must be a local checkpoint directory, e.g. resolve_model('smollm2-135m')")
        if not self.served_name:
            raise ValueError("served_name must name the model for the clients, e.g. 'teacher'")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535 (0: a free one), got {self.port}")
        for name in ("kv_cache_gib", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_dtype(self.dtype)
        if not 0 < self.startup_timeout_s < math.inf:
            raise ValueError(f"startup_timeout_s must be > 0 seconds (vLLM starts in 1-2 minutes on a small CPU), "
                             f"got {self.startup_timeout_s}")


class VllmServer:
    """The teacher's vLLM server: a :class:`~eviback.vllm_process.ServerProcess` of `vllm serve` (its own process
    group, so stopping it stops its engine workers too)."""

    def __init__(self, config: VllmServerConfig) -> None:
        self.config = config
        self.port = config.port or free_port()
        self._server: ServerProcess | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def served_name(self) -> str:
        return self.config.served_name

    def command(self) -> list[str]:
        """The `vllm serve` line it runs (through :func:`~eviback.vllm_process.vllm_argv`)."""
        c = self.config
        return ["vllm", "serve", c.model_dir, "--served-model-name", c.served_name, "--host", "127.0.0.1", "--port",
                str(self.port), "--max-model-len", str(c.max_model_len), "--dtype", resolve_dtype(c.dtype),
                *c.extra_args]

    def start(self) -> VllmServer:
        c = self.config
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE=str(c.kv_cache_gib))
        self._server = ServerProcess(vllm_argv(self.command()), f"http://127.0.0.1:{self.port}", env=env,
                                     log_path=c.log_path or None, startup_timeout_s=c.startup_timeout_s,
                                     name="the teacher's vLLM server")
        self._server.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
