"""The jobs through Spark Connect (``--remote sc://…``): a real Connect server started
from pyspark's bundled ``sbin/start-connect-server.sh`` on a loopback port, with the
PostgreSQL JDBC jar (the ``connect_server`` fixture, tests/batch/conftest.py), and the
CLI run as a client in a subprocess (a process that has used the Connect client switches
pyspark's functions to Connect mode, and this one holds the shared classic session).
The results must equal the local-mode results of the same database."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from federation_sender.testing.prereq import require_module

from .histories import OUR, expected_diff, load_pg, scenario
from .spark_servers import ConnectServer
from .test_jobs import broken, run

pytestmark = [pytest.mark.spark, pytest.mark.postgres]

require_module("grpc", "the Spark Connect client: pip install 'pyspark[connect]'")
require_module("zstandard", "the Spark Connect client: pip install 'pyspark[connect]'")


def _remote(url: str, database_url: str, *argv: str) -> tuple[int, dict[str, Any], str]:
    env = dict(os.environ, FEDERATION_SENDER__SERVER_NAME=OUR)
    proc = subprocess.run(
        [sys.executable, "-m", "federation_sender.batch", *argv, "--remote", url,
         "--database-url", database_url, "--json", "--partitions", "3"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    doc = json.loads(proc.stdout) if proc.stdout.strip() else {}
    return proc.returncode, doc, proc.stderr


def _without_master(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if k != "spark_master"}


def test_audit_through_spark_connect_matches_local_mode(
    connect_server: ConnectServer, spark: Any, batch_db: str
) -> None:
    h = broken(scenario())
    load_pg(h, batch_db)
    # Local mode first, while the server starts.
    local_status, local = run(spark, batch_db, "audit")
    url = connect_server.url()

    status, remote, err = _remote(url, batch_db, "audit")
    assert status == local_status, err[-3000:]
    assert remote["summary"]["spark_master"] == url
    assert _without_master(remote["summary"]) == _without_master(local["summary"])
    assert remote["samples"] == local["samples"]
    # The findings are the scenario's (not two equally empty results).
    problems = list(expected_diff(h).values())
    for p in ("behind", "ahead", "stale"):
        assert remote["summary"][f"rows_{p}"] == problems.count(p), p
    assert "[audit] 3. compute expected destination_rooms" in err
