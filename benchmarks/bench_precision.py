"""What `dtype: auto` buys on a CPU without native bf16: the same work in each precision path, on one machine.

Paths (each in its own process, so that the kernel restrictions hold from start-up):

- `native`: the machine as it is, `dtype: auto` (bf16 here when the CPU has AVX512-BF16 or AMX);
- `avx2`: PyTorch, oneDNN and vLLM restricted to their AVX2 kernels (benchmarks/avx2_only), `dtype: auto`
  (fp32 there): what a laptop or cloud CPU without AVX-512 runs;
- `avx2-bf16`: the same restriction with `dtype: bfloat16` forced, the default before `auto`, for reference.
  It is about 30-60x slower, so its update and warm start run on less work (2 rollouts, 2 examples) and are
  compared with the others by their per-token rate (the update's time is scaled to the full work, said in
  the output as `scaled_from`); its rollout part is not run (`--bf16-rollout` runs it: about 20 minutes).

Parts, per path:

- `matmul`: one-thread (384^3) and all-thread (1024^3) GFLOP/s of bf16 and fp32 square matmuls: the
  hardware peak, measured in the same run as everything else;
- `update`: one GRPO update at the experiment's shape, through the trainer's own pieces: the policy as
  `eviback train` loads it for the path's precision (bf16 + fp32 masters, or fp32), the reference model's
  no-grad pass, then per micro-batch of 2 rollouts the padding-free log-probabilities (train/update.py), a
  policy-gradient loss and its backward, then clipping and the optimiser step. The batch: 2 questions x G = 5
  rollouts of a 260-token prompt and 700 tokens of completion, 300 of them the model's own (two 200-token
  observations masked), random tokens (the cost depends on shapes, not on values);
- `rollout`: vLLM generation through the rollout engine at the experiment's settings (2 questions x G = 5 per
  batch, 2 searches, 160 tokens a turn, 300-token observations, temperature 1) with the bundled SmolLM2 and
  BM25 over the embedded corpus: a warm-up batch, then timed batches; generated tokens per second;
- `warmstart`: the warm start (`eviback sft`) of 8 examples (2 on avx2-bf16), trained into a temporary
  directory; its tokens per second, and the minutes that rate gives for the demo's 100 examples;
- `test`, `demo`: the README's two commands as a new user runs them: `git clone` of this repository's HEAD
  into a temporary directory, then `/usr/bin/time -v make test` (or `make demo`) there with an empty
  `EVIBACK_CACHE`, `.venv` setup included; wall time, peak RSS, exit code and the command's last lines (its
  whole log beside the JSON). Not run on avx2-bf16, whose parts above show it would take hours.

    python benchmarks/bench_precision.py --out results/precision                    # the four parts
    python benchmarks/bench_precision.py --paths native,avx2 --parts test,demo --out results/precision
    python benchmarks/bench_precision.py --paths avx2 --parts matmul,update --out /tmp/p

Writes `<out>/bench_precision.json` (every figure, per path, with the load average around each part).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "EVIBACK_AVX2_ONLY": "1"}
PATHS = {  # name: (restricted to AVX2, dtype setting, work scale: 1 = full, <1 = less work, scaled up)
    "native": (False, "auto"),
    "avx2": (True, "auto"),
    "avx2-bf16": (True, "bfloat16"),
}
PARTS = ("matmul", "update", "rollout", "warmstart")
COMMANDS = ("test", "demo")  # whole `make` commands from a fresh clone (not in the default parts: ~1 hour)
# Reduced work on the emulated-bf16 path (it is ~60x slower): rollouts per update, rollout batches, examples.
REDUCED = {"update_rows": 2, "rollout_batches": 1, "warmstart_examples": 2}
FULL = {"update_rows": 10, "rollout_batches": 3, "warmstart_examples": 8}
DEMO_WARMSTART_EXAMPLES = 100


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# --------------------------------------------------------------------------------------------------
# Parts (run in the child process of a path)


def part_matmul() -> dict:
    import torch

    from eviback.dtype import measure_matmul

    one = measure_matmul(size=384, seconds=0.3)
    out = {"one_thread": {"bf16_gflops": one.bf16_gflops, "fp32_gflops": one.fp32_gflops, "size": 384}}
    threads = torch.get_num_threads()
    figures = {}
    for name, dt in (("fp32_gflops", torch.float32), ("bf16_gflops", torch.bfloat16)):
        n = 1024
        a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
        torch.mm(a, b)
        count, start = 0, time.perf_counter()
        while count < 2 or time.perf_counter() - start < 0.5:
            torch.mm(a, b)
            count += 1
        figures[name] = round(2 * n ** 3 * count / (time.perf_counter() - start) / 1e9, 2)
    out["all_threads"] = {**figures, "size": 1024, "threads": threads}
    return out


def synthetic_batch(rows: int, vocab: int, seed: int = 0):
    """(input_ids, attention_mask, score_mask, logits_to_keep) of `rows` rollouts of the experiment's shape."""
    import torch

    prompt, completion = 260, 700  # the completion holds two 200-token observations
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, prompt + completion), generator=g)
    attention = torch.ones_like(ids)
    score = torch.ones(rows, completion, dtype=torch.long)
    # two observations masked from the loss: model 100 | obs 200 | model 100 | obs 200 | model 100
    score[:, 100:300] = 0
    score[:, 400:600] = 0
    return ids, attention, score, completion


