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


def free_port_block(size: int, below: int = 32768) -> int:
    """A base port with ``size`` free consecutive loopback ports from it, in
    [20000, ``below``) like :func:`free_port` (``demo --port-base``)."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randint(20000, below - size)
        try:
            for port in range(base, base + size):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no block of {size} free ports found")
