"""Retrieval indexes as users build and load them: `eviback index`, manifests, BM25 and dense search,
the cached suite index. The HTTP service and its client are in test_retrieval_service.py."""

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from eviback import cli
from eviback.data import DataError, DataSuite, file_sha256
from eviback.retrieval import (
    DenseConfig,
    IndexMismatchError,
    Retriever,
    build_index,
    load_retriever,
    read_manifest,
    suite_retriever,
)

# A small hand-written corpus: distinct topics, so the right passage for a query is unambiguous for both
# BM25 (shared words) and a dense encoder (meaning). Reused by test_retrieval_service.py.
PASSAGES = [
    ("p0", "Nobel Prize in Physics", "The first Nobel Prize in Physics was awarded in 1901 to Wilhelm Conrad "
     "Röntgen for his discovery of X-rays."),
    ("p1", "Deadpool 2", "Deadpool 2 is a superhero film released in the United States on May 18, 2018."),
    ("p2", "Hamlet", "Hamlet is a tragedy written by William Shakespeare about the Prince of Denmark."),
    ("p3", "Photosynthesis", "Photosynthesis is the process by which green plants use sunlight to turn carbon "
     "dioxide and water into glucose and oxygen."),
    ("p4", "Mount Everest", "Mount Everest is Earth's highest mountain above sea level, in the Himalayas on the "
     "border of Nepal and China."),
    ("p5", "Python (programming language)", "Python is a programming language created by Guido van Rossum and "
     "first released in 1991."),
    ("p6", "Great Wall of China", "The Great Wall of China is a series of fortifications built across the "
     "historical northern borders of ancient Chinese states."),
    ("p7", "Amazon River", "The Amazon River in South America is the largest river by discharge volume of water "
     "in the world."),
    ("p8", "Mona Lisa", "The Mona Lisa is a half-length portrait painting by the Italian artist Leonardo da "
     "Vinci, kept at the Louvre in Paris."),
    ("p9", "Insulin", "Insulin is a peptide hormone produced by beta cells of the pancreas; it regulates blood "
     "sugar.\nIt was discovered in 1921 by Frederick Banting and Charles Best."),
    ("p10", "Tour de France", "The Tour de France is an annual men's multiple-stage bicycle race held mainly in "
     "France."),
    ("p11", "Saturn", "Saturn is the sixth planet from the Sun and is famous for its prominent ring system."),
]

# query -> the passage that answers it (by words for BM25, by meaning for the dense encoder)
BM25_QUERIES = {"who won the first nobel prize in physics": "p0", "who wrote hamlet": "p2",
                "highest mountain himalayas": "p4", "planet with rings": "p11"}
DENSE_QUERIES = {"which painter made the famous portrait in the Louvre": "p8",
                 "hormone that controls blood glucose": "p9", "cycling competition": "p10"}


def write_corpus(path: Path, passages=PASSAGES) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for pid, title, text in passages:
            f.write(json.dumps({"id": pid, "contents": f'"{title}"\n{text}'}, ensure_ascii=False) + "\n")
    return path


def corpus_lines(path: Path) -> dict[str, str]:
    return {obj["id"]: obj["contents"] for obj in map(json.loads, path.read_text(encoding="utf-8").splitlines())}


@pytest.fixture(scope="module")
def bm25_index(tmp_path_factory):
    root = tmp_path_factory.mktemp("bm25")
    corpus = write_corpus(root / "corpus.jsonl")
    assert cli.main(["index", str(corpus), "--out", str(root / "index"), "--no-progress"]) == 0
    return corpus, root / "index"


def test_index_command_writes_a_manifest(bm25_index):
    corpus, index = bm25_index
    manifest = read_manifest(index)
    assert manifest.kind == "bm25"
    assert manifest.corpus_path == str(corpus.resolve())
    assert manifest.corpus_sha256 == file_sha256(corpus)
    assert manifest.passages == len(PASSAGES)
    assert manifest.params == {"k1": 0.9, "b": 0.4, "method": "lucene", "stopwords": "en"}
    assert manifest.eviback_version and manifest.built_at and manifest.build_seconds > 0
    raw = json.loads((index / "manifest.json").read_text())
    assert {"kind", "model", "params", "corpus_path", "corpus_sha256", "passages", "built_at",
            "eviback_version"} <= set(raw)


