"""The writer side: stream ids, RDATA/POSITION emission, backlog, history ids.

This is what a main process does for its readers, and what the simulator and
tests use. It is sans-I/O: methods return or broadcast :mod:`commands`
objects; ``tcp.py`` serves them to TCP readers and ``redis.py`` publishes them.

:class:`StreamIdGenerator` implements the reserve/complete rule of
``streams.md``: ids complete in any order, and the current position advances
only over a contiguous completed prefix.

:class:`WriterStream` turns completions into commands. When the position moves
from ``old`` to ``new`` it emits, in token order, one RDATA per row of every
completed token in ``(old, new]`` (rows sharing a token go out as ``batch``
except the last) and, if the last rows did not reach ``new``, a
``POSITION last new`` meaning "no rows in between". Rows also go into a bounded
backlog of recent tokens.

History (the PSYNC extension): every stream has a history id and the token at
which that history started. :meth:`WriterStream.reset` (an in-memory stream
after restart, a restored database) starts a new history. A reader offering
``(history, token)`` in ``REPLICATE`` is answered with ``HISTORY``; then, if
the backlog still holds everything after the reader's effective position (its
token for the same history, ``min(token, start)`` for another), those rows as
RDATA; then ``POSITION cur cur``. A reader the backlog cannot serve fetches the
gap from the database, exactly as with a plain peer. Plain readers get only
``POSITION cur cur``.

:class:`ReplicationWriter` holds the streams of one writer instance and fans
commands out to subscribers (connections, a Redis publisher).
"""

from __future__ import annotations

import logging
import secrets
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from federation_sender.replication import commands as c
from federation_sender.replication.commands import JsonValue

logger = logging.getLogger(__name__)

DEFAULT_BACKLOG_TOKENS = 10_000


def new_history_id() -> str:
    return secrets.token_hex(8)


class StreamIdGenerator:
    """Reserve ids, complete them in any order; ``current`` is the completed prefix."""

    def __init__(self, current: int = 0) -> None:
        self._current = current
        self._next = current + 1
        self._in_flight: set[int] = set()
        self._completed: set[int] = set()

    @property
    def current(self) -> int:
        return self._current

    @property
    def in_flight(self) -> frozenset[int]:
        return frozenset(self._in_flight)

    @property
    def last_reserved(self) -> int:
        """The highest id handed out so far (completed or not)."""
        return self._next - 1

    def reserve(self) -> int:
        token = self._next
        self._next += 1
        self._in_flight.add(token)
        return token

    def complete(self, token: int) -> tuple[int, int] | None:
        """Mark ``token`` done; ``(old, new)`` if the current position advanced."""
        if token not in self._in_flight:
            raise ValueError(f"stream id {token} was not reserved or is already complete")
        self._in_flight.remove(token)
        self._completed.add(token)
        old = self._current
        new = old
        while new + 1 in self._completed:
            new += 1
            self._completed.remove(new)
        if new == old:
            return None
        self._current = new
        return old, new


def rdata_for(stream: str, instance: str, token: int, rows: Sequence[JsonValue]) -> list[c.Command]:
    """RDATA for the rows of one token: all but the last are ``batch``."""
    last = len(rows) - 1
    return [
        c.RdataCommand(stream, instance, token if i == last else None, row)
        for i, row in enumerate(rows)
    ]


def to_json(row: object) -> JsonValue:
    """A typed row (anything with ``wire()``) or already-JSON data."""
    wire = getattr(row, "wire", None)
    return wire() if callable(wire) else row


