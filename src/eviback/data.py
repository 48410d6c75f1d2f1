"""Data in and out: FlashRAG QA JSONL, corpus JSONL, Search-R1 training parquet, and data suites.

Every reader validates as it goes: a malformed line, a missing field or an empty answer list raises
:class:`DataError` naming the file, the line and the field. Nothing is skipped silently; with
`skip_bad=True` bad lines are skipped *and counted* (see :class:`ReadReport`). A line that is valid but
worth a look (a gold answer that SQuAD normalisation empties) is read and noted as a warning in the report,
with its file and line. Files ending in `.gz` are read and written compressed. Corpora are read streaming,
one line at a time.

A data suite (:class:`DataSuite`) keeps its training and evaluation questions apart, and the rules that
keep them apart live here: :func:`read_training_questions` leaves out any training question whose id or
text is also an evaluation question, :func:`check_no_eval_overlap` refuses such questions.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import IO, Any, TypeVar

from eviback.metrics import normalize_answer, plain_answer
from eviback.protocol import PROMPT_PREFIX, build_prompt
from eviback.types import Passage, Question

T = TypeVar("T")

log = logging.getLogger(__name__)


def _where(path: str | os.PathLike, line: int | None) -> str:
    return f"{path}:{line}" if line is not None else str(path)


class DataError(ValueError):
    """A data file is malformed. The message names the file, the line and the field."""

    def __init__(self, path: str | os.PathLike, line: int | None, message: str) -> None:
        super().__init__(f"{_where(path, line)}: {message}")
        self.path = str(path)
        self.line = line


@dataclass
class ReadReport:
    """How many records were read, which lines were skipped (only with `skip_bad=True`), and warnings about
    lines that were read (each message starts with `file:line`)."""

    read: int = 0
    skipped: list[str] = field(default_factory=list)  # the error message of each skipped line
    warnings: list[str] = field(default_factory=list)


def gold_warnings(question: Question, path: str | os.PathLike = "<memory>", number: int | None = None) -> list[str]:
    """One `file:line` message per gold answer of `question` that SQuAD normalisation empties (`A+`, `The
    The`, `*`, `)`). Such a gold is not an error: the metrics compare it in its plain form (`a+`; see
    :mod:`eviback.metrics`), so it matches only a prediction that is the same text, and a stray one (`)`,
    `---`) matches nothing useful. It is worth a look, so validation reports it."""
    return [f"{_where(path, number)}: question {question.id!r}: gold answer {g!r} is only punctuation and "
            f"articles; SQuAD normalisation leaves nothing, so it is scored in its plain form {plain_answer(g)!r}"
            for g in question.golden_answers if not normalize_answer(g)]


def open_text(path: str | os.PathLike, mode: str = "r") -> IO[str]:
    """Open a text file, transparently gzip-compressed when its name ends in `.gz`."""
    path = Path(path)
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, mode.replace("t", "") + "b"), encoding="utf-8")
    return open(path, mode, encoding="utf-8")


def numbered_lines(path: str | os.PathLike) -> Iterator[tuple[int, str | DataError]]:
    """(line number, text) per line of a UTF-8 file (gzip-compressed when named `.gz`), streaming. A line that
    is not UTF-8 comes as a DataError naming the file, the line and the byte, for the caller to raise or skip:
    the lines after it are still read."""
    path = Path(path)
    with gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield number, DataError(path, number, f"not UTF-8 text: byte 0x{raw[e.start]:02x} at column "
                                                      f"{e.start + 1} (convert the file to UTF-8)")


def parse_json_line(line: str, path: str | os.PathLike, number: int) -> Any:
    """The object on line `number` of `path`; invalid JSON raises DataError naming the file and line."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(path, number, f"invalid JSON ({e.msg} at column {e.colno})") from None


def iter_json_lines(path: str | os.PathLike) -> Iterator[tuple[int, Any]]:
    """(line number, parsed object) per non-blank line, streaming; raises DataError on invalid JSON."""
    for number, line in numbered_lines(path):
        if isinstance(line, DataError):
            raise line
        if line.strip():
            yield number, parse_json_line(line, path, number)


