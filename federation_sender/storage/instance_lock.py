"""One process per instance name: a lock taken at start and held for the worker's life.

Two processes running as the same instance (two copies of ``fed1``) would both read
the same events and both send them: receivers get duplicates and nothing notices.
So before anything is sent the worker takes a lock keyed on its instance name, and a
second copy refuses to start with one line (:class:`StartupError`, exit status 1).

* **PostgreSQL** (Synapse's database beside Synapse, or our own): a session-level
  advisory lock, ``pg_try_advisory_lock(classid, objid)`` with ``classid`` fixed for
  this program and ``objid`` derived from the instance name (:func:`lock_key`), on a
  dedicated connection (autocommit, outside the engine's pool, ``application_name``
  ``federation-sender <instance> lock``) that stays open for the worker's life. The
  refusal names the holder's backend pid and client address from ``pg_stat_activity``.
  The session asks the server for TCP keepalives (10 s idle, 5 s apart, 3 probes):
  when the holder's host vanishes without closing the connection, the server ends the
  session and frees the lock within about 25 s. Connect directly or through a pooler in
  session mode: a transaction-mode pooler cannot hold a session lock.
  A session lock lives exactly as long as its connection, so the holder checks the
  connection every ``check_interval_s`` (a ``SELECT 1`` bounded by ``timeout_s``).
  When it is gone (the server restarted, the backend was terminated, the network
  dropped) the lock is gone with it and another copy could take it: the worker
  reconnects and takes the lock again, for at most ``retake_for_s``; if another
  process holds it by then, or the database stays unreachable, :meth:`hold` raises
  :class:`InstanceLockLost` and the worker stops at once (in-flight transactions are
  not waited for). The window in which a lost lock goes unnoticed is at most
  ``check_interval_s + timeout_s``.
* **SQLite**: an exclusive ``flock`` on ``<database file>.<instance>.lock`` beside the
  database file, held by the open file for the process's life (the kernel releases it
  when the process ends, SIGKILL included); nothing can drop it while the process
  lives. Processes on other machines cannot share a SQLite file, so this covers every
  case. An in-memory database takes no lock.

Synapse's own ``federation_sender`` worker takes no such lock: a copy of ours beside
Synapse's own worker under the same name is **not** detected (docs/synapse.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
from pathlib import Path
from typing import IO, Any

from sqlalchemy.engine import URL, make_url

from federation_sender.clock import Clock
from federation_sender.errors import LocalPermanentError, StartupError

log = logging.getLogger(__name__)

LOCK_CLASS = int.from_bytes(hashlib.sha256(b"federation-sender instance").digest()[:4], "big",
                            signed=True)
"""The advisory lock's first key (``pg_locks.classid``), the same for every instance."""


def lock_key(instance_name: str) -> tuple[int, int]:
    """``(classid, objid)`` of the instance's advisory lock (two signed 32-bit keys)."""
    objid = int.from_bytes(hashlib.sha256(instance_name.encode()).digest()[:4], "big",
                           signed=True)
    return LOCK_CLASS, objid


SERVER_KEEPALIVES = (
    "SET tcp_keepalives_idle = 10; SET tcp_keepalives_interval = 5;"
    " SET tcp_keepalives_count = 3"
)
"""Per-session settings of the lock's connection (ignored on a Unix socket)."""


class InstanceLockLost(LocalPermanentError):
    """The lock's connection ended and the lock could not be taken again."""


def _where(url: URL) -> str:
    return f"postgresql {url.host or 'localhost'}:{url.port or 5432}/{url.database or ''}"


def _conninfo(url: URL) -> str:
    """A libpq URI for psycopg from the engine's URL (driver name dropped)."""
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


