"""The evidence judge's example sampling and batching (pure functions; the build itself is in
test_evidence_judge.py)."""

import random
from collections import Counter

import pytest

from eviback.train.judge_builder import JudgeExample, balance, length_batches
from eviback.types import Status

S, A, NO = Status.SUFFICIENT, Status.AMBIGUOUS, Status.INSUFFICIENT


def _examples(multi_hop: bool, counts: dict[Status, int]) -> list[JudgeExample]:
    return [JudgeExample(f"{multi_hop}-{label.value}-{i}", "q", "e", label, "search", multi_hop)
            for label, n in counts.items() for i in range(n)]


def test_labels_are_balanced_within_each_kind_of_question():
    """Multi-hop questions are the only ones with A labels: balancing over all examples would leave
    'multi-hop' predicting A. Within each kind, every label is capped at the rarest one's count x ratio."""
    examples = _examples(False, {S: 300, NO: 500}) + _examples(True, {S: 20, A: 200, NO: 90})
    chosen = balance(examples, ratio=1.5, seed=0)
    single = Counter(e.label for e in chosen if not e.multi_hop)
    multi = Counter(e.label for e in chosen if e.multi_hop)
    assert single == {S: 300, NO: 450}
    assert multi == {S: 20, A: 30, NO: 30}
    assert balance(examples, ratio=1.5, seed=0) == chosen  # seeded
    assert balance([], ratio=1.5, seed=0) == []


def test_length_batches_cover_the_epoch_once_with_similar_lengths():
    rng = random.Random(0)
    lengths = [rng.randint(20, 300) for _ in range(1000)]
    batches = length_batches(range(1000), lengths, batch_size=16, rng=random.Random(1))
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(1000)) and all(len(b) <= 16 for b in batches)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    assert padded < 1.15 * sum(lengths)  # vs ~1.8x for random batches of these lengths


def test_the_build_key_names_the_base_model_by_content_not_by_location(tmp_path):
    """A judge cached by one checkout is reused by another whose environment installs the same base model
    elsewhere; other weights give another key."""
    from eviback.train.judge_builder import EvidenceJudgeConfig, build_key

    examples = [JudgeExample("q1", "q", "e", S, "search")]
    keys = []
    for where, weights in (("a", b"w1"), ("b", b"w1"), ("c", b"w2")):
        base = tmp_path / where / "model"
        base.mkdir(parents=True)
        (base / "config.json").write_text("{}")
        (base / "model.safetensors").write_bytes(weights)
        keys.append(build_key(EvidenceJudgeConfig(base_model=str(base)), examples))
    assert keys[0] == keys[1] != keys[2]


def test_the_build_key_takes_numbers_by_value_not_by_type(tmp_path):
    """`judge_epochs: 3` in a training config and `--epochs 3` on the command line (3.0) are the same build:
    the cached judge is reused, not rebuilt under another key."""
    from eviback.train.judge_builder import EvidenceJudgeConfig, build_key

    base = tmp_path / "model"
    base.mkdir()
    (base / "config.json").write_text("{}")
    (base / "model.safetensors").write_bytes(b"w")
    examples = [JudgeExample("q1", "q", "e", S, "search")]

    def key(**changes) -> str:
        return build_key(EvidenceJudgeConfig(base_model=str(base), architecture="cross-encoder", **changes), examples)

    assert key(epochs=3) == key(epochs=3.0) == key()  # 3 epochs: the default
    assert key(learning_rate=1e-4, seed=0) == key()
    assert key(epochs=2) != key()


def test_a_setting_that_changes_the_judge_changes_its_key(tmp_path):
    """Each setting a judge depends on makes another cache entry; settings a bi-encoder does not use (it trains
    no encoder: epochs, batch size, learning rate) do not, so changing them reuses the cached judge."""
    from eviback.train.judge_builder import EvidenceJudgeConfig, build_key

    base = tmp_path / "model"
    base.mkdir()
    (base / "config.json").write_text("{}")
    (base / "model.safetensors").write_bytes(b"w")
    examples = [JudgeExample("q1", "q", "e", S, "search")]

    def key(**changes) -> str:
        return build_key(EvidenceJudgeConfig(base_model=str(base), **changes), examples)

    assert EvidenceJudgeConfig().architecture == "bi-encoder"
    assert key() == key(epochs=1, batch_size=8, learning_rate=3e-4)
    keys = {key(), key(architecture="cross-encoder"), key(threshold=0.6), key(max_length=128),
            build_key(EvidenceJudgeConfig(base_model=str(base)), examples + [JudgeExample("q2", "q", "f", NO, "search")])}
    assert len(keys) == 5


