"""Shared fixtures: a real throwaway PostgreSQL cluster (session-scoped), a fresh
migrated database per test on both PostgreSQL and SQLite, and a fake clock.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.storage.engine import create_engine
from federation_sender.storage.migrate import upgrade
from federation_sender.testing.clock import FakeClock
from federation_sender.testing.postgres import PostgresCluster, ephemeral_cluster

_db_counter = itertools.count()

# py4j logs "Closing down clientserver connection" from __del__ at interpreter exit, after
# pytest closed its capture streams ("--- Logging error ---"); nothing of ours is lost.
logging.getLogger("py4j").setLevel(logging.WARNING)


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PostgresCluster]:
    with ephemeral_cluster() as cluster:
        yield cluster


@pytest.fixture
def pg_url(pg_cluster: PostgresCluster) -> str:
    """URL of a new, empty PostgreSQL database."""
    return pg_cluster.create_database(f"t{next(_db_counter)}")


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/test.db"


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest) -> str:
    """An empty database URL, once for each backend."""
    if request.param == "sqlite":
        return str(request.getfixturevalue("sqlite_url"))
    return str(request.getfixturevalue("pg_url"))


@pytest.fixture
async def engine(db_url: str) -> AsyncIterator[AsyncEngine]:
    """A migrated database on each backend."""
    eng = create_engine(db_url)
    await upgrade(eng)
    yield eng
    await eng.dispose()


@pytest.fixture
async def pg_engine(pg_url: str) -> AsyncIterator[AsyncEngine]:
    """A migrated PostgreSQL database only."""
    eng = create_engine(pg_url)
    await upgrade(eng)
    yield eng
    await eng.dispose()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
