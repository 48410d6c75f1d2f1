"""The check of a command's log that the tests of the commands share (eviback.log_format): a user can tell which
lines matter only when the log holds eviback's own lines, its progress bars and the third-party lines that are
not known to be harmless (none, in these runs).

- A command run as a user runs it (a subprocess): its stderr holds no foreign line, and its stdout, which holds
  the command's results, no log line of any library.
- A command run in the test's process (`main([...])`, sharing an engine the session has started): the log
  records of loggers outside eviback (vLLM's included, which its own handler keeps from the root logger once
  an engine has started), the lines written straight to the file descriptors, and the warnings a user would see
  (not the deprecation, import and resource warnings Python hides by default) are all empty. Weaker than a
  subprocess: an engine's start-up lines belong to the test that started it."""

from __future__ import annotations

import logging
import subprocess
import warnings
from collections.abc import Iterable

from eviback.log_format import foreign_lines, foreign_records, log_lines

# Hidden by Python's default warning filters: a user running the command never sees them (pytest shows them).
HIDDEN_BY_DEFAULT = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)


def assert_clean_run(result: subprocess.CompletedProcess) -> None:
    """A command's run, its output captured as text: stderr holds only eviback's lines and progress bars,
    stdout no log line."""
    assert foreign_lines(result.stderr) == [], "\n".join(foreign_lines(result.stderr))
    assert log_lines(result.stdout) == [], "\n".join(log_lines(result.stdout))


def capture_command_log(caplog, monkeypatch) -> None:
    """Before a command runs in the test's process: its log records are captured at the command line's level
    (INFO), vLLM's too (its logger, configured by an engine's start, passes them to its own handler only)."""
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)


def assert_clean_in_process(capfd, caplog, recwarn: Iterable[warnings.WarningMessage]):
    """A command run by `main([...])` in this test, after :func:`capture_command_log`: no third-party record,
    line or visible warning. Returns what it read from `capfd` (its `out` and `err`), for the test's own checks
    of the command's output."""
    assert foreign_records(caplog.records) == [], "\n".join(foreign_records(caplog.records))
    captured = capfd.readouterr()
    assert foreign_lines(captured.err) == [], "\n".join(foreign_lines(captured.err))
    assert log_lines(captured.out) == [], "\n".join(log_lines(captured.out))
    shown = [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in recwarn
             if not issubclass(w.category, HIDDEN_BY_DEFAULT)]
    assert shown == [], "\n".join(shown)
    return captured
