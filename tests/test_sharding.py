from __future__ import annotations

import hashlib
from collections import Counter

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.config import ShardingSettings
from federation_sender.sharding import (
    HEARTBEAT,
    ShardCoordinator,
    lease_is_current,
    rendezvous_owner,
    static_owner,
)
from federation_sender.supervisor import Supervisor
from federation_sender.testing.clock import FakeClock
from federation_sender.testing.waiting import wait_until

DESTS = [f"server{i}.example.org" for i in range(200)]
DYNAMIC = ShardingSettings(mode="dynamic", heartbeat_interval_s=5.0, lease_s=30.0)


# --- pure rules -------------------------------------------------------------------------

def test_static_owner_is_synapses_rule() -> None:
    instances = ["fs1", "fs2", "fs3"]
    for d in DESTS[:50]:
        h = int.from_bytes(hashlib.sha256(d.encode()).digest(), "little")
        assert static_owner(d, instances) == instances[h % 3]
    with pytest.raises(ValueError):
        static_owner("a", [])


def test_rendezvous_is_balanced_and_moves_little() -> None:
    dests = [f"d{i}.org" for i in range(3000)]
    three = ["fs1", "fs2", "fs3"]
    before = {d: rendezvous_owner(d, three) for d in dests}
    shares = Counter(before.values())
    assert all(800 < c < 1200 for c in shares.values()), shares
    after = {d: rendezvous_owner(d, [*three, "fs4"]) for d in dests}
    moved = [d for d in dests if before[d] != after[d]]
    # Only destinations the newcomer wins move, about a quarter of them.
    assert all(after[d] == "fs4" for d in moved)
    assert 600 < len(moved) < 900
    # Removing an instance moves only its own destinations.
    without = {d: rendezvous_owner(d, ["fs1", "fs3"]) for d in dests}
    assert all(without[d] == before[d] for d in dests if before[d] != "fs2")
    assert rendezvous_owner("x", ["b", "a"]) == rendezvous_owner("x", ["a", "b"])


# --- single and static modes --------------------------------------------------------

async def test_single_mode_owns_everything_without_the_database(clock: FakeClock) -> None:
    c = ShardCoordinator(None, "fs1", clock, ShardingSettings())  # type: ignore[arg-type]
    await c.start()
    assert all(c.owns(d) for d in DESTS)
    assert await c.acquire_lease("a.org") == 0
    assert c.holds_lease("a.org", 0)
    await c.release("a.org")
    await c.stop()


async def test_static_mode_partitions_and_fences(engine: AsyncEngine, clock: FakeClock) -> None:
    settings = ShardingSettings(mode="static", instances=["fs1", "fs2"])
    a = ShardCoordinator(engine, "fs1", clock, settings)
    b = ShardCoordinator(engine, "fs2", clock, settings)
    await a.start()
    await b.start()
    try:
        for d in DESTS[:40]:
            assert a.owns(d) != b.owns(d)
            owner, other = (a, b) if a.owns(d) else (b, a)
            assert await owner.acquire_lease(d) == 1
            assert await other.acquire_lease(d) is None
    finally:
        await a.stop()
        await b.stop()
    with pytest.raises(ValueError):
        ShardCoordinator(engine, "fs9", clock, settings)


# --- dynamic mode --------------------------------------------------------------------

async def test_lease_lifecycle_and_monotonic_tokens(engine: AsyncEngine,
                                                    clock: FakeClock) -> None:
    c = ShardCoordinator(engine, "fs1", clock, DYNAMIC)
    await c.start()
    try:
        assert await c.acquire_lease("a.org") == 1
        assert await c.acquire_lease("a.org") == 1  # renewal keeps the token
        assert c.holds_lease("a.org", 1) and not c.holds_lease("a.org", 2)
        async with engine.connect() as conn:
            assert await lease_is_current(conn, "a.org", "fs1", 1)
        await c.release("a.org")
        assert not c.holds_lease("a.org")
        assert await c.acquire_lease("a.org") == 2  # a new tenure, a new token
        # Heartbeats renew it; without them it lapses by our own clock.
        clock.advance(25)
        await c.heartbeat_once()
        clock.advance(25)
        assert c.holds_lease("a.org")
        clock.advance(10)
        assert not c.holds_lease("a.org")
    finally:
        await c.stop()


async def started(engine: AsyncEngine, clock: FakeClock, name: str,
                  seen: list[frozenset[str]] | None = None,
                  supervisor: Supervisor | None = None) -> ShardCoordinator:
    c = ShardCoordinator(engine, name, clock, DYNAMIC,
                         on_membership_change=(seen.append if seen is not None else None))
    await c.start(supervisor)
    return c


