"""`eviback experiment`: the experiment file, the paired bootstrap, and a two-step, two-arm experiment end to
end as a user runs it (real model, real retriever, local teacher), committed run by run and resumed."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
import yaml

from eviback.data import embedded_root
from eviback.experiment import load_experiment, parse_experiment
from eviback.experiment.compare import (
    changed_share,
    common_keys,
    mean_curves,
    paired_bootstrap,
    trailing_mean,
)

ROOT = Path(__file__).resolve().parents[1]


def runs_of(values: list[list[float]], benchmark: str = "nq") -> list[dict]:
    """One run (seed) per list: item i scores values[seed][i] on every metric."""
    return [{(benchmark, str(i)): {"f1": v, "em": v, "valid_answer": v, "searches": v} for i, v in enumerate(vals)}
            for vals in values]


def test_paired_bootstrap_of_a_run_against_itself_is_exactly_zero():
    runs = runs_of([[0.0, 1.0, 0.5, 0.2] * 10])
    d = paired_bootstrap(runs, runs, "f1", samples=500)["macro"]
    assert (d.diff, d.lo, d.hi, d.items) == (0.0, 0.0, 0.0, 40)
    assert not d.excludes_zero


def test_paired_bootstrap_pairs_items_so_a_constant_shift_is_certain():
    rng = np.random.default_rng(0)
    base = rng.uniform(0, 1, 200).tolist()  # items of very different difficulty
    d = paired_bootstrap(runs_of([[x + 0.05 for x in base]]), runs_of([base]), "f1", samples=500)["macro"]
    assert d.diff == pytest.approx(0.05) and d.lo == pytest.approx(0.05) and d.hi == pytest.approx(0.05)
    # unpaired noise of the same size is not significant: one item better, another worse
    noisy = [x + (0.05 if i % 2 else -0.05) for i, x in enumerate(base)]
    d = paired_bootstrap(runs_of([noisy]), runs_of([base]), "f1", samples=500)["macro"]
    assert abs(d.diff) < 1e-9 and d.lo < 0 < d.hi


def test_paired_bootstrap_resamples_seeds_and_averages_benchmarks():
    # two seeds of the arm disagree wildly; one seed alone would look certain, the pair does not
    arm = runs_of([[1.0] * 50, [0.0] * 50])
    base = runs_of([[0.4] * 50])
    d = paired_bootstrap(arm, base, "em", samples=1000, seed=1)["macro"]
    assert d.diff == pytest.approx(0.1) and d.lo < 0 < d.hi
    # the macro average weighs sets equally, whatever their sizes
    two = [{**runs_of([[1.0] * 10])[0], **runs_of([[0.0] * 90], "musique")[0]}]
    zero = [{k: {m: 0.0 for m in v} for k, v in two[0].items()}]
    result = paired_bootstrap(two, zero, "f1", samples=200)
    assert result["nq"].diff == 1.0 and result["musique"].diff == 0.0 and result["macro"].diff == 0.5
    # the same seed gives the same interval
    assert paired_bootstrap(arm, base, "em", samples=300, seed=3) == paired_bootstrap(arm, base, "em", samples=300,
                                                                                     seed=3)


def test_arms_run_on_the_same_seeds_pair_run_s_with_run_s():
    # seed 1 is far better than seed 0 in both arms, and the arm is 0.05 above the baseline in each seed:
    # drawn together, the seeds cancel; drawn apart, the seed spread swamps the 0.05
    base = runs_of([[0.2] * 50, [0.8] * 50])
    arm = runs_of([[0.25] * 50, [0.85] * 50])
    paired = paired_bootstrap(arm, base, "f1", samples=1000, paired_seeds=True)["macro"]
    assert paired.diff == pytest.approx(0.05) and paired.lo == pytest.approx(0.05) and paired.hi == pytest.approx(0.05)
    apart = paired_bootstrap(arm, base, "f1", samples=1000)["macro"]
    assert apart.diff == pytest.approx(0.05) and apart.lo < 0 < apart.hi
    with pytest.raises(ValueError, match="as many runs"):
        paired_bootstrap(arm[:1], base, "f1", paired_seeds=True)


def test_runs_on_different_items_cannot_be_paired():
    with pytest.raises(ValueError, match="different items"):
        common_keys(runs_of([[0.0, 1.0]]), runs_of([[0.0]]))


def test_curves_average_seeds_per_step_and_answers_changed():
    runs = [[{"step": 1, "k": 1.0}, {"step": 2, "k": 3.0}], [{"step": 1, "k": 2.0}, {"step": 2, "k": None}]]
    assert mean_curves(runs, "k") == ([1, 2], [1.5, 3.0])
    assert changed_share({("a", "1"): "x", ("a", "2"): None}, {("a", "1"): "x", ("a", "2"): "y"}) == 0.5


def test_training_summary_means_the_all_zero_groups_diversity_over_steps_and_seeds():
    from eviback.experiment.compare import training_summary

    runs = [[{"step": 1, "backoff/all_zero_distinct_evidence": 2.0, "backoff/all_zero_distinct_rewards": 1.0},
             {"step": 2, "backoff/all_zero_distinct_evidence": None}],  # a step without an all-zero group
            [{"step": 1, "backoff/all_zero_distinct_evidence": 4.0, "backoff/all_zero_distinct_rewards": 3.0}]]
    distinct = training_summary(runs)["distinct"]
    assert (distinct["evidence"], distinct["rewards"]) == (3.0, 2.0)
    assert distinct["statuses"] != distinct["statuses"]  # NaN: never logged (no teacher)


def test_all_zero_anatomy_counts_what_could_tell_a_groups_rollouts_apart():
    from eviback.experiment.compare import all_zero_anatomy

    def rollout(answer, queries, ids):
        return {"answer": answer, "queries": queries, "passage_ids": ids}

    def verdict(status, error=None):
        return {"status": status, "error": error}

    q = "Who wrote Hamlet?"
    groups = [
        # a verified group is not counted
        {"kind": "verified", "question": q, "golden_answers": ["Shakespeare"], "rewards": [1.0, 0.0],
         "verdicts": None, "summaries": [rollout("Shakespeare", [q], [["1"]]), rollout("x", [], [])]},
        # the question as written (case, punctuation, articles aside), the same passages in another order,
        # answers of the same F1, judged alike: nothing tells the rollouts apart
        {"kind": "fallback", "question": q, "golden_answers": ["William Shakespeare"], "rewards": [0.1, 0.1],
         "verdicts": [verdict("S"), verdict("S")],
         "summaries": [rollout("Marlowe", ["who wrote hamlet"], [["1", "2"]]),
                       rollout(None, ["Who wrote the Hamlet", "hamlet author"], [["2"], ["1"]])]},
        # another query, other passages, a partly right answer, mixed verdicts and rewards
        {"kind": "fallback", "question": q, "golden_answers": ["William Shakespeare"], "rewards": [0.1, 0.0],
         "verdicts": [verdict("S"), verdict("I")], "labels": ["S", "I"],
         "summaries": [rollout("Shakespeare", ["Hamlet play author"], [["3"]]), rollout("no", [], [])]},
        # a teacher error: not judged; grpo's all-zero group has no verdicts at all
        {"kind": "teacher_error", "question": q, "golden_answers": ["a"], "rewards": [0.0], "labels": ["I"],
         "verdicts": [verdict(None, "timeout")], "summaries": [rollout("b", [q], [["1"]])]},
        {"kind": "all_zero", "question": q, "golden_answers": ["a"], "rewards": [0.0], "verdicts": None,
         "summaries": [rollout("b", [q], [["1"]])]},
        # DAPO drops the groups whose rollouts all hit as well as those that all failed: only the latter count
        {"kind": "dropped", "em": [1.0], "question": q, "golden_answers": ["a"], "rewards": [1.0],
         "verdicts": None, "summaries": [rollout("a", [q], [["1"]])]},
        {"kind": "dropped", "em": [0.0], "question": q, "golden_answers": ["a"], "rewards": [0.0],
         "verdicts": None, "summaries": [rollout("b", ["other"], [["1"]])]},
    ]
    assert all_zero_anatomy(groups) == {
        "groups": 5, "rollouts": 7, "informative": 1, "first_query_is_question": 4, "no_search": 1,
        "same_evidence": 4, "f1_differs": 1, "judged": 2, "judged_all_s": 1, "judged_all_a": 0,
        "judged_all_i": 0, "judged_mixed": 1, "labelled": 2, "labels_differ": 1}


def test_trailing_mean_averages_the_window_behind_each_step():
    assert trailing_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert trailing_mean([1.0, 3.0], 5) == [1.0, 2.0]
    assert trailing_mean([], 3) == []
    with pytest.raises(ValueError, match="window"):
        trailing_mean([1.0], 0)


def minimal(**extra) -> dict:
    return {"name": "t", "out": "out", "steps": 2, "eval": {"benchmarks": ["nq"], "limit": 2},
            "arms": [{"name": "grpo", "preset": "grpo"}, {"name": "eviback", "preset": "eviback", "seeds": [0, 1]}],
            **extra}


@pytest.mark.parametrize(("change", "message"), [
    ({"settings": {"max_steps": 5}}, "the experiment sets for every run"),
    ({"arms": [{"name": "grpo", "preset": "grpo", "settings": {"seed": 3}}]}, "the experiment sets"),
    ({"baseline": "nope"}, "no arm named 'nope'"),
    ({"arms": [{"name": "a b", "preset": "grpo"}]}, "needs a name"),
    ({"arms": [{"name": "x", "preset": "grpo"}, {"name": "x", "preset": "dapo"}]}, "distinct names"),
    ({"arms": [{"name": "x", "preset": "grpo", "seeds": [0, 0]}]}, "seeds must be distinct"),
    ({"arms": [{"name": "x", "preset": "nope"}]}, "unknown preset"),
    ({"settings": {"lamda": 0.3}}, r"arm 'grpo': unknown setting\(s\) \['lamda'\]"),
    ({"settings": {"group_size": 1}}, "group_size must be >= 2"),
    ({"arms_": []}, "unknown key"),
    ({"contrasts": [["eviback", "nope"]]}, "no arm named 'nope'"),
    ({"contrasts": [["grpo", "grpo"]]}, "pair of two different arms"),
    ({"contrasts": ["eviback"]}, "pair of two different arms"),
])
def test_bad_experiment_files_are_refused_before_any_run(change, message):
    with pytest.raises(ValueError, match=message):
        parse_experiment(minimal(**change), "x.yaml")


def test_runs_go_seed_by_seed_and_settings_layer_in_order():
    config = parse_experiment(minimal(settings={"lam": 0.3}, baseline="grpo"))
    assert [(a.name, s) for a, s in config.runs()] == [("grpo", 0), ("eviback", 0), ("eviback", 1)]
    train = config.train_config(config.arm("eviback"), 1)
    assert (train.backoff.mode, train.backoff.lam, train.seed, train.build_seed, train.max_steps) == \
        ("eviback", 0.3, 1, 0, 2)
    assert (train.eval_benchmarks, train.eval_limit, train.eval_warm_start) == (["nq"], 2, False)


def finished_run(directory: Path, score: float, items: int = 10, start: str | None = None) -> None:
    """The files `keep` leaves for a finished run, every held-out item scoring `score` on every metric; `start`:
    the fingerprint of the weights it began from."""
    (directory / "eval").mkdir(parents=True)
    if start is not None:
        (directory / "start.json").write_text(json.dumps({"policy": "key", "fingerprint": start}))
    with gzip.open(directory / "eval" / "items.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"benchmark": "nq", "id": str(i), "answer": "x", "f1": score, "em": score,
                                 "valid_answer": score, "searches": score, "duplicate_searches": 0,
                                 "forced": False}) + "\n" for i in range(items))
    metrics = dict.fromkeys(("em", "f1", "valid_answer_rate", "avg_searches", "duplicate_query_rate",
                             "forced_termination_rate"), score)
    (directory / "eval" / "summary.json").write_text(json.dumps({"benchmarks": [{"name": "nq", "metrics": metrics}]}))
    (directory / "metrics.jsonl").write_text(json.dumps({"step": 1, "time/step": 1.0}) + "\n")
    (directory / "done.json").write_text("{}\n")


def test_contrasts_compare_two_arms_run_s_against_run_s(tmp_path):
    from eviback.experiment.report import build

    config = parse_experiment({
        "name": "t", "out": str(tmp_path), "steps": 2, "eval": {"benchmarks": ["nq"], "limit": 10},
        "arms": [{"name": "grpo", "preset": "grpo", "seeds": [0, 1]},
                 {"name": "eviback", "preset": "eviback", "seeds": [0, 1]},
                 {"name": "single", "preset": "eviback-single-prompt", "seeds": [1]},
                 {"name": "dapo", "preset": "dapo", "seeds": [5]}],
        "contrasts": [["eviback", "single"], ["dapo", "eviback"]]})
    for arm, seed, score in [("grpo", 0, 0.2), ("grpo", 1, 0.8), ("eviback", 0, 0.3), ("eviback", 1, 0.9),
                             ("single", 1, 0.6), ("dapo", 5, 0.5)]:
        finished_run(tmp_path / arm / f"seed-{seed}", score)
    result = build(config)
    assert set(result["differences"]) == {"eviback - grpo", "single - grpo", "dapo - grpo", "eviback - single",
                                          "dapo - eviback", "grpo seed 1 - grpo seed 0"}
    # on the seed both ran (1), paired: EviBack's 0.9 against the single-prompt run's 0.6, with no noise
    contrast = result["differences"]["eviback - single"]["f1"]["macro"]
    assert (contrast["diff"], contrast["lo"], contrast["hi"]) == pytest.approx((0.3, 0.3, 0.3))
    assert result["difference_seeds"]["eviback - single"] == "1 paired"
    # no seed in common: every run of one arm against every run of the other
    apart = result["differences"]["dapo - eviback"]["f1"]["macro"]
    assert apart["diff"] == pytest.approx(-0.1) and result["difference_seeds"]["dapo - eviback"] == "5 - 0, 1"
    # an interval for every item metric, duplicate queries and forced stops included
    assert set(result["differences"]["eviback - grpo"]) == {"f1", "em", "valid_answer", "searches",
                                                            "duplicate_searches", "forced"}
    # a contrast with an arm that has no finished run yet is left out, not an error
    (tmp_path / "single" / "seed-1" / "done.json").unlink()
    assert "eviback - single" not in build(config)["differences"]


def test_a_run_from_another_warm_start_is_measured_from_its_own(tmp_path, monkeypatch):
    from eviback.experiment import run
    from eviback.experiment.report import build, markdown

    config = parse_experiment({
        "name": "t", "out": str(tmp_path / "out"), "work": str(tmp_path / "work"), "steps": 2,
        "eval": {"benchmarks": ["nq"], "limit": 10},
        "arms": [{"name": "grpo", "preset": "grpo"}, {"name": "single", "preset": "eviback-single-prompt"}]})
    a, b = "a" * 64, "b" * 64  # the experiment's warm start, and one rebuilt on another machine
    out = tmp_path / "out"
    finished_run(out / "warm-start", 0.1, start=a)
    finished_run(out / "grpo" / "seed-0", 0.2, start=a)
    finished_run(out / "single" / "seed-0", 0.6, start=b)
    assert run.unevaluated_starts(config) == {b}

    # this machine's warm start is a third one: nothing is kept, and the runs stay compared with warm-start/
    def child(fingerprint: str):
        def fake(command):
            work = tmp_path / "work" / "other-start"
            (work / "start.json").write_text(json.dumps({"policy": "key", "fingerprint": fingerprint}))
            if fingerprint in command[-1]:  # the child evaluates only a wanted start
                finished_run(tmp_path / "fresh", 0.4)
                for name in ("eval/summary.json", "eval/items.jsonl.gz"):
                    (work / name).parent.mkdir(exist_ok=True)
                    (work / name).write_bytes((tmp_path / "fresh" / name).read_bytes())
                with gzip.open(work / "eval" / "items.jsonl.gz", "rb") as f:
                    (work / "eval" / "items.jsonl").write_bytes(f.read())
        return fake

    monkeypatch.setattr(run, "run_process", child("c" * 64))
    assert run.evaluate_other_start(config) is None and run.unevaluated_starts(config) == {b}
    # known already (a run made here began from it): no process is started to learn it is not wanted
    monkeypatch.setattr(run, "run_process", lambda command: pytest.fail("started a process"))
    assert run.evaluate_other_start(config, this_machine="c" * 64) is None
    # it is the one the single-prompt run began from: evaluated once, kept beside warm-start/
    monkeypatch.setattr(run, "run_process", child(b))
    assert run.evaluate_other_start(config) == out / f"warm-start-{b[:16]}"
    assert run.unevaluated_starts(config) == set()

    result = build(config)
    differences = {k: v["f1"]["macro"]["diff"] for k, v in result["differences"].items()}
    assert differences == pytest.approx({"single - grpo": 0.4, "grpo - warm start": 0.1,
                                         f"warm start {b[:16]} - warm start": 0.3,
                                         f"single - warm start {b[:16]}": 0.2})
    assert result["difference_seeds"]["single - grpo"] == "0 paired, from different starts"
    text = markdown(result)
    assert "did not all start from the same weights" in text and f"| warm start {b[:16]} | macro |" in text


@pytest.mark.parametrize("name", ["cpu.yaml", "cpu-round2.yaml", "cpu-round3.yaml", "lr-probe.yaml", "gpu.yaml", "searchr1-parity.yaml"])
def test_shipped_experiment_files_are_valid(name):
    config = load_experiment(ROOT / "experiments" / name, data=str(embedded_root()))
    assert config.arm(config.baseline) and config.eval_limit >= 40
    assert {config.train_config(a, s).data for a, s in config.runs()} == {str(embedded_root())}


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie waiting for a reaper counts as gone)."""
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return False


