"""Does judging with an in-process teacher slow the policy's update afterwards? Pool threads vs the caller's.

EviBack's policy update (the TRL step, with no teacher in it) took 1.6x as long as GRPO's on the same
batches (results/experiment-cpu). The suspect: the teacher judged from its thread pool, and every pool
thread that runs torch with more than one intra-op thread starts an OpenMP team of its own, which lives as
long as the pool. Once a process holds more OpenMP threads than there are cores, GNU OpenMP stops
spin-waiting in every team, the trainer's included: its threads then sleep and wake at each of the update's
many small parallel regions.

Each measurement is a fresh process that times a training step of SmolLM2 (bf16, AdamW; `--rows` x
`--tokens` random token ids: the shapes of one micro-batch of the CPU experiment), then runs a teacher on
the same model class and times the step again. Modes:

- `none`: no teacher between the two timings (the noise floor of "after / before");
- `pool`: the two-stage policy on a local SmolLM2 judged from a pool of `--concurrency` threads (the
  teacher before it ran in-process clients in the caller's thread);
- `caller`: the same, judged in the calling thread (`Teacher.in_process`, now the default for such
  teachers).

Reported per process: seconds per step before and after, CPU cores busy during the steps (the process's
CPU seconds over wall seconds), the process's OS threads, and the bf16 matmul peak measured beside the steps;
modes alternate, `--reps` times.

    python benchmarks/bench_teacher_threads.py --out results/teacher-threads
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

MODES = ("none", "pool", "caller")


def threads_now() -> int:
    return psutil.Process().num_threads()


def matmul_peak_tflops(n: int = 1024, reps: int = 5) -> float:
    import torch

    a = torch.randn(n, n, dtype=torch.bfloat16)
    b = torch.randn(n, n, dtype=torch.bfloat16)
    a @ b
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best / 1e12


def measure(mode: str, rows: int, tokens: int, steps: int, concurrency: int, probes: int) -> dict:
    """One process's figures (run in a fresh process: OpenMP teams are per process and never go away)."""
    import torch

    from eviback.policy import load_model
    from eviback.teacher.judge import JudgeConfig, Teacher
    from eviback.teacher.local import LocalClient
    from eviback.teacher.policy import load_policy
    from eviback.teacher.probes import build_probes

    torch.manual_seed(0)
    model = load_model("smollm2-135m", "bfloat16")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.randint(0, model.config.vocab_size, (rows, tokens))

    def step() -> None:
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def timed() -> dict:
        step()  # warm-up
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(steps):
            step()
        wall = time.perf_counter() - wall
        return {"s_per_step": wall / steps, "cores_busy": (time.process_time() - cpu) / wall,
                "peak_tflops": matmul_peak_tflops()}

    before = timed()
    threads_before = threads_now()
    teacher_s = None
    if mode != "none":
        client = LocalClient()

        class Pooled:  # the same client without its in-process mark: judged from the pool, as before
            backend_id = client.backend_id
            complete = staticmethod(client.complete)
            close = staticmethod(client.close)

        trajectories = [p.trajectory for p in build_probes(probes, seed=3)]
        with Teacher(load_policy("two-stage"), Pooled() if mode == "pool" else client,
                     JudgeConfig(concurrency=concurrency)) as teacher:
            start = time.perf_counter()
            verdicts = teacher.judge(trajectories)
            teacher_s = time.perf_counter() - start
            after = timed()  # the teacher is still alive: in training it lives as long as the run
            threads_after = threads_now()
        assert not any(v.teacher_error for v in verdicts)
    else:
        after = timed()
        threads_after = threads_now()
    return {"mode": mode, "before": before, "after": after, "ratio": after["s_per_step"] / before["s_per_step"],
            "threads_before": threads_before, "threads_after": threads_after, "teacher_s": teacher_s,
            "torch_threads": torch.get_num_threads(), "load_avg": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=640)
    parser.add_argument("--steps", type=int, default=4, help="timed training steps before and after")
    parser.add_argument("--concurrency", type=int, default=8, help="the teacher's pool (eviback train's default)")
    parser.add_argument("--probes", type=int, default=4, help="rollouts the teacher judges")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child, args.rows, args.tokens, args.steps, args.concurrency, args.probes)))
        return 0
    results = []
    for rep in range(args.reps):
        for mode in MODES:
            cmd = [sys.executable, __file__, "--child", mode, "--rows", str(args.rows), "--tokens", str(args.tokens),
                   "--steps", str(args.steps), "--concurrency", str(args.concurrency), "--probes", str(args.probes)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            row = {"rep": rep, **json.loads(out.strip().splitlines()[-1])}
            results.append(row)
            print(f"rep {rep} {mode:>6}: {row['before']['s_per_step']:.2f} -> {row['after']['s_per_step']:.2f} s/step "
                  f"(x{row['ratio']:.2f}), cores busy {row['before']['cores_busy']:.2f} -> "
                  f"{row['after']['cores_busy']:.2f}, threads {row['threads_before']} -> {row['threads_after']}, "
                  f"peak {row['before']['peak_tflops']:.2f}/{row['after']['peak_tflops']:.2f} TFLOP/s", flush=True)
    summary = {mode: statistics.median(r["ratio"] for r in results if r["mode"] == mode) for mode in MODES}
    print("median after/before:", json.dumps({k: round(v, 3) for k, v in summary.items()}))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_teacher_threads.json").write_text(json.dumps(
            {"command": " ".join(["python", "benchmarks/bench_teacher_threads.py", *(argv or sys.argv[1:])]),
             "cpus": os.cpu_count(), "runs": results, "median_ratio": summary}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
