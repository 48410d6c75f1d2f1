"""Build a retrieval index from a corpus JSONL (`{"id", "contents"}` lines, `.gz` accepted).

  eviback index CORPUS --out DIR                       BM25 (bm25s), seconds for 100k passages
  eviback index CORPUS --out DIR --kind dense          sentence-transformers + FAISS (all-MiniLM-L6-v2)
  eviback index CORPUS --out DIR --kind dense --model PATH --query-prefix 'query: ' --passage-prefix 'passage: '
  eviback index CORPUS --out DIR --kind dense --device cpu    the encoder on the CPU (default auto: the local GPU)
  eviback index import-faiss FLAT_INDEX CORPUS --out DIR --model PATH
                                                       an existing FAISS flat index (Search-R1's e5_Flat.index)
                                                       in bounded RAM: `eviback index import-faiss --help`

Rerunning the same command on a finished index does nothing; an interrupted dense build resumes where it
stopped. An index of another corpus (or other parameters) in DIR is refused unless --force.
Serve the result with `eviback serve DIR`.
"""

from __future__ import annotations

import argparse

from eviback.retrieval import IndexKind, build_index
from eviback.retrieval.config import (
    BUILD_KINDS,
    BM25Config,
    DenseConfig,
    add_config_arguments,
    config_from_arguments,
)

HELP = "build a BM25 or dense retrieval index from a corpus"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("corpus", help="corpus JSONL ({'id', 'contents'} or {'id', 'title', 'text'} lines)")
    parser.add_argument("--out", required=True, help="index directory to create")
    parser.add_argument("--kind", choices=[k.value for k in BUILD_KINDS], default="bm25", help="index kind (default: bm25)")
    parser.add_argument("--force", action="store_true",
                        help="rebuild even if DIR holds an index of another corpus or other parameters")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    add_config_arguments(parser.add_argument_group("BM25 (--kind bm25)"), BM25Config)
    add_config_arguments(parser.add_argument_group("dense (--kind dense)"), DenseConfig)


def run(args: argparse.Namespace) -> int:
    kind = IndexKind(args.kind)
    manifest = build_index(
        args.corpus,
        args.out,
        kind,
        bm25=config_from_arguments(BM25Config, args) if kind is IndexKind.BM25 else None,
        dense=config_from_arguments(DenseConfig, args) if kind is IndexKind.DENSE else None,
        force=args.force,
        progress=args.progress,
    )
    print(f"{manifest.kind} index of {manifest.passages} passages in {args.out} "
          f"(corpus sha256 {manifest.corpus_sha256[:12]}, built {manifest.built_at} in {manifest.build_seconds:.1f} s)")
    return 0
