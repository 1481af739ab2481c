"""Start-up's waits and listeners fail with one line that names the place, never the
credentials."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from federation_sender.errors import StartupError
from federation_sender.startup import listen, wait_for_database
from federation_sender.storage.engine import create_engine
from federation_sender.testing.clock import FakeClock
from federation_sender.testing.ports import free_port
from federation_sender.testing.waiting import wait_until


async def test_an_unreachable_database_is_retried_then_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = free_port()  # nothing listens there
    engine = create_engine(f"postgresql+psycopg://u:s3cret@127.0.0.1:{port}/db")
    clock = FakeClock()
    try:
        with caplog.at_level(logging.WARNING, "federation_sender.startup"):
            wait = asyncio.create_task(
                wait_for_database(engine, attempts=2, interval_s=5.0, clock=clock)
            )
            await wait_until(lambda: len(caplog.records), "the first failure's line",
                             timeout_s=30)
            assert not wait.done()  # the first failure waits for the interval
            clock.advance(5.0)
            with pytest.raises(StartupError) as e:
                await wait
    finally:
        await engine.dispose()
    message = str(e.value)
    assert message.startswith(
        f"database postgresql 127.0.0.1:{port}/db unreachable after 2 attempts: "
    )
    assert "\n" not in message and "s3cret" not in message
    assert "attempt 1 of 2" in caplog.text and "s3cret" not in caplog.text


async def test_a_reachable_database_returns_at_once(
    sqlite_url: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """At once: no retry line, and no wait on the clock (a fake clock nobody advances,
    so a wait would never end; the outer timeout turns that into a failure)."""
    engine = create_engine(sqlite_url)
    clock = FakeClock()
    try:
        with caplog.at_level(logging.WARNING, "federation_sender.startup"):
            wait = asyncio.create_task(
                wait_for_database(engine, attempts=3, interval_s=5.0, clock=clock))
            done, _ = await asyncio.wait({wait}, timeout=30)
            assert done == {wait}, f"still waiting ({clock.pending_sleepers} on the clock)"
            wait.result()
    finally:
        await engine.dispose()
    assert clock.pending_sleepers == 0
    assert caplog.records == []


async def test_a_taken_port_is_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]

        async def start() -> object:
            raise OSError(98, "Address already in use")

        with pytest.raises(StartupError, match=rf"^admin: 127.0.0.1:{port} is already in use$"):
            await listen("admin", "127.0.0.1", port, start())  # type: ignore[arg-type]
