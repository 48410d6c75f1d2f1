"""Choosing a teacher backend from a benchmark's command line (shared by the bench_teacher_* scripts).

    --backend local                        the in-process transformers model (default: bundled SmolLM2)
    --backend http --base-url URL          an OpenAI-compatible server that is already running
    --backend vllm                         start vLLM's server on 127.0.0.1 for the run, then stop it
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

from eviback.teacher.chat import TeacherClient
from eviback.teacher.openai_http import DEFAULT_BASE_URL


def add_backend_arguments(parser: argparse.ArgumentParser, default: str = "local") -> None:
    parser.add_argument("--backend", choices=("local", "http", "vllm"), default=default)
    parser.add_argument("--base-url", default=DEFAULT_BASE_URL, help="with --backend http")
    parser.add_argument("--model", default="", help="served model name (http), or the model to load/serve")
    parser.add_argument("--structured-output", default="response_format")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--server-log", default="", help="with --backend vllm: where the server logs")
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="with --backend vllm")
    parser.add_argument("--threads", type=int, default=1,
                        help="with --backend local: torch threads (1 avoids OpenMP oversubscription on a busy box)")


@contextlib.contextmanager
def open_backend(args: argparse.Namespace, max_connections: int = 32) -> Iterator[TeacherClient]:
    from eviback.teacher.openai_http import HttpBackendConfig, OpenAIChatClient

    if args.backend == "local":
        from eviback.teacher.local import LocalBackendConfig, LocalClient

        yield LocalClient(LocalBackendConfig(model=args.model or "smollm2-135m", threads=args.threads))
        return
    if args.backend == "http":
        client = OpenAIChatClient(HttpBackendConfig(
            base_url=args.base_url, model=args.model, structured_output=args.structured_output,
            timeout_s=args.timeout, max_connections=max_connections))
        try:
            yield client
        finally:
            client.close()
        return
    from eviback.policy import resolve_model
    from eviback.teacher.vllm_server import VllmServer, VllmServerConfig

    config = VllmServerConfig(model_dir=resolve_model(args.model or "smollm2-135m"), served_name="teacher",
                              kv_cache_gib=args.kv_cache_gib, log_path=args.server_log)
    with VllmServer(config) as server:
        client = OpenAIChatClient(HttpBackendConfig(
            base_url=server.base_url, model=server.served_name, structured_output=args.structured_output,
            timeout_s=args.timeout, max_connections=max_connections))
        try:
            yield client
        finally:
            client.close()
