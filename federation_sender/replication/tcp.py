"""TCP transports on asyncio streams: the reader's session and the writer's server.

Both are thin shells around :class:`ReplicationConnection`: they read bytes and
feed them in, write what it queues, and run one timer task that sleeps (on the
injected clock) until the connection's next keepalive deadline. All policy --
framing, direction, keepalive, congestion -- lives in the connection.

Reader (:class:`TcpTransport`): ``open()`` connects, queues ``NAME`` and
``PING`` and returns a :class:`TcpSession`; the client then sends ``REPLICATE``.
Reconnection is the client's job (``client.py``).

Writer (:class:`TcpReplicationServer`): each accepted reader gets ``SERVER`` and
``PING``, its own connection state, a flusher task that writes and awaits
``drain()`` (so a slow reader lets commands pile up in the connection until
congestion closes it) and the replies to its ``REPLICATE``. ``HISTORY`` goes
only to readers that offered PSYNC.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

from federation_sender.clock import Clock
from federation_sender.errors import ProtocolError
from federation_sender.replication import commands as c
from federation_sender.replication.connection import (
    DEFAULT_LIMITS,
    Limits,
    ReplicationConnection,
    Role,
)
from federation_sender.replication.server import ReplicationWriter
from federation_sender.replication.transport import (
    ConnectionLost,
    cancel_and_wait,
    close_stream_writer,
)

logger = logging.getLogger(__name__)

READ_CHUNK = 65536
CLOSE_GRACE_S = 5.0


async def _run_timer(conn: ReplicationConnection, clock: Clock, flush: Callable[[], None]) -> None:
    while True:
        deadline = conn.next_deadline()
        if deadline is None:
            return
        await clock.sleep(max(0.0, deadline - clock.monotonic_s()))
        conn.on_timer()
        flush()


class _Flush:
    """Write what the connection has queued; close the stream once it is closed."""

    def __init__(self, conn: ReplicationConnection, writer: asyncio.StreamWriter) -> None:
        self._conn = conn
        self._writer = writer

    def __call__(self) -> None:
        data = self._conn.data_to_send()
        if data and not self._writer.is_closing():
            self._writer.write(data)
        if self._conn.closed and not self._writer.is_closing():
            self._writer.close()


class TcpSession:
    """One reader-side TCP connection (implements ``transport.Session``)."""

    supports_psync = True
    skips_bad_input = False

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        conn: ReplicationConnection,
        clock: Clock,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._conn = conn
        self._clock = clock
        self._flush = _Flush(conn, writer)
        self._timer = asyncio.create_task(_run_timer(conn, clock, self._flush))
        self._error: ProtocolError | None = None
        self._flush()

    def send(self, command: c.Command) -> None:
        self._conn.send(command)
        self._flush()

    async def receive(self) -> list[c.Command]:
        while True:
            if self._error is not None:
                raise self._error
            if self._conn.closed:
                raise ConnectionLost(f"connection closed: {self._conn.close_reason}")
            try:
                data = await self._reader.read(READ_CHUNK)
            except OSError as e:
                raise ConnectionLost(self._ours() or f"read failed: {e}") from e
            if not data:
                # Our own close (a ping timeout from the timer task) also ends the read
                # with end-of-file; say whose close it was.
                ours = self._ours()
                self._conn.close()
                raise ConnectionLost(ours or "peer closed the connection")
            self._conn.receive_data(data)
            out, self._error = self._conn.drain_commands()
            self._flush()
            if out:
                return out

    def _ours(self) -> str | None:
        """``closed by us: <reason>`` once this side has closed the connection."""
        if self._conn.closed:
            return f"closed by us: {self._conn.close_reason}"
        return None

    def abort(self, reason: str) -> None:
        self._conn.close(reason)
        self._flush()

    async def close(self) -> None:
        self._conn.close()
        try:
            await cancel_and_wait(self._timer)
        finally:
            # A cancelled caller (the client's task stopped) gets its CancelledError
            # back from cancel_and_wait; the socket is closed all the same.
            await close_stream_writer(self._writer, self._clock)


class TcpTransport:
    """Connects to a writer's replication listener (implements ``transport.Transport``)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        clock: Clock,
        client_name: str,
        expected_server_name: str | None = None,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        self.host = host
        self.port = port
        self._clock = clock
        self._name = client_name
        self._expected = expected_server_name
        self._limits = limits
        self.description = f"tcp://{host}:{port}"

    async def open(self) -> TcpSession:
        try:
            reader, writer = await asyncio.open_connection(self.host, self.port)
        except OSError as e:
            raise ConnectionLost(f"connect to {self.description} failed: {e}") from e
        conn = ReplicationConnection(
            Role.CLIENT, self._clock, expected_server_name=self._expected, limits=self._limits
        )
        conn.send(c.NameCommand(self._name))
        conn.send(c.PingCommand(str(int(self._clock.time_s() * 1000))))
        return TcpSession(reader, writer, conn, self._clock)


