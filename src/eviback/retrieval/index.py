"""Index directories: building them, their manifest, and loading any retriever from a spec.

An index directory holds `manifest.json` (kind, model, parameters, corpus path and sha256, passage count,
build time, eviback version), a copy of the passages (`passages.jsonl`) and the kind's own files. A build
works in `<dir>.partial/` and renames it into place when finished, so a directory with a manifest is always
complete; an interrupted dense build resumes from `<dir>.partial/`.

    from eviback.retrieval import build_index, load_retriever, suite_retriever
    build_index("corpus.jsonl", "indexes/bm25")                  # or: eviback index corpus.jsonl --out ...
    retriever = load_retriever("indexes/bm25")                   # or an http:// URL of `eviback serve`
    retriever = suite_retriever()                                # the embedded suite's corpus, cached

Loading checks that the corpus the index was built from is unchanged (by its sha256) and refuses it
otherwise: the index would return passages that are no longer the corpus's.

The kinds' modules are imported here (their heavy libraries, bm25s and FAISS, only where an index is built or
opened); the `/retrieve` client is imported for a URL alone, since it loads httpx.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from eviback import __version__
from eviback.cache import cache_dir, file_lock
from eviback.data import DataSuite, file_sha256, load_suite
from eviback.retrieval.base import Retriever
from eviback.retrieval.bm25 import BM25Index
from eviback.retrieval.bm25 import build as build_bm25
from eviback.retrieval.config import BM25Config, ClientConfig, DenseConfig, IndexKind
from eviback.retrieval.dense import DenseIndex
from eviback.retrieval.dense import build as build_dense
from eviback.retrieval.imported import ImportedIndex
from eviback.retrieval.manifest import (
    MANIFEST_FILE,
    IndexMismatchError,
    Manifest,
    read_manifest,
)
from eviback.retrieval.manifest import write_json as _write_json
from eviback.types import to_dict

log = logging.getLogger(__name__)

BUILD_STATE_FILE = "build.json"  # in <dir>.partial/: what the unfinished build is for


def _params(kind: IndexKind, bm25: BM25Config | None, dense: DenseConfig | None) -> dict[str, Any]:
    if kind is IndexKind.BM25:
        return to_dict(bm25 or BM25Config())
    params = (dense or DenseConfig()).index_params()
    if params["model"] != DenseConfig().model:
        params["model"] = str(Path(params["model"]).resolve())  # a path must mean the same model later
    return params


def _rebuild_hint(corpus: str, out: Path, kind: IndexKind) -> str:
    if kind is IndexKind.FAISS_IMPORT:
        return f"eviback index import-faiss FLAT_INDEX {corpus} --out {out} --force"
    kind_option = "" if kind is IndexKind.BM25 else f" --kind {kind}"
    return f"eviback index {corpus} --out {out}{kind_option} --force"


def build_index(
    corpus: str | os.PathLike,
    out: str | os.PathLike,
    kind: IndexKind | str = IndexKind.BM25,
    *,
    bm25: BM25Config | None = None,
    dense: DenseConfig | None = None,
    force: bool = False,
    progress: bool = True,
    lock: str | os.PathLike | None = None,
) -> Manifest:
    """Build (or resume, or confirm) the index of `corpus` in `out` and return its manifest.

    An `out` that already holds an index of the same corpus content and parameters is left as it is. One
    built from another corpus or with other parameters is refused unless `force` (then rebuilt). Two
    processes building the same `out` at once are serialised by a lock file (`lock`, default: one in
    `cache_dir()/locks` named after `out`)."""
    kind = IndexKind(kind)
    if kind is IndexKind.FAISS_IMPORT:
        raise ValueError("an imported FAISS index is made by eviback.retrieval.imported.import_faiss "
                         "(`eviback index import-faiss`), not built from a corpus")
    corpus = Path(corpus)
    if not corpus.is_file():
        raise FileNotFoundError(f"corpus {corpus} not found")
    corpus = corpus.resolve()
    out = Path(out)
    params = _params(kind, bm25, dense)
    if lock is None:  # keyed by the absolute output path; kept in the cache, not beside the user's files
        lock = cache_dir() / "locks" / f"index-{hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:16]}.lock"
    lock_path = Path(lock)
    with file_lock(lock_path):
        sha = file_sha256(corpus)
        if out.exists() and not (out / MANIFEST_FILE).exists() and (not out.is_dir() or any(out.iterdir())):
            # A rebuild replaces `out` wholesale: never do that to something that is not an index.
            raise FileExistsError(f"{out} exists and is not an index directory: choose another --out")
        if (out / MANIFEST_FILE).exists():
            existing = read_manifest(out)
            same = (existing.kind, existing.corpus_sha256, dict(existing.params)) == (kind, sha, params)
            if same and not force:
                log.info("index %s is up to date (%s, %d passages)", out, kind, existing.passages)
                return existing
            if not force:
                raise IndexMismatchError(_describe_difference(out, existing, kind, sha, params, corpus)
                                         + f": rebuild it with `{_rebuild_hint(str(corpus), out, kind)}`, "
                                         "or choose another --out")
        work = out.with_name(out.name + ".partial")
        state = {"kind": str(kind), "corpus_sha256": sha, "params": params}
        if work.exists():
            try:
                previous = json.loads((work / BUILD_STATE_FILE).read_text())
            except (OSError, ValueError):
                previous = None
            if previous != state and not force:
                raise IndexMismatchError(
                    f"{work} holds an unfinished build of another corpus or other parameters "
                    f"(it was for {previous}, this build is for {state}): rerun with --force to discard it")
            if previous != state:
                shutil.rmtree(work)
            else:
                log.info("resuming the unfinished build in %s", work)
        work.mkdir(parents=True, exist_ok=True)
        _write_json(work / BUILD_STATE_FILE, state)
        started = time.perf_counter()
        build = build_bm25 if kind is IndexKind.BM25 else build_dense
        config = (bm25 or BM25Config()) if kind is IndexKind.BM25 else (dense or DenseConfig())
        count = build(corpus, work, config, progress=progress)
        manifest = Manifest(
            kind=kind,
            corpus_path=str(corpus),
            corpus_sha256=sha,
            passages=count,
            params=params,
            model=params.get("model", ""),
            built_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            build_seconds=round(time.perf_counter() - started, 3),
            eviback_version=__version__,
        )
        (work / BUILD_STATE_FILE).unlink()
        _write_json(work / MANIFEST_FILE, to_dict(manifest))
        if out.exists():
            shutil.rmtree(out)
        os.replace(work, out)
        log.info("built %s index of %d passages in %s (%.1f s)", kind, count, out, manifest.build_seconds)
        return manifest


def _describe_difference(out: Path, existing: Manifest, kind: IndexKind, sha: str, params: dict,
                         corpus: Path) -> str:
    if existing.kind != kind:
        return f"{out} already holds a {existing.kind} index, not {kind}"
    if existing.corpus_sha256 != sha:
        return (f"{out} was built from {existing.corpus_path} with sha256 {existing.corpus_sha256}, but "
                f"{corpus} has sha256 {sha}")
    changed = {k: (existing.params.get(k), v) for k, v in params.items() if existing.params.get(k) != v}
    return f"{out} was built with other parameters ({', '.join(f'{k}: {a!r} -> {b!r}' for k, (a, b) in changed.items())})"


def check_corpus(directory: str | os.PathLike, manifest: Manifest, known_sha256: str | None = None) -> None:
    """Refuse an index whose corpus file changed since the build. A corpus that is not there (an index
    copied to another machine) is accepted with a warning: the index carries its own passages."""
    corpus = Path(manifest.corpus_path)
    if not corpus.exists():
        log.warning("the corpus of index %s (%s) is not on this machine; serving the index's own copy of its "
                    "passages", directory, corpus)
        return
    sha = known_sha256 or file_sha256(corpus)
    if sha != manifest.corpus_sha256:
        raise IndexMismatchError(
            f"index {directory} was built from {corpus} with sha256 {manifest.corpus_sha256}, but that file "
            f"now has sha256 {sha}: its passages are no longer the corpus's. Rebuild the index with "
            f"`{_rebuild_hint(str(corpus), Path(directory), manifest.kind)}` (or restore the corpus it was "
            "built from)")


def load_index(directory: str | os.PathLike, *, verify_corpus: bool = True,
               known_sha256: str | None = None) -> Retriever:
    """The in-process retriever of an index directory (BM25, dense or an imported FAISS index, as its
    manifest says)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    if verify_corpus:
        check_corpus(directory, manifest, known_sha256)
    if manifest.kind is IndexKind.FAISS_IMPORT:
        retriever: Any = ImportedIndex(directory, manifest.params)
    elif manifest.kind is IndexKind.BM25:
        retriever = BM25Index(directory, BM25Config(**manifest.params))
    else:
        retriever = DenseIndex(directory, DenseConfig(**manifest.params))
    if len(retriever) != manifest.passages:
        retriever.close()
        raise ValueError(f"index {directory} holds {len(retriever)} passages but its manifest says "
                         f"{manifest.passages} (damaged): rebuild it with `eviback index ... --force`")
    return retriever


