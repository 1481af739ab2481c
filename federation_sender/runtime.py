"""Process-level runtime choices: the event loop, and handing freed memory back.

Theory of operation
-------------------
**Event loop.** The worker runs on asyncio's own loop unless ``--event-loop uvloop``
(the ``uvloop`` extra installed) or ``auto`` (uvloop when installed) is given.
``bench/runtime_ab.py loop`` measured the two side by side with the production sender:
uvloop used 4 % and 6 % less CPU per transaction at 200 and 1,000 destinations
(docs/benchmarks.md), less than one run moves, so the default stays the standard
library's (the test suite runs on it). The code never
depends on which loop runs it.

**Freed memory.** A worker that had thousands of live queues at once (a burst, a
catch-up after an outage) frees their objects when they go idle, but the C allocator
keeps the pages: the process stays at its high-water mark (``bench/idle_memory.py``:
162 MB after 20,000 destinations had one transaction each, 136 MB after
``malloc_trim``). :class:`MemoryTrimmer` watches the number of live queues and, once it
has fallen by ``min_drop`` from the last peak, collects cyclic garbage and asks glibc to
return free pages (``malloc_trim(0)``, in a thread: ctypes releases the GIL, the event
loop goes on). On a C library without ``malloc_trim`` it does nothing.

**Open files.** The worker keeps a connection alive per destination it sends to (60 s
after the last transaction): a 10,000-server room holds 10,000 sockets at once
(``bench/big_room.py``), ten times the soft limit many systems start a process with
(1,024). :func:`run` raises the soft limit to the hard one, as Synapse does at start.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import resource
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

from federation_sender.clock import Clock

log = logging.getLogger(__name__)

T = TypeVar("T")
LoopChoice = Literal["auto", "uvloop", "asyncio"]


def loop_factory(choice: LoopChoice = "asyncio") -> Callable[[], asyncio.AbstractEventLoop]:
    """The event loop constructor for ``choice``; ``uvloop`` raises if not installed."""
    if choice == "asyncio":
        return asyncio.new_event_loop
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise
        return asyncio.new_event_loop
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def raise_open_file_limit() -> int:
    """Raise the soft limit on open files to the hard limit; returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft >= hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as e:  # a container may refuse; run with what we have
        log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, e)
        return soft
    return hard


def run(main: Coroutine[Any, Any, T], choice: LoopChoice = "asyncio") -> T:
    """``asyncio.run(main)`` on the chosen event loop, the open-file limit raised."""
    raise_open_file_limit()
    with asyncio.Runner(loop_factory=loop_factory(choice)) as runner:
        return runner.run(main)


def _load_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        fn: Callable[[int], int] = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    return fn


_TRIM = _load_trim()


def malloc_trim() -> bool:
    """Return free heap pages to the OS (glibc); False where unavailable."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


class MemoryTrimmer:
    """Trims the heap after the number of live queues fell by ``min_drop``."""

    def __init__(
        self,
        live: Callable[[], int],
        clock: Clock,
        *,
        interval_s: float = 15.0,
        min_drop: int = 1000,
    ) -> None:
        self._live = live
        self._clock = clock
        self._interval_s = interval_s
        self._min_drop = min_drop
        self._peak = 0
        self.trims = 0
        self.trimmed = asyncio.Event()
        """Set after every trim (tests and benchmarks wait on it)."""

    def check(self) -> bool:
        """One observation; True if a trim is due now (and the peak is reset)."""
        n = self._live()
        self._peak = max(self._peak, n)
        if self._peak - n < self._min_drop:
            return False
        self._peak = n
        return True

    async def run(self) -> None:
        if _TRIM is None:
            return
        while True:
            await self._clock.sleep(self._interval_s)
            if self.check():
                # The queues' objects are partly in reference cycles, which the raised
                # collector thresholds leave for later: collect them first, or the
                # trim finds their pages still in use. Rare (after a drop of
                # ``min_drop`` live queues), so its pause is affordable.
                gc.collect()
                await asyncio.to_thread(malloc_trim)
                self.trims += 1
                self.trimmed.set()
                log.debug("returned freed memory to the OS (trim %d)", self.trims)
