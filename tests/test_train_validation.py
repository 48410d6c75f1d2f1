"""Validation during training (`val_every`) on a scripted policy: when it runs, on which process, in what order
it pushes, wakes, evaluates and puts the engine back to sleep; what it records, keeps and redoes; the settings; the
figures a step's log hands to the trackers; and the report's validation curve and sentence. The real run (the
CLI, a killed run resumed, two processes) is tests/test_train_cli.py and tests/test_train_multiprocess.py."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from eviback.evaluate import EvalConfig
from eviback.policy import load_tokenizer
from eviback.rollout import RolloutConfig
from eviback.train.config import TrainConfig
from eviback.train.plots import panels, write_report
from eviback.train.report_summary import summarize_run
from eviback.train.step_log import tracker_figures
from eviback.train.validation import Validation, validation_due
from rollout_fakes import ScriptedBackend, ScriptedRetriever, wiki

# two questions answered right, one wrong, one without an answer: EM 0.5 on every validation
NQ = [("n1", "who wrote hamlet", ["William Shakespeare"], "<answer> William Shakespeare </answer>"),
      ("n2", "capital of peru", ["Lima"], "<answer> Cusco </answer>"),
      ("n3", "largest ocean", ["Pacific Ocean", "Pacific"], "<answer> Pacific </answer>"),
      ("n4", "who painted guernica", ["Pablo Picasso"], "I think it is someone.")]
FIXTURE_RUN = Path(__file__).resolve().parent / "fixtures" / "demo-run"


@dataclass
class SleepingBackend(ScriptedBackend):
    """A scripted engine that records, in order, each push, wake, generate call and sleep (as vLLM on a GPU
    would be driven)."""

    events: list[str] = field(default_factory=list)

    def generate(self, prompts, params, max_tokens=None):
        self.events.append("generate")
        return super().generate(prompts, params, max_tokens)

    def update_weights(self, weights) -> None:
        self.events.append("push")

    def sleep(self) -> None:
        self.events.append("sleep")

    def wake(self) -> None:
        self.events.append("wake")


@dataclass
class Processes:
    is_main_process: bool
    waits: int = 0

    def wait_for_everyone(self) -> None:
        self.waits += 1


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m")


def make_validation(tmp_path, tokenizer, *, main=True, every=2, keep=10):
    qa = tmp_path / "nq.jsonl"
    qa.write_text("".join(json.dumps({"id": i, "question": q, "golden_answers": g}) + "\n" for i, q, g, _ in NQ))
    backend = SleepingBackend(tokenizer, {q: [reply] for _, q, _, reply in NQ})
    recorded: dict[int, dict] = {}
    validation = Validation(
        every=every, eval_config=EvalConfig(out=str(tmp_path / "val"), qa_files=(str(qa),), batch_size=2,
                                            progress=False, rollout=RolloutConfig(max_turns=1)),
        backend=backend, retriever=ScriptedRetriever(wiki), push=lambda: backend.update_weights({}),
        record=lambda step, figures: recorded.setdefault(step, dict(figures)), processes=Processes(main), keep=keep)
    return validation, backend, recorded


def end_step(validation: Validation, step: int) -> None:
    validation.on_step_end(None, SimpleNamespace(global_step=step), None)


def test_validation_runs_after_every_nth_step_with_the_step_s_weights(tmp_path, tokenizer):
    validation, backend, recorded = make_validation(tmp_path, tokenizer, every=2)
    end_step(validation, 1)
    assert backend.events == [] and recorded == {}
    end_step(validation, 2)
    # the step's weights go in before anything is generated, and the engine sleeps again before the next update
    events = backend.events
    assert events[:3] == ["push", "wake", "generate"] and events[-1] == "sleep"
    assert set(events[2:-1]) == {"generate"}
    figures = recorded[2]
    assert figures["val/em"] == figures["val/nq/em"] == 0.5 and figures["val/questions"] == 4
    assert figures["val/valid_answer_rate"] == 0.75 and figures["time/validation"] > 0
    items = (tmp_path / "val" / "step-000002" / "items.jsonl").read_text().splitlines()
    assert len(items) == 4
    assert validation.processes.waits == 1  # every process meets after it, the main one included
    assert [validation_due(s, 3) for s in range(7)] == [False, False, False, True, False, False, True]
    assert not any(validation_due(s, 0) for s in range(5))


def test_other_processes_only_wait(tmp_path, tokenizer):
    validation, backend, recorded = make_validation(tmp_path, tokenizer, main=False, every=1)
    end_step(validation, 1)
    assert backend.events == [] and recorded == {} and validation.processes.waits == 1
    assert not (tmp_path / "val").exists()


def test_a_redone_validation_starts_afresh_and_old_ones_are_pruned(tmp_path, tokenizer):
    validation, backend, recorded = make_validation(tmp_path, tokenizer, every=2, keep=1)
    # what an interrupted try of step 4 left (a run killed mid-validation redoes the step from a checkpoint)
    stale = tmp_path / "val" / "step-000004"
    stale.mkdir(parents=True)
    (stale / "items.jsonl").write_text("not an item\n")
    end_step(validation, 2)
    end_step(validation, 4)
    assert sorted(p.name for p in (tmp_path / "val").iterdir()) == ["step-000004"]  # keep=1: the newest
    assert len((stale / "items.jsonl").read_text().splitlines()) == 4
    assert recorded[4]["val/em"] == recorded[2]["val/em"] == 0.5


def test_validation_settings_are_checked():
    assert TrainConfig().val_every == 0  # off by default
    with pytest.raises(ValueError, match=r"val_every=5 needs held-out questions: set val_benchmarks"):
        TrainConfig.from_settings(val_every=5)
    with pytest.raises(ValueError, match="val_limit must be >= 0"):
        TrainConfig.from_settings(val_limit=-1)
    with pytest.raises(ValueError, match="val_every must be >= 0"):
        TrainConfig.from_settings(val_every=-1)
    TrainConfig.from_settings(val_every=5, eval_benchmarks=["nq"])  # the final evaluation's questions


def test_a_step_s_log_gets_every_figure_of_its_metrics_line():
    logs = {"loss": 0.25, "grad_norm": 1.5, "learning_rate": 1e-6, "kl": 0.0}
    record = {"step": 3, "train/loss": 0.25, "train/kl": None, "train/grad_norm": 1.5, "train/learning_rate": 2e-6,
              "rollout/em": 0.5, "backoff/fallback_groups": 2, "train/update_skipped": False, "time/step": 4.0,
              "val/em": 0.4, "val/nq/em": 0.3, "note": "text"}
    assert tracker_figures(record, logs) == {
        # loss and grad_norm reach the tracker as TRL's `loss`, `grad_norm`; a figure that differs is sent
        "train/learning_rate": 2e-6, "rollout/em": 0.5, "backoff/fallback_groups": 2, "train/update_skipped": 0,
        "time/step": 4.0, "val/em": 0.4, "val/nq/em": 0.3}


def test_the_report_draws_and_summarises_the_validation_curve(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FIXTURE_RUN, run)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for record in lines:  # validated after every step, on 2 benchmarks of 10 questions
        record.update({"val/em": 0.05 * record["step"], "val/f1": 0.1 * record["step"], "val/questions": 20,
                       "val/valid_answer_rate": 0.8, "val/nq/em": 0.1, "val/popqa/em": 0.2})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    titles = [title for title, _ in panels({"run": lines})]
    assert titles[1:3] == ["Validation (held-out questions, greedy)", "Validation EM by benchmark"]
    steps = [r["step"] for r in lines]
    assert len(steps) > 1
    validation = summarize_run(run).validation
    assert [p.step for p in validation.points] == steps and validation.questions == 20
    page = write_report([run], run).read_text()
    assert (f"EM went from {0.05 * steps[0]:.3f} after step {steps[0]} to {0.05 * steps[-1]:.3f} after step "
            f"{steps[-1]}") in page
    assert "<th>validation EM, first -&gt; last (20 questions)</th>" in page
    means = page[page.index("Means over training steps"):page.index("Curves")]
    assert "val/em" not in means  # a mean of validations over the steps is no figure
