"""Running an experiment: the warm start's evaluation, then every (arm, seed) run, one after the other.

Each run trains in its own `eviback train` process (so peak memory is per run, and a crash is one run's),
in `<work>/<arm>/seed-<seed>/` with its checkpoints. When it has finished (trained and evaluated), what is
worth keeping is copied to `<out>/<arm>/seed-<seed>/` and marked done:

    config.yaml  metrics.jsonl  groups.jsonl.gz  teacher.json  start.json  eval/summary.json  eval/items.jsonl.gz
    done.json

so that `<out>` holds every number of the comparison and no checkpoint (and `<out>/warm-start/`, the start
evaluated on the same questions; `<out>/warm-start-<fingerprint>/` for another warm start a run began from,
rebuilt on another machine). A done run is never redone; an
interrupted one resumes from its last checkpoint (`eviback train --resume`). With `commit`, each finished
run and the refreshed comparison are committed to git at once, so an interrupted experiment loses at most
the run in progress.

Stopping the experiment (Ctrl-C, or SIGTERM from `kill` or a job scheduler) stops the run in progress with it:
each run's process and whatever it started run in their own process group, killed with the experiment, so
no orphaned trainer keeps writing into a run directory that the next `eviback experiment` resumes.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

import yaml

from eviback.data import file_sha256, load_suite
from eviback.evaluate import run_eval
from eviback.experiment.config import Arm, ExperimentConfig
from eviback.log_format import configure_logging
from eviback.train.config import TrainConfig
from eviback.train.runner import held_out_eval_config, initial_policy, write_start_record

log = logging.getLogger(__name__)

DONE = "done.json"
START = "warm-start"


def run_dir(root: Path, arm: str, seed: int) -> Path:
    return root / arm / f"seed-{seed}"


def is_done(config: ExperimentConfig, arm: str, seed: int) -> bool:
    return (run_dir(config.out, arm, seed) / DONE).exists()


def _child_env() -> dict[str, str]:
    return {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1"}


@contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """Within the block, SIGTERM raises SystemExit(143) (as Ctrl-C raises KeyboardInterrupt), so that the
    cleanup of `run_process` runs; Python's default for SIGTERM ends the process without any. Only the main
    thread can set a handler: elsewhere the block changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_process(command: Sequence[str]) -> None:
    """Run `command` to its end in its own process group; raises CalledProcessError on a non-zero exit. If
    this process is interrupted meanwhile (KeyboardInterrupt, or SystemExit under `sigterm_as_exit`), the
    whole group (the command and every process it started) is killed before the exception goes on."""
    process = subprocess.Popen(list(command), env=_child_env(), start_new_session=True)
    try:
        code = process.wait()
    except BaseException:
        with suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise
    if code:
        raise subprocess.CalledProcessError(code, list(command))


def train_run(config: ExperimentConfig, arm: Arm, seed: int) -> Path:
    """Train and evaluate one run in its own process (resuming it when its directory exists)."""
    work = run_dir(config.work_dir, arm.name, seed)
    settings = config.train_config(arm, seed).to_dict()
    work.parent.mkdir(parents=True, exist_ok=True)
    settings_file = work.parent / f"seed-{seed}.yaml"
    settings_file.write_text(yaml.safe_dump(settings, sort_keys=False))
    command = [*(config.launch or (sys.executable, "-m")), "eviback.cli", "train", "--preset", arm.preset,
               "--config", str(settings_file), "--output", str(work)]
    if (work / "config.yaml").exists():
        command.append("--resume")
    log.info("run %s seed %d: %s", arm.name, seed, " ".join(command))
    run_process(command)
    return work


def _hide_data_path(text: str, data: str | None) -> str:
    """A kept file names the data suite as $DATA, not by this machine's path (the files' hashes are in
    experiment.yaml)."""
    if not data:
        return text
    for form in sorted({data, str(Path(data).resolve())}, key=len, reverse=True):
        text = text.replace(form, "$DATA")
    return text


def keep(work: Path, target: Path, extra: dict, data: str | None = None) -> None:
    """Copy what a finished run leaves worth keeping (no checkpoints, no model) and mark it done, last."""
    if not (work / "eval" / "summary.json").exists():
        raise RuntimeError(f"{work} has no held-out evaluation (eval/summary.json): the run did not finish")
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "eval").mkdir(parents=True)
    for name in ("config.yaml", "metrics.jsonl", "teacher.json", "start.json", "eval/summary.json"):
        if (work / name).exists():
            (tmp / name).write_text(_hide_data_path((work / name).read_text(), data))
    for source, dest in ((work / "groups.jsonl", tmp / "groups.jsonl.gz"),
                         (work / "eval" / "items.jsonl", tmp / "eval" / "items.jsonl.gz")):
        if source.exists():
            with source.open("rb") as f, gzip.GzipFile(dest, "wb", mtime=0) as g:
                shutil.copyfileobj(f, g)
    (tmp / DONE).write_text(json.dumps(extra, indent=2) + "\n")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)


