"""Batch test fixtures: one local SparkSession for the whole run (a session costs 5-10 s
to start), and a migrated PostgreSQL database per test."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from federation_sender.batch.session import SessionOptions, build_session
from federation_sender.storage.engine import create_engine
from federation_sender.storage.migrate import upgrade


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    session = build_session(SessionOptions(master="local[2]", shuffle_partitions=2,
                                           app_name="federation-sender-tests",
                                           conf={"spark.sql.codegen.wholeStage": "false",
                                                 "spark.sql.adaptive.enabled": "false"}))
    yield session
    session.stop()


async def _migrate(url: str) -> None:
    eng = create_engine(url)
    try:
        await upgrade(eng)
    finally:
        await eng.dispose()


@pytest.fixture
def batch_db(pg_url: str) -> str:
    """A migrated, empty PostgreSQL database (URL)."""
    asyncio.run(_migrate(pg_url))
    return pg_url
