"""What the batch jobs need beyond the worker, checked before Spark starts, so that a
missing piece is one line naming it and how to install it, not a Py4J traceback.

* The ``batch`` extra: pyspark, pandas, pyarrow and matplotlib are not runtime
  dependencies of the worker (``pip install 'federation-sender[batch]'``).
* The SQLite JDBC driver, for the embedded database the demo leaves.
* Java (17 or 21) for a local or cluster-client session: Spark's driver is a JVM.
  A Spark Connect session (``--remote``) runs its JVM on the server and needs none here.
* The database (:func:`check_database`), a ``spark://`` or ``k8s://`` master
  (:func:`check_master`) and a Spark Connect server (:func:`check_remote`) must answer:
  a connection each, within :data:`CONNECT_TIMEOUT_S`, instead of Spark starting first
  and failing a minute later (or, for a Connect server, retrying for ten).

No module here imports pyspark: ``federation-sender --help`` and the worker never load it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import socket
import subprocess
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
from sqlalchemy.engine import make_url

if TYPE_CHECKING:
    from federation_sender.batch.io import Database

BATCH_MODULES = ("pyspark", "pandas", "pyarrow", "matplotlib")
INSTALL_EXTRA = "pip install 'federation-sender[batch]'"
INSTALL_JAVA = ("install a Java 17 or 21 runtime (Debian/Ubuntu: apt-get install "
                "openjdk-17-jre-headless) or set JAVA_HOME to one")
INSTALL_SQLITE_JDBC = ("install it (Debian/Ubuntu: apt-get install libxerial-sqlite-jdbc-java) "
                      "or give its jar with --conf spark.jars=...")
MIN_JAVA = 17
"""Spark 4 runs on Java 17 and 21."""
CONNECT_TIMEOUT_S = 3.0
"""How long the database, a master or a Connect server has to accept a connection."""
CHECK_DATABASE = "check --database-url (or database.url in the configuration)"
START_MASTER = ("check --master: is a Spark master running there (sbin/start-master.sh) "
                "and reachable from this host?")
START_CONNECT = ("check --remote: is a Spark Connect server running there "
                 "(sbin/start-connect-server.sh, docs/batch.md) and reachable from this host?")


class MissingPrerequisite(Exception):
    """One line: what is missing and how to install it."""


class Unreachable(MissingPrerequisite):
    """One line: what did not answer (the database, the master, the Connect server)."""


def missing_modules() -> list[str]:
    """The batch extra's modules that cannot be imported."""
    return [m for m in BATCH_MODULES if not _importable(m)]


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder refused it, or a half-removed install
        return False


def check_modules() -> None:
    missing = missing_modules()
    if missing:
        raise MissingPrerequisite(
            f"the batch jobs need {', '.join(missing)}, not installed: {INSTALL_EXTRA}")


def check_sqlite_jdbc(jar: str) -> None:
    """Spark reads the embedded SQLite database through this JDBC driver's jar."""
    if not Path(jar).is_file():
        raise MissingPrerequisite(
            f"reading an SQLite database needs its JDBC driver at {jar}, not found: "
            f"{INSTALL_SQLITE_JDBC}")


def java_command(environ: os._Environ[str] | dict[str, str] | None = None) -> str | None:
    """The java Spark will start: ``$JAVA_HOME/bin/java``, else the one on PATH."""
    env = os.environ if environ is None else environ
    home = env.get("JAVA_HOME")
    if home:
        return str(Path(home) / "bin" / "java")
    return shutil.which("java", path=env.get("PATH"))


_VERSION = re.compile(r'version "(\d+)(?:\.(\d+))?')


