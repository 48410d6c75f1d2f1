"""`eviback index import-faiss`: a real FAISS IndexFlatIP file (faiss.write_index) and a JSONL.gz corpus in
Search-R1's formats, imported and served.

The release is 3,000 clustered random unit vectors of 384 dimensions (all-MiniLM-L6-v2's width, so the
bundled model stands in for e5 as a real local encoder), whose first rows are real passages embedded the
e5 way ("passage: " prefix, mean pooling, normalised) so that real queries find them.
"""

from __future__ import annotations

import gzip
import json
import shutil
import struct
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np
import pytest

faiss = pytest.importorskip("faiss")

from eviback.data import iter_corpus, load_suite  # noqa: E402
from eviback.retrieval import IndexMismatchError, load_index, read_manifest  # noqa: E402
from eviback.retrieval.config import DEFAULT_DENSE_MODEL, FaissImportConfig  # noqa: E402
from eviback.retrieval.dense import resolve_model  # noqa: E402
from eviback.retrieval.flatfile import FlatFileError, read_flat_header  # noqa: E402
from eviback.retrieval.imported import ImportedIndex, auto_nlist, import_faiss  # noqa: E402

DIM, COUNT, REAL = 384, 3000, 40
FAST = {"pq_m": 12, "nprobe": 8, "rerank": 64}  # PQ training is the slow part of a small import


@dataclass
class Release:
    flat: Path
    corpus: Path
    vectors: np.ndarray
    contents: list[str]
    ids: list[str]


class LookupEncoder:
    """A scripted query encoder: text "row:N" is row N's vector plus a little noise (tests only)."""

    dim = DIM

    def __init__(self, vectors: np.ndarray) -> None:
        self.vectors = vectors

    def encode(self, texts):
        rng = np.random.default_rng(len(texts))
        x = self.vectors[[int(t.split(":")[1]) for t in texts]] + 0.02 * rng.standard_normal((len(texts), DIM))
        return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def write_flat(path: Path, vectors: np.ndarray) -> None:
    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(vectors)
    faiss.write_index(index, str(path))


def write_corpus(path: Path, ids: list[str], contents: list[str]) -> None:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for passage_id, text in zip(ids, contents, strict=True):
            f.write(json.dumps({"id": passage_id, "contents": text}) + "\n")


