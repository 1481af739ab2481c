"""What a backend offers beyond one transaction's Protocols.

The backend is chosen once, in the composition root (``app/assembly.py``), which asks
the backend it opened for its :class:`Capabilities`; nothing downstream asks which
backend it has.
What only one backend can do is offered here and is absent (None, empty, a no-op)
elsewhere:

* ``fetchers`` and ``gap_notes``: the replication gap fetchers of the streams the
  backend's schema has tables for, and what a gap in a stream skips on this backend
  where that differs from the stream's own note
  (:mod:`federation_sender.intake.streams`; :mod:`.stream_fetchers`);
* ``signals``: what the backend says on replication about the streams it writes
  (beside Synapse: cache invalidations, ``REMOTE_SERVER_UP``, ``POSITION caches``);
* ``edu_rooms``: rooms, hosts, event metadata and presence states for the ephemeral
  EDU fan-outs (beside Synapse, from its tables);
* ``bind_stream_tokens``: the latest replication token of each stream, by which the
  backend bounds its outbox reads (beside Synapse, as its stream tokens do).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from federation_sender.replication.client import GapNote
from federation_sender.replication.commands import Command
from federation_sender.replication.positions import StreamFetcher
from federation_sender.storage.protocols import PresenceSource, RoomHosts


class ReplicationSignals(Protocol):
    def attach(self, send: Callable[[Command], bool]) -> None:
        """Publish through ``send`` from now on (False: not sent, disconnected)."""
        ...

    def announce(self) -> Sequence[Command]:
        """What to say after connecting and in answer to every ``REPLICATE``."""
        ...


class EduRooms(RoomHosts, PresenceSource, Protocol):
    """The backend's rooms, hosts, event metadata and presence states."""


def _ignore_tokens(_tokens: Mapping[str, int]) -> None:
    return None


@dataclass(frozen=True, slots=True)
class Capabilities:
    fetchers: Mapping[str, StreamFetcher]
    gap_notes: Mapping[str, GapNote | None]
    signals: ReplicationSignals | None = None
    edu_rooms: EduRooms | None = None
    bind_stream_tokens: Callable[[Mapping[str, int]], None] = _ignore_tokens
