"""From Search-R1's public release to a data suite: the logic of `eviback data prepare`.

The inputs are the files as downloaded: training questions (Search-R1's `nq_hotpotqa_train/train.parquet`),
evaluation questions (its merged seven-benchmark `test.parquet`, or FlashRAG JSONL files), the wiki-18
corpus (`wiki-18.jsonl` or `.jsonl.gz`) and, optionally, its FAISS flat index (`e5_Flat.index`) with the
encoder it was built with. The output is a directory that :func:`eviback.data.load_suite` reads:

    OUT/train/<data_source>.jsonl   training questions (FlashRAG JSONL), one file per data_source
    OUT/eval/<benchmark>.jsonl      evaluation questions, one file per benchmark (per data_source)
    OUT/corpus.jsonl[.gz]           the corpus: a hard link to the input file (or a copy, or a symbolic link)
    OUT/index/                      the FAISS index, imported by eviback.retrieval.imported.import_faiss
    OUT/prepare.json                what each part was made from (see below)
    OUT/suite.json                  written last

A question file is split by its rows' `data_source` (a file without one is one benchmark, named by its
stem), so the merged `test.parquet` gives the seven benchmarks. A question's id in the suite is
`<data_source>_<release id>`: Search-R1's files reuse FlashRAG's ids (`train_0`, `test_0`) in every data
source, and a suite's ids must be unique across its files (training files are merged by id). A training
question whose id or normalised text is also an evaluation question is left out and counted, so the
training files pass :func:`eviback.data.check_no_eval_overlap`.

Everything streams: parquet files are read by batches of rows, the corpus line by line. The corpus is
checked line by line, then linked rather than copied (wiki-18 is 14 GB compressed): a hard link where the
file system allows (else a copy), a copy, or a symbolic link, as `corpus_link` says; a corpus in the
`{"id", "title", "text"}` layout is rewritten as `{"id", "contents"}` lines.

The work is four parts, in order: eval, train (which needs eval's files to leave out overlaps), corpus,
index. Each part writes under `OUT/.partial/` and renames its files into place when it has finished, then
records in `prepare.json` the signature of its inputs (path, size and modification time of each file,
and its options). A rerun skips a part whose record matches and whose files are there, and redoes one
whose inputs changed; a failed run resumes at the part that failed. `suite.json` is removed when a run
starts and written when it ends, so it exists only after a run that succeeded.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import shutil
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from tqdm import tqdm

from eviback import data
from eviback.cache import cache_dir, file_lock
from eviback.metrics import normalize_answer
from eviback.retrieval.config import FaissImportConfig
from eviback.settings import check_fields
from eviback.types import Question

MANIFEST = "prepare.json"
SUITE_FILE = "suite.json"
PARTIAL = ".partial"
TRAIN_DIR = "train"
EVAL_DIR = "eval"
INDEX_DIR = "index"
CORPUS_LINKS = ("hard", "copy", "symlink")
MANIFEST_FORMAT = 1
# Search settings of an imported index: changing them rewrites its manifest, it does not re-import it.
SEARCH_PARAMS = ("nprobe", "rerank")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\Z")  # a data_source that can name a file
_SHOWN_WARNINGS = 5  # per part; the rest are counted


def _help(text: str, **kwargs: Any) -> Any:
    return field(metadata={"help": text}, **kwargs)


@dataclass(frozen=True)
class PrepareConfig:
    """What `eviback data prepare` reads and where it writes. Paths are files as downloaded."""

    out: str = _help("suite directory to write (created; a rerun into it skips the parts already done)",
                     default="")
    corpus: str = _help("corpus JSONL or JSONL.gz, `{'id', 'contents'}` lines (Search-R1's wiki-18.jsonl.gz)",
                        default="")
    train: tuple[str, ...] = _help("training question files: Search-R1 parquet (nq_hotpotqa_train/train.parquet) "
                                   "or JSONL; split by data_source into train/<data_source>.jsonl", default=())
    test: tuple[str, ...] = _help("evaluation question files: Search-R1's merged test.parquet (split by "
                                  "data_source into eval/<benchmark>.jsonl) or FlashRAG JSONL (one benchmark "
                                  "per file, named by its stem, unless its lines carry a data_source)",
                                  default=())
    faiss_index: str = _help("FAISS flat index of the corpus to import into index/ (Search-R1's e5_Flat.index; "
                             "needs --model)", default="")
    corpus_link: str = _help("how the corpus gets into the suite when it is already {'id', 'contents'} lines: "
                             "hard (a hard link, a copy where the file system refuses one), copy, or symlink",
                             default="hard")
    redo: bool = _help("redo every part, even those done from the same inputs", default=False)

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.out:
            raise ValueError("give the suite directory to write: --out DIR")
        if not self.corpus:
            raise ValueError("give the corpus: --corpus wiki-18.jsonl.gz (a suite needs one)")
        if not self.train and not self.test:
            raise ValueError("give question files: --train train.parquet and/or --test test.parquet")
        if self.corpus_link not in CORPUS_LINKS:
            raise ValueError(f"unknown corpus_link (--corpus-link) {self.corpus_link!r}; choose one of "
                             f"{', '.join(CORPUS_LINKS)}")


@dataclass(frozen=True)
class PartResult:
    """One part of a run: `name` (eval, train, corpus, index), whether it was skipped (done before from the
    same inputs), the files it holds (relative to the suite) and a one-line summary."""

    name: str
    skipped: bool
    outputs: tuple[str, ...]
    summary: str


@dataclass(frozen=True)
class PrepareResult:
    """A finished run: the suite directory (its suite.json written) and its parts, in the order run."""

    suite: Path
    parts: tuple[PartResult, ...]

    def part(self, name: str) -> PartResult | None:
        return next((p for p in self.parts if p.name == name), None)


Say = Callable[[str], None]


# --------------------------------------------------------------------------------------------------
# The run


def prepare(config: PrepareConfig, index_config: FaissImportConfig | None = None, *, progress: bool = True,
            say: Say = print) -> PrepareResult:
    """Write (or bring up to date) the suite `config.out` from the release files of `config`; return what
    each part did. `index_config` sets the FAISS import (`model` required with `config.faiss_index`).
    `say` receives one line per part as it finishes (and a few warnings).

    Refused before any work: a missing input file, an index without an encoder, an `out` that holds
    something that is not a suite this function wrote. A malformed line stops the run with a DataError
    naming its file and line (or parquet row); the part it was in leaves nothing behind, the parts done
    before it stay done (and are skipped by the next run), and there is no suite.json."""
    out = Path(config.out)
    inputs = [Path(p) for p in (*config.train, *config.test, config.corpus)]
    if config.faiss_index:
        inputs.append(Path(config.faiss_index))
        index_config = index_config or FaissImportConfig()
        if not index_config.model:
            raise ValueError("give the encoder the FAISS index was built with: --model DIR, a local model "
                             "directory (for Search-R1's e5_Flat.index, a download of intfloat/e5-base-v2)")
        index_config = replace(index_config, model=str(Path(index_config.model).resolve()))
    missing = [str(p) for p in inputs if not p.is_file()]
    if index_config is not None and config.faiss_index and not Path(index_config.model).is_dir():
        missing.append(f"{index_config.model} (the --model directory)")
    if missing:
        raise FileNotFoundError(f"input file(s) not found: {', '.join(missing)}")
    _check_out(out)
    lock = cache_dir() / "locks" / f"prepare-{hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:16]}.lock"
    with file_lock(lock):
        out.mkdir(parents=True, exist_ok=True)
        (out / SUITE_FILE).unlink(missing_ok=True)  # a run that fails leaves no suite.json
        manifest = _read_manifest(out)
        _write_manifest(out, manifest)  # marks the directory as a suite prepare writes, from the start
        parts = _Parts(out, manifest, redo=config.redo, say=say)
        try:
            tests = [Path(p) for p in config.test]
            trains = [Path(p) for p in config.train]
            eval_part = train_part = index_part = None
            if tests:
                eval_part = parts.run("eval", {"inputs": _signatures(tests)},
                                      lambda stage: _write_eval(tests, stage, progress=progress, say=say))
            if trains:
                eval_files = {Path(p).stem: out / p for p in (eval_part.outputs if eval_part else ())}
                key = {"inputs": _signatures(trains), "eval": _signatures(tests)}
                train_part = parts.run("train", key, lambda stage: _write_train(
                    trains, eval_files, stage, progress=progress, say=say))
            corpus = Path(config.corpus)
            corpus_key = {"inputs": _signatures([corpus]), "link": config.corpus_link}
            corpus_part = parts.run("corpus", corpus_key, lambda stage: _place_corpus(
                corpus, stage, config.corpus_link, progress=progress))
            if config.faiss_index:
                assert index_config is not None
                index_part = _run_index(parts, Path(config.faiss_index), out / corpus_part.outputs[0],
                                        corpus_key, index_config, progress=progress)
        finally:
            shutil.rmtree(out / PARTIAL, ignore_errors=True)
        for name, part in (("eval", eval_part), ("train", train_part), ("index", index_part)):
            if part is None and name in manifest["parts"]:
                say(f"{name}: not asked for this time; its files from an earlier run are kept but not listed in "
                    f"{SUITE_FILE}")
        spec = {
            "corpus": corpus_part.outputs[0],
            "train": list(train_part.outputs) if train_part else [],
            "eval": {Path(p).stem: p for p in _benchmark_order(eval_part.outputs if eval_part else ())},
        }
        _write_json(out / SUITE_FILE, spec)
        return PrepareResult(out, tuple(p for p in (eval_part, train_part, corpus_part, index_part) if p))


def _check_out(out: Path) -> None:
    """Refuse an `out` that exists and is not a suite directory this module wrote (it would be mixed into)."""
    if not out.exists():
        return
    if not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory: choose another --out")
    if not (out / MANIFEST).exists() and any(p.name != PARTIAL for p in out.iterdir()):
        raise FileExistsError(f"{out} exists, is not empty and was not written by `eviback data prepare` (no "
                              f"{MANIFEST}): choose another --out, or empty it")


class _Parts:
    """Runs the parts of one run against the manifest: skips a part done from the same inputs, else makes
    it in a staging directory and renames its files into place, then records it."""

    def __init__(self, out: Path, manifest: dict[str, Any], *, redo: bool, say: Say) -> None:
        self.out, self.manifest, self.redo, self.say = out, manifest, redo, say

    def recorded(self, name: str) -> Mapping[str, Any] | None:
        return self.manifest["parts"].get(name)

    def is_done(self, name: str, key: Mapping[str, Any]) -> bool:
        record = self.recorded(name)
        return (not self.redo and record is not None and record["key"] == _jsonable(key)
                and all((self.out / p).exists() for p in record["outputs"]))

    def run(self, name: str, key: Mapping[str, Any],
            make: Callable[[Path], tuple[list[str], str]]) -> PartResult:
        """`make(stage)` writes the part's files under `stage` at their paths relative to the suite and
        returns (those paths, a summary); a path it returns but did not write under `stage` is one it wrote
        in place itself (the index import does its own staging)."""
        if self.is_done(name, key):
            record = self.recorded(name)
            assert record is not None
            self.say(f"{name}: skipped, done from the same inputs: {record['summary']}")
            return PartResult(name, True, tuple(record["outputs"]), record["summary"])
        stage = self.out / PARTIAL / name
        shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir(parents=True)
        try:
            outputs, summary = make(stage)
            for rel in outputs:
                if (stage / rel).exists() or (stage / rel).is_symlink():
                    (self.out / rel).parent.mkdir(parents=True, exist_ok=True)
                    _remove(self.out / rel)
                    os.replace(stage / rel, self.out / rel)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        previous = self.recorded(name)
        for rel in previous["outputs"] if previous else ():
            if rel not in outputs:
                _remove(self.out / rel)  # e.g. a benchmark the new inputs no longer have
        self.manifest["parts"][name] = {"key": _jsonable(key), "outputs": list(outputs), "summary": summary}
        _write_manifest(self.out, self.manifest)
        self.say(f"{name}: done: {summary}")
        return PartResult(name, False, tuple(outputs), summary)


def _run_index(parts: _Parts, flat: Path, corpus: Path, corpus_key: Mapping[str, Any], config: FaissImportConfig,
               *, progress: bool) -> PartResult:
    """The index part: import_faiss into OUT/index. Keyed on the corpus part's inputs (not the suite's
    corpus file, whose modification time a copy changes), the flat file and the import settings; only the
    search settings changed updates the index's manifest in place, anything else re-imports."""
    from eviback.retrieval.imported import describe, import_faiss

    params = config.index_params()
    key = {"flat": _signatures([flat]), "corpus": corpus_key["inputs"], "params": params,
           "search": {name: getattr(config, name) for name in SEARCH_PARAMS}}
    record = parts.recorded("index")
    rebuild = parts.redo or record is None or any(record["key"].get(k) != _jsonable(key[k])
                                                  for k in ("flat", "corpus", "params"))

    def make(stage: Path) -> tuple[list[str], str]:
        manifest = import_faiss(flat, corpus, parts.out / INDEX_DIR, config, force=rebuild, progress=progress)
        return [INDEX_DIR], describe(manifest)

    return parts.run("index", key, make)