def test_stopping_the_experiment_stops_the_run_in_progress_and_what_it_started(tmp_path):
    """SIGTERM to the experiment (`kill`, a job scheduler) kills its run's process group too: no orphaned
    trainer is left writing into the run directory the next `eviback experiment` resumes."""
    import signal
    import time

    pids = tmp_path / "pids"
    run = ("import subprocess, sys, time\n"
           "sleeper = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
           f"open({str(pids)!r}, 'w').write(f'{{__import__(\"os\").getpid()}} {{sleeper.pid}}')\n"
           "time.sleep(600)\n")
    experiment = subprocess.Popen([sys.executable, "-c", (
        "import sys\nfrom eviback.experiment.run import run_process, sigterm_as_exit\n"
        f"with sigterm_as_exit():\n    run_process([sys.executable, '-c', {run!r}])\n")])
    deadline = time.monotonic() + 120
    while not (pids.exists() and len(pids.read_text().split()) == 2):
        assert experiment.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    child, grandchild = map(int, pids.read_text().split())
    assert _alive(child) and _alive(grandchild)
    experiment.send_signal(signal.SIGTERM)
    assert experiment.wait(timeout=60) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 30
    while (_alive(child) or _alive(grandchild)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child) and not _alive(grandchild)


def test_a_run_that_fails_fails_the_experiment_with_its_exit_code():
    from eviback.experiment.run import run_process

    with pytest.raises(subprocess.CalledProcessError) as failed:
        run_process([sys.executable, "-c", "raise SystemExit(3)"])
    assert failed.value.returncode == 3


