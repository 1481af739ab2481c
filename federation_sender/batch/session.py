"""SparkSession creation for the batch jobs.

One function, :func:`build_session`, so every job runs the same way in local mode
(``local[*]``, the default), on a cluster (``--master spark://…``, ``yarn``,
``k8s://…``) or through Spark Connect (``--remote sc://…``). The code of the jobs is the
same in all three; only classic sessions get the JDBC jar and log settings here (a Spark
Connect server is configured on the server side, with the same ``spark.jars``).

Local mode is tuned for one machine: no web UI, few shuffle partitions (the default 200
is for clusters and makes small jobs slow), loopback networking and quiet logs.

A session that can not start is one line (:class:`SessionStartError`): a Spark Connect
server must complete its gRPC handshake within :data:`CONNECT_TIMEOUT_S` and the session
be built within :data:`REMOTE_BUILD_TIMEOUT_S` (the client would otherwise retry for 10
minutes); a classic session's driver also logs its errors to a file of its own, so the
reason Spark gives only in its log ("All masters are unresponsive") is the line's.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

DEFAULT_JDBC_JAR = "/usr/share/java/postgresql.jar"
JDBC_DRIVER = "org.postgresql.Driver"
SQLITE_JDBC_JAR = "/usr/share/java/sqlite-jdbc.jar"
"""Debian's libxerial-sqlite-jdbc-java: the embedded SQLite database, read by Spark."""
SQLITE_JDBC_DRIVER = "org.sqlite.JDBC"


def default_jars() -> str:
    """The JDBC drivers on ``spark.jars``: PostgreSQL's, and SQLite's when installed."""
    jars = [DEFAULT_JDBC_JAR]
    if Path(SQLITE_JDBC_JAR).exists():
        jars.append(SQLITE_JDBC_JAR)
    return ",".join(jars)

CONNECT_TIMEOUT_S = 3.0
"""How long a Spark Connect server has to complete the gRPC handshake."""
REMOTE_BUILD_TIMEOUT_S = 30.0
"""How long building a Spark Connect session (its first calls) may take."""

_ERRORS_PROPERTY = "federation_sender.batch.errors"
"""The driver's JVM logs its errors to the file this system property names too (the
executors, without it, to /dev/null): :func:`start_failure_reason` reads it."""

_LOG4J2 = f"""\
rootLogger.level = error
rootLogger.appenderRef.stderr.ref = console
rootLogger.appenderRef.errors.ref = errors
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{{HH:mm:ss}} %p %c{{1}}: %m%n
appender.errors.type = File
appender.errors.name = errors
appender.errors.fileName = ${{sys:{_ERRORS_PROPERTY}:-/dev/null}}
appender.errors.layout.type = PatternLayout
appender.errors.layout.pattern = %p %c{{1}}: %m%n
"""

MASTERS_UNRESPONSIVE = "All masters are unresponsive"
"""What Spark's driver logs when no ``spark://`` master accepted the application (after
three registration attempts, 20 s apart): the exception it raises does not say it."""


class SessionStartError(Exception):
    """The session could not start; the text is one line saying why."""


class SparkUnreachable(SessionStartError):
    """The master or the Spark Connect server did not answer: a configuration problem
    (``--master``, ``--remote``), not a failure of the job."""


@dataclass(frozen=True)
class SessionOptions:
    master: str | None = None
    """``local[*]`` when neither ``master`` nor ``remote`` is given."""
    remote: str | None = None
    """A Spark Connect URL (``sc://host:15002``); excludes ``master``."""
    shuffle_partitions: int | None = None
    """Default: 2 x cores in local mode, Spark's own default on clusters."""
    jdbc_jar: str = field(default_factory=default_jars)
    """Comma-separated jar paths."""
    app_name: str = "federation-sender-batch"
    progress_bar: bool = False
    """Spark's console progress bar (stage x/y) on stderr."""
    conf: Mapping[str, str] = field(default_factory=dict)


def is_local_master(master: str) -> bool:
    return master.startswith("local")


def _log4j_config() -> str:
    path = Path(tempfile.gettempdir()) / "federation-sender-batch-log4j2.properties"
    if not path.exists() or path.read_text() != _LOG4J2:
        path.write_text(_LOG4J2)
    return str(path)


def session_conf(opts: SessionOptions) -> dict[str, str]:
    """The Spark configuration of a classic (non-Connect) session."""
    master = opts.master or "local[*]"
    conf: dict[str, str] = {
        "spark.app.name": opts.app_name,
        "spark.master": master,
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "true" if opts.progress_bar else "false",
        "spark.jars": opts.jdbc_jar,
        "spark.sql.session.timeZone": "UTC",
        "spark.driver.extraJavaOptions": f"-Dlog4j2.configurationFile=file:{_log4j_config()}",
        "spark.executor.extraJavaOptions": f"-Dlog4j2.configurationFile=file:{_log4j_config()}",
    }
    if is_local_master(master):
        cores = os.cpu_count() or 2
        conf["spark.sql.shuffle.partitions"] = str(opts.shuffle_partitions or 2 * cores)
        conf["spark.driver.host"] = "127.0.0.1"
        conf["spark.driver.bindAddress"] = "127.0.0.1"
    elif opts.shuffle_partitions:
        conf["spark.sql.shuffle.partitions"] = str(opts.shuffle_partitions)
    conf.update(opts.conf)
    return conf


