"""A sans-I/O replication connection: bytes in, commands out; commands in, bytes out.

Like h11, the object never touches a socket. The I/O shell (``tcp.py``,
``redis.py``) feeds received bytes with :meth:`ReplicationConnection.receive_data`,
pulls commands with :meth:`next_command` until it returns ``None``, queues
commands with :meth:`send`, writes whatever :meth:`data_to_send` returns, and
calls :meth:`on_timer` at :meth:`next_deadline`.

Policy enforced here, identically on every transport:

* **Framing.** Lines end in ``\\n`` (a trailing ``\\r`` is tolerated), are UTF-8,
  at most :data:`MAX_LINE_BYTES` long; blank lines are ignored.
* **Direction.** A ``CLIENT`` (reader) accepts only what a writer may send and
  vice versa; a ``BUS`` (Redis pub/sub, where every process hears every
  command) accepts every known command. Commands Synapse defines but we do not
  use are returned as :class:`IgnoredCommand` in any role. Unknown commands are
  an error on TCP and skipped on the bus, where other Synapse versions may
  publish commands we have never heard of.
* **Identity.** A ``CLIENT`` given ``expected_server_name`` rejects a ``SERVER``
  naming anybody else.
* **Keepalive** (on the injected clock). A ``PING`` is queued when nothing was
  sent for ``ping_interval_s``; once the peer has pinged, ``ping_timeout_s``
  without any command from it closes the connection with ``ERROR ping timeout``.
* **Congestion.** More than ``max_outbound`` commands waiting to be written
  means the peer cannot keep up: the queue is dropped, ``ERROR Failed to keep
  up`` is queued and the connection closes.

Any violation raises :class:`ProtocolError` (once) from :meth:`next_command`,
queues ``ERROR <reason>`` for the peer and marks the connection closed; the
shell then flushes :meth:`data_to_send` and closes the transport. A message
handed to :meth:`receive_line` (the Redis bus, which frames messages itself) is
the exception: a bad one raises ``ProtocolError`` and leaves the connection
open, since on a bus it is one publisher's message and says nothing about the
next (:data:`MAX_BUS_MESSAGE_BYTES` is the bus's limit).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

from federation_sender.clock import Clock
from federation_sender.errors import ProtocolError
from federation_sender.replication import commands as c

MAX_LINE_BYTES = c.MAX_LINE_BYTES

MAX_BUS_MESSAGE_BYTES = 1024 * 1024
"""The longest message accepted on the Redis bus. Synapse caps lines at 16 KiB on TCP
only; on Redis it publishes whatever a row serialises to, and a presence row carries the
user's ``status_msg``, which only the client API's request size bounds (12.5 MiB, or
``max_upload_size``, 50 MB, where the process serves media). Measured on 1.163: a status
of n ASCII characters makes a line of n + 100 bytes (a non-ASCII one is escaped to 6
bytes); main accepted and published a 13 MB one. 1 MiB is 64 times the TCP limit, a
status of a million ASCII characters (the real-Synapse test's 100 kB one is a tenth of
it), a quarter of our 4 MB transaction limit, so that the EDU still fits one, and it
bounds what one message makes us parse and hold. A longer message is skipped with a
warning like any bad one: that presence update is not sent, a later one under the limit is."""


class Role(enum.Enum):
    CLIENT = "client"
    """We are a reader connected to a writer over TCP."""
    SERVER = "server"
    """We are a writer serving one reader over TCP."""
    BUS = "bus"
    """We are one of many processes on a Redis channel."""


_BOTH: frozenset[type] = frozenset({c.PingCommand, c.ErrorCommand, c.RemoteServerUpCommand})
SENT_BY_SERVER: frozenset[type] = _BOTH | {
    c.ServerCommand,
    c.RdataCommand,
    c.PositionCommand,
    c.HistoryCommand,
}
SENT_BY_CLIENT: frozenset[type] = _BOTH | {
    c.NameCommand,
    c.ReplicateCommand,
    c.UserSyncCommand,
    c.ClearUserSyncCommand,
    c.FederationAckCommand,
    c.UserIpCommand,
}
_KNOWN = SENT_BY_SERVER | SENT_BY_CLIENT

_INBOUND: dict[Role, frozenset[type]] = {
    Role.CLIENT: SENT_BY_SERVER,
    Role.SERVER: SENT_BY_CLIENT,
    Role.BUS: _KNOWN,
}
_OUTBOUND: dict[Role, frozenset[type]] = {
    Role.CLIENT: SENT_BY_CLIENT,
    Role.SERVER: SENT_BY_SERVER,
    Role.BUS: _KNOWN,
}

PING_TIMEOUT_REASON = "ping timeout"
CONGESTION_REASON = "Failed to keep up"


@dataclass(frozen=True, slots=True)
class Limits:
    max_line_bytes: int = MAX_LINE_BYTES
    ping_interval_s: float = 5.0
    ping_timeout_s: float = 25.0
    max_outbound: int = 10_000


DEFAULT_LIMITS = Limits()
BUS_LIMITS = Limits(max_line_bytes=MAX_BUS_MESSAGE_BYTES)


class ReplicationConnection:
    """One end of one replication connection, as a state machine."""

    def __init__(
        self,
        role: Role,
        clock: Clock,
        *,
        expected_server_name: str | None = None,
        keepalive: bool = True,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        self.role = role
        self._clock = clock
        self._expected_server = expected_server_name
        self._keepalive = keepalive
        self._limits = limits
        self._inbound = _INBOUND[role]
        self._outbound_ok = _OUTBOUND[role]
        self._buf = bytearray()
        self._start = 0
        self._scan_from = 0
        self._out: deque[bytes] = deque()
        now = clock.monotonic_s()
        self._last_sent_s = now
        self._last_received_s = now
        self._data_time_s = now
        self._peer_pinged = False
        self.closed = False
        self.close_reason: str | None = None
        self.peer_server_name: str | None = None
        self.peer_name: str | None = None

    # --- inbound -------------------------------------------------------------------

    def receive_data(self, data: bytes) -> None:
        """Buffer bytes from the peer; parse nothing yet."""
        if not self.closed:
            self._buf += data
            # Commands framed from these bytes count as received now: one clock
            # read per chunk instead of one per command.
            self._data_time_s = self._clock.monotonic_s()

    def receive_line(self, line: bytes) -> c.Command | None:
        """Handle one already-framed message (the Redis bus delivers messages, not
        bytes). A bad one raises ``ProtocolError`` and, unlike a bad line in a byte
        stream, leaves the connection open: the next message does not depend on it."""
        if self.closed:
            return None
        self._data_time_s = self._clock.monotonic_s()
        return self._handle_line(line)

    def next_command(self) -> c.Command | None:
        """The next complete command, or ``None`` when more data is needed or closed."""
        buf = self._buf
        while not self.closed:
            start = self._start
            nl = buf.find(b"\n", self._scan_from)
            if nl < 0:
                # Compact once per received chunk rather than once per line.
                del buf[:start]
                self._start = 0
                self._scan_from = len(buf)
                if len(buf) > self._limits.max_line_bytes + 1:  # +1: a trailing \r
                    reason = f"line too long (more than {self._limits.max_line_bytes} bytes)"
                    self._fail(reason)
                    raise ProtocolError(reason)
                return None
            line = buf[start:nl]
            self._start = self._scan_from = nl + 1
            try:
                command = self._handle_line(line)
            except ProtocolError as e:
                self._fail(str(e))
                raise
            if command is not None:
                return command
        return None

    def drain_commands(self) -> tuple[list[c.Command], ProtocolError | None]:
        """Every complete command buffered so far, and the error that stopped it.

        Equivalent to calling :meth:`next_command` until ``None``, but one call
        per received chunk: RDATA, nearly all of the traffic, takes a short path.
        Commands before an error are returned with it, in order.
        """
        out: list[c.Command] = []
        if self.closed:
            return out, None
        buf = self._buf
        start = self._start
        scan = self._scan_from
        max_line = self._limits.max_line_bytes
        rdata_ok = c.RdataCommand in self._inbound
        parse_rdata = c.parse_rdata_args
        append = out.append
        try:
            while True:
                nl = buf.find(b"\n", scan)
                if nl < 0:
                    break
                if (
                    rdata_ok
                    and buf.startswith(b"RDATA ", start)
                    and nl - start <= max_line
                    and buf[nl - 1] != 13  # a trailing \r takes the general path
                ):
                    try:
                        text = buf[start + 6 : nl].decode("utf-8")
                    except UnicodeDecodeError:
                        raise ProtocolError("line is not valid UTF-8") from None
                    start = scan = nl + 1
                    append(parse_rdata(text))
                    continue
                line = buf[start:nl]
                start = scan = nl + 1
                command = self._handle_line(line)
                if command is not None:
                    append(command)
        except ProtocolError as e:
            self._start = self._scan_from = start
            self._fail(str(e))
            return out, e
        if out:
            self._last_received_s = self._data_time_s
        del buf[:start]
        self._start = 0
        self._scan_from = len(buf)
        if len(buf) > max_line + 1:
            reason = f"line too long (more than {max_line} bytes)"
            self._fail(reason)
            return out, ProtocolError(reason)
        return out, None

    def _handle_line(self, line: bytes | bytearray) -> c.Command | None:
        if line.endswith(b"\r"):
            line = line[:-1]
        if len(line) > self._limits.max_line_bytes:
            raise ProtocolError(f"line too long ({len(line)} bytes)")
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError("line is not valid UTF-8") from None
        if not text or text.isspace():
            return None
        command = c.parse_line(text)
        kind = type(command)
        if kind is c.RdataCommand and kind in self._inbound:
            self._last_received_s = self._data_time_s
            return command
        if kind is c.UnknownCommand:
            if self.role is Role.BUS:
                return None
            raise ProtocolError(f"unknown command {c.command_name(command)}")
        if kind is not c.IgnoredCommand and kind not in self._inbound:
            raise ProtocolError(f"{command.NAME} not allowed from this peer")
        self._last_received_s = self._data_time_s
        if kind is c.PingCommand:
            self._peer_pinged = True
        elif isinstance(command, c.ServerCommand):
            self._check_server(command.server_name)
        elif isinstance(command, c.NameCommand):
            self.peer_name = command.name
        return command

    def _check_server(self, name: str) -> None:
        if self._expected_server is not None and name != self._expected_server:
            raise ProtocolError(f"connected to server {name!r}, expected {self._expected_server!r}")
        if self.peer_server_name is not None and name != self.peer_server_name:
            raise ProtocolError("server name changed on a live connection")
        self.peer_server_name = name

    # --- outbound ------------------------------------------------------------------

    def send(self, command: c.Command) -> None:
        """Queue ``command``. Sending on a closed connection is a silent no-op."""
        if self.closed:
            return
        if type(command) not in self._outbound_ok:
            raise ValueError(f"a {self.role.value} may not send {c.command_name(command)}")
        self._out.append(c.encode(command))
        self._last_sent_s = self._clock.monotonic_s()
        if len(self._out) > self._limits.max_outbound:
            self._out.clear()
            self._fail(CONGESTION_REASON)

    @property
    def outbound_count(self) -> int:
        """Commands queued and not yet taken by :meth:`data_to_send`."""
        return len(self._out)

    def data_to_send(self) -> bytes:
        """Everything queued so far, as bytes; empties the queue."""
        if not self._out:
            return b""
        data = b"".join(self._out)
        self._out.clear()
        return data

    def lines_to_send(self) -> list[bytes]:
        """Like :meth:`data_to_send` but one line per item (for message transports)."""
        lines = list(self._out)
        self._out.clear()
        return lines

    def close(self, reason: str | None = None) -> None:
        """Close from our side, telling the peer why if a reason is given."""
        if self.closed:
            return
        if reason is None:
            self.closed = True
            self.close_reason = "closed"
        else:
            self._fail(reason)

    def _fail(self, reason: str) -> None:
        if self.closed:
            return
        self._out.append(c.encode(c.ErrorCommand(reason[:1000])))
        self.closed = True
        self.close_reason = reason

    # --- timers --------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """Monotonic time at which :meth:`on_timer` has something to do."""
        if self.closed or not self._keepalive:
            return None
        deadline = self._last_sent_s + self._limits.ping_interval_s
        if self._peer_pinged:
            deadline = min(deadline, self._last_received_s + self._limits.ping_timeout_s)
        return deadline

    def on_timer(self) -> None:
        """Send a keepalive or time the peer out, as the clock says."""
        if self.closed or not self._keepalive:
            return
        now = self._clock.monotonic_s()
        if self._peer_pinged and now - self._last_received_s >= self._limits.ping_timeout_s:
            self._fail(PING_TIMEOUT_REASON)
            return
        if now - self._last_sent_s >= self._limits.ping_interval_s:
            self.send(c.PingCommand(str(int(self._clock.time_s() * 1000))))