def check_java(timeout_s: float = 60.0) -> None:
    """Raise :class:`MissingPrerequisite` unless a Java Spark can use runs."""
    java = java_command()
    if java is None:
        raise MissingPrerequisite(
            f"Spark needs Java, and none was found (no JAVA_HOME, no java on PATH): "
            f"{INSTALL_JAVA}")
    where = f"JAVA_HOME={os.environ['JAVA_HOME']}" if os.environ.get("JAVA_HOME") else java
    try:
        proc = subprocess.run([java, "-version"], capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise MissingPrerequisite(
            f"Java ({where}) does not run: {reason}: {INSTALL_JAVA}") from None
    output = (proc.stderr or proc.stdout).strip()
    if proc.returncode != 0:
        first = output.splitlines()[0] if output else f"exit status {proc.returncode}"
        raise MissingPrerequisite(
            f"Java ({where}) does not run: {first}: {INSTALL_JAVA}")
    m = _VERSION.search(output)
    if m is not None:
        major = int(m.group(2) if m.group(1) == "1" and m.group(2) else m.group(1))
        if major < MIN_JAVA:
            raise MissingPrerequisite(
                f"Java {major} ({where}) is too old for Spark 4: {INSTALL_JAVA}")


def _refused(host: str, port: int, timeout_s: float) -> str | None:
    """Why ``host:port`` does not accept a TCP connection within ``timeout_s``, or None
    when it does (the connection is closed again at once)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except OSError as e:
        return e.strerror or type(e).__name__


def master_endpoints(master: str) -> list[tuple[str, int]]:
    """The (host, port) a ``spark://h1:7077,h2:7077`` or ``k8s://[https://]host[:port]``
    master is reached at; none for ``local…``, ``yarn`` (found through its configuration)
    and what is not a URL."""
    if master.startswith("spark://"):
        out = []
        for part in master[len("spark://"):].split(","):
            u = urllib.parse.urlsplit(f"//{part}")
            if u.hostname:
                out.append((u.hostname, u.port or 7077))
        return out
    if master.startswith("k8s://"):
        rest = master[len("k8s://"):]
        u = urllib.parse.urlsplit(rest if "://" in rest else f"https://{rest}")
        if u.hostname:
            return [(u.hostname, u.port or (80 if u.scheme == "http" else 443))]
    return []


def remote_endpoint(remote: str) -> tuple[str, int]:
    """The (host, port) of a Spark Connect URL ``sc://host[:port][/;params]`` (port 15002
    by default); :class:`ValueError` when it is not one."""
    u = urllib.parse.urlsplit(remote)
    if u.scheme != "sc" or not u.hostname:
        raise ValueError(f"--remote wants a Spark Connect URL sc://host[:port], not {remote!r}")
    try:
        port = u.port or 15002
    except ValueError:
        raise ValueError(f"--remote {remote!r}: the port is not a number") from None
    return u.hostname, port


def check_master(master: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Raise :class:`Unreachable` unless one of the master's endpoints accepts a TCP
    connection (Spark would try for a minute and say why only in its log)."""
    endpoints = master_endpoints(master)
    reasons = [f"{h}:{p}: {why}" for h, p in endpoints
               if (why := _refused(h, p, timeout_s)) is not None]
    if endpoints and len(reasons) == len(endpoints):
        raise Unreachable(f"the Spark master {master} does not answer "
                          f"({'; '.join(reasons)}): {START_MASTER}")


def check_remote(remote: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Raise :class:`Unreachable` unless the Spark Connect server's port accepts a TCP
    connection (the client would retry for ten minutes, saying nothing)."""
    try:
        host, port = remote_endpoint(remote)
    except ValueError as e:
        raise Unreachable(str(e)) from None
    why = _refused(host, port, timeout_s)
    if why is not None:
        raise Unreachable(f"the Spark Connect server {remote} does not answer "
                          f"({host}:{port}: {why}): {START_CONNECT}")


def shown_url(url: str) -> str:
    """A database URL as it may be printed: the password as ``***``."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL SQLAlchemy parses: print it as given, without userinfo
        return re.sub(r"//[^@/]*@", "//", url)


_PG_FAILED = re.compile(r'^(?:connection failed: )?(?:connection to server at "[^"]*"'
                        r'(?: \([^)]*\))?, port \d+ failed: )?(?:FATAL:\s+)?')


def check_database(db: Database, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Raise :class:`Unreachable` unless ``db`` can be opened: a PostgreSQL connection
    (libpq's ``connect_timeout``; a database that does not exist or refuses the user
    fails here too), or an SQLite file that is a database."""
    if db.sqlite:
        path = Path(db.url)
        try:
            with path.open("rb") as f:
                header = f.read(16)
        except OSError as e:
            raise Unreachable(f"cannot open the SQLite database {path}: "
                              f"{e.strerror or type(e).__name__}: {CHECK_DATABASE}") from None
        if header != b"SQLite format 3\x00":
            what = "is empty" if not header else "is not an SQLite database"
            raise Unreachable(f"{path} {what}: {CHECK_DATABASE}")
        return
    try:
        # libpq rounds a timeout below 2 s up to 2 s.
        psycopg.connect(db.url, connect_timeout=max(2, round(timeout_s))).close()
    except psycopg.Error as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        reason = _PG_FAILED.sub("", lines[0]) if lines else type(e).__name__
        raise Unreachable(f"cannot connect to the database {shown_url(db.url)}: {reason}: "
                          f"{CHECK_DATABASE}") from None
