"""A real forward proxy (Debian's ``tinyproxy``) on a free loopback port.

:func:`tinyproxy` writes a configuration into a directory and runs ``tinyproxy -d``
(foreground) until the block ends, as :mod:`federation_sender.testing.redis_server`
runs Redis. It allows ``CONNECT`` to any port (no ``ConnectPort`` line) from loopback
only and logs every connection into ``tinyproxy.log``, which tests read to see what
went through the proxy. ``credentials`` turn on Basic authentication (407 without
them). :meth:`ProxyServer.stop` stops it early (the proxy going down) and
:meth:`ProxyServer.start` brings it back on the same port.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from federation_sender.clock import SystemClock
from federation_sender.testing.ports import free_port

START_TIMEOUT_S = 10.0


class TinyproxyMissing(RuntimeError):
    """``tinyproxy`` is not installed (``scripts/bootstrap.sh test`` installs it)."""


@dataclass
class ProxyServer:
    port: int
    log_path: Path
    credentials: tuple[str, str] | None = None
    host: str = "127.0.0.1"
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    command: list[str] = field(default_factory=list, repr=False)

    def start(self) -> None:
        """(Re)start the proxy on the same port and wait until it listens."""
        if self.popen is not None and self.popen.poll() is None:
            return
        self.popen = subprocess.Popen(
            self.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        _wait_listening(self.popen, self.port)

    def url(self, credentials: tuple[str, str] | None = None) -> str:
        """``http://[user:password@]host:port`` (credentials given, or none)."""
        auth = ""
        if credentials is not None:
            auth = f"{quote(credentials[0], safe='')}:{quote(credentials[1], safe='')}@"
        return f"http://{auth}{self.host}:{self.port}"

    def connects(self) -> list[str]:
        """The ``host:port`` of every tunnel requested so far, in order."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return []
        out = []
        for line in text.splitlines():
            if "Request (file descriptor" in line and "): CONNECT " in line:
                out.append(line.split("): CONNECT ", 1)[1].split(" ", 1)[0])
        return out

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)


def _config(port: int, log: Path, credentials: tuple[str, str] | None) -> str:
    lines = [
        f"Port {port}", "Listen 127.0.0.1", "Timeout 30", "MaxClients 50",
        "LogLevel Info", f'LogFile "{log}"', "Allow 127.0.0.1",
    ]  # fmt: skip
    if credentials is not None:
        lines.append(f"BasicAuth {credentials[0]} {credentials[1]}")
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def tinyproxy(directory: Path, *, credentials: tuple[str, str] | None = None
              ) -> Iterator[ProxyServer]:
    binary = shutil.which("tinyproxy")
    if binary is None:
        raise TinyproxyMissing("tinyproxy not found; install the 'tinyproxy' package")
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = directory / "tinyproxy.log"
    conf = directory / "tinyproxy.conf"
    conf.write_text(_config(port, log, credentials))
    server = ProxyServer(port, log, credentials, command=[binary, "-d", "-c", str(conf)])
    try:
        server.start()
        yield server
    finally:
        server.stop()


def _wait_listening(proc: subprocess.Popen[bytes], port: int) -> None:
    clock = SystemClock()
    deadline = clock.monotonic_s() + START_TIMEOUT_S
    while clock.monotonic_s() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        # Polling a child's port; waiting on the child notices an early exit at once.
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(0.02)
            raise RuntimeError(f"tinyproxy exited with {proc.returncode} at start")
    raise RuntimeError(f"tinyproxy did not listen on port {port} within {START_TIMEOUT_S} s")
