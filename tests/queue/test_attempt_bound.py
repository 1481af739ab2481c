"""One deadline per attempt: the queue's (``TimedAttempts``) or, when the sender bounds
every attempt sooner on the same clock, the sender's. Either way a hung request ends."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from federation_sender.clock import SystemClock
from federation_sender.queue.attempt import TimedAttempts
from federation_sender.testing.clock import FakeClock
from federation_sender.transport.client import FederationClient
from federation_sender.transport.result import Outcome, SendResult, Transaction
from federation_sender.transport.signing import SigningKey

TXN = Transaction(destination="hang.test", txn_id="t1", pdus=(),
                  edus=({"edu_type": "m.test", "content": {}},))


class Hangs:
    """A sender that never answers, declaring (or not) a bound it does not keep."""

    def __init__(self, bound_s: float | None) -> None:
        if bound_s is not None:
            self.attempt_bound_s = bound_s

    async def send_transaction(self, txn: Transaction) -> SendResult:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


@pytest.fixture
async def silent_port() -> AsyncIterator[int]:
    """A loopback HTTP server that reads requests and never answers."""

    async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            await r.read()  # until the client goes away
        finally:
            w.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()


async def test_the_client_bounds_the_attempt_when_the_queue_adds_no_deadline(
    silent_port: int,
) -> None:
    client = FederationClient(
        server_name="us.test", signing_key=SigningKey.generate("a_t"), clock=SystemClock(),
        attempt_timeout_s=0.3, ip_allow_list=("127.0.0.0/8",), plain_http=True,
        destination_overrides={"hang.test": f"127.0.0.1:{silent_port}"})
    async with client:
        attempts = TimedAttempts(client, SystemClock(), 30.0)
        assert not attempts.own_deadline  # the client's 0.3 s comes first
        started = time.monotonic()
        result = await attempts.send(TXN)
        attempts.close()
    assert time.monotonic() - started < 5.0
    assert result.outcome is Outcome.TRANSIENT
    assert result.error is not None and "no response within 0.3 s" in result.error
    assert client.stats.outcomes["transient"] == 1  # the client's own accounting ran


@pytest.mark.parametrize("bound_s", [None, 60.0])
async def test_the_queue_keeps_its_deadline_unless_the_sender_bounds_sooner(
    bound_s: float | None,
) -> None:
    attempts = TimedAttempts(Hangs(bound_s), SystemClock(), 0.2)
    assert attempts.own_deadline
    started = time.monotonic()
    result = await attempts.send(TXN)
    attempts.close()
    assert time.monotonic() - started < 5.0
    assert result.outcome is Outcome.TRANSIENT
    assert result.error == "no answer within 0.2s"


async def test_on_an_injected_clock_the_queue_keeps_its_deadline() -> None:
    # The sender's bound runs on the event loop's clock, not on the injected one.
    clock = FakeClock()
    attempts = TimedAttempts(Hangs(1.0), clock, 30.0)
    assert attempts.own_deadline
    task = asyncio.ensure_future(attempts.send(TXN))
    for _ in range(100):  # until the deadline's timer sleeps on the clock
        if clock.pending_sleepers:
            break
        await asyncio.sleep(0)
    assert clock.pending_sleepers == 1
    clock.advance(31.0)
    result = await asyncio.wait_for(task, 5.0)
    attempts.close()
    assert result.error == "no answer within 30s"


async def _guarded(deadline: object, within_s: float | None, started: asyncio.Event) -> str:
    """One attempt that never ends by itself, under ``deadline``."""
    from federation_sender.aio.timing import AttemptDeadline

    assert isinstance(deadline, AttemptDeadline)
    try:
        async with asyncio.timeout(None) as timeout:
            deadline.watch(timeout, within_s)
            try:
                started.set()
                await asyncio.Event().wait()
            finally:
                deadline.unwatch()
    except TimeoutError:
        return "timed out"
    return "unreachable"


async def test_one_timer_bounds_each_attempt_by_its_own_shorter_bound() -> None:
    """Pacing's requests (``Confirmations._ask``) share one lazily armed timer, each
    bounded by what its confirmation has left: a bound shorter than the armed timer's
    moves the timer; a longer one than the deadline's seconds is cut to them."""
    from federation_sender.aio.timing import AttemptDeadline

    clock = FakeClock()
    deadline = AttemptDeadline(clock, 30.0)

    async def attempt(within_s: float | None) -> asyncio.Task[str]:
        started = asyncio.Event()
        task = asyncio.ensure_future(_guarded(deadline, within_s, started))
        await started.wait()
        return task

    # The timer is armed for 30 s; then an attempt with 5 s left must end at 5 s.
    first = await attempt(None)
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    short = await attempt(5.0)
    await clock.advance_and_settle(4.9)
    assert not short.done()
    await clock.advance_and_settle(0.2)
    assert short.done() and short.result() == "timed out"
    # A bound past the deadline's seconds is cut to them.
    long = await attempt(300.0)
    await clock.advance_and_settle(29.9)
    assert not long.done()
    await clock.advance_and_settle(0.2)
    assert long.done() and long.result() == "timed out"
    deadline.close()
