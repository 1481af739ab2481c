"""A real Synapse deployment (the pinned release) on loopback: main on PostgreSQL and
Redis, workers.

Theory of operation
-------------------
:func:`create_deployment` writes a deployment into a directory: a signing key, a
certificate from the test CA for ``localhost``, ``homeserver.yaml`` and the worker
file of Synapse's own federation sender (``<instance>.yaml``). Main runs with
``federation_sender_instances: [<instance>]``, so it never sends federation traffic
itself; whoever runs as that instance does -- Synapse's own worker
(:meth:`SynapseDeployment.start_federation_sender`) or ours, given the paths, URLs
and instance name this object exposes. Main does not notice which. With
``event_persisters=N``, N generic workers (``persister1``...) persist the events
(``stream_writers.events``) and :meth:`SynapseDeployment.start` starts them after main.

The database is a fresh one in the caller's PostgreSQL cluster, created from
``template0`` with UTF8 and C collation as Synapse requires; Redis is the caller's.
Without a cluster Synapse uses SQLite and without Redis there are no workers (main
sends federation itself): enough for one-process interop tests.

Processes are Synapse's own (``python -m synapse.app.homeserver`` /
``synapse.app.generic_worker`` from the pinned virtualenv, see
:mod:`federation_sender.testing.synapse_install`); each logs into the directory
(``main.log``, ``<instance>.log``) and is ready when its ``/health`` answers 200.
Stopping is SIGTERM, then SIGKILL after 10 s; ``kill=True`` goes straight to SIGKILL
(a crash). The API is blocking so tests, fixtures and ``bench/`` scripts share it;
async callers use ``asyncio.to_thread``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import secrets
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from federation_sender.clock import SystemClock
from federation_sender.testing.certs import CertFiles, LoopbackCA
from federation_sender.testing.ports import free_port
from federation_sender.testing.postgres import PostgresCluster
from federation_sender.testing.synapse_client import SynapseClient
from federation_sender.testing.synapse_config import (
    EventPersister,
    PostgresDatabase,
    RedisAddress,
    SynapseLayout,
    SynapsePorts,
    homeserver_config,
    log_config,
    persister_config,
    worker_config,
)
from federation_sender.testing.synapse_install import synapse_python
from federation_sender.transport.signing import generate_key_file

START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 10.0
DEFAULT_INSTANCE = "fed1"


class SynapseStartError(RuntimeError):
    """A Synapse process exited or did not become healthy; carries its log's tail."""


@dataclass
class SynapseProcess:
    """One Synapse process (main or a worker) with its log file and health URL."""

    name: str
    args: list[str]
    cwd: Path
    log_path: Path
    health_url: str
    popen: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self.popen is None else self.popen.pid

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "<no log>"

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        if self.running:
            return
        stdout = self.cwd / f"{self.name}.stdout"
        with open(stdout, "ab") as out:
            self.popen = subprocess.Popen(
                self.args, cwd=self.cwd, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )  # fmt: skip
        self._wait_healthy(timeout_s, stdout)

    def _wait_healthy(self, timeout_s: float, stdout: Path) -> None:
        assert self.popen is not None
        clock = SystemClock()
        deadline = clock.monotonic_s() + timeout_s
        while clock.monotonic_s() < deadline:
            if self.popen.poll() is not None:
                tail = stdout.read_text(errors="replace")[-2000:] + self.log_tail(2000)
                raise SynapseStartError(f"Synapse {self.name} exited at start:\n{tail}")
            try:
                with urllib.request.urlopen(self.health_url, timeout=1) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            # Polling a child's port; waiting on the child notices an early exit at once.
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(0.1)
        self.stop(kill=True)
        raise SynapseStartError(
            f"Synapse {self.name} not healthy in {timeout_s:.0f} s:\n{self.log_tail()}"
        )

    def stop(self, *, kill: bool = False) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        if kill:
            self.popen.kill()
        else:
            self.popen.terminate()
        try:
            self.popen.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout=STOP_TIMEOUT_S)


@dataclass
class SynapseDeployment:
    """Paths, addresses and processes of one deployment; see the module docstring."""

    layout: SynapseLayout
    certs: CertFiles
    python: Path
    main: SynapseProcess
    sender: SynapseProcess | None
    client: SynapseClient
    cluster: PostgresCluster | None = None
    persisters: list[SynapseProcess] = field(default_factory=list)
    """Event persister workers (``stream_writers.events``), when created with some."""

    # -- what a test needs to run our worker in Synapse's sender's place --------------
    @property
    def directory(self) -> Path:
        return self.layout.directory

    @property
    def server_name(self) -> str:
        return self.layout.server_name

    @property
    def instance_name(self) -> str:
        return self.layout.instance_name

    @property
    def homeserver_yaml(self) -> Path:
        return self.directory / "homeserver.yaml"

    @property
    def worker_yaml(self) -> Path:
        return self.directory / f"{self.instance_name}.yaml"

    @property
    def signing_key_path(self) -> Path:
        return self.layout.signing_key

    @property
    def ca_cert(self) -> Path:
        """The CA that signed every certificate of the deployment and its peers."""
        return self.layout.ca_cert

    @property
    def database_url(self) -> str:
        if self.layout.database is None:
            raise ValueError("this deployment runs on SQLite")
        return self.layout.database.url

    @property
    def redis_url(self) -> str:
        if self.layout.redis is None:
            raise ValueError("this deployment has no Redis")
        return self.layout.redis.url

    @property
    def client_url(self) -> str:
        return f"http://127.0.0.1:{self.layout.ports.client}"

    # -- processes ----------------------------------------------------------------------
    def start(self) -> None:
        """Start main and the event persisters, if any (no federation sender);
        idempotent."""
        self.main.start()
        for p in self.persisters:
            p.start()

    @property
    def event_writers(self) -> list[str]:
        """``stream_writers.events``: the processes that persist events."""
        return [p.name for p in self.persisters] or ["master"]

    def start_federation_sender(self) -> None:
        """Start Synapse's own federation_sender worker as the configured instance."""
        if self.sender is None:
            raise ValueError("this deployment has no workers (no Redis)")
        self.sender.start()

    def stop_federation_sender(self, *, kill: bool = False) -> None:
        if self.sender is not None:
            self.sender.stop(kill=kill)

    def stop(self) -> None:
        self.stop_federation_sender()
        for p in self.persisters:
            p.stop()
        self.main.stop()

    def sql(self, query: str) -> str:
        """Run SQL on Synapse's database with psql; returns unaligned rows (``a|b``)."""
        if self.cluster is None or self.layout.database is None:
            raise ValueError("this deployment runs on SQLite")
        return self.cluster.psql(query, self.layout.database.name)


