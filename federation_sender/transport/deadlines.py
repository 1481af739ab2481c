"""One deadline for many concurrent attempts of the same length, on one timer.

Why: ``asyncio.timeout(seconds)`` schedules a timer when an attempt starts and cancels
it when the attempt ends. A busy sender starts thousands of attempts a second and
nearly all of them end long before their deadline, so the event loop's timer heap
fills with cancelled handles; every push and every clean-up compares handles through
Python-level ``TimerHandle.__lt__``. In the fan-out benchmark at 200 destinations the
client's ``async with asyncio.timeout(...)`` was about 5 % of the process's CPU
(``bench/profile_fanout.py``).

How: every attempt has the same length, so deadlines expire in the order attempts
started. Each attempt enters ``asyncio.timeout(None)`` (no timer of its own) and is
:meth:`Deadlines.watch` ed: an entry appended to an insertion-ordered dict. One timer,
armed for the oldest entry's deadline, expires every entry whose deadline has passed
(``Timeout.reschedule`` to now: asyncio cancels the attempt and its ``async with``
raises :class:`TimeoutError`, exactly as with a timer of its own), then re-arms for
the next. Ending an attempt removes its entry; the timer is not touched, and when it
fires with nothing due it re-arms for the oldest entry left, or stays unarmed.

Precision is the event loop's, as with ``asyncio.timeout``: an attempt expires at its
deadline or, if the loop is busy then, at its next turn.
"""

from __future__ import annotations

import asyncio
import itertools


class Deadlines:
    """Attempts of ``seconds`` each, expired by one timer (see the module docstring)."""

    __slots__ = ("_entries", "_handle", "_keys", "_loop", "_seconds")

    def __init__(self, seconds: float) -> None:
        if seconds <= 0:
            raise ValueError("a deadline must be positive")
        self._seconds = seconds
        self._entries: dict[int, tuple[float, asyncio.Timeout]] = {}
        self._keys = itertools.count()
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def watched(self) -> int:
        """Attempts under watch now (for tests)."""
        return len(self._entries)

    def watch(self, timeout: asyncio.Timeout) -> int:
        """Expire ``timeout`` (entered with no deadline) ``seconds`` from now; returns
        the key for :meth:`unwatch`."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._reset(loop)  # a new event loop: nothing of the old one can be expired
        key = next(self._keys)
        expires = loop.time() + self._seconds
        self._entries[key] = (expires, timeout)
        if self._handle is None:
            self._handle = loop.call_at(expires, self._fire)
        return key

    def unwatch(self, key: int) -> None:
        """The attempt ended (any way): no longer expire it."""
        self._entries.pop(key, None)

    def close(self) -> None:
        """Stop the timer; attempts still watched are no longer expired."""
        self._reset(None)

    def _reset(self, loop: asyncio.AbstractEventLoop | None) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._entries.clear()
        self._loop = loop

    def _fire(self) -> None:
        self._handle = None
        loop = self._loop
        if loop is None:
            return
        now = loop.time()
        entries = self._entries
        while entries:
            key = next(iter(entries))
            expires, timeout = entries[key]
            if expires > now:
                self._handle = loop.call_at(expires, self._fire)
                return
            del entries[key]
            if timeout.expired():
                continue
            timeout.reschedule(now)  # asyncio cancels the attempt at its next step
