"""The `/retrieve` service over loopback: requests/s, p50/p99 latency and errors at 1, 8 and 32 clients.

    python benchmarks/bench_retrieval_service.py DATA_DIR [--index INDEX_DIR] [--seconds 10] [--clients 1,8,32]

Starts `eviback serve` (BM25 over DATA_DIR's corpus, or INDEX_DIR) in its own process, then runs each
client count for --seconds: every client is a keep-alive connection sending Search-R1
requests of one NQ question each (`{"queries": [q], "topk": 3, "return_scores": true}`) back to back, the
way rollout workers call the service. A request that fails or answers non-200 counts as an error. The
service's /health counters give how many requests each batched search call served.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from eviback.data import read_questions
from eviback.retrieval import build_index


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(index: Path, port: int) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-m", "eviback.cli", "serve", str(index), "--port", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.2)
    process.terminate()
    raise RuntimeError("the server did not start in 120 s")


def run_clients(url: str, questions: list[str], clients: int, seconds: float) -> dict:
    return asyncio.run(_run_clients(url, questions, clients, seconds))


async def _run_clients(url: str, questions: list[str], clients: int, seconds: float) -> dict:
    """`clients` concurrent keep-alive HTTP/1.1 connections on one asyncio loop. The client side is a
    minimal HTTP writer/reader rather than httpx: on a 2-core machine a full Python HTTP client per
    connection would be the bottleneck and the figures would measure the load generator, not the service."""
    host, port = url.removeprefix("http://").split(":")
    latencies: list[float] = []
    errors = 0
    connections = [await asyncio.open_connection(host, int(port)) for _ in range(clients)]
    stop = time.monotonic() + seconds

    async def exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, question: str) -> bool:
        body = json.dumps({"queries": [question], "topk": 3, "return_scores": True}).encode()
        writer.write(b"POST /retrieve HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(body), body))
        status = await reader.readline()
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.lower() == "content-length":
                length = int(value)
        payload = json.loads(await reader.readexactly(length))
        return status.split()[1] == b"200" and len(payload["result"]) == 1

    async def client(slot: int) -> None:
        nonlocal errors
        reader, writer = connections[slot]
        i = slot
        while time.monotonic() < stop:
            started = time.perf_counter()
            try:
                ok = await asyncio.wait_for(exchange(reader, writer, questions[i % len(questions)]), 30)
            except (OSError, TimeoutError, ValueError, KeyError, IndexError, asyncio.IncompleteReadError):
                ok = False
                writer.close()
                reader, writer = await asyncio.open_connection(host, int(port))
            latencies.append(time.perf_counter() - started)
            errors += not ok
            i += clients
        writer.close()

    started = time.perf_counter()
    await asyncio.gather(*(client(slot) for slot in range(clients)))
    elapsed = time.perf_counter() - started
    flat = np.array(latencies)
    return {"clients": clients, "requests": len(flat), "rps": len(flat) / elapsed,
            "p50_ms": float(np.percentile(flat, 50) * 1000), "p99_ms": float(np.percentile(flat, 99) * 1000),
            "errors": errors}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data_dir", type=Path)
    parser.add_argument("--index", type=Path, help="index to serve (default: BM25 of DATA_DIR's corpus, built in a temp dir)")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--clients", default="1,8,32")
    args = parser.parse_args(argv)
    questions = [q.question for q in read_questions(args.data_dir / "qa" / "nq.jsonl")]
    with tempfile.TemporaryDirectory() as tmp:
        index = args.index
        if index is None:
            index = Path(tmp) / "index"
            build_index(args.data_dir / "corpus" / "wiki_mini.jsonl", index, progress=False)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = start_server(index, port)
        try:
            print(f"serving {index} on {url} (cpu cores: {os.cpu_count()}); {args.seconds:.0f} s per run")
            print("| clients | requests | requests/s | p50 ms | p99 ms | errors | requests per search call |")
            print("|---:|---:|---:|---:|---:|---:|---:|")
            for clients in map(int, args.clients.split(",")):
                before = httpx.get(f"{url}/health", timeout=5).json()["stats"]
                row = run_clients(url, questions, clients, args.seconds)
                after = httpx.get(f"{url}/health", timeout=5).json()["stats"]
                per_call = (after["requests"] - before["requests"]) / max(1, after["batches"] - before["batches"])
                print(f"| {clients} | {row['requests']} | {row['rps']:.0f} | {row['p50_ms']:.1f} | {row['p99_ms']:.1f} "
                      f"| {row['errors']} | {per_call:.1f} |", flush=True)
            print(json.dumps(httpx.get(f"{url}/health", timeout=5).json()["stats"]))
        finally:
            server.terminate()
            server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
