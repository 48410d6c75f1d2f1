"""The engines' memory arithmetic (eviback.generation.memory) and the trainer's (eviback.train.memory): the
vLLM CPU engine's KV cache is sized to one step's sequences, an HF generate call takes as many rows as fit,
and an in-process vLLM engine on a GPU takes what one step needs beside the trainer, or is refused."""

from __future__ import annotations

import json

import pytest

from eviback.generation.memory import (
    GIB,
    ModelShape,
    cpu_kv_cache_gib,
    cpu_rollout_kv_cache_gib,
    engine_share,
    even_batches,
    hf_rows_per_call,
    kv_bytes_per_token,
    kv_gib,
)
from eviback.train.memory import release_free_heap, trainer_bytes

SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
QWEN3_06B = ModelShape(layers=28, kv_heads=8, head_dim=128, hidden=1024, intermediate=3072, vocab=151_936)
QWEN3_4B = ModelShape(layers=36, kv_heads=8, head_dim=128, hidden=2560, intermediate=9728, vocab=151_936)


def test_kv_cache_follows_the_step():
    per_token = kv_bytes_per_token(30, 3, 64)
    assert per_token == 23_040
    assert cpu_kv_cache_gib(8, 1592, per_token) == 0.5  # the demo: 0.27 GiB needed x 1.5, the floor
    assert cpu_kv_cache_gib(12, 3012, per_token) == 1.25  # 0.78 GiB x 1.5 = 1.16, in quarters of a GiB
    assert cpu_kv_cache_gib(20, 3012, per_token) == 2  # the defaults: 1.29 GiB needed x 1.5
    assert cpu_kv_cache_gib(200, 3012, per_token) == 2  # the ceiling (the engine schedules in waves)
    assert QWEN3_06B.kv_bytes_per_token() == 112 * 1024
    assert kv_gib(80 * 4096, QWEN3_06B.kv_bytes_per_token()) == pytest.approx(35.0)


def test_rollout_kv_cache_reads_the_model_and_defers_to_the_user(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    assert ModelShape.from_checkpoint(tmp_path).kv_bytes_per_token() == 23_040
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert cpu_rollout_kv_cache_gib(8, 1592, str(tmp_path)) == 0.5
    assert cpu_rollout_kv_cache_gib(8, 1592, str(tmp_path / "missing")) is None
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    assert cpu_rollout_kv_cache_gib(8, 1592, str(tmp_path)) is None


def test_hf_calls_take_as_many_rows_as_fit():
    """256 rows late in a 4k rollout of 0.6B want about 100 GiB of cache: on 40 GiB free they are split into
    as few calls as fit, evenly."""
    rows = hf_rows_per_call(rows=256, width=3500, cap=500, free_bytes=40 * GIB, shape=QWEN3_06B)
    per_row_kv = 4000 * QWEN3_06B.kv_bytes_per_token()
    assert 256 * per_row_kv > 100 * GIB
    assert rows * per_row_kv < 36 * GIB and (rows + 1) * (per_row_kv + 3500 * QWEN3_06B.prefill_bytes_per_token()) > 36 * GIB * 0.9
    calls = even_batches(256, rows)
    assert sum(calls) == 256 and max(calls) <= rows and max(calls) - min(calls) <= 1
    assert len(calls) == -(-256 // rows)
    assert hf_rows_per_call(rows=4, width=10, cap=10, free_bytes=80 * GIB, shape=QWEN3_06B) == 4  # all fit
    assert hf_rows_per_call(rows=4, width=10**6, cap=10, free_bytes=GIB, shape=QWEN3_06B) == 1  # never 0
    assert even_batches(10, 4) == [4, 3, 3] and even_batches(0, 4) == []


def test_the_engine_takes_one_steps_need_beside_the_trainer():
    """0.6B on an 80 GB H100: 80 rollouts of 4,096 tokens need 35 GiB of cache; the trainer keeps 16 bytes a
    parameter (fp32 weights, AdamW, fp32 reference). The engine's share leaves the trainer its bytes, and a
    4B trainer beside a whole step's cache does not fit: the engine is given what is left (waves), or refused
    when even a quarter of the cache does not fit."""
    params = 600_000_000
    trainer = trainer_bytes(accelerator=True, masters=False, reference=True)
    assert trainer.resident == 16 and trainer.update == 6
    total = 80 * GIB
    share = engine_share(total_bytes=total, engine_weight_bytes=2 * params,
                         kv_bytes=80 * 4096 * QWEN3_06B.kv_bytes_per_token(), trainer_resident_bytes=trainer.resident_bytes(params))
    assert share.kv == 35 * GIB
    assert share.utilization * total >= share.engine
    assert share.utilization * total + trainer.resident_bytes(params) <= total - GIB  # the trainer fits beside it
    assert 0.5 < share.utilization < 0.7
    # 4B: 64 GB resident leaves about 14 GiB: less than the step's 45 GiB, more than its quarter: waves
    big = 4_000_000_000
    tight = engine_share(total_bytes=total, engine_weight_bytes=2 * big,
                         kv_bytes=80 * 4096 * QWEN3_4B.kv_bytes_per_token(),
                         trainer_resident_bytes=trainer_bytes(accelerator=True, masters=False, reference=False).resident_bytes(big))
    assert tight.utilization * total + 12 * big <= total
    with pytest.raises(ValueError, match="backend=vllm-server"):
        engine_share(total_bytes=total, engine_weight_bytes=2 * big, kv_bytes=80 * 4096 * QWEN3_4B.kv_bytes_per_token(),
                     trainer_resident_bytes=trainer.resident_bytes(big))


def test_release_free_heap_runs():
    assert release_free_heap() in (True, False)  # glibc: True; elsewhere a no-op
