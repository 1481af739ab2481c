"""The queue's persistence: its database access, one method per unit of work.

Each method is one database transaction of the storage backend (retried whole on
transient errors); everything a transaction result implies (backoff, position, outbox
rows, pruning, the log row) is written atomically. Nothing here knows a table: it
speaks the Protocols of ``storage/protocols.py``.

Catch-up's reads are here too (:func:`plan_rows`, inside :meth:`QueuePersistence.
plan_catchup`'s transaction): the inputs of :mod:`federation_sender.queue.core.catchup`'s
pure plans. It takes the next ``destination_rooms`` rows past the episode's cursor,
reads each room's gap one page at a time (from the episode's base, or from where the
room's last page ended), finds the first room whose gap is longer than a page (paged
through: the read stops at it) and the rooms whose gap is too long to replay (their
extremities instead), asks the backend which candidates the destination may not see,
and returns one :class:`~federation_sender.queue.core.catchup.RoomPlan` per row read.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from federation_sender.aio.idle import IdleSignal
from federation_sender.model import (
    DEVICE_LIST_UPDATE,
    DestinationRow,
    DeviceListRow,
    EventRow,
    MembershipRow,
    ToDeviceRow,
    TxnLogRow,
)
from federation_sender.queue.core.backoff import BackoffState
from federation_sender.queue.core.catchup import (
    GAP_PAGE_EVENTS,
    RoomInput,
    RoomPlan,
    is_sendable,
    plan_room,
)
from federation_sender.queue.core.effects import Effects
from federation_sender.queue.core.steps import FrozenTxn
from federation_sender.storage.protocols import Backend, Tx
from federation_sender.transport.result import SendResult
from federation_sender.visibility import Verdict, decide

JsonDict = dict[str, object]
log = logging.getLogger(__name__)


class QueuePersistence:
    def __init__(
        self, storage: Backend, max_gathered_reads: int = 256, commit_gather_s: float = 0.0,
        idle: IdleSignal | None = None,
    ) -> None:
        self.storage = storage
        self._idle = idle or IdleSignal()
        """Raised when a group commit has resolved its results' futures."""
        self._pending: list[_Pending] = []
        self._flushing = False
        self._flusher: asyncio.Future[None] | None = None
        self.commit_gather_s = commit_gather_s
        """Before each group commit, results are gathered this long (real time, the
        event loop's: a few milliseconds of batching, not a schedule to test)."""
        self.commits = 0
        self.committed_results = 0
        """Group commits and the results they carried (for tests and benchmarks)."""
        self._reads: list[tuple[str, int, asyncio.Future[Bootstrap]]] = []
        self._reading = False
        self._reader: asyncio.Future[None] | None = None
        """The running gathered read (held so that the task is not collected)."""
        self._max_gathered_reads = max_gathered_reads
        self.gathered_reads = 0
        """Database transactions of :meth:`bootstrap_gathered` (for tests and benchmarks)."""

    async def load_destination(self, destination: str) -> tuple[BackoffState, int | None]:
        async def fn(tx: Tx) -> DestinationRow | None:
            return await tx.destinations.get_destination(destination)

        return _row_state(await self.storage.run(fn))

    async def persist(
        self,
        destination: str,
        eff: Effects,
        log_row: TxnLogRow | None,
        now_ms: int,
    ) -> None:
        """Write what a result implies and wait for the commit."""
        fut = self.submit(destination, eff, log_row, now_ms)
        if fut is not None:
            await fut

    def submit(
        self,
        destination: str,
        eff: Effects,
        log_row: TxnLogRow | None,
        now_ms: int,
    ) -> asyncio.Future[None] | None:
        """Queue the write; the future resolves at commit (None: nothing to write).

        Writes are group-committed: one database transaction for everything submitted
        while the previous one ran and ``commit_gather_s`` before it began, so thousands
        of destinations cost a few commits per second, not thousands. Writes of one
        destination commit in submission order."""
        if (
            eff.backoff is None
            and not eff.succeeded
            and eff.last_successful is None
            and not eff.to_device_sent
            and not eff.device_lists_sent
            and not eff.prune
            and log_row is None
        ):
            return None
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((destination, eff, log_row, now_ms, fut))
        if not self._flushing:
            self._flushing = True
            self._flusher = asyncio.ensure_future(self._flush())
        return fut

    @property
    def idle(self) -> bool:
        """No write queued or being committed."""
        return not self._pending and not self._flushing

    async def drain(self) -> None:
        """Wait for queued writes to commit (shutdown)."""
        while self._flusher is not None and not self._flusher.done():
            await asyncio.shield(self._flusher)

    async def _flush(self) -> None:
        try:
            while self._pending:
                if self.commit_gather_s > 0:
                    # The loop's clock, not the injected one: batching, not a schedule.
                    await asyncio.sleep(self.commit_gather_s)  # noqa: TID251
                batch, self._pending = self._pending, []
                self.commits += 1
                self.committed_results += len(batch)
                try:
                    await self.storage.run(functools.partial(_apply, batch=batch))
                except Exception as e:  # handed to every waiter, which decides
                    self._fail(batch, e)
                else:
                    for *_, fut in batch:
                        if not fut.done():
                            fut.set_result(None)
                self._idle.went_idle()
        finally:
            self._flushing = False
            self._idle.went_idle()

    def _fail(self, batch: Sequence[_Pending], exc: Exception) -> None:
        """A batch failed: so do the writes its destinations queued meanwhile. Committed
        alone, a later write would record a position past PDUs whose transaction log
        rows (and prunes, outbox acks) were in the failed batch: delivered, but the
        audit would count them lost. The runner sees the failure at its next write and
        restarts in catch-up mode from the position persisted before the failed write."""
        failed = {p[0] for p in batch}
        later = [p for p in self._pending if p[0] in failed]
        self._pending = [p for p in self._pending if p[0] not in failed]
        for *_, fut in (*batch, *later):
            if not fut.done():
                fut.set_exception(exc)
                # Marked retrieved: the runner awaits its oldest unpersisted write, fails
                # on it and is restarted (logged there, one line); its later writes'
                # futures are dropped unawaited, and asyncio would otherwise print each
                # with a traceback at exit ("Future exception was never retrieved").
                fut.exception()

    async def read_outbox(
        self, destination: str, to_device_after: int, device_lists_after: int, limit: int
    ) -> tuple[list[tuple[int, JsonDict]], list[tuple[int, str, str, str, JsonDict]], bool]:
        async def fn(tx: Tx) -> tuple[list[ToDeviceRow], list[DeviceListRow]]:
            return await tx.outbox.unsent_outbox(
                destination, to_device_after, device_lists_after, limit
            )

        td, dl = await self.storage.run(fn)
        return _outbox(td, dl, limit)

    async def plan_catchup(
        self,
        destination: str,
        server_name: str,
        after: int,
        cursor: tuple[int, str | None],
        rooms_limit: int,
        max_gap_events: int,
        floors: Mapping[str, int] | None = None,
        skip_rooms: Collection[str] = (),
    ) -> list[RoomPlan]:
        """Plans for the ``rooms_limit`` oldest rows past ``cursor``, replaying gaps from
        ``after`` (the episode's base position) or a room's floor (``floors``: where
        this episode left the room), none of ``skip_rooms`` (a read beside rooms whose
        pages await a confirmation). Empty: caught up (or nothing beside them)."""
        return await self.storage.run(
            functools.partial(
                plan_rows,
                destination=destination,
                server_name=server_name,
                after=after,
                cursor=cursor,
                rooms_limit=rooms_limit,
                max_gap_events=max_gap_events,
                floors=floors,
                skip_rooms=skip_rooms,
            ),
        )

    async def bootstrap_catchup(
        self,
        destination: str,
        server_name: str,
        outbox_limit: int,
        rooms_limit: int,
        max_gap_events: int,
        now_ms: int,
    ) -> Bootstrap:
        """Everything a new queue that starts in catch-up reads first, in one database
        transaction: its row, its outbox window and its first catch-up plans, unless it
        is backing off (other queues: :meth:`bootstrap_gathered`)."""

        async def fn(tx: Tx) -> Bootstrap:
            backoff, last = _row_state(await tx.destinations.get_destination(destination))
            td, dl = await tx.outbox.unsent_outbox(destination, -1, -1, outbox_limit)
            plans: list[RoomPlan] | None = None
            if not backoff.active_at(now_ms):
                base = -1 if last is None else last
                plans = await plan_rows(
                    tx,
                    destination=destination,
                    server_name=server_name,
                    after=base,
                    cursor=(base, None),
                    rooms_limit=rooms_limit,
                    max_gap_events=max_gap_events,
                )
            return Bootstrap(backoff, last, *_outbox(td, dl, outbox_limit), plans)

        return await self.storage.run(fn)

    async def bootstrap_gathered(self, destination: str, outbox_limit: int) -> Bootstrap:
        """:meth:`bootstrap_catchup` without catch-up plans, gathered: the first reads of every
        queue that starts while the previous read runs share one database transaction
        (at most ``max_gathered_reads`` queues), one statement per kind of row for all
        of them, then the outbox rows of the few that have any. A message in a room of
        10,000 servers, after a quiet minute has let their queues go, costs about 40
        database transactions instead of 10,000 (``bench/big_room.py``). One read runs
        at a time: the caller needs no database slot."""
        fut: asyncio.Future[Bootstrap] = asyncio.get_running_loop().create_future()
        self._reads.append((destination, outbox_limit, fut))
        if not self._reading:
            self._reading = True
            self._reader = asyncio.ensure_future(self._read_gathered())
        return await fut

    async def _read_gathered(self) -> None:
        try:
            while self._reads:
                n = self._max_gathered_reads
                batch, self._reads = self._reads[:n], self._reads[n:]
                wanted = [(d, limit) for d, limit, fut in batch if not fut.done()]
                if not wanted:
                    continue  # every caller was cancelled meanwhile
                self.gathered_reads += 1
                try:
                    out = await self.storage.run(functools.partial(_bootstrap_many, wanted=wanted))
                except Exception as e:  # handed to every caller (its runner restarts)
                    for _, _, fut in batch:
                        if not fut.done():
                            fut.set_exception(e)
                    continue
                for d, _, fut in batch:
                    if not fut.done():
                        fut.set_result(out[d])
        finally:
            self._reading = False

    async def destinations_behind(self) -> list[str]:
        async def fn(tx: Tx) -> list[str]:
            return await tx.destinations.destinations_behind()

        return await self.storage.run(fn)

    async def clear_retry(self, destination: str) -> bool:
        async def fn(tx: Tx) -> bool:
            return await tx.destinations.clear_retry(destination)

        return await self.storage.run(fn)

    async def load_position(self, stream: str, instance: str) -> int | None:
        async def fn(tx: Tx) -> int | None:
            return await tx.positions.load(stream, instance)

        return await self.storage.run(fn)

    async def save_position(self, stream: str, instance: str, stream_id: int) -> None:
        async def fn(tx: Tx) -> None:
            await tx.positions.save(stream, instance, stream_id)

        await self.storage.run(fn)

    async def wakeup_page(
        self, after: str | None, limit: int, now_ms: int
    ) -> list[tuple[str, int | None]]:
        async def fn(tx: Tx) -> list[tuple[str, int | None]]:
            return await tx.destinations.destinations_with_outstanding_work(
                after, limit, now_ms
            )

        return await self.storage.run(fn)


