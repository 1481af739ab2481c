"""A plain TCP server on loopback for tests, which closes what it accepted: the one copy
(an accepted connection left open is a ResourceWarning, an error in the suite)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def loopback_server(handler: Handler) -> AsyncIterator[int]:
    """A loopback server running ``handler`` per connection; yields its port.

    Each connection is closed when its handler returns, and on exit a handler still
    running is cancelled and its connection closed before the server is waited for:
    from Python 3.12 ``wait_closed()`` also waits for every connection still open (a
    client's half-closed one, a handler parked on an event), and would never return.
    """
    handlers: set[asyncio.Task[None]] = set()
    writers: set[asyncio.StreamWriter] = set()

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        writers.add(w)
        try:
            await handler(r, w)
        finally:
            handlers.discard(task)
            w.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for task in list(handlers):
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        for w in writers:
            w.transport.abort()  # a close() still flushing to a client that left
        await server.wait_closed()