@pytest.mark.parametrize("code, status, says", [(75, 75, "exited 75"), (1, 1, "exited 1"),
                                                (-9, 1, "was killed by signal 9")])
def test_a_failed_run_stops_the_experiment_in_one_line_with_its_status(tmp_path, monkeypatch, capsys, code, status,
                                                                      says):
    from eviback.cli import main
    from eviback.experiment import run

    def failing(command):
        raise subprocess.CalledProcessError(code, list(command))

    monkeypatch.chdir(tmp_path)
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(minimal()))
    monkeypatch.setattr(run, "run_process", failing)
    assert main(["experiment", "exp.yaml"]) == status
    err = capsys.readouterr().err
    assert err.startswith(f"eviback experiment: `{sys.executable} -c ") and "Traceback" not in err
    assert f"{says} (its own message is above), so the experiment stopped. The runs it finished are kept in " \
           "out; run the same command again to go on" in err


# ---- end to end --------------------------------------------------------------------------------------------

TINY = {"backend": "hf", "warm_start": False, "group_size": 2, "questions_per_step": 2, "max_turns": 1,
        "max_turn_tokens": 24, "max_obs_tokens": 64, "save_steps": 1, "teacher_stage_a": "prompted",
        "train_files": ["popqa_train"]}


# The end-to-end test's time limits. Each `eviback experiment` call has its own, and the test's limit
# (pytest-timeout; 1,800 s for the other tests) is above their sum, so a slow experiment fails with its own
# output and stops its runs, instead of pytest ending the test in the middle of a call and leaving them.
FIRST_CALL_S = 2400  # the warm-start evaluation and two 2-step runs, on a slow CPU machine
REPLAY_CALL_S = 300  # everything done: the comparison only
TEST_LIMIT_S = FIRST_CALL_S + REPLAY_CALL_S + 300


