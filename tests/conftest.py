"""Shared fixtures: a real throwaway PostgreSQL cluster (session-scoped), a fresh
migrated database per test on both PostgreSQL and SQLite, a fake clock, and the queue
harness (``h``, ``hdb``: federation_sender.testing.queue_harness) that the queue, EDU,
intake and storage tests share.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
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

# A test or module that leaves a thread behind fails (tests/thread_leaks.py).
pytest_plugins = ["tests.thread_leaks"]

_db_counter = itertools.count()

# --- Spark's JVMs in tests --------------------------------------------------------------
# Each JVM a test starts (the session's local Spark, the CLI's, the chaos run's audit, the
# Spark Connect server) lives seconds to minutes on tiny data: its optimising (C2) JIT
# compiles code it never runs again, and a parallel GC collects a few MB. The quick JIT
# alone and the serial GC took tests/batch/test_transforms.py from 107 to 62 CPU seconds
# (63 to 51 s) on the 2-core machine; results cannot differ, only speed. spark-submit adds
# SPARK_SUBMIT_OPTS to every driver it starts (pyspark starts its gateway through it).
# Benchmarks and operators keep the JVM's defaults. An operator's own setting wins.
os.environ.setdefault("SPARK_SUBMIT_OPTS", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")

# --- The service-free selection ---------------------------------------------------------
# FEDERATION_SENDER_SERVICE_FREE=1 (scripts/other-pythons.sh, on Python 3.12 and 3.13)
# runs only the tests that need none of the services scripts/bootstrap.sh installs
# (PostgreSQL, Redis, Java and Spark, Chromium, Synapse, tinyproxy) and deselects the rest:
# deselected, not skipped, since under CI a missing prerequisite fails (prereq.py). Unset,
# nothing here changes the run.
SERVICE_FREE = os.environ.get("FEDERATION_SENDER_SERVICE_FREE", "") not in ("", "0")
_SERVICE_MARKERS = {"postgres", "spark"}
# Fixtures that start a service (a test using one, directly or through another fixture).
_SERVICE_FIXTURES = {
    "pg_cluster": "PostgreSQL",
    "private_pg_cluster": "PostgreSQL",
    "redis_server": "Redis",
    "synapse_deployment": "Synapse",
    "contract_synapse_template": "Synapse",
    "synapse_redactor": "Synapse",  # tests/test_pruning.py: Synapse's virtualenv
}
# Parameters that pick a backend on PostgreSQL (db_url, storage/conftest.py's subject).
_POSTGRES_PARAMS = {"postgresql", "native-postgresql", "synapse-postgresql"}
# Under tests/: what runs a service with no fixture or marker above to say so (not
# collected at all).
_SERVICE_PATHS = {
    "synapse/": "Synapse",
    "storage/synapse/": "Synapse",
    "batch/": "Spark",
    "transport/test_synapse_interop.py": "Synapse",
    "testing/test_synapse_compose_config.py": "Synapse",
    "replication/test_repl_redis.py": "Redis",
    "transport/test_forward_proxy.py": "tinyproxy",
    "admin/test_admin_dashboard.py": "Chromium",
    # No service, but a wheel build and a virtualenv: other-pythons.sh's runtime install
    # and demo are this test on those interpreters.
    "test_install.py": "a runtime install",
    # No service, but the dev extra's schemathesis (and a process of its own, test.sh).
    "reliability/test_rel_admin_schemathesis.py": "schemathesis",
}
_TESTS = Path(__file__).resolve().parent


def _service_path(path: Path) -> str | None:
    try:
        relative = path.resolve().relative_to(_TESTS).as_posix()
    except ValueError:
        return None
    for prefix, service in _SERVICE_PATHS.items():
        if relative + "/" == prefix or relative == prefix or (
            prefix.endswith("/") and relative.startswith(prefix)
        ):
            return service
    return None


def pytest_ignore_collect(collection_path: Path) -> bool | None:
    """Not even imported: these modules import what the service-free run lacks
    (pyspark, schemathesis)."""
    if SERVICE_FREE and _service_path(collection_path) is not None:
        return True
    return None


def _needs_a_service(item: pytest.Item) -> str | None:
    for marker in _SERVICE_MARKERS:
        if item.get_closest_marker(marker) is not None:
            return marker
    for name in getattr(item, "fixturenames", ()):
        if name in _SERVICE_FIXTURES:
            return _SERVICE_FIXTURES[name]
    callspec = getattr(item, "callspec", None)
    if callspec is not None and _POSTGRES_PARAMS & {str(v) for v in callspec.params.values()}:
        return "PostgreSQL"
    return None


LONG_MODULES: dict[str, int] = {
    "reliability/test_rel_chaos.py": 104,
    "batch/test_synapse_remote.py": 110,
    "synapse/test_catchup_pacing.py": 71,
    "test_install.py": 60,
    "batch/test_cluster.py": 60,
    "batch/test_jobs.py": 57,
    "reliability/test_rel_hostile.py": 53,
    "batch/test_sqlite.py": 52,
    "synapse/test_synapse_chaos.py": 50,
    "synapse/test_event_persisters.py": 43,
    "batch/test_bilateral_synapse.py": 42,
    "batch/test_bilateral.py": 42,
    "synapse/test_backend_withholding.py": 40,
    "batch/test_synapse_jobs.py": 40,
    "synapse/test_return_probe_synapse.py": 39,
    "batch/test_connect.py": 37,
    "batch/test_defects.py": 29,
    "test_config.py": 28,
    "worker/test_worker_process.py": 27,
    "synapse/test_backend_e2e.py": 25,
    "synapse/test_short_outage.py": 24,
    "worker/test_demo.py": 22,
    "synapse/test_sharded_senders.py": 21,
    "synapse/test_outbound_proxy_e2e.py": 20,
}
"""The longest modules, with their seconds in one sequential run of the suite on the
2-core machine (pytest --durations=0, summed per module). They are collected first,
longest first: scripts/test.sh runs the suite on two pytest-xdist workers a module at
a time (``--dist loadfile``), and a long module handed out last kept one worker busy for
minutes after the other had finished (1,018 s in collection order). Only the order
depends on these figures; a stale one costs time, never a test."""

_TESTS_DIR = Path(__file__).parent


def _module_weight(item: pytest.Item) -> int:
    try:
        rel = item.path.relative_to(_TESTS_DIR).as_posix()
    except ValueError:
        return 0
    return LONG_MODULES.get(rel, 0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Stable: each module's own order and the order of the rest are kept.
    items.sort(key=lambda item: -_module_weight(item))
    if not SERVICE_FREE:
        return
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        (drop if _needs_a_service(item) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.hookimpl(tryfirst=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[object]) -> None:
    """A service-free run that reaches a service anyway (a rule above missed a test)
    fails that test rather than start the service."""
    if SERVICE_FREE and fixturedef.argname in _SERVICE_FIXTURES:
        pytest.fail(f"FEDERATION_SENDER_SERVICE_FREE: this test needs "
                    f"{_SERVICE_FIXTURES[fixturedef.argname]} (tests/conftest.py "
                    f"should deselect it)", pytrace=False)

# py4j logs "Closing down clientserver connection" from __del__ at interpreter exit, after
# pytest closed its capture streams ("--- Logging error ---"); nothing of ours is lost.
logging.getLogger("py4j").setLevel(logging.WARNING)


DEMO_DESTINATIONS = 8


@dataclass(frozen=True)
class DemoRun:
    """One ``federation-sender demo`` run of the session (its own process, as the README
    runs it; --keep-running: the dashboard stays up after the delivery check until
    Ctrl-C)."""

    directory: Path
    """Its working directory (``data/demo/demo.db``, ``data/demo/worker.log``)."""
    port_base: int
    status: int
    output: str
    dashboard_status: int | None
    """What ``/dashboard`` answered once the run was over (None: no answer)."""


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    """The demo, run once for the tests that check it (``tests/worker/test_demo.py``)
    and read its database (``tests/batch/test_sqlite.py``, on a copy)."""
    import signal
    import subprocess
    import sys
    import urllib.request

    from federation_sender.testing.ports import free_port_block
    from federation_sender.testing.waiting import wait_until_blocking

    work = tmp_path_factory.mktemp("demo-run")
    base = free_port_block(10 + DEMO_DESTINATIONS)
    out_path = work / "demo.out"
    with out_path.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "federation_sender", "demo", "--destinations",
             str(DEMO_DESTINATIONS), "--port-base", str(base), "--rooms", "5",
             "--events", "150", "--duration", "8", "--no-live", "--keep-running"],
            stdout=out, stderr=subprocess.STDOUT, text=True, cwd=work,
        )
    dashboard: int | None = None
    try:
        def run_over() -> bool:
            assert proc.poll() is None, out_path.read_text()[-3000:]
            return "still running (--keep-running)" in out_path.read_text()

        wait_until_blocking(run_over, "the demo's run to end", timeout_s=180, every_s=0.2,
                            details=lambda: out_path.read_text()[-3000:])
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{base}/dashboard",
                                        timeout=10) as r:
                dashboard = r.status
        except OSError:
            dashboard = None
    finally:
        proc.send_signal(signal.SIGINT)
        status = proc.wait(timeout=60)
    return DemoRun(work, base, status, out_path.read_text(), dashboard)


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PostgresCluster]:
    try:
        find_pg_bin()
    except PostgresMissing:
        missing("PostgreSQL server binaries (Debian package postgresql)")
    with ephemeral_cluster() as cluster:
        yield cluster


@pytest.fixture
def private_pg_cluster() -> Iterator[PostgresCluster]:
    """A PostgreSQL cluster of the test's own, for a test that restarts it: restarting
    the session's cluster under the session's Synapse left dead connections in Synapse's
    pool, and its next request (another module's registration) answered 500."""
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
