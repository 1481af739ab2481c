"""The replication ``federation`` stream: its EDUs go to the queues, its position is
persisted, then acknowledged.

``process_batch(token, edus)`` queues the EDUs, persists ``token`` under
``stream_positions(federation_sender.federation, <instance>)`` and only then calls the
acknowledgement callback (FEDERATION_ACK), so the main process never drops rows a
restarted worker still needs. ``position`` is the resume point after a restart.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass

from federation_sender.model import FEDERATION_STREAM
from federation_sender.queue.core.items import JsonDict
from federation_sender.queue.persistence import QueuePersistence


@dataclass(frozen=True, slots=True)
class FederationEdu:
    """One row of the replication ``federation`` stream, decoded."""

    destination: str
    edu_type: str
    content: JsonDict
    key: Hashable | None = None


class FederationStream:
    def __init__(
        self,
        store: QueuePersistence,
        instance_name: str,
        enqueue_edu: Callable[[str, str, JsonDict, Hashable | None], None],
        enqueue_presence: Callable[[str, Iterable[JsonDict]], None],
    ) -> None:
        self._store = store
        self._instance = instance_name
        self._enqueue_edu = enqueue_edu
        self._enqueue_presence = enqueue_presence
        self._ack: Callable[[int], Awaitable[None]] | None = None
        self.position: int | None = None

    async def load(self) -> None:
        self.position = await self._store.load_position(FEDERATION_STREAM, self._instance)

    def set_ack(self, ack: Callable[[int], Awaitable[None]] | None) -> None:
        """``ack(token)`` sends FEDERATION_ACK; called after each processed batch."""
        self._ack = ack

    async def process_batch(self, token: int, edus: Sequence[FederationEdu]) -> None:
        for e in edus:
            if e.edu_type == "m.presence" and e.key is None:
                push = e.content.get("push", [])
                self._enqueue_presence(e.destination, push if isinstance(push, list) else [])
            else:
                self._enqueue_edu(e.destination, e.edu_type, e.content, e.key)
        if self.position is None or token > self.position:
            await self._store.save_position(FEDERATION_STREAM, self._instance, token)
            self.position = token
        if self._ack is not None:
            await self._ack(token)