def exact_top(vectors: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    return np.argsort(-(queries @ vectors.T), axis=1, kind="stable")[:, :k]


@pytest.fixture(scope="module")
def minilm() -> str:
    return resolve_model(DEFAULT_DENSE_MODEL)


@pytest.fixture(scope="module")
def release(tmp_path_factory, minilm) -> Release:
    from eviback.retrieval.encoder import E5QueryEncoder

    root = tmp_path_factory.mktemp("release")
    real = list(islice(iter_corpus(load_suite().corpus), REAL))
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((30, DIM)).astype(np.float32)
    vectors = centres[rng.integers(0, 30, COUNT)] + rng.standard_normal((COUNT, DIM)).astype(np.float32)
    vectors[:REAL] = E5QueryEncoder(minilm, prefix="passage: ").encode([p.contents for p in real])
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    contents = [p.contents for p in real] + [f'"Synthetic {i}"\nfiller passage {i}' for i in range(REAL, COUNT)]
    ids = [p.id for p in real] + [f"s{i}" for i in range(REAL, COUNT)]
    write_flat(root / "e5_Flat.index", vectors)
    write_corpus(root / "wiki-18.jsonl.gz", ids, contents)
    return Release(root / "e5_Flat.index", root / "wiki-18.jsonl.gz", vectors, contents, ids)


@pytest.fixture(scope="module")
def imported(release, minilm, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("imported") / "wiki18"
    import_faiss(release.flat, release.corpus, out, FaissImportConfig(model=minilm, **FAST), progress=False)
    return out


def queries_near(release: Release, count: int, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    q = release.vectors[rng.choice(COUNT, count, replace=False)] + 0.1 * rng.standard_normal((count, DIM))
    return (q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float32)


def test_the_header_is_read_as_faiss_writes_it(tmp_path):
    vectors = np.random.default_rng(0).standard_normal((37, 12)).astype(np.float32)
    write_flat(tmp_path / "flat.index", vectors)
    flat = read_flat_header(tmp_path / "flat.index")
    assert (flat.dim, flat.count, flat.offset) == (12, 37, 45)
    assert np.array_equal(flat.vectors(), vectors)
    assert np.array_equal(np.concatenate([c.copy() for _, c in flat.iter_chunks(10)]), vectors)

    l2 = faiss.IndexFlatL2(12)
    l2.add(vectors)
    faiss.write_index(l2, str(tmp_path / "l2.index"))
    with pytest.raises(FlatFileError, match="IndexFlatL2"):
        read_flat_header(tmp_path / "l2.index")
    ivf = faiss.index_factory(12, "IVF2,Flat", faiss.METRIC_INNER_PRODUCT)
    ivf.train(vectors)
    faiss.write_index(ivf, str(tmp_path / "ivf.index"))
    with pytest.raises(FlatFileError, match="not a FAISS flat index"):
        read_flat_header(tmp_path / "ivf.index")
    (tmp_path / "cut.index").write_bytes((tmp_path / "flat.index").read_bytes()[:-4])
    with pytest.raises(FlatFileError, match="truncated"):
        read_flat_header(tmp_path / "cut.index")
    assert struct.unpack("<i", (tmp_path / "flat.index").read_bytes()[4:8]) == (12,)


def test_ivfpq_import_finds_the_exact_top3_with_exact_scores(release, imported):
    manifest = read_manifest(imported)
    assert manifest.kind == "faiss-import" and manifest.passages == COUNT
    assert manifest.params["nlist"] == auto_nlist(COUNT) == 64 and manifest.params["dim"] == DIM
    index = ImportedIndex(imported, manifest.params, encoder=LookupEncoder(release.vectors))
    try:
        q = queries_near(release, 300)
        scores, rows = index.search_vectors(q, 3)
        exact = exact_top(release.vectors, q, 3)
        recall = np.mean([len(set(a) & set(b)) / 3 for a, b in zip(rows.tolist(), exact.tolist(), strict=True)])
        assert recall >= 0.95
        # Re-ranked scores are the flat index's inner products, best first.
        assert np.allclose(scores, np.einsum("qkd,qd->qk", release.vectors[rows], q), atol=1e-5)
        assert np.all(np.diff(scores, axis=1) <= 0)
        passages = index.search(["row:7", "", "row:2999"], topk=2)
        assert passages[0][0].id == release.ids[7] and passages[0][0].contents == release.contents[7]
        assert passages[1] == [] and passages[2][0].id == release.ids[2999]
    finally:
        index.close()


def test_sq8_and_flat_modes(release, minilm, tmp_path):
    q = queries_near(release, 100, seed=2)
    exact = exact_top(release.vectors, q, 3)
    for compression in ("sq8", "flat"):
        out = tmp_path / compression
        import_faiss(release.flat, release.corpus, out, FaissImportConfig(model=minilm, compression=compression,
                                                                          nprobe=8, rerank=16), progress=False)
        index = ImportedIndex(out, read_manifest(out).params, encoder=LookupEncoder(release.vectors))
        _, rows = index.search_vectors(q, 3)
        index.close()
        if compression == "flat":  # Search-R1's exact mode: the flat file loaded whole
            assert not (out / "ivf.faiss").exists()
            assert np.array_equal(rows, exact)
        else:
            assert np.mean([len(set(a) & set(b)) / 3 for a, b in zip(rows.tolist(), exact.tolist(), strict=True)]) >= 0.95


def test_a_corpus_of_another_size_is_refused_naming_both_files(release, minilm, tmp_path):
    short = tmp_path / "short.jsonl.gz"
    write_corpus(short, release.ids[:-1], release.contents[:-1])
    with pytest.raises(IndexMismatchError) as error:
        import_faiss(release.flat, short, tmp_path / "out", FaissImportConfig(model=minilm, **FAST), progress=False)
    message = str(error.value)
    assert str(short) in message and str(release.flat) in message
    assert f"{COUNT - 1} passages" in message and f"{COUNT} vectors" in message
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_an_encoder_of_another_width_is_refused_naming_both(release, tmp_path):
    model = tmp_path / "e5-base"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 768}))
    with pytest.raises(IndexMismatchError, match=r"768-dimensional vectors but the FAISS index .*e5_Flat.index holds "
                                                 r"384-dimensional"):
        import_faiss(release.flat, release.corpus, tmp_path / "out", FaissImportConfig(model=str(model)))
    with pytest.raises(ValueError, match="--pq-m 100 does not divide the dimension 384"):
        import_faiss(release.flat, release.corpus, tmp_path / "out",
                     FaissImportConfig(model=resolve_model(DEFAULT_DENSE_MODEL), pq_m=100))
    with pytest.raises(ValueError, match="--model PATH"):
        import_faiss(release.flat, release.corpus, tmp_path / "out")