def evaluate_start(config: ExperimentConfig) -> Path:
    """The common starting point (the cached warm start of the baseline's first seed; every run shares it)
    on the same held-out questions, in its own process; kept in `<out>/warm-start/`."""
    target = config.out / START
    if (target / DONE).exists():
        return target
    work = config.work_dir / START
    _evaluate_this_start(config, work)
    keep(work, target, {"run": START, "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, config.settings.get("data"))
    return target


def start_fingerprint(directory: Path) -> str | None:
    """The fingerprint of the weights a kept run (or start) began from, from its start.json."""
    path = directory / "start.json"
    return json.loads(path.read_text())["fingerprint"] if path.exists() else None


def other_start_dir(config: ExperimentConfig, fingerprint: str) -> Path:
    return config.out / f"{START}-{fingerprint[:16]}"


def unevaluated_starts(config: ExperimentConfig) -> set[str]:
    """Fingerprints that finished runs started from, other than the experiment's warm start's, and not yet
    evaluated. The warm start is cached per machine, and the CPU fine-tune is not bitwise reproducible across
    machines: rebuilt on another one it can be a sibling, so a run made there started from other weights."""
    main = start_fingerprint(config.out / START)
    if main is None:
        return set()
    started = {start_fingerprint(run_dir(config.out, arm.name, seed)) for arm, seed in config.runs()
               if is_done(config, arm.name, seed)}
    return {fp for fp in started if fp and fp != main and not (other_start_dir(config, fp) / DONE).exists()}


def evaluate_other_start(config: ExperimentConfig, this_machine: str | None = None) -> Path | None:
    """When a finished run started from another warm start than `<out>/warm-start/` and this machine's cached
    warm start is that one, evaluate it once on the same questions into `<out>/warm-start-<fingerprint>/`, so
    that the run is compared with the weights it started from. Returns the kept directory, if any.
    `this_machine`: the fingerprint of this machine's warm start when already known (a run made here just
    started from it), so that no process is started to learn that it is not wanted."""
    wanted = unevaluated_starts(config)
    if not wanted or (this_machine is not None and this_machine not in wanted):
        return None
    work = config.work_dir / "other-start"
    shutil.rmtree(work, ignore_errors=True)
    _evaluate_this_start(config, work, wanted)
    fingerprint = start_fingerprint(work)
    if fingerprint not in wanted or not (work / "eval" / "summary.json").exists():
        log.warning("finished runs started from warm start(s) %s, which this machine does not have (its own is "
                    "%s): they are compared with the experiment's warm start only",
                    ", ".join(sorted(f[:16] for f in wanted)), (fingerprint or "?")[:16])
        return None
    target = other_start_dir(config, fingerprint)
    keep(work, target, {"run": target.name, "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
         config.settings.get("data"))
    return target


def _evaluate_this_start(config: ExperimentConfig, work: Path, wanted: set[str] | None = None) -> None:
    """This machine's cached warm start (built if missing), evaluated on the held-out questions in its own
    process, into `work`; with `wanted`, only when its fingerprint is one of them (start.json is written
    either way)."""
    baseline = config.arm(config.baseline)
    train = config.train_config(baseline, baseline.seeds[0])
    work.mkdir(parents=True, exist_ok=True)
    (work / "config.yaml").write_text(yaml.safe_dump(train.to_dict(), sort_keys=False))
    code = (f"from eviback.experiment.run import _evaluate_start_child; "
            f"_evaluate_start_child({str(work)!r}, {sorted(wanted) if wanted is not None else None!r})")
    log.info("evaluating the warm start on the held-out questions (%s x %d)%s", ", ".join(config.eval_benchmarks),
             config.eval_limit, " if it is the one some finished runs started from" if wanted else "")
    run_process([sys.executable, "-c", code])


def _evaluate_start_child(work: str, wanted: list[str] | None = None) -> None:
    configure_logging(logging.INFO)
    config = TrainConfig.from_settings(yaml.safe_load((Path(work) / "config.yaml").read_text()))
    policy = initial_policy(config)
    write_start_record(Path(work) / "start.json", policy)
    if wanted is not None and start_fingerprint(Path(work)) not in wanted:
        return
    run_eval(held_out_eval_config(config, Path(work) / "eval", policy))


def commit(paths: list[Path], message: str) -> None:
    """Commit `paths` (and nothing else) to the git repository they are in."""
    subprocess.run(["git", "add", "--", *map(str, paths)], check=True)
    staged = subprocess.run(["git", "diff", "--cached", "--quiet", "--", *map(str, paths)], check=False)
    if staged.returncode == 0:
        return  # nothing changed
    subprocess.run(["git", "commit", "-q", "-m", message, "--", *map(str, paths)], check=True)


def run_experiment(config: ExperimentConfig, *, only: tuple[str, ...] = (), git_commit: bool = False,
                   report: Callable[[ExperimentConfig], list[Path]] | None = None) -> list[tuple[str, int]]:
    """Every run not yet done (of the arms in `only`, when given), then the comparison after each.
    Returns the (arm, seed) runs done by this call."""
    for name in only:
        config.arm(name)  # raises on an unknown arm
    with sigterm_as_exit():
        return _run_experiment(config, only, git_commit, report)


def _run_experiment(config: ExperimentConfig, only: tuple[str, ...], git_commit: bool,
                    report: Callable[[ExperimentConfig], list[Path]] | None) -> list[tuple[str, int]]:
    if git_commit:
        inside = subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], capture_output=True, text=True)
        if inside.stdout.strip() != "true":
            raise ValueError("--commit needs the results directory inside a git work tree")
    config.out.mkdir(parents=True, exist_ok=True)
    (config.out / "experiment.yaml").write_text(yaml.safe_dump(spec_of(config), sort_keys=False))
    evaluated = (config.out / START / DONE).exists()
    evaluate_start(config)
    if git_commit:
        commit([config.out / "experiment.yaml", config.out / START], f"experiment {config.name}: " + (
            "experiment.yaml as it runs now" if evaluated else "the warm start evaluated on the held-out questions"))
    _evaluate_other_start(config, git_commit, report, None)
    todo = [(arm, seed) for arm, seed in config.runs() if (not only or arm.name in only)
            and not is_done(config, arm.name, seed)]
    done: list[tuple[str, int]] = []
    for i, (arm, seed) in enumerate(todo, 1):
        log.info("experiment %s: run %d/%d: %s seed %d", config.name, i, len(todo), arm.name, seed)
        started = time.monotonic()
        work = train_run(config, arm, seed)
        target = run_dir(config.out, arm.name, seed)
        keep(work, target, {"arm": arm.name, "preset": arm.preset, "seed": seed, "steps": config.steps,
                            "wall_s": round(time.monotonic() - started, 1),
                            "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, config.settings.get("data"))
        # a kept run is never resumed: its checkpoints (GBs each) go; the final model stays in the work dir
        shutil.rmtree(work / "checkpoints", ignore_errors=True)
        done.append((arm.name, seed))
        written = [target]
        if report is not None:
            written += report(config)
        if git_commit:
            commit(written, f"experiment {config.name}: {arm.name} seed {seed} ({config.steps} steps) and the "
                   "refreshed comparison")
        _evaluate_other_start(config, git_commit, report, start_fingerprint(target))
    return done


def _evaluate_other_start(config: ExperimentConfig, git_commit: bool,
                          report: Callable[[ExperimentConfig], list[Path]] | None, this_machine: str | None) -> None:
    kept = evaluate_other_start(config, this_machine)
    if kept is None:
        return
    written = [kept, *(report(config) if report is not None else [])]
    if git_commit:
        commit(written, f"experiment {config.name}: the warm start {kept.name.removeprefix(START + '-')}, which "
               "some runs started from, evaluated on the held-out questions and the refreshed comparison")


def spec_of(config: ExperimentConfig) -> dict:
    """The experiment as it ran (every default filled in), kept beside its results. The data suite is named by
    its files' hashes, not by this machine's path."""
    settings = dict(config.settings)
    suite = load_suite(settings.get("data"))
    files = [suite.corpus, *suite.train, *suite.eval.values()]
    if settings.get("data"):
        settings["data"] = "$DATA"
    return {"name": config.name, "out": str(config.out), "steps": config.steps, "baseline": config.baseline,
            "settings": settings, "eval": {"benchmarks": list(config.eval_benchmarks), "limit": config.eval_limit},
            "arms": [{"name": a.name, "preset": a.preset, "seeds": list(a.seeds), "settings": a.settings}
                     for a in config.arms],
            "bootstrap_samples": config.bootstrap_samples, "bootstrap_seed": config.bootstrap_seed,
            "launch": list(config.launch), "contrasts": [list(c) for c in config.contrasts],
            "data_files": {str(p.relative_to(suite.root)) if p.is_relative_to(suite.root) else p.name:
                           file_sha256(p) for p in files}}
