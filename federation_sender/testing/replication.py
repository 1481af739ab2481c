"""Fakes for the replication subsystem, shipped as real code.

* :class:`InMemoryPositionStore` implements ``positions.PositionStore``.
* :class:`WriterDatabase` plays the database behind a :class:`ReplicationWriter`:
  it records every row the writer completes, and :meth:`WriterDatabase.fetcher`
  gives a ``StreamFetcher`` over those rows, so a reader can fill gaps.
* :class:`MemoryTransport` / :class:`MemorySession` replay recorded bytes into
  the client through the real connection, without sockets.
* :class:`RecordingHandler` implements ``client.ReplicationHandler`` and keeps
  what it was given; it can be told to fail, to test rollback.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from federation_sender.clock import Clock
from federation_sender.intake.streams import parse_row
from federation_sender.replication import commands as c
from federation_sender.replication.connection import ReplicationConnection, Role
from federation_sender.replication.rows import Row
from federation_sender.replication.server import ReplicationWriter
from federation_sender.replication.transport import ConnectionLost
from federation_sender.testing.waiting import wait_until


class InMemoryPositionStore:
    def __init__(self, initial: dict[tuple[str, str], int] | None = None) -> None:
        self.positions: dict[tuple[str, str], int] = dict(initial or {})
        self.saves = 0

    async def load(self) -> dict[tuple[str, str], int]:
        return dict(self.positions)

    async def save(self, stream: str, instance: str, token: int) -> None:
        """As the database does: a lower token than the stored one is ignored."""
        self.saves += 1
        key = (stream, instance)
        self.positions[key] = max(token, self.positions.get(key, token))


class _Fetcher:
    def __init__(self, db: WriterDatabase, stream: str) -> None:
        self._db = db
        self._stream = stream
        self.calls: list[tuple[str, int, int, int]] = []

    async def fetch(
        self, instance: str, from_token: int, upto_token: int, limit: int
    ) -> tuple[list[tuple[int, Row]], int, bool]:
        self.calls.append((instance, from_token, upto_token, limit))
        rows = [
            (token, row)
            for token, row in self._db.rows.get((self._stream, instance), [])
            if from_token < token <= upto_token
        ]
        if len(rows) <= limit:
            return rows, upto_token, False
        # Never split a token across batches: cut after the last complete token.
        cut = rows[limit - 1][0]
        rows = [r for r in rows if r[0] <= cut]
        return rows, cut, True


class WriterDatabase:
    """Every row a writer has completed, as a database would hold them."""

    def __init__(self, writer: ReplicationWriter | None = None) -> None:
        self.rows: dict[tuple[str, str], list[tuple[int, Row]]] = {}
        self._batch: list[c.RdataCommand] = []
        self.fetchers: dict[str, _Fetcher] = {}
        if writer is not None:
            writer.subscribe(self, self.record)

    def record(self, commands: Sequence[c.Command]) -> None:
        for command in commands:
            if isinstance(command, c.RdataCommand):
                row = parse_row(command.stream_name, command.row)
                key = (command.stream_name, command.instance_name)
                if command.token is None:
                    self._batch.append(command)
                    continue
                for pending in self._batch:
                    self.rows.setdefault(key, []).append(
                        (command.token, parse_row(pending.stream_name, pending.row))
                    )
                self._batch.clear()
                self.rows.setdefault(key, []).append((command.token, row))

    def fetcher(self, stream: str) -> _Fetcher:
        return self.fetchers.setdefault(stream, _Fetcher(self, stream))


class RecordingHandler:
    def __init__(self) -> None:
        self.updates: list[tuple[str, str, int, tuple[Row, ...]]] = []
        self.servers_up: list[str] = []
        self.fail_next = 0
        self.changed = asyncio.Event()

    async def on_rows(
        self, stream_name: str, instance_name: str, token: int, rows: Sequence[Row]
    ) -> None:
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("handler told to fail")
        self.updates.append((stream_name, instance_name, token, tuple(rows)))
        self.changed.set()

    async def on_remote_server_up(self, server: str) -> None:
        self.servers_up.append(server)
        self.changed.set()

    def rows(self, stream: str) -> list[Row]:
        return [row for s, _, _, rows in self.updates if s == stream for row in rows]

    def last_token(self, stream: str, instance: str = "master") -> int | None:
        tokens = [t for s, i, t, _ in self.updates if s == stream and i == instance]
        return tokens[-1] if tokens else None

    async def wait_for(
        self, probe: Callable[[], object], timeout_s: float = 5.0, what: str = ""
    ) -> None:
        """Wait (real time, for network tests) until ``probe()`` is truthy: re-checked on
        each delivery, and every 10 ms for state that moves without one (histories,
        positions moved without rows)."""
        await wait_until(probe, what, timeout_s=timeout_s, wake=self.changed)


class MemorySession:
    """A reader session fed from bytes in memory, through the real connection.

    For benchmarks and tests of the client without sockets: ``chunks`` are what a
    writer would have sent; they are framed and parsed exactly as over TCP.
    """

    supports_psync = True
    skips_bad_input = False

    def __init__(self, chunks: Sequence[bytes], clock: Clock, *, hold_open: bool = False) -> None:
        self._chunks = list(chunks)
        self._conn = ReplicationConnection(Role.CLIENT, clock, keepalive=False)
        self.sent: list[c.Command] = []
        self._hold_open = hold_open
        """At the end of the chunks, wait for :meth:`feed` (or :meth:`end`) instead of
        ending the session."""
        self._more = asyncio.Event()

    def feed(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._more.set()

    def end(self) -> None:
        self._hold_open = False
        self._more.set()

    def send(self, command: c.Command) -> None:
        self.sent.append(command)

    async def receive(self) -> list[c.Command]:
        while True:
            while self._chunks:
                self._conn.receive_data(self._chunks.pop(0))
                out, error = self._conn.drain_commands()
                if error is not None:
                    raise error
                if out:
                    return out
            if not self._hold_open:
                raise ConnectionLost("end of recorded input")
            self._more.clear()
            await self._more.wait()

    def abort(self, reason: str) -> None:
        self._conn.close(reason)

    async def close(self) -> None:
        self._conn.close()


class MemoryTransport:
    """Opens each of ``sessions`` once, then waits forever (no more peers)."""

    description = "memory"

    def __init__(self, sessions: Sequence[MemorySession]) -> None:
        self._sessions = list(sessions)

    async def open(self) -> MemorySession:
        if self._sessions:
            return self._sessions.pop(0)
        await asyncio.Event().wait()
        raise ConnectionLost("unreachable")