def test_bm25_search_is_batched_ranked_and_keeps_contents(bm25_index):
    corpus, index = bm25_index
    contents = corpus_lines(corpus)
    retriever = load_retriever(index)
    assert isinstance(retriever, Retriever)
    queries = list(BM25_QUERIES)
    results = retriever.search(queries[:2] + ["", "   "] + queries[2:], topk=3)
    assert len(results) == len(queries) + 2
    assert results[2] == [] and results[3] == []  # empty queries
    for query, passages in zip(queries, results[:2] + results[4:], strict=True):
        assert 1 <= len(passages) <= 3
        assert passages[0].id == BM25_QUERIES[query]
        scores = [p.score for p in passages]
        assert all(isinstance(s, float) and s > 0 for s in scores)
        assert scores == sorted(scores, reverse=True)
        for p in passages:
            assert p.contents == contents[p.id]  # byte for byte, title quotes and newlines included
    assert results[0][0].title == "Nobel Prize in Physics" and "Röntgen" in results[0][0].text
    # a query sharing no word with the corpus finds nothing (Lucene semantics), topk is honoured
    assert retriever.search(["zzzz qqqq"], topk=3) == [[]]
    assert len(retriever.search(["the first in is of"], topk=1)[0]) <= 1
    assert len(retriever.search(["the prize film river planet mountain"], topk=50)[0]) <= len(PASSAGES)
    with pytest.raises(ValueError, match="topk"):
        retriever.search(["hamlet"], topk=0)
    retriever.close()


def test_bm25_search_is_thread_safe(bm25_index):
    _, index = bm25_index
    retriever = load_retriever(index)
    queries = list(BM25_QUERIES) * 5
    expected = retriever.search(queries, topk=3)
    outputs, errors = [None] * 8, []

    def work(slot):
        try:
            outputs[slot] = [retriever.search([q], topk=3)[0] for q in queries]
        except Exception as e:  # collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(out == expected for out in outputs)


def test_rerunning_index_on_the_same_corpus_does_nothing(bm25_index, capsys):
    corpus, index = bm25_index
    before = read_manifest(index)
    assert cli.main(["index", str(corpus), "--out", str(index), "--no-progress"]) == 0
    assert read_manifest(index) == before