def _parse_lines(
    path: str | os.PathLike, parse: Callable[[Any, str | os.PathLike, int], T], *, skip_bad: bool,
    report: ReadReport,
) -> Iterator[T]:
    """`parse(object, path, line number)` per non-blank JSON line. A bad line (invalid JSON, or a DataError
    from `parse`) stops the read, or with `skip_bad` is skipped and recorded in `report`."""
    for number, line in numbered_lines(path):
        if not isinstance(line, DataError) and not line.strip():
            continue
        try:
            if isinstance(line, DataError):
                raise line
            record = parse(parse_json_line(line, path, number), path, number)
        except DataError as e:
            if not skip_bad:
                raise
            report.skipped.append(str(e))
            continue
        report.read += 1
        yield record


def _require_str(obj: dict, key: str, path, number: int, allow_empty: bool = False) -> str:
    if key not in obj:
        raise DataError(path, number, f"missing field {key!r}")
    value = obj[key]
    if isinstance(value, int) and not isinstance(value, bool) and key == "id":
        value = str(value)  # numeric ids are common in corpora; keep them as strings
    if not isinstance(value, str):
        raise DataError(path, number, f"field {key!r} must be a string, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise DataError(path, number, f"field {key!r} is empty")
    return value


def question_from_json(obj: Any, path: str | os.PathLike = "<memory>", number: int = 0) -> Question:
    """Validate one FlashRAG QA object and build a Question."""
    if not isinstance(obj, dict):
        raise DataError(path, number, f"expected a JSON object, got {type(obj).__name__}")
    qid = _require_str(obj, "id", path, number)
    text = _require_str(obj, "question", path, number)
    if "golden_answers" not in obj:
        raise DataError(path, number, "missing field 'golden_answers'")
    golds = obj["golden_answers"]
    if isinstance(golds, str):
        golds = [golds]
    if not isinstance(golds, list) or not all(isinstance(g, str | int | float) for g in golds):
        raise DataError(path, number, "field 'golden_answers' must be a list of strings")
    golds = [str(g) for g in golds if str(g).strip()]
    if not golds:
        raise DataError(path, number, "field 'golden_answers' is empty")
    metadata = obj.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise DataError(path, number, "field 'metadata' must be an object")
    return Question(
        id=qid,
        question=text,
        golden_answers=tuple(golds),
        dataset=str(obj.get("dataset", "")),
        split=str(obj.get("split", "")),
        metadata=metadata,
        source=str(obj.get("source", "")),
    )


def question_to_json(question: Question) -> dict[str, Any]:
    out: dict[str, Any] = {"id": question.id, "question": question.question,
                           "golden_answers": list(question.golden_answers)}
    if question.dataset:
        out["dataset"] = question.dataset
    if question.split:
        out["split"] = question.split
    if question.source:
        out["source"] = question.source
    if question.metadata:
        out["metadata"] = dict(question.metadata)
    return out


def read_questions(
    path: str | os.PathLike, *, skip_bad: bool = False, report: ReadReport | None = None
) -> list[Question]:
    """Read a FlashRAG QA JSONL file (or `.parquet` in Search-R1's layout). Duplicate ids are an error; gold
    answers that SQuAD normalisation empties are noted in `report.warnings` (see :func:`gold_warnings`)."""
    if str(path).endswith(".parquet"):
        return read_search_r1_parquet(path, report=report)
    seen: dict[str, int] = {}

    report = report if report is not None else ReadReport()

    def parse(obj: Any, path: str | os.PathLike, number: int) -> Question:
        question = question_from_json(obj, path, number)
        if question.id in seen:
            raise DataError(path, number, f"duplicate id {question.id!r} (first on line {seen[question.id]})")
        seen[question.id] = number
        report.warnings.extend(gold_warnings(question, path, number))
        return question

    return list(_parse_lines(path, parse, skip_bad=skip_bad, report=report))


def write_questions(path: str | os.PathLike, questions: Iterable[Question]) -> None:
    """Write FlashRAG QA JSONL (`.parquet` writes Search-R1's training layout instead)."""
    if str(path).endswith(".parquet"):
        write_search_r1_parquet(path, questions)
        return
    write_jsonl(path, (question_to_json(q) for q in questions))


def write_jsonl(path: str | os.PathLike, records: Iterable[Any]) -> None:
    """Write JSON objects one per line, atomically (a temporary file renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open_text(tmp, "w") if path.suffix != ".gz" else _gz_writer(tmp) as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def _gz_writer(path: Path) -> IO[str]:
    # mtime=0 keeps compressed files byte-identical across rebuilds
    return io.TextIOWrapper(gzip.GzipFile(filename=path, mode="wb", mtime=0), encoding="utf-8")


def read_jsonl(path: str | os.PathLike) -> Iterator[Any]:
    """Parsed objects of a JSONL file, streaming; invalid JSON raises DataError with file and line."""
    for _, obj in iter_json_lines(path):
        yield obj


# --------------------------------------------------------------------------------------------------
# Corpus


def iter_corpus(
    path: str | os.PathLike, *, skip_bad: bool = False, report: ReadReport | None = None
) -> Iterator[Passage]:
    """Stream a corpus JSONL (`{"id", "contents"}` with `contents = "Title"\\ntext`) as Passages.

    Also accepts `{"id", "title", "text"}` lines (the other common layout)."""
    report = report if report is not None else ReadReport()
    yield from _parse_lines(path, passage_from_json, skip_bad=skip_bad, report=report)


def passage_from_json(obj: Any, path: str | os.PathLike = "<memory>", number: int = 0) -> Passage:
    if not isinstance(obj, dict):
        raise DataError(path, number, f"expected a JSON object, got {type(obj).__name__}")
    pid = _require_str(obj, "id", path, number)
    if "contents" in obj:
        return Passage(pid, _require_str(obj, "contents", path, number))
    if "title" in obj and "text" in obj:
        title = _require_str(obj, "title", path, number, allow_empty=True)
        return Passage.from_title_text(pid, title, _require_str(obj, "text", path, number))
    raise DataError(path, number, "missing field 'contents' (or 'title' and 'text')")


def write_corpus(path: str | os.PathLike, passages: Iterable[Passage]) -> None:
    write_jsonl(path, ({"id": p.id, "contents": p.contents} for p in passages))


def file_sha256(path: str | os.PathLike) -> str:
    """Content hash of a file (used by index manifests and splits to detect changed inputs)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------------
# Search-R1 training parquet: data_source, prompt, ability, reward_model.ground_truth.target, extra_info
# (Search-R1's preprocessing keeps the original id/question/golden_answers columns too). pyarrow is imported
# by the two functions that need it: every module reads data.py, few read parquet.


def write_search_r1_parquet(path: str | os.PathLike, questions: Iterable[Question], split: str = "train") -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for index, q in enumerate(questions):
        rows.append({
            "id": q.id,
            "question": q.question,
            "golden_answers": list(q.golden_answers),
            "data_source": q.dataset or "nq",
            "prompt": [{"role": "user", "content": build_prompt(q.question)}],
            "ability": "fact-reasoning",
            "reward_model": {"style": "rule", "ground_truth": {"target": list(q.golden_answers)}},
            "extra_info": {"split": q.split or split, "index": index},
        })
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), str(path))


