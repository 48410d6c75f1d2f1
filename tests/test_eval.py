"""`eviback eval`'s bookkeeping on a scripted policy: resume after an interruption, summaries that equal
what the per-item file says, macro averages, settings checks, and the viewer page."""

from __future__ import annotations

import json

import pytest

from eviback import cli
from eviback.evaluate import (
    EvalConfig,
    read_items,
    read_summary,
    run_eval,
    summarize,
)
from eviback.metrics import rollout_metrics
from eviback.policy import load_tokenizer
from eviback.rollout import RolloutConfig
from eviback.types import Trajectory, from_dict
from rollout_fakes import ScriptedBackend, ScriptedRetriever, wiki

NQ = [("n1", "who wrote hamlet", ["William Shakespeare"], ["<answer> William Shakespeare </answer>"]),
      ("n2", "capital of peru", ["Lima"], ["<search> peru capital </search>", "<answer> Cusco </answer>"]),
      ("n3", "largest ocean", ["Pacific Ocean", "Pacific"], ["<answer> the Pacific </answer>"]),
      ("n4", "who painted guernica", ["Pablo Picasso"], ["I think it is someone."])]
HOTPOT = [("h1", "which river flows through the capital of egypt", ["Nile"],
           ["<search> capital of egypt </search>", "<search> capital of egypt </search>", "<answer> Nile </answer>"]),
          ("h2", "who directed the film that won best picture in 1998", ["James Cameron"],
           ["<search> best picture 1998 </search>", "<answer> Cameron </answer>"])]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m")


@pytest.fixture
def suite(tmp_path):
    def write(name, rows):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"id": i, "question": q, "golden_answers": g}) + "\n" for i, q, g, _ in rows))
        return str(path)

    files = (write("nq", NQ), write("hotpotqa", HOTPOT))
    script = {q: turns for _, q, _, turns in NQ + HOTPOT}
    return files, script


class Interrupted(Exception):
    pass


class FailingAfter(ScriptedBackend):
    """Raises on the n-th generate call, as a killed run would stop."""

    fail_at: int = 10**9

    def generate(self, prompts, params, max_tokens=None):
        if len(self.calls) + 1 == self.fail_at:
            raise Interrupted
        return super().generate(prompts, params, max_tokens)


def config(tmp_path, files, **rollout):
    return EvalConfig(out=str(tmp_path / "out"), qa_files=files, batch_size=2, progress=False,
                      rollout=RolloutConfig(**{"max_turns": 2, **rollout}))


def test_summary_equals_metrics_recomputed_from_items(tmp_path, suite, tokenizer):
    files, script = suite
    summary = run_eval(config(tmp_path, files), backend=ScriptedBackend(tokenizer, script),
                       retriever=ScriptedRetriever(wiki))
    out = tmp_path / "out"
    raw = [json.loads(line) for line in (out / "items.jsonl").read_text().splitlines()]
    assert sorted((r["benchmark"], r["id"]) for r in raw) == sorted(
        [("nq", i) for i, *_ in NQ] + [("hotpotqa", i) for i, *_ in HOTPOT])
    saved = read_summary(out / "summary.json")
    assert saved == summary
    for row in saved.benchmarks:
        mine = [r for r in raw if r["benchmark"] == row.name]
        # from the flat per-item fields ...
        assert row.metrics.n == len(mine)
        assert row.metrics.em == pytest.approx(sum(r["em"] for r in mine) / len(mine))
        assert row.metrics.f1 == pytest.approx(sum(r["f1"] for r in mine) / len(mine))
        assert row.metrics.valid_answer_rate == pytest.approx(sum(r["valid_answer"] for r in mine) / len(mine))
        assert row.metrics.forced_termination_rate == pytest.approx(sum(r["forced"] for r in mine) / len(mine))
        searches = sum(r["searches"] for r in mine)
        assert row.metrics.avg_searches == pytest.approx(searches / len(mine))
        assert row.metrics.duplicate_query_rate == pytest.approx(
            sum(r["duplicate_searches"] for r in mine) / searches if searches else 0.0)
        # ... and from the whole trajectories, through the metrics module
        assert row.metrics == rollout_metrics(from_dict(Trajectory, r["trajectory"]) for r in mine)
    nq = next(r.metrics for r in saved.benchmarks if r.name == "nq")
    hotpot = next(r.metrics for r in saved.benchmarks if r.name == "hotpotqa")
    assert nq.em == 0.5 and nq.valid_answer_rate == 0.75 and nq.forced_termination_rate == 0.25
    assert hotpot.em == 0.5 and hotpot.avg_searches == 1.5 and hotpot.duplicate_query_rate == pytest.approx(1 / 3)
    assert saved.single_hop == nq and saved.multi_hop == hotpot
    assert saved.overall.em == pytest.approx((nq.em + hotpot.em) / 2) and saved.overall.n == 6
    table = (out / "summary.md").read_text()
    assert "| nq | 4 | 0.500 |" in table and "**overall (macro)**" in table
    assert all("tokens" not in r["trajectory"] or r["trajectory"]["tokens"] is None for r in raw)
    # where the time went: the questions of this invocation, the tokens generated (the model's own turns)
    throughput = json.loads((out / "throughput.json").read_text())
    assert throughput["questions"] == 6 and throughput["batches"] == 3  # 6 questions in batches of 2
    turns = [t for r in raw for t in r["trajectory"]["turns"]]
    text_tokens = sum(len(tokenizer.encode(t["text"], add_special_tokens=False)) for t in turns)
    assert text_tokens <= throughput["generated_tokens"] <= text_tokens + len(turns)  # an EOS id a turn at most
    assert throughput["generate_s"] >= 0 and throughput["backend"] == "vllm" and throughput["batch_size"] == 2


