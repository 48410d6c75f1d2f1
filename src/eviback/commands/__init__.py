"""One module per `eviback` subcommand: `HELP`, `add_arguments(parser)`, `run(args) -> int`.

Modules here stay thin: they parse arguments and call the library. Heavy imports happen inside `run`."""

from __future__ import annotations

import argparse

from eviback.protocol import CHAT_TEMPLATES, PromptStyle


def add_prompt_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """`--chat-template` and `--chat-template-kwargs`: the prompt style (`eviback.protocol.PromptStyle`) of the
    commands that build the actor's prompt (`eviback eval`, `eviback sft`; `eviback train` sets the same two
    with `--set`)."""
    parser.add_argument("--chat-template", choices=CHAT_TEMPLATES, default=PromptStyle().chat_template,
                        help="auto: the Search-R1 prompt through the tokenizer's chat template; none: the plain "
                             "prompt, no template (Search-R1's prompt for base models) (default: %(default)s)")
    parser.add_argument("--chat-template-kwargs", default=None, metavar="MAPPING",
                        help="the chat template's own switches, as YAML or JSON, e.g. '{enable_thinking: false}' for "
                             "Qwen3 (with --chat-template auto)")


def prompt_from_args(args: argparse.Namespace) -> PromptStyle:
    """The prompt style of `add_prompt_arguments`' options; raises ValueError naming the option when its value
    is not a mapping, or the style is not one (see PromptStyle)."""
    import yaml

    kwargs = {}
    if args.chat_template_kwargs is not None:
        try:
            kwargs = yaml.safe_load(args.chat_template_kwargs)
        except yaml.YAMLError as e:
            raise ValueError(f"--chat-template-kwargs {args.chat_template_kwargs!r} is not YAML or JSON "
                             f"({getattr(e, 'problem', None) or type(e).__name__})") from None
        if not isinstance(kwargs, dict):
            raise ValueError(f"--chat-template-kwargs takes a mapping such as '{{enable_thinking: false}}', got "
                             f"{args.chat_template_kwargs!r}")
    return PromptStyle(chat_template=args.chat_template, chat_template_kwargs=kwargs)
