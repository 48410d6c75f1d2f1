"""The rollout engine's KV cache is sized to one step's sequences, in whole GiB, within its bounds."""

from __future__ import annotations

import json

from eviback.train.memory import (
    kv_bytes_per_token,
    kv_cache_gib,
    model_kv_bytes_per_token,
    release_free_heap,
    rollout_kv_cache_gib,
)

SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}


def test_kv_cache_follows_the_step():
    per_token = kv_bytes_per_token(30, 3, 64)
    assert per_token == 23_040
    assert kv_cache_gib(8, 1592, per_token) == 0.5  # the demo: 0.27 GiB needed x 1.5, the floor
    assert kv_cache_gib(12, 3012, per_token) == 1.25  # 0.78 GiB x 1.5 = 1.16, in quarters of a GiB
    assert kv_cache_gib(20, 3012, per_token) == 2  # the defaults: 1.29 GiB needed x 1.5
    assert kv_cache_gib(200, 3012, per_token) == 2  # the ceiling (the engine schedules in waves)


def test_rollout_kv_cache_reads_the_model_and_defers_to_the_user(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    assert model_kv_bytes_per_token(str(tmp_path)) == 23_040
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert rollout_kv_cache_gib(8, 1592, str(tmp_path)) == 0.5
    assert rollout_kv_cache_gib(8, 1592, str(tmp_path / "missing")) is None
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    assert rollout_kv_cache_gib(8, 1592, str(tmp_path)) is None


def test_release_free_heap_runs():
    assert release_free_heap() in (True, False)  # glibc: True; elsewhere a no-op
