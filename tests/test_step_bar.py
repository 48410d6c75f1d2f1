"""The trainers' step bar: with the bars on or off (`--no-progress`), a training run prints none of the
Trainer's per-step dicts (eviback logs its own step line); with `-v` they stay."""

from __future__ import annotations

import pytest
import torch

from eviback.train.step_bar import keep_bar_only


def _train(tmp_path, disable_tqdm: bool) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    rows = [{"input_ids": torch.arange(8), "labels": torch.arange(8)} for _ in range(4)]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, logging_steps=1,
                             report_to="none", use_cpu=True, disable_tqdm=disable_tqdm, save_strategy="no")
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    keep_bar_only(trainer)
    trainer.train()


@pytest.mark.parametrize("disable_tqdm", [True, False], ids=["no-progress", "bars"])
def test_no_per_step_dict_is_printed(tmp_path, capfd, disable_tqdm):
    _train(tmp_path, disable_tqdm)
    out, err = capfd.readouterr()
    assert "'loss'" not in out and "'loss'" not in err
    assert "'train_runtime'" not in out and "'train_runtime'" not in err


def test_verbose_keeps_the_dicts(tmp_path, capfd, monkeypatch):
    monkeypatch.setattr("eviback.train.step_bar.verbose", lambda: True)
    _train(tmp_path, disable_tqdm=True)
    assert "'loss'" in capfd.readouterr().out