@dataclass(frozen=True, slots=True)
class Bootstrap:
    backoff: BackoffState
    last_successful: int | None
    to_device: list[tuple[int, JsonDict]]
    device_lists: list[tuple[int, str, str, str, JsonDict]]
    """(stream_id, user_id, device_id, edu_type, content)"""
    outbox_exhausted: bool
    plans: list[RoomPlan] | None


def _row_state(row: DestinationRow | None) -> tuple[BackoffState, int | None]:
    """The backoff and the last successful position a ``destinations`` row holds."""
    if row is None:
        return BackoffState(), None
    return (
        BackoffState(
            retry_last_ts_ms=row.retry_last_ts or 0,
            retry_interval_ms=row.retry_interval or 0,
            failure_ts_ms=row.failure_ts,
        ),
        row.last_successful_stream_ordering,
    )


async def _bootstrap_many(tx: Tx, *, wanted: Sequence[tuple[str, int]]) -> dict[str, Bootstrap]:
    """:meth:`QueuePersistence.bootstrap_gathered`'s transaction: the rows and which outboxes
    hold anything in one statement each, then the outbox windows of those that do."""
    names = {d for d, _ in wanted}
    rows = await tx.destinations.get_destinations(names)
    with_outbox = await tx.outbox.destinations_with_unsent(names)
    out: dict[str, Bootstrap] = {}
    for d, limit in wanted:
        if d in out:
            continue
        backoff, last = _row_state(rows.get(d))
        td: list[ToDeviceRow] = []
        dl: list[DeviceListRow] = []
        if d in with_outbox:
            td, dl = await tx.outbox.unsent_outbox(d, -1, -1, limit)
        out[d] = Bootstrap(backoff, last, *_outbox(td, dl, limit), None)
    return out


