"""The warm start on the real pieces: SmolLM2's tokenizer and chat template, BM25 over the embedded corpus,
a tiny fine-tuning run on the real model, and the fp32-master optimiser."""

import json

import pytest
import torch

from eviback.log_format import foreign_lines
from eviback.protocol import apply_chat_template, render_observation
from eviback.queries import contains_words
from eviback.train import sft
from eviback.train import warmstart_data as wsd
from eviback.train.precision import MasterWeightAdamW


def test_master_weights_keep_updates_that_bf16_rounds_away():
    x = torch.rand(8, 4) + 0.5  # positive inputs: every gradient of the sum is positive, every step -lr

    def train(model, optimizer, steps=50):
        for _ in range(steps):
            optimizer.zero_grad()
            model(x.to(model.weight.dtype)).float().sum().backward()
            optimizer.step()

    pure = torch.nn.Linear(4, 1, bias=False).to(torch.bfloat16)
    torch.nn.init.constant_(pure.weight, 1.0)
    train(pure, torch.optim.AdamW(pure.parameters(), lr=1e-4, weight_decay=0.0))
    assert torch.all(pure.weight == 1.0)  # every update of ~1e-4 was below bf16's spacing at 1.0 (2**-7)

    model = torch.nn.Linear(4, 1, bias=False).to(torch.bfloat16)
    master = torch.nn.Linear(4, 1, bias=False)
    torch.nn.init.constant_(master.weight, 1.0)
    optimizer = MasterWeightAdamW(model, master, lr=1e-4, weight_decay=0.0)
    assert torch.all(model.weight == 1.0)  # the bf16 copy starts from the masters
    train(model, optimizer)
    assert torch.allclose(master.weight, torch.full_like(master.weight, 1 - 50e-4), atol=1e-3)
    assert torch.equal(model.weight, master.weight.to(torch.bfloat16))
    train(model, optimizer, steps=100)
    assert torch.all(model.weight < 1.0)  # the accumulated updates reach the bf16 weights


@pytest.fixture(scope="module")
def tokenizer():
    from eviback.policy import load_tokenizer

    return load_tokenizer("smollm2-135m", "float32")


@pytest.fixture(scope="module")
def retriever():
    from eviback.retrieval import suite_retriever

    r = suite_retriever()
    yield r
    r.close()


@pytest.mark.slow
def test_real_examples_and_masks(tokenizer, retriever):
    config = sft.WarmStartConfig(train_files=["nq_train", "hotpotqa_train"], max_examples=40, progress=False)
    examples, report = sft.build_training_set(config, tokenizer, retriever)
    assert report.kept["single"] > 100 and report.kept["multi"] > 10  # both kinds exist on the real data
    assert {e.kind for e in examples} >= {wsd.ExampleKind.SINGLE, wsd.ExampleKind.MULTI}
    for example in examples:
        trace = wsd.tokenize_trajectory(example.trajectory, tokenizer, max_obs_tokens=config.max_observation_tokens)
        question = example.question.question
        # The prompt is the chat template's, exactly as the rollout engine encodes it.
        assert tokenizer.decode(trace.prompt_ids) == apply_chat_template(tokenizer, question)
        assert list(trace.prompt_ids) == tokenizer(apply_chat_template(tokenizer, question),
                                                   add_special_tokens=False)["input_ids"]
        own = [t for t, m in zip(trace.ids, trace.mask, strict=True) if m]
        assert tokenizer.decode(own) == "".join(t.text for t in example.trajectory.turns) + tokenizer.eos_token
        seen = [t for t, m in zip(trace.ids, trace.mask, strict=True) if not m]
        assert tokenizer.decode(seen) == "".join(t.observation for t in example.trajectory.turns)
        searches = [t for t in example.trajectory.turns if t.executed]
        assert len(seen) <= config.max_observation_tokens * len(searches)
        for turn in searches:  # observations are the real retriever's results for the query, as rendered
            rendered = render_observation(retriever.search([turn.action.content], topk=3)[0])
            assert rendered.startswith(turn.observation)
        answer_turn = example.trajectory.turns[-1]
        assert answer_turn.text.endswith(f"<answer> {example.trajectory.answer} </answer>")
        assert contains_words("".join(t.observation for t in searches), example.trajectory.answer)
        if example.kind is wsd.ExampleKind.MULTI:
            assert len(searches) == 2
        input_ids, labels = wsd.labels_for(trace)
        assert labels[: len(trace.prompt_ids)] == [-100] * len(trace.prompt_ids)
        assert [t for t in labels if t != -100] == own


