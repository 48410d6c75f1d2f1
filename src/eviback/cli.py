"""The `eviback` command line: one subcommand per job, each defined in `eviback.commands.<name>`.

Subcommand modules are imported only when their command runs (or when `--help` lists them), so that a
quick command never pays for importing torch. Each module defines `HELP`, `add_arguments(parser)` and
`run(args) -> int`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys
from collections.abc import Callable
from types import ModuleType

from eviback.disk import full_disk_error
from eviback.log_format import configure_logging
from eviback.unavailable import RESUMABLE_EXIT

# name -> module under eviback.commands; the order is the order of `eviback --help`
COMMANDS = ("demo", "data", "index", "serve", "serve-policy", "eval", "judge", "build-judge", "sft", "train", "experiment", "ape",
            "report")
# `eviback COMMAND WORD ...` run by their own module: (command, word) -> module under eviback.commands
SUBCOMMANDS = {("index", "import-faiss"): "index_import"}


def _load(name: str) -> ModuleType:
    return importlib.import_module(f"eviback.commands.{name.replace('-', '_')}")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eviback",
        description="Search-agent RL with evidence-constrained teacher backoff.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        if only is not None and name != only:
            sub.add_parser(name, add_help=False)
            continue
        module = _load(name)
        command = sub.add_parser(name, help=module.HELP, description=module.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(command)
    return parser


def _subcommand(argv: list[str]) -> tuple[str, list[str], list[str]] | None:
    """(module, options before the command, arguments after the word) when argv names a SUBCOMMANDS entry."""
    words = [i for i, a in enumerate(argv) if not a.startswith("-")]
    if len(words) >= 2 and (argv[words[0]], argv[words[1]]) in SUBCOMMANDS and words[1] == words[0] + 1:
        return SUBCOMMANDS[argv[words[0]], argv[words[1]]], argv[:words[0]], argv[words[1] + 1:]
    return None


def _run_subcommand(module_name: str, name: str, before: list[str], rest: list[str]) -> int:
    module = _load(module_name)
    parser = argparse.ArgumentParser(prog=f"eviback {name}", description=module.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    module.add_arguments(parser)
    args = parser.parse_args(before + rest)
    configure_logging(logging.DEBUG if args.verbose else logging.INFO)
    return _run(module.run, args, name)


def _run(run: Callable[[argparse.Namespace], int | None], args: argparse.Namespace, name: str) -> int:
    """A command's exit status: bad input of the user's is said (what and where) without a traceback
    (`-v` shows it), exit 2; Ctrl-C exits 130."""
    try:
        return int(run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, FileExistsError, PermissionError) as e:
        if args.verbose:
            raise
        print(f"eviback {name}: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a full disk is not a bug: said in one line (eviback train says more, and how to resume)
        full = full_disk_error(e)
        if full is None or args.verbose:
            raise
        print(f"eviback {name}: the disk is full ({type(full).__name__}: {full}); free space and run the same "
              "command again (-v shows where it was writing)", file=sys.stderr)
        return RESUMABLE_EXIT


def main(argv: list[str] | None = None) -> int:
    """The `eviback` command. A reader that stops early (`eviback data suite | head -1`) ends it quietly, as
    it ends `cat`: exit 141 (128 + SIGPIPE), no traceback."""
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, not at exit, so that a closed pipe is caught below
        return code
    except BrokenPipeError:
        with contextlib.suppress(OSError, ValueError):  # nothing more can be written: keep the interpreter's
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # last flush from failing again
        return 141


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    sub = _subcommand(argv)
    if sub is not None:
        module_name, before, rest = sub
        name = next(f"{c} {w}" for (c, w), m in SUBCOMMANDS.items() if m == module_name)
        return _run_subcommand(module_name, name, before, rest)
    # Build only the chosen subcommand's arguments, so `eviback serve ...` imports nothing else.
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(only=chosen if chosen in COMMANDS else None)
    args = parser.parse_args(argv)
    configure_logging(logging.DEBUG if args.verbose else logging.INFO)
    if args.command is None:
        parser.print_help()
        return 2
    return _run(lambda a: _load(args.command).run(a), args, args.command)  # loading inside: its errors too


if __name__ == "__main__":
    raise SystemExit(main())
