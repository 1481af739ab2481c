"""Connections of the built-in HTTP/1.1 client, over TLS with a small read buffer.

asyncio wraps a TLS connection in ``asyncio.sslproto.SSLProtocol``, which allocates a
256 KiB read buffer per connection (``max_size``) and holds it for the connection's
life: measured here, 289 KB of RSS per TLS connection end in Python 3.11. A federation
sender keeps a connection alive per destination: 415 destinations held 115 MB in
buffers alone, a 10,000-server room would hold 2.8 GB. :class:`LeanSSLProtocol` is
asyncio's own TLS protocol with a 16 KiB buffer (one TLS record's plaintext at most);
reading a larger response takes more turns of its read loop, nothing else changes.
:func:`open_connection` sets up what ``loop.create_connection(ssl=...)`` sets up -- the
TLS protocol over the socket's transport, the handshake awaited, the application
protocol told of its transport once the handshake is done -- with that class.
``asyncio.sslproto`` is not in asyncio's documented API; it has been the home of
asyncio's TLS since 3.4 and is what uvloop's loop also accepts as a protocol.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from asyncio import sslproto
from collections.abc import Callable
from typing import TypeVar

P = TypeVar("P", bound=asyncio.Protocol)

READ_BUFFER_BYTES = 16 * 1024


class LeanSSLProtocol(sslproto.SSLProtocol):
    """asyncio's TLS protocol with a 16 KiB read buffer instead of 256 KiB."""

    max_size = READ_BUFFER_BYTES


async def open_connection(loop: asyncio.AbstractEventLoop, factory: Callable[[], P],
                          sock: socket.socket, context: ssl.SSLContext | None,
                          server_hostname: str | None) -> P:
    """The application protocol ``factory`` makes, connected over ``sock`` (already
    connected), through TLS when ``context`` is given (handshake done on return)."""
    if context is None:
        _, protocol = await loop.create_connection(factory, sock=sock)
        return protocol
    app = factory()
    waiter = loop.create_future()
    tls = LeanSSLProtocol(loop, app, context, waiter, server_side=False,
                          server_hostname=server_hostname)
    transport, _ = await loop.create_connection(lambda: tls, sock=sock)
    try:
        await waiter
    except BaseException:
        transport.close()
        raise
    return app