def _outbox(
    td: Sequence[ToDeviceRow], dl: Sequence[DeviceListRow], limit: int
) -> tuple[list[tuple[int, JsonDict]], list[tuple[int, str, str, str, JsonDict]], bool]:
    to_device = [(r.stream_id, _load(r.messages_json)) for r in td]
    device_lists: list[tuple[int, str, str, str, JsonDict]] = []
    for r in dl:
        content = _load(r.content_json)
        if r.edu_type == DEVICE_LIST_UPDATE:
            content.setdefault("user_id", r.user_id)
            content.setdefault("device_id", r.device_id)
            content.setdefault("stream_id", r.stream_id)
        device_lists.append((r.stream_id, r.user_id, r.device_id, r.edu_type, content))
    return to_device, device_lists, len(td) < limit and len(dl) < limit


_Pending = tuple[str, Effects, "TxnLogRow | None", int, "asyncio.Future[None]"]


async def _apply(tx: Tx, *, batch: Sequence[_Pending]) -> None:
    positions: list[tuple[str, int, int]] = []
    logs: list[TxnLogRow] = []
    succeeded: set[str] = set()
    for destination, eff, log_row, now_ms, _fut in batch:
        if eff.backoff is not None:
            b = eff.backoff
            await tx.destinations.set_retry_timings(
                destination, b.failure_ts_ms, b.retry_last_ts_ms, b.retry_interval_ms
            )
            succeeded.discard(destination)  # a later failure of the same batch wins
        elif eff.succeeded:
            succeeded.add(destination)
        if eff.last_successful is not None:
            positions.append((destination, eff.last_successful, eff.position_before))
        # Most results mark no outbox rows: skip the coroutine, not just the query.
        if eff.to_device_sent:
            await tx.outbox.ack_to_device(destination, eff.to_device_sent, now_ms)
        if eff.device_lists_sent:
            await tx.outbox.ack_device_lists(destination, eff.device_lists_sent)
        if eff.prune:
            await tx.destinations.delete_destination_rooms(destination, eff.prune)
        if log_row is not None:
            logs.append(log_row)
    # One statement for the group: a success clears a backoff another instance wrote.
    await tx.destinations.clear_retry_many(succeeded)
    await tx.destinations.set_last_successful_many(positions)
    await tx.txlog.log_transactions(logs)