def load_retriever(spec: str | os.PathLike, client: ClientConfig | None = None) -> Retriever:
    """A retriever from `spec`: an index directory, or the `http://` / `https://` URL of a `/retrieve`
    service (`eviback serve`), which gives its client, configured by `client` (default: `ClientConfig()`;
    ignored for an index)."""
    text = os.fspath(spec)
    if text.startswith(("http://", "https://")):
        from eviback.retrieval.client import RetrievalClient  # httpx: loaded for a URL only

        return RetrievalClient(text, client)
    return load_index(text)


def open_retriever(spec: str | os.PathLike | None, suite: DataSuite | None = None,
                   kind: IndexKind | str = IndexKind.BM25, client: ClientConfig | None = None) -> Retriever:
    """The retriever a run's `retriever` setting chooses: the index directory or `/retrieve` URL `spec`
    names (:func:`load_retriever`; `client` configures the client of a URL), or, when it names none, the
    `kind` index (BM25 by default) of `suite`'s corpus, built once and cached (:func:`suite_retriever`;
    default: the embedded suite)."""
    if spec:
        return load_retriever(spec, client)
    return suite_retriever(suite, kind)


def suite_index_dir(suite: DataSuite | None = None, kind: IndexKind | str = IndexKind.BM25) -> tuple[Path, str]:
    """Where :func:`suite_retriever` caches the index of a suite's corpus, and the corpus's sha256."""
    suite = suite if suite is not None else load_suite()
    kind = IndexKind(kind)
    sha = file_sha256(suite.corpus)
    name = f"{kind}-{sha[:16]}" if kind is IndexKind.BM25 else f"{kind}-{DenseConfig().model.lower()}-{sha[:16]}"
    return cache_dir() / "indexes" / name, sha


def suite_retriever(suite: DataSuite | None = None, kind: IndexKind | str = "bm25") -> Retriever:
    """The index of a data suite's corpus (default: the embedded suite), with default parameters.

    Built once into `cache_dir()/indexes/<kind>-<corpus sha256 prefix>` and reused; the cache key is the
    corpus content, so an edited corpus gets a new index. Safe when several processes ask at once: one
    builds, the others wait for it and load the result."""
    suite = suite if suite is not None else load_suite()
    kind = IndexKind(kind)
    out, sha = suite_index_dir(suite, kind)
    if not (out / MANIFEST_FILE).exists():
        build_index(suite.corpus, out, kind, progress=False, lock=cache_dir() / "locks" / f"index-{out.name}.lock")
    return load_index(out, known_sha256=sha)