# --------------------------------------------------------------------------------------------------
# Questions


def iter_question_file(path: str | os.PathLike) -> Iterator[tuple[int, str, Question]]:
    """(row or line number, benchmark name, question) per question of a file, streaming.

    A `.parquet` file is Search-R1's layout (:func:`eviback.data.iter_search_r1_parquet`); any other file is
    JSONL whose lines are Search-R1 rows (they have `reward_model`) or FlashRAG objects (`id`, `question`,
    `golden_answers`). The name is the row's `data_source` where it has one, else the file's stem. A bad
    row raises DataError naming the file and the row (parquet, 1-based) or line."""
    path = Path(path)
    stem = _file_stem(path)
    if path.name.endswith(".parquet"):
        for number, question in enumerate(data.iter_search_r1_parquet(path), start=1):
            yield number, _checked_name(question.dataset or stem, path, number), question
        return
    for number, obj in data.iter_json_lines(path):
        if isinstance(obj, dict) and "reward_model" in obj:
            question = data.search_r1_row_to_question(obj, path, number)
        else:
            question = data.question_from_json(obj, path, number)
        source = obj.get("data_source") if isinstance(obj, dict) else None
        yield number, _checked_name(str(source) if source else stem, path, number), question


def in_suite(question: Question, name: str) -> Question:
    """`question` as the suite holds it: dataset `name`, id `<name>_<release id>` (unchanged when it already
    starts so, as Search-R1's fallback ids `<data_source>_<index>` and an earlier suite's ids do)."""
    qid = question.id if question.id.startswith(f"{name}_") else f"{name}_{question.id}"
    return replace(question, id=qid, dataset=name)