def remote_session_conf(opts: SessionOptions) -> dict[str, str]:
    """The configuration a Spark Connect client sets on its server-side session.

    Only runtime SQL settings can be set from a client (the Connect client sets them
    after the session exists and silently ignores the static ones, such as
    ``spark.jars`` or ``spark.driver.memory``: those belong on the server's command
    line). The time zone is pinned to UTC as in classic sessions, so hourly buckets
    do not depend on the server's zone.
    """
    conf: dict[str, str] = {"spark.sql.session.timeZone": "UTC"}
    if opts.shuffle_partitions:
        conf["spark.sql.shuffle.partitions"] = str(opts.shuffle_partitions)
    conf.update(opts.conf)
    return conf


def build_session(opts: SessionOptions) -> SparkSession:
    """Create (or return the running) SparkSession; :class:`SessionStartError` (one line)
    when the master or the Connect server does not answer or Spark logs why it stopped."""
    from pyspark.sql import SparkSession

    if opts.remote and opts.master:
        raise ValueError("give either a master or a Spark Connect remote, not both")
    if opts.remote:
        await_connect_server(opts.remote, CONNECT_TIMEOUT_S)
        builder = SparkSession.builder.remote(opts.remote).appName(opts.app_name)
        for key, value in remote_session_conf(opts).items():
            builder = builder.config(key, value)
        return _bounded(builder.getOrCreate, REMOTE_BUILD_TIMEOUT_S, SparkUnreachable(
            f"the Spark Connect server {opts.remote} did not start a session within "
            f"{REMOTE_BUILD_TIMEOUT_S:g} s"))
    conf = session_conf(opts)
    if is_local_master(conf["spark.master"]):
        # Workers and executors of local-cluster mode bind to this, not the host's name.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    # Python workers must run the interpreter the driver runs (the venv's).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    fd, errors = tempfile.mkstemp(prefix="federation-sender-batch-", suffix=".errors.log")
    os.close(fd)
    driver_opts = conf.get("spark.driver.extraJavaOptions", "")
    conf["spark.driver.extraJavaOptions"] = f"{driver_opts} -D{_ERRORS_PROPERTY}={errors}".strip()
    builder = SparkSession.builder
    for key, value in conf.items():
        builder = builder.config(key, value)
    try:
        spark = builder.getOrCreate()
    except Exception as e:
        reason = start_failure_reason(Path(errors).read_text(errors="replace"))
        if reason is None:
            raise
        if MASTERS_UNRESPONSIVE in reason:
            raise SparkUnreachable(f"the Spark master {conf['spark.master']} did not "
                                   f"answer (Spark's log: {reason})") from e
        raise SessionStartError(reason) from e
    finally:
        # The driver keeps the file open: its later errors go to the console only.
        Path(errors).unlink(missing_ok=True)
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def start_failure_reason(log: str) -> str | None:
    """Why the driver stopped, from its error log: the reason of an application killed
    by the scheduler ("All masters are unresponsive! Giving up."), else the first error
    logged; ``None`` when it logged none."""
    errors = [line.split(": ", 1)[1].strip() for line in log.splitlines()
              if line.startswith("ERROR ") and ": " in line]
    for message in errors:
        if "Reason: " in message:
            return message.split("Reason: ", 1)[1]
    return errors[0] if errors else None


def await_connect_server(url: str, timeout_s: float) -> None:
    """Return once the Spark Connect server at ``url`` completed a gRPC handshake (the
    channel pyspark's client opens, with the URL's TLS and token settings), else raise
    :class:`SparkUnreachable` after ``timeout_s``. A port that accepts connections but
    never answers (a stopped or wedged process, another kind of server) ends here, not in
    the client's retries."""
    from pyspark.sql.connect.client import DefaultChannelBuilder

    ready = threading.Event()

    def on_state(state: Any) -> None:
        if getattr(state, "name", "") == "READY":
            ready.set()

    channel = DefaultChannelBuilder(url).toChannel()
    try:
        channel.subscribe(on_state, try_to_connect=True)
        if not ready.wait(timeout_s):
            raise SparkUnreachable(
                f"the Spark Connect server {url} did not answer (no gRPC handshake "
                f"within {timeout_s:g} s)")
    finally:
        channel.unsubscribe(on_state)
        channel.close()


T = TypeVar("T")


def _bounded(fn: Callable[[], T], timeout_s: float, on_timeout: Exception) -> T:
    """``fn()``, or ``on_timeout`` raised after ``timeout_s``; ``fn`` runs on a daemon
    thread, which does not keep the process alive when it is still retrying."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name="build-spark-session", daemon=True).start()
    if not done.wait(timeout_s):
        raise on_timeout
    if "error" in box:
        raise box["error"]
    value: T = box["value"]
    return value

