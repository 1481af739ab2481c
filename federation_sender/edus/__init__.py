"""Ephemeral EDUs that the worker derives from replication streams, backend-neutral.

Theory of operation. Main publishes typing sets (``typing``) and receipts
(``receipts``) over replication; nothing about them is in a table the queue reads. The
worker turns each change into EDUs for the room's *current* hosts, exactly as Synapse's
federation sender does:

* :mod:`.typing_edus`: the per-room set of typers is diffed against the previous set;
  every local user who started or stopped typing gives one ``m.typing`` EDU per host,
  keyed by (room, user) so a newer state replaces an older one still queued. While a
  user keeps typing the EDU is re-sent every 40 s (remotes forget a typer after 30 s
  without one). When the stream goes backwards (main restarted: its typing stream is
  in memory and starts again from 0) every set is forgotten.
* :mod:`.receipts`: local users only; ``m.read.private`` never leaves the server. Rooms
  with fewer than 10 other hosts get the receipt at once; in bigger rooms only a
  receipt for a recent event (received under 60 s ago) or the one going to the event
  sender's server starts a transaction: the others ride on the next transaction to
  that host, or are woken by a paced queue that drains within 30 s.

Where the hosts and an event's metadata come from is the backend's business
(:class:`RoomHosts`, read through the storage Protocols by :mod:`.room_hosts`): the
native backend replays ``room_memberships``, the Synapse backend reads
``current_state_events`` and ``events``. Presence (:mod:`.presence`) has the one
``m.presence`` formatter, also used for the presence main queues on the federation
stream (:mod:`federation_sender.intake`).

Failure modes: these EDUs are volatile as in Synapse. A worker restart, or a queue that
falls back to catch-up, drops what was pending; a receipt row in a replication gap is
read back from the database by the stream's fetcher (when the backend provides one); a
typing change in a gap is gone (main keeps typing in memory only), and the next change
or the 40 s re-send repairs it.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol

from federation_sender.queue.core.items import JsonDict
from federation_sender.storage.protocols import EventMeta, RoomHosts

__all__ = ["EduSink", "EventMeta", "RoomHosts"]


class EduSink(Protocol):
    """The queue engine's entry points for ephemeral EDUs (:class:`QueueManager`)."""

    def enqueue_edu(
        self, destination: str, edu_type: str, content: JsonDict, key: Hashable | None = None
    ) -> None: ...

    def enqueue_receipt(
        self,
        destination: str,
        room_id: str,
        receipt_type: str,
        user_id: str,
        data: JsonDict,
        *,
        wake: bool = True,
    ) -> bool:
        """With ``wake=False``, False when no live queue took it."""

    def wake(self, destination: str) -> bool:
        """Start a transaction for what the destination's queue holds; False if it
        holds nothing (it was sent with another transaction meanwhile)."""