def _file_stem(path: Path) -> str:
    name = path.name
    for suffix in (".gz", ".jsonl", ".json", ".parquet"):
        name = name.removesuffix(suffix)
    return name


def _checked_name(name: str, path: Path, number: int) -> str:
    if not _NAME.match(name):
        raise data.DataError(path, number, f"data_source {name!r} cannot name a file of the suite: use letters, "
                                           "digits, '_', '-' and '.'")
    return name


class _QuestionFiles:
    """Questions written to one JSONL file per name, `directory/<name>.jsonl`, opened as names appear.
    A duplicate id within a name is a DataError naming both places."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.files: dict[str, IO[str]] = {}
        self.first: dict[str, dict[str, str]] = {}  # name -> id -> "file:row" where it was first seen
        self.counts: Counter[str] = Counter()

    def write(self, name: str, question: Question, path: Path, number: int) -> None:
        seen = self.first.setdefault(name, {})
        if question.id in seen:
            raise data.DataError(path, number, f"duplicate id {question.id!r} in {name} (first at {seen[question.id]})")
        seen[question.id] = f"{path}:{number}"
        if name not in self.files:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.files[name] = data.open_text(self.directory / f"{name}.jsonl", "w")
        self.files[name].write(json.dumps(data.question_to_json(question), ensure_ascii=False) + "\n")
        self.counts[name] += 1

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def _question_rows(paths: Iterable[Path], desc: str, *, progress: bool) -> Iterator[tuple[Path, int, str, Question]]:
    for path in paths:
        total = data.parquet_rows(path) if path.name.endswith(".parquet") else None
        with tqdm(total=total, desc=f"{desc} {path.name}", unit=" rows", disable=not progress,
                  mininterval=1.0) as bar:
            for number, name, question in iter_question_file(path):
                yield path, number, name, question
                bar.update(1)


def _write_questions(paths: list[Path], stage: Path, folder: str, desc: str, *, keep: Callable[[Question], bool],
                     progress: bool, say: Say) -> tuple[list[str], Counter[str], list[str], list[str]]:
    """Write the questions of `paths` (those `keep` accepts) to `stage/folder/<name>.jsonl`; return (the
    files, relative to the suite, in name order; the count per name; the ids left out; gold warnings)."""
    files = _QuestionFiles(stage / folder)
    left_out: list[str] = []
    warnings: list[str] = []
    try:
        for path, number, name, question in _question_rows(paths, desc, progress=progress):
            question = in_suite(question, name)
            if not keep(question):
                left_out.append(question.id)
                continue
            warnings.extend(data.gold_warnings(question, path, number))
            files.write(name, question, path, number)
    finally:
        files.close()
    for message in warnings[:_SHOWN_WARNINGS]:
        say(f"warning: {message}")
    if len(warnings) > _SHOWN_WARNINGS:
        say(f"warning: ... and {len(warnings) - _SHOWN_WARNINGS} more gold answer(s) that normalise to nothing "
            f"(`eviback data validate FILE` lists them all)")
    names = sorted(files.counts)
    if not names:
        raise data.DataError(paths[0], None, "no questions in " + ", ".join(str(p) for p in paths))
    return [f"{folder}/{n}.jsonl" for n in names], files.counts, left_out, warnings


def _counts(counts: Counter[str], order: Iterable[str]) -> str:
    total = sum(counts.values())
    return f"{len(counts)} file(s), {total:,} questions ({', '.join(f'{n} {counts[n]:,}' for n in order)})"


def _write_eval(paths: list[Path], stage: Path, *, progress: bool, say: Say) -> tuple[list[str], str]:
    outputs, counts, _, warnings = _write_questions(paths, stage, EVAL_DIR, "eval", keep=lambda q: True,
                                                    progress=progress, say=say)
    names = [Path(p).stem for p in _benchmark_order(outputs)]
    unusual = [n for n in names if n not in data.BENCHMARKS]
    summary = _counts(counts, names).replace("file(s)", "benchmark(s)")
    if unusual:
        summary += f"; not one of Search-R1's seven: {', '.join(unusual)}"
    return outputs, summary + _warned(warnings)


def _write_train(paths: list[Path], eval_files: Mapping[str, Path], stage: Path, *, progress: bool,
                 say: Say) -> tuple[list[str], str]:
    suite = data.DataSuite(root=stage, corpus=stage, train=(), eval=dict(eval_files))
    ids, texts = data.eval_question_keys(suite)
    outputs, counts, left_out, warnings = _write_questions(
        paths, stage, TRAIN_DIR, "train", keep=lambda q: q.id not in ids and normalize_answer(q.question) not in texts,
        progress=progress, say=say)
    summary = _counts(counts, sorted(counts))
    if left_out:
        summary += (f"; left out {len(left_out):,} whose id or text is also an evaluation question "
                    f"(e.g. {', '.join(left_out[:3])})")
    return outputs, summary + _warned(warnings)


def _warned(warnings: list[str]) -> str:
    return f"; {len(warnings)} gold answer(s) that normalise to nothing (kept, see the warnings)" if warnings else ""


def _benchmark_order(outputs: Iterable[str]) -> list[str]:
    """Search-R1's seven benchmarks in their usual order (single-hop, then multi-hop), then any others."""
    rank = {name: i for i, name in enumerate(data.BENCHMARKS)}
    return sorted(outputs, key=lambda p: (rank.get(Path(p).stem, len(rank)), Path(p).stem))