def test_a_calibrated_judge_has_its_own_key(tmp_path):
    """Builder 5 calibrates a bi-encoder's threshold: its key differs from a fixed threshold's (and from builder
    4's, whose judges are rebuilt), and depends on the evidence it calibrates on; a cross-encoder is not
    calibrated, and its key is builder 3's as before (threshold 0 means the 0.5 it always had)."""
    from eviback.train import judge_builder
    from eviback.train.judge_builder import EvidenceJudgeConfig, build_key

    base = tmp_path / "model"
    base.mkdir()
    (base / "config.json").write_text("{}")
    (base / "model.safetensors").write_bytes(b"w")
    examples = [JudgeExample("q1", "q", "e", S, "search")]
    evidence = [JudgeExample("q1", "q", "e\nDoc 2(Title: x) f", S, "search")]

    def key(evidence=evidence, **changes) -> str:
        return build_key(EvidenceJudgeConfig(base_model=str(base), **changes), examples, evidence)

    assert EvidenceJudgeConfig().calibrated and EvidenceJudgeConfig().threshold == 0
    assert not EvidenceJudgeConfig(threshold=0.5).calibrated
    assert not EvidenceJudgeConfig(architecture="cross-encoder").calibrated
    assert len({key(), key(threshold=0.5), key(evidence=evidence + examples), key(seed=1)}) == 4
    assert judge_builder.BUILDER_VERSION == 5
    cross = [key(architecture="cross-encoder", threshold=t, evidence=()) for t in (0.0, 0.5)]
    assert cross[0] == cross[1] == key(architecture="cross-encoder", evidence=evidence)


@pytest.fixture
def one_thread():
    """Tiny head fits: one torch thread (two, on a busy 2-core machine, made each fit 10-20x slower)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _synthetic(n_questions: int):
    """Embeddings where a relevant passage is its question's own vector and an irrelevant one another
    direction: (embedded, passage examples, whole evidence texts), no model."""
    import torch

    from eviback.train.judge_builder import Embedded

    gen = torch.Generator().manual_seed(0)
    questions = [f"question {i}" for i in range(n_questions)]
    q = torch.nn.functional.normalize(torch.randn(n_questions, 8, generator=gen), dim=-1)
    texts, vectors, train, evidence = [], [], [], []
    for i, question in enumerate(questions):
        good, bad = f'Doc 1(Title: "g{i}") answer', f'Doc 1(Title: "b{i}") other'
        texts += [good, bad]
        vectors += [q[i], torch.nn.functional.normalize(torch.randn(8, generator=gen), dim=-1)]
        train += [JudgeExample(f"q{i}", question, good, S, "search"), JudgeExample(f"q{i}", question, bad, NO, "search")]
        evidence += [JudgeExample(f"q{i}", question, good + "\n" + bad, S, "search"),
                     JudgeExample(f"q{i}", question, bad, NO, "negative")]
    embedded = Embedded({x: k for k, x in enumerate(questions)}, {t: k for k, t in enumerate(texts)}, q,
                        torch.stack(vectors))
    return embedded, train, evidence


def test_the_gate_is_calibrated_on_cross_fitted_training_evidence(monkeypatch, one_thread):
    """Each training question's evidence is scored by a head fitted without its fold; on evidence a head
    separates, the threshold separates it too, and the record says how it was chosen."""
    from eviback.train import judge_builder
    from eviback.train.judge_builder import calibrate_gate, question_fold

    embedded, train, evidence = _synthetic(20)
    assert len({question_fold(e.question_id, 5, 0) for e in evidence}) == 5
    fitted_on = []
    real = judge_builder.fit_head

    def spy(features, examples):
        fitted_on.append({e.question_id for e in examples})
        return real(features, examples)

    monkeypatch.setattr(judge_builder, "fit_head", spy)
    record = calibrate_gate(embedded, train, evidence, seed=0)
    # five heads, each without one fold's questions: every question's evidence scored by a head without it
    assert len(fitted_on) == 5 and all(len(questions) < 20 for questions in fitted_on)
    everyone = {f"q{i}" for i in range(20)}
    assert set.union(*(everyone - questions for questions in fitted_on)) == everyone
    assert record["method"] == "cross-fitted" and record["folds"] == 5 and record["gate"] == 1.0
    assert (record["n"], record["n_i"], record["n_open"]) == (40, 20, 20) and 0 < record["threshold"] < 1


def test_evidence_that_cannot_calibrate_keeps_the_default_threshold(one_thread):
    from eviback.train.judge_builder import calibrate_gate

    embedded, train, evidence = _synthetic(20)
    one = [e for e in evidence if e.question_id == "q0"]  # one question: one fold, nothing to cross-fit
    record = calibrate_gate(embedded, train, one, seed=0)
    assert record["threshold"] == 0.5 and "one calibration fold" in record["skipped"]
    for kept, missing in ((S, "no I text"), (NO, "no S or A text")):
        record = calibrate_gate(embedded, train, [e for e in evidence if e.label is kept], seed=0)
        assert record["threshold"] == 0.5 and missing in record["skipped"]
