"""Fixtures of the worker process tests (helpers live in worker_harness.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine
from worker_harness import MainProcess

from federation_sender.testing.fake_homeserver import FakeHomeserver
from federation_sender.testing.ports import free_port


@pytest.fixture
async def main_process(pg_engine: AsyncEngine) -> AsyncIterator[MainProcess]:
    mp = MainProcess(pg_engine)
    await mp.start()
    yield mp
    await mp.close()


@pytest.fixture
async def remotes() -> AsyncIterator[FakeHomeserver]:
    hs = FakeHomeserver()
    await hs.start(free_port())
    yield hs
    await hs.close()
