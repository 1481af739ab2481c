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
    # The tests' tables have tens of rows: compiling each plan's Java code (whole-stage
    # code generation, and with factoryMode the expressions' too) costs more than the
    # interpreted plan runs. test_transforms.py and test_jobs.py: 134-138 machine CPU
    # seconds with codegen of expressions, 122 without. Results cannot differ.
    session = build_session(SessionOptions(master="local[2]", shuffle_partitions=2,
                                           app_name="federation-sender-tests",
                                           conf={"spark.sql.codegen.wholeStage": "false",
                                                 "spark.sql.adaptive.enabled": "false",
                                                 "spark.sql.codegen.factoryMode": "NO_CODEGEN"}))
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
