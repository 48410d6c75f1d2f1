"""experiments/searchr1-parity.yaml: every setting is one eviback validates (a typo fails here, not hours into a
GPU run), the values are Search-R1's GRPO recipe (scripts/nq_hotpotqa/v0.2/train_grpo.sh and verl's
ppo_trainer.yaml of PeterGriffinJin/Search-R1), and docs/training.md's table names every setting it sets."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from eviback.data import embedded_root
from eviback.experiment import load_experiment, parse_experiment

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "experiments" / "searchr1-parity.yaml"

# Search-R1's values, by the eviback setting that carries each (the docs' table says where each comes from)
SEARCH_R1 = {
    "warm_start": False, "topk": 3, "group_size": 5, "max_turns": 4, "max_turn_tokens": 500, "max_obs_tokens": 500,
    "temperature": 1.0, "top_p": 0.95, "learning_rate": 1e-6, "lr_scheduler_type": "constant_with_warmup",
    "warmup_ratio": 0.285, "beta": 0.001, "loss_type": "dapo", "adv_eps": 1e-6, "max_grad_norm": 1.0,
    "is_correction": False, "mode": "grpo",
}
BENCHMARKS = ["nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle"]
STEPS, QUESTIONS_PER_STEP, MINI_BATCH = 1005, 512, 256  # total_training_steps, train_batch_size, ppo_mini_batch_size


@pytest.fixture(scope="module")
def recipe():
    config = load_experiment(RECIPE, data=str(embedded_root()))
    (arm, seed), = config.runs()
    return config, config.train_config(arm, seed)


def test_the_recipe_resolves_to_search_r1s_settings(recipe):
    config, train = recipe
    settings = train.to_dict()
    assert {k: settings[k] for k in SEARCH_R1} == SEARCH_R1
    assert train.retriever.endswith("/retrieve")  # Search-R1's retriever.url, served by `eviback serve`
    assert list(config.eval_benchmarks) == BENCHMARKS and config.eval_limit >= 14_267  # PopQA, the largest set
    assert train.prompt.chat_template == "auto"  # Search-R1 applies the tokenizer's template when it has one


def test_the_recipe_sees_search_r1s_questions_in_updates_of_its_size(recipe):
    """One eviback step is one update: 8 processes x questions_per_step x G rollouts, close to Search-R1's
    mini-batch of 256 rollouts; over the run, exactly Search-R1's 1005 x 512 questions; the warm-up the same
    share of the updates."""
    config, train = recipe
    processes = int(config.launch[config.launch.index("--num_processes") + 1])
    questions = processes * train.questions_per_step
    assert config.steps * questions == STEPS * QUESTIONS_PER_STEP
    assert abs(questions * train.rollout.group_size - MINI_BATCH) / MINI_BATCH < 0.1
    assert train.warmup_steps / train.max_steps == pytest.approx(int(0.285 * STEPS) / STEPS, abs=1e-3)
    assert train.val_every * 10 == train.max_steps  # test_freq 100 of 1005 steps: ten validations


def test_a_typo_in_the_recipe_is_refused():
    spec = yaml.safe_load(RECIPE.read_text())
    spec["settings"]["warmup_rato"] = 0.285
    with pytest.raises(ValueError, match="warmup_rato"):
        parse_experiment(spec, str(RECIPE))


def test_the_docs_table_names_every_setting_of_the_recipe():
    text = (ROOT / "docs" / "training.md").read_text()
    section = text.split("## Search-R1 parity", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([a-z_0-9]+)(?:[:=][^`]*)?`", section))
    spec = yaml.safe_load(RECIPE.read_text())
    missing = sorted(set(spec["settings"]) - named)
    assert not missing, f"docs/training.md, Search-R1 parity: no row for {missing}"
