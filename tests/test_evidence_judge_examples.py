"""The evidence judge's example sampling and batching (pure functions; the build itself is in
test_evidence_judge.py)."""

import random
from collections import Counter

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