class WriterStream:
    """One stream as written by one instance."""

    def __init__(
        self,
        name: str,
        instance_name: str,
        *,
        current: int = 0,
        history_id: str | None = None,
        backlog_tokens: int = DEFAULT_BACKLOG_TOKENS,
    ) -> None:
        self.name = name
        self.instance_name = instance_name
        self.ids = StreamIdGenerator(current)
        self.history_id = history_id or new_history_id()
        self.start_token = current
        self._done: dict[int, list[JsonValue]] = {}
        self._backlog: deque[tuple[int, tuple[JsonValue, ...]]] = deque()
        self._backlog_tokens = backlog_tokens
        self._backlog_floor = current
        """Every row with a token above the floor is in the backlog."""

    @property
    def current(self) -> int:
        return self.ids.current

    def reserve(self) -> int:
        return self.ids.reserve()

    def complete(self, token: int, rows: Iterable[object] = ()) -> list[c.Command]:
        self._done[token] = [to_json(r) for r in rows]
        advanced = self.ids.complete(token)
        if advanced is None:
            return []
        old, new = advanced
        out: list[c.Command] = []
        last_rows_token = old
        for tok in range(old + 1, new + 1):
            tok_rows = self._done.pop(tok)
            if tok_rows:
                out.extend(rdata_for(self.name, self.instance_name, tok, tok_rows))
                self._remember(tok, tuple(tok_rows))
                last_rows_token = tok
        if last_rows_token != new:
            out.append(c.PositionCommand(self.name, self.instance_name, last_rows_token, new))
        return out

    def _remember(self, token: int, rows: tuple[JsonValue, ...]) -> None:
        self._backlog.append((token, rows))
        while len(self._backlog) > self._backlog_tokens:
            self._backlog_floor = self._backlog.popleft()[0]

    def reset(self, current: int, history_id: str | None = None) -> list[c.Command]:
        """Start a new history at ``current`` (restart of an in-memory stream, restore).

        In-flight ids are abandoned. Returns what to tell connected readers.
        """
        self.ids = StreamIdGenerator(current)
        self.history_id = history_id or new_history_id()
        self.start_token = current
        self._done.clear()
        self._backlog.clear()
        self._backlog_floor = current
        return [
            self.history_command(),
            c.PositionCommand(self.name, self.instance_name, current, current),
        ]

    def history_command(self) -> c.HistoryCommand:
        return c.HistoryCommand(self.name, self.instance_name, self.history_id, self.start_token)

    def backlog_since(self, token: int) -> list[c.Command] | None:
        """RDATA for every row after ``token``, or ``None`` if the backlog lost some."""
        if not self._backlog_floor <= token <= self.current:
            return None
        out: list[c.Command] = []
        for tok, rows in self._backlog:
            if tok > token:
                out.extend(rdata_for(self.name, self.instance_name, tok, rows))
        return out

    def answer_replicate(self, offer: c.PsyncOffer | None) -> list[c.Command]:
        position = c.PositionCommand(self.name, self.instance_name, self.current, self.current)
        if offer is None:
            return [position]
        out: list[c.Command] = [self.history_command()]
        have = next(
            (
                h
                for h in offer.have
                if h.stream_name == self.name and h.instance_name == self.instance_name
            ),
            None,
        )
        if have is not None:
            effective = (
                have.token
                if have.history_id == self.history_id
                else min(have.token, self.start_token)
            )
            rows = self.backlog_since(effective)
            if rows:
                out.extend(rows)
        out.append(position)
        return out


Subscriber = Callable[[Sequence[c.Command]], None]
"""Receives broadcast commands; must not block (queue and return)."""


class ReplicationWriter:
    """All streams of one writer instance, and who to tell about them."""

    def __init__(
        self,
        server_name: str,
        instance_name: str = "master",
        *,
        backlog_tokens: int = DEFAULT_BACKLOG_TOKENS,
    ) -> None:
        self.server_name = server_name
        self.instance_name = instance_name
        self._backlog_tokens = backlog_tokens
        self.streams: dict[str, WriterStream] = {}
        self._subscribers: dict[object, Subscriber] = {}
        self.federation_acks: dict[str, int] = {}
        self.remote_servers_up: list[str] = []

    def add_stream(
        self, name: str, *, current: int = 0, history_id: str | None = None
    ) -> WriterStream:
        """Declare a stream; a persistent one passes its stored ``history_id``."""
        stream = WriterStream(
            name,
            self.instance_name,
            current=current,
            history_id=history_id,
            backlog_tokens=self._backlog_tokens,
        )
        self.streams[name] = stream
        return stream

    def subscribe(self, key: object, subscriber: Subscriber) -> Callable[[], None]:
        """Receive every broadcast under ``key``; returns the unsubscribe function."""
        self._subscribers[key] = subscriber
        return lambda: self._subscribers.pop(key, None) and None

    def broadcast(self, commands: Sequence[c.Command], *, exclude: object = None) -> None:
        if commands:
            for key, subscriber in list(self._subscribers.items()):
                if key is not exclude:
                    subscriber(commands)

    def reserve(self, stream: str) -> int:
        return self.streams[stream].reserve()

    def complete(self, stream: str, token: int, rows: Iterable[object] = ()) -> None:
        self.broadcast(self.streams[stream].complete(token, rows))

    def publish(self, stream: str, *rows: object) -> int:
        """Reserve one token, attach ``rows`` (typed rows or JSON) to it, complete it."""
        token = self.reserve(stream)
        self.complete(stream, token, rows)
        return token

    def reset_stream(self, stream: str, current: int = 0, history_id: str | None = None) -> None:
        self.broadcast(self.streams[stream].reset(current, history_id))

    def answer_replicate(self, command: c.ReplicateCommand) -> list[c.Command]:
        out: list[c.Command] = []
        for stream in self.streams.values():
            out.extend(stream.answer_replicate(command.psync))
        return out

    def on_client_command(self, command: c.Command, origin: object = None) -> list[c.Command]:
        """Handle a reader's command; returns the reply for that reader only.

        ``origin`` is the subscriber key of the reader's connection, so that a
        relayed ``REMOTE_SERVER_UP`` does not go back to where it came from.
        """
        if isinstance(command, c.ReplicateCommand):
            return self.answer_replicate(command)
        if isinstance(command, c.FederationAckCommand):
            self.federation_acks[command.instance_name] = command.token
        elif isinstance(command, c.RemoteServerUpCommand):
            self.remote_servers_up.append(command.server)
            self.broadcast([command], exclude=origin)
        elif isinstance(command, c.ErrorCommand):
            logger.warning("replication reader reported error: %s", command.message)
        return []
