"""The prompt style (`chat_template: auto | none`, `chat_template_kwargs`): Search-R1's plain prompt byte for byte,
the template's own switches reaching the template, a tokenizer without a template refused by name, and every
part that builds the actor's prompt (the training rollouts, the run's evaluation and `eviback eval`, the warm
start and `eviback sft`) building the same one.

The evidence judge and the teacher never build the actor's prompt (the judge reads observations cut in the
actor's tokens, the teacher its own stage prompts through its own model's template), so they have no path here.

Three real tokenizers, no model: SmolLM2's (bundled, with a chat template), a copy of its files without the
template (a base model's), and a copy whose template honours Qwen3's `enable_thinking` switch."""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from eviback import protocol
from eviback.commands import eval as eval_command
from eviback.commands import sft as sft_command
from eviback.evaluate import run_eval
from eviback.policy import load_tokenizer, resolve_model
from eviback.protocol import PromptStyle, prompt_text
from eviback.rollout import RolloutEngine
from eviback.train import runner, sft
from eviback.train import warmstart_data as wsd
from eviback.train.config import TrainConfig, resolve_config
from eviback.types import Action, ActionKind, Question, StopReason, Trajectory, Turn
from rollout_fakes import ScriptedBackend, ScriptedRetriever, wiki
from test_protocol import PREFIX_JSON

Q = Question("q1", "who wrote hamlet", ("William Shakespeare",))
PLAIN = json.loads(PREFIX_JSON) + "who wrote hamlet?\n"  # Search-R1's `chat[0]['content']`, as its doc quotes it
# Qwen3's generation prompt, cut down to what the switch changes: `enable_thinking=false` closes an empty
# think block after the assistant header.
THINKING_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)
NO_THINKING = PromptStyle(chat_template_kwargs={"enable_thinking": False})


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer("smollm2-135m", "float32")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """SmolLM2's tokenizer files without its chat template: a base model's tokenizer."""
    source = Path(resolve_model("smollm2-135m", "float32"))
    target = tmp_path_factory.mktemp("base-tokenizer")
    for file in source.iterdir():  # not chat_template.jinja, where transformers saves the template
        if file.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(file, target / file.name)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def base(base_dir):
    tokenizer = load_tokenizer(str(base_dir))
    assert not tokenizer.chat_template
    return tokenizer


@pytest.fixture(scope="module")
def thinking(base_dir):
    tokenizer = load_tokenizer(str(base_dir))
    tokenizer.chat_template = THINKING_TEMPLATE
    return tokenizer


def ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# ---------------------------------------------------------------- the prompt texts


def test_none_is_search_r1s_plain_prompt_byte_for_byte(smollm2, base):
    none = PromptStyle(chat_template="none")
    for tokenizer in (smollm2, base):  # with or without a template: no template is applied
        assert prompt_text(tokenizer, "  who wrote hamlet ", none) == PLAIN
    # what Search-R1's dataset row holds (`data.write_search_r1_parquet` writes the same user message)
    assert protocol.chat_messages(Q.question)[0]["content"] == PLAIN


def test_auto_is_the_tokenizers_template_as_before(smollm2):
    expected = smollm2.apply_chat_template([{"role": "user", "content": PLAIN}], add_generation_prompt=True,
                                           tokenize=False)
    assert prompt_text(smollm2, Q.question) == prompt_text(smollm2, Q.question, PromptStyle()) == expected
    assert protocol.apply_chat_template(smollm2, Q.question) == expected
    assert expected.endswith(PLAIN + "<|im_end|>\n<|im_start|>assistant\n")


def test_the_switch_reaches_the_template(thinking):
    default = prompt_text(thinking, Q.question)
    assert default.endswith("<|im_start|>assistant\n")
    off = prompt_text(thinking, Q.question, NO_THINKING)
    assert off == default + "<think>\n\n</think>\n\n"
    on = prompt_text(thinking, Q.question, PromptStyle(chat_template_kwargs={"enable_thinking": True}))
    assert on == default


