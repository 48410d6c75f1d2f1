"""The update benchmark counts the FLOPs each path runs: the fast path's LM head only on the scored
positions and its decoder on its length buckets; TRL's path on full-width rows."""

import importlib.util
import sys
from pathlib import Path

SPEC = importlib.util.spec_from_file_location(
    "bench_update", Path(__file__).resolve().parents[1] / "benchmarks" / "bench_update.py")
bench = importlib.util.module_from_spec(SPEC)
sys.modules.setdefault("bench_update", bench)  # its dataclasses look their module up
SPEC.loader.exec_module(bench)


def _batch():
    rows = [bench.Row([1, 2, 3], [4, 5, 6, 7, 8, 9], [1, 1, 0, 0, 1, 1], 1.0),
            bench.Row([1, 2], [4, 5, 6], [1, 0, 1], -1.0),
            bench.Row([1, 2, 3, 4], [4, 5, 6, 7], [1, 1, 1, 1], 0.5),
            bench.Row([1], [4, 5], [1, 1], 0.0)]
    return bench.generation_batch(rows, pad=0)


def test_the_fast_path_counts_its_head_on_the_scored_positions_only():
    batch = _batch()
    decoder, head = 100, 10
    fast = bench.flops_run(batch, decoder + head, head, True, fast=True, old_pass=False, parts=2, seed=0)
    plain = bench.flops_run(batch, decoder + head, head, True, fast=False, old_pass=True, parts=2, seed=0)
    scored = int((batch["completion_mask"] * batch["tool_mask"]).sum())  # 4 + 2 + 4 + 2 = 12
    assert scored == 12
    assert fast["head_positions_no_grad"] == fast["head_positions_trained"] == scored
    width, keep = 4 + 6, 6  # prompt 4 (left-padded) + completion 6 (right-padded)
    assert plain["decoder_tokens_trained"] == 4 * width and plain["head_positions_trained"] == 4 * (keep + 1)
    assert plain["decoder_tokens_no_grad"] == 2 * 4 * width  # reference and old log-probs
    real = int(batch["prompt_mask"].sum() + batch["completion_mask"].sum())
    assert fast["flops_useful"] == plain["flops_useful"] == 8 * (decoder * real + head * scored)
    assert real <= fast["decoder_tokens_trained"] and fast["flops"] < plain["flops"]
    # what runs, pass by pass: 2x forward (reference), 6x forward and backward (trained micro-batches)
    assert fast["flops"] == (2 * (decoder * fast["decoder_tokens_no_grad"] + head * scored)
                             + 6 * (decoder * fast["decoder_tokens_trained"] + head * scored))


def test_untied_embeddings_are_not_counted_as_decoder_work():
    batch = _batch()
    tied = bench.flops_run(batch, 110, 10, True, fast=True, old_pass=False, parts=2, seed=0)
    untied = bench.flops_run(batch, 120, 10, False, fast=True, old_pass=False, parts=2, seed=0)
    assert tied["flops"] == untied["flops"]
