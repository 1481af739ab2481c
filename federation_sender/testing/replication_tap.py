"""Listen to a deployment's Redis replication channel and record every line.

Synapse's processes publish their replication commands on the channel named after the
server (``RDATA caches master 12 [...]``, ``REMOTE_SERVER_UP ...``, ``POSITION ...``).
A :class:`ReplicationTap` subscribes from a background thread and keeps the lines in
arrival order; :meth:`ReplicationTap.wait_for` blocks until a predicate over them holds,
woken by each line (no sleeps). Tests use it to see what main or a sender published,
e.g. main's ``get_destination_retry_timings`` invalidation when a remote contacts it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import redis

DEFAULT_WAIT_S = 30.0


def cache_invalidations(line: str, cache: str) -> tuple[str, list[Any]] | None:
    """``(instance, keys)`` when ``line`` is ``RDATA caches <instance> <t> [cache, keys, ts]``."""
    parts = line.split(" ", 4)
    if len(parts) != 5 or parts[:2] != ["RDATA", "caches"]:
        return None
    try:
        row = json.loads(parts[4])
    except ValueError:
        return None
    if not isinstance(row, list) or not row or row[0] != cache:
        return None
    keys = row[1] if len(row) > 1 and isinstance(row[1], list) else []
    return parts[2], keys


class ReplicationTap:
    def __init__(self, redis_url: str, channel: str) -> None:
        self._client = redis.Redis.from_url(redis_url)
        self._pubsub = self._client.pubsub(ignore_subscribe_messages=True)
        self._pubsub.subscribe(channel)  # subscribed before __init__ returns
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, name="replication-tap", daemon=True)
        self._thread.start()

    def __enter__(self) -> ReplicationTap:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _read(self) -> None:
        while not self._stop.is_set():
            message = self._pubsub.get_message(timeout=0.2)
            if message is None:
                continue
            data = message["data"]
            line = data.decode(errors="replace") if isinstance(data, bytes) else str(data)
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()

    def wait_for(
        self,
        predicate: Callable[[list[str]], bool],
        timeout_s: float = DEFAULT_WAIT_S,
        what: str = "",
    ) -> None:
        """Block until ``predicate(lines)`` holds."""
        with self._cond:
            if not self._cond.wait_for(lambda: predicate(self.lines), timeout_s):
                raise TimeoutError(f"not on the channel within {timeout_s:.0f} s: {what}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._pubsub.close()
        self._client.close()
