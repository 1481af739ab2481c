"""Helpers of the Synapse backend tests (test_backend_*.py).

* A Synapse schema made by Synapse itself (``update_synapse_database``), cloned per
  test: import the ``*_fixture`` functions into a test module; the fixtures are named
  without the suffix.
* :class:`OurWorker`: our worker as a process in the place of Synapse's own federation
  sender, started exactly as an operator would (``federation-sender worker
  --synapse-config homeserver.yaml --synapse-config fed1.yaml -c ours.yaml``).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.storage.synapse.database import create_synapse_engine
from federation_sender.testing.postgres import PostgresCluster
from federation_sender.testing.replication_tap import ReplicationTap
from federation_sender.testing.synapse_deployment import SynapseDeployment
from federation_sender.testing.synapse_install import synapse_python
from federation_sender.testing.synapse_schema import clone_database, create_synapse_schema

_counter = itertools.count()
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session", name="synapse_template")
def synapse_template_fixture(pg_cluster: PostgresCluster) -> str:
    """Name of a database holding Synapse's empty schema (made once per session: each
    module importing this fixture has its own copy of it, so the second finds it)."""
    name = "synapse_template"
    if not pg_cluster.psql(f"SELECT 1 FROM pg_database WHERE datname = '{name}'").strip():
        create_synapse_schema(pg_cluster, name, synapse_python())
    return name


@pytest.fixture(name="synapse_db_url")
def synapse_db_url_fixture(pg_cluster: PostgresCluster, synapse_template: str) -> str:
    return clone_database(pg_cluster, synapse_template, f"syn{next(_counter)}")


@pytest.fixture(name="synapse_engine")
async def synapse_engine_fixture(synapse_db_url: str) -> AsyncIterator[AsyncEngine]:
    eng = create_synapse_engine(synapse_db_url)
    yield eng
    await eng.dispose()


class OurWorker:
    """Our worker process as the deployment's federation sender instance, or as
    ``instance`` (one of several in ``federation_sender_instances``): its worker file
    ``<instance>.yaml`` in the deployment's directory names it."""

    def __init__(self, deployment: SynapseDeployment, directory: Path,
                 queue: dict[str, object] | None = None, instance: str | None = None) -> None:
        """``queue``: our ``queue:`` keys over the suite's defaults. Those turn our
        short-retry window off: with the suite's Synapse settings
        (``max_long_retries: 2``, 500 ms apart) a destination that is down is then backed
        off after about a second, as Synapse's sender does there, so a test sees the
        persisted backoff; tests/synapse/test_short_outage.py turns it back on.
        ``instance``: another of the deployment's sender instances (several senders)."""
        self.d = deployment
        self.instance = instance or deployment.instance_name
        self.worker_yaml = deployment.directory / f"{self.instance}.yaml"
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.config = directory / "ours.yaml"
        self.config.write_text(
            json.dumps(
                {
                    "data_dir": str(directory / "data"),
                    "admin": {"enabled": False},
                    "telemetry": {"metrics_port": None, "log_level": "INFO"},
                    "queue": {"wakeup_interval_s": 5.0, "short_retry_probe_window_s": 0.0,
                              **(queue or {})},
                }
            )
        )
        self.log_path = directory / "ours.log"
        self.popen: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def start(self, timeout_s: float = 60.0) -> None:
        """Start and wait until it announced its ``caches`` position on Redis (it is
        then connected to replication with its positions loaded)."""
        assert not self.running
        args = [
            sys.executable, "-m", "federation_sender", "worker", "-c", str(self.config),
            "--synapse-config", str(self.d.homeserver_yaml),
            "--synapse-config", str(self.worker_yaml),
        ]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.starts += 1
        with ReplicationTap(self.d.redis_url, self.d.server_name) as tap:
            log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child
            self.popen = subprocess.Popen(args, stdout=log, stderr=log, env=env, cwd=self.directory)
            log.close()
            marker = f"POSITION caches {self.instance} "
            try:
                tap.wait_for(
                    lambda lines: any(ln.startswith(marker) for ln in lines)
                    or not self.running,
                    timeout_s=timeout_s,
                    what="our worker's POSITION caches",
                )
            except TimeoutError:
                self.stop(kill=True)
                raise
        if not self.running:
            raise RuntimeError(f"our worker exited: {self.log_tail()}")

    def stop(self, *, kill: bool = False) -> int | None:
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""
