"""Without the batch extra or without a working Java, a batch job is one line saying
what is missing and how to install it (exit 2), and the rest of the command line and
the worker never import pyspark. No Spark session is started here."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

BLOCK_BATCH_EXTRA = """
import sys
from importlib.abc import MetaPathFinder

class NotInstalled(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pyspark", "pandas", "pyarrow", "matplotlib"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NotInstalled())
"""


def _run(code: str, *, env: dict[str, str] | None = None, cwd: Path | None = None
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env, cwd=cwd)


def _cli(*args: str) -> str:
    return ("import sys\nfrom federation_sender.cli import main\n"
            f"sys.exit(main({list(args)!r}))\n")


def test_without_the_batch_extra_the_cli_and_worker_work_and_batch_names_the_extra(
        tmp_path: Path) -> None:
    help_ = _run(BLOCK_BATCH_EXTRA + _cli("--help"))
    assert help_.returncode == 0, help_.stderr
    assert "batch" in help_.stdout
    worker = _run(BLOCK_BATCH_EXTRA + "import federation_sender.app, federation_sender.demo, "
                  "federation_sender.batch.cli\nfrom federation_sender.cli import build_parser\n"
                  "build_parser()\n"
                  "print(sorted(m for m in sys.modules if m.split('.')[0] in "
                  "('pyspark', 'pandas', 'pyarrow', 'matplotlib')))")
    assert worker.returncode == 0, worker.stderr
    assert worker.stdout.strip() == "[]"
    job = _run(BLOCK_BATCH_EXTRA + _cli("batch", "health-report", "--database-url",
                                        "postgresql://fs@127.0.0.1:1/fs"), cwd=tmp_path)
    assert job.returncode == 2, job.stderr
    (line,) = job.stderr.strip().splitlines()
    assert "pip install 'federation-sender[batch]'" in line, line
    assert "pyspark" in line


def _batch_with_java(tmp_path: Path, java_home: Path | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    env["PATH"] = str(tmp_path / "empty-path")  # no java there
    if java_home is not None:
        env["JAVA_HOME"] = str(java_home)
    return _run(_cli("batch", "health-report", "--database-url",
                     "postgresql://fs@127.0.0.1:1/fs"), env=env, cwd=tmp_path)


def test_without_java_a_batch_job_says_how_to_install_it(tmp_path: Path) -> None:
    proc = _batch_with_java(tmp_path, None)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "Java" in line and "no java on PATH" in line and "openjdk-17" in line, line


def test_with_a_broken_java_a_batch_job_says_so_in_one_line(tmp_path: Path) -> None:
    home = tmp_path / "jdk"
    (home / "bin").mkdir(parents=True)
    java = home / "bin" / "java"
    java.write_text("#!/bin/sh\necho 'Error: could not find libjava.so' >&2\nexit 1\n")
    java.chmod(java.stat().st_mode | stat.S_IXUSR)
    proc = _batch_with_java(tmp_path, home)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert f"JAVA_HOME={home}" in line and "could not find libjava.so" in line, line
    assert "openjdk-17" in line


def test_without_the_sqlite_jdbc_driver_a_batch_job_on_sqlite_says_so(
        tmp_path: Path) -> None:
    (tmp_path / "x.db").write_bytes(b"")
    code = ("import sys\nimport federation_sender.batch.cli as c\n"
            f"c.SQLITE_JDBC_JAR = {str(tmp_path / 'no-sqlite-jdbc.jar')!r}\n"
            "from federation_sender.cli import main\n"
            f"sys.exit(main(['batch', 'health-report', '--database-url', "
            f"'sqlite:///{tmp_path}/x.db']))\n")
    proc = _run(code, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "libxerial-sqlite-jdbc-java" in line and "no-sqlite-jdbc.jar" in line, line