def test_a_tokenizer_without_a_template_is_refused_by_name(base, base_dir, tmp_path):
    with pytest.raises(ValueError, match=r"has no chat template, and chat_template is 'auto'.*chat_template none "
                                         r"\(--set chat_template=none with eviback train, --chat-template none"):
        prompt_text(base, Q.question)
    with pytest.raises(ValueError, match="has no chat template"):
        RolloutEngine(ScriptedBackend(base, {}), ScriptedRetriever(wiki))
    # the warm start and a training run refuse it before any search or process: the message names the model
    named = f"the tokenizer of {re.escape(str(base_dir))} has no chat template"
    with pytest.raises(ValueError, match=named):
        sft.warm_start(sft.WarmStartConfig(model=str(base_dir), output=str(tmp_path / "ws")))
    with pytest.raises(ValueError, match=named):
        runner.initial_policy(TrainConfig.from_settings(model=str(base_dir)))
    assert not (tmp_path / "ws").exists()


# ---------------------------------------------------------------- the settings


def test_bad_prompt_settings_name_the_fix():
    with pytest.raises(ValueError, match=r"chat_template must be 'auto' .* or 'none' .* got 'base'"):
        PromptStyle(chat_template="base")
    with pytest.raises(ValueError, match=r"chat_template is 'none' \(no template\): set chat_template to auto"):
        PromptStyle(chat_template="none", chat_template_kwargs={"enable_thinking": False})
    with pytest.raises(ValueError, match=r"may not set 'add_generation_prompt'"):
        PromptStyle(chat_template_kwargs={"add_generation_prompt": False})
    with pytest.raises(ValueError, match=r"chat_template_kwargs\['x'\] must be plain data .* got set"):
        PromptStyle(chat_template_kwargs={"x": {1}})
    with pytest.raises(ValueError, match=r"chat_template_kwargs\['x'\]\[0\] must be a finite number"):
        PromptStyle(chat_template_kwargs={"x": [float("nan")]})
    with pytest.raises(ValueError, match=r"chat_template_kwargs"):
        PromptStyle(chat_template_kwargs="enable_thinking")
    with pytest.raises(ValueError, match=r"prompt: unknown prompt setting\(s\) \['template'\]"):
        PromptStyle.of({"template": "none"})
    with pytest.raises(ValueError, match=r"--set chat_template_kwargs=abc: setting 'chat_template_kwargs' takes"):
        resolve_config(overrides=["chat_template_kwargs=abc"])


def test_a_style_is_a_value():
    kwargs = {"enable_thinking": False}
    style = PromptStyle(chat_template_kwargs=kwargs)
    kwargs["enable_thinking"] = True  # the caller's mapping changes later; the record does not
    assert style == NO_THINKING and hash(style) == hash(NO_THINKING) and style != PromptStyle()
    assert PromptStyle.of(style.to_dict()) == style and PromptStyle.of(style) is style
    assert style.to_dict() == {"chat_template": "auto", "chat_template_kwargs": {"enable_thinking": False}}


def test_a_run_records_its_prompt_style_and_reads_it_back():
    config = resolve_config(overrides=["chat_template_kwargs={enable_thinking: false}"])
    assert config.prompt == NO_THINKING
    saved = yaml.safe_load(yaml.safe_dump(config.to_dict(), sort_keys=False))  # what config.yaml holds
    assert (saved["chat_template"], saved["chat_template_kwargs"]) == ("auto", {"enable_thinking": False})
    assert TrainConfig.from_settings(saved).prompt == NO_THINKING
    assert resolve_config(overrides=["chat_template=none"]).prompt == PromptStyle("none")
    assert TrainConfig().prompt == PromptStyle()


def test_the_warm_start_key_holds_the_style_but_keeps_the_defaults_key():
    default = sft.WarmStartConfig().key_fields()
    assert "prompt" not in default  # a warm start saved before the setting existed is found again
    plain = sft.WarmStartConfig(prompt=PromptStyle("none")).key_fields()
    assert plain["prompt"] == {"chat_template": "none", "chat_template_kwargs": {}}
    assert {k: v for k, v in plain.items() if k != "prompt"} == default
    assert sft.WarmStartConfig(prompt=NO_THINKING).key_fields()["prompt"] != plain["prompt"]


# ---------------------------------------------------------------- every path builds the same prompt


CASES = {  # tokenizer fixture, style, the extra options of `eviback eval` / `eviback sft`
    "template": ("smollm2", PromptStyle(), []),
    "plain-with-a-template": ("smollm2", PromptStyle("none"), ["--chat-template", "none"]),
    "plain-base-model": ("base", PromptStyle("none"), ["--chat-template", "none"]),
    "no-thinking": ("thinking", NO_THINKING, ["--chat-template-kwargs", '{"enable_thinking": false}']),
}


