"""Loopback port allocation for tests, demos and harnesses: the one copy.

A port is probed (bound and released) here and bound for real later by whoever asked,
often a child process that takes seconds to start (Synapse). Three things could take
the same port in between (the first two failed a CI run: "Address already in use"):

- the same process asking again (a Synapse deployment asks for four ports before any is
  bound): a port handed out is never handed out again by this process;
- another pytest-xdist worker probing the same port: each worker draws from its own
  slice of the range (``PYTEST_XDIST_WORKER`` is ``gwN`` of
  ``PYTEST_XDIST_WORKER_COUNT``);
- another process run beside, such as scripts/other-pythons.sh's tests and demos on
  3.12 and 3.13 at once: ``FEDERATION_SENDER_PORT_SLICE=K/N`` gives a process the K-th
  of N slices (xdist workers then share that slice out among themselves).
"""

from __future__ import annotations

import os
import random
import socket
import threading

LOWEST = 20000
PORT_SLICE_ENV = "FEDERATION_SENDER_PORT_SLICE"
_handed_out: set[int] = set()
_lock = threading.Lock()


def port_range(below: int = 32768, environ: dict[str, str] | None = None) -> range:
    """The ports this process draws from: [20000, ``below``), or the slice
    ``FEDERATION_SENDER_PORT_SLICE`` gives it, or this xdist worker's share of that."""
    env = os.environ if environ is None else environ
    whole = range(LOWEST, below)
    given = env.get(PORT_SLICE_ENV, "").partition("/")
    if given[0].isdigit() and given[2].isdigit() and int(given[2]) > 0:
        whole = _slice(whole, int(given[0]), int(given[2]))
    worker = env.get("PYTEST_XDIST_WORKER", "")
    count = env.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (worker.startswith("gw") and worker[2:].isdigit() and count.isdigit()):
        return whole
    return _slice(whole, int(worker[2:]), max(int(count), 1))


def _slice(ports: range, index: int, count: int) -> range:
    width = len(ports) // count
    start = ports.start + (index % count) * width
    return range(start, start + width)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port(below: int = 32768) -> int:
    """A free loopback TCP port in [20000, ``below``), outside the ephemeral range.

    Picking below the kernel's ephemeral range (32768+ on Linux) means a port
    handed out here is not taken a moment later by some outgoing connection
    before the caller binds it.
    """
    return free_port_block(1, below)


def free_port_block(size: int, below: int = 32768) -> int:
    """A base port with ``size`` free consecutive loopback ports from it, in
    [20000, ``below``) like :func:`free_port` (``demo --port-base``)."""
    ports = port_range(below)
    rng = random.Random()
    with _lock:
        for _ in range(200):
            base = rng.randint(ports.start, ports.stop - size)
            block = range(base, base + size)
            if any(p in _handed_out for p in block) or not all(map(_bindable, block)):
                continue
            _handed_out.update(block)
            return base
    raise RuntimeError(f"no block of {size} free ports found in {ports.start}-{ports.stop - 1}")