async def test_two_instances_share_destinations_without_overlap(
        pg_engine: AsyncEngine, clock: FakeClock) -> None:
    seen: list[frozenset[str]] = []
    a = await started(pg_engine, clock, "fs1", seen)
    b = await started(pg_engine, clock, "fs2")
    try:
        await a.heartbeat_once()
        assert a.live_instances == b.live_instances == {"fs1", "fs2"}
        assert seen == [frozenset({"fs1", "fs2"})]
        mine_a = {d for d in DESTS if a.owns(d)}
        mine_b = {d for d in DESTS if b.owns(d)}
        assert mine_a.isdisjoint(mine_b) and mine_a | mine_b == set(DESTS)
        assert 60 < len(mine_a) < 140
        for d in DESTS:
            owner, other = (a, b) if d in mine_a else (b, a)
            assert await owner.acquire_lease(d) == 1
            assert await other.acquire_lease(d) is None
        assert sorted(a.held_destinations()) == sorted(mine_a)
    finally:
        await a.stop()
        await b.stop()


async def test_leaving_instance_hands_over_at_once(pg_engine: AsyncEngine,
                                                   clock: FakeClock) -> None:
    seen: list[frozenset[str]] = []
    a = await started(pg_engine, clock, "fs1", seen)
    b = await started(pg_engine, clock, "fs2")
    await a.heartbeat_once()
    mine_b = [d for d in DESTS if b.owns(d)]
    for d in mine_b:
        assert await b.acquire_lease(d) == 1
    try:
        await b.stop()
        await a.heartbeat_once()
        assert a.live_instances == {"fs1"}
        assert seen[-1] == frozenset({"fs1"})
        assert all(a.owns(d) for d in DESTS)
        for d in mine_b:
            assert await a.acquire_lease(d) == 2  # released: no waiting, new token
        async with pg_engine.connect() as conn:
            assert not await lease_is_current(conn, mine_b[0], "fs2", 1)
            assert await lease_is_current(conn, mine_b[0], "fs1", 2)
    finally:
        await a.stop()


async def test_crashed_instance_is_fenced_out_after_the_lease(pg_engine: AsyncEngine,
                                                              clock: FakeClock) -> None:
    a = await started(pg_engine, clock, "fs1")
    b_tasks = Supervisor(clock)
    b = await started(pg_engine, clock, "fs2", supervisor=b_tasks)
    await a.heartbeat_once()
    d = next(x for x in DESTS if b.owns(x))
    assert await b.acquire_lease(d) == 1
    # fs2 stops heartbeating (a crash, a long pause); fs1 keeps going.
    assert b_tasks.names() == [HEARTBEAT]
    await b_tasks.stop(HEARTBEAT)
    for _ in range(5):
        clock.advance(5)
        await a.heartbeat_once()
    assert a.live_instances == {"fs2", "fs1"}  # 25 s of silence: still live
    assert await a.acquire_lease(d) is None  # not ours yet
    for _ in range(2):
        clock.advance(5)
        await a.heartbeat_once()
    assert a.live_instances == {"fs1"}
    assert await a.acquire_lease(d) == 2
    # The paused holder no longer trusts its lease, and its token is refused.
    assert not b.holds_lease(d, 1)
    async with pg_engine.connect() as conn:
        assert not await lease_is_current(conn, d, "fs2", 1)
    await a.stop()


async def test_joining_instance_waits_for_the_old_lease(pg_engine: AsyncEngine,
                                                        clock: FakeClock) -> None:
    a = await started(pg_engine, clock, "fs1")
    for d in DESTS:
        assert await a.acquire_lease(d) == 1
    b = await started(pg_engine, clock, "fs2")
    await a.heartbeat_once()
    moved = [d for d in DESTS if b.owns(d)]
    assert moved and not any(a.owns(d) for d in moved)
    # fs1 no longer renews the moved leases; fs2 must wait until they lapse.
    assert await b.acquire_lease(moved[0]) is None
    for _ in range(7):
        clock.advance(5)
        await a.heartbeat_once()
        await b.heartbeat_once()
    assert not any(a.holds_lease(d) for d in moved)
    assert all(a.holds_lease(d) for d in DESTS if d not in moved)
    assert await b.acquire_lease(moved[0]) == 2
    # A lease released by the old owner's queue is available at once.
    await a.stop()
    await b.stop()


async def test_heartbeat_loop_runs_on_the_clock(pg_engine: AsyncEngine,
                                                clock: FakeClock) -> None:
    seen: list[frozenset[str]] = []
    a = await started(pg_engine, clock, "fs1", seen)
    b = await started(pg_engine, clock, "fs2")
    try:
        await wait_until(lambda: clock.pending_sleepers, "both heartbeat loops on the clock",
                         accept=lambda n: n >= 2, timeout_s=2)
        clock.advance(5)
        await wait_until(lambda: seen, "a membership change", timeout_s=3)
        assert seen == [frozenset({"fs1", "fs2"})]
    finally:
        await a.stop()
        await b.stop()
