"""Batch test fixtures: one local SparkSession for the whole run (a session costs 5-10 s
to start), a migrated PostgreSQL database per test, and, per module that asks, a Spark
Connect server and a standalone cluster (tests/batch/spark_servers.py), started at once
and awaited by their ``url()``."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from federation_sender.batch.session import SessionOptions, build_session
from federation_sender.storage.engine import create_engine
from federation_sender.storage.migrate import upgrade
from federation_sender.testing.prereq import require_module

from .spark_servers import TINY_DATA_CONF, ConnectServer, StandaloneCluster


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    # The tests' tables have tens of rows: compiling each plan's Java code (whole-stage
    # code generation, and with factoryMode the expressions' too) costs more than the
    # interpreted plan runs. test_transforms.py and test_jobs.py: 134-138 machine CPU
    # seconds with codegen of expressions, 122 without. Results cannot differ.
    session = build_session(SessionOptions(master="local[2]", shuffle_partitions=2,
                                           app_name="federation-sender-tests",
                                           conf=TINY_DATA_CONF))
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


@pytest.fixture(scope="module")
def connect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConnectServer]:
    """A Spark Connect server (``local[2]``, the PostgreSQL JDBC jar) for the module,
    stopped at its end whatever happened."""
    for module in ("grpc", "zstandard"):
        require_module(module, "the Spark Connect client: pip install 'pyspark[connect]'")
    server = ConnectServer(tmp_path_factory.mktemp("spark-connect"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def standalone_cluster(tmp_path_factory: pytest.TempPathFactory
                       ) -> Iterator[StandaloneCluster]:
    """A standalone master and worker for the module, stopped at its end."""
    cluster = StandaloneCluster(tmp_path_factory.mktemp("spark-standalone"))
    try:
        yield cluster
    finally:
        cluster.stop()
