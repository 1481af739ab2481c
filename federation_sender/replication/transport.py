"""What the reader client needs from a transport (TCP, Redis, in-memory).

A :class:`Transport` opens :class:`Session` objects; a session is one
connection (TCP) or one subscription (Redis). The client sends through
:meth:`Session.send` and receives batches of commands from
:meth:`Session.receive`, which raises :class:`ConnectionLost` when the session
is over (peer closed, keepalive timeout, congestion, our own abort) and
``ProtocolError`` for bad input (the session has already told the peer and
closed), except on a session that ``skips_bad_input`` (the Redis bus), which
logs it and reads on. ``Transport.open`` returns only when sending
``REPLICATE`` is safe: for TCP after ``NAME`` and ``PING`` are queued, for
Redis after the subscription is confirmed, so no reply to it can be missed.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from federation_sender.clock import Clock
from federation_sender.errors import RemoteTransientError
from federation_sender.replication import commands as c


class ConnectionLost(RemoteTransientError):
    """The session ended; reconnect."""


class Session(Protocol):
    supports_psync: bool
    """Whether ``REPLICATE`` may carry the PSYNC offer (always safe: plain peers
    ignore it), and whether ``HISTORY`` can arrive on this session."""

    skips_bad_input: bool
    """Whether bad input (a line or row that does not parse) is skipped with a warning
    rather than ending the session. True on the Redis bus, where any process may publish
    and the next message does not depend on the bad one; False on TCP, where Synapse
    answers ``ERROR`` and closes, and we do the same."""

    def send(self, command: c.Command) -> None:
        """Queue a command for the peer(s); never blocks."""

    async def receive(self) -> list[c.Command]:
        """The next non-empty batch of commands, in order."""

    def abort(self, reason: str) -> None:
        """Tell the peer (where the transport has one) and end the session."""

    async def close(self) -> None:
        """End the session and release its resources."""


class Transport(Protocol):
    description: str

    async def open(self) -> Session:
        """Connect (and handshake/subscribe); raises ``OSError``-derived errors
        translated to :class:`ConnectionLost` on failure."""


async def close_stream_writer(
    writer: asyncio.StreamWriter, clock: Clock, grace_s: float = 5.0
) -> None:
    """Close, flushing what is buffered, but abort a peer that will not read."""
    writer.close()
    waiter = asyncio.ensure_future(writer.wait_closed())
    timer = asyncio.ensure_future(clock.sleep(grace_s))
    try:
        done, _ = await asyncio.wait({waiter, timer}, return_when=asyncio.FIRST_COMPLETED)
        if waiter not in done:
            writer.transport.abort()
    finally:
        timer.cancel()
        if not waiter.done():
            waiter.cancel()
        elif not waiter.cancelled():
            waiter.exception()  # consume: a reset peer is expected here


async def cancel_and_wait(task: asyncio.Task[None]) -> None:
    """Cancel a helper task (a session's timer or publisher) and wait for it to end.

    The helper's own CancelledError is absorbed; a cancellation of the *caller* that
    arrives meanwhile is not (``contextlib.suppress(CancelledError)`` here would swallow
    it, and a cancelled replication client would carry on reconnecting forever).
    """
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