SEARCH_R1_COLUMNS = ("id", "question", "data_source", "prompt", "reward_model", "extra_info")  # what is read


def search_r1_row_to_question(row: Any, path: str | os.PathLike = "<memory>", number: int = 0) -> Question:
    """One row of Search-R1's layout (a parquet row as a dict, or a JSON object with the same fields) as a
    Question. The golds are `reward_model.ground_truth.target`; the text is the `question` field when
    present, else the prompt with Search-R1's prefix removed; the id is the `id` field when present, else
    `<data_source>_<extra_info.index>`. `dataset` is the `data_source`, `split` is `extra_info.split`."""
    if not isinstance(row, dict):
        raise DataError(path, number, f"expected an object, got {type(row).__name__}")
    try:
        golds = row["reward_model"]["ground_truth"]["target"]
    except (KeyError, TypeError):
        raise DataError(path, number, "missing field 'reward_model.ground_truth.target'") from None
    golds = [str(g) for g in (golds if isinstance(golds, list) else [golds]) if g is not None and str(g).strip()]
    if not golds:
        raise DataError(path, number, "field 'reward_model.ground_truth.target' is empty")
    text = row.get("question")
    if not text:
        prompt = row.get("prompt")
        first = prompt[0] if isinstance(prompt, list) and prompt else None
        content = first.get("content") if isinstance(first, dict) else None
        if not isinstance(content, str) or not content.startswith(PROMPT_PREFIX):
            raise DataError(path, number, "no 'question' field and the prompt is not Search-R1's")
        text = content[len(PROMPT_PREFIX):].rstrip("\n")
    if not isinstance(text, str) or not text.strip():
        raise DataError(path, number, "field 'question' must be a non-empty string")
    extra = row.get("extra_info") or {}
    if not isinstance(extra, dict):
        raise DataError(path, number, "field 'extra_info' must be an object")
    return Question(
        id=str(row.get("id") or f"{row.get('data_source', 'row')}_{extra.get('index', number - 1)}"),
        question=text,
        golden_answers=tuple(golds),
        dataset=str(row.get("data_source") or ""),
        split=str(extra.get("split") or ""),
    )


