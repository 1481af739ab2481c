"""Reader-side stream positions: per stream, per writer; batches, gaps and resets.

:class:`StreamPositions` is a sans-I/O state machine fed with the RDATA,
POSITION and HISTORY commands of one stream-writer pair at a time. It answers
what to deliver and what to fetch; the client (``client.py``) does the I/O.

Rules, per ``(stream, instance)`` key:

* ``RDATA`` with token ``batch`` is buffered until the next numeric token of that
  key and delivered with it as one :class:`Update`. A ``POSITION`` (or a reset,
  or a new connection) discards a pending batch: its rows are either covered by
  the POSITION or will be fetched.
* ``RDATA`` whose token is at or below the current position is dropped (a
  duplicate: the same rows came from a fetch or the backlog already) -- except on
  the streams in :data:`OUT_OF_ORDER_STREAMS`, whose writer may complete tokens out
  of order (Synapse's ``caches``: every process writes it through one shared
  sequence). There a token below the position is delivered if it was never seen
  (the last :data:`SEEN_WINDOW` tokens are remembered), without moving the position.
* ``POSITION prev new``: with no position yet, adopt ``new``; if ``prev <= cur
  <= new`` just move to ``new``; if ``cur < prev`` rows were missed, so
  :class:`Fetch` ``(cur, new]`` from the database; if ``cur > new`` the writer's
  stream went backwards (a plain-protocol peer that restarted an in-memory
  stream or restored a database), so adopt ``new`` -- treating later rows as
  stale would lose them.
* ``HISTORY h start`` (PSYNC extension): if ``h`` differs from the history we
  know, the writer reset the stream; the position becomes ``min(cur, start)``
  and the usual gap rule fetches what is missing.

The in-memory position moves as soon as rows are accepted; the *persisted*
position moves only when the client has delivered them (see
:meth:`StreamPositions.mark_persisted`), so an error before the handler
finishes never moves what is read back at start. History ids live in memory
only: the persisted table holds tokens.

For a multi-writer stream, :meth:`linear` is the minimum over writers (all
facts at or below it are complete) and :meth:`writer_positions` the per-writer
view.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from federation_sender.errors import LocalPermanentError
from federation_sender.replication.rows import Row

Key = tuple[str, str]
"""``(stream_name, instance_name)``."""

FETCH_BATCH_ROWS = 100

OUT_OF_ORDER_STREAMS = frozenset({"caches"})
"""Streams whose tokens may arrive out of order from one writer (see the module doc)."""

SEEN_WINDOW = 4096
"""How many recent tokens of an out-of-order stream are remembered as seen."""


class PositionStore(Protocol):
    """Where finished positions persist (table ``stream_positions``)."""

    async def load(self) -> dict[tuple[str, str], int]:
        """Every persisted ``(stream, instance) -> token``."""

    async def save(self, stream: str, instance: str, token: int) -> None:
        """Persist that rows of ``stream`` from ``instance`` up to ``token`` are done."""


class StreamFetcher(Protocol):
    """Reads a stream's rows from the database to fill a gap."""

    async def fetch(
        self, instance: str, from_token: int, upto_token: int, limit: int
    ) -> tuple[list[tuple[int, Row]], int, bool]:
        """Rows with ``from_token < token <= upto_token``, in token order, about
        ``limit`` of them; returns ``(rows, upto, limited)`` where ``upto`` is how
        far the rows reach and ``limited`` says to call again from ``upto``."""


@dataclass(frozen=True, slots=True)
class Update:
    """Rows to deliver: every row of the key with a token in (previous, token]."""

    stream_name: str
    instance_name: str
    token: int
    rows: tuple[Row, ...]


@dataclass(frozen=True, slots=True)
class Advance:
    """Move to ``token``; nothing was missed."""

    token: int


@dataclass(frozen=True, slots=True)
class Fetch:
    """Rows in ``(from_token, upto_token]`` were missed: fetch, then move."""

    from_token: int
    upto_token: int


@dataclass(frozen=True, slots=True)
class Reset:
    """The writer's stream went backwards; the position is now ``token``."""

    token: int


PositionAction = Advance | Fetch | Reset