def test_changed_corpus_is_refused_with_both_hashes_and_the_fix(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    index = tmp_path / "index"
    build_index(corpus, index, progress=False)
    old = file_sha256(corpus)
    write_corpus(corpus, PASSAGES[:-1])  # the corpus is edited after the build
    new = file_sha256(corpus)
    with pytest.raises(IndexMismatchError) as refused:
        load_retriever(index)
    message = str(refused.value)
    assert old in message and new in message and "--force" in message and str(index) in message

    # `eviback index` over the stale index refuses too, naming both hashes, without a traceback...
    result = subprocess.run([sys.executable, "-m", "eviback.cli", "index", str(corpus), "--out", str(index)],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert old in result.stderr and new in result.stderr and "--force" in result.stderr
    assert "Traceback" not in result.stderr
    # ...and --force rebuilds it, after which it loads and serves the new corpus.
    assert cli.main(["index", str(corpus), "--out", str(index), "--force", "--no-progress"]) == 0
    assert read_manifest(index).corpus_sha256 == new and read_manifest(index).passages == len(PASSAGES) - 1
    assert load_retriever(index).search(["saturn rings"], topk=3) == [[]]  # p11 was removed


def test_other_parameters_are_refused_without_force(bm25_index, tmp_path):
    corpus, _ = bm25_index
    index = tmp_path / "index"
    build_index(corpus, index, progress=False)
    result = subprocess.run([sys.executable, "-m", "eviback.cli", "index", str(corpus), "--out", str(index),
                             "--k1", "1.5"], capture_output=True, text=True)
    assert result.returncode == 2 and "k1: 0.9 -> 1.5" in result.stderr


def test_bad_corpora_and_missing_indexes_say_what_to_do(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "contents": "\\"A\\"\\ntext"}\n{"id": "b"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: missing field 'contents'"):
        build_index(bad, tmp_path / "i1", progress=False)
    duplicate = tmp_path / "dup.jsonl"
    duplicate.write_text('{"id": "a", "contents": "x"}\n{"id": "a", "contents": "y"}\n')
    with pytest.raises(DataError, match="duplicate passage id 'a'"):
        build_index(duplicate, tmp_path / "i2", progress=False)
    with pytest.raises(FileNotFoundError, match="eviback index CORPUS --out"):
        load_retriever(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="not found"):
        build_index(tmp_path / "missing.jsonl", tmp_path / "i3", progress=False)
    # an existing directory that is not an index is never replaced, even with --force
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not an index directory"):
        build_index(write_corpus(tmp_path / "ok.jsonl"), tmp_path / "notes", force=True, progress=False)
    assert (tmp_path / "notes" / "keep.txt").read_text() == "mine"


def test_suite_retriever_builds_once_into_the_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("EVIBACK_CACHE", str(cache))
    root = tmp_path / "suite"
    root.mkdir()
    write_corpus(root / "corpus.jsonl")
    (root / "suite.json").write_text(json.dumps({"corpus": "corpus.jsonl", "train": [], "eval": {}}))
    # Two processes ask for the same suite index at once: one builds, the other waits and reuses it.
    script = ("import sys; from eviback.data import load_suite; from eviback.retrieval import suite_retriever; "
              "r = suite_retriever(load_suite(sys.argv[1])); print(r.search(['who wrote hamlet'])[0][0].id)")
    env = {**__import__("os").environ, "EVIBACK_CACHE": str(cache)}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(root)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert [out.strip() for out, _ in outputs] == ["p2", "p2"]
    indexes = list((cache / "indexes").iterdir())
    assert [d.name for d in indexes] == [f"bm25-{file_sha256(root / 'corpus.jsonl')[:16]}"]
    built_at = read_manifest(indexes[0]).built_at
    retriever = suite_retriever(DataSuite(root=root, corpus=root / "corpus.jsonl", train=(), eval={}))
    assert retriever.search(["nobel prize physics"])[0][0].id == "p0"
    assert read_manifest(indexes[0]).built_at == built_at  # reused, not rebuilt


def test_open_retriever_opens_the_named_index_else_the_suites_bm25(bm25_index, tmp_path, monkeypatch):
    """The `retriever` setting of every command: an index directory (or /retrieve URL) when given, else BM25
    over the suite's corpus, built into the cache."""
    from eviback.retrieval import open_retriever
    from eviback.retrieval.client import RetrievalClient

    monkeypatch.setenv("EVIBACK_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "suite"
    root.mkdir()
    write_corpus(root / "corpus.jsonl", PASSAGES[:2])
    suite = DataSuite(root=root, corpus=root / "corpus.jsonl", train=(), eval={})
    _, index = bm25_index
    named = open_retriever(str(index), suite)
    assert len(named) == len(PASSAGES) and not (tmp_path / "cache").exists()  # the suite is not indexed
    for spec in (None, ""):
        assert len(open_retriever(spec, suite)) == 2
    client = open_retriever("http://127.0.0.1:9", suite)
    assert isinstance(client, RetrievalClient)
    client.close()
    from eviback.retrieval import ClientConfig

    client = open_retriever("http://127.0.0.1:9", suite, client=ClientConfig(deadline_s=7))  # a run's deadline
    assert client.config.deadline_s == 7
    client.close()


def test_suite_retriever_defaults_to_the_embedded_suite(tmp_path, monkeypatch):
    from eviback.data import load_suite, read_questions

    monkeypatch.setenv("EVIBACK_CACHE", str(tmp_path))
    suite = load_suite()
    retriever = suite_retriever()
    question = read_questions(suite.eval["nq"])[0]
    passages = retriever.search([question.question], topk=3)[0]
    assert len(passages) == 3 and all(p.id and p.contents and p.score for p in passages)
    assert read_manifest(next((tmp_path / "indexes").iterdir())).corpus_sha256 == file_sha256(suite.corpus)


# --------------------------------------------------------------------------------------------------
# Dense: the bundled all-MiniLM-L6-v2 on the small corpus (a few seconds per model load).


@pytest.fixture(scope="module")
def dense_index(tmp_path_factory):
    root = tmp_path_factory.mktemp("dense")
    corpus = write_corpus(root / "corpus.jsonl")
    assert cli.main(["index", str(corpus), "--out", str(root / "index"), "--kind", "dense",
                     "--chunk-size", "5", "--no-progress"]) == 0
    return corpus, root / "index"


def test_dense_index_finds_passages_by_meaning(dense_index):
    corpus, index = dense_index
    manifest = read_manifest(index)
    assert manifest.kind == "dense" and manifest.model == "all-MiniLM-L6-v2"
    assert manifest.params["normalize"] is True and manifest.passages == len(PASSAGES)
    assert not (index / "embeddings").exists()  # chunks are dropped once the FAISS index holds the vectors
    retriever = load_retriever(index)
    queries = list(DENSE_QUERIES)
    results = retriever.search(queries + [""], topk=3)
    assert [r[0].id for r in results[:-1]] == list(DENSE_QUERIES.values())
    assert results[-1] == []
    for passages in results[:-1]:
        scores = [p.score for p in passages]
        assert len(passages) == 3 and scores == sorted(scores, reverse=True)
        assert all(-1.0 <= s <= 1.0 + 1e-5 for s in scores)  # cosine similarity of normalised vectors
    assert results[0][0].contents == corpus_lines(corpus)["p8"]
    retriever.close()


def test_interrupted_dense_build_resumes_without_redoing_chunks(dense_index, tmp_path, monkeypatch):
    import faiss

    from eviback.retrieval import dense

    corpus, finished = dense_index
    real_encode = dense._encode
    calls = []

    def encode_then_crash(model, texts, config):
        if len(calls) == 1:  # the process dies while embedding the second chunk
            raise KeyboardInterrupt
        calls.append(len(texts))
        return real_encode(model, texts, config)

    out = tmp_path / "index"
    config = DenseConfig(chunk_size=5, batch_size=2)  # 12 passages: chunks of 5, 5, 2; calls of 5 (2 x 8 > 5)
    monkeypatch.setattr(dense, "_encode", encode_then_crash)
    with pytest.raises(KeyboardInterrupt):
        build_index(corpus, out, "dense", dense=config, progress=False)
    assert sorted(p.name for p in (out.parent / "index.partial" / "embeddings").iterdir()) == ["chunk-000000000.npy"]
    with pytest.raises(FileNotFoundError, match="interrupted"):
        load_retriever(out)
    # Other parameters must not silently reuse these vectors.
    with pytest.raises(IndexMismatchError, match="--force"):
        build_index(corpus, out, "dense", dense=DenseConfig(chunk_size=5, passage_prefix="passage: "),
                    progress=False)

    calls.clear()
    monkeypatch.setattr(dense, "_encode", lambda *a: calls.append(len(a[1])) or real_encode(*a))
    build_index(corpus, out, "dense", dense=config, progress=False)
    assert calls == [5, 2]  # only the two missing chunks were embedded
    resumed = faiss.read_index(str(out / "dense.faiss"))
    fresh = faiss.read_index(str(finished / "dense.faiss"))
    np.testing.assert_allclose(resumed.reconstruct_n(0, resumed.ntotal), fresh.reconstruct_n(0, fresh.ntotal),
                               atol=1e-5)
    assert not (out.parent / "index.partial").exists()
