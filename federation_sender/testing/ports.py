"""Loopback port allocation for tests, demos and harnesses: the one copy."""

from __future__ import annotations

import random
import socket


def free_port(below: int = 32768) -> int:
    """A free loopback TCP port in [20000, ``below``), outside the ephemeral range.

    Picking below the kernel's ephemeral range (32768+ on Linux) means a port
    handed out here is not taken a moment later by some outgoing connection
    before the caller binds it.
    """
    rng = random.Random()
    for _ in range(200):
        port = rng.randint(20000, below - 1)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port found")
