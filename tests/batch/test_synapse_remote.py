"""The Synapse-schema jobs on a standalone cluster (``--master spark://…``) and through
Spark Connect (``--remote sc://…``), run as an operator runs them: ``federation-sender
batch JOB --synapse-config homeserver.yaml --json --output DIR`` in a subprocess (a
process holds one SparkContext, and the shared one is local; one that has used the
Connect client switches pyspark's functions to Connect mode).

One world (tests/batch/synapse_world.py: every class of the audit planted in the
session's real Synapse database) and, started while it is built, one standalone cluster
(a master and a worker from pyspark's ``bin/spark-class``) and one Connect server
(tests/batch/spark_servers.py). On the cluster the JDBC reads run in executor JVMs the
worker starts, which get the PostgreSQL driver from the session's ``spark.jars`` (served
by the driver, as ``local-cluster`` in tests/batch/test_cluster.py); the Connect server
has it on its command line. Each run's findings of this world's rooms must be the
planted ones exactly, class by class the local-mode run's; only read-only jobs run
here, so the tests' order does not matter (the repair is tests/batch/test_synapse_jobs.py's).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from federation_sender.batch.arguments import EXIT_FINDINGS
from federation_sender.testing.synapse_deployment import SynapseDeployment
from federation_sender.testing.synapse_peer import PeerNetwork

from .spark_servers import TINY_DATA_CONF, ConnectServer, StandaloneCluster, conf_args
from .synapse_world import World, build
from .test_synapse_jobs import batch

pytestmark = [pytest.mark.spark, pytest.mark.postgres, pytest.mark.timeout(600)]

log = logging.getLogger(__name__)

EXECUTOR_JVM = os.environ["SPARK_SUBMIT_OPTS"]
"""The executors' JVMs get the quick JIT and serial GC too (see tests/batch/test_cluster.py)."""

Findings = dict[tuple[str, str], tuple[str, str, str]]