def parse(module, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


def example_trajectory() -> Trajectory:
    turn = Turn("<answer> William Shakespeare </answer>", Action(ActionKind.ANSWER, "William Shakespeare"))
    return Trajectory(Q, (turn,), "William Shakespeare", StopReason.ANSWERED)


@pytest.mark.parametrize("case", list(CASES))
def test_every_path_builds_the_same_prompt(case, request, tmp_path):
    name, style, options = CASES[case]
    tokenizer = request.getfixturevalue(name)
    expected = ids(tokenizer, prompt_text(tokenizer, Q.question, style))
    if style.chat_template == "none":
        assert tokenizer.decode(expected) == PLAIN
    elif style == NO_THINKING:
        assert tokenizer.decode(expected).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    config = TrainConfig.from_settings(chat_template=style.chat_template,
                                       chat_template_kwargs=style.chat_template_kwargs)
    script = {Q.question: ["<answer> William Shakespeare </answer>"]}

    # training: the run's rollout engine, and the ids of its trajectories (what TRL trains on)
    engine = runner.rollout_engine(config, ScriptedBackend(tokenizer, script), ScriptedRetriever(wiki))
    assert engine.prompt_ids(Q) == expected
    [trajectory] = engine.rollout([Q], group_size=1).trajectories
    assert list(trajectory.tokens.prompt_ids) == expected

    # evaluation: the run's held-out evaluation and `eviback eval` with the options, each recorded in config.json
    qa = tmp_path / "qa.jsonl"
    qa.write_text(json.dumps({"id": Q.id, "question": Q.question, "golden_answers": list(Q.golden_answers)}) + "\n")
    held_out = runner.held_out_eval_config(config, tmp_path / "held-out", "smollm2-135m", qa_files=(str(qa),),
                                           progress=False)
    command = eval_command.config_from_args(parse(eval_command, ["--qa", str(qa), "--out", str(tmp_path / "cli"),
                                                                 "--no-progress", *options]))
    for eval_config in (held_out, command):
        assert eval_config.prompt == style
        backend = ScriptedBackend(tokenizer, script)
        run_eval(eval_config, backend=backend, retriever=ScriptedRetriever(wiki))
        assert backend.calls[0] == [expected]
        recorded = json.loads((eval_config.out_dir() / "config.json").read_text())
        assert recorded["config"]["prompt"] == recorded["identity"]["prompt"] == style.to_dict()

    # the warm start: the run's, through the dict its own process reads back, and `eviback sft` with the options
    warm = runner.warm_start_config(config)
    assert sft.WarmStartConfig(**warm.to_dict()).prompt == style
    assert sft_command.config_from_args(parse(sft_command, options)).prompt == style
    [row] = sft.tokenized_dataset([wsd.WarmStartExample(example_trajectory(), wsd.ExampleKind.SINGLE)], tokenizer,
                                  warm.max_observation_tokens, warm.prompt)
    assert row["input_ids"][: len(expected)] == expected
    assert row["labels"][: len(expected)] == [wsd.IGNORE_INDEX] * len(expected)
    assert row["input_ids"][len(expected):] == ids(tokenizer, example_trajectory().turns[0].text) + [
        tokenizer.eos_token_id]


def test_an_evaluation_resumes_only_with_its_prompt_style(smollm2, tmp_path):
    qa = tmp_path / "qa.jsonl"
    qa.write_text(json.dumps({"id": Q.id, "question": Q.question, "golden_answers": list(Q.golden_answers)}) + "\n")
    out = tmp_path / "eval"

    def evaluate(*options: str) -> None:
        config = eval_command.config_from_args(parse(eval_command, ["--qa", str(qa), "--out", str(out),
                                                                    "--no-progress", *options]))
        backend = ScriptedBackend(smollm2, {Q.question: ["<answer> William Shakespeare </answer>"]})
        run_eval(config, backend=backend, retriever=ScriptedRetriever(wiki))

    evaluate()
    with pytest.raises(ValueError, match=r"other settings \(prompt: .*'auto'.* -> .*'none'"):
        evaluate("--chat-template", "none")
    # an evaluation written before the setting existed ran with the chat template: it resumes as one
    saved = json.loads((out / "config.json").read_text())
    del saved["identity"]["prompt"]
    (out / "config.json").write_text(json.dumps(saved))
    evaluate()
    with pytest.raises(ValueError, match="--chat-template-kwargs takes a mapping"):
        evaluate("--chat-template-kwargs", "enable_thinking")
