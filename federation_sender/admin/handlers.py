"""Admin route handlers. Each reads its dependencies from typed app keys.

Synapse-compatible routes return exactly Synapse's fields plus one extra object,
``queue``, holding the live state from :class:`QueueControl` (``"live": true``) or,
for a destination without a loaded queue on this instance, a state derived from the
persisted retry timings (``"live": false``). Clients that do not know ``queue``
ignore it.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from federation_sender.admin.errors import AdminError, Codes, parse_enum, parse_int, parse_str
from federation_sender.admin.protocols import QUEUE_STATES, QueueControl
from federation_sender.clock import Clock, time_ms
from federation_sender.model import DestinationOrder, DestinationRow, Direction
from federation_sender.storage.protocols import Backend, Tx

ReadinessCheck = Callable[[], bool | Awaitable[bool]]

STORAGE = web.AppKey("storage", Backend)
QUEUES = web.AppKey("queues", QueueControl)
CLOCK = web.AppKey("clock", Clock)
READY: web.AppKey[ReadinessCheck] = web.AppKey("ready")
CounterSource = Callable[[], Mapping[str, float]]
COUNTERS: web.AppKey[CounterSource] = web.AppKey("counters")

MAX_LIMIT = 1000
MAX_OFFSET = 2**62
"""Larger offsets would overflow the databases' 64-bit integers (a 500, found by
schemathesis); no listing is that long."""
"""Upper bound on ``limit``; Synapse has none, but one request should not read a
whole 100k-row table into memory."""

TXN_STATUSES = ("success", "transient", "permanent", "too_large")


def _query(request: web.Request) -> Mapping[str, str]:
    return request.rel_url.query


def derived_queue_state(row: DestinationRow) -> dict[str, Any]:
    backing_off = row.backing_off
    next_retry = None
    if backing_off and row.retry_last_ts is not None:
        next_retry = row.retry_last_ts + (row.retry_interval or 0)
    return {
        "state": "backing_off" if backing_off else "idle",
        "pending_pdus": 0,
        "pending_edus": 0,
        "in_flight_txn_id": None,
        "in_flight_age_s": None,
        "last_error": None,
        "next_retry_ts": next_retry,
        "last_success_ts": None,
        "catching_up": False,
        "live": False,
    }


def _queue_json(live: Mapping[str, Any] | None, row: DestinationRow) -> dict[str, Any]:
    if live is None:
        return derived_queue_state(row)
    return {**live, "live": True}


async def _read(request: web.Request, fn: Callable[[Tx], Awaitable[Any]]) -> Any:
    return await request.app[STORAGE].run(fn)


async def _known(request: web.Request, destination: str) -> DestinationRow:
    row: DestinationRow | None = await _read(
        request, lambda tx: tx.admin.find_destination(destination))
    if row is None:
        raise AdminError(404, Codes.NOT_FOUND, "Unknown destination")
    return row


def _page(query: Mapping[str, str]) -> tuple[int, int]:
    start = parse_int(query, "from", 0, maximum=MAX_OFFSET)
    limit = parse_int(query, "limit", 100, maximum=MAX_LIMIT)
    return start, limit


def _paged(body: dict[str, Any], start: int, limit: int, count: int, total: int
           ) -> dict[str, Any]:
    # Synapse's rule: a next_token while the requested window ends before the total.
    if start + limit < total:
        body["next_token"] = str(start + count)
    return body


async def list_destinations(request: web.Request) -> web.Response:
    q = _query(request)
    start, limit = _page(q)
    search = parse_str(q, "destination")
    order_by = parse_enum(q, "order_by", DestinationOrder, DestinationOrder.DESTINATION)
    direction = parse_enum(q, "dir", Direction, Direction.FORWARDS)
    rows, total = await _read(request, lambda tx: tx.admin.list_destinations(
        start=start, limit=limit, search=search, order_by=order_by, direction=direction))
    queues = request.app[QUEUES]
    items = [{**r.to_json(), "queue": _queue_json(queues.live_state(r.destination), r)}
             for r in rows]
    return web.json_response(
        _paged({"destinations": items, "total": total}, start, limit, len(items), total))


async def get_destination(request: web.Request) -> web.Response:
    destination = request.match_info["destination"]
    row = await _known(request, destination)
    live = request.app[QUEUES].live_state(destination)
    return web.json_response({**row.to_json(), "queue": _queue_json(live, row)})


async def destination_rooms(request: web.Request) -> web.Response:
    destination = request.match_info["destination"]
    await _known(request, destination)
    q = _query(request)
    start, limit = _page(q)
    direction = parse_enum(q, "dir", Direction, Direction.FORWARDS)
    rooms, total = await _read(request, lambda tx: tx.admin.list_destination_rooms(
        destination, start=start, limit=limit, direction=direction))
    items = [{"room_id": room, "stream_ordering": so} for room, so in rooms]
    return web.json_response(
        _paged({"rooms": items, "total": total}, start, limit, len(items), total))


async def destination_transactions(request: web.Request) -> web.Response:
    destination = request.match_info["destination"]
    await _known(request, destination)
    q = _query(request)
    start, limit = _page(q)
    status = parse_str(q, "status")
    if status is not None and status not in TXN_STATUSES:
        raise AdminError(400, Codes.INVALID_PARAM,
                         f"Query parameter status must be one of {list(TXN_STATUSES)}")
    txns, total = await _read(request, lambda tx: tx.admin.list_transactions(
        destination, start=start, limit=limit, status=status))
    items = [t.to_json() for t in txns]
    return web.json_response(
        _paged({"transactions": items, "total": total}, start, limit, len(items), total))


async def _empty_object_body(request: web.Request) -> None:
    """A write's body is ``{}`` as Synapse documents it, or absent (``curl -X POST``).
    Anything else is refused as Synapse's JSON parser refuses it, before anything is
    done: a caller that sent something else meant something else."""
    raw = await request.read()
    if not raw.strip():
        return
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise AdminError(400, Codes.NOT_JSON, "Content not JSON.") from None
    if not isinstance(body, dict):
        raise AdminError(400, Codes.BAD_JSON, "Content must be a JSON object.")


async def reset_connection(request: web.Request) -> web.Response:
    destination = request.match_info["destination"]
    await _empty_object_body(request)
    await _known(request, destination)
    if not await request.app[QUEUES].reset_connection(destination):
        raise AdminError(400, Codes.UNKNOWN,
                         "The retry timing does not need to be reset for this destination.")
    return web.json_response({})


async def summary(request: web.Request) -> web.Response:
    async def read(tx: Tx) -> tuple[int, int]:
        _, total = await tx.admin.list_destinations(start=0, limit=0)
        return total, await tx.admin.count_destinations_backing_off()

    total, backing_off = await _read(request, read)
    states: dict[str, int] = dict.fromkeys(QUEUE_STATES, 0)
    pending_pdus = pending_edus = catching_up = 0
    oldest: float | None = None
    for live in request.app[QUEUES].live_states().values():
        name = str(live.get("state"))
        states[name] = states.get(name, 0) + 1
        # Catch-up is a mode that outlives a backoff: counted like the metric
        # federation_sender_destinations_catching_up, not by the momentary state.
        catching_up += bool(live.get("catching_up"))
        pending_pdus += int(live.get("pending_pdus") or 0)
        pending_edus += int(live.get("pending_edus") or 0)
        age = live.get("in_flight_age_s")
        if age is not None and (oldest is None or float(age) > oldest):
            oldest = float(age)
    return web.json_response({
        "now_ts": time_ms(request.app[CLOCK]),
        "total_destinations": total,
        "backing_off_destinations": backing_off,
        "live_states": states,
        "pending_pdus": pending_pdus,
        "pending_edus": pending_edus,
        "oldest_in_flight_age_s": oldest,
        "catching_up_destinations": catching_up,
        "counters": dict(request.app[COUNTERS]()),
    })


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    result = request.app[READY]()
    is_ready = bool(await result) if inspect.isawaitable(result) else bool(result)
    return web.json_response({"ready": is_ready}, status=200 if is_ready else 503)
