"""Shared fixtures: a real throwaway PostgreSQL cluster (session-scoped), a fresh
migrated database per test on both PostgreSQL and SQLite, a fake clock, and the queue
harness (``h``, ``hdb``: federation_sender.testing.queue_harness) that the queue, EDU,
intake and storage tests share.
"""

from __future__ import annotations

import itertools
import logging
import shutil
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.config import QueueSettings
from federation_sender.storage.engine import create_engine
from federation_sender.storage.migrate import upgrade
from federation_sender.testing.certs import LoopbackCA
from federation_sender.testing.clock import FakeClock
from federation_sender.testing.fake_homeserver import FakeHomeserver
from federation_sender.testing.http_sender import HttpTransactionSender
from federation_sender.testing.postgres import (
    PostgresCluster,
    PostgresMissing,
    ephemeral_cluster,
    find_pg_bin,
)
from federation_sender.testing.prereq import missing
from federation_sender.testing.queue_harness import ME, Harness
from federation_sender.testing.queue_writer import HomeserverWriter
from federation_sender.testing.redis_server import RedisServer, ephemeral_redis
from federation_sender.testing.synapse_config import RedisAddress
from federation_sender.testing.synapse_deployment import SynapseDeployment, create_deployment
from federation_sender.testing.synapse_peer import PeerNetwork

_db_counter = itertools.count()

# py4j logs "Closing down clientserver connection" from __del__ at interpreter exit, after
# pytest closed its capture streams ("--- Logging error ---"); nothing of ours is lost.
logging.getLogger("py4j").setLevel(logging.WARNING)


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PostgresCluster]:
    try:
        find_pg_bin()
    except PostgresMissing:
        missing("PostgreSQL server binaries (Debian package postgresql)")
    with ephemeral_cluster() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A throwaway redis-server on loopback for the whole session."""
    if shutil.which("redis-server") is None:
        missing("redis-server")
    with ephemeral_redis() as server:
        yield server


@pytest.fixture(scope="session")
def loopback_ca(tmp_path_factory: pytest.TempPathFactory) -> LoopbackCA:
    """The CA behind every certificate of the Synapse deployment and its peers."""
    return LoopbackCA.create(tmp_path_factory.mktemp("loopback-ca"))


@pytest.fixture(scope="session")
def synapse_deployment(
    pg_cluster: PostgresCluster,
    redis_server: RedisServer,
    loopback_ca: LoopbackCA,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[SynapseDeployment]:
    """Synapse 1.163 main on PostgreSQL and Redis, shared by the session.

    Main runs; no federation sender does. A test that starts one (Synapse's own, with
    ``start_federation_sender()``, or ours as ``instance_name``) stops it again. Another
    Synapse deployment needs a Redis of its own (``ephemeral_redis()``): Synapse's
    external cache keys (``cache_v1:get_joined_hosts:<state group>``) are not per server.
    """
    deployment = create_deployment(
        tmp_path_factory.mktemp("synapse"),
        ca=loopback_ca,
        cluster=pg_cluster,
        database_name="synapse_session",
        redis=RedisAddress(redis_server.host, redis_server.port),
    )
    deployment.start()
    yield deployment
    deployment.stop()


@pytest.fixture(scope="module")
def network(
    loopback_ca: LoopbackCA, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PeerNetwork]:
    """Fake remote servers for this module, joining the session's Synapse over
    federation."""
    with PeerNetwork(loopback_ca, tmp_path_factory.mktemp("peers")) as net:
        yield net


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
