"""The teacher's reply cache: a paid call is never paid twice.

Keys come from :meth:`ChatRequest.cache_key`: (backend model, policy version, stage, exact request, teacher
sample index). Only replies that parsed into the stage's schema are stored, so a malformed reply is retried
rather than replayed. :class:`SqliteCache` is one SQLite file in WAL mode: safe for many threads (one
connection per live thread; a dead thread's connection is closed) and for several processes (SQLite's own locking), and it survives a killed run.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Protocol

from eviback.teacher.chat import ChatReply


class ReplyCache(Protocol):
    """Contract: `get` returns the stored reply or None; `put` stores it (last write wins). Thread-safe."""

    def get(self, key: str) -> ChatReply | None: ...

    def put(self, key: str, reply: ChatReply, *, stage: str = "", policy_version: str = "") -> None: ...

    def close(self) -> None: ...


class MemoryCache:
    """An in-process cache (tests, and runs that must not touch the disk)."""

    def __init__(self) -> None:
        self._items: dict[str, ChatReply] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> ChatReply | None:
        with self._lock:
            return self._items.get(key)

    def put(self, key: str, reply: ChatReply, *, stage: str = "", policy_version: str = "") -> None:
        with self._lock:
            self._items[key] = reply

    def __len__(self) -> int:
        return len(self._items)

    def close(self) -> None:
        pass


class SqliteCache:
    """A reply cache in one SQLite file."""

    _SCHEMA = """
        CREATE TABLE IF NOT EXISTS replies (
            key TEXT PRIMARY KEY,
            stage TEXT NOT NULL,
            policy_version TEXT NOT NULL,
            text TEXT NOT NULL,
            prompt_tokens INTEGER NOT NULL,
            completion_tokens INTEGER NOT NULL,
            latency_s REAL NOT NULL,
            created REAL NOT NULL
        )"""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        # each connection with the thread that opened it: a connection whose thread has ended is closed
        # when the next one is opened, so threads that come and go never pile up open files
        self._connections: list[tuple[threading.Thread, sqlite3.Connection]] = []
        self._lock = threading.Lock()
        with self._connect() as db:
            db.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
            db.execute(self._SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            # 60 s busy timeout: a concurrent writer (another thread or process) holds the lock briefly
            db = sqlite3.connect(self.path, timeout=60.0, check_same_thread=False)
            # WAL with synchronous=NORMAL: a commit no longer waits for an fsync (which dominated the cost of a
            # put), and a killed process still loses nothing committed; only an OS crash may lose the last
            # few replies, which are then simply asked again. A per-connection setting.
            db.execute("PRAGMA synchronous=NORMAL")
            self._local.db = db
            with self._lock:
                alive = []
                for thread, other in self._connections:
                    if thread.is_alive():
                        alive.append((thread, other))
                    else:
                        other.close()
                alive.append((threading.current_thread(), db))
                self._connections = alive
        return db

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._connections)

    def get(self, key: str) -> ChatReply | None:
        row = self._connect().execute(
            "SELECT text, prompt_tokens, completion_tokens, latency_s FROM replies WHERE key = ?", (key,)
        ).fetchone()
        return None if row is None else ChatReply(text=row[0], prompt_tokens=row[1], completion_tokens=row[2],
                                                  latency_s=row[3])

    def put(self, key: str, reply: ChatReply, *, stage: str = "", policy_version: str = "") -> None:
        with self._connect() as db:
            db.execute(
                "INSERT OR REPLACE INTO replies VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (key, stage, policy_version, reply.text, reply.prompt_tokens, reply.completion_tokens,
                 reply.latency_s, time.time()),
            )

    def __len__(self) -> int:
        return self._connect().execute("SELECT COUNT(*) FROM replies").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            for _, db in self._connections:
                db.close()
            self._connections.clear()
        self._local = threading.local()