class PostgresInstanceLock:
    """See the module docstring (PostgreSQL)."""

    def __init__(
        self,
        url: URL | str,
        instance_name: str,
        clock: Clock,
        *,
        check_interval_s: float = 2.0,
        timeout_s: float = 5.0,
        retake_for_s: float = 30.0,
    ) -> None:
        self.url = make_url(url) if isinstance(url, str) else url
        self.instance_name = instance_name
        self.key = lock_key(instance_name)
        self._clock = clock
        self.check_interval_s = check_interval_s
        self.timeout_s = timeout_s
        self.retake_for_s = retake_for_s
        self._conn: Any = None
        self.retaken = 0
        """How many times the lock was taken again after its connection ended."""

    async def _connect(self) -> Any:
        import psycopg

        conn = await asyncio.wait_for(
            psycopg.AsyncConnection.connect(
                _conninfo(self.url),
                autocommit=True,
                connect_timeout=max(1, int(self.timeout_s)),
                application_name=f"federation-sender {self.instance_name} lock"[:63],
            ),
            self.timeout_s + 1,
        )
        try:
            # The server ends this session (and frees the lock) about 25 s after our
            # host vanished, instead of after the system's keepalive default (hours).
            await asyncio.wait_for(conn.execute(SERVER_KEEPALIVES), self.timeout_s)
        except BaseException:
            await conn.close()
            raise
        return conn

    async def _try_lock(self, conn: Any) -> bool:
        cur = await conn.execute("SELECT pg_try_advisory_lock(%s, %s)", self.key)
        row = await cur.fetchone()
        return bool(row and row[0])

    async def _holder(self, conn: Any) -> str:
        cur = await conn.execute(
            "SELECT l.pid, a.client_addr, a.application_name FROM pg_locks l"
            " LEFT JOIN pg_stat_activity a ON a.pid = l.pid"
            " WHERE l.locktype = 'advisory' AND l.granted"
            " AND l.classid = (%s::int)::oid AND l.objid = (%s::int)::oid AND l.objsubid = 2",
            self.key,
        )
        row = await cur.fetchone()
        if row is None:
            return "a backend that has just released it"
        pid, addr, app = row
        where = f"backend pid {pid}"
        if addr is not None:
            where += f", client {addr}"
        if app:
            where += f", {app!r}"
        return where

    async def acquire(self) -> None:
        """Take the lock or raise :class:`StartupError` naming who holds it."""
        conn = await self._connect()
        try:
            if not await self._try_lock(conn):
                holder = await self._holder(conn)
                raise StartupError(
                    f"another process is running as instance {self.instance_name!r}: it "
                    f"holds the instance lock on {_where(self.url)} ({holder}); two "
                    "senders of one instance send every event twice: stop it first"
                )
        except BaseException:
            await conn.close()
            raise
        self._conn = conn
        log.info("took the instance lock of %r on %s", self.instance_name, _where(self.url))

    async def _alive(self) -> bool:
        conn = self._conn
        if conn is None or conn.closed:
            return False
        try:
            await asyncio.wait_for(conn.execute("SELECT 1"), self.timeout_s)
        except Exception:  # any failure of the connection: the lock may be gone
            return False
        return True

    async def hold(self) -> None:
        """Check the connection every ``check_interval_s``; take the lock again when it
        ended, or raise :class:`InstanceLockLost`. Runs until cancelled."""
        while True:
            await self._clock.sleep(self.check_interval_s)
            if await self._alive():
                continue
            log.warning(
                "the connection holding the instance lock of %r ended; taking it again",
                self.instance_name,
            )
            await self._drop()
            await self._retake()

    async def _retake(self) -> None:
        deadline = self._clock.monotonic_s() + self.retake_for_s
        reason = "the database stayed unreachable"
        while True:
            try:
                conn = await self._connect()
            except Exception as e:  # unreachable: retried until the deadline
                reason = f"the database stayed unreachable ({type(e).__name__})"
            else:
                try:
                    if await self._try_lock(conn):
                        self._conn = conn
                        self.retaken += 1
                        log.warning("took the instance lock of %r again", self.instance_name)
                        return
                    holder = await self._holder(conn)
                except Exception as e:  # the new connection failed too
                    reason = f"the database stayed unreachable ({type(e).__name__})"
                else:
                    await conn.close()
                    raise InstanceLockLost(
                        f"lost the instance lock of {self.instance_name!r}: another "
                        f"process took it ({holder}); stopping"
                    )
                with contextlib.suppress(Exception):
                    await conn.close()
            if self._clock.monotonic_s() >= deadline:
                raise InstanceLockLost(
                    f"lost the instance lock of {self.instance_name!r}: {reason} for "
                    f"{self.retake_for_s:g} s; stopping"
                )
            await self._clock.sleep(1.0)

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()

    async def release(self) -> None:
        """Close the connection (the server releases the lock with it)."""
        await self._drop()


def _lock_file_name(instance_name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", instance_name)[:100] or "_"


class SqliteInstanceLock:
    """See the module docstring (SQLite)."""

    def __init__(self, database: str, instance_name: str) -> None:
        self.path = Path(f"{database}.{_lock_file_name(instance_name)}.lock")
        self.instance_name = instance_name
        self._file: IO[bytes] | None = None

    async def acquire(self) -> None:
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        # A local file, opened once at start (no await would help); held for good.
        f = open(self.path, "ab")  # noqa: SIM115, ASYNC230
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise StartupError(
                f"another process is running as instance {self.instance_name!r} on this "
                f"database: it holds {self.path}; two senders of one instance send every "
                "event twice: stop it first"
            ) from None
        self._file = f

    async def hold(self) -> None:
        """Nothing can drop a lock held by an open file; waits until cancelled."""
        await asyncio.Event().wait()

    async def release(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            f.close()


InstanceLock = PostgresInstanceLock | SqliteInstanceLock


def instance_lock(url: URL | str, instance_name: str, clock: Clock) -> InstanceLock | None:
    """The lock for a database URL (None for an in-memory SQLite database)."""
    u = make_url(url) if isinstance(url, str) else url
    if u.get_backend_name() == "sqlite":
        if not u.database or u.database == ":memory:" or u.database.startswith("file::memory"):
            return None
        return SqliteInstanceLock(u.database, instance_name)
    return PostgresInstanceLock(u, instance_name, clock)
