"""Which servers receive an event, computed as Synapse's federation sender computes it.

For each sendable event (``federation/sender/__init__.py:handle_event`` in Synapse):

1. no ``prev_events`` (a room's create event): nobody;
2. a partial-state room: the servers in the room when we joined it
   (``partial_state_rooms_servers``);
3. Synapse's Redis external cache, which main fills for every event it creates in a
   full-state room: ``cache_v1:event_to_prev_state_group:<event_id>`` gives the state
   group before the event, ``cache_v1:get_joined_hosts:<group>`` its joined hosts
   (entries live one hour);
4. otherwise the joined hosts of the state *before* the event: the state groups of its
   prev events (``event_to_state_groups``), each expanded along ``state_group_edges``
   over ``state_groups_state`` to its ``m.room.member`` events, kept where
   ``room_memberships`` says ``join``. Several prev events: the **union** of their
   groups' hosts, where Synapse resolves the groups' state first (a superset of its
   answer; docs/synapse-reference.md). A state group never changes, so its hosts are cached
   forever (LRU-bounded), whichever source (Redis or the database) gave them;
5. a leave by someone else whose auth events hold an invite for the target (a
   rescinded invite) also goes to the invitee's server;
6. minus the server a relayed join was made through (``send_on_behalf_of``: it has the
   event), minus servers outside ``federation_domain_whitelist``.

Our own server may be in the answer; the intake removes it and applies the shard.
"""

from __future__ import annotations

import json
import logging
import sys
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from sqlalchemy import bindparam, select, text
from sqlalchemy.ext.asyncio import AsyncConnection

from federation_sender.ids import server_of
from federation_sender.model import EventRow
from federation_sender.storage.synapse.schema import (
    event_to_state_groups,
    partial_state_rooms_servers,
    room_memberships,
)

log = logging.getLogger(__name__)


class ExternalCache(Protocol):
    """Synapse's Redis external cache, read-only
    (``synapse/replication/tcp/external_cache.py``)."""

    async def get_many(self, cache_name: str, keys: Sequence[str]) -> list[Any | None]:
        """The decoded JSON values (None where absent or unreadable)."""
        ...


