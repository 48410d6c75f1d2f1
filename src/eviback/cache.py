"""The eviback cache: where converted models, indexes, warm starts, judges and measurements live
(`$EVIBACK_CACHE`, default `~/.cache/eviback`), and the lock that keeps two processes from building the same
cached artifact at once. The lowest layer: it imports nothing of eviback."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock


def cache_dir() -> Path:
    """Where converted models, indexes and warm starts are cached (`$EVIBACK_CACHE`)."""
    return Path(os.environ.get("EVIBACK_CACHE", Path.home() / ".cache" / "eviback"))


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive inter-process lock (so two processes never build the same cached artifact at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(path, thread_local=False):
        yield
