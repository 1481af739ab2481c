"""Our worker as the federation sender of a :class:`SynapseDeployment`, in a subprocess.

It runs exactly as an operator would run it beside Synapse (``$S`` standing for
``--synapse-config homeserver.yaml --synapse-config fed1.yaml``)::

    federation-sender migrate -c ours.yaml $S
    federation-sender worker -c ours.yaml $S

with our own file (``ours.yaml``) holding only what is ours: the data directory, the
test CA for the peers' certificates, the admin port (its ``/ready`` says when the worker
has started and connected to replication) and any ``settings`` the caller adds (merged
one level deep). Synapse's own worker must not run at the same time: both would be
``fed1``. :meth:`OurSender.stop` with ``kill=True`` is a crash (SIGKILL).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from federation_sender.clock import SystemClock
from federation_sender.testing.ports import free_port
from federation_sender.testing.synapse_deployment import SynapseDeployment

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0


class OurSenderError(RuntimeError):
    """Our worker failed to migrate or start; the message names the last log line."""


class OurSender:
    def __init__(
        self,
        deployment: SynapseDeployment,
        directory: Path,
        settings: dict[str, Any] | None = None,
        worker_args: tuple[str, ...] = (),
        source: Path | None = None,
    ) -> None:
        """``worker_args``: extra options of ``federation-sender worker`` (e.g.
        ``("--event-loop", "uvloop")``); ``source``: run the ``federation_sender``
        package of another checkout (e.g. an older commit's, to compare)."""
        self.deployment = deployment
        self.env = dict(os.environ)
        if source is not None:
            self.env["PYTHONPATH"] = str(source)
        self.worker_args = worker_args
        self.directory = directory
        self.admin_port = free_port()
        self.admin_token = "test-admin-token"
        self.popen: subprocess.Popen[bytes] | None = None
        directory.mkdir(parents=True, exist_ok=True)
        ours: dict[str, Any] = {
            "data_dir": str(directory / "data"),
            "federation": {"extra_ca_file": str(deployment.ca_cert)},
            "admin": {"port": self.admin_port, "token": self.admin_token},
            "telemetry": {"metrics_port": None},
        }
        for key, value in (settings or {}).items():
            if isinstance(value, dict) and isinstance(ours.get(key), dict):
                ours[key] = {**ours[key], **value}
            else:
                ours[key] = value
        self.config_path = directory / "ours.yaml"
        self.config_path.write_text(yaml.safe_dump(ours))
        self.log_path = directory / "ours.log"

    @property
    def pid(self) -> int | None:
        return None if self.popen is None else self.popen.pid

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def _args(self, command: str) -> list[str]:
        d = self.deployment
        return [
            sys.executable, "-m", "federation_sender", command, "-c", str(self.config_path),
            "--synapse-config", str(d.homeserver_yaml), "--synapse-config", str(d.worker_yaml),
        ]  # fmt: skip

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no log>"

    def migrate(self) -> None:
        result = subprocess.run(
            self._args("migrate"), capture_output=True, text=True, cwd=self.directory,
            env=self.env, timeout=START_TIMEOUT_S,
        )  # fmt: skip
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise OurSenderError(f"migrate exited {result.returncode}: {last}")

    def start(self, *, migrate: bool = True) -> None:
        """Migrate (our schema only; idempotent), start, and wait until ``/ready``."""
        if self.running:
            return
        if migrate:
            self.migrate()
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                [*self._args("worker"), *self.worker_args], stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, cwd=self.directory, env=self.env,
            )  # fmt: skip
        self._wait_ready()

    def _wait_ready(self) -> None:
        assert self.popen is not None
        clock = SystemClock()
        deadline = clock.monotonic_s() + START_TIMEOUT_S
        url = f"http://127.0.0.1:{self.admin_port}/ready"
        while clock.monotonic_s() < deadline:
            if self.popen.poll() is not None:
                raise OurSenderError(
                    f"worker exited {self.popen.returncode} at start:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=1) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            # Polling a child's port; waiting on the child notices an early exit at once.
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(0.1)
        self.stop(kill=True)
        raise OurSenderError(f"worker not ready in {START_TIMEOUT_S:.0f} s:\n{self.log_tail()}")

    def stop(self, *, kill: bool = False) -> int | None:
        """SIGTERM (orderly) or SIGKILL (a crash); returns the exit status."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            if kill:
                self.popen.kill()
            else:
                self.popen.terminate()
            try:
                self.popen.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(STOP_TIMEOUT_S)
        return self.popen.returncode