def part_update(dtype_setting: str, rows: int, warm_up: bool = True) -> dict:
    import torch

    from eviback.dtype import choose
    from eviback.policy import resolve_model
    from eviback.train.precision import MasterWeightAdamW
    from eviback.train.runner import load_policy_for_training, training_precision
    from eviback.train.update import padding_free_logprobs, score_plan

    choice = choose(dtype_setting)
    precision = training_precision(choice.dtype, cuda=False)
    path = resolve_model("smollm2-135m", "float32")
    model, master = load_policy_for_training(path, precision, None)
    reference, _ = load_policy_for_training(path, precision, None)  # TRL's reference copy, same dtype
    reference.eval()
    if master is not None:
        optimizer = MasterWeightAdamW(model, master, lr=1e-6, weight_decay=0.0)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0, fused=True)
    model.train()
    ids, attention, score, keep = synthetic_batch(rows, model.config.vocab_size)
    advantages = torch.linspace(-1, 1, rows)
    params = sum(p.numel() for p in model.parameters())

    def update() -> dict:
        times = {}
        t0 = time.perf_counter()
        with torch.no_grad():
            padding_free_logprobs(reference, ids, score_plan(attention, keep, score))
        times["reference_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for start in range(0, rows, 2):
            sl = slice(start, start + 2)
            out = padding_free_logprobs(model, ids[sl], score_plan(attention[sl], keep, score[sl]))
            mask = score[sl].float()
            loss = -((out.logps * mask).sum(-1) * advantages[sl]).sum() / mask.sum()
            loss.backward()
            if master is not None:
                optimizer.accumulate()
        times["policy_forward_backward_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        if master is not None:
            optimizer.clip_master_grads(1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times["optimizer_s"] = time.perf_counter() - t0
        times["update_s"] = sum(times.values())
        return times

    if warm_up:  # allocator, kernel choice (skipped on the ~30x slower emulated path: minutes, and noise there
        update()  # is a small share of the time)
    before = load()
    timed = update()
    tokens = int(ids.numel())
    flops = 6 * params * tokens + 2 * params * tokens  # policy forward+backward, reference forward
    return {"dtype": choice.dtype, "precision": precision.value, "rows": rows, "tokens": tokens, "warm_up": warm_up,
            "model_tokens_scored": int(score.sum()), **{k: round(v, 2) for k, v in timed.items()},
            "gflops": round(flops / timed["update_s"] / 1e9, 1), "load_before": before, "load_after": load()}


def part_rollout(dtype_setting: str, batches: int) -> dict:
    from eviback.data import load_suite, read_questions
    from eviback.dtype import resolve
    from eviback.generation import BackendConfig, load_backend
    from eviback.retrieval import suite_retriever
    from eviback.rollout import RolloutConfig, RolloutEngine

    suite = load_suite(None)
    questions = read_questions(next(iter(suite.eval_files(["nq"]).values())))
    dtype = resolve(dtype_setting)
    started = time.perf_counter()
    backend = load_backend(BackendConfig(backend="vllm", dtype=dtype, kv_cache_gib=1.0, max_model_len=4096))
    engine_start = time.perf_counter() - started
    retriever = suite_retriever(suite)
    engine = RolloutEngine(backend, retriever, RolloutConfig(
        group_size=5, max_turns=2, max_turn_tokens=160, max_observation_tokens=300, topk=3, temperature=1.0))
    kernels = sorted({Path(line.split()[-1]).name for line in Path("/proc/self/maps").read_text().splitlines()
                      if "vllm/_C" in line})
    engine.rollout(questions[:2], seed=100)  # warm-up
    timings = []
    for b in range(batches):
        chunk = questions[2 + 2 * b: 4 + 2 * b]
        before = load()
        t0 = time.perf_counter()
        batch = engine.rollout(chunk, seed=b)
        seconds = time.perf_counter() - t0
        generated = batch.generated_tokens
        timings.append({"seconds": round(seconds, 2), "generated_tokens": generated,
                        "generate_s": round(batch.generate_s, 2), "retrieve_s": round(batch.retrieve_s, 3),
                        "turns": len(batch.turns), "tokens_per_second": round(generated / seconds, 1),
                        "load_before": before})
    retriever.close()
    total_tokens = sum(t["generated_tokens"] or 0 for t in timings)
    total_seconds = sum(t["seconds"] for t in timings)
    return {"dtype": dtype, "engine_start_s": round(engine_start, 1), "vllm_kernels": kernels,
            "batches": timings, "tokens_per_second": round(total_tokens / total_seconds, 1) if total_seconds else None,
            "seconds_per_batch": round(total_seconds / len(timings), 2)}


def part_warmstart(dtype_setting: str, examples: int) -> dict:
    from eviback.train.sft import REPORT_FILE, WarmStartConfig, warm_start

    with tempfile.TemporaryDirectory() as tmp:
        config = WarmStartConfig(max_examples=examples, max_observation_tokens=300, gradient_accumulation=2,
                                 dtype=dtype_setting, output=str(Path(tmp) / "ws"), force=True, progress=False)
        started = time.perf_counter()
        path = warm_start(config)
        wall = time.perf_counter() - started
        report = json.loads((path / REPORT_FILE).read_text())
        choice = json.loads((path / "sft_config.json").read_text())["dtype_choice"]
    train = report["train"]
    per_example = train["seconds"] / max(1, train["examples"])
    return {"dtype": choice["dtype"], "examples": train["examples"], "tokens": train["tokens"],
            "train_seconds": train["seconds"], "wall_seconds": round(wall, 1),
            "tokens_per_second": train["tokens_per_second"], "peak_rss_gb": train["peak_rss_gb"],
            f"minutes_for_{DEMO_WARMSTART_EXAMPLES}_examples_at_this_rate":
                round(per_example * DEMO_WARMSTART_EXAMPLES / 60, 1)}


def child(path: str, part: str) -> dict:
    _, setting = PATHS[path]
    work = REDUCED if path == "avx2-bf16" else FULL
    import torch

    from eviback.dtype import choose

    info = {"path": path, "part": part, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "dtype_choice": choose(setting).to_dict(), "threads": torch.get_num_threads(), "load_start": load()}
    started = time.perf_counter()
    if part == "matmul":
        result = part_matmul()
    elif part == "update":
        result = part_update(setting, work["update_rows"], warm_up=work is FULL)
    elif part == "rollout":
        result = part_rollout(setting, work["rollout_batches"])
    elif part == "warmstart":
        result = part_warmstart(setting, work["warmstart_examples"])
    else:
        raise ValueError(f"unknown part {part!r}")
    return {**info, **result, "part_wall_s": round(time.perf_counter() - started, 1), "load_end": load()}


# --------------------------------------------------------------------------------------------------
# Parent: one child per (path, part)


def path_env(path: str) -> dict[str, str]:
    restricted, _ = PATHS[path]
    env = dict(os.environ)
    env.pop("EVIBACK_DTYPE", None)
    if restricted:
        env.update(AVX2_ENV)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE / "avx2_only"), env.get("PYTHONPATH")]))
    return env