def event_writer(room_id: str, writers: list[str]) -> str:
    """Which of ``stream_writers.events`` persists a room's events (Synapse's
    ``events_shard_config``: sha256 of the room id, little-endian, modulo the number of
    writers)."""
    digest = hashlib.sha256(room_id.encode()).digest()
    return writers[int.from_bytes(digest, "little") % len(writers)]


def create_synapse_database(cluster: PostgresCluster, name: str) -> PostgresDatabase:
    """A database Synapse accepts: UTF8, C collation and ctype, from template0."""
    cluster.psql(
        f"CREATE DATABASE \"{name}\" TEMPLATE template0 ENCODING 'UTF8' LC_COLLATE 'C' LC_CTYPE 'C'"
    )
    return PostgresDatabase("127.0.0.1", cluster.port, cluster.user, name)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=1))


def _layout(directory: Path, ports: SynapsePorts, certs: CertFiles,
            database: PostgresDatabase | None, redis: RedisAddress | None,
            instance_name: str, event_persisters: int) -> SynapseLayout:
    """The deployment's layout, with fresh secrets and a port for each persister."""
    return SynapseLayout(
        directory=directory,
        server_name=f"localhost:{ports.federation}",
        ports=ports,
        tls_cert=certs.cert,
        tls_key=certs.key,
        ca_cert=certs.ca_cert,
        database=database,
        redis=redis,
        instance_name=instance_name,
        shared_secret=secrets.token_hex(16),
        replication_secret=secrets.token_hex(16),
        macaroon_secret=secrets.token_hex(16),
        event_persisters=tuple(
            EventPersister(f"persister{i}", free_port()) for i in range(1, event_persisters + 1)
        ),
    )


def _generic_worker(python: Path, directory: Path, name: str, config: dict[str, Any],
                    log_yaml: Path, health_port: int) -> SynapseProcess:
    """One of Synapse's generic workers: its file ``<name>.yaml`` and its log
    configuration written, and the process that runs it (not started)."""
    worker_file = directory / f"{name}.yaml"
    _write_json(worker_file, config)
    _write_json(log_yaml, log_config(directory / f"{name}.log"))
    return SynapseProcess(
        name,
        [str(python), "-m", "synapse.app.generic_worker",
         "-c", str(directory / "homeserver.yaml"), "-c", str(worker_file)],
        directory,
        directory / f"{name}.log",
        f"http://127.0.0.1:{health_port}/health",
    )  # fmt: skip


def create_deployment(
    directory: Path,
    *,
    ca: LoopbackCA,
    cluster: PostgresCluster | None = None,
    database_name: str = "synapse",
    redis: RedisAddress | None = None,
    instance_name: str = DEFAULT_INSTANCE,
    overrides: dict[str, Any] | None = None,
    event_persisters: int = 0,
) -> SynapseDeployment:
    """Write a deployment's files into ``directory`` (nothing is started).

    ``overrides`` are merged into ``homeserver.yaml`` at the top level.
    ``event_persisters``: that many generic workers (``persister1``...) persist the
    events instead of main (needs Redis).
    """
    if event_persisters and redis is None:
        raise ValueError("event persisters are workers: they need Redis")
    directory.mkdir(parents=True, exist_ok=True)
    ports = SynapsePorts(free_port(), free_port(), free_port(), free_port())
    certs = ca.issue(directory / "tls", ["localhost", "127.0.0.1"])
    database = None if cluster is None else create_synapse_database(cluster, database_name)
    layout = _layout(directory, ports, certs, database, redis, instance_name, event_persisters)
    generate_key_file(layout.signing_key)  # Synapse reads our key file format
    _write_json(directory / "main.log.yaml", log_config(directory / "main.log"))
    config = homeserver_config(layout) | (overrides or {})
    _write_json(directory / "homeserver.yaml", config)
    python = synapse_python()
    main = SynapseProcess(
        "main",
        [str(python), "-m", "synapse.app.homeserver", "-c", str(directory / "homeserver.yaml")],
        directory,
        directory / "main.log",
        f"http://127.0.0.1:{ports.client}/health",
    )
    sender = None
    if layout.has_workers:
        sender = _generic_worker(python, directory, instance_name, worker_config(layout),
                                 directory / "worker.log.yaml", ports.worker_health)
    persisters = [
        _generic_worker(python, directory, p.name, persister_config(layout, p),
                        directory / f"{p.name}.log.yaml", p.port)
        for p in layout.event_persisters
    ]
    client = SynapseClient(f"http://127.0.0.1:{ports.client}", layout.shared_secret)
    return SynapseDeployment(
        layout, certs, python, main, sender, client, cluster, persisters=persisters
    )
