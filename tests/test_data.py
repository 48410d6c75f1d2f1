"""Data I/O: round trips, clear errors with file:line:field, counted skips, the embedded suite."""

import json

import pytest

from eviback import data
from eviback.types import Passage, Question


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_questions_round_trip_jsonl_and_gz(tmp_path):
    qs = [Question("a", "who?", ("x", "y"), "nq", "test", {"gold_passage_ids": ["1"]}, "github:o/r@c:p")]
    for name in ("q.jsonl", "q.jsonl.gz"):
        data.write_questions(tmp_path / name, qs)
        back = data.read_questions(tmp_path / name)
        assert back == qs and back[0].metadata == {"gold_passage_ids": ["1"]}
        assert back[0].gold_passage_ids == ("1",)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"id": "1", "question": "q?"', "invalid JSON"),
        ('{"question": "q?", "golden_answers": ["a"]}', "missing field 'id'"),
        ('{"id": "1", "golden_answers": ["a"]}', "missing field 'question'"),
        ('{"id": "1", "question": "q?"}', "missing field 'golden_answers'"),
        ('{"id": "1", "question": "q?", "golden_answers": []}', "field 'golden_answers' is empty"),
        ('{"id": "1", "question": "q?", "golden_answers": ["", " "]}', "field 'golden_answers' is empty"),
        ('{"id": "1", "question": 5, "golden_answers": ["a"]}', "field 'question' must be a string"),
        ('{"id": "1", "question": "q", "golden_answers": [{"x": 1}]}', "must be a list of strings"),
        ('[1, 2]', "expected a JSON object"),
    ],
)
def test_bad_question_line_names_file_line_and_field(tmp_path, line, message):
    path = _write(tmp_path / "bad.jsonl", ['{"id": "0", "question": "ok?", "golden_answers": ["a"]}', "", line])
    with pytest.raises(data.DataError) as err:
        data.read_questions(path)
    assert str(err.value).startswith(f"{path}:3: ")
    assert message in str(err.value)
    assert err.value.line == 3


def test_duplicate_ids_are_an_error(tmp_path):
    path = _write(tmp_path / "d.jsonl", ['{"id": "0", "question": "a", "golden_answers": ["a"]}'] * 2)
    with pytest.raises(data.DataError, match=r"d.jsonl:2: duplicate id '0' \(first on line 1\)"):
        data.read_questions(path)


def test_skip_bad_skips_and_counts(tmp_path):
    path = _write(tmp_path / "m.jsonl", [
        '{"id": "0", "question": "a", "golden_answers": ["a"]}',
        "not json",
        '{"id": "2", "question": "c", "golden_answers": []}',
        '{"id": "3", "question": "d", "golden_answers": ["d"]}',
    ])
    report = data.ReadReport()
    qs = data.read_questions(path, skip_bad=True, report=report)
    assert [q.id for q in qs] == ["0", "3"]
    assert report.read == 2 and len(report.skipped) == 2
    assert ":2:" in report.skipped[0] and ":3:" in report.skipped[1]


def test_golds_that_normalise_to_nothing_are_warned_about_by_file_and_line(tmp_path):
    path = _write(tmp_path / "q.jsonl", [
        '{"id": "1", "question": "blood type?", "golden_answers": ["A+", "AB+"]}',
        '{"id": "2", "question": "fine?", "golden_answers": ["Paris"]}',
        "",
        '{"id": "3", "question": "band?", "golden_answers": ["The The"]}',
    ])
    report = data.ReadReport()
    questions = data.read_questions(path, report=report)
    assert [q.id for q in questions] == ["1", "2", "3"]  # a warning, not an error: every line is read
    assert len(report.warnings) == 2 and not report.skipped
    assert report.warnings[0].startswith(f"{path}:1: question '1': gold answer 'A+'")
    assert "'a+'" in report.warnings[0]  # the form it is scored in
    assert report.warnings[1].startswith(f"{path}:4: question '3': gold answer 'The The'")
    # the Search-R1 parquet layout is checked too, by row
    parquet = tmp_path / "q.parquet"
    data.write_questions(parquet, questions)
    report = data.ReadReport()
    data.read_questions(parquet, report=report)
    assert report.read == 3 and [w.split(": ")[0] for w in report.warnings] == [f"{parquet}:1", f"{parquet}:3"]


def test_corpus_streaming_and_errors(tmp_path):
    path = _write(tmp_path / "c.jsonl", [
        json.dumps({"id": "1", "contents": '"Title"\nbody text'}),
        json.dumps({"id": 2, "title": "T2", "text": "other"}),
    ])
    it = data.iter_corpus(path)
    assert next(it) == Passage("1", '"Title"\nbody text')  # a generator: nothing read ahead
    second = next(it)
    assert second.id == "2" and second.title == "T2" and second.text == "other"
    bad = _write(tmp_path / "bad.jsonl", [json.dumps({"id": "1"})])
    with pytest.raises(data.DataError, match=r"bad.jsonl:1: missing field 'contents'"):
        list(data.iter_corpus(bad))


