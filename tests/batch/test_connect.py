"""The jobs through Spark Connect (``--remote sc://…``): a real Connect server started
from pyspark's bundled ``sbin/start-connect-server.sh`` on a loopback port, with the
PostgreSQL JDBC jar, and the CLI run as a client in a subprocess (a process that has used
the Connect client switches pyspark's functions to Connect mode, and this one holds the
shared classic session). The results must equal the local-mode results of the same
database."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from federation_sender.testing.ports import free_port
from federation_sender.testing.prereq import require_module, unavailable

from .histories import OUR, expected_diff, load_pg, scenario
from .test_jobs import broken, run

pytestmark = [pytest.mark.spark, pytest.mark.postgres]

require_module("grpc", "the Spark Connect client: pip install 'pyspark[connect]'")
require_module("zstandard", "the Spark Connect client: pip install 'pyspark[connect]'")

JDBC_JAR = "/usr/share/java/postgresql.jar"
START_TIMEOUT_S = 90.0



def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop the server's process group (the script's shell and the JVM under it)."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


class ConnectServer:
    """A Spark Connect server being started; :meth:`url` waits until it listens."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.proc = proc
        self.port = port
        self.log = log

    def url(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _listening(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-2000:]
                unavailable(f"the Spark Connect server did not start (exit status "
                            f"{self.proc.poll()}): {tail}")
            time.sleep(0.25)
        return f"sc://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def connect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConnectServer]:
    """Starts the server and returns at once (it starts while the test does other work);
    stops it at the end, whatever happened."""
    import pyspark

    spark_home = Path(pyspark.__file__).parent
    script = spark_home / "sbin" / "start-connect-server.sh"
    work = tmp_path_factory.mktemp("spark-connect")
    port = free_port()
    env = dict(
        os.environ,
        SPARK_HOME=str(spark_home),
        SPARK_PID_DIR=str(work),
        SPARK_LOG_DIR=str(work),
        SPARK_CONF_DIR=str(work),
        SPARK_LOCAL_IP="127.0.0.1",
        PYSPARK_PYTHON=sys.executable,
    )
    log = work / "server.log"
    with log.open("wb") as out:
        # --wait: in the foreground (no daemon, no pid file to clean up); a new session so
        # the whole process group (the script's shell and the JVM) can be stopped.
        proc = subprocess.Popen(
            ["bash", str(script), "--wait", "--master", "local[2]", "--jars", JDBC_JAR,
             "--conf", f"spark.connect.grpc.binding.port={port}",
             "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
             "--conf", "spark.driver.host=127.0.0.1",
             "--conf", "spark.driver.bindAddress=127.0.0.1",
             "--conf", "spark.ui.enabled=false",
             "--conf", "spark.sql.shuffle.partitions=2"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            start_new_session=True,
        )
    try:
        yield ConnectServer(proc, port, log)
    finally:
        _stop(proc)


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
