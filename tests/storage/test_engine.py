from __future__ import annotations

import logging

import pytest
from sqlalchemy import insert, select, text
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from federation_sender.storage import schema
from federation_sender.storage.engine import (
    create_engine,
    is_transient_db_error,
    normalise_url,
    run_in_transaction,
)
from federation_sender.testing.postgres import PostgresCluster


@pytest.mark.parametrize("message, transient", [
    ('connection failed: connection to server at "127.0.0.1", port 20169 failed: '
     "Connection reset by peer\n\tIs the server running on that host and accepting "
     "TCP/IP connections?", True),
    ("connection failed: connection refused", True),
    ("FATAL: the database system is starting up", True),
    ('FATAL: password authentication failed for user "x"', False),
])
def test_connect_errors_while_the_server_restarts_are_transient(
    message: str, transient: bool
) -> None:
    """A connect while PostgreSQL restarts can be reset rather than refused; both are
    an outage (one line, retried), a refused password is not."""
    exc = OperationalError("SELECT 1", {}, Exception(message))
    assert is_transient_db_error(exc) is transient


def test_normalise_url_picks_async_drivers() -> None:
    assert normalise_url("postgresql://u@h/db").startswith("postgresql+psycopg://")
    assert normalise_url("sqlite:///x.db").startswith("sqlite+aiosqlite://")


async def test_permanent_error_surfaces_at_once(engine: AsyncEngine) -> None:
    calls = 0

    async def fn(conn: AsyncConnection) -> None:
        nonlocal calls
        calls += 1
        await conn.execute(insert(schema.destinations).values(destination="dup"))
        await conn.execute(insert(schema.destinations).values(destination="dup"))

    with pytest.raises(IntegrityError):
        await run_in_transaction(engine, fn)
    assert calls == 1
    async with engine.connect() as conn:
        assert (await conn.execute(select(schema.destinations))).first() is None


async def test_connection_killed_mid_transaction_is_retried(
    pg_engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    calls = 0

    async def fn(conn: AsyncConnection) -> int:
        nonlocal calls
        calls += 1
        await conn.execute(insert(schema.destinations).values(destination=f"d{calls}"))
        if calls == 1:
            # Kill our own backend: the server drops the connection under us.
            await conn.execute(text("SELECT pg_terminate_backend(pg_backend_pid())"))
        return calls

    with caplog.at_level(logging.WARNING):
        assert await run_in_transaction(pg_engine, fn) == 2
    assert "transient database error" in caplog.text
    async with pg_engine.connect() as conn:
        rows = (await conn.execute(select(schema.destinations.c.destination))).scalars().all()
    assert rows == ["d2"]  # the first attempt's write was rolled back


async def test_unreachable_database_gives_up_after_bounded_attempts() -> None:
    eng = create_engine("postgresql://nobody@127.0.0.1:1/none")
    calls = 0

    async def fn(conn: AsyncConnection) -> None:
        nonlocal calls
        calls += 1

    try:
        with pytest.raises(Exception) as ei:
            await run_in_transaction(eng, fn, attempts=3, max_wait_s=0.01)
        assert is_transient_db_error(ei.value)
        assert calls == 0
    finally:
        await eng.dispose()


async def test_database_restart_is_survived(private_pg_cluster: PostgresCluster) -> None:
    from federation_sender.storage.migrate import upgrade

    eng = create_engine(private_pg_cluster.create_database("restarted"))
    try:
        await upgrade(eng)
        private_pg_cluster.restart()

        async def fn(conn: AsyncConnection) -> int:
            return int((await conn.execute(text("SELECT 1"))).scalar_one())

        assert await run_in_transaction(eng, fn) == 1
    finally:
        await eng.dispose()
