"""The reply cache that makes a resumed E2E-APE run free: what was committed survives a killed process.

(The cache runs SQLite in WAL mode with synchronous=NORMAL: commits skip the fsync, which is safe against a
process kill, the failure a resumable run is built for.)"""

import os
import signal
import subprocess
import sys
import textwrap

from eviback.teacher.cache import SqliteCache
from eviback.teacher.chat import ChatReply


def test_replies_survive_a_killed_process(tmp_path):
    path = tmp_path / "replies.sqlite"
    child = textwrap.dedent(f"""
        import os, signal
        from eviback.teacher.cache import SqliteCache
        from eviback.teacher.chat import ChatReply
        cache = SqliteCache({str(path)!r})
        for i in range(50):
            cache.put(f"key{{i}}", ChatReply(text=f"reply {{i}}", prompt_tokens=i, completion_tokens=1), stage="A")
        os.kill(os.getpid(), signal.SIGKILL)  # no close, no clean exit
    """)
    done = subprocess.run([sys.executable, "-c", child], env={**os.environ}, check=False)
    assert done.returncode == -signal.SIGKILL
    cache = SqliteCache(path)
    assert len(cache) == 50 and cache.get("key49") == ChatReply(text="reply 49", prompt_tokens=49, completion_tokens=1)
    assert cache._connect().execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
    cache.close()