def test_interrupted_eval_resumes_without_redoing_items(tmp_path, suite, tokenizer):
    files, script = suite
    failing = FailingAfter(tokenizer, script)
    failing.fail_at = 3  # batch 1 (n1, n2): 2 calls; batch 2 dies in its first call
    with pytest.raises(Interrupted):
        run_eval(config(tmp_path, files), backend=failing, retriever=ScriptedRetriever(wiki))
    items_path = tmp_path / "out" / "items.jsonl"
    assert [i.trajectory.question.id for i in read_items(items_path)] == ["n1", "n2"]
    with open(items_path, "a") as f:
        f.write('{"schema": 1, "benchmark": "nq", "id": "n3", "traj')  # a write cut by the kill

    backend = ScriptedBackend(tokenizer, script)
    summary = run_eval(config(tmp_path, files), backend=backend, retriever=ScriptedRetriever(wiki))
    asked = {q for call in backend.calls for ctx in call for q in script if q in tokenizer.decode(ctx)}
    assert asked == {"largest ocean", "who painted guernica", HOTPOT[0][1], HOTPOT[1][1]}  # n1, n2 not redone
    ids = [(i.benchmark, i.trajectory.question.id) for i in read_items(items_path)]
    assert len(ids) == len(set(ids)) == 6
    fresh = run_eval(config(tmp_path / "again", files), backend=ScriptedBackend(tokenizer, script),
                     retriever=ScriptedRetriever(wiki))
    assert summary == fresh  # resuming gives the same numbers as an uninterrupted run


def test_resume_refuses_other_settings(tmp_path, suite, tokenizer):
    files, script = suite
    run_eval(config(tmp_path, files), backend=ScriptedBackend(tokenizer, script), retriever=ScriptedRetriever(wiki))
    with pytest.raises(ValueError, match="--overwrite"):
        run_eval(config(tmp_path, files, topk=5), backend=ScriptedBackend(tokenizer, script),
                 retriever=ScriptedRetriever(wiki))
    backend = ScriptedBackend(tokenizer, script)
    run_eval(config(tmp_path, files, topk=5), overwrite=True, backend=backend, retriever=ScriptedRetriever(wiki))
    assert backend.calls  # everything was run again