# --------------------------------------------------------------------------------------------------
# Corpus


def check_corpus(path: str | os.PathLike, *, progress: bool = False) -> tuple[int, bool]:
    """(passages, whether every line is already `{"id", "contents"}`) of a corpus JSONL(.gz), read line by
    line and parsed as :func:`eviback.data.iter_corpus` parses it, with a progress bar over the file's bytes.
    The first bad line raises DataError naming the file and line; so do a line that is not UTF-8, a gzip
    stream that is corrupt or cut short (a download that stopped early), and a corpus with no passages.
    (Lines are split at "\\n" only; a stray carriage return is white space to JSON.)"""
    path = Path(path)
    passages, contents_layout, number = 0, True, 0
    with open(path, "rb") as raw, tqdm(total=path.stat().st_size, desc=f"check corpus {path.name}", unit="B",
                                       unit_scale=True, disable=not progress, mininterval=1.0) as bar:
        # Bytes, decoded line by line: a text stream decodes blocks ahead and would blame the wrong line.
        stream: IO[bytes] = gzip.GzipFile(fileobj=raw) if path.name.endswith(".gz") else raw
        try:
            for number, chunk in enumerate(stream, start=1):
                try:
                    line = chunk.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise data.DataError(path, number, f"not UTF-8 text (byte {e.start + 1} of the line: "
                                         f"{e.reason})") from None
                if line.strip():
                    obj = data.parse_json_line(line, path, number)
                    data.passage_from_json(obj, path, number)
                    contents_layout = contents_layout and "contents" in obj
                    passages += 1
                if number % 16384 == 0:
                    bar.update(raw.tell() - bar.n)
        except (gzip.BadGzipFile, EOFError, zlib.error) as e:
            raise data.DataError(path, number + 1, f"the gzip stream is corrupt or cut short ({e}): download "
                                 "the file again") from None
        bar.update(bar.total - bar.n)
    if not passages:
        raise data.DataError(path, None, "the corpus has no passages")
    return passages, contents_layout