def parquet_rows(path: str | os.PathLike) -> int:
    """The number of rows of a parquet file, from its footer (nothing else is read)."""
    return int(_parquet_file(path).metadata.num_rows)


def _parquet_file(path: str | os.PathLike) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(str(path))
    except pa.ArrowInvalid as e:  # not parquet (a missing file raises FileNotFoundError, as it is)
        raise DataError(path, None, f"not a readable parquet file ({e})") from None


def iter_search_r1_parquet(
    path: str | os.PathLike, report: ReadReport | None = None, *, batch_size: int = 4096
) -> Iterator[Question]:
    """The questions of a Search-R1 parquet, streaming: `batch_size` rows in memory at a time, and only the
    columns in :data:`SEARCH_R1_COLUMNS` read. Row `i` (1-based) is question `i`; a bad row raises DataError
    naming the file and the row. `report`, when given, counts the rows read and notes their gold-answer
    warnings, by row number."""
    parquet = _parquet_file(path)
    columns = set(parquet.schema_arrow.names)
    for needed in ("prompt", "reward_model"):
        if needed not in columns:
            raise DataError(path, None, f"missing column {needed!r} (not a Search-R1 parquet?)")
    number = 0
    for batch in parquet.iter_batches(batch_size=batch_size, columns=[c for c in SEARCH_R1_COLUMNS if c in columns]):
        for row in batch.to_pylist():
            number += 1
            question = search_r1_row_to_question(row, path, number)
            if report is not None:
                report.read += 1
                report.warnings.extend(gold_warnings(question, path, number))
            yield question


def read_search_r1_parquet(path: str | os.PathLike, report: ReadReport | None = None) -> list[Question]:
    """Questions from a Search-R1 training parquet (see :func:`iter_search_r1_parquet`). The question text
    comes from the `question` column when present, else from the prompt (Search-R1's prefix removed).
    `report`, when given, counts the rows read and notes their gold-answer warnings, by row number."""
    return list(iter_search_r1_parquet(path, report))


# --------------------------------------------------------------------------------------------------
# Data suites: a corpus, training files and the evaluation benchmarks, found in one directory.

