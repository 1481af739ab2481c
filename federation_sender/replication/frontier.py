"""The events stream's safe read position when several processes write it.

With ``stream_writers: {events: [persister1, persister2]}`` each persister takes stream
orderings from one shared sequence and commits on its own: persister2 may commit 206
after persister1 has committed and published 209-213. Reading events up to the
highest token any writer reported (213) then skips 206 for good, since the next read
starts above 213. :class:`WritersFrontier` is the position below which every writer
has finished, which is what Synapse's own sender reads up to (its
``MultiWriterIdGenerator.get_persisted_upto_position``, behind
``get_room_max_token``). Sans-I/O: fed with per-writer tokens, it answers a number.

Rules, as Synapse applies them on a process that reads the stream:

* Each writer has a position: everything it wrote at or below it is committed. It
  moves with the writer's rows (RDATA) and with its POSITION commands. A writer that
  has nothing in flight advances its own position to the highest token it has seen
  from the others and announces it with a POSITION about once a second
  (``ReplicationStreamer``'s looping call), so an idle writer holds the frontier back
  for about a second, never for good.
* The frontier is at least the minimum over the writers' positions.
* It also moves through a gapless run of reported tokens: if 206, 207 and 208 were
  each reported (by any writer) and the frontier is 205, it moves to 208, since every
  stream ordering up to 208 is then committed (``_known_persisted_positions``).
* A configured writer that has not reported yet counts at the position given at
  start (what the caller knows to be safe: our stored intake position, our stored
  replication positions). The stream orderings of the events committed above it are
  known at start too (Synapse reads them from the events table): gapless runs through
  them move the frontier even while a configured writer is down.
* A writer that is not configured but reports is counted from then on, with a
  warning: missing it could skip its events.
* Nothing goes backwards. A token below a writer's position (a replay after a failed
  session, or the writer's stream reset: a database restored behind our back, which
  the replication client logs as a warning) moves nothing back; the frontier itself
  never decreases.

``writers=None`` is the single-writer shape (our simulator, a Synapse without event
persisters where main writes): whichever writer reports is counted, and with one
writer the frontier is simply its latest token.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Collection, Iterable, Mapping

log = logging.getLogger(__name__)

MAX_PENDING = 100_000
"""Reported tokens kept above the frontier for the gapless-run rule; beyond it the
oldest are dropped, which can only delay the frontier until the minimum moves."""


class WritersFrontier:
    """See the module docstring."""

    __slots__ = ("_configured", "_pending", "_positions", "_stream", "_unexpected", "frontier")

    def __init__(
        self, writers: Collection[str] | None, start: int, stream: str = "events"
    ) -> None:
        self._stream = stream
        self._configured = None if writers is None else frozenset(writers)
        self._positions: dict[str, int] = (
            {} if writers is None else dict.fromkeys(writers, start)
        )
        self._pending: list[int] = []
        """Reported tokens above the frontier (a heap), for gapless runs."""
        self._unexpected: set[str] = set()
        self.frontier = start
        """Every stream ordering at or below it is committed by its writer."""

    @property
    def stream(self) -> str:
        """The stream whose writers it follows (``events``, ``device_lists``)."""
        return self._stream

    @property
    def positions(self) -> Mapping[str, int]:
        return self._positions

    def seed(self, writer: str, token: int) -> None:
        """A lower bound known at start (a stored position): the writer is at least
        there. Only configured writers are seeded: without a configured list, a stored
        name may be a writer that no longer exists, which would hold the frontier for
        good; writers are then counted when they report."""
        if self._configured is None or writer not in self._configured:
            return
        if token > self._positions.get(writer, self.frontier):
            self._positions[writer] = token
        self._recompute()

    def committed(self, tokens: Iterable[int]) -> int:
        """Stream orderings known to be committed (rows read from the events table at
        start, as Synapse's generator prefills its known positions): they extend gapless
        runs, so a configured writer that is down does not hold back what the others
        wrote before our restart. Returns the frontier."""
        for token in tokens:
            if token > self.frontier:
                heapq.heappush(self._pending, token)
        self._recompute()
        return self.frontier

    def advance(self, writer: str, token: int) -> int:
        """The writer finished everything up to ``token``; returns the frontier."""
        positions = self._positions
        current = positions.get(writer)
        if current is None:
            self._new_writer(writer, token)
        else:
            # A lower token than before is a replay (the replication client delivers
            # again what it had not saved when a session failed) or a writer's reset
            # (the client logs that one as a warning): either way nothing moves back.
            if token > current:
                positions[writer] = token
        if len(positions) == 1:  # the single-writer hot path
            if token > self.frontier:
                self.frontier = token
            return self.frontier
        if token > self.frontier:
            heapq.heappush(self._pending, token)
            if len(self._pending) > MAX_PENDING:
                self._pending = heapq.nsmallest(MAX_PENDING // 2, self._pending)
        self._recompute()
        return self.frontier

    def _new_writer(self, writer: str, token: int) -> None:
        if self._configured is not None and writer not in self._unexpected:
            self._unexpected.add(writer)
            log.warning(
                "%s writer %r is not in stream_writers.%s of the Synapse "
                "configuration we read (%s); counting it", self._stream, writer,
                self._stream, ", ".join(sorted(self._configured)),
            )  # fmt: skip
        if self._positions and token < self.frontier:
            # A writer we never heard of, behind what we already read past: whatever it
            # committed between the two was read or will never be; say so.
            log.warning(
                "%s writer %r first reported %d, below the position %d already read",
                self._stream, writer, token, self.frontier,
            )  # fmt: skip
        self._positions[writer] = token

    def _recompute(self) -> None:
        floor = min(self._positions.values(), default=self.frontier)
        frontier = max(self.frontier, floor)
        pending = self._pending
        while pending:
            top = pending[0]
            if top <= frontier:
                heapq.heappop(pending)
            elif top == frontier + 1:
                heapq.heappop(pending)
                frontier = top
            else:
                break
        self.frontier = frontier
