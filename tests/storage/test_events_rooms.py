from __future__ import annotations

import random

from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.queue.core.catchup import server_joined_at
from federation_sender.storage import events as ev
from federation_sender.storage import hosts as rm
from federation_sender.storage import membership_history as mh
from federation_sender.testing.queue_writer import HomeserverWriter


async def test_event_reads(engine: AsyncEngine) -> None:
    w = HomeserverWriter(engine)
    await w.join("!a:l", "@u:l")
    a = await w.messages("!a:l", "@u:l", 5)
    await w.join("!b:l", "@u:l")
    b = await w.messages("!b:l", "@u:l", 2)
    await w.mark_partial_state("!b:l")
    async with engine.begin() as conn:
        assert await ev.max_stream_ordering(conn) == w.stream_ordering
        got = await ev.events_after(conn, 2, 6, 3)
        assert [e.stream_ordering for e in got] == [3, 4, 5]
        between = await ev.room_events_between(conn, ["!a:l", "!b:l"], 1, 100, 3)
        assert [e.stream_ordering for e in between["!a:l"]] == [2, 3, 4]
        assert [e.event_id for e in between["!b:l"]] == [
            f"${b[0].stream_ordering - 1}-b:l", b[0].event_id, b[1].event_id]
        ext = await ev.forward_extremities(conn, ["!a:l", "!b:l"])
        assert [e.event_id for e in ext["!a:l"]] == [a[-1].event_id]
        assert await ev.partial_state(conn, ["!a:l", "!b:l"]) == {"!b:l"}
        at = await ev.events_at(conn, [a[0].stream_ordering, 999])
        assert list(at) == [a[0].stream_ordering]
    await w.purge_room("!a:l")
    async with engine.begin() as conn:
        assert await ev.rooms_with_events(conn, ["!a:l", "!b:l"]) == {"!b:l"}


async def test_hosts_cache_agrees_with_uncached_replay(engine: AsyncEngine) -> None:
    rng = random.Random(5)
    w = HomeserverWriter(engine)
    users = [f"@u{i}:s{i % 4}" for i in range(12)]
    positions: list[int] = []
    for _ in range(80):
        u = rng.choice(users)
        e = await w.membership("!r:l", u, rng.choice(["join", "join", "leave", "ban", "invite"]))
        positions.append(e.stream_ordering)
        if rng.random() < 0.3:
            positions.append((await w.message("!r:l", "@x:l")).stream_ordering)
    cache = rm.RoomHostsCache()
    async with engine.begin() as conn:
        # Asked in increasing chunks, as the intake does, plus one step back.
        for chunk_start in range(0, len(positions), 17):
            chunk = positions[chunk_start:chunk_start + 17]
            got = (await cache.hosts_for_events(conn, {"!r:l": chunk}))["!r:l"]
            for so, hosts in zip(chunk, got, strict=True):
                assert hosts == await rm.joined_servers_at(conn, "!r:l", so), so
        back = positions[:3]
        got = (await cache.hosts_for_events(conn, {"!r:l": back}))["!r:l"]
        assert got == [await rm.joined_servers_at(conn, "!r:l", so) for so in back]
        hist = (await mh.server_membership_history(conn, "s1", ["!r:l"]))["!r:l"]
        for so in positions:
            assert server_joined_at(hist, so) == ("s1" in await rm.joined_servers_at(
                conn, "!r:l", so))
    assert cache.hits > 0


def test_membership_state_counts_servers() -> None:
    st = rm.MembershipState()
    st.apply(rm.MembershipRow(1, "@a:x", "x", "join"))
    st.apply(rm.MembershipRow(2, "@b:x", "x", "join"))
    st.apply(rm.MembershipRow(3, "@a:x", "x", "leave"))
    assert st.joined_servers() == {"x"}
    st.apply(rm.MembershipRow(4, "@b:x", "x", "ban"))
    assert st.joined_servers() == frozenset()
