"""Fixtures for queue tests; the harness itself is federation_sender.testing.queue_harness."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from federation_sender.config import QueueSettings
from federation_sender.storage.engine import create_engine
from federation_sender.storage.migrate import upgrade
from federation_sender.testing.clock import FakeClock
from federation_sender.testing.fake_homeserver import FakeHomeserver
from federation_sender.testing.http_sender import HttpTransactionSender
from federation_sender.testing.queue_harness import ME, Harness
from federation_sender.testing.queue_writer import HomeserverWriter


async def _harness(
    url: str, clock: FakeClock, settings: QueueSettings | None = None
) -> AsyncIterator[Harness]:
    engine = create_engine(url)
    await upgrade(engine)
    fake = FakeHomeserver()
    await fake.start()
    sender = HttpTransactionSender(fake.url, ME, clock, timeout_s=20)
    h = Harness(engine, clock, fake, sender, HomeserverWriter(engine, ME),
                settings or replace(QueueSettings(), wakeup_interval_s=60.0))
    try:
        yield h
    finally:
        if h.manager is not None:
            await h.manager.stop(0.0)
        await sender.close()
        await fake.close()
        await engine.dispose()


@pytest.fixture
async def h(sqlite_url: str, clock: FakeClock) -> AsyncIterator[Harness]:
    async for x in _harness(sqlite_url, clock):
        yield x


@pytest.fixture
async def hdb(db_url: str, clock: FakeClock) -> AsyncIterator[Harness]:
    """The harness on both SQLite and PostgreSQL."""
    async for x in _harness(db_url, clock):
        yield x


