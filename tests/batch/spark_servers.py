"""Spark servers the batch tests start from pyspark's own installation, on loopback ports:
a Spark Connect server (``sbin/start-connect-server.sh --wait``, the bundled
``spark-connect`` jar) and a standalone cluster (a master and a worker, ``bin/spark-class``
``org.apache.spark.deploy.master.Master`` / ``…worker.Worker``: the pip package ships
no ``sbin/start-master.sh``, which would only wrap the same classes in daemons).

Each is started in its own process group and returned at once, so it comes up while the
test builds its data; ``url()`` waits until it answers. :func:`stop` ends the group (the
script's shell and the JVM under it; a worker's executors are its children).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from federation_sender.testing.ports import free_port
from federation_sender.testing.prereq import unavailable
from federation_sender.testing.waiting import WaitTimedOut, wait_until_blocking

JDBC_JAR = "/usr/share/java/postgresql.jar"
START_TIMEOUT_S = 90.0
TINY_DATA_CONF = {"spark.sql.codegen.wholeStage": "false",
                  "spark.sql.adaptive.enabled": "false",
                  "spark.sql.codegen.factoryMode": "NO_CODEGEN"}
"""The tests' tables have tens of rows: compiling each plan's Java code costs more than
the interpreted plan runs (tests/batch/conftest.py's session has the figures). Results
cannot differ. For every Spark the batch tests start: the shared session, the Connect
server, the CLI's driver on a cluster (``--conf``)."""

DAEMON_JVM = os.environ.get("SPARK_SUBMIT_OPTS", "")
"""The master's and worker's JVMs get the tests' quick JIT and serial GC too
(tests/conftest.py sets SPARK_SUBMIT_OPTS; ``spark-class`` reads SPARK_DAEMON_JAVA_OPTS)."""


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent


def conf_args(conf: dict[str, str]) -> list[str]:
    """``conf`` as ``--conf KEY=VALUE`` arguments (spark-submit's and the batch CLI's)."""
    return [a for k, v in conf.items() for a in ("--conf", f"{k}={v}")]


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _env(work: Path) -> dict[str, str]:
    return dict(
        os.environ,
        SPARK_HOME=str(spark_home()),
        SPARK_PID_DIR=str(work),
        SPARK_LOG_DIR=str(work),
        SPARK_CONF_DIR=str(work),
        SPARK_WORKER_DIR=str(work / "worker"),
        SPARK_LOCAL_IP="127.0.0.1",
        SPARK_DAEMON_JAVA_OPTS=DAEMON_JVM,
        PYSPARK_PYTHON=sys.executable,
    )


def _start(argv: Sequence[str], work: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        # A new session, so the whole process group can be stopped.
        return subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=_env(work),
                                start_new_session=True)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop the process group of ``proc``."""
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


def _await(ready: Callable[[], bool], procs: Sequence[subprocess.Popen[bytes]], log: Path,
           what: str) -> None:
    def settled() -> bool:  # up, or a process of it gone
        return ready() or any(p.poll() is not None for p in procs)

    with contextlib.suppress(WaitTimedOut):
        wait_until_blocking(settled, f"{what} to start", timeout_s=START_TIMEOUT_S,
                            every_s=0.25)
    if not ready():
        tail = log.read_text(errors="replace")[-2000:]
        unavailable(f"{what} did not start (exit status "
                    f"{[p.poll() for p in procs]}): {tail}")


class ConnectServer:
    """A Spark Connect server being started; :meth:`url` waits until it listens."""

    def __init__(self, work: Path) -> None:
        self.port = free_port()
        self.log = work / "server.log"
        # --wait: in the foreground (no daemon, no pid file to clean up).
        self.proc = _start(
            ["bash", str(spark_home() / "sbin" / "start-connect-server.sh"), "--wait",
             "--master", "local[2]", "--jars", JDBC_JAR,
             "--conf", f"spark.connect.grpc.binding.port={self.port}",
             "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
             "--conf", "spark.driver.host=127.0.0.1",
             "--conf", "spark.driver.bindAddress=127.0.0.1",
             "--conf", "spark.ui.enabled=false",
             "--conf", "spark.sql.shuffle.partitions=2",
             *conf_args(TINY_DATA_CONF)], work, self.log)

    def url(self) -> str:
        _await(lambda: _listening(self.port), [self.proc], self.log, "the Spark Connect server")
        return f"sc://127.0.0.1:{self.port}"

    def stop(self) -> None:
        stop(self.proc)


class StandaloneCluster:
    """A standalone master and one worker (``cores`` cores, ``memory_mb`` for
    executors) being started; :meth:`url` waits until the worker has registered."""

    def __init__(self, work: Path, *, cores: int = 2, memory_mb: int = 1536) -> None:
        self.port = free_port()
        self.master_log = work / "master.log"
        self.worker_log = work / "worker.log"
        spark_class = str(spark_home() / "bin" / "spark-class")
        self.master = _start(
            [spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
             "--port", str(self.port), "--webui-port", str(free_port())],
            work, self.master_log)
        self.worker = _start(
            [spark_class, "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
             "--port", str(free_port()), "--webui-port", str(free_port()),
             "--cores", str(cores), "--memory", f"{memory_mb}m",
             "--work-dir", str(work / "worker"), self.master_url],
            work, self.worker_log)

    @property
    def master_url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    def url(self) -> str:
        _await(lambda: "Successfully registered with master" in self.worker_log.read_text(
            errors="replace"), [self.master, self.worker], self.worker_log,
            "the standalone cluster")
        return self.master_url

    def stop(self) -> None:
        stop(self.worker)  # and its executors, children in its process group
        stop(self.master)
