"""SparkSession creation for the batch jobs.

One function, :func:`build_session`, so every job runs the same way in local mode
(``local[*]``, the default), on a cluster (``--master spark://…``, ``yarn``,
``k8s://…``) or through Spark Connect (``--remote sc://…``). The code of the jobs is the
same in all three; only classic sessions get the JDBC jar and log settings here (a Spark
Connect server is configured on the server side, with the same ``spark.jars``).

Local mode is tuned for one machine: no web UI, few shuffle partitions (the default 200
is for clusters and makes small jobs slow), loopback networking and quiet logs.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

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

_LOG4J2 = """\
rootLogger.level = error
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n
"""


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
    """Create (or return the running) SparkSession."""
    from pyspark.sql import SparkSession

    if opts.remote and opts.master:
        raise ValueError("give either a master or a Spark Connect remote, not both")
    if opts.remote:
        builder = SparkSession.builder.remote(opts.remote).appName(opts.app_name)
        for key, value in remote_session_conf(opts).items():
            builder = builder.config(key, value)
        return builder.getOrCreate()
    conf = session_conf(opts)
    if is_local_master(conf["spark.master"]):
        # Workers and executors of local-cluster mode bind to this, not the host's name.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    # Python workers must run the interpreter the driver runs (the venv's).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark
