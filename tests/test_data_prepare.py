"""`eviback data prepare`: Search-R1's release files (a training parquet, the merged seven-benchmark test
parquet, the wiki-18 corpus, its e5 flat FAISS index) made into a data suite, run as a user runs it.

The files are small ones written here in exactly Search-R1's schemas: the training parquet has the five
columns of its release (`data_source`, `prompt`, `ability`, the nested `reward_model` struct, `extra_info`),
the test parquet also keeps FlashRAG's `id`, `question` and `golden_answers` (as Search-R1's merge script
leaves them), both in several row groups.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eviback.cli import main
from eviback.data import (
    check_no_eval_overlap,
    iter_corpus,
    load_suite,
    read_questions,
    read_training_questions,
)
from eviback.protocol import build_prompt

# Questions end in "?", as Search-R1's preprocessing leaves them (build_prompt would add one).
NQ_TRAIN = ["who sang hey jude?", "when did the cold war end?", "what is the capital of peru?",
            "who wrote hamlet?", "how many legs does a spider have?", "where is mount kilimanjaro?"]
HOTPOT_TRAIN = ["which band formed first, blur or oasis?", "were scott derrickson and ed wood of the same nationality?",
                "what year was the director of jaws born?", "who is older, tom hanks or meg ryan?"]
TESTS = {  # data_source -> (FlashRAG id, question, golds); the ids repeat across benchmarks, as in the release
    "nq": [("test_0", "who wrote hamlet?", ["William Shakespeare"]), ("test_1", "who painted the mona lisa?", ["Leonardo da Vinci"])],
    "triviaqa": [("test_0", "which planet is known as the red planet?", ["Mars"])],
    "bamboogle": [("test_0", "who was president when the eiffel tower was built?", ["Sadi Carnot"]),
                  ("test_1", "what is the birth year of the author of dracula?", ["1847"])],
}
PASSAGES = [(str(i), f'"Title {i}"\npassage number {i}') for i in range(1, 7)]


def search_r1_row(data_source: str, index: int, question: str, golds: list[str], split: str) -> dict:
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": build_prompt(question)}],
        "ability": "fact-reasoning",
        "reward_model": {"style": "rule", "ground_truth": {"target": golds}},
        "extra_info": {"split": split, "index": index},
    }


def write_train(path: Path, extra: int = 0) -> None:
    rows = [search_r1_row("nq", i, q, [f"answer {i}"], "train") for i, q in enumerate(NQ_TRAIN)]
    rows += [search_r1_row("hotpotqa", i, q, [f"answer {i}"], "train") for i, q in enumerate(HOTPOT_TRAIN)]
    rows += [search_r1_row("nq", len(NQ_TRAIN) + i, f"extra question {i}?", ["x"], "train") for i in range(extra)]
    pq.write_table(pa.Table.from_pylist(rows), str(path), row_group_size=4)


def write_test(path: Path, bad_row: int | None = None) -> None:
    rows = []
    for source, items in TESTS.items():
        for index, (qid, question, golds) in enumerate(items):
            row = {"id": qid, "question": question, "golden_answers": golds,
                   **search_r1_row(source, index, question, golds, "test")}
            if len(rows) + 1 == bad_row:
                row["reward_model"] = {"style": "rule", "ground_truth": {"target": []}}
            rows.append(row)
    pq.write_table(pa.Table.from_pylist(rows), str(path), row_group_size=2)


def write_corpus(path: Path, lines: list[str] | None = None) -> None:
    lines = lines if lines is not None else [json.dumps({"id": i, "contents": c}) for i, c in PASSAGES]
    with (gzip.open(path, "wt", encoding="utf-8") if path.name.endswith(".gz") else open(path, "w")) as f:
        f.write("\n".join(lines) + "\n")


@pytest.fixture
def release(tmp_path) -> dict[str, Path]:
    files = {"train": tmp_path / "nq_hotpotqa_train" / "train.parquet",
             "test": tmp_path / "nq_hotpotqa_train" / "test.parquet",
             "corpus": tmp_path / "wiki-18.jsonl.gz"}
    files["train"].parent.mkdir()
    write_train(files["train"])
    write_test(files["test"])
    write_corpus(files["corpus"])
    return files


def prepare(release: dict[str, Path], out: Path, *extra: str) -> int:
    return main(["data", "prepare", "--train", str(release["train"]), "--test", str(release["test"]),
                 "--corpus", str(release["corpus"]), "--out", str(out), "--no-progress", *extra])


def test_the_release_becomes_a_suite_and_a_rerun_skips_what_is_done(release, tmp_path, capsys):
    out = tmp_path / "suite"
    assert prepare(release, out) == 0
    said = capsys.readouterr().out
    assert "eval: done: 3 benchmark(s), 5 questions (nq 2, triviaqa 1, bamboogle 2)" in said
    assert "left out 1 whose id or text is also an evaluation question (e.g. nq_3)" in said

    suite = load_suite(out)
    assert list(suite.eval) == ["nq", "triviaqa", "bamboogle"]  # the merged file, split by data_source
    assert [p.name for p in suite.train] == ["hotpotqa.jsonl", "nq.jsonl"]
    nq = read_questions(suite.eval["nq"])
    assert [(q.id, q.question, q.golden_answers, q.dataset) for q in nq] == [
        ("nq_test_0", "who wrote hamlet?", ("William Shakespeare",), "nq"),
        ("nq_test_1", "who painted the mona lisa?", ("Leonardo da Vinci",), "nq")]
    assert [q.id for q in read_questions(suite.eval["triviaqa"])] == ["triviaqa_test_0"]

    training = read_training_questions(suite)
    check_no_eval_overlap(training, suite)  # the training question "who wrote hamlet?" was left out
    assert len(training) == len(NQ_TRAIN) + len(HOTPOT_TRAIN) - 1
    by_id = {q.id: q for q in training}
    assert by_id["nq_0"].question == "who sang hey jude?" and by_id["nq_0"].golden_answers == ("answer 0",)
    assert by_id["hotpotqa_0"].dataset == "hotpotqa" and by_id["hotpotqa_0"].split == "train"
    assert "nq_3" not in by_id

    # The corpus is the downloaded file itself, linked, not rewritten.
    assert suite.corpus.name == "corpus.jsonl.gz"
    assert suite.corpus.stat().st_ino == release["corpus"].stat().st_ino
    assert [p.id for p in iter_corpus(suite.corpus)] == [i for i, _ in PASSAGES]
    assert main(["data", "suite", str(out)]) == 0
    assert "bamboogle" in capsys.readouterr().out

    spec = (out / "suite.json").read_text()
    assert prepare(release, out) == 0
    said = capsys.readouterr().out
    for part in ("eval", "train", "corpus"):
        assert f"{part}: skipped, done from the same inputs" in said
    assert (out / "suite.json").read_text() == spec

    write_train(release["train"], extra=2)  # a changed input redoes its part, and only that
    assert prepare(release, out) == 0
    said = capsys.readouterr().out
    assert "eval: skipped" in said and "corpus: skipped" in said and "train: done" in said
    assert len(read_training_questions(load_suite(out))) == len(training) + 2


def test_a_malformed_corpus_line_is_named_and_a_rerun_resumes(release, tmp_path, capsys):
    out = tmp_path / "suite"
    lines = [json.dumps({"id": i, "contents": c}) for i, c in PASSAGES]
    lines[2] = '{"id": "3", "contents": "cut short'
    write_corpus(release["corpus"], lines)
    assert prepare(release, out) == 2
    err = capsys.readouterr().err
    assert f"{release['corpus']}:3: invalid JSON" in err
    assert not (out / "suite.json").exists() and not (out / ".partial").exists()
    assert not list(out.glob("corpus*"))  # nothing half-written
    assert (out / "eval" / "nq.jsonl").exists()  # the parts before it are done

    write_corpus(release["corpus"])
    whole = release["corpus"].read_bytes()
    release["corpus"].write_bytes(whole[:len(whole) // 2])  # a download cut short
    assert prepare(release, out) == 2
    assert "the gzip stream is corrupt or cut short" in capsys.readouterr().err
    assert not list(out.glob("corpus*")) and not (out / "suite.json").exists()

    release["corpus"].write_bytes(whole)
    assert prepare(release, out, "--corpus-link", "symlink") == 0
    said = capsys.readouterr().out
    assert "eval: skipped" in said and "train: skipped" in said and "corpus: done" in said
    suite = load_suite(out)
    assert suite.corpus.is_symlink() and suite.corpus.resolve() == release["corpus"].resolve()
    assert len(suite.eval) == 3 and len(suite.train) == 2


def test_a_bad_question_row_or_line_is_named_and_nothing_is_written(release, tmp_path, capsys):
    write_test(release["test"], bad_row=4)
    assert prepare(release, tmp_path / "a") == 2
    err = capsys.readouterr().err
    assert f"{release['test']}:4: field 'reward_model.ground_truth.target' is empty" in err
    assert not (tmp_path / "a" / "suite.json").exists() and not (tmp_path / "a" / "eval").exists()

    bamboogle = tmp_path / "bamboogle.jsonl"  # FlashRAG JSONL: one benchmark, named by the file
    bamboogle.write_text('{"id": "test_0", "question": "q?", "golden_answers": ["x"]}\n{"id": "test_1", "question": "r?"}\n')
    code = main(["data", "prepare", "--test", str(bamboogle), "--corpus", str(release["corpus"]),
                 "--out", str(tmp_path / "b"), "--no-progress"])
    assert code == 2
    assert f"{bamboogle}:2: missing field 'golden_answers'" in capsys.readouterr().err
    assert not (tmp_path / "b" / "suite.json").exists() and not (tmp_path / "b" / "eval").exists()

    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert prepare(release, other) == 2
    assert "was not written by `eviback data prepare`" in capsys.readouterr().err


def test_the_faiss_index_is_imported_into_the_suite(tmp_path, capsys):
    faiss = pytest.importorskip("faiss")
    import numpy as np

    count, dim = 50, 8
    corpus = tmp_path / "wiki.jsonl"  # the other common layout: rewritten as {"id", "contents"}
    write_corpus(corpus, [json.dumps({"id": f"p{i}", "title": f"T{i}", "text": f"text {i}"}) for i in range(count)])
    vectors = np.random.default_rng(0).standard_normal((count, dim)).astype(np.float32)
    flat = faiss.IndexFlatIP(dim)
    flat.add(vectors)
    faiss.write_index(flat, str(tmp_path / "e5_Flat.index"))
    model = tmp_path / "e5"  # the import reads the encoder's width only
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": dim}))
    bamboogle = tmp_path / "bamboogle.jsonl"
    bamboogle.write_text('{"id": "test_0", "question": "q?", "golden_answers": ["x"]}\n')
    out = tmp_path / "suite"
    argv = ["data", "prepare", "--test", str(bamboogle), "--corpus", str(corpus), "--out", str(out),
            "--faiss-index", str(tmp_path / "e5_Flat.index"), "--model", str(model), "--compression", "flat",
            "--no-progress"]
    assert main(argv) == 0
    said = capsys.readouterr().out
    assert "index: done: 50 passages x 8" in said and f"eviback serve {out / 'index'}" in said
    suite = load_suite(out)
    assert list(suite.eval) == ["bamboogle"] and suite.corpus.name == "corpus.jsonl"
    assert json.loads(suite.corpus.read_text().splitlines()[0]) == {"id": "p0", "contents": '"T0"\ntext 0'}
    manifest = json.loads((out / "index" / "manifest.json").read_text())
    assert manifest["kind"] == "faiss-import" and manifest["passages"] == count

    assert main(argv) == 0
    assert "index: skipped, done from the same inputs" in capsys.readouterr().out
    assert main([*argv, "--rerank", "8"]) == 0  # a search setting: the manifest is updated, nothing re-imported
    assert "index: done" in capsys.readouterr().out
    again = json.loads((out / "index" / "manifest.json").read_text())
    assert again["built_at"] == manifest["built_at"] and again["params"]["rerank"] == 8