def _place_corpus(corpus: Path, stage: Path, how: str, *, progress: bool) -> tuple[list[str], str]:
    passages, contents_layout = check_corpus(corpus, progress=progress)
    if not contents_layout:
        name = "corpus.jsonl"
        data.write_corpus(stage / name, data.iter_corpus(corpus))
        return [name], f"{passages:,} passages, rewritten from {corpus} as {{'id', 'contents'}} lines"
    name = "corpus.jsonl.gz" if corpus.name.endswith(".gz") else "corpus.jsonl"
    source = corpus.resolve()
    if how == "symlink":
        os.symlink(source, stage / name)
        return [name], f"{passages:,} passages, a symbolic link to {source}"
    note = ""
    if how == "hard":
        try:
            os.link(source, stage / name)
            return [name], f"{passages:,} passages, a hard link to {source} (no copy)"
        except OSError as e:  # another file system, or one without hard links
            note = f" (a hard link was refused: {e.strerror})"
    _copy(source, stage / name, progress=progress)
    return [name], f"{passages:,} passages, copied from {source}{note}"


def _copy(src: Path, dst: Path, *, progress: bool) -> None:
    with open(src, "rb") as f, open(dst, "wb") as g, tqdm(total=src.stat().st_size, desc=f"copy {src.name}",
                                                          unit="B", unit_scale=True, disable=not progress,
                                                          mininterval=1.0) as bar:
        for block in iter(lambda: f.read(8 << 20), b""):
            g.write(block)
            bar.update(len(block))


# --------------------------------------------------------------------------------------------------
# Files


def file_signature(path: Path) -> dict[str, Any]:
    """How a rerun recognises an input: its resolved path, size and modification time. (Hashing would read
    the 80 GB of the release on every run; a file replaced by another of the same size and time is missed,
    which `redo` covers.)"""
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _signatures(paths: Iterable[Path]) -> list[dict[str, Any]]:
    return [file_signature(p) for p in paths]


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value))  # as the manifest stores it (tuples become lists)


def _read_manifest(out: Path) -> dict[str, Any]:
    path = out / MANIFEST
    if not path.exists():
        return {"format": MANIFEST_FORMAT, "parts": {}}
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError:
        manifest = None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return {"format": MANIFEST_FORMAT, "parts": {}}  # unreadable: every part is redone
    return manifest


def _write_manifest(out: Path, manifest: Mapping[str, Any]) -> None:
    _write_json(out / MANIFEST, manifest)


def _write_json(path: Path, value: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    os.replace(tmp, path)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