def _load(text: str) -> JsonDict:
    try:
        v = json.loads(text)
    except ValueError:
        return {}
    return v if isinstance(v, dict) else {"value": v}


def log_row_for(
    txn: FrozenTxn, destination: str, instance_name: str, result: SendResult, started_ts: int
) -> TxnLogRow:
    """The ``federation_transaction_log`` row of one attempt."""
    batch = txn.batch
    return TxnLogRow(
        txn_id=txn.txn_id,
        destination=destination,
        instance_name=instance_name,
        pdu_count=len(batch.pdus),
        edu_count=len(batch.edus),
        request_bytes=result.request_bytes or batch.size_bytes,
        status=result.outcome.value,
        http_status=result.status,
        started_ts=started_ts,
        duration_ms=int(result.duration_s * 1000),
        catchup=batch.catchup,
        max_stream_ordering=batch.max_stream_ordering,
        pdu_event_ids=tuple([p.event_id for p in batch.pdus]),
        error=result.error or None,
    )


# --- catch-up's reads -------------------------------------------------------------------


Rows = list[tuple[str, int]]
"""``destination_rooms`` rows: (room, stream ordering)."""


async def plan_rows(
    tx: Tx,
    *,
    destination: str,
    server_name: str,
    after: int,
    cursor: tuple[int, str | None],
    rooms_limit: int,
    max_gap_events: int,
    floors: Mapping[str, int] | None = None,
    page_events: int = GAP_PAGE_EVENTS,
    skip_rooms: Collection[str] = (),
) -> list[RoomPlan]:
    """Plans for the rows past ``cursor``. A room's gap is read from ``after`` (the
    episode's base), or from its floor (``floors``: the last event read of a room this
    episode already paged through), one page (``page_events``) at a time: a gap longer
    than a page and at most ``max_gap_events`` long ends the read with a ``more``
    plan of its first page holding something to send (``queue/core/catchup.py``)."""
    rows = await tx.catchup.catchup_rows(destination, cursor[0], rooms_limit, cursor[1],
                                         skip_rooms)
    if not rows:
        return []
    page = max(1, min(page_events, max_gap_events))
    fresh, missed = await _read_gaps(tx, rows, after, floors or {}, page)
    rows, long_gap, paged = await _long_gaps(tx, rows, missed, fresh, after, page,
                                             max_gap_events)
    room_ids = [r for r, _ in rows]
    whole = [r for r in room_ids if paged is None or r != paged[0]]
    # The common case (short gaps) needs neither partial-state flags nor extremities,
    # and finds the row's own event at the end of the gap.
    partial = await tx.events.partial_state(long_gap) if long_gap else set()
    extremities = await tx.events.forward_extremities([r for r in long_gap if r not in partial])
    history = await tx.catchup.server_membership_history(destination, room_ids)
    row_events = await _row_events(tx, rows, missed, long_gap, whole)
    withheld = await _withheld(
        tx, destination, server_name,
        [e for r in whole if r not in long_gap for e in missed.get(r, ())
         if is_sendable(e, server_name)],
        [e for evs in extremities.values() for e in evs],
        [e for so, e in row_events.items() if paged is None or so != paged[1]],
    )  # fmt: skip
    plans = [
        plan_room(
            RoomInput(
                room_id=room,
                row_stream_ordering=so,
                missed=missed.get(room, []) if room not in long_gap else [],
                extremities=extremities.get(room, []),
                partial_state=room in partial,
                history=history.get(room, []),
                row_event=row_events.get(so),
                withheld=withheld,
            ),
            destination,
            server_name,
            max_gap_events if room not in long_gap else -1,
        )
        for room, so in rows
        if room in whole
    ]
    if paged is not None:
        last = await _page(
            tx, destination=destination, server_name=server_name, room=paged[0],
            row_so=paged[1], first=missed[paged[0]], page=page,
            history=history.get(paged[0], []),
        )  # fmt: skip
        plans.append(replace(last, cut=True))
    return plans


