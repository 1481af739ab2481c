"""Waiting in tests for a condition another task, thread or process makes true.

The one way a test waits in real time (a real HTTP server, a real database, a worker
process, Synapse): look at the state through ``probe`` until ``accept`` takes what it
returns, or fail at the deadline. Code under test on a :class:`FakeClock` does not wait
here; it advances the clock.

``probe`` returns what it saw (a count, a position, a list), not only whether it is done,
so that a timeout says what was awaited *and* what was last seen, e.g.::

    await wait_until(lambda: h.fake.in_progress, "one transaction in flight",
                     accept=lambda n: n == 1, timeout_s=10)
    # WaitTimedOut: timed out after 10 s waiting for one transaction in flight;
    #               last observed: 0

Without ``accept`` the value itself must be truthy. A probe that raises ends the wait with
its error. The deadline is hard for :func:`wait_until` (a probe that hangs is cancelled at
it); :func:`wait_until_blocking` checks it between probes (it is for probes that block on
another process, e.g. a SQL query on Synapse's database).

``wake`` (optional) is an event set whenever the awaited state may have changed; the wait
then re-checks at once instead of at the next ``every_s``. ``details`` (optional) adds to
the failure message what would explain it, e.g. the tail of a worker's log.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

_NOTHING = object()
_REPR_CHARS = 500


class WaitTimedOut(AssertionError):
    """A condition a test waited for did not hold by its deadline."""

    def __init__(self, what: str, timeout_s: float, last: object, details: str = "") -> None:
        seen = "nothing (the probe never returned)" if last is _NOTHING else _short(last)
        super().__init__(f"timed out after {timeout_s:g} s waiting for {what}; "
                         f"last observed: {seen}" + (f"\n{details}" if details else ""))
        self.what, self.timeout_s = what, timeout_s
        self.last = None if last is _NOTHING else last


async def wait_until(
    probe: Callable[[], T | Awaitable[T]],
    what: str = "",
    *,
    timeout_s: float,
    accept: Callable[[T], object] = bool,
    every_s: float = 0.01,
    wake: asyncio.Event | None = None,
    details: Callable[[], str] | None = None,
) -> T:
    """Return the first value of ``probe()`` that ``accept`` takes; fail after ``timeout_s``."""
    what = what or _describe(probe)
    last: object = _NOTHING
    deadline = asyncio.timeout(timeout_s)
    try:
        async with deadline:
            # Look first after one turn of the loop: tasks the caller has just created
            # have started (a probe may read what they set up).
            await asyncio.sleep(0)  # noqa: TID251 - a yield, not a wait
            while True:
                if wake is not None:
                    wake.clear()  # before the probe: a change during it wakes the next wait
                value = probe()
                if inspect.isawaitable(value):
                    value = await value
                last = value
                if accept(value):
                    return value
                if wake is None:
                    await asyncio.sleep(every_s)  # noqa: TID251 - real time: the state is real
                else:
                    # Some state changes without a wake-up: re-check after every_s anyway.
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(wake.wait(), every_s)
    except TimeoutError:
        if not deadline.expired():
            raise  # the probe's own timeout: its error, not ours
        raise WaitTimedOut(what, timeout_s, last, details() if details else "") from None


def wait_until_blocking(
    probe: Callable[[], T],
    what: str = "",
    *,
    timeout_s: float,
    accept: Callable[[T], object] = bool,
    every_s: float = 0.05,
    details: Callable[[], str] | None = None,
) -> T:
    """:func:`wait_until` for a blocking probe, outside an event loop."""
    what = what or _describe(probe)
    end = time.monotonic() + timeout_s  # noqa: TID251 - real time: the state is real
    while True:
        value = probe()
        if accept(value):
            return value
        if time.monotonic() > end:  # noqa: TID251
            raise WaitTimedOut(what, timeout_s, value, details() if details else "")
        time.sleep(every_s)


def _describe(probe: Callable[..., object]) -> str:
    """The probe's source line when the caller did not say what it waits for."""
    try:
        return inspect.getsource(probe).strip()
    except (OSError, TypeError):
        return repr(probe)


def _short(value: object) -> str:
    """``repr(value)``, its middle cut out if long (a log's tail matters as its head)."""
    text = repr(value)
    half = _REPR_CHARS // 2
    return text if len(text) <= _REPR_CHARS else f"{text[:half]} … {text[-half:]}"


async def wait_admin_ready(admin_port: int, check_alive: Callable[[], None],
                           timeout_s: float = 60.0) -> None:
    """Wait for a worker's ``/ready`` on loopback to answer 200 (started and connected
    to replication); ``check_alive`` raises when the process exited meanwhile."""
    import aiohttp

    async with aiohttp.ClientSession() as http:

        async def ready() -> int | str:
            check_alive()
            try:
                async with http.get(f"http://127.0.0.1:{admin_port}/ready") as r:
                    return r.status
            except aiohttp.ClientError as e:
                return repr(e)

        def ok(status: int | str) -> bool:
            return status == 200

        await wait_until(ready, "the worker's /ready", accept=ok, timeout_s=timeout_s,
                         every_s=0.1)
