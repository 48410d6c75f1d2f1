"""Serve a policy with vLLM's own server, for `backend=vllm-server` (TRL's server mode).

  eviback serve-policy                          the bundled SmolLM2 on http://127.0.0.1:8002
  eviback serve-policy DIR --host 0.0.0.0       reachable from other machines (trainers on other nodes)
  eviback serve-policy DIR --port 8002          any local HF model directory
  eviback serve-policy DIR --vllm-args "--gpu-memory-utilization 0.9 --tensor-parallel-size 2"
  eviback serve-policy DIR --print              print the command and exit
  eviback serve-policy DIR --generation-only    no weight-transfer engine (evaluation; a CPU server)

  CUDA_VISIBLE_DEVICES=7 eviback serve-policy DIR &
  CUDA_VISIBLE_DEVICES=0,1,2,3 accelerate launch --num_processes 4 -m eviback.cli train \\
      --set backend=vllm-server --set policy_url=http://localhost:8002 --set model=DIR ...

It prints the `vllm serve` command it runs (with VLLM_SERVER_DEV_MODE=1, which vLLM needs for its
weight-transfer endpoints; the flags are those `trl vllm-serve` sets) and then becomes that server. A bundled
model is converted to a checkpoint directory first, which `vllm serve` can read. The trainer's model must be
the one served (the backend checks the tokenizer on connect); its weights are pushed before the first rollout.

It listens on the loopback address by default: a training server runs vLLM's development endpoints, which
accept new weights (and reset the cache) from anyone who reaches the port. `--host 0.0.0.0` (or a private
address) opens it to trainers on other machines, with a warning; keep such a port on a private network.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys

from eviback import dtype as dtypes
from eviback.generation.server import DEFAULT_PORT, DEV_MODE_ENV, LOOPBACK, is_loopback, serve_command
from eviback.policy import DEFAULT_MODEL, resolve_model
from eviback.vllm_process import vllm_argv

HELP = "serve a policy with vLLM's server for backend=vllm-server (TRL's server mode)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                        help="model name (see eviback.policy) or local checkpoint directory (default: %(default)s)")
    parser.add_argument("--host", default=LOOPBACK, help="address to listen on (default: %(default)s, this machine "
                        "only; 0.0.0.0 for trainers on other machines: the weight-push endpoints are then open to "
                        "anyone who reaches the port)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (default: %(default)s)")
    parser.add_argument("--dtype", default="auto", choices=dtypes.CHOICES,
                        help="the bundled model's checkpoint dtype, and vLLM's --dtype (default: %(default)s)")
    parser.add_argument("--generation-only", action="store_true",
                        help="no weight-transfer engine: a server for evaluation (and the only kind a CPU build of "
                             "vLLM can run); a training run refuses it")
    parser.add_argument("--vllm-args", default="", help="more `vllm serve` arguments, as one quoted string")
    parser.add_argument("--print", action="store_true", help="print the command and exit")


def run(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be a port number, got {args.port}")
    extra = shlex.split(args.vllm_args)
    directory = resolve_model(args.model, args.dtype)
    if args.dtype != dtypes.AUTO:
        extra = ["--dtype", args.dtype, *extra]
    command = serve_command(directory, port=args.port, host=args.host, training=not args.generation_only,
                            extra=extra)
    print(f"{DEV_MODE_ENV}=1 {shlex.join(command)}", flush=True)
    if not args.generation_only and not is_loopback(args.host):
        print(f"eviback serve-policy: warning: listening on {args.host}: vLLM's development endpoints, which "
              f"replace the served weights, accept requests from anyone who can reach port {args.port}; keep it on "
              "a private network", file=sys.stderr, flush=True)
    if args.print:
        return 0
    if importlib.util.find_spec("vllm") is None:
        print("eviback serve-policy: error: vLLM is not installed in this environment: on a GPU machine "
              "`make setup DEVICE=cuda` (the README's 'On a GPU'), on a CPU the `vllm` extra", file=sys.stderr)
        return 2
    env = {**os.environ, DEV_MODE_ENV: "1"}
    os.execve(sys.executable, vllm_argv(command), env)
    return 0  # not reached

