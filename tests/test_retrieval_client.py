"""The `/retrieve` client's retry rule, without a server: what is retried (connection errors, timeouts, 408,
429, 5xx) and for how long (until `deadline_s`, with capped exponential backoff, each attempt logged), what is
not (a 4xx, at once with the service's reason), and the error past the deadline. The real service, stopped
and restarted: test_retrieval_service.py and test_retrieval_restart.py."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path

import httpx
import pytest

from eviback.retrieval import ClientConfig
from eviback.retrieval.client import RetrievalClient, RetrievalError, RetrieverUnavailable, retry_delay
from eviback.train.config import TrainConfig

ANSWER = {"result": [[{"document": {"id": "7", "contents": '"Hamlet"\nA play.'}, "score": 2.5}]]}


def scripted(*replies: httpx.Response | Exception) -> tuple[httpx.MockTransport, list[httpx.Request]]:
    """A transport answering each request with the next reply (the last one repeated), and its requests."""
    calls: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        reply = replies[min(len(calls), len(replies) - 1)]
        calls.append(request)
        if isinstance(reply, Exception):
            raise reply
        return reply

    return httpx.MockTransport(handle), calls


def test_backoff_doubles_up_to_its_cap():
    config = ClientConfig(backoff_s=0.5, max_backoff_s=10)
    assert [retry_delay(n, config) for n in range(1, 8)] == [0.5, 1, 2, 4, 8, 10, 10]
    assert retry_delay(10_000, config) == 10  # no overflow however long a service stays down


def test_a_failing_service_is_retried_until_it_answers(caplog):
    transport, calls = scripted(httpx.ConnectError("Connection refused"), httpx.Response(503, json={"detail": "loading"}),
                                httpx.ReadTimeout("timed out"), httpx.Response(200, json=ANSWER))
    client = RetrievalClient("http://svc:8000", ClientConfig(backoff_s=0.01, max_backoff_s=0.02), transport=transport)
    with caplog.at_level(logging.WARNING, logger="eviback.retrieval.client"):
        [[passage]] = client.search(["hamlet"])
    assert (passage.id, passage.title, passage.score) == ("7", "Hamlet", 2.5)
    assert len(calls) == 4
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 3  # one line per failed attempt: its number, the service, the error, the time left
    for attempt, (message, error) in enumerate(zip(logged, ("ConnectError: Connection refused", "HTTP 503: loading",
                                                             "ReadTimeout: timed out"), strict=True), start=1):
        assert message.startswith(f"retrieval attempt {attempt} to http://svc:8000 failed: {error}; retrying in ")
        assert "s left of the 300 s deadline" in message


@pytest.mark.parametrize("status", [408, 429, 500, 502, 504])
def test_overload_and_server_errors_are_retried(status):
    transport, calls = scripted(httpx.Response(status, text="busy"), httpx.Response(200, json=ANSWER))
    client = RetrievalClient("http://svc", ClientConfig(backoff_s=0.01), transport=transport)
    assert client.search(["hamlet"])[0][0].id == "7" and len(calls) == 2


@pytest.mark.parametrize("status", [400, 404, 413, 422])
def test_a_refused_request_fails_at_once_with_the_services_reason(status):
    transport, calls = scripted(httpx.Response(status, json={"detail": "'topk' must be between 1 and 100"}))
    client = RetrievalClient("http://svc", ClientConfig(backoff_s=0.01), transport=transport)
    with pytest.raises(RetrievalError, match=rf"refused the request \(HTTP {status}\): 'topk' must be") as failed:
        client.search(["hamlet"])
    assert not isinstance(failed.value, RetrieverUnavailable) and len(calls) == 1


def test_past_the_deadline_the_service_and_its_last_error_are_named():
    transport, calls = scripted(httpx.ConnectError("Connection refused"))
    client = RetrievalClient("http://svc:8000/retrieve",
                             ClientConfig(deadline_s=0.2, backoff_s=0.01, max_backoff_s=0.05), transport=transport)
    with pytest.raises(RetrieverUnavailable) as failed:
        client.search(["hamlet"])
    error = failed.value
    assert (error.url, error.last_error) == ("http://svc:8000", "ConnectError: Connection refused")
    assert error.attempts == len(calls) >= 3 and error.waited_s >= 0.2
    assert "http://svc:8000 did not answer for 0 s" in str(error) and "retrieval_deadline_s" in str(error)
    copy = pickle.loads(pickle.dumps(error))  # crosses process boundaries intact
    assert (copy.url, copy.last_error, copy.attempts, str(copy)) == (error.url, error.last_error, error.attempts,
                                                                       str(error))


@pytest.mark.parametrize("values, message", [
    ({"deadline_s": 0}, "deadline_s must be > 0"),
    ({"backoff_s": 0}, "backoff_s must be > 0"),
    ({"backoff_s": 2, "max_backoff_s": 1}, "max_backoff_s >= backoff_s"),
])
def test_client_settings_are_checked(values, message):
    with pytest.raises(ValueError, match=message):
        ClientConfig(**values)


def test_the_training_setting_is_checked_and_may_change_on_resume():
    from eviback.train.run import RESUMABLE_CHANGES

    assert TrainConfig().retrieval_deadline_s == 300
    assert TrainConfig.from_settings(retrieval_deadline_s=1).retrieval_deadline_s == 1.0
    with pytest.raises(ValueError, match="retrieval_deadline_s must be > 0"):
        TrainConfig.from_settings(retrieval_deadline_s=0)
    assert "retrieval_deadline_s" in RESUMABLE_CHANGES  # a resumed run may wait longer (or less)


def test_the_error_is_found_through_exceptions_that_wrap_it():
    down = RetrieverUnavailable("http://svc", "ConnectError: refused", 3, 2.0)
    try:
        try:
            raise down
        except RetrievalError as e:
            raise RuntimeError("training step failed") from e
    except RuntimeError as wrapped:
        assert RetrieverUnavailable.found_in(wrapped) is down
    assert RetrieverUnavailable.found_in(RetrievalError("refused")) is None
    assert down.exit_code == 75  # EX_TEMPFAIL: the same command continues once the service is back


def stopped_run(tmp_path: Path, logged: int, checkpoint: int | None, **settings: int) -> str:
    """The paragraph of `eviback train` for a run of 10 steps that logged `logged` steps and checkpointed at
    `checkpoint` before its service stayed down."""
    import argparse

    from eviback.commands.train import resume_command, stop_message
    from run_fakes import stopped_run_dir

    run = stopped_run_dir(tmp_path / "run", logged, checkpoint)
    args = argparse.Namespace(preset="grpo", config="my run.yaml", set=["retriever=http://svc:8000", "lam=0.5"],
                              output=str(run.root), resume=False)
    config = TrainConfig.from_settings(max_steps=10, **settings)
    error = RetrieverUnavailable("http://svc:8000", "ConnectError: [Errno 111] Connection refused", 33, 300.4)
    return stop_message(error, config, str(run.root), resume_command(args, str(run.root)))


def test_the_paragraph_names_the_service_the_error_what_is_redone_and_the_command(tmp_path):
    text = stopped_run(tmp_path, logged=7, checkpoint=5, save_steps=5)
    assert "\n" not in text and text.startswith("eviback train: the retrieval service at http://svc:8000 did not "
                                                "answer for 300 s (33 attempts; last error: ConnectError: [Errno 111]")
    assert "stopped in step 8 of 10; --resume continues from its last checkpoint, step 5 (save_steps=5): steps 6-8 " \
           "are redone" in text
    # the command a user typed, quoted for a shell, with --resume
    assert (f"`eviback train --preset grpo --config 'my run.yaml' --set retriever=http://svc:8000 --set lam=0.5 "
            f"--output {tmp_path / 'run'} --resume`") in text
    assert "retrieval_deadline_s=SECONDS` (now 300)" in text


@pytest.mark.parametrize("logged, checkpoint, settings, says", [
    (3, 3, {"save_steps": 1}, "stopped in step 4 of 10; --resume continues from its checkpoint at step 3: only step 4 "
                              "is redone"),
    (2, None, {}, "stopped in step 3 of 10; it had no checkpoint yet, so --resume starts it over"),
    (0, None, {}, "stopped before its first step was done (in the warm start, or the first rollouts); --resume "
                  "starts it over, reusing a finished warm start"),
    (2, None, {"save_steps": 0}, "the run writes no checkpoints (save_steps=0), so --resume starts it over"),
    (10, 10, {}, "stopped after its last step (10 of 10), in the final evaluation; --resume redoes only the "
                 "evaluation's unfinished questions"),
])
def test_the_paragraph_says_what_resuming_redoes(tmp_path, logged, checkpoint, settings, says):
    assert says in stopped_run(tmp_path, logged, checkpoint, **settings)
