"""The `/retrieve` service (`eviback serve` in a subprocess, real HTTP) and its client: Search-R1's request
and response bytes, every refused input, batching of concurrent requests, and the client's retries across
a server restart and up to its deadline. (A training run across a restart: test_retrieval_restart.py.)"""

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi.responses import JSONResponse

from eviback.log_format import foreign_lines, log_lines
from eviback.retrieval import ClientConfig, build_index, load_retriever
from eviback.retrieval.client import RetrievalClient, RetrievalError, RetrieverUnavailable
from test_retrieval import BM25_QUERIES, write_corpus

pytestmark = pytest.mark.slow  # starts real servers


def wait_until(condition, what: str, timeout_s: float = 120.0, detail=lambda: "") -> None:
    """Wait for `condition()`; fail naming `what` (and `detail()`) when it has not happened in `timeout_s`,
    far above what it takes, so that a broken client fails the test instead of hanging it."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_s:.0f} s {detail()}".rstrip())
        time.sleep(0.01)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`eviback serve INDEX` as a user starts it, on a given port."""

    def __init__(self, index: Path, port: int, *options: str) -> None:
        self.index, self.port, self.options = index, port, options
        self.url = f"http://127.0.0.1:{port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> "Server":
        self.process = subprocess.Popen(
            [sys.executable, "-m", "eviback.cli", "serve", str(self.index), "--port", str(self.port), *self.options],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited: {self.process.stdout.read()}{self.process.stderr.read()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                time.sleep(0.1)
        raise RuntimeError("server did not start in 60 s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=20)

    def output(self) -> tuple[str, str]:
        """What the last process started wrote, (stdout, stderr), once it has stopped."""
        return self.process.stdout.read(), self.process.stderr.read()

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=5).json()


@pytest.fixture(scope="module")
def index(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("service")
    build_index(write_corpus(root / "corpus.jsonl"), root / "index", progress=False)
    return root / "index"


@pytest.fixture(scope="module")
def server(index):
    # Small limits, so that every limit can be crossed cheaply; a batching window so that concurrent
    # requests are merged.
    server = Server(index, free_port(), "--max-queries", "40", "--max-query-chars", "64", "--max-topk", "10",
                    "--batch-wait-ms", "20").start()
    yield server
    server.stop()


def post(server: Server, body: bytes | str) -> httpx.Response:
    content = body.encode() if isinstance(body, str) else body
    return httpx.post(f"{server.url}/retrieve", content=content, headers={"content-type": "application/json"},
                      timeout=10)


def test_response_is_search_r1s_bytes(server, index):
    in_process = load_retriever(index)
    queries = ["who won the first nobel prize in physics", "who wrote hamlet", ""]
    expected = in_process.search(queries, topk=3)
    response = post(server, json.dumps({"queries": queries, "topk": 3, "return_scores": True}))
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    # What Search-R1's FastAPI endpoint sends for the same passages: it returns this dict and FastAPI
    # renders it with JSONResponse.
    search_r1 = {"result": [[{"document": {"id": p.id, "contents": p.contents}, "score": p.score} for p in ps]
                            for ps in expected]}
    assert response.content == JSONResponse(search_r1).body
    assert response.content.startswith(b'{"result":[[{"document":{"id":"p0","contents":"\\"Nobel Prize in Physics\\"\\n')
    assert "Röntgen".encode() in response.content  # UTF-8, not \u escapes, as FastAPI sends it
    assert response.content.endswith(b"}],[]]}")  # the empty query gets an empty list


def test_without_scores_each_item_is_just_the_document(server, index):
    expected = load_retriever(index).search(["who wrote hamlet"], topk=2)
    response = post(server, '{"queries": ["who wrote hamlet"], "topk": 2, "return_scores": false}')
    assert response.status_code == 200
    assert response.json() == {"result": [[{"document": {"id": p.id, "contents": p.contents}} for p in expected[0]]]}
    # Search-R1's defaults: return_scores false, topk the server's default (3)
    default = post(server, '{"queries": ["the prize film river planet mountain wall"]}').json()["result"][0]
    assert len(default) == 3 and all(set(item) == {"document"} for item in default)


BAD_REQUESTS = [
    ('{"queries": ["hamlet"', 400, "malformed JSON"),
    (b'{"queries": ["\xff"]}', 400, "not UTF-8"),
    ('["hamlet"]', 422, "must be a JSON object"),
    ('{"topk": 3}', 422, "missing field 'queries'"),
    ('{"queries": "hamlet"}', 422, "'queries' must be a list of strings, got a string"),
    ('{"queries": []}', 422, "'queries' is empty"),
    ('{"queries": ["ok", 7]}', 422, "queries[1] must be a string, got an integer"),
    ('{"queries": ["ok", null]}', 422, "queries[1] must be a string, got null"),
    (json.dumps({"queries": ["q"] * 41}), 422, "too many queries: 41 in one request, the limit is 40"),
    (json.dumps({"queries": ["x" * 65]}), 422, "queries[0] is 65 characters long, the limit is 64"),
    ('{"queries": ["\\ud800"]}', 422, "not valid Unicode"),
    ('{"queries": ["hamlet"], "topk": 0}', 422, "'topk' must be between 1 and 10, got 0"),
    ('{"queries": ["hamlet"], "topk": 11}', 422, "'topk' must be between 1 and 10, got 11"),
    ('{"queries": ["hamlet"], "topk": -3}', 422, "'topk' must be between 1 and 10"),
    ('{"queries": ["hamlet"], "topk": "3"}', 422, "'topk' must be an integer, got a string"),
    ('{"queries": ["hamlet"], "topk": 2.5}', 422, "'topk' must be an integer, got a number"),
    ('{"queries": ["hamlet"], "topk": true}', 422, "'topk' must be an integer, got a boolean"),
    ('{"queries": ["hamlet"], "return_scores": "yes"}', 422, "'return_scores' must be true or false"),
    ("[" * 5000 + "]" * 5000, 400, "nested too deeply"),
    (json.dumps({"queries": ["q"], "padding": "x" * 30_000}), 413, "over the limit"),
]


@pytest.mark.parametrize(("body", "status", "reason"), BAD_REQUESTS, ids=[r for _, _, r in BAD_REQUESTS])
def test_bad_input_gets_a_4xx_with_the_reason(server, body, status, reason):
    response = post(server, body)
    assert response.status_code == status
    assert reason in response.json()["detail"]


def test_a_body_without_length_is_cut_at_the_limit(server):
    def chunks():  # sent chunked (no content-length), larger than the limit
        yield b'{"queries": ["q"], "padding": "'
        for _ in range(40):
            yield b"x" * 1000
        yield b'"}'

    response = httpx.post(f"{server.url}/retrieve", content=chunks(), timeout=10)
    assert response.status_code == 413 and "over the limit" in response.json()["detail"]


def test_server_survives_bad_input_and_counts_it(server):
    before = server.health()["stats"]
    for body, _, _ in BAD_REQUESTS:
        post(server, body)
    after = server.health()["stats"]
    assert after["refused"] - before["refused"] == len(BAD_REQUESTS) and after["failed"] == 0
    assert server.process.poll() is None
    assert post(server, '{"queries": ["who wrote hamlet"], "topk": 1}').json()["result"][0][0]["document"]["id"] == "p2"
    assert httpx.get(f"{server.url}/retrieve", timeout=5).status_code == 405


def test_concurrent_requests_are_batched_and_answered_correctly(server, index):
    queries = list(BM25_QUERIES) * 8  # 32 requests, alternately top-3 and top-1 (batched together)
    topks = [3, 1] * 16
    in_process = load_retriever(index)
    expected = [in_process.search([q], topk=k)[0] for q, k in zip(queries, topks, strict=True)]
    before = server.health()["stats"]
    client = RetrievalClient(server.url)
    answers: list = [None] * len(queries)
    barrier = threading.Barrier(len(queries))

    def ask(i):
        barrier.wait()  # all at once
        answers[i] = client.search([queries[i]], topk=topks[i])[0]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(queries))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    client.close()
    assert answers == expected
    after = server.health()["stats"]
    requests, batches = after["requests"] - before["requests"], after["batches"] - before["batches"]
    assert requests == len(queries)
    assert batches < requests  # merged: fewer search calls than requests


def test_client_matches_in_process_search(server, index):
    client = load_retriever(server.url)
    assert isinstance(client, RetrievalClient)
    queries = list(BM25_QUERIES) + ["", "zzzz qqqq"]
    assert client.search(queries, topk=2) == load_retriever(index).search(queries, topk=2)
    # a batch larger than a request may carry is split into several requests
    small = RetrievalClient(server.url + "/retrieve", ClientConfig(batch_queries=3))
    assert small.search(queries * 3, topk=1) == load_retriever(index).search(queries * 3, topk=1)
    client.close()
    small.close()


def test_client_does_not_retry_a_refused_request(server):
    client = RetrievalClient(server.url, ClientConfig(deadline_s=60, backoff_s=1.0))
    before = server.health()["stats"]["refused"]
    with pytest.raises(RetrievalError, match=r"refused the request \(HTTP 422\): 'topk' must be between 1 and 10"):
        client.search(["hamlet"], topk=50)
    assert server.health()["stats"]["refused"] == before + 1  # one attempt, no retry: a 4xx would fail again
    client.close()


def test_client_retries_across_a_server_restart(index, caplog):
    server = Server(index, free_port()).start()
    expected = load_retriever(index).search(list(BM25_QUERIES), topk=3)
    # a deadline of minutes: a restart on a loaded machine must not run the client out of time
    client = RetrievalClient(server.url, ClientConfig(deadline_s=600, backoff_s=0.1, max_backoff_s=0.5, timeout_s=10))
    stop, results, errors = threading.Event(), [], []

    def keep_searching():
        while not stop.is_set():
            try:
                results.append(client.search(list(BM25_QUERIES), topk=3))
            except RetrievalError as e:
                errors.append(e)

    def progress() -> str:
        return f"({len(results)} searches done, errors: {errors[:3]})"

    worker = threading.Thread(target=keep_searching)
    try:
        with caplog.at_level(logging.WARNING, logger="eviback.retrieval.client"):
            worker.start()
            wait_until(lambda: len(results) >= 5, "5 searches before the restart", detail=progress)
            server.stop()  # the service goes away mid-run...
            down = len(results)
            # ...long enough for the client to meet it (a retry logged), however slowly the thread is scheduled
            wait_until(lambda: any("retrieval attempt" in r.getMessage() for r in caplog.records),
                       "a retry while the server is down", detail=progress)
            server.start()  # ...and comes back on the same port
            wait_until(lambda: len(results) >= down + 5, "5 searches after the restart", detail=progress)
            stop.set()
            worker.join(timeout=60)
            assert not worker.is_alive(), "the searching thread did not stop"
    finally:
        stop.set()
        server.stop()
        client.close()
    assert not errors
    out, err = server.output()  # the restarted service's, until its stop: eviback's lines only, none on stdout
    assert foreign_lines(err) == [] and log_lines(out) == [], (err, out)
    assert all(r == expected for r in results)
    retried = [r.getMessage() for r in caplog.records if "retrieval attempt" in r.getMessage()]
    assert retried, "the client should have retried while the server was down"
    assert all(server.url in m and "left of the 600 s deadline" in m for m in retried)  # each attempt, with the time left


def test_client_gives_up_at_its_deadline_with_a_clear_error(index, caplog):
    port = free_port()  # nothing listens there
    client = RetrievalClient(f"http://127.0.0.1:{port}", ClientConfig(deadline_s=1.0, backoff_s=0.05, max_backoff_s=0.2))
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="eviback.retrieval.client"), \
            pytest.raises(RetrieverUnavailable) as failed:
        client.search(["who wrote hamlet"])
    assert time.monotonic() - started >= 1.0  # retried until the deadline, not a number of times
    error = failed.value
    assert error.url == f"http://127.0.0.1:{port}" and error.last_error.startswith("ConnectError")
    assert error.attempts >= 3 and error.waited_s >= 1.0
    message = str(error)
    assert f"127.0.0.1:{port} did not answer for 1 s" in message and "ConnectError" in message
    assert "eviback serve" in message and "retrieval_deadline_s" in message
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == error.attempts - 1  # every failed attempt but the last, which raised
    assert all(f"127.0.0.1:{port}" in m and "ConnectError" in m for m in logged)
    assert client.search([""]) == [[]]  # empty queries never reach the network


def test_client_times_out_on_a_silent_server():
    # A server that accepts connections and never answers: every attempt must end at the timeout.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    accepted = []
    threading.Thread(target=lambda: [accepted.append(listener.accept()) for _ in range(2)], daemon=True).start()
    client = RetrievalClient(f"http://127.0.0.1:{listener.getsockname()[1]}",
                             ClientConfig(timeout_s=0.5, deadline_s=0.7, backoff_s=0.01))
    started = time.monotonic()
    with pytest.raises(RetrieverUnavailable, match="ReadTimeout") as failed:
        client.search(["who wrote hamlet"])
    # each attempt waited its whole timeout (a lower bound holds on any machine); the ReadTimeout says the
    # timeout, not the server, ended them
    assert time.monotonic() - started >= 0.5 * failed.value.attempts >= 0.5
    listener.close()


def test_serve_on_a_taken_port_says_so(index):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "eviback.cli", "serve", str(index), "--port", str(port)],
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr and "--port" in result.stderr
    assert "Traceback" not in result.stderr