@pytest.fixture(scope="module")
def world(standalone_cluster: StandaloneCluster, connect_server: ConnectServer,
          synapse_deployment: SynapseDeployment, network: PeerNetwork,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """The world, built while the cluster and the Connect server start (asked for first),
    at rest: the worker stopped, nothing else writing."""
    w = build(synapse_deployment, network, tmp_path_factory.mktemp("ours"))
    yield w
    w.worker.stop()
    synapse_deployment.stop_federation_sender()


@dataclass(frozen=True)
class Run:
    status: int
    doc: dict[str, Any]
    stderr: str
    out: Path

    def csv(self, name: str) -> list[dict[str, Any]]:
        path = self.out / f"{name}.csv"
        return pd.read_csv(path).to_dict("records") if path.stat().st_size > 1 else []


def operator(w: World, out: Path, job: str, *argv: str) -> Run:
    """``federation-sender batch <job> --synapse-config homeserver.yaml <argv> --json
    --output <out>``, as a shell runs it."""
    started, cpu = time.monotonic(), _children_cpu_s()
    proc = subprocess.run(
        [sys.executable, "-m", "federation_sender", "batch", job,
         "--synapse-config", str(w.d.homeserver_yaml), *argv, "--json", "--partitions", "2",
         "--output", str(out)],
        capture_output=True, text=True, timeout=240, env=os.environ,
    )
    text = proc.stdout.strip()
    doc = json.loads(text) if text else {}
    log.info("%s %s: exit %s in %.1f s (the CLI's CPU %.1f s); steps %s", job,
             " ".join(argv[:2]), proc.returncode, time.monotonic() - started,
             _children_cpu_s() - cpu, doc.get("steps"))
    return Run(proc.returncode, doc, proc.stderr, out)


def _children_cpu_s() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def on_cluster(cluster: StandaloneCluster) -> list[str]:
    return ["--master", cluster.url(), "--conf",
            f"spark.executor.defaultJavaOptions={EXECUTOR_JVM}",
            # The executors connect back to the driver: on loopback, as the cluster is.
            "--conf", "spark.driver.host=127.0.0.1", "--conf", "spark.driver.bindAddress=127.0.0.1",
            *conf_args(TINY_DATA_CONF)]


def planted(w: World) -> Findings:
    return {k: (s, r, w.events[label]) for k, (s, r, label) in w.expected.items()}


def classes(found: Findings) -> Counter[tuple[str, str]]:
    return Counter((s, r) for s, r, _ in found.values())


@pytest.fixture(scope="module")
def local_audit(spark: Any, world: World, tmp_path_factory: pytest.TempPathFactory) -> Findings:
    """This world's findings of the audit in local mode (the shared session)."""
    out = tmp_path_factory.mktemp("local-audit")
    status, _ = batch(spark, world, "audit", "--output", str(out))
    assert status == EXIT_FINDINGS
    found = world.findings_of_mine(Run(status, {}, "", out).csv("findings"))
    assert found == planted(world)
    return found


def check_audit(w: World, run: Run, where: str, local: Findings) -> None:
    assert run.status == EXIT_FINDINGS, run.stderr[-3000:]
    s = run.doc["summary"]
    assert (s["schema"], s["spark_master"]) == ("synapse", where), s
    found = w.findings_of_mine(run.csv("findings"))
    assert found == planted(w)
    assert classes(found) == classes(local)
    assert s["lost"] >= 1 and s["missing_row_no_row"] >= 2 and s["pending_backoff"] >= 1, s
    assert "classify (destination, room) pairs" in run.stderr  # the steps: on stderr


def test_audit_on_a_standalone_cluster_finds_each_planted_class(
        world: World, local_audit: Findings, standalone_cluster: StandaloneCluster,
        tmp_path: Path) -> None:
    where = on_cluster(standalone_cluster)
    run = operator(world, tmp_path, "audit", *where)
    check_audit(world, run, standalone_cluster.master_url, local_audit)


def test_audit_through_spark_connect_finds_each_planted_class(
        world: World, local_audit: Findings, connect_server: ConnectServer,
        tmp_path: Path) -> None:
    url = connect_server.url()
    run = operator(world, tmp_path, "audit", "--remote", url)
    check_audit(world, run, url, local_audit)


def test_health_report_through_spark_connect(world: World, connect_server: ConnectServer,
                                             tmp_path: Path) -> None:
    w = world
    run = operator(w, tmp_path, "health-report", "--remote", connect_server.url())
    assert run.status == 0, run.stderr[-3000:]
    down = {r["destination"]: r for r in run.csv("down")}
    assert down[w.name("B")]["backing_off"] and down[w.name("B")]["down_since_ts"] > 0
    debt = {r["destination"]: r for r in run.csv("catchup_debt")}
    for role in ("B", "C"):
        assert (debt[w.name(role)]["rooms_behind"], debt[w.name(role)]["events_behind"]) == (
            1, 1), role
    assert w.name("L") not in debt and w.name("M") not in debt
    rooms = {r["room_id"]: r for r in run.csv("rooms_unreachable")}
    assert rooms[w.rooms["b"]]["unreachable_servers"] == 1
    assert "Destinations down" in (tmp_path / "health.html").read_text()


def test_backfill_dry_run_of_some_rooms_through_spark_connect(
        world: World, connect_server: ConnectServer, tmp_path: Path) -> None:
    """``--room``: the pairs of those rooms only, each as in a run on every room."""
    w = world
    some = ("a", "a2", "b", "m")
    rooms = [a for label in some for a in ("--room", w.rooms[label])]
    run = operator(w, tmp_path, "backfill-destination-rooms", "--dry-run", *rooms,
                   "--remote", connect_server.url())
    assert run.status == 0, run.stderr[-3000:]
    missing = w.findings_of_mine([{**r, "status": "missing_row"}
                                  for r in run.csv("missing_rows")])
    assert missing == {k: v for k, v in planted(w).items() if v[0] == "missing_row"}
    s = run.doc["summary"]
    # a, a2, b and m have one remote each: four pairs, and no one else's.
    assert (s["only_rooms"], s["pairs"], s["missing_row"], s["dry_run"]) == (4, 4, 3, True), s
    assert {r["room_id"] for r in run.csv("missing_rows")} <= {w.rooms[x] for x in some}
