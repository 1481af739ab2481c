"""Device-list and cross-signing EDUs from Synapse's tables, as Synapse builds them.

Mirrors ``synapse/storage/databases/main/devices.py``:
:func:`device_updates_by_remote` is ``get_device_updates_by_remote`` with
``_get_device_updates_by_remote_txn`` and ``_get_device_update_edus_by_remote``;
:func:`mark_sent` is ``_mark_as_sent_devices_by_remote_txn``;
:func:`destinations_for_token` is ``get_destinations_for_device``.

What a destination receives for a window ``(from_stream_id, now_stream_id]`` of its
pokes (at most ``limit`` rows, in stream order):

* one ``m.device_list_update`` per (user, device), for the newest poke of that device:
  ``user_id``, ``device_id``, ``stream_id``, ``prev_id`` (the user's previous update in
  this window, else the newest ``device_lists_outbound_last_success`` at or before
  ``from_stream_id``, else ``[]``; a poke at or before ``from_stream_id`` that is still
  in the table counts too: it belongs to an earlier window read ahead and not yet
  acknowledged, which Synapse, reading a window only after the previous one's 200,
  never has), ``keys`` (the device's published keys from
  ``e2e_device_keys_json`` with the owner's cross-signatures from
  ``e2e_cross_signing_signatures`` merged into ``signatures``), ``device_display_name``
  only with ``allow_device_name_lookup_over_federation``, and ``deleted: true`` for a
  device that no longer exists (or is hidden);
* for a poke whose "device" is the user's current master or self-signing key (Synapse
  stores those keys as hidden devices named by the public key), one
  ``m.signing_key_update`` with ``master_key``/``self_signing_key`` as stored in
  ``e2e_cross_signing_keys``, plus the same content as ``org.matrix.signing_key_update``
  (the unstable twin Synapse still sends); these count twice against ``limit``.

The window's end (``upto``) is the stream id of the last poke taken; after the
destination answered 200 for every EDU of the window, :func:`mark_sent` deletes its
pokes ``<= upto`` and upserts ``device_lists_outbound_last_success`` per user, which is
what the next window's first ``prev_id`` is read from. :func:`mark_covered_sent` does
the same for the pokes of some EDUs only (a window split over several transactions).

``now_stream_id`` must be a position at which every poke is committed: the
``device_lists`` replication stream's token, as Synapse uses its stream token; a poke
above it may still be followed by a lower one committing late.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from federation_sender.model import DeviceListRow

log = logging.getLogger(__name__)

JsonDict = dict[str, Any]

DEVICE_LIST_UPDATE = "m.device_list_update"
SIGNING_KEY_UPDATE = "m.signing_key_update"
UNSTABLE_SIGNING_KEY_UPDATE = "org.matrix.signing_key_update"

Cover = tuple[str, str, int]
"""(user_id, device_id, stream_id): pokes of that device up to that id."""


@dataclass(frozen=True, slots=True)
class DeviceUpdate:
    edu_type: str
    content: JsonDict
    covers: tuple[Cover, ...]
    """The pokes this EDU stands for (both signing-key twins cover the same ones)."""


@dataclass(frozen=True, slots=True)
class DeviceUpdates:
    upto: int
    """How far the window reached: the next window starts after it. With no EDUs the
    position may move there at once; with EDUs only once all of them are delivered."""
    edus: list[DeviceUpdate] = field(default_factory=list)


_POKES = text(
    "SELECT user_id, device_id, stream_id, opentracing_context"
    " FROM device_lists_outbound_pokes"
    " WHERE destination = :destination AND :from_id < stream_id AND stream_id <= :now_id"
    " ORDER BY stream_id LIMIT :limit"
)
_CROSS_SIGNING_KEYS = text(
    "SELECT DISTINCT ON (user_id, keytype) user_id, keytype, keydata"
    " FROM e2e_cross_signing_keys"
    " WHERE user_id = ANY(:users) AND keytype IN ('master', 'self_signing')"
    " ORDER BY user_id, keytype, stream_id DESC"
)
_DEVICES = text(
    "SELECT d.user_id, d.device_id, d.display_name, k.key_json"
    " FROM devices d LEFT JOIN e2e_device_keys_json k USING (user_id, device_id)"
    " JOIN unnest(CAST(:users AS text[]), CAST(:devices AS text[])) AS q(user_id, device_id)"
    "   ON d.user_id = q.user_id AND d.device_id = q.device_id"
    " WHERE NOT d.hidden"
)
_SIGNATURES = text(
    "SELECT s.user_id, s.key_id, s.target_device_id, s.signature"
    " FROM e2e_cross_signing_signatures s"
    " JOIN unnest(CAST(:users AS text[]), CAST(:devices AS text[])) AS q(user_id, device_id)"
    "   ON s.target_user_id = q.user_id AND s.target_device_id = q.device_id"
    "   AND s.user_id = q.user_id"
)
_LAST_SUCCESS = text(
    "SELECT user_id, max(stream_id) FROM ("
    "  SELECT user_id, stream_id FROM device_lists_outbound_last_success"
    "  WHERE destination = :destination AND user_id = ANY(:users) AND stream_id <= :from_id"
    "  UNION ALL"
    "  SELECT user_id, stream_id FROM device_lists_outbound_pokes"
    "  WHERE destination = :destination AND user_id = ANY(:users) AND stream_id <= :from_id"
    ") AS sent GROUP BY user_id"
)
_DELETE_UPTO = text(
    "DELETE FROM device_lists_outbound_pokes"
    " WHERE destination = :destination AND stream_id <= :upto"
    " RETURNING user_id, stream_id"
)
_DELETE_COVERED = text(
    "DELETE FROM device_lists_outbound_pokes p"
    " USING unnest(CAST(:users AS text[]), CAST(:devices AS text[]), CAST(:ids AS bigint[]))"
    "   AS c(user_id, device_id, stream_id)"
    " WHERE p.destination = :destination AND p.user_id = c.user_id"
    "   AND p.device_id = c.device_id AND p.stream_id <= c.stream_id"
    " RETURNING p.user_id, p.stream_id"
)
_UPSERT_LAST_SUCCESS = text(
    "INSERT INTO device_lists_outbound_last_success (destination, user_id, stream_id)"
    " SELECT :destination, u, s FROM unnest(CAST(:users AS text[]), CAST(:ids AS bigint[]))"
    "   AS x(u, s)"
    " ON CONFLICT (destination, user_id) DO UPDATE SET stream_id = EXCLUDED.stream_id"
)
_DESTINATIONS_OF_USERS = text(
    "SELECT DISTINCT destination FROM device_lists_outbound_pokes WHERE user_id = ANY(:users)"
)
_DESTINATIONS_WITH_POKES = text(
    "SELECT DISTINCT destination FROM device_lists_outbound_pokes WHERE destination = ANY(:ds)"
)
_DESTINATIONS_AT = text(
    "SELECT DISTINCT destination FROM device_lists_outbound_pokes WHERE stream_id = :stream_id"
)


def _key_device_id(key_info: JsonDict) -> str | None:
    """The "device id" Synapse files a cross-signing key under: the part of its only
    key id after the algorithm (``get_verify_key_from_cross_signing_key``)."""
    keys = key_info.get("keys")
    if not isinstance(keys, dict) or len(keys) != 1:
        return None
    key_id = next(iter(keys))
    return key_id.split(":", 1)[1] if ":" in key_id else None


@dataclass(slots=True)
class _Window:
    """The pokes of one window grouped as Synapse groups them."""

    devices: dict[tuple[str, str], tuple[int, str | None]] = field(default_factory=dict)
    """(user, device) -> (newest stream id, its opentracing context)"""
    cross_signing: dict[str, JsonDict] = field(default_factory=dict)
    cross_covers: dict[str, dict[str, int]] = field(default_factory=dict)
    upto: int = 0


def _group(
    rows: Sequence[Any],
    from_stream_id: int,
    limit: int,
    master: dict[str, tuple[JsonDict, str]],
    self_signing: dict[str, tuple[JsonDict, str]],
) -> _Window:
    w = _Window(upto=from_stream_id)
    for user_id, device_id, stream_id, context in rows:
        budget = limit - (len(w.devices) + 2 * len(w.cross_signing))
        is_master = user_id in master and device_id == master[user_id][1]
        is_self = user_id in self_signing and device_id == self_signing[user_id][1]
        if (is_master or is_self) and user_id not in w.cross_signing and budget < 2:
            break  # two EDUs (the stable and the unstable type) do not fit
        if is_master or is_self:
            content = w.cross_signing.setdefault(user_id, {})
            if is_master:
                content["master_key"] = master[user_id][0]
            else:
                content["self_signing_key"] = self_signing[user_id][0]
            covers = w.cross_covers.setdefault(user_id, {})
            covers[device_id] = max(covers.get(device_id, 0), stream_id)
        else:
            key = (user_id, device_id)
            if key not in w.devices and budget < 1:
                break
            if stream_id > w.devices.get(key, (0, None))[0]:
                w.devices[key] = (stream_id, context)
        w.upto = stream_id
    return w


async def _cross_signing_keys(
    conn: AsyncConnection, users: list[str]
) -> tuple[dict[str, tuple[JsonDict, str]], dict[str, tuple[JsonDict, str]]]:
    master: dict[str, tuple[JsonDict, str]] = {}
    self_signing: dict[str, tuple[JsonDict, str]] = {}
    for user_id, keytype, keydata in await conn.execute(_CROSS_SIGNING_KEYS, {"users": users}):
        info = json.loads(keydata)
        device_id = _key_device_id(info) if isinstance(info, dict) else None
        if device_id is None:
            log.warning("ignoring a malformed %s cross-signing key of %s", keytype, user_id)
            continue
        (master if keytype == "master" else self_signing)[user_id] = (info, device_id)
    return master, self_signing


async def _device_keys(
    conn: AsyncConnection, wanted: Collection[tuple[str, str]]
) -> dict[tuple[str, str], tuple[str | None, JsonDict | None]]:
    """(display name, keys with the owner's cross-signatures) of every existing,
    visible device asked for (``get_e2e_device_keys_and_signatures``)."""
    users = [u for u, _ in wanted]
    devices = [d for _, d in wanted]
    found: dict[tuple[str, str], tuple[str | None, JsonDict | None]] = {}
    params = {"users": users, "devices": devices}
    for user_id, device_id, display_name, key_json in await conn.execute(_DEVICES, params):
        found[(user_id, device_id)] = (display_name, json.loads(key_json) if key_json else None)
    with_keys = [k for k, (_, keys) in found.items() if keys is not None]
    if with_keys:
        sig_params = {"users": [u for u, _ in with_keys], "devices": [d for _, d in with_keys]}
        for user_id, key_id, device_id, signature in await conn.execute(_SIGNATURES, sig_params):
            keys = found[(user_id, device_id)][1]
            assert keys is not None
            keys.setdefault("signatures", {}).setdefault(user_id, {})[key_id] = signature
    return found


def _device_edus(
    w: _Window,
    found: dict[tuple[str, str], tuple[str | None, JsonDict | None]],
    prev_ids: dict[str, int],
    allow_device_names: bool,
) -> list[DeviceUpdate]:
    by_user: dict[str, list[tuple[int, str, str | None]]] = {}
    for (user_id, device_id), (stream_id, context) in w.devices.items():
        by_user.setdefault(user_id, []).append((stream_id, device_id, context))
    out: list[DeviceUpdate] = []
    for user_id, updates in by_user.items():
        prev_id = prev_ids.get(user_id, 0)
        for stream_id, device_id, context in sorted(updates, key=lambda u: u[0]):
            content: JsonDict = {
                "user_id": user_id,
                "device_id": device_id,
                "prev_id": [prev_id] if prev_id else [],
                "stream_id": stream_id,
            }
            if context != "{}":
                content["org.matrix.opentracing_context"] = context
            prev_id = stream_id
            device = found.get((user_id, device_id))
            if device is None:
                content["deleted"] = True
            else:
                display_name, keys = device
                if keys:
                    content["keys"] = keys
                if allow_device_names and display_name:
                    content["device_display_name"] = display_name
            covers = ((user_id, device_id, stream_id),)
            out.append(DeviceUpdate(DEVICE_LIST_UPDATE, content, covers))
    return out


async def device_updates_by_remote(
    conn: AsyncConnection,
    destination: str,
    from_stream_id: int,
    now_stream_id: int,
    limit: int,
    *,
    allow_device_names: bool,
) -> DeviceUpdates:
    """The EDUs for ``destination``'s pokes in ``(from_stream_id, now_stream_id]``, at
    most ``limit`` of them."""
    if from_stream_id >= now_stream_id:
        return DeviceUpdates(max(from_stream_id, now_stream_id))
    params = {
        "destination": destination,
        "from_id": from_stream_id,
        "now_id": now_stream_id,
        "limit": limit,
    }
    rows = (await conn.execute(_POKES, params)).all()
    if not rows:
        return DeviceUpdates(now_stream_id)
    users = sorted({r[0] for r in rows})
    master, self_signing = await _cross_signing_keys(conn, users)
    w = _group(rows, from_stream_id, limit, master, self_signing)
    found = await _device_keys(conn, list(w.devices)) if w.devices else {}
    prev_ids: dict[str, int] = {}
    if w.devices:
        last = {"destination": destination, "users": users, "from_id": from_stream_id}
        prev_ids = {u: int(s) for u, s in await conn.execute(_LAST_SUCCESS, last)}
    edus = _device_edus(w, found, prev_ids, allow_device_names)
    for user_id, content in w.cross_signing.items():
        content["user_id"] = user_id
        covers = tuple((user_id, d, s) for d, s in w.cross_covers[user_id].items())
        edus.append(DeviceUpdate(SIGNING_KEY_UPDATE, content, covers))
        edus.append(DeviceUpdate(UNSTABLE_SIGNING_KEY_UPDATE, content, covers))
    return DeviceUpdates(w.upto, edus)


async def _record_success(
    conn: AsyncConnection, destination: str, deleted: Iterable[Any]
) -> None:
    newest: dict[str, int] = {}
    for user_id, stream_id in deleted:
        newest[user_id] = max(newest.get(user_id, 0), int(stream_id))
    if newest:
        await conn.execute(
            _UPSERT_LAST_SUCCESS,
            {"destination": destination, "users": list(newest), "ids": list(newest.values())},
        )


async def mark_sent(conn: AsyncConnection, destination: str, upto: int) -> None:
    """Every EDU of a window up to ``upto`` was delivered: delete its pokes and record
    the newest delivered stream id per user."""
    deleted = await conn.execute(_DELETE_UPTO, {"destination": destination, "upto": upto})
    await _record_success(conn, destination, deleted.all())


async def mark_covered_sent(
    conn: AsyncConnection, destination: str, covers: Collection[Cover]
) -> None:
    """Some EDUs were delivered: delete just the pokes they stand for."""
    if not covers:
        return
    params = {
        "destination": destination,
        "users": [c[0] for c in covers],
        "devices": [c[1] for c in covers],
        "ids": [c[2] for c in covers],
    }
    deleted = await conn.execute(_DELETE_COVERED, params)
    await _record_success(conn, destination, deleted.all())


async def destinations_for_token(conn: AsyncConnection, stream_id: int) -> list[str]:
    """Destinations poked at ``stream_id`` (a ``device_lists`` row with
    ``hosts_calculated``)."""
    rows = await conn.execute(_DESTINATIONS_AT, {"stream_id": stream_id})
    return sorted(str(r[0]) for r in rows)


async def destinations_for_users(conn: AsyncConnection, user_ids: Collection[str]) -> list[str]:
    """Destinations with pokes (unsent: sent ones are deleted) for these users."""
    rows = await conn.execute(_DESTINATIONS_OF_USERS, {"users": list(user_ids)})
    return sorted(str(r[0]) for r in rows)


async def destinations_with_pokes(
    conn: AsyncConnection, destinations: Collection[str]
) -> set[str]:
    """Those of ``destinations`` with any poke (sent ones are deleted), one statement."""
    if not destinations:
        return set()
    res = await conn.execute(_DESTINATIONS_WITH_POKES, {"ds": sorted(destinations)})
    return {str(r) for r in res.scalars()}


def _rows(updates: Iterable[DeviceUpdate]) -> list[DeviceListRow]:
    """The neutral outbox rows: one per EDU, acknowledged by one poke it covers (the
    signing-key twins by the first and the last: together they cover both keys)."""
    out: list[DeviceListRow] = []
    twin = 0
    for u in updates:
        if u.edu_type == DEVICE_LIST_UPDATE:
            user_id, device_id, stream_id = u.covers[0]
        else:
            user_id, device_id, stream_id = u.covers[0] if twin == 0 else u.covers[-1]
            twin ^= 1
        out.append(
            DeviceListRow(stream_id, user_id, device_id, json.dumps(u.content), u.edu_type)
        )
    return out


async def device_list_rows(
    conn: AsyncConnection,
    destination: str,
    after: int,
    now_stream_id: int,
    limit: int,
    *,
    allow_device_names: bool,
) -> list[DeviceListRow]:
    """The outbox reader's answer: windows of :func:`device_updates_by_remote` from
    ``after`` until ``limit`` EDUs are gathered or the pokes up to ``now_stream_id`` are
    all read. Fewer than ``limit`` rows means none are left (pokes of one device
    collapse into one EDU, so one window may give few); a cross-signing pair may take
    the count one past ``limit``."""
    position = max(after, 0)
    rows: list[DeviceListRow] = []
    while len(rows) < limit:
        budget = max(2, limit - len(rows))
        window = await device_updates_by_remote(
            conn, destination, position, now_stream_id, budget,
            allow_device_names=allow_device_names,
        )
        rows.extend(_rows(window.edus))
        if window.upto >= now_stream_id or window.upto <= position:
            break
        position = window.upto
    return rows


async def ack_device_list_rows(
    conn: AsyncConnection, destination: str, keys: Collection[tuple[int, str, str]]
) -> None:
    """The destination answered 200 for these rows' EDUs (keys as the queue gives
    them: (stream_id, user_id, device_id))."""
    await mark_covered_sent(conn, destination, [(u, d, s) for s, u, d in keys])
