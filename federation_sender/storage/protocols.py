"""The storage boundary: everything the queue engine, the admin API and the adapters read
or write, as typed Protocols over the neutral rows of :mod:`federation_sender.model`.

A :class:`Backend` owns connections and transactions. :meth:`Backend.run` calls a
function with a :class:`Tx`, one database transaction's view of the storage, which
hands out one object per aggregate (``tx.events``, ``tx.destinations``, ...). Whatever a
function does through one ``Tx`` commits or rolls back together; this is how the
intake keeps invariant 1 (``destination_rooms`` and its position in one transaction)
on any backend.

Two implementations stand behind the same Protocols:

* ``native`` (:mod:`federation_sender.storage.backend`): the project's own schema
  (``storage/schema.py``), on PostgreSQL or SQLite.
* ``synapse`` (:mod:`federation_sender.storage.synapse.backend`): Synapse's own tables
  (``events`` + ``event_json``, ``destinations``, ``destination_rooms``,
  ``federation_stream_position``, ``device_federation_outbox``,
  ``device_lists_outbound_pokes``, state groups), with the project-only tables in a
  schema of their own. Where the two differ, the Protocol states the meaning and each
  backend keeps it its own way; the rules that differ are behind a method here, not in
  the callers (which servers receive an event; what "acknowledging" an outbox row does;
  where positions live).

Rules every backend keeps (``tests/storage/test_backend_contract.py`` checks them):

* positions never move backwards (a lower save is ignored);
* ``destination_rooms``: per (destination, room) the highest stream ordering wins;
  ``last_successful_stream_ordering`` only moves forwards; a retry interval is reset by
  0, and a stale writer (an older ``retry_last_ts``) never shortens it;
* reads "past" a stream id or a keyset cursor are strict (``>``), oldest first;
* :meth:`Backend.run` retries the whole function on transient database errors, so the
  function must have no effect outside the transaction.

The last Protocols (:class:`RoomHosts`, :class:`PresenceSource`, with
:class:`EventMeta`) are what the EDU fan-outs read of the backend outside a ``Tx``: each
read is a transaction of its own, offered by the backend's ``edu_rooms`` capability
(:mod:`.capabilities`) and re-exported by :mod:`federation_sender.edus`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol, TypeVar

from federation_sender.model import (
    DestinationOrder,
    DestinationRow,
    DeviceListRow,
    Direction,
    EventRow,
    MembershipRow,
    ToDeviceRow,
    TxnLogRow,
)
from federation_sender.replication.rows import PresenceState
from federation_sender.storage.batch_apply import BatchCounts, StagedChange

# What the callers of Backend.run need to tell a database outage (an expected operational
# error: one line, no traceback) from a bug, without reaching into the engine.
from federation_sender.storage.engine import db_outage as db_outage
from federation_sender.visibility import EventFacts

T = TypeVar("T")


class EventReader(Protocol):
    """Persisted events (the main process writes them; we only read)."""

    async def max_stream_ordering(self) -> int:
        """Highest persisted stream ordering, 0 when there is none."""
        ...

    async def events_after(self, after: int, upto: int, limit: int) -> list[EventRow]:
        """Events with ``after < stream_ordering <= upto``, oldest first, at most
        ``limit``."""
        ...

    async def stream_orderings_after(self, after: int, limit: int) -> list[int]:
        """The stream orderings of committed events above ``after``, lowest first, at
        most ``limit`` (the events read position's gapless runs, at start)."""
        ...

    async def events_at(self, stream_orderings: Collection[int]) -> dict[int, EventRow]:
        """The events at these stream orderings (missing ones are absent)."""
        ...

    async def room_events_between(
        self, room_ids: Collection[str], after: int, upto: int, per_room_limit: int
    ) -> dict[str, list[EventRow]]:
        """Per room, its first ``per_room_limit`` events with ``after < so <= upto``,
        oldest first (rooms without any are absent)."""
        ...

    async def room_gap_longer_than(self, room_id: str, after: int, upto: int, n: int) -> bool:
        """Whether the room has more than ``n`` events with ``after < so <= upto``
        (catch-up's bound on a gap it replays, without reading the gap)."""
        ...

    async def forward_extremities(self, room_ids: Collection[str]) -> dict[str, list[EventRow]]:
        """Each room's forward extremities that exist as events, oldest first."""
        ...

    async def partial_state(self, room_ids: Collection[str]) -> set[str]:
        """Those of the rooms we only have partial state for."""
        ...

    async def sender_and_received_ts(self, room_id: str, event_id: str) -> tuple[str, int] | None:
        """The event's sender and when this server received (or created) it, in ms;
        None if unknown."""
        ...


class RoomHostsReader(Protocol):
    """Which servers must receive an event: the backend's rule, not the caller's
    (native: servers joined after the event from ``room_memberships``, plus the target
    of a leave or ban; Synapse: the hosts of the state before the event, from state
    groups). The result may contain our own server and empty names; the caller removes
    them and applies its shard."""

    async def hosts_for_events(
        self, events: Mapping[str, Sequence[EventRow]]
    ) -> dict[str, list[frozenset[str]]]:
        """For each room, for each of its given events (ascending stream order, as
        passed), the servers that must receive it. Consecutive events with the same
        answer may share one set object: callers may key their own work by identity."""
        ...

    async def current_hosts(self, room_ids: Collection[str]) -> dict[str, frozenset[str]]:
        """Servers joined to each room now (receipts, typing, presence)."""
        ...


class DestinationStore(Protocol):
    """``destinations`` (backoff, catch-up position) and ``destination_rooms``."""

    async def get_destination(self, destination: str) -> DestinationRow | None: ...

    async def get_destinations(self, names: Collection[str]) -> dict[str, DestinationRow]: ...

    async def ensure_destinations(self, names: Collection[str]) -> None:
        """Create the missing rows (no retry timings, no position)."""
        ...

    async def set_retry_timings(
        self, destination: str, failure_ts: int | None, retry_last_ts: int, retry_interval: int
    ) -> None:
        """Persist backoff: ``retry_interval == 0`` resets; a longer interval replaces
        the stored one; a stale writer (older ``retry_last_ts``, shorter interval) never
        does. (Native: no shorter interval at all; Synapse's own rule also lets a newer
        attempt through, and that backend keeps Synapse's rule.)"""
        ...

    async def clear_retry(self, destination: str) -> bool:
        """Reset backoff; True if the destination was backing off."""
        ...

    async def clear_retry_many(self, destinations: Collection[str]) -> None:
        """Reset the backoff of destinations that just accepted a transaction, whoever
        wrote it (another instance sharing the database)."""
        ...

    async def set_last_successful_many(
        self, positions: Sequence[tuple[str, int, int]]
    ) -> None:
        """Move each ``(destination, position, before)`` forwards, only over ``before``
        (the value its queue knows, -1 for none: then a missing destination is
        created); a position changed meanwhile by another process is left alone."""
        ...

    async def upsert_destination_rooms(
        self, rows: Sequence[tuple[str, str, int]], *, skip_destinations: bool = False
    ) -> None:
        """Record (destination, room_id, stream_ordering); per (destination, room) the
        highest stream ordering wins. Creates missing destinations unless the caller
        says they all exist."""
        ...

    async def delete_destination_rooms(
        self, destination: str, rows: Sequence[tuple[str, int]]
    ) -> None:
        """Prune (room_id, stream_ordering) rows, each only if it still has that stream
        ordering (a newer event since keeps the row)."""
        ...

    async def destinations_behind(self) -> list[str]:
        """Destinations with ``destination_rooms`` rows past their position."""
        ...

    async def apply_batch(
        self, changes: Sequence[StagedChange], high_water_mark: int
    ) -> BatchCounts:
        """A batch job's result (:mod:`.batch_apply`): rows upserted or deleted only at or
        below ``high_water_mark``, positions only lowered."""
        ...

    async def apply_staged_batch(self, staging: str, high_water_mark: int) -> BatchCounts:
        """The same, from a staging table a job's executors filled."""
        ...

    async def destinations_with_outstanding_work(
        self, after: str | None, limit: int, now_ms: int
    ) -> list[tuple[str, int | None]]:
        """Keyset page (by name, strictly after ``after``) of destinations not backing
        off at ``now_ms`` that are behind or have unsent outbox rows (the wake-up
        sweep), each with its ``last_successful_stream_ordering``."""
        ...


class CatchUpReader(Protocol):
    """What catch-up planning reads besides events."""

    async def catchup_rows(
        self, destination: str, after: int, limit: int, after_room: str | None = None,
        skip: Collection[str] = (),
    ) -> list[tuple[str, int]]:
        """The ``limit`` oldest (room_id, stream_ordering) ``destination_rooms`` rows of
        the destination past the keyset (``after``, ``after_room``) in (stream_ordering,
        room_id) order; without ``after_room``, simply past ``after``; none of the
        rooms in ``skip``."""
        ...

    async def server_membership_history(
        self, server_name: str, room_ids: Collection[str]
    ) -> dict[str, list[MembershipRow]]:
        """Every room asked for, with the membership rows of ``server_name``'s users in
        it, oldest first (empty lists for rooms it never had a member in)."""
        ...


class CatchUpVisibility(Protocol):
    """What a backend knows of who may see an event (erased senders, history visibility,
    partial state): the facts :func:`federation_sender.visibility.decide` needs. A
    backend without it (native: the simulator's events are all shareable) has
    ``Tx.visibility`` None, and catch-up withholds nothing on that ground."""

    async def visibility_facts(
        self, destination: str, server_name: str, events: Sequence[EventRow]
    ) -> dict[str, EventFacts]:
        """The facts of each event, by event id, for ``destination`` (``server_name``:
        ours)."""
        ...


@dataclass(frozen=True, slots=True)
class SendTimeFacts:
    """What may have changed about a transaction's PDUs since they were queued
    (``queue/send_time.py`` acts on it)."""

    erased_senders: frozenset[str] = frozenset()
    """Those of the senders asked about that were erased (deactivated with ``erase:
    true``)."""
    redacted: Mapping[str, str | None] = field(default_factory=lambda: MappingProxyType({}))
    """The events asked about that a valid redaction redacts, each with its room's
    version (None when the backend does not know it)."""


NOTHING_CHANGED = SendTimeFacts()


class SendTimeReader(Protocol):
    """Erasures and redactions read just before a transaction goes out, so that what a
    user erased or redacted after their events were queued is not sent as it was."""

    async def send_time_facts(
        self, event_ids: Collection[str], senders: Collection[str]
    ) -> SendTimeFacts:
        """Of ``senders``, the erased ones; of ``event_ids``, the validly redacted ones
        (as the homeserver would apply the redaction when it reads the event). One
        bounded read for the whole transaction, never one per event; retried on
        transient database errors like :meth:`Backend.run`, and raises past them. The
        caller holds no database slot: the backend bounds its own connections (the
        Synapse one reads one at a time, gathering the questions asked meanwhile)."""
        ...


class OutboxStore(Protocol):
    """The durable EDU outboxes (to-device messages, device-list updates), read per
    destination past a stream id. Acknowledging a row (after the remote's 200) makes it
    unsent no more: native marks it, Synapse deletes it."""

    async def unsent_outbox(
        self, destination: str, to_device_after: int, device_lists_after: int, limit: int
    ) -> tuple[list[ToDeviceRow], list[DeviceListRow]]:
        """Unacknowledged rows past the given stream ids, oldest first, at most
        ``limit`` of each kind."""
        ...

    async def ack_to_device(
        self, destination: str, stream_ids: Collection[int], now_ms: int
    ) -> None: ...

    async def ack_device_lists(
        self, destination: str, keys: Collection[tuple[int, str, str]]
    ) -> None:
        """``keys`` are (stream_id, user_id, device_id)."""
        ...

    async def device_list_destinations(self, user_ids: Collection[str]) -> list[str]:
        """Destinations with unacknowledged device-list rows for these users."""
        ...

    async def destinations_with_unsent(self, destinations: Collection[str]) -> set[str]:
        """Those of ``destinations`` that may have unacknowledged rows: every one for
        which :meth:`unsent_outbox` from the start would return a row is in it (a few
        more may be: each is then read in full). One statement, however many."""
        ...


class PositionStore(Protocol):
    """Stream positions keyed by (stream, instance); saving never moves one backwards.

    ``load``/``save`` hold this worker's own progress (:data:`~federation_sender.model.
    EVENTS_STREAM`, :data:`~federation_sender.model.FEDERATION_STREAM`). The replication
    methods hold a reader's per-(stream, writer instance) tokens, namespaced by the
    reader's instance name so several workers can share one database."""

    async def load(self, stream: str, instance: str) -> int | None: ...

    async def save(self, stream: str, instance: str, stream_id: int) -> None: ...

    async def replay_upto(self, stream: str, instance: str) -> int | None:
        """This instance's own position before a changed instance list moved it back
        to a slower instance's (Synapse's reset at start), if it did: the events below
        it were handed to this instance's own destinations already. None otherwise."""
        ...

    async def load_replication(self, reader: str) -> dict[tuple[str, str], int]:
        """(stream, writer instance) -> token."""
        ...

    async def save_replication(self, reader: str, stream: str, writer: str, token: int) -> None:
        ...


class TxnLog(Protocol):
    """The log of transaction attempts (one row per attempt, whatever its outcome)."""

    async def log_transactions(self, rows: Sequence[TxnLogRow]) -> None: ...

    async def recent_transactions(self, destination: str, limit: int = 100) -> list[TxnLogRow]:
        """Newest first."""
        ...


class AdminReads(Protocol):
    """The admin API's reads. Sorting is stable (ties by destination / room id / log
    order) and NULLs sort as the smallest value, so offset pagination is the same on
    every backend."""

    async def list_destinations(
        self,
        *,
        start: int,
        limit: int,
        search: str | None = None,
        order_by: DestinationOrder = DestinationOrder.DESTINATION,
        direction: Direction = Direction.FORWARDS,
    ) -> tuple[list[DestinationRow], int]:
        """One page and the total matching ``search`` (a case-insensitive substring of
        the name)."""
        ...

    async def find_destination(self, destination: str) -> DestinationRow | None:
        """As Synapse: known when it has a ``destinations`` row or appears in
        ``destination_rooms`` (the latter alone reads as never failed); else None."""
        ...

    async def list_destination_rooms(
        self,
        destination: str,
        *,
        start: int,
        limit: int,
        direction: Direction = Direction.FORWARDS,
    ) -> tuple[list[tuple[str, int]], int]:
        """A page of (room_id, stream_ordering) by room id, and the total."""
        ...

    async def list_transactions(
        self, destination: str, *, start: int, limit: int, status: str | None = None
    ) -> tuple[list[TxnLogRow], int]:
        """A page of the destination's transaction log, newest attempt first."""
        ...

    async def count_destinations_backing_off(self) -> int:
        """Destinations with a retry scheduled (``retry_last_ts`` set, as Synapse)."""
        ...


class Tx(Protocol):
    """One database transaction's view of the storage, one object per aggregate."""

    @property
    def events(self) -> EventReader: ...

    @property
    def hosts(self) -> RoomHostsReader: ...

    @property
    def destinations(self) -> DestinationStore: ...

    @property
    def catchup(self) -> CatchUpReader: ...

    @property
    def visibility(self) -> CatchUpVisibility | None: ...

    @property
    def outbox(self) -> OutboxStore: ...

    @property
    def positions(self) -> PositionStore: ...

    @property
    def txlog(self) -> TxnLog: ...

    @property
    def admin(self) -> AdminReads: ...


class Backend(SendTimeReader, Protocol):
    """Owns connections and transactions (and any cache that outlives one, such as the
    native room-membership cache). Its :meth:`~SendTimeReader.send_time_facts` is one
    read of its own, outside :meth:`run`: no transaction is needed for one statement."""

    @property
    def name(self) -> str:
        """``native`` or ``synapse``: for logs and the admin API."""
        ...

    async def run(self, fn: Callable[[Tx], Awaitable[T]]) -> T:
        """Run ``fn`` in one transaction, committed when it returns; retried whole on
        transient database errors (bounded, jittered), so ``fn`` must have no effect
        outside the transaction."""
        ...


# What the EDU fan-outs read of the backend (rooms, hosts, an event's sender and
# reception time, presence states), outside a Tx: declared here, below the EDU fan-outs,
# so that each backend's capabilities can offer them without importing edus/.


@dataclass(frozen=True, slots=True)
class EventMeta:
    """What the receipt pacing rule needs to know of the receipt's event."""

    sender: str
    received_ts: int
    """When this server received (or created) the event, in ms."""


class RoomHosts(Protocol):
    """The backend's view of rooms, for ephemeral EDUs."""

    async def current_hosts(self, room_id: str) -> Collection[str]:
        """Servers with a joined member in the room now (our own included or not)."""

    async def receipt_hosts(self, room_id: str) -> Collection[str]:
        """Where a receipt goes: the current hosts, and in a partial-state room also
        the servers in it at our join (Synapse's
        ``get_current_hosts_in_room_or_partial_state_approximation``)."""

    async def event_meta(self, room_id: str, event_id: str) -> EventMeta | None:
        """Sender and reception time of an event; None if unknown."""


class PresenceSource(Protocol):
    """The backend's side of presence."""

    async def startup_states(self) -> list[PresenceState]:
        """Every user's latest state that is not offline."""

    async def states_for_users(self, user_ids: Collection[str]) -> dict[str, PresenceState]:
        """The latest stored state of each user that has one."""

    async def rooms_for_user(self, user_id: str) -> Collection[str]:
        """Rooms the user is joined to now."""

    async def current_hosts(self, room_id: str) -> Collection[str]:
        """Servers with a joined member in the room now."""