class StreamPositions:
    """Positions, pending batches and history ids for every consumed key."""

    def __init__(self, persisted: dict[Key, int] | None = None) -> None:
        self._persisted: dict[Key, int] = dict(persisted or {})
        self._positions: dict[Key, int] = dict(self._persisted)
        self._batches: dict[Key, list[Row]] = {}
        self._histories: dict[Key, str] = {}
        self._seen: dict[Key, _Seen] = {}

    # --- queries -------------------------------------------------------------------

    def get(self, stream: str, instance: str) -> int | None:
        return self._positions.get((stream, instance))

    def history(self, stream: str, instance: str) -> str | None:
        return self._histories.get((stream, instance))

    def writer_positions(self, stream: str) -> dict[str, int]:
        return {i: t for (s, i), t in self._positions.items() if s == stream}

    def linear(self, stream: str) -> int | None:
        """The minimum over known writers: every fact at or below it is complete."""
        tokens = [t for (s, _), t in self._positions.items() if s == stream]
        return min(tokens) if tokens else None

    def persisted(self) -> dict[Key, int]:
        return dict(self._persisted)

    def known(self) -> list[tuple[Key, int, str | None]]:
        """Every key with its token and history id, for a PSYNC offer."""
        return [(k, t, self._histories.get(k)) for k, t in sorted(self._positions.items())]

    # --- transitions ---------------------------------------------------------------

    def on_rdata(self, stream: str, instance: str, token: int | None, row: Row) -> Update | None:
        rows = self.accept_rdata((stream, instance), token, row)
        return None if rows is None else Update(stream, instance, token or 0, rows)

    def accept_rdata(self, key: Key, token: int | None, row: Row) -> tuple[Row, ...] | None:
        """:meth:`on_rdata` without building an :class:`Update` (the hot path)."""
        if token is None:
            self._batches.setdefault(key, []).append(row)
            return None
        batches = self._batches
        batch = batches.pop(key, None) if batches else None
        current = self._positions.get(key)
        rows = (row,) if batch is None else (*batch, row)
        if key[0] in OUT_OF_ORDER_STREAMS:
            seen = self._seen.setdefault(key, _Seen())
            if not seen.add(token):
                return None
            if current is None or token > current:
                self._positions[key] = token
            return rows
        if current is not None and token <= current:
            return None
        self._positions[key] = token
        return rows

    def on_position(self, stream: str, instance: str, prev: int, new: int) -> PositionAction | None:
        """What a POSITION means; ``None`` if the position does not change.

        A :class:`Fetch` does not move the position: call :meth:`advance` as
        fetched rows are delivered.
        """
        key = (stream, instance)
        self._batches.pop(key, None)
        current = self._positions.get(key)
        if current is None or prev <= current <= new:
            if current == new:
                return None
            self._positions[key] = new
            return Advance(new)
        if current < prev:
            return Fetch(current, new)
        self._positions[key] = new
        self._seen.pop(key, None)
        return Reset(new)

    def on_history(self, stream: str, instance: str, history_id: str, start_token: int) -> bool:
        """Record the writer's history id; ``True`` if it changed (a reset)."""
        key = (stream, instance)
        known = self._histories.get(key)
        self._histories[key] = history_id
        if known is None or known == history_id:
            return False
        self._batches.pop(key, None)
        self._seen.pop(key, None)
        current = self._positions.get(key)
        if current is not None and current > start_token:
            self._positions[key] = start_token
        return True

    def advance(self, stream: str, instance: str, token: int) -> None:
        """Move forward to ``token`` (after delivering fetched rows)."""
        key = (stream, instance)
        current = self._positions.get(key)
        if current is None or token > current:
            self._positions[key] = token

    def mark_persisted(self, stream: str, instance: str, token: int) -> None:
        """Record a save. Like the database (``save_position``), a save never moves the
        persisted token back, so after a writer reset this stays what the database holds;
        the next connection's POSITION brings the in-memory position down again."""
        key = (stream, instance)
        known = self._persisted.get(key)
        self._persisted[key] = token if known is None else max(known, token)

    def on_new_connection(self) -> None:
        """Drop partial batches: the new connection's POSITIONs cover them."""
        self._batches.clear()

    def rollback_to_persisted(self) -> None:
        """Forget unpersisted progress (the handler failed); refetch it later."""
        self._batches.clear()
        self._seen.clear()  # what the handler failed on must be delivered again
        self._positions = dict(self._persisted)


class _Seen:
    """The last :data:`SEEN_WINDOW` tokens of one key, for out-of-order streams."""

    __slots__ = ("_order", "_tokens")

    def __init__(self) -> None:
        self._tokens: set[int] = set()
        self._order: deque[int] = deque()

    def add(self, token: int) -> bool:
        """Remember ``token``; ``False`` if it was already seen."""
        if token in self._tokens:
            return False
        self._tokens.add(token)
        self._order.append(token)
        if len(self._order) > SEEN_WINDOW:
            self._tokens.discard(self._order.popleft())
        return True


async def fetch_gap(
    fetcher: StreamFetcher,
    stream: str,
    instance: str,
    from_token: int,
    upto_token: int,
    batch_rows: int = FETCH_BATCH_ROWS,
) -> AsyncIterator[Update]:
    """Fetch ``(from_token, upto_token]`` in batches, one :class:`Update` each.

    Repeats while the fetcher says ``limited``; a final empty update carries the
    position up to ``upto_token`` when the last batch stopped short of it.
    """
    position = from_token
    while position < upto_token:
        rows, reached, limited = await fetcher.fetch(instance, position, upto_token, batch_rows)
        reached = min(reached, upto_token)
        if reached <= position and limited:
            raise LocalPermanentError(f"fetcher for {stream} made no progress at {position}")
        got: Sequence[Row] = [row for _, row in rows]
        if not limited:
            reached = upto_token
        yield Update(stream, instance, reached, tuple(got))
        position = reached
        if not limited:
            return