def test_the_rollout_settings_are_the_rollout_engine_s_with_evaluation_s_turns(tmp_path, suite, tokenizer):
    """EvalConfig holds a RolloutConfig: RolloutConfig's defaults but for max_turns (EVAL_MAX_TURNS), always
    greedy; the resume identity names the same five settings as before it held one."""
    from eviback.evaluate import EVAL_MAX_TURNS

    default = EvalConfig().rollout
    assert default == RolloutConfig(max_turns=EVAL_MAX_TURNS, temperature=0.0, group_size=1, logprobs=False)
    sampled = EvalConfig(rollout=RolloutConfig(temperature=1.0, group_size=5)).rollout
    assert (sampled.temperature, sampled.group_size, sampled.logprobs) == (0.0, 1, False)
    identity = EvalConfig().identity()
    assert {k: identity[k] for k in ("topk", "max_turns", "max_turn_tokens", "max_observation_tokens",
                                     "max_context_tokens")} == {"topk": 3, "max_turns": EVAL_MAX_TURNS,
                                                                "max_turn_tokens": 500, "max_observation_tokens": 500,
                                                                "max_context_tokens": 4096}
    assert "rollout" not in identity
    files, script = suite
    run_eval(config(tmp_path, files), backend=ScriptedBackend(tokenizer, script), retriever=ScriptedRetriever(wiki))
    with pytest.raises(ValueError, match="max_turns: 2 -> 3"):
        run_eval(config(tmp_path, files, max_turns=3), backend=ScriptedBackend(tokenizer, script),
                 retriever=ScriptedRetriever(wiki))


def test_limit_and_suite_benchmarks(tmp_path, tokenizer):
    from eviback.evaluate import load_tasks

    tasks = load_tasks(EvalConfig(limit=3))  # the embedded suite
    names = list(dict.fromkeys(t.benchmark for t in tasks))
    assert names == ["nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle"]
    assert len(tasks) == 21
    with pytest.raises(KeyError, match="unknown benchmark"):
        load_tasks(EvalConfig(benchmarks=("nope",)))


def test_summarize_macro_groups():
    assert summarize([]).overall.n == 0
    from eviback.evaluate import hop_kind

    assert [hop_kind(n) for n in ("nq", "popqa_dev", "hotpotqa_ctx", "bamboogle", "custom")] == \
        ["single", "single", "multi", "multi", None]


def test_viewer_page_and_report_command(tmp_path, suite, tokenizer):
    files, script = suite[0], dict(suite[1])
    script["who painted guernica"] = ["</script><b>x</b> <answer> Picasso </answer>"]
    run_eval(config(tmp_path, files), backend=ScriptedBackend(tokenizer, script), retriever=ScriptedRetriever(wiki))
    out = tmp_path / "out"
    page = (out / "viewer.html").read_text()
    data = page.split('<script id="data" type="application/json">')[1].split("</script>")[0]
    records = json.loads(data)  # the model's "</script>" did not end the data block
    assert len(records) == 6 and any("<\\/script>" in r["turns"][0]["text"] or "</script>" in r["turns"][0]["text"]
                                     for r in records)
    (out / "viewer.html").unlink()
    assert cli.main(["report", str(out)]) == 0
    assert (out / "viewer.html").exists()


def test_report_reads_an_archived_items_file(tmp_path, suite, tokenizer):
    import gzip

    files, script = suite
    run_eval(config(tmp_path, files), backend=ScriptedBackend(tokenizer, script), retriever=ScriptedRetriever(wiki))
    archived = tmp_path / "items.jsonl.gz"
    archived.write_bytes(gzip.compress((tmp_path / "out" / "items.jsonl").read_bytes()))
    assert [i.key for i in read_items(archived)] == [i.key for i in read_items(tmp_path / "out" / "items.jsonl")]
    assert cli.main(["report", str(archived), "-o", str(tmp_path / "page.html")]) == 0
    assert "who wrote hamlet" in (tmp_path / "page.html").read_text()


def test_a_record_written_under_the_old_definitions_reads_as_the_current_ones():
    """An items.jsonl record of a rollout cut by the context budget, written when `forced` also counted such
    a stop: its stats are recomputed from its trajectory."""
    from eviback.evaluate import EvalItem
    from eviback.types import Question, StopReason, to_dict
    t = Trajectory(Question("q1", "who?", ("x",)), (), None, StopReason.LENGTH)
    record = EvalItem.of("nq", t).to_json()
    assert record["forced"] is False and record["valid_answer"] is False
    record["forced"] = True  # the old definition
    assert EvalItem.from_json(record).stats.forced is False
    assert to_dict(EvalItem.from_json(record).trajectory) == to_dict(t)
