"""A throwaway PostgreSQL cluster from the machine's PostgreSQL binaries.

Used by the test suite and the benchmarks. PostgreSQL refuses to run as root, so as
root the cluster is initialised and run as the ``postgres`` system user (created by
the Debian package). Binaries are found under ``/usr/lib/postgresql/<ver>/bin`` or on
``PATH``; nothing is installed from here (``scripts/bootstrap.sh test`` does that).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from federation_sender.testing.ports import free_port


def find_pg_bin() -> Path:
    cands = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), reverse=True)
    if cands:
        return cands[0].parent
    exe = shutil.which("initdb")
    if exe:
        return Path(exe).parent
    raise PostgresMissing("PostgreSQL binaries (initdb) not found; install the Debian "
                          "package postgresql (scripts/bootstrap.sh test does)")


class PostgresMissing(RuntimeError):
    """No PostgreSQL server binaries on this machine."""


@dataclass
class PostgresCluster:
    bin_dir: Path
    data_dir: Path
    port: int
    user: str
    run_as: str | None

    @property
    def base_url(self) -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}"

    def url(self, dbname: str = "postgres") -> str:
        return f"{self.base_url}/{dbname}"

    def _cmd(self, args: list[str]) -> list[str]:
        if self.run_as:
            return ["runuser", "-u", self.run_as, "--", *args]
        return args

    def run(self, args: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self._cmd(args), check=check, capture_output=True, text=True)

    def psql(self, sql: str, dbname: str = "postgres") -> str:
        out = self.run(
            [
                str(self.bin_dir / "psql"),
                "-h",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-U",
                self.user,
                "-d",
                dbname,
                "-Atc",
                sql,
            ]
        )
        return out.stdout

    def create_database(self, name: str) -> str:
        self.psql(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self, mode: str = "fast") -> None:
        self.run(
            [str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-m", mode, "-w", "stop"],
            check=False,
        )

    def start(self) -> None:
        self.run(
            [
                str(self.bin_dir / "pg_ctl"),
                "-D",
                str(self.data_dir),
                "-w",
                "-t",
                "60",
                "-l",
                str(self.data_dir / "server.log"),
                "start",
            ]
        )

    def restart(self) -> None:
        self.stop()
        self.start()


@contextlib.contextmanager
def ephemeral_cluster() -> Iterator[PostgresCluster]:
    bin_dir = find_pg_bin()
    root = Path(tempfile.mkdtemp(prefix="fedsender-pg-"))
    data = root / "data"
    run_as: str | None = None
    user = pwd.getpwuid(os.geteuid()).pw_name
    if os.geteuid() == 0:
        run_as = "postgres"
        pw = pwd.getpwnam(run_as)
        os.chown(root, pw.pw_uid, pw.pw_gid)
        user = "postgres"
    port = free_port()
    cluster = PostgresCluster(bin_dir, data, port, user, run_as)
    try:
        cluster.run(
            [
                str(bin_dir / "initdb"),
                "-D",
                str(data),
                "-U",
                user,
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--no-sync",
            ]
        )
        with open(data / "postgresql.conf", "a") as f:
            f.write(
                f"\nport = {port}\nlisten_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{root}'\nfsync = off\n"
                "synchronous_commit = off\nfull_page_writes = off\nmax_connections = 300\n"
                "shared_buffers = 128MB\n"
            )
        cluster.start()
        yield cluster
    finally:
        cluster.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)