class _ServerPeer:
    """A connected reader, as the writer sees it."""

    def __init__(
        self, conn: ReplicationConnection, writer: asyncio.StreamWriter, clock: Clock
    ) -> None:
        self.conn = conn
        self.writer = writer
        self.psync = False
        self.wake = asyncio.Event()
        self._clock = clock
        self._aborter: asyncio.Task[None] | None = None

    def on_broadcast(self, commands: Sequence[c.Command]) -> None:
        conn = self.conn
        for command in commands:
            if conn.closed:
                break
            if not self.psync and type(command) is c.HistoryCommand:
                continue
            conn.send(command)
        if conn.closed:
            # Congested or failed: push the ERROR out now, the flusher may be
            # stuck in drain() behind a reader that stopped reading.
            self.write_now_and_close()
        self.wake.set()

    def write_now_and_close(self) -> None:
        """Queue what is left (the ERROR) and close; abort if not flushed in time.

        A congested reader may never read again, and then a plain close would
        wait for the flush forever and keep the handler's read loop alive.
        """
        data = self.conn.data_to_send()
        if not self.writer.is_closing():
            if data:
                self.writer.write(data)
            self.writer.close()
            self._aborter = asyncio.create_task(self._abort_later())

    async def _abort_later(self) -> None:
        await self._clock.sleep(CLOSE_GRACE_S)
        self.writer.transport.abort()

    def cancel_abort(self) -> None:
        if self._aborter is not None:
            self._aborter.cancel()

    async def run_flusher(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            data = self.conn.data_to_send()
            if data and not self.writer.is_closing():
                self.writer.write(data)
                await self.writer.drain()
            if self.conn.closed:
                self.write_now_and_close()
                return


class TcpReplicationServer:
    """Serves a :class:`ReplicationWriter` to any number of TCP readers."""

    def __init__(
        self,
        writer: ReplicationWriter,
        *,
        clock: Clock,
        host: str = "127.0.0.1",
        port: int = 0,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        self._rw = writer
        self._clock = clock
        self._host = host
        self._port = port
        self._limits = limits
        self._server: asyncio.Server | None = None
        self._closing = False
        self._handlers: set[asyncio.Task[None]] = set()
        self.peers: set[_ServerPeer] = set()

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("server not started")
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def start(self) -> None:
        self._closing = False
        self._server = await asyncio.start_server(self._on_connect, self._host, self._port)

    async def close(self) -> None:
        """Stop accepting, tell every reader we are stopping, close them.

        Every connection is closed before ``wait_closed()``, which from Python 3.12 also
        waits for the connections still open."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        for peer in list(self.peers):
            peer.conn.close("server stopping")
            peer.write_now_and_close()
        # Closing each stream ends its handler's read loop; wait for them.
        if self._handlers:
            await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._closing:
            # Accepted just before close(), whose wait for the handlers missed this one:
            # left open, it would hold close() in wait_closed() until the reader left.
            writer.transport.abort()
            return
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            await self._serve(reader, writer)
        except (OSError, ConnectionError) as e:
            logger.info("replication reader connection failed: %s", e)
        finally:
            self._handlers.discard(task)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = ReplicationConnection(Role.SERVER, self._clock, limits=self._limits)
        peer = _ServerPeer(conn, writer, self._clock)
        conn.send(c.ServerCommand(self._rw.server_name))
        conn.send(c.PingCommand(str(int(self._clock.time_s() * 1000))))
        peer.wake.set()
        self.peers.add(peer)
        unsubscribe = self._rw.subscribe(peer, peer.on_broadcast)
        flusher = asyncio.create_task(peer.run_flusher())
        timer = asyncio.create_task(_run_timer(conn, self._clock, peer.wake.set))
        try:
            while not conn.closed and not flusher.done():
                data = await reader.read(READ_CHUNK)
                if not data:
                    conn.close()
                    break
                conn.receive_data(data)
                commands, error = conn.drain_commands()
                for command in commands:
                    self._on_command(peer, command)
                if error is not None:
                    logger.warning(
                        "replication reader %s sent bad input: %s", conn.peer_name, error
                    )
                peer.wake.set()
        finally:
            unsubscribe()
            self.peers.discard(peer)
            conn.close()
            timer.cancel()
            flusher.cancel()
            for task in (timer, flusher):
                with contextlib.suppress(asyncio.CancelledError, OSError, ConnectionError):
                    await task
            peer.write_now_and_close()
            await close_stream_writer(writer, self._clock, CLOSE_GRACE_S)
            peer.cancel_abort()

    def _on_command(self, peer: _ServerPeer, command: c.Command) -> None:
        if isinstance(command, c.ReplicateCommand):
            peer.psync = command.psync is not None
        replies = self._rw.on_client_command(command, origin=peer)
        if replies:
            peer.on_broadcast(replies)
