"""Validate and convert data files.

  eviback data validate FILE [--corpus] [--skip-bad]   check a QA (or corpus) file, report bad lines
  eviback data convert IN OUT                          QA JSONL <-> Search-R1 parquet (by extension)
  eviback data suite [DIR]                             list a data suite's corpus, train and eval files

`validate` stops at the first malformed line (exit 2) or, with --skip-bad, reports every one (exit 1). It
also prints a warning, by file and line, for each gold answer that SQuAD normalisation empties (`A+`, `The
The`, `*`): the file is still valid (exit 0), since the metrics score such a gold in its plain form (`a+`),
which only the same text matches; but a stray one (`)`, `---`) is a data error to fix at its source.
"""

from __future__ import annotations

import argparse

from eviback import data

HELP = "validate and convert QA / corpus files (FlashRAG JSONL, Search-R1 parquet)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    validate = sub.add_parser("validate", help="check a QA file (or a corpus with --corpus); gold answers that "
                              "normalise to nothing are warned about by file:line")
    validate.add_argument("path")
    validate.add_argument("--corpus", action="store_true", help="the file is a corpus JSONL")
    validate.add_argument("--skip-bad", action="store_true", help="report every bad line instead of stopping")
    convert = sub.add_parser("convert", help="convert QA JSONL <-> Search-R1 parquet, by file extension")
    convert.add_argument("src")
    convert.add_argument("dst")
    convert.add_argument("--skip-bad", action="store_true", help="skip malformed lines (they are counted)")
    suite = sub.add_parser("suite", help="show the files of a data suite (default: the embedded one)")
    suite.add_argument("root", nargs="?")


def run(args: argparse.Namespace) -> int:
    if args.data_command == "suite":
        s = data.load_suite(args.root)
        print(f"root:   {s.root}\ncorpus: {s.corpus}")
        for path in s.train:
            print(f"train:  {path}")
        for name, path in s.eval.items():
            print(f"eval:   {name:16s} {path}")
        return 0
    report = data.ReadReport()
    if args.data_command == "validate":
        if args.corpus:
            for _ in data.iter_corpus(args.path, skip_bad=args.skip_bad, report=report):
                pass
        else:
            data.read_questions(args.path, skip_bad=args.skip_bad, report=report)
    else:
        questions = data.read_questions(args.src, skip_bad=args.skip_bad, report=report)
        data.write_questions(args.dst, questions)
        print(f"wrote {len(questions)} questions to {args.dst}")
    for message in report.skipped:
        print(f"skipped: {message}")
    for message in report.warnings:
        print(f"warning: {message}")
    warnings = f", {len(report.warnings)} warning(s)" if report.warnings else ""
    print(f"{report.read} records ok, {len(report.skipped)} skipped{warnings}")
    return 1 if report.skipped and args.data_command == "validate" else 0