async def _read_gaps(
    tx: Tx, rows: Rows, after: int, floors: Mapping[str, int], page: int
) -> tuple[list[str], dict[str, list[EventRow]]]:
    """The rooms read from the episode's base (``fresh``) and each room's gap up to its
    row, at most one page and one event more (``missed``)."""
    row_so = dict(rows)
    upto = max(row_so.values())
    # A floor inside a row's gap: the room was paged through (or handled) this episode;
    # at or past its row: handled through it (a read beside a waiting room did), nothing
    # to read again.
    done = {r for r, so in rows if after < floors.get(r, after) and floors[r] >= so}
    fresh = [r for r, so in rows if r not in done and not after < floors.get(r, after) < so]
    missed = await tx.events.room_events_between(fresh, after, upto, page + 1)
    for room, so in rows:
        if room in done:
            missed[room] = []
        elif room not in fresh:
            missed.update(await tx.events.room_events_between([room], floors[room], so,
                                                               page + 1))
    for room, evs in missed.items():
        missed[room] = [e for e in evs if e.stream_ordering <= row_so[room]]
    return fresh, missed


async def _long_gaps(
    tx: Tx, rows: Rows, missed: Mapping[str, Sequence[EventRow]], fresh: Sequence[str],
    after: int, page: int, max_gap_events: int,
) -> tuple[Rows, list[str], tuple[str, int] | None]:
    """The rows this read plans (those up to the first paged room), the rooms whose gap
    is longer than ``max_gap_events`` (counted from the episode's base: extremities, as
    before paging), and the first room whose gap is longer than a page (paged through;
    the rooms after it are read again after its gap)."""
    long_gap: list[str] = []
    for i, (room, so) in enumerate(rows):
        if len(missed.get(room, ())) <= page:
            continue
        if room in fresh and await tx.events.room_gap_longer_than(
                room, after, so, max_gap_events):
            long_gap.append(room)
            continue
        return rows[: i + 1], long_gap, (room, so)
    return rows, long_gap, None


