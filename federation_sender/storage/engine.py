"""Async engines for PostgreSQL (psycopg 3) and SQLite (aiosqlite), and bounded retry
of transient database errors.

Transient errors are those where running the same transaction again may succeed:
connection lost, server shutting down or restarting, serialization failures and
deadlocks, SQLite's "database is locked". They are retried with jittered exponential
backoff a bounded number of times, each retry logged. Anything else (constraint
violations, programming errors) surfaces at once.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    wait_random_exponential,
)

from federation_sender.errors import LocalPermanentError, LocalTransientError

log = logging.getLogger(__name__)

T = TypeVar("T")

# SQLSTATE classes/codes that mean "try again": connection exceptions (08),
# serialization failure, deadlock, admin shutdown, crash shutdown, cannot connect now.
_TRANSIENT_SQLSTATES = {"40001", "40P01", "57P01", "57P02", "57P03"}


def db_outage(exc: BaseException) -> str | None:
    """One line for a transient database error (the database restarting or out of
    reach: an expected operational error, logged without a traceback); ``None`` for
    anything else."""
    if not is_transient_db_error(exc):
        return None
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def is_transient_db_error(exc: BaseException) -> bool:
    if isinstance(exc, LocalTransientError):
        return True
    if not isinstance(exc, DBAPIError):
        return False
    if exc.connection_invalidated:
        return True
    orig = exc.orig
    sqlstate = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    if isinstance(sqlstate, str) and (
        sqlstate.startswith("08") or sqlstate in _TRANSIENT_SQLSTATES
    ):
        return True
    if isinstance(exc, OperationalError):
        text = str(orig).lower()
        return any(
            s in text
            for s in (
                "database is locked",
                "connection refused",
                # A connect while the server restarts: psycopg's "connection failed:
                # ... failed: Connection reset by peer" (seen in the chaos beside Synapse).
                "connection reset by peer",
                "server closed the connection",
                "terminating connection",
                "the database system is starting up",
                "the database system is shutting down",
                "connection is closed",
                "consuming input failed",
            )
        )
    return False


def normalise_url(url: str) -> str:
    """Pick the async driver for a plain ``postgresql://`` or ``sqlite:///`` URL."""
    u = make_url(url)
    if u.drivername in ("postgresql", "postgres", "postgresql+psycopg2"):
        u = u.set(drivername="postgresql+psycopg")
    elif u.drivername == "sqlite":
        u = u.set(drivername="sqlite+aiosqlite")
    return u.render_as_string(hide_password=False)


def is_sqlite(engine_or_url: AsyncEngine | str) -> bool:
    url = engine_or_url if isinstance(engine_or_url, str) else str(engine_or_url.url)
    return make_url(url).get_backend_name() == "sqlite"


def create_engine(url: str, *, pool_size: int = 10, echo: bool = False) -> AsyncEngine:
    """Create an async engine; for SQLite, create the parent directory and enable WAL."""
    url = normalise_url(url)
    u = make_url(url)
    if u.get_backend_name() == "sqlite":
        if u.database and u.database != ":memory:":
            Path(u.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_async_engine(url, echo=echo, connect_args={"timeout": 30})

        @event.listens_for(engine.sync_engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    if u.get_backend_name() != "postgresql":
        raise LocalPermanentError(f"unsupported database URL scheme {u.drivername!r}")
    return create_async_engine(
        url,
        echo=echo,
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_pre_ping=True,
        pool_recycle=1800,
    )


def _log_retry(state: RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome else None
    log.warning(
        "transient database error, retrying (attempt %d): %s",
        state.attempt_number,
        type(exc).__name__ if exc else "?",
    )


async def run_in_transaction(
    engine: AsyncEngine,
    fn: Callable[[AsyncConnection], Awaitable[T]],
    *,
    attempts: int = 5,
    max_wait_s: float = 2.0,
) -> T:
    """Run ``fn`` in one transaction, retrying the whole transaction on transient errors.

    ``fn`` must be safe to re-run: it must not have side effects outside the
    transaction.
    """
    retrying = AsyncRetrying(
        retry=retry_if_exception(is_transient_db_error),
        stop=stop_after_attempt(attempts),
        wait=wait_random_exponential(multiplier=0.05, max=max_wait_s),
        before_sleep=_log_retry,
        reraise=True,
    )
    async for attempt in retrying:
        with attempt:
            async with engine.begin() as conn:
                return await fn(conn)
    raise AssertionError("unreachable")  # pragma: no cover


async def ping(engine: AsyncEngine) -> None:
    """One round trip (``SELECT 1``); raises the driver's error when unreachable."""
    async with engine.connect() as conn:
        await conn.execute(text("SELECT 1"))
