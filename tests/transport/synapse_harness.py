"""Install and run a real Synapse on loopback for interop tests.

Synapse goes into its own virtualenv so its pins never disturb ours; the version is
pinned below. The virtualenv lives in the user's cache directory
(``$XDG_CACHE_HOME/federation-sender/synapse-<version>``, default ``~/.cache/...``)
so that fresh clones on the same machine (CI) reuse it; set
``FEDERATION_SENDER_SYNAPSE_VENV`` to put it elsewhere, or
``FEDERATION_SENDER_SYNAPSE_PYTHON`` to use an existing interpreter with Synapse.
The first run installs and byte-compiles it (about a minute); later runs reuse it.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from federation_sender.transport.signing import generate_key_file

from .certs import CertFiles, make_certs

SYNAPSE_VERSION = "1.163.2"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "federation-sender"
VENV = Path(
    os.environ.get("FEDERATION_SENDER_SYNAPSE_VENV") or CACHE / f"synapse-{SYNAPSE_VERSION}"
)
START_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def synapse_python() -> Path:
    """An interpreter with the pinned Synapse, installing it on first use."""
    override = os.environ.get("FEDERATION_SENDER_SYNAPSE_PYTHON")
    if override:
        return Path(override)
    python = VENV / "bin" / "python"
    marker = VENV / ".installed"
    if marker.exists():
        return python
    VENV.parent.mkdir(parents=True, exist_ok=True)
    with open(VENV.parent / f"{VENV.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel test runs install once
        if not marker.exists():
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
            result = subprocess.run(
                [str(python), "-m", "pip", "install", "-q", f"matrix-synapse=={SYNAPSE_VERSION}"],
                capture_output=True,
                text=True,
            )
            if result.returncode != 0:
                raise RuntimeError(
                    f"installing matrix-synapse=={SYNAPSE_VERSION} failed:\n{result.stderr[-3000:]}"
                )
            # Byte-compile now: otherwise the first Synapse start takes ~30 s.
            subprocess.run(
                [str(python), "-m", "compileall", "-q", "-j0", str(VENV / "lib")],
                capture_output=True,
                check=False,
            )
            marker.touch()
    return python


LOG_CONFIG = """
version: 1
formatters:
  plain: {format: "%(asctime)s %(levelname)s %(name)s %(message)s"}
handlers:
  console: {class: logging.StreamHandler, formatter: plain}
root: {level: INFO, handlers: [console]}
disable_existing_loggers: false
"""


@dataclass
class Synapse:
    directory: Path
    fed_port: int
    client_port: int
    certs: CertFiles
    shared_secret: str
    process: subprocess.Popen[bytes] | None = None

    @property
    def server_name(self) -> str:
        return f"127.0.0.1:{self.fed_port}"

    @property
    def client_url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def log_path(self) -> Path:
        return self.directory / "synapse.log"

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "<no log>"

    def write_config(self) -> Path:
        d = self.directory
        generate_key_file(d / "signing.key")  # Synapse reads our key file format
        (d / "log.yaml").write_text(LOG_CONFIG)
        config = {
            "server_name": self.server_name,
            "pid_file": str(d / "homeserver.pid"),
            "public_baseurl": self.client_url + "/",
            "listeners": [
                {
                    "port": self.fed_port,
                    "bind_addresses": ["127.0.0.1"],
                    "type": "http",
                    "tls": True,
                    "resources": [{"names": ["federation"], "compress": False}],
                },
                {
                    "port": self.client_port,
                    "bind_addresses": ["127.0.0.1"],
                    "type": "http",
                    "tls": False,
                    "resources": [{"names": ["client"], "compress": False}],
                },
            ],
            "tls_certificate_path": str(self.certs.cert),
            "tls_private_key_path": str(self.certs.key),
            "database": {"name": "sqlite3", "args": {"database": str(d / "homeserver.db")}},
            "log_config": str(d / "log.yaml"),
            "media_store_path": str(d / "media"),
            "signing_key_path": str(d / "signing.key"),
            "report_stats": False,
            "registration_shared_secret": self.shared_secret,
            "macaroon_secret_key": secrets.token_hex(16),
            "form_secret": secrets.token_hex(16),
            "federation_verify_certificates": False,
            # Without this Synapse cannot fetch our key from loopback and answers 401.
            "ip_range_whitelist": ["127.0.0.0/8", "::1/128"],
            "trusted_key_servers": [],
            "suppress_key_server_warning": True,
            "enable_metrics": False,
            "rc_federation": {
                "window_size": 1000,
                "sleep_limit": 1000,
                "sleep_delay": 1,
                "reject_limit": 1000,
                "concurrent": 10,
            },
        }
        path = d / "homeserver.yaml"
        path.write_text(json.dumps(config, indent=1))  # JSON is YAML
        return path

    def start(self) -> None:
        config = self.write_config()
        log = open(self.log_path, "wb")  # noqa: SIM115 - handed to the child process
        self.process = subprocess.Popen(
            [str(synapse_python()), "-m", "synapse.app.homeserver", "-c", str(config)],
            cwd=self.directory,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"Synapse exited at start:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.client_url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"Synapse did not become healthy:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)

    def call(
        self, method: str, path: str, body: Any = None, token: str | None = None
    ) -> dict[str, Any]:
        """A client-API request; returns the JSON body (raises on HTTP errors)."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.client_url + path, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(request, timeout=10) as response:
            result: dict[str, Any] = json.loads(response.read())
            return result

    def register(self, localpart: str, password: str) -> dict[str, Any]:
        """Shared-secret registration (the admin API); returns user_id, token, device."""
        nonce = self.call("GET", "/_synapse/admin/v1/register")["nonce"]
        mac = hmac.new(self.shared_secret.encode(), digestmod=hashlib.sha1)
        for part in (nonce, localpart, password, "notadmin"):
            mac.update(part.encode())
            if part != "notadmin":
                mac.update(b"\x00")
        return self.call(
            "POST",
            "/_synapse/admin/v1/register",
            {
                "nonce": nonce,
                "username": localpart,
                "password": password,
                "admin": False,
                "mac": mac.hexdigest(),
            },
        )


def make_synapse(directory: Path) -> Synapse:
    directory.mkdir(parents=True, exist_ok=True)
    certs = make_certs(directory / "tls", ["127.0.0.1", "localhost"], self_signed=True)
    return Synapse(
        directory=directory,
        fed_port=free_port(),
        client_port=free_port(),
        certs=certs,
        shared_secret=secrets.token_hex(16),
    )