async def _row_events(
    tx: Tx, rows: Rows, missed: Mapping[str, Sequence[EventRow]], long_gap: Sequence[str],
    whole: Sequence[str],
) -> dict[int, EventRow]:
    """Each row's own event: the end of its gap when the gap was read to it, else read."""
    row_events: dict[int, EventRow] = {}
    for room, so in rows:
        gap = missed.get(room)
        if gap and gap[-1].stream_ordering == so and room not in long_gap:
            row_events[so] = gap[-1]
    lacking = [so for r, so in rows if so not in row_events and r in whole]
    if lacking:
        row_events.update(await tx.events.events_at(lacking))
    return row_events


async def _page(
    tx: Tx,
    *,
    destination: str,
    server_name: str,
    room: str,
    row_so: int,
    first: Sequence[EventRow],
    page: int,
    history: Sequence[MembershipRow],
) -> RoomPlan:
    """The next page of ``room``'s long gap with something to send (``first``: the
    page read, with one more event): pages with nothing for the destination (other
    servers' events, withheld ones) are skipped, one at a time. Ends the room (a
    complete plan) when the gap ends within a page."""
    evs = list(first)
    while True:
        more = len(evs) > page
        evs = evs[:page]
        row_event = evs[-1] if evs and evs[-1].stream_ordering == row_so else None
        if not more and row_event is None:
            row_event = (await tx.events.events_at([row_so])).get(row_so)
        withheld = await _withheld(
            tx, destination, server_name,
            [e for e in evs if is_sendable(e, server_name)],
            [row_event] if row_event is not None and not more else [],
        )  # fmt: skip
        plan = plan_room(
            RoomInput(room, row_so, evs, (), False, history,
                      None if more else row_event, withheld),
            destination, server_name, len(evs),
        )  # fmt: skip
        if not more:
            return plan
        if plan.events:
            return replace(plan, prune=False, mode="page", more=True,
                           read_upto=evs[-1].stream_ordering)
        evs = (await tx.events.room_events_between(
            [room], evs[-1].stream_ordering, row_so, page + 1)).get(room, [])


async def _withheld(
    tx: Tx, destination: str, server_name: str, *candidates: Sequence[EventRow]
) -> frozenset[str]:
    """The candidates (events catch-up may send) the destination may not see, as the
    backend knows it (none on a backend without visibility)."""
    if tx.visibility is None:
        return frozenset()
    events = {e.event_id: e for evs in candidates for e in evs}
    facts = await tx.visibility.visibility_facts(destination, server_name, list(events.values()))
    verdicts = {eid: decide(f) for eid, f in facts.items()}
    out = frozenset(eid for eid, v in verdicts.items() if v is not Verdict.SEND)
    if out:
        reasons = Counter(verdicts[eid].value for eid in out)
        log.info(
            "Catch-up to %s withholds %d events (%s)", destination, len(out),
            ", ".join(f"{r}: {n}" for r, n in sorted(reasons.items())),
        )  # fmt: skip
    return out