def clean_log(path: Path) -> None:
    """Drop pip's notes about the machine's own package index locations (not the project's output)."""
    lines = path.read_text(errors="replace").splitlines(keepends=True)
    path.write_text("".join(line for line in lines if not line.startswith("WARNING: Location 'file:")))


def run_command(path: str, target: str, out: Path) -> dict:
    """`make <target>` in a fresh clone of HEAD with an empty cache, under the path's restrictions."""
    import re
    import shutil

    _, setting = PATHS[path]
    if setting != "auto":
        return {"path": path, "part": target, "skipped": "the forced-bf16 path is ~60x slower: see its parts"}
    root = HERE.parent
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, check=True).stdout.strip())
    work = Path(tempfile.mkdtemp(prefix=f"bench-{target}-{path}-"))
    try:
        subprocess.run(["git", "clone", "-q", str(root), str(work / "clone")], check=True)
        env = path_env(path)
        # the clone's own avx2_only folder, so that the command sees exactly what a clone holds
        env["PYTHONPATH"] = env.get("PYTHONPATH", "").replace(str(HERE / "avx2_only"),
                                                               str(work / "clone" / "benchmarks" / "avx2_only"))
        env["EVIBACK_CACHE"] = str(work / "cache")
        env.pop("VIRTUAL_ENV", None)
        log_path = out / f"make-{target}-{path}.log"
        before = load()
        started = time.perf_counter()
        with open(log_path, "w") as log:
            done = subprocess.run(["/usr/bin/time", "-v", "make", target], cwd=work / "clone", env=env,
                                  stdout=log, stderr=subprocess.STDOUT, check=False)
        wall = time.perf_counter() - started
        clean_log(log_path)
        text = log_path.read_text(errors="replace")
        rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
        summary = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed)", line)]
        return {"path": path, "part": target, "commit": head, "working_tree_dirty": dirty,
                "exit_code": done.returncode, "wall_s": round(wall, 1), "wall_min": round(wall / 60, 1),
                "peak_rss_gb": round(int(rss.group(1)) / 1024 ** 2, 2) if rss else None,
                "pytest_summary": summary[-1] if summary else None, "log": log_path.name,
                "load_before": before, "load_after": load()}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_child(path: str, part: str) -> dict:
    env = path_env(path)
    with tempfile.NamedTemporaryFile("r", suffix=".json") as answer:
        code = subprocess.run([sys.executable, __file__, "--child", path, "--part", part, "--answer", answer.name],
                              env=env, check=False)
        if code.returncode != 0:
            return {"path": path, "part": part, "error": f"exit code {code.returncode}"}
        return json.loads(Path(answer.name).read_text())