def run_experiment(cwd: Path, *args: str, timeout_s: float) -> subprocess.CompletedProcess:
    """`eviback experiment ARGS` in `cwd`; past `timeout_s` it is stopped with SIGTERM (which stops the run it
    started, see the test above) and the test fails with the end of its output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1", "GIT_AUTHOR_NAME": "t",
           "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    command = [sys.executable, "-m", "eviback.cli", "experiment", *args]
    with subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as process:
        try:
            out, err = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.terminate()
            try:
                out, err = process.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                process.kill()
                out, err = process.communicate()
            pytest.fail(f"`eviback experiment` ran past its {timeout_s:.0f} s limit and was stopped:\n{err[-3000:]}")
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def test_the_end_to_end_limits_are_consistent():
    assert FIRST_CALL_S + REPLAY_CALL_S < TEST_LIMIT_S
    marker = test_two_arm_experiment_end_to_end_committed_and_resumed.pytestmark
    assert any(m.name == "timeout" and m.args == (TEST_LIMIT_S,) for m in marker)


@pytest.mark.slow
@pytest.mark.timeout(TEST_LIMIT_S)
def test_two_arm_experiment_end_to_end_committed_and_resumed(tmp_path):
    git = ["git"]
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    spec = {"name": "ci", "out": "results/ci", "work": "runs/ci", "steps": 2, "baseline": "grpo", "settings": TINY,
            "eval": {"benchmarks": ["nq", "hotpotqa"], "limit": 3}, "bootstrap_samples": 200,
            "contrasts": [["grpo", "eviback"]],
            "arms": [{"name": "grpo", "preset": "grpo"}, {"name": "eviback", "preset": "eviback"}]}
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(spec))
    data = str(embedded_root())
    result = run_experiment(tmp_path, "exp.yaml", "--data", data, "--commit", timeout_s=FIRST_CALL_S)
    assert result.returncode == 0, result.stderr[-4000:]
    out = tmp_path / "results" / "ci"
    for arm in ("grpo", "eviback"):
        kept = out / arm / "seed-0"
        names = sorted(str(p.relative_to(kept)) for p in kept.rglob("*") if p.is_file())
        # what is kept: the numbers, no checkpoint and no model
        assert set(names) - {"teacher.json"} == {"config.yaml", "done.json", "eval/items.jsonl.gz",
                                                 "eval/summary.json", "groups.jsonl.gz", "metrics.jsonl",
                                                 "start.json"}
        assert ("teacher.json" in names) == (arm == "eviback")
        config = yaml.safe_load((kept / "config.yaml").read_text())
        assert (config["max_steps"], config["seed"], config["data"]) == (2, 0, "$DATA")
        with gzip.open(kept / "eval" / "items.jsonl.gz", "rt") as f:
            assert len(f.readlines()) == 6  # 3 questions x 2 sets, the same for every arm
        assert len((kept / "metrics.jsonl").read_text().splitlines()) == 2
    assert not (out / "grpo" / "seed-0" / "checkpoints").exists()
    # a finished run's checkpoints are removed from the work directory (its final model stays)
    work = tmp_path / "runs" / "ci" / "grpo" / "seed-0"
    assert (work / "metrics.jsonl").exists() and not (work / "checkpoints").exists()
    # the machine's data path is in no kept file: the suite is named by its files' hashes
    for path in out.rglob("*"):
        if path.is_file() and path.suffix in (".yaml", ".json", ".md", ".jsonl"):
            assert data not in path.read_text(), path
    assert "data_files" in yaml.safe_load((out / "experiment.yaml").read_text())
    comparison = json.loads((out / "comparison.json").read_text())
    assert set(comparison["differences"]) == {"eviback - grpo", "grpo - eviback", "grpo - warm start",
                                              "eviback - warm start"}
    macro = comparison["differences"]["eviback - grpo"]["f1"]["macro"]
    assert macro["items"] == 6 and macro["lo"] <= macro["diff"] <= macro["hi"]
    # a contrast is the same pairing the other way round
    reverse = comparison["differences"]["grpo - eviback"]["f1"]["macro"]
    assert reverse["diff"] == pytest.approx(-macro["diff"])
    assert comparison["difference_seeds"]["grpo - eviback"] == "0 paired"
    assert comparison["arms"]["eviback"]["training"]["steps"] == 2
    # the warm start and both runs started from the same weights, checked by their hash
    assert [sorted(v) for v in comparison["start_policies"].values()] == [["eviback seed 0", "grpo seed 0",
                                                                           "warm start"]]
    training = comparison["arms"]["eviback"]["training"]
    assert sum(training["teacher_status"].values()) + training["teacher_errors"] == training["teacher_judged"]
    assert training["cpu_s"] > 0 and comparison["arms"]["grpo"]["training"]["stage_b_runs"] == 0
    text = (out / "comparison.md").read_text()
    assert "| eviback - grpo | 0 paired | 6 |" in text
    assert ("What the teacher said" in text) == (training["teacher_judged"] > 0)
    # the all-zero groups counted from each run's groups.jsonl.gz: 2 steps x 2 questions at most
    anatomy = {arm: comparison["arms"][arm]["all_zero"] for arm in ("grpo", "eviback")}
    assert all(z["groups"] <= 4 and z["judged"] <= z["groups"] for z in anatomy.values())
    assert anatomy["grpo"]["judged"] == 0 and training["evidence_labelled"] <= training["teacher_judged"]
    assert ("The all-zero groups, counted" in text) == any(z["groups"] for z in anatomy.values())
    assert "The machine under the runs" in text
    assert "data:image/png;base64," in (out / "comparison.html").read_text()
    log = subprocess.run([*git, "log", "--format=%s"], cwd=tmp_path, capture_output=True, text=True).stdout
    assert log.splitlines() == ["experiment ci: eviback seed 0 (2 steps) and the refreshed comparison",
                                "experiment ci: grpo seed 0 (2 steps) and the refreshed comparison",
                                "experiment ci: the warm start evaluated on the held-out questions"]
    tracked = subprocess.run([*git, "ls-files"], cwd=tmp_path, capture_output=True, text=True).stdout
    assert "runs/" not in tracked and "checkpoint" not in tracked
    # a second call redoes nothing: every run is done
    again = run_experiment(tmp_path, "exp.yaml", "--data", data, "--commit", timeout_s=REPLAY_CALL_S)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "run 1/" not in again.stderr and "eviback - grpo" in again.stdout


def test_a_run_resumes_only_from_the_start_it_began_with(tmp_path, caplog):
    """A run's checkpoints were trained from the policy its start.json names. Resumed after the warm start
    changed (a new builder version: another cache key, so another name), it is refused rather than continued
    with the new start as its reference and record; the same warm start rebuilt on another machine (same name,
    other weights) goes on, and the record keeps the weights the run began from."""
    from eviback.train.runner import StartChanged, write_start_record

    def policy(name: str, weights: bytes) -> str:
        directory = tmp_path / "cache" / name
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text("{}")
        (directory / "model.safetensors").write_bytes(weights)
        return str(directory)

    record = tmp_path / "run" / "start.json"
    record.parent.mkdir()
    write_start_record(record, policy("builder4-key", b"a"))
    began = json.loads(record.read_text())
    assert began["policy"] == "builder4-key"
    write_start_record(record, policy("builder4-key", b"a"), resuming=True)
    assert json.loads(record.read_text()) == began
    with pytest.raises(StartChanged, match="'builder4-key'.*'builder5-key'"):
        write_start_record(record, policy("builder5-key", b"b"), resuming=True)
    with caplog.at_level("WARNING"):
        write_start_record(record, policy("builder4-key", b"a rebuilt sibling"), resuming=True)
    assert "rebuilt here" in caplog.text and json.loads(record.read_text()) == began
    write_start_record(record, policy("builder5-key", b"b"))  # a fresh run records its own start
    assert json.loads(record.read_text())["policy"] == "builder5-key"
