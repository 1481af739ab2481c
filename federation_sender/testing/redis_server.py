"""A throwaway ``redis-server`` on a free loopback port, without persistence."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

from federation_sender.clock import SystemClock
from federation_sender.testing.ports import free_port

START_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class RedisServer:
    port: int
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"


def _wait_listening(proc: subprocess.Popen[bytes], port: int) -> None:
    clock = SystemClock()
    deadline = clock.monotonic_s() + START_TIMEOUT_S
    while clock.monotonic_s() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        # Polling a child's port; waiting on the child notices an early exit at once.
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(0.02)
            raise RuntimeError(f"redis-server exited with {proc.returncode} at start")
    raise RuntimeError(f"redis-server did not listen on port {port} within {START_TIMEOUT_S} s")


@contextlib.contextmanager
def ephemeral_redis() -> Iterator[RedisServer]:
    """Run ``redis-server`` for the duration of the block (the setup script installs it)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server not found; install the 'redis-server' package")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="fedsender-redis-") as tmp:
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", tmp],
            stdout=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            _wait_listening(proc, port)
            yield RedisServer(port)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
