"""Each setting is defined once: a training run's settings live in one field each, the components a run hands
them to (evaluation, the warm start) hold the rollout section instead of copies of its fields, and the
defaults every command shares (the model, the dtype choices, the ports) are one constant each."""

from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path

import eviback
from eviback import dtype as dtypes
from eviback.policy import DEFAULT_MODEL
from eviback.rollout import RolloutConfig
from eviback.train.config import SECTION_SETTINGS, SECTIONS, TrainConfig, setting_types

SRC = Path(eviback.__file__).parent


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_every_training_setting_is_one_field():
    """Walk the documented settings (`eviback train --help-config`): each is set by one name and stored in
    one field, of TrainConfig itself or of one of its sections."""
    places: dict[tuple[str | None, str], str] = {}
    for name in setting_types():
        section, field = SECTION_SETTINGS.get(name, (None, name))
        owner = SECTIONS[section] if section else TrainConfig
        assert field in _fields(owner), (name, owner.__name__)
        assert (section, field) not in places, f"{name} and {places[(section, field)]} set the same field"
        places[(section, field)] = name
    # a section's field is a setting, or one the run derives (the context bound, log-probs, the hit threshold)
    for section, cls in SECTIONS.items():
        unset = _fields(cls) - {f for (s, f) in places if s == section}
        assert unset <= {"max_context_tokens", "logprobs", "hit_threshold"}, (section, unset)


def test_the_runs_components_take_the_rollout_settings_as_the_rollout_section_writes_them():
    """Evaluation holds a RolloutConfig; the warm start and the evidence judge's build name the rollout fields
    they use as RolloutConfig does, with its defaults (no renamed copy such as `max_obs_tokens`)."""
    from eviback.evaluate import EvalConfig
    from eviback.train.judge_builder import EvidenceJudgeConfig
    from eviback.train.sft import WarmStartConfig

    held = [f.name for f in dataclasses.fields(EvalConfig) if f.type in (RolloutConfig, "RolloutConfig")]
    assert held == ["rollout"] and not (_fields(EvalConfig) - {"rollout"}) & _fields(RolloutConfig)
    aliases = {k for k, (s, f) in SECTION_SETTINGS.items() if s == "rollout" and k != f}  # e.g. max_obs_tokens
    defaults = {f.name: f.default for f in dataclasses.fields(RolloutConfig)}
    for cls in (WarmStartConfig, EvidenceJudgeConfig):
        assert not _fields(cls) & aliases, (cls.__name__, _fields(cls) & aliases)
        for f in dataclasses.fields(cls):
            if f.name in defaults:
                assert f.default == defaults[f.name], (cls.__name__, f.name, f.default, defaults[f.name])


def _string_constants(tree: ast.AST) -> list[ast.Constant]:
    """Every string constant of a module that is not a docstring."""
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    return [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docstrings]


def test_the_default_model_is_named_once():
    """`policy.DEFAULT_MODEL` is the one place the bundled model's name is written in code (docstrings may
    show it in examples)."""
    places = []
    for path in SRC.rglob("*.py"):
        for node in _string_constants(ast.parse(path.read_text(encoding="utf-8"))):
            if node.value == DEFAULT_MODEL:
                places.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert places == ["policy.py:" + places[0].split(":")[1]] and places[0].startswith("policy.py"), places


def _dtype_choices() -> dict[str, tuple[str, ...] | None]:
    """The `--dtype` choices of every command, by command."""
    from eviback.cli import SUBCOMMANDS, build_parser

    parser = build_parser()
    out = {}
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for action in subparsers:
        for name, sub in action.choices.items():
            for arg in sub._actions:
                if "--dtype" in arg.option_strings:
                    out[name] = arg.choices
    assert SUBCOMMANDS is not None
    return out


def test_every_commands_dtype_choices_are_the_dtype_modules():
    choices = _dtype_choices()
    assert len(choices) >= 5, choices
    for command, given in choices.items():
        assert given is dtypes.CHOICES or given is dtypes.TRAINING_CHOICES, (command, given)


def test_the_retrieval_service_the_teacher_and_the_policy_server_default_to_different_ports():
    from eviback.commands.serve_policy import add_arguments
    from eviback.evaluate import EvalConfig
    from eviback.generation.server import DEFAULT_PORT as POLICY_PORT
    from eviback.generation.server import DEFAULT_URL as POLICY_URL
    from eviback.retrieval.config import DEFAULT_PORT as RETRIEVAL_PORT
    from eviback.retrieval.config import ServerConfig
    from eviback.teacher.openai_http import DEFAULT_BASE_URL, DEFAULT_PORT, HttpBackendConfig

    assert len({RETRIEVAL_PORT, DEFAULT_PORT, POLICY_PORT}) == 3
    assert ServerConfig().port == RETRIEVAL_PORT
    assert HttpBackendConfig().base_url == DEFAULT_BASE_URL and f":{DEFAULT_PORT}/" in DEFAULT_BASE_URL
    # the policy server: one port, the one `eviback serve-policy` listens on and every client defaults to
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).port == POLICY_PORT and POLICY_URL.endswith(f":{POLICY_PORT}")
    assert TrainConfig().engine.policy_url == EvalConfig().engine.policy_url == POLICY_URL