def scaled(results: dict) -> dict:
    """The reduced-work figures of avx2-bf16 scaled to the full work, and the ratios the issue asks for."""
    out: dict = {}
    full, reduced = FULL, REDUCED
    bf16 = results.get("avx2-bf16", {})
    if "update" in bf16 and "update_s" in bf16["update"]:
        factor = full["update_rows"] / reduced["update_rows"]
        out["avx2-bf16_update_s_scaled"] = {"value": round(bf16["update"]["update_s"] * factor, 1),
                                            "scaled_from": f"{reduced['update_rows']} rollouts x {factor:g}"}
    ratios = {}
    for part, key, higher_better in (("update", "update_s", False), ("rollout", "tokens_per_second", True),
                                     ("warmstart", "tokens_per_second", True), ("test", "wall_s", False),
                                     ("demo", "wall_s", False)):
        a = results.get("avx2", {}).get(part, {}).get(key)
        b = bf16.get(part, {}).get(key)
        if part == "update" and "avx2-bf16_update_s_scaled" in out:
            b = out["avx2-bf16_update_s_scaled"]["value"]
        if a and b:
            ratios[f"{part}_auto_over_bf16_on_avx2"] = round((b / a) if not higher_better else (a / b), 1)
        n = results.get("native", {}).get(part, {}).get(key)
        if a and n:
            ratios[f"{part}_native_over_avx2_auto"] = round((a / n) if not higher_better else (n / a), 2)
    out["speedups"] = ratios
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--out", type=Path, default=Path("results/precision"))
    parser.add_argument("--bf16-rollout", action="store_true", help="run the rollout part on avx2-bf16 too")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--part", help=argparse.SUPPRESS)
    parser.add_argument("--answer", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    if args.child:
        Path(args.answer).write_text(json.dumps(child(args.child, args.part)))
        return 0

    args.out.mkdir(parents=True, exist_ok=True)
    target = args.out / "bench_precision.json"
    record = json.loads(target.read_text()) if target.exists() else {}
    record.update({"command": " ".join(["python benchmarks/bench_precision.py", *(argv or sys.argv[1:])]),
                   "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                               "python": platform.python_version()},
                   "work": {"full": FULL, "avx2-bf16": REDUCED}})
    results = record.setdefault("paths", {})
    for path in args.paths.split(","):
        for part in args.parts.split(","):
            if path == "avx2-bf16" and part == "rollout" and not args.bf16_rollout:
                results.setdefault(path, {})[part] = {"path": path, "part": part, "skipped": "about 20 minutes "
                                                      "for one batch: run with --bf16-rollout"}
                continue
            logging.info("path %s, part %s", path, part)
            result = run_command(path, part, args.out) if part in COMMANDS else run_child(path, part)
            results.setdefault(path, {})[part] = result
            record["derived"] = scaled(results)
            target.write_text(json.dumps(record, indent=1) + "\n")  # after every part: a long run keeps what it did
            logging.info("%s %s: %s", path, part, json.dumps(result)[:400])
    print(json.dumps(record["derived"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