def test_passage_title_and_text_keep_the_wiki18_convention():
    p = Passage("7", '"Paris"\nParis is the capital.\nSecond line.')
    assert p.title == "Paris" and p.text == "Paris is the capital.\nSecond line."
    assert Passage.from_title_text("7", "Paris", "Paris is the capital.\nSecond line.") == p


def test_search_r1_parquet_round_trip(tmp_path):
    import pyarrow.parquet as pq

    from eviback.protocol import build_prompt

    qs = [Question("n1", "who got the first nobel prize in physics", ("Wilhelm Conrad Röntgen",), "nq", "train"),
          Question("n2", "capital of france?", ("Paris", "paris city"), "nq", "train")]
    path = tmp_path / "train.parquet"
    data.write_questions(path, qs)
    row = pq.read_table(path).to_pylist()[0]
    assert row["prompt"] == [{"role": "user", "content": build_prompt(qs[0].question)}]
    assert row["ability"] == "fact-reasoning"
    assert row["reward_model"] == {"style": "rule", "ground_truth": {"target": ["Wilhelm Conrad Röntgen"]}}
    assert row["extra_info"] == {"split": "train", "index": 0}
    assert [(q.id, q.question, q.golden_answers) for q in data.read_questions(path)] == [
        (q.id, q.question, q.golden_answers) for q in qs
    ]


def test_search_r1_parquet_without_question_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eviback.protocol import build_prompt

    path = tmp_path / "s.parquet"
    pq.write_table(pa.Table.from_pylist([{
        "data_source": "nq", "prompt": [{"role": "user", "content": build_prompt("who is it")}],
        "ability": "fact-reasoning", "reward_model": {"style": "rule", "ground_truth": {"target": ["x"]}},
        "extra_info": {"split": "test", "index": 4},
    }]), path)
    [q] = data.read_questions(path)
    assert (q.id, q.question, q.golden_answers, q.split) == ("nq_4", "who is it?", ("x",), "test")


def test_embedded_suite_has_the_seven_benchmarks_and_needed_passages():
    suite = data.load_suite()
    assert set(suite.eval) == set(data.BENCHMARKS)
    assert len(suite.train) == 4
    corpus_ids = {p.id for p in data.iter_corpus(suite.corpus)}
    train_ids = set()
    for path in suite.train:
        for q in data.read_questions(path):
            train_ids.add(q.id)
            assert set(q.gold_passage_ids) <= corpus_ids, (path, q.id)
    for name, path in suite.eval.items():
        qs = data.read_questions(path)
        assert qs and not train_ids & {q.id for q in qs}, name
        for q in qs:
            assert set(q.gold_passage_ids) <= corpus_ids
    assert (suite.root / "ATTRIBUTION.md").exists()


def test_flashrag_layout_is_recognised(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "qa").mkdir()
    _write(tmp_path / "corpus/wiki_mini.jsonl", [json.dumps({"id": "1", "contents": '"T"\nx'})])
    _write(tmp_path / "qa/bamboogle.jsonl", ['{"id": "0", "question": "a", "golden_answers": ["a"]}'])
    suite = data.load_suite(tmp_path)
    assert suite.eval == {"bamboogle": tmp_path / "qa/bamboogle.jsonl"}
    with pytest.raises(KeyError, match="unknown benchmark"):
        suite.eval_files(["nq"])
    with pytest.raises(FileNotFoundError, match="not a data suite"):
        data.load_suite(tmp_path / "qa")


# ---------------------------------------------------------------- training questions are never evaluation questions


def test_eval_overlap_and_eval_files_are_refused():
    suite = data.load_suite()
    leaked = data.read_questions(suite.eval["nq"])[0]
    with pytest.raises(ValueError, match="also appear in the suite's evaluation files"):
        data.check_no_eval_overlap([leaked], suite)
    renamed = Question("fresh-id", leaked.question, leaked.golden_answers)  # same text, new id: still refused
    with pytest.raises(ValueError, match="evaluation files"):
        data.check_no_eval_overlap([renamed], suite)
    with pytest.raises(ValueError, match="not a training file of the suite.*nq_train"):
        data.training_files(suite, ["nq"])


def test_training_questions_that_share_an_evaluation_text_are_left_out(tmp_path, caplog):
    """A release can hold the same question text about two entities, one in training, one held out: the
    training side is left out with a warning, and training goes on with the rest."""
    suite = data.load_suite()
    held_out = data.read_questions(suite.eval["popqa"])[0]
    train = [Question("twin", held_out.question, ("someone else",)), Question("fresh", "Who wrote Ulysses?", ("Joyce",))]
    data.write_questions(tmp_path / "qa_train.jsonl", train)
    (tmp_path / "suite.json").write_text(json.dumps({
        "corpus": str(suite.corpus), "train": ["qa_train.jsonl"], "eval": {"popqa": str(suite.eval["popqa"])}}))
    with caplog.at_level("WARNING"):
        kept = data.read_training_questions(data.load_suite(tmp_path))
    assert [q.id for q in kept] == ["fresh"]
    assert "1 training question(s) left out" in caplog.text and "twin" in caplog.text
    with pytest.raises(ValueError, match="not a training file"):
        data.training_files(suite, [str(suite.eval["popqa"])])
    assert data.training_files(suite, ["popqa_train"]) == (suite.root / "qa/popqa_train.jsonl.gz",)
