"""What the batch jobs need beyond the worker, checked before Spark starts, so that a
missing piece is one line naming it and how to install it, not a Py4J traceback.

* The ``batch`` extra: pyspark, pandas, pyarrow and matplotlib are not runtime
  dependencies of the worker (``pip install 'federation-sender[batch]'``).
* The SQLite JDBC driver, for the embedded database the demo leaves.
* Java (17 or 21) for a local or cluster-client session: Spark's driver is a JVM.
  A Spark Connect session (``--remote``) runs its JVM on the server and needs none here.

No module here imports pyspark: ``federation-sender --help`` and the worker never load it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

BATCH_MODULES = ("pyspark", "pandas", "pyarrow", "matplotlib")
INSTALL_EXTRA = "pip install 'federation-sender[batch]'"
INSTALL_JAVA = ("install a Java 17 or 21 runtime (Debian/Ubuntu: apt-get install "
                "openjdk-17-jre-headless) or set JAVA_HOME to one")
INSTALL_SQLITE_JDBC = ("install it (Debian/Ubuntu: apt-get install libxerial-sqlite-jdbc-java) "
                      "or give its jar with --conf spark.jars=...")
MIN_JAVA = 17
"""Spark 4 runs on Java 17 and 21."""


class MissingPrerequisite(Exception):
    """One line: what is missing and how to install it."""


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
