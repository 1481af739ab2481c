"""The chaos run: zero lost deliveries under worker kills, replication cuts, main
process and PostgreSQL restarts and misbehaving or absent destinations.

Default: 50 s of chaos (about 2 minutes in all, with setup, convergence and the Spark
audit). ``CHAOS_LONG=1``: 15 minutes of chaos (``CHAOS_SECONDS``, ``CHAOS_SEED`` and
``CHAOS_FAULTS``, a comma-separated subset of the fault kinds, possibly empty,
override). ``bench/chaos.py`` runs the long mode and prints the figures.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from federation_sender.testing.postgres import PostgresCluster

from .chaos import ADMIN_TOKEN, FAULTS, ChaosConfig, run_chaos

LONG = bool(os.environ.get("CHAOS_LONG"))


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.spark
@pytest.mark.timeout(3600 if LONG else 420)
async def test_chaos_run_loses_nothing(
    tmp_path: Path, private_pg_cluster: PostgresCluster
) -> None:
    # A cluster of its own: the run restarts PostgreSQL (conftest.py, private_pg_cluster).
    pg_cluster = private_pg_cluster
    pg_url = pg_cluster.create_database("chaos")
    cfg = ChaosConfig(
        chaos_s=float(os.environ.get("CHAOS_SECONDS", 900 if LONG else 50)),
        seed=int(os.environ.get("CHAOS_SEED", 1)),
        converge_timeout_s=300 if LONG else 90,
        faults=tuple(f for f in os.environ.get("CHAOS_FAULTS", ",".join(FAULTS)).split(",")
                     if f),
    )
    report = await run_chaos(cfg, pg_cluster, pg_url, tmp_path)
    sys.stderr.write("\n" + report.summary() + "\n")
    assert report.delivery is not None and report.delivery.ok, report.summary()
    assert report.audit["undelivered_lost"] == 0, report.audit
    assert report.audit["undelivered_pending"] == 0, report.audit
    assert report.audit["exit_status"] == 0, (report.audit, report.findings)
    assert set(report.faults) == set(cfg.faults), report.faults
    # Memory stays bounded: no incarnation of the worker grows past 400 MiB.
    assert report.rss_kib and max(report.rss_kib) < 400 * 1024, report.summary()
    # The worker's own log never shows the admin token or a request signature.
    assert ADMIN_TOKEN not in report.worker_log
    assert 'sig="' not in report.worker_log.replace('sig="<redacted>"', "")
