"""Cancelling the replication client stops it: a session's close, or a library on the
way, must not swallow the cancellation and leave it reconnecting forever."""

from __future__ import annotations

import asyncio

from federation_sender.intake.streams import ROW_PARSERS
from federation_sender.replication.client import ReplicationClient
from federation_sender.replication.transport import ConnectionLost, Session, cancel_and_wait
from federation_sender.testing.clock import FakeClock
from federation_sender.testing.replication import InMemoryPositionStore, RecordingHandler


async def test_a_cancel_arriving_while_a_helper_winds_down_is_not_swallowed() -> None:
    helper_cancelled = asyncio.Event()
    helper_started = asyncio.Event()

    async def helper() -> None:
        helper_started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            helper_cancelled.set()
            await asyncio.Event().wait()  # slow to wind down: the caller waits here
            raise

    after_close: list[str] = []

    async def closer() -> None:
        running = asyncio.create_task(helper())
        await helper_started.wait()
        await cancel_and_wait(running)
        after_close.append("carried on")  # a swallowed cancel would get here

    task = asyncio.create_task(closer())
    await asyncio.wait_for(helper_cancelled.wait(), 5)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=5)
    assert task in done and task.cancelled()
    assert after_close == []


async def test_the_helpers_own_cancellation_is_absorbed() -> None:
    async def helper() -> None:
        await asyncio.Event().wait()

    await cancel_and_wait(asyncio.create_task(helper()))  # returns, does not raise


class _SwallowingTransport:
    """Its ``open`` turns a cancellation into a connection error, as a client library
    that catches CancelledError inside connect would."""

    description = "swallowing"

    def __init__(self) -> None:
        self.opening = asyncio.Event()

    async def open(self) -> Session:
        self.opening.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise ConnectionLost("connect interrupted") from None
        raise AssertionError("unreachable")


async def test_a_cancelled_client_stops_even_if_a_library_swallowed_the_cancel() -> None:
    transport = _SwallowingTransport()
    client = ReplicationClient(
        transport,
        instance_name="fed1",
        store=InMemoryPositionStore(),
        fetchers={},
        handler=RecordingHandler(),
        streams=ROW_PARSERS,
        clock=FakeClock(),  # a reconnect backoff would wait forever on it
    )
    task = asyncio.create_task(client.run())
    await asyncio.wait_for(transport.opening.wait(), 5)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=5)
    assert task in done and task.cancelled()
