"""The queue engine's database access, one method per unit of work.

Each method is one database transaction (retried on transient errors by
:func:`run_in_transaction`); everything a transaction result implies (backoff, position,
outbox rows, pruning, the log row) is written atomically.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from federation_sender.queue.backoff import BackoffState
from federation_sender.queue.catchup import RoomInput, RoomPlan, plan_room
from federation_sender.queue.core import Effects
from federation_sender.storage import destinations as dst
from federation_sender.storage import events as ev
from federation_sender.storage import outboxes as ob
from federation_sender.storage import positions as pos
from federation_sender.storage import rooms as rm
from federation_sender.storage import txlog
from federation_sender.storage.engine import run_in_transaction
from federation_sender.storage.events import EventRow

JsonDict = dict[str, object]


class QueueStore:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._pending: list[_Pending] = []
        self._flushing = False
        self._flusher: asyncio.Future[None] | None = None

    async def load_destination(self, destination: str) -> tuple[BackoffState, int | None]:
        async def fn(conn: AsyncConnection) -> dst.DestinationRow | None:
            return await dst.get_destination(conn, destination)

        row = await run_in_transaction(self.engine, fn)
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

    async def persist(
        self,
        destination: str,
        eff: Effects,
        log_row: txlog.TxnLogRow | None,
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
        log_row: txlog.TxnLogRow | None,
        now_ms: int,
    ) -> asyncio.Future[None] | None:
        """Queue the write; the future resolves at commit (None: nothing to write).

        Writes are group-committed: one database transaction for everything submitted
        while the previous one ran, so thousands of destinations cost a few commits per
        second, not thousands. Writes of one destination commit in submission order."""
        if (
            eff.backoff is None
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

    async def drain(self) -> None:
        """Wait for queued writes to commit (shutdown)."""
        while self._flusher is not None and not self._flusher.done():
            await asyncio.shield(self._flusher)

    async def _flush(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                try:
                    await run_in_transaction(self.engine, functools.partial(_apply, batch=batch))
                except Exception as e:  # handed to every waiter, which decides
                    for *_, fut in batch:
                        if not fut.done():
                            fut.set_exception(e)
                else:
                    for *_, fut in batch:
                        if not fut.done():
                            fut.set_result(None)
        finally:
            self._flushing = False

    async def read_outbox(
        self, destination: str, to_device_after: int, device_lists_after: int, limit: int
    ) -> tuple[list[tuple[int, JsonDict]], list[tuple[int, str, str, JsonDict]], bool]:
        async def fn(
            conn: AsyncConnection,
        ) -> tuple[list[ob.ToDeviceRow], list[ob.DeviceListRow]]:
            return await ob.unsent_outbox(
                conn, destination, to_device_after, device_lists_after, limit
            )

        td, dl = await run_in_transaction(self.engine, fn)
        return _outbox(td, dl, limit)

    async def plan_catchup(
        self,
        destination: str,
        server_name: str,
        after: int,
        cursor: tuple[int, str | None],
        rooms_limit: int,
        max_gap_events: int,
    ) -> list[RoomPlan]:
        """Plans for the ``rooms_limit`` oldest rows past ``cursor``, replaying gaps from
        ``after`` (the episode's base position). Empty: caught up."""
        return await run_in_transaction(
            self.engine,
            functools.partial(
                _plan,
                destination=destination,
                server_name=server_name,
                after=after,
                cursor=cursor,
                rooms_limit=rooms_limit,
                max_gap_events=max_gap_events,
            ),
        )

    async def bootstrap(
        self,
        destination: str,
        server_name: str,
        plan: bool,
        outbox_limit: int,
        rooms_limit: int,
        max_gap_events: int,
        now_ms: int,
    ) -> Bootstrap:
        """Everything a new queue reads first, in one database transaction: its row,
        its outbox window and (``plan``: it starts in catch-up) its first catch-up plans,
        unless it is backing off."""

        async def fn(conn: AsyncConnection) -> Bootstrap:
            row = await dst.get_destination(conn, destination)
            backoff = BackoffState()
            last: int | None = None
            if row is not None:
                backoff = BackoffState(
                    retry_last_ts_ms=row.retry_last_ts or 0,
                    retry_interval_ms=row.retry_interval or 0,
                    failure_ts_ms=row.failure_ts,
                )
                last = row.last_successful_stream_ordering
            td, dl = await ob.unsent_outbox(conn, destination, -1, -1, outbox_limit)
            plans: list[RoomPlan] | None = None
            if plan and not backoff.active_at(now_ms):
                base = -1 if last is None else last
                plans = await _plan(
                    conn,
                    destination=destination,
                    server_name=server_name,
                    after=base,
                    cursor=(base, None),
                    rooms_limit=rooms_limit,
                    max_gap_events=max_gap_events,
                )
            return Bootstrap(backoff, last, *_outbox(td, dl, outbox_limit), plans)

        return await run_in_transaction(self.engine, fn)

    async def destinations_behind(self) -> list[str]:
        async def fn(conn: AsyncConnection) -> list[str]:
            return await dst.destinations_behind(conn)

        return await run_in_transaction(self.engine, fn)

    async def clear_retry(self, destination: str) -> bool:
        async def fn(conn: AsyncConnection) -> bool:
            return await dst.clear_retry(conn, destination)

        return await run_in_transaction(self.engine, fn)

    async def load_position(self, stream: str, instance: str) -> int | None:
        async def fn(conn: AsyncConnection) -> int | None:
            return await pos.load_position(conn, stream, instance)

        return await run_in_transaction(self.engine, fn)

    async def save_position(self, stream: str, instance: str, stream_id: int) -> None:
        async def fn(conn: AsyncConnection) -> None:
            await pos.save_position(conn, stream, instance, stream_id)

        await run_in_transaction(self.engine, fn)

    async def wakeup_page(self, after: str | None, limit: int, now_ms: int) -> list[str]:
        async def fn(conn: AsyncConnection) -> list[str]:
            return await dst.destinations_with_outstanding_work(conn, after, limit, now_ms)

        return await run_in_transaction(self.engine, fn)


@dataclass(frozen=True, slots=True)
class Bootstrap:
    backoff: BackoffState
    last_successful: int | None
    to_device: list[tuple[int, JsonDict]]
    device_lists: list[tuple[int, str, str, JsonDict]]
    outbox_exhausted: bool
    plans: list[RoomPlan] | None


def _outbox(
    td: Sequence[ob.ToDeviceRow], dl: Sequence[ob.DeviceListRow], limit: int
) -> tuple[list[tuple[int, JsonDict]], list[tuple[int, str, str, JsonDict]], bool]:
    to_device = [(r.stream_id, _load(r.messages_json)) for r in td]
    device_lists: list[tuple[int, str, str, JsonDict]] = []
    for r in dl:
        content = _load(r.content_json)
        content.setdefault("user_id", r.user_id)
        content.setdefault("device_id", r.device_id)
        content.setdefault("stream_id", r.stream_id)
        device_lists.append((r.stream_id, r.user_id, r.device_id, content))
    return to_device, device_lists, len(td) < limit and len(dl) < limit


async def _plan(
    conn: AsyncConnection,
    *,
    destination: str,
    server_name: str,
    after: int,
    cursor: tuple[int, str | None],
    rooms_limit: int,
    max_gap_events: int,
) -> list[RoomPlan]:
    rows = await dst.catchup_rows(conn, destination, cursor[0], rooms_limit, cursor[1])
    if not rows:
        return []
    room_ids = [r for r, _ in rows]
    row_so = dict(rows)
    upto = max(row_so.values())
    missed = await ev.room_events_between(conn, room_ids, after, upto, max_gap_events + 1)
    for room, evs in missed.items():
        missed[room] = [e for e in evs if e.stream_ordering <= row_so[room]]
    long_gap = [r for r in room_ids if len(missed.get(r, ())) > max_gap_events]
    # The common case (short gaps) needs neither partial-state flags nor extremities,
    # and finds the row's own event at the end of the gap.
    partial = await ev.partial_state(conn, long_gap) if long_gap else set()
    extremities = await ev.forward_extremities(conn, [r for r in long_gap if r not in partial])
    history = await rm.server_membership_history(conn, destination, room_ids)
    row_events: dict[int, EventRow] = {}
    for room, so in rows:
        gap = missed.get(room)
        if gap and gap[-1].stream_ordering == so and len(gap) <= max_gap_events:
            row_events[so] = gap[-1]
    lacking = [so for _, so in rows if so not in row_events]
    if lacking:
        row_events.update(await ev.events_at(conn, lacking))
    return [
        plan_room(
            RoomInput(
                room_id=room,
                row_stream_ordering=so,
                missed=missed.get(room, []),
                extremities=extremities.get(room, []),
                partial_state=room in partial,
                history=history.get(room, []),
                row_event=row_events.get(so),
            ),
            destination,
            server_name,
            max_gap_events,
        )
        for room, so in rows
    ]


_Pending = tuple[str, Effects, "txlog.TxnLogRow | None", int, "asyncio.Future[None]"]


async def _apply(conn: AsyncConnection, *, batch: Sequence[_Pending]) -> None:
    positions: list[tuple[str, int]] = []
    logs: list[txlog.TxnLogRow] = []
    for destination, eff, log_row, now_ms, _fut in batch:
        if eff.backoff is not None:
            b = eff.backoff
            await dst.set_retry_timings(
                conn, destination, b.failure_ts_ms, b.retry_last_ts_ms, b.retry_interval_ms
            )
        if eff.last_successful is not None:
            positions.append((destination, eff.last_successful))
        # Most results mark no outbox rows: skip the coroutine, not just the query.
        if eff.to_device_sent:
            await ob.mark_to_device_sent(conn, destination, eff.to_device_sent, now_ms)
        if eff.device_lists_sent:
            await ob.mark_device_lists_sent(conn, destination, eff.device_lists_sent)
        if eff.prune:
            await dst.delete_destination_rooms(conn, destination, eff.prune)
        if log_row is not None:
            logs.append(log_row)
    await dst.set_last_successful_many(conn, positions)
    await txlog.log_transactions(conn, logs)


def _load(text: str) -> JsonDict:
    try:
        v = json.loads(text)
    except ValueError:
        return {}
    return v if isinstance(v, dict) else {"value": v}


def log_row_for(
    *,
    txn_id: str,
    destination: str,
    instance_name: str,
    pdu_event_ids: Sequence[str],
    edu_count: int,
    request_bytes: int,
    status: str,
    http_status: int | None,
    started_ts: int,
    duration_ms: int,
    catchup: bool,
    max_stream_ordering: int | None,
    error: str | None,
) -> txlog.TxnLogRow:
    return txlog.TxnLogRow(
        txn_id=txn_id,
        destination=destination,
        instance_name=instance_name,
        pdu_count=len(pdu_event_ids),
        edu_count=edu_count,
        request_bytes=request_bytes,
        status=status,
        http_status=http_status,
        started_ts=started_ts,
        duration_ms=duration_ms,
        catchup=catchup,
        max_stream_ordering=max_stream_ordering,
        pdu_event_ids=tuple(pdu_event_ids),
        error=error,
    )
