"""Import an existing FAISS flat index and its corpus (Search-R1's wiki-18 e5 release) for serving in bounded RAM.

  eviback index import-faiss e5_Flat.index wiki-18.jsonl.gz --out indexes/wiki18-e5 --model models/e5-base-v2
  eviback index import-faiss e5_Flat.index wiki-18.jsonl.gz --out indexes/wiki18-e5-flat --model ... --compression flat

The flat index (an IndexFlatIP written by faiss.write_index) is never loaded: its vectors are read in
chunks to train and fill an IVF-PQ index (`--pq-m` bytes per passage in RAM: 2.0 GB for wiki-18's 21M
passages at the default 96), and at search time each query's `--rerank` best candidates are re-scored
exactly from the flat file, which must stay where it is. `--compression flat` serves the flat file loaded
whole (Search-R1's exact mode: 65 GB of RAM for wiki-18). Row i of the index must be passage i of the
corpus; a corpus or encoder that does not match is refused before serving. Serve with `eviback serve DIR`.
"""

from __future__ import annotations

import argparse
import os

from eviback.retrieval.config import FaissImportConfig, add_config_arguments, config_from_arguments
from eviback.retrieval.imported import describe, import_faiss

HELP = "import a FAISS flat index and its corpus (Search-R1's e5_Flat.index), compressed for bounded RAM"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("flat_index", help="FAISS IndexFlatIP file (e.g. Search-R1's e5_Flat.index)")
    parser.add_argument("corpus", help="its corpus JSONL or JSONL.gz, row i = vector i ({'id', 'contents'} lines)")
    parser.add_argument("--out", required=True, help="index directory to create")
    parser.add_argument("--force", action="store_true", help="replace an index of something else in DIR")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    add_config_arguments(parser.add_argument_group("import"), FaissImportConfig)


def run(args: argparse.Namespace) -> int:
    # OpenMP threads (FAISS's, torch's) that spin while idle steal the cores of a small or shared machine:
    # measured 4x slower FAISS searches on 2 busy cores. Read when the runtimes load, so set first.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    manifest = import_faiss(args.flat_index, args.corpus, args.out, config_from_arguments(FaissImportConfig, args),
                            force=args.force, progress=args.progress)
    print(f"imported into {args.out}: {describe(manifest)} (corpus sha256 {manifest.corpus_sha256[:12]}, "
          f"{manifest.build_seconds:.1f} s)")
    return 0
