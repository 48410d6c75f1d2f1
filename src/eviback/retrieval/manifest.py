"""An index directory's manifest: what it holds and what it was built from (`manifest.json`), read and
written here for every kind of index (built by :mod:`eviback.retrieval.index`, imported by
:mod:`eviback.retrieval.imported`)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eviback import __version__
from eviback.retrieval.config import IndexKind
from eviback.types import from_dict

MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1


class IndexMismatchError(ValueError):
    """An index does not match its corpus or the requested parameters. The message names the fix."""


@dataclass(frozen=True)
class Manifest:
    """What an index directory holds and what it was built from."""

    kind: IndexKind
    corpus_path: str  # absolute path of the corpus file at build time
    corpus_sha256: str
    passages: int
    params: Mapping[str, Any] = field(default_factory=dict)  # BM25Config / DenseConfig.index_params()
    model: str = ""  # the dense encoder; "" for BM25
    built_at: str = ""  # ISO 8601, UTC
    build_seconds: float = 0.0
    eviback_version: str = ""
    format_version: int = FORMAT_VERSION


def read_manifest(directory: str | os.PathLike) -> Manifest:
    """The manifest of an index directory; the errors say how to get a usable one."""
    directory = Path(directory)
    path = directory / MANIFEST_FILE
    if not path.exists():
        partial = directory.with_name(directory.name + ".partial")
        if partial.exists():
            raise FileNotFoundError(f"the index {directory} was never finished (its build in {partial} was "
                                    "interrupted): rerun the same `eviback index` command to resume it")
        if not directory.exists():
            raise FileNotFoundError(f"no index at {directory}: build one with `eviback index CORPUS --out {directory}`")
        raise FileNotFoundError(f"{directory} is not an index directory (no {MANIFEST_FILE}): build one with "
                                f"`eviback index CORPUS --out {directory}`")
    try:
        manifest = from_dict(Manifest, json.loads(path.read_text()))
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: unreadable manifest ({e}): rebuild the index with `eviback index ... --force`") from None
    if manifest.format_version > FORMAT_VERSION:
        raise ValueError(f"{path}: index format {manifest.format_version} is newer than this eviback "
                         f"({__version__}) reads: upgrade eviback or rebuild the index")
    return manifest


def write_json(path: Path, obj: Any) -> None:
    """`obj` as JSON at `path`, replaced atomically."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
