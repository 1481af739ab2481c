"""The replication handler: each stream's rows become queue engine calls.

What each stream's rows do is its hook in the stream table
(:mod:`federation_sender.intake.streams`); this class holds what the hooks share: the
writers' frontiers, the latest token of each stream, the fan-outs it is given.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Collection, Sequence

from federation_sender.clock import Clock
from federation_sender.edus.fanouts import EduFanouts
from federation_sender.intake.streams import STREAMS, Batch
from federation_sender.queue.manager import QueueManager
from federation_sender.replication.frontier import WritersFrontier
from federation_sender.replication.positions import PositionStore
from federation_sender.replication.rows import Row
from federation_sender.storage.protocols import Backend, Tx
from federation_sender.telemetry.metrics import Metrics
from federation_sender.telemetry.tracing import Tracing

log = logging.getLogger(__name__)

PREFILL_LIMIT = 10_000
"""Committed stream orderings read at start for the events read position (at most)."""


class ReplicationIntake:
    """Implements :class:`federation_sender.replication.client.ReplicationHandler`: each
    stream's rows become queue engine calls (see the package docstring)."""

    def __init__(
        self,
        manager: QueueManager,
        storage: Backend,
        fanouts: EduFanouts,
        clock: Clock,
        metrics: Metrics | None = None,
        on_events_token: Callable[[int], None] | None = None,
        tracing: Tracing | None = None,
        event_writers: Collection[str] | None = None,
        stored_positions: PositionStore | None = None,
        device_list_writers: Collection[str] | None = None,
    ) -> None:
        self.manager = manager
        self.fanouts = fanouts
        """The EDU fan-outs (typing, receipts, presence), built by the caller."""
        self.clock = clock
        self._event_writers = None if event_writers is None else tuple(event_writers)
        self._stored_positions = stored_positions
        self.events: WritersFrontier = WritersFrontier(
            self._event_writers, manager.events_position)
        """How far the intake may read: below it every events writer has finished
        (``stream_writers.events``; None: whoever writes, one writer)."""
        self._device_list_writers = (
            None if device_list_writers is None else tuple(device_list_writers))
        self.device_lists: WritersFrontier = WritersFrontier(
            self._device_list_writers, 0, "device_lists")
        """How far device-list outbox reads may go (``stream_writers.device_lists``):
        a writer may commit a lower stream id after another published a higher one."""
        self._held_device_lists: list[tuple[int, str]] = []
        """(token, destination) of device-list rows above the frontier: the destination
        is told once the frontier reaches them (a heap)."""
        self._tracing = tracing or Tracing(None)
        self._on_events_token = on_events_token
        self._storage = storage
        self._metrics = metrics
        self.tokens: dict[str, int] = {}
        """The latest token of each stream whose rows were handled: everything of that
        stream at or below it is committed (Synapse bounds its outbox reads by these)."""

    async def prepare(self) -> None:
        """Before the first rows: the presence states so far (Synapse's worker loads them
        at start; loaded once rows arrive, the first change would already be in them).
        The events frontier starts at the intake's stored position, each configured
        writer at least at its stored replication position, and with several writers
        it runs through the stream orderings committed above that."""
        self.events = WritersFrontier(self._event_writers, self.manager.events_position)
        self.device_lists = WritersFrontier(self._device_list_writers, 0, "device_lists")
        if self._stored_positions is not None and (
                self._event_writers is not None or self._device_list_writers is not None):
            frontiers = {f.stream: f for f in (self.events, self.device_lists)}
            for (stream, writer), token in (await self._stored_positions.load()).items():
                if (frontier := frontiers.get(stream)) is not None:
                    frontier.seed(writer, token)
        if self._event_writers is not None and len(self._event_writers) > 1:
            after = self.events.frontier

            async def committed(tx: Tx) -> list[int]:
                return await tx.events.stream_orderings_after(after, PREFILL_LIMIT)

            self.events.committed(await self._storage.run(committed))
        if self.fanouts.presence is not None:
            await self.fanouts.presence.load()

    async def on_rows(
        self, stream_name: str, instance_name: str, token: int, rows: Sequence[Row]
    ) -> None:
        with self._tracing.replication_batch(stream_name, instance_name, token, len(rows)):
            await self._on_rows(stream_name, instance_name, token, rows)

    async def _on_rows(
        self, stream_name: str, instance_name: str, token: int, rows: Sequence[Row]
    ) -> None:
        stream = STREAMS.get(stream_name)
        reported = token
        frontier = None if stream is None else stream.frontier
        if frontier is not None:
            # Outbox reads are bounded by the token: with several writers, only by what
            # all of them finished (as the events intake, replication/frontier.py).
            token = frontier(self).advance(instance_name, token)
        # A frontier of 0 bounds nothing yet (some writer not heard of).
        first = not self.tokens.get(stream_name) and (token > 0 or frontier is None)
        self.tokens[stream_name] = token
        if first and stream is not None and stream.bounds_outboxes:
            # Outbox reads are bounded by this token (Synapse backend): queues that read
            # before it was known found nothing and must look again.
            self.manager.notify_all_outboxes()
        if self._metrics is not None:
            self._metrics.replication_batch(stream_name, len(rows))
            # Rows of the other streams are handled before this call returns; the events
            # stream is fanned out by the intake, which may still be behind the token.
            read_later = stream is not None and stream.read_later
            lag = max(0, token - self.manager.events_position) if read_later else 0
            self._metrics.replication_position(stream_name, instance_name, reported, lag)
        if stream is not None:
            await stream.handle(self, Batch(instance_name, token, reported, rows))

    def events_moved(self, instance_name: str, token: int) -> None:
        """The events writer finished up to ``token``: the queue's event fan-out reads
        up to the frontier. Not ``token``: with several writers, a lower stream ordering
        may still be in flight at another writer (see replication/frontier.py)."""
        upto = self.events.advance(instance_name, token)
        if self._on_events_token is not None:
            self._on_events_token(upto)
        self.manager.notify_new_events(upto)

    async def device_lists_changed(self, reported: int, frontier: int, users: list[str]) -> None:
        """Tell the destinations of changed users' device lists, once the frontier
        reaches the rows' token (a queue told earlier would read below it and find
        nothing, and no later row might tell it again)."""
        held = self._held_device_lists
        if users:
            for dest in await self._device_list_destinations(users):
                if reported <= frontier:
                    self.manager.notify_outbox(dest)
                else:
                    heapq.heappush(held, (reported, dest))
        while held and held[0][0] <= frontier:
            self.manager.notify_outbox(heapq.heappop(held)[1])

    async def _device_list_destinations(self, users: list[str]) -> list[str]:
        async def fn(tx: Tx) -> list[str]:
            return await tx.outbox.device_list_destinations(users)

        return await self._storage.run(fn)

    async def on_remote_server_up(self, server: str) -> None:
        await self.manager.remote_server_up(server)