class RedisExternalCache:
    """:class:`ExternalCache` over a redis client; any Redis failure reads as misses."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.failures = 0

    async def get_many(self, cache_name: str, keys: Sequence[str]) -> list[Any | None]:
        if not keys:
            return []
        try:
            raw = await self._client.mget([f"cache_v1:{cache_name}:{k}" for k in keys])
        except Exception as e:  # redis errors of every kind: fall back to the database
            self.failures += 1
            if self.failures == 1 or self.failures % 1000 == 0:
                log.warning("Synapse's external cache is unreadable (%s); using the database", e)
            return [None] * len(keys)
        out: list[Any | None] = []
        for v in raw:
            try:
                out.append(None if v is None else json.loads(v))
            except ValueError:
                out.append(None)
        return out


@dataclass
class StateGroupHostsCache:
    """state group -> its joined hosts; groups are immutable, so entries never go stale.

    Bounded by the number of groups and by the hosts they hold in total (a group of a
    room with thousands of servers weighs thousands). Consecutive groups of a room
    usually have the same hosts (most state changes are not joins of a new server), so
    an entry equal to the one cached last for another group shares its set, and host
    names are interned: memory follows distinct sets, not groups."""

    max_groups: int = 50_000
    max_hosts: int = 2_000_000
    _groups: OrderedDict[int, frozenset[str]] = field(default_factory=OrderedDict)
    _last: frozenset[str] = frozenset()
    _total_hosts: int = 0
    hits: int = 0
    misses: int = 0

    def get(self, group: int) -> frozenset[str] | None:
        hosts = self._groups.get(group)
        if hosts is not None:
            self._groups.move_to_end(group)
        return hosts

    def put(self, group: int, hosts: frozenset[str]) -> frozenset[str]:
        """Cache ``hosts`` for ``group``; returns the set kept (possibly a shared one)."""
        if hosts == self._last:
            hosts = self._last
        else:
            hosts = frozenset(map(sys.intern, hosts))
            self._last = hosts
        old = self._groups.pop(group, None)
        if old is not None:
            self._total_hosts -= len(old)
        self._groups[group] = hosts
        self._total_hosts += len(hosts)
        while len(self._groups) > 1 and (
            len(self._groups) > self.max_groups or self._total_hosts > self.max_hosts
        ):
            _, evicted = self._groups.popitem(last=False)
            self._total_hosts -= len(evicted)
        return hosts

    def __len__(self) -> int:
        return len(self._groups)


# Each group's membership state: the nearest row per state key along its delta chain.
_GROUP_HOSTS = text(
    """
    WITH RECURSIVE chain(root, sg, depth) AS (
        SELECT g, g, 0 FROM unnest(CAST(:groups AS BIGINT[])) AS g
        UNION ALL
        SELECT c.root, e.prev_state_group, c.depth + 1
        FROM state_group_edges e JOIN chain c ON e.state_group = c.sg
    ),
    members AS (
        SELECT DISTINCT ON (c.root, s.state_key) c.root, s.state_key, s.event_id
        FROM state_groups_state s JOIN chain c ON s.state_group = c.sg
        WHERE s.type = 'm.room.member'
        ORDER BY c.root, s.state_key, c.depth
    )
    SELECT DISTINCT m.root, substring(m.state_key FROM '@[^:]*:(.*)$')
    FROM members m JOIN room_memberships r ON r.event_id = m.event_id
    WHERE r.membership = 'join'
    """
)

_CURRENT_HOSTS = text(
    """
    SELECT DISTINCT room_id, substring(state_key FROM '@[^:]*:(.*)$')
    FROM current_state_events
    WHERE type = 'm.room.member' AND membership = 'join'
      AND room_id = ANY(CAST(:rooms AS TEXT[]))
    """
)


async def group_hosts(
    conn: AsyncConnection, groups: Collection[int], cache: StateGroupHostsCache
) -> dict[int, frozenset[str]]:
    """The joined hosts of each state group (one query for all uncached groups)."""
    out: dict[int, frozenset[str]] = {}
    missing: list[int] = []
    for g in groups:
        hit = cache.get(g)
        if hit is None:
            missing.append(g)
        else:
            out[g] = hit
            cache.hits += 1
    if missing:
        cache.misses += len(missing)
        found: dict[int, set[str]] = {g: set() for g in missing}
        for root, host in await conn.execute(_GROUP_HOSTS, {"groups": missing}):
            if host:
                found[int(root)].add(str(host))
        for g, hosts in found.items():
            out[g] = cache.put(g, frozenset(hosts))
    return out


async def current_hosts(
    conn: AsyncConnection, room_ids: Collection[str]
) -> dict[str, frozenset[str]]:
    """Servers joined to each room now (Synapse's ``get_current_hosts_in_room``)."""
    found: dict[str, set[str]] = {r: set() for r in room_ids}
    if room_ids:
        for room, host in await conn.execute(_CURRENT_HOSTS, {"rooms": list(room_ids)}):
            if host:
                found[str(room)].add(str(host))
    return {r: frozenset(h) for r, h in found.items()}


async def partial_state_servers(
    conn: AsyncConnection, rooms: Collection[str]
) -> dict[str, frozenset[str]]:
    """The servers in each partial-state room at our join
    (``partial_state_rooms_servers``); rooms not partial-state are absent."""
    if not rooms:
        return {}
    t = partial_state_rooms_servers
    res = await conn.execute(
        select(t.c.room_id, t.c.server_name).where(t.c.room_id.in_(list(rooms)))
    )
    found: dict[str, set[str]] = {}
    for room, server in res:
        found.setdefault(str(room), set()).add(str(server))
    return {r: frozenset(s) for r, s in found.items()}


@dataclass(frozen=True, slots=True)
class _Parsed:
    event: EventRow
    prev_events: tuple[str, ...]
    auth_events: tuple[str, ...]
    membership: str | None


def _parse(e: EventRow) -> _Parsed:
    try:
        pdu = json.loads(e.json)
    except ValueError:
        pdu = {}
    prev = pdu.get("prev_events") if isinstance(pdu, dict) else None
    auth = pdu.get("auth_events") if isinstance(pdu, dict) else None
    content = pdu.get("content") if isinstance(pdu, dict) else None
    membership = content.get("membership") if isinstance(content, dict) else None
    return _Parsed(
        e,
        tuple(p for p in prev if isinstance(p, str)) if isinstance(prev, list) else (),
        tuple(a for a in auth if isinstance(a, str)) if isinstance(auth, list) else (),
        membership if isinstance(membership, str) else None,
    )


def _is_leave_by_other(p: _Parsed) -> bool:
    e = p.event
    return (
        e.type == "m.room.member"
        and p.membership == "leave"
        and e.state_key is not None
        and e.sender != e.state_key
    )


class SynapseHostsReader:
    """Implements :class:`federation_sender.storage.protocols.RoomHostsReader`."""

    __slots__ = ("_allowed", "_c", "_external", "_groups")

    def __init__(
        self,
        conn: AsyncConnection,
        groups: StateGroupHostsCache,
        external: ExternalCache | None,
        domain_allowed: Callable[[str], bool],
    ) -> None:
        self._c = conn
        self._groups = groups
        self._external = external
        self._allowed = domain_allowed

    async def current_hosts(self, room_ids: Collection[str]) -> dict[str, frozenset[str]]:
        return await current_hosts(self._c, room_ids)

    async def hosts_for_events(
        self, events: Mapping[str, Sequence[EventRow]]
    ) -> dict[str, list[frozenset[str]]]:
        parsed = {room: [_parse(e) for e in evs] for room, evs in events.items()}
        partial = await self._partial_servers(list(parsed))
        need = [
            p for room, ps in parsed.items() if room not in partial for p in ps if p.prev_events
        ]
        before = await self._hosts_before(need)
        rescinded = await self._rescinded_invitees(
            [p for ps in parsed.values() for p in ps if _is_leave_by_other(p)]
        )
        # Events between two state changes share one hosts set: the adjustments below
        # are made once per (set, extra, dropped), not once per event and host.
        done: dict[tuple[int, str | None, str | None], frozenset[str]] = {}
        canon: dict[frozenset[str], frozenset[str]] = {}
        empty: frozenset[str] = frozenset()
        out: dict[str, list[frozenset[str]]] = {}
        for room, ps in parsed.items():
            answers: list[frozenset[str]] = []
            for p in ps:
                e = p.event
                if not p.prev_events:
                    hosts = empty
                elif room in partial:
                    hosts = partial[room]
                else:
                    hosts = before.get(e.event_id, empty)
                key = (id(hosts), rescinded.get(e.event_id), e.send_on_behalf_of)
                final = done.get(key)
                if final is None:
                    final = self._adjust(hosts, key[1], key[2])
                    done[key] = final = canon.setdefault(final, final)
                answers.append(final)
            out[room] = answers
        return out

    def _adjust(
        self, hosts: frozenset[str], extra: str | None, dropped: str | None
    ) -> frozenset[str]:
        """Steps 5 and 6: plus a rescinded invitee, minus the relaying server and the
        servers outside the whitelist."""
        if extra is None and dropped is None and all(map(self._allowed, hosts)):
            return hosts
        return frozenset(
            d
            for d in (hosts | {extra} if extra is not None else hosts)
            if d != dropped and self._allowed(d)
        )

    async def _partial_servers(self, rooms: list[str]) -> dict[str, frozenset[str]]:
        return await partial_state_servers(self._c, rooms)

    async def _hosts_before(self, need: Sequence[_Parsed]) -> dict[str, frozenset[str]]:
        """event id -> hosts of the state before it (steps 3 and 4)."""
        out: dict[str, frozenset[str]] = {}
        if not need:
            return out
        rest = list(need)
        if self._external is not None:
            rest = await self._from_external_cache(need, out)
        if not rest:
            return out
        prevs = {pid for p in rest for pid in p.prev_events}
        sg_of = await _state_groups_of(self._c, prevs)
        groups = await group_hosts(self._c, set(sg_of.values()), self._groups)
        fallback: list[_Parsed] = []
        for p in rest:
            gs = {sg_of[pid] for pid in p.prev_events if pid in sg_of}
            if not gs:
                fallback.append(p)
                continue
            hosts = frozenset().union(*(groups[g] for g in gs)) if len(gs) > 1 else groups[gs.pop()]
            out[p.event.event_id] = hosts
        if fallback:
            log.info(
                "%d events have no prev event with a state group; using current hosts",
                len(fallback),
            )
            cur = await current_hosts(self._c, {p.event.room_id for p in fallback})
            for p in fallback:
                out[p.event.event_id] = cur[p.event.room_id]
        return out

    async def _from_external_cache(
        self, need: Sequence[_Parsed], out: dict[str, frozenset[str]]
    ) -> list[_Parsed]:
        assert self._external is not None
        sgs = await self._external.get_many(
            "event_to_prev_state_group", [p.event.event_id for p in need]
        )
        by_group: dict[int, list[_Parsed]] = {}
        rest: list[_Parsed] = []
        for p, sg in zip(need, sgs, strict=True):
            if isinstance(sg, int) and not isinstance(sg, bool) and sg > 0:
                by_group.setdefault(sg, []).append(p)
            else:
                rest.append(p)
        unknown = [g for g in by_group if self._groups.get(g) is None]
        hosts_lists = await self._external.get_many("get_joined_hosts", [str(g) for g in unknown])
        for g, hl in zip(unknown, hosts_lists, strict=True):
            if isinstance(hl, list) and all(isinstance(h, str) for h in hl):
                self._groups.put(g, frozenset(hl))
        for g, ps in by_group.items():
            hosts = self._groups.get(g)
            if hosts is None:
                rest.extend(ps)
                continue
            for p in ps:
                out[p.event.event_id] = hosts
        return rest

    async def _rescinded_invitees(self, leaves: Sequence[_Parsed]) -> dict[str, str]:
        """event id -> invitee's server, for leaves that rescind an invite."""
        if not leaves:
            return {}
        rm = room_memberships
        auth_ids = {a for p in leaves for a in p.auth_events}
        res = await self._c.execute(
            select(rm.c.event_id, rm.c.user_id).where(
                rm.c.event_id.in_(list(auth_ids)), rm.c.membership == "invite"
            )
        )
        invites = {(str(eid), str(uid)) for eid, uid in res}
        out: dict[str, str] = {}
        for p in leaves:
            target = p.event.state_key
            if target is not None and any((a, target) in invites for a in p.auth_events):
                out[p.event.event_id] = server_of(target)
        return out


_SG_OF = select(event_to_state_groups.c.event_id, event_to_state_groups.c.state_group).where(
    event_to_state_groups.c.event_id.in_(bindparam("ids", expanding=True))
)


async def _state_groups_of(conn: AsyncConnection, event_ids: Collection[str]) -> dict[str, int]:
    if not event_ids:
        return {}
    res = await conn.execute(_SG_OF, {"ids": list(event_ids)})
    return {str(eid): int(sg) for eid, sg in res}
