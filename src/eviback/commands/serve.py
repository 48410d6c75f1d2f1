"""Serve an index over HTTP as a Search-R1-compatible `/retrieve` service (FastAPI + uvicorn).

  eviback serve INDEX_DIR                       http://127.0.0.1:8000/retrieve
  eviback serve INDEX_DIR --host 0.0.0.0 --port 8002
  eviback serve INDEX_DIR                       an index of `eviback index import-faiss` (Search-R1's e5 index)
  eviback serve                                 the embedded suite's corpus (BM25, built once and cached)
  eviback serve --suite DATA_DIR --kind dense   a data suite's corpus, dense
  eviback serve INDEX_DIR --device cpu          the query encoder on the CPU (default auto: the local GPU)

  curl -s localhost:8000/retrieve -d '{"queries": ["who wrote hamlet"], "topk": 3, "return_scores": true}'

Clients: `eviback.retrieval.load_retriever("http://127.0.0.1:8000")`, or Search-R1's own rollout code.
"""

from __future__ import annotations

import argparse
import os
import sys

from eviback import device as devices
from eviback.data import load_suite
from eviback.retrieval import ServerConfig, load_index, read_manifest, suite_retriever
from eviback.retrieval.config import BUILD_KINDS, add_config_arguments, config_from_arguments
from eviback.retrieval.index import suite_index_dir
from eviback.types import to_dict

HELP = "serve an index as a Search-R1-compatible /retrieve HTTP service"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("index", nargs="?", help="index directory (default: the data suite's corpus, see --suite)")
    parser.add_argument("--suite", help="data suite directory whose corpus to serve when no index is given "
                                        "(default: the embedded suite)")
    parser.add_argument("--kind", choices=[k.value for k in BUILD_KINDS], default="bm25",
                        help="index kind to build for --suite (default: bm25)")
    parser.add_argument("--device", default="auto",
                        help="the query encoder of a dense or imported index: " + devices.HELP
                             + " (default: %(default)s)")
    add_config_arguments(parser.add_argument_group("service"), ServerConfig)


def run(args: argparse.Namespace) -> int:
    # OpenMP threads (FAISS's, torch's) that spin while idle steal the cores of a small or shared machine:
    # measured 4x slower FAISS searches on 2 busy cores. Read when the runtimes load, so set first.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if devices.check_device(args.device) != devices.AUTO:
        # The index is loaded as its manifest says, with the encoder placed by `auto`; this process serves
        # that one index, so `auto` is made to mean the device asked for (as $EVIBACK_DEVICE would)
        os.environ[devices.ENV_VAR] = args.device
    from eviback.retrieval.server import serve  # FastAPI and uvicorn (a second): not for `--help`

    config = config_from_arguments(ServerConfig, args)
    if args.index:
        if args.suite:
            raise ValueError("give an index directory or --suite, not both")
        directory = args.index
        retriever = load_index(directory)
    else:
        suite = load_suite(args.suite)
        retriever = suite_retriever(suite, args.kind)
        directory, _ = suite_index_dir(suite, args.kind)
    manifest = read_manifest(directory)
    print(f"{manifest.kind} index {directory}: {manifest.passages} passages from {manifest.corpus_path}", flush=True)
    try:
        serve(retriever, config, info=to_dict(manifest))
    except OSError as e:  # the port is taken, or the address is not this machine's
        print(f"eviback serve: error: {e}", file=sys.stderr)
        return 2
    finally:
        retriever.close()
    return 0