def masked_loss(model_dir, examples, tokenizer, max_obs_tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    total, count = 0.0, 0
    with torch.no_grad():
        for e in examples:
            input_ids, labels = wsd.labels_for(wsd.tokenize_trajectory(e.trajectory, tokenizer, max_obs_tokens))
            out = model(input_ids=torch.tensor([input_ids]), labels=torch.tensor([labels]))
            n = sum(t != -100 for t in labels)
            total += out.loss.item() * n
            count += n
    return total / count


@pytest.mark.slow
def test_tiny_warm_start_learns_saves_and_is_reused(tmp_path, tokenizer, retriever):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eviback.policy import resolve_model

    config = sft.WarmStartConfig(
        train_files=["nq_train", "hotpotqa_train"], max_examples=4, max_observation_tokens=32, epochs=3,
        gradient_accumulation=2, learning_rate=1e-4, output=str(tmp_path / "ws"), progress=False,
    )
    path = sft.warm_start(config, retriever=retriever)
    assert path == tmp_path / "ws"
    report = json.loads((path / sft.REPORT_FILE).read_text())
    assert report["examples"]["total"] == 4 and report["examples"]["multi"] >= 1
    assert report["train"]["optimizer_steps"] == 6 and report["train"]["tokens_per_second"] > 0
    examples = [e for e in sft.build_training_set(config, tokenizer, retriever)[0]]
    base = resolve_model("smollm2-135m", "float32")
    before = masked_loss(base, examples, tokenizer, 32)
    after = masked_loss(str(path), examples, tokenizer, 32)
    assert after < before * 0.8, (before, after)
    # An ordinary checkpoint: resolve_model accepts the directory, transformers loads model and tokenizer.
    assert resolve_model(str(path)) == str(path)
    AutoModelForCausalLM.from_pretrained(resolve_model(str(path)), dtype=torch.bfloat16)
    assert AutoTokenizer.from_pretrained(path).eos_token == tokenizer.eos_token
    saved = json.loads((path / sft.CONFIG_FILE).read_text())
    assert saved["key"] == report["key"] and saved["max_examples"] == 4
    # The second call reuses it without training.
    stamp = (path / sft.REPORT_FILE).stat().st_mtime_ns
    assert sft.warm_start(config, retriever=retriever) == path
    assert (path / sft.REPORT_FILE).stat().st_mtime_ns == stamp


@pytest.mark.slow
def test_cli_dry_run_counts_examples():
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "eviback.cli", "sft", "--dry-run", "--no-progress", "--train-files", "popqa_train",
         "musique_train", "--max-examples", "10"],
        capture_output=True, text=True, check=True,
    )
    counts = json.loads(result.stdout[: result.stdout.index("\n}\n") + 2])
    selected = counts["selected"]
    assert selected["total"] == 10 and selected["multi"] + selected["retry"] == 3 and selected["multi"] >= 1
    assert set(counts["build"]["considered"]) == {"popqa", "musique"}
    assert "<search>" in result.stdout and "</answer>" in result.stdout
    # its log: eviback's lines only (its stdout is an example's text, passages included: not checked for levels)
    assert foreign_lines(result.stderr) == [], "\n".join(foreign_lines(result.stderr))
