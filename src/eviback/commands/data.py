"""Validate and convert data files.

  eviback data validate FILE [--corpus] [--skip-bad]   check a QA (or corpus) file, report bad lines
  eviback data convert IN OUT                          QA JSONL <-> Search-R1 parquet (by extension)
  eviback data suite [DIR]                             list a data suite's corpus, train and eval files
  eviback data prepare --train train.parquet --test test.parquet --corpus wiki-18.jsonl.gz --out DIR
                       [--faiss-index e5_Flat.index --model e5-base-v2]
                                                       Search-R1's release files -> a data suite in DIR

`validate` stops at the first malformed line (exit 2) or, with --skip-bad, reports every one (exit 1). It
also prints a warning, by file and line, for each gold answer that SQuAD normalisation empties (`A+`, `The
The`, `*`): the file is still valid (exit 0), since the metrics score such a gold in its plain form (`a+`),
which only the same text matches; but a stray one (`)`, `---`) is a data error to fix at its source.

`prepare` splits the question files by `data_source` (the merged test.parquet gives the seven benchmarks),
links the corpus in (checked line by line), imports the FAISS index with `--faiss-index` (the options of
`eviback index import-faiss`), and writes suite.json last. A rerun skips the parts done from the same inputs
and redoes those whose inputs changed; a malformed line stops it with its file and line (exit 2), leaving no
suite.json. See docs/data.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from eviback import data
from eviback.retrieval.config import FaissImportConfig, add_config_arguments, config_from_arguments

HELP = "validate and convert QA / corpus files (FlashRAG JSONL, Search-R1 parquet); prepare a data suite"
PREPARE_DOC = """Turn Search-R1's release files into a data suite (see docs/data.md).

  eviback data prepare --train nq_hotpotqa_train/train.parquet --test nq_hotpotqa_train/test.parquet \\
      --corpus wiki-18.jsonl.gz --out suites/search-r1 [--faiss-index e5_Flat.index --model e5-base-v2]

writes DIR/train/<data_source>.jsonl, DIR/eval/<benchmark>.jsonl (the merged test.parquet split by its
data_source), DIR/corpus.jsonl.gz (a hard link to the corpus, checked line by line), DIR/index/ (with
--faiss-index, imported as `eviback index import-faiss` does) and DIR/suite.json, last. Ids become
<data_source>_<id>; training questions that are also evaluation questions are left out and counted.
A rerun skips each part done from the same inputs (path, size, modification time) and redoes those whose
inputs changed; a malformed line stops it with its file and line (exit 2), leaving no suite.json.
"""


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
    _add_prepare_arguments(sub.add_parser(
        "prepare", help="turn Search-R1's release (train/test parquet, wiki-18 corpus, e5_Flat.index) into a data "
        "suite", description=PREPARE_DOC, formatter_class=argparse.RawDescriptionHelpFormatter))


def _add_prepare_arguments(parser: argparse.ArgumentParser) -> None:
    from eviback.prepare import CORPUS_LINKS, PrepareConfig

    helps = {f.name: f.metadata["help"] for f in dataclasses.fields(PrepareConfig)}
    parser.add_argument("--train", nargs="+", action="extend", default=[], metavar="FILE", help=helps["train"])
    parser.add_argument("--test", nargs="+", action="extend", default=[], metavar="FILE", help=helps["test"])
    parser.add_argument("--corpus", required=True, metavar="FILE", help=helps["corpus"])
    parser.add_argument("--out", required=True, metavar="DIR", help=helps["out"])
    parser.add_argument("--faiss-index", default="", metavar="FILE", help=helps["faiss_index"])
    parser.add_argument("--corpus-link", choices=CORPUS_LINKS, default="hard", help=helps["corpus_link"])
    parser.add_argument("--redo", action="store_true", help=helps["redo"])
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    add_config_arguments(parser.add_argument_group(
        "index import (with --faiss-index; the options of `eviback index import-faiss`)"), FaissImportConfig)


def run(args: argparse.Namespace) -> int:
    if args.data_command == "prepare":
        return _prepare(args)
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


def _prepare(args: argparse.Namespace) -> int:
    from eviback.prepare import PrepareConfig, prepare

    # FAISS's and torch's OpenMP threads spin while idle and steal a small machine's cores (index_import.py).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if args.model and not args.faiss_index:
        raise ValueError("--model is the encoder of the FAISS index to import: give --faiss-index too")
    config = PrepareConfig(out=args.out, corpus=args.corpus, train=tuple(args.train), test=tuple(args.test),
                           faiss_index=args.faiss_index, corpus_link=args.corpus_link, redo=args.redo)
    result = prepare(config, config_from_arguments(FaissImportConfig, args), progress=args.progress)
    suite = data.load_suite(result.suite)
    print(f"suite {result.suite}: {len(suite.train)} training file(s), {len(suite.eval)} benchmark(s) "
          f"({', '.join(suite.eval)}); list it with `eviback data suite {result.suite}`")
    if result.part("index") is not None:
        print(f"serve its index with `eviback serve {result.suite / 'index'}`")
    return 0