BENCHMARKS_SINGLE_HOP = ("nq", "triviaqa", "popqa")
BENCHMARKS_MULTI_HOP = ("hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
BENCHMARKS = BENCHMARKS_SINGLE_HOP + BENCHMARKS_MULTI_HOP

# The layout of the FlashRAG-style data release (DATA.md): for each benchmark, the file of held-out
# questions that the small corpus can answer where one exists (training splits never overlap them).
FLASHRAG_LAYOUT = {
    "corpus": "corpus/wiki_mini.jsonl",
    "train": ["qa/splits/nq_oracle_train.jsonl", "qa/splits/popqa_train.jsonl",
              "qa/train/hotpotqa_train_hipporag100.jsonl", "qa/train/musique_train_hipporag100.jsonl"],
    "eval": {
        "nq": "qa/splits/nq_oracle_dev.jsonl",
        "triviaqa": "qa/triviaqa.jsonl",
        "popqa": "qa/splits/popqa_dev.jsonl",
        "hotpotqa": "qa/hotpotqa_ctx.jsonl",
        "2wikimultihopqa": "qa/2wikimultihopqa_ctx.jsonl",
        "musique": "qa/musique_ctx.jsonl",
        "bamboogle": "qa/bamboogle.jsonl",
    },
}


@dataclass(frozen=True)
class DataSuite:
    """Where a corpus, its training questions and its evaluation benchmarks live.

    A directory with a `suite.json` (`{"corpus", "train": [...], "eval": {name: file}}`, paths relative to
    it) describes itself; a directory in the FlashRAG release layout (`corpus/`, `qa/`) is recognised."""

    root: Path
    corpus: Path
    train: tuple[Path, ...]
    eval: dict[str, Path]

    def eval_files(self, names: Iterable[str] | None = None) -> dict[str, Path]:
        names = list(names) if names is not None else list(self.eval)
        unknown = [n for n in names if n not in self.eval]
        if unknown:
            raise KeyError(f"unknown benchmark(s) {unknown}; this suite has {sorted(self.eval)}")
        return {n: self.eval[n] for n in names}


def embedded_root() -> Path:
    """The directory of the small dataset shipped inside the package."""
    return Path(str(resources.files("eviback") / "embedded"))


def load_suite(root: str | os.PathLike | None = None) -> DataSuite:
    """The data suite in `root` (default: the embedded one)."""
    root = Path(root) if root is not None else embedded_root()
    manifest = root / "suite.json"
    if manifest.exists():
        spec = json.loads(manifest.read_text())
    elif (root / FLASHRAG_LAYOUT["corpus"]).exists():
        spec = FLASHRAG_LAYOUT
    else:
        raise FileNotFoundError(
            f"{root} is not a data suite: it has neither suite.json nor {FLASHRAG_LAYOUT['corpus']}"
        )
    return DataSuite(
        root=root,
        corpus=root / spec["corpus"],
        train=tuple(root / p for p in spec["train"] if (root / p).exists()),
        eval={name: root / p for name, p in spec["eval"].items() if (root / p).exists()},
    )


# --------------------------------------------------------------------------------------------------
# Training questions: never an evaluation question of their suite.


def training_files(suite: DataSuite, names: Sequence[str] = ()) -> tuple[Path, ...]:
    """The suite's training files, or the named subset of them (by path or by file stem, e.g. `nq_train`).

    Evaluation files are refused: training never sees an evaluation question."""
    if not names:
        if not suite.train:
            raise ValueError(f"the data suite {suite.root} lists no training files; add a `train` list to it")
        return suite.train
    by_name = {_stem(p): p for p in suite.train}
    chosen = []
    for name in names:
        path = by_name.get(_stem(name)) or next((p for p in suite.train if str(p) == str(name)), None)
        if path is None:
            raise ValueError(
                f"{name!r} is not a training file of the suite {suite.root}; choose from "
                f"{', '.join(sorted(by_name))}"
            )
        chosen.append(path)
    return tuple(chosen)


def _stem(path: str | os.PathLike) -> str:
    name = str(path).rsplit("/", 1)[-1]
    for suffix in (".gz", ".jsonl", ".json", ".parquet"):
        name = name.removesuffix(suffix)
    return name


def eval_question_keys(suite: DataSuite) -> tuple[set[str], set[str]]:
    """The ids and normalised question texts of every evaluation file of `suite`."""
    ids: set[str] = set()
    texts: set[str] = set()
    for path in suite.eval.values():
        for q in read_questions(path):
            ids.add(q.id)
            texts.add(normalize_answer(q.question))
    return ids, texts


def eval_overlap(questions: Iterable[Question], suite: DataSuite) -> list[Question]:
    """The questions whose id or normalised text is also in one of the suite's evaluation files."""
    ids, texts = eval_question_keys(suite)
    return [q for q in questions if q.id in ids or normalize_answer(q.question) in texts]


def check_no_eval_overlap(questions: Iterable[Question], suite: DataSuite) -> None:
    """Raise when a training question's id or text appears in one of the suite's evaluation files."""
    leaked = [q.id for q in eval_overlap(questions, suite)]
    if leaked:
        raise ValueError(
            f"{len(leaked)} training question(s) also appear in the suite's evaluation files "
            f"(e.g. {leaked[:3]}); train only on the suite's `train` files, or remove these questions"
        )


def read_training_questions(suite: DataSuite, names: Sequence[str] = ()) -> list[Question]:
    """The questions of the suite's training files (or the named ones), each id once, never an evaluation
    question: a training question whose id or text is also in an evaluation file is left out, with a warning
    (a release can hold two questions of the same text about different entities, e.g. PopQA's "What is Will
    Smith's occupation?" in both its training and its held-out split)."""
    questions, seen = [], set()
    for path in training_files(suite, names):
        for q in read_questions(path):
            if q.id not in seen:  # the same id in two files is one question
                seen.add(q.id)
                questions.append(q)
    leaked = {q.id for q in eval_overlap(questions, suite)}
    kept = [q for q in questions if q.id not in leaked]
    if len(kept) < len(questions):
        left_out = [q.id for q in questions if q.id in leaked][:3]
        log.warning(
            "%d training question(s) left out: their id or text is also in the suite's evaluation files (e.g. %s)",
            len(questions) - len(kept), left_out)
    return kept