def test_reimport_is_a_no_op_and_a_replaced_flat_file_is_refused(release, minilm, tmp_path):
    flat = tmp_path / "e5_Flat.index"
    shutil.copy(release.flat, flat)
    out = tmp_path / "out"
    config = FaissImportConfig(model=minilm, **FAST)
    first = import_faiss(flat, release.corpus, out, config, progress=False)
    again = import_faiss(flat, release.corpus, out, FaissImportConfig(model=minilm, **{**FAST, "nprobe": 4}),
                         progress=False)
    assert again.built_at == first.built_at and again.params["nprobe"] == 4  # search settings: no rebuild
    with pytest.raises(IndexMismatchError, match="--force"):
        import_faiss(flat, release.corpus, out, FaissImportConfig(model=minilm, **{**FAST, "pq_m": 24}),
                     progress=False)
    write_flat(flat, release.vectors[::-1].copy())  # same size, other vectors
    with pytest.raises(IndexMismatchError, match=r"changed since index .* was imported"):
        load_index(out)
    flat.unlink()
    with pytest.raises(FileNotFoundError, match="which is not there"):
        load_index(out)


@pytest.mark.slow
def test_e5_conventions_match_sentence_transformers_mean_pooling(minilm):
    from sentence_transformers import SentenceTransformer

    from eviback.retrieval.encoder import E5QueryEncoder

    texts = ["who wrote hamlet", "when was insulin discovered and by whom, in which country"]
    ours = E5QueryEncoder(minilm).encode(texts)
    theirs = SentenceTransformer(minilm, device="cpu").encode(["query: " + t for t in texts],
                                                              normalize_embeddings=True)
    assert ours.shape == (2, DIM) and np.allclose(ours, theirs, atol=1e-5)


@pytest.mark.slow
def test_cli_import_then_serve_over_http(release, minilm, tmp_path):
    import httpx

    from eviback import cli
    from test_retrieval_service import Server, free_port, post

    out = tmp_path / "wiki18"
    code = cli.main(["index", "import-faiss", str(release.flat), str(release.corpus), "--out", str(out),
                     "--model", minilm, "--pq-m", "12", "--nprobe", "8", "--rerank", "64", "--no-progress"])
    assert code == 0
    in_process = load_index(out)
    titles = [c.split("\n")[0].strip('"') for c in release.contents[:REAL]]
    server = Server(out, free_port()).start()
    try:
        assert server.health()["index"]["kind"] == "faiss-import"
        response = post(server, json.dumps({"queries": titles[:8], "topk": 3, "return_scores": True}))
        assert response.status_code == 200
        result = response.json()["result"]
        expected = in_process.search(titles[:8], 3)
        for items, passages in zip(result, expected, strict=True):
            assert [i["document"]["id"] for i in items] == [p.id for p in passages]
            assert [i["score"] for i in items] == pytest.approx([p.score for p in passages], abs=1e-4)
        found = sum(items[0]["document"]["id"] == release.ids[i] for i, items in enumerate(result))
        assert found >= 6  # a title finds its own passage among 3,000
        many = [titles[i % len(titles)] for i in range(300)]
        body = post(server, json.dumps({"queries": many, "return_scores": False})).json()
        assert len(body["result"]) == 300 and all(set(item) == {"document"} for r in body["result"] for item in r)
        assert all(len(r) == 3 for r in body["result"])
        refused = httpx.post(f"{server.url}/retrieve", json={"queries": ["x"], "topk": "3"}, timeout=10)
        assert refused.status_code == 422 and "'topk' must be an integer" in refused.json()["detail"]
    finally:
        server.stop()
        in_process.close()


def test_cli_refuses_a_mismatch_with_a_message(release, minilm, tmp_path, capsys):
    from eviback import cli

    short = tmp_path / "short.jsonl.gz"
    write_corpus(short, release.ids[:10], release.contents[:10])
    code = cli.main(["index", "import-faiss", str(release.flat), str(short), "--out", str(tmp_path / "o"),
                     "--model", minilm, "--no-progress"])
    assert code == 2
    err = capsys.readouterr().err
    assert "eviback index import-faiss: error:" in err and "10 passages" in err and str(release.flat) in err
