"""One job on ``local-cluster`` mode: a master, workers and executors in separate JVMs, so
closures, JDBC reads and the staging write really cross process boundaries. Runs the CLI
in a subprocess, since a process holds one SparkContext and the shared one is local."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .histories import OUR, expected_diff, load_pg, scenario
from .test_jobs import broken

pytestmark = [pytest.mark.spark, pytest.mark.postgres]

EXECUTOR_JVM = os.environ["SPARK_SUBMIT_OPTS"]
"""The executors' JVMs get the test drivers' quick JIT and serial GC (tests/conftest.py):
spark-submit's SPARK_SUBMIT_OPTS reaches the driver, not the executors a worker starts.
``defaultJavaOptions`` goes before the job's own ``extraJavaOptions``, which it keeps."""


def test_backfill_dry_run_on_local_cluster(batch_db: str) -> None:
    h = broken(scenario())
    load_pg(h, batch_db)
    env = dict(os.environ, FEDERATION_SENDER__SERVER_NAME=OUR)
    proc = subprocess.run(
        [sys.executable, "-m", "federation_sender.batch", "backfill-destination-rooms",
         "--master", "local-cluster[2,1,1024]", "--database-url", batch_db, "--dry-run",
         "--json", "--conf", f"spark.executor.defaultJavaOptions={EXECUTOR_JVM}"],
        capture_output=True, text=True, timeout=240, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["summary"]["spark_master"] == "local-cluster[2,1,1024]"
    # Sized from the row counts (no --partitions): two per executor core on a cluster,
    # and a cluster's memory is its own.
    assert doc["summary"]["partitions"] == 4
    assert "driver_memory" not in doc["summary"]
    assert "[backfill-destination-rooms] sized for " in proc.stderr
    problems = list(expected_diff(h).values())
    for p in ("missing", "behind", "ahead", "stale"):
        assert doc["summary"][p] == problems.count(p), p
    # Progress lines went to stderr, not into the JSON.
    assert "[backfill-destination-rooms] 3. compute expected destination_rooms" in proc.stderr
