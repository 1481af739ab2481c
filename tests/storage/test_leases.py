"""Destination leases are fenced: a takeover only after expiry, with a higher token that
the old holder's writes then fail to match; released rows keep their token (SQLite and
PostgreSQL)."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.storage import leases


async def test_a_lease_is_taken_over_only_after_expiry_with_a_higher_token(
    engine: AsyncEngine,
) -> None:
    async with engine.begin() as c:
        assert await leases.take_lease(c, "d.test", "w1", now_ms=0, until_ms=100) == 1
        assert await leases.take_lease(c, "d.test", "w2", now_ms=50, until_ms=150) is None
        assert await leases.take_lease(c, "d.test", "w1", now_ms=60, until_ms=200) == 1
        assert await leases.take_lease(c, "d.test", "w2", now_ms=199, until_ms=300) is None
        assert await leases.take_lease(c, "d.test", "w2", now_ms=201, until_ms=300) == 2
        assert not await leases.lease_is_current(c, "d.test", "w1", 1)
        assert await leases.lease_is_current(c, "d.test", "w2", 2)
        assert await leases.held_leases(c, "w2") == {"d.test": 2}
        assert await leases.held_leases(c, "w1") == {}


async def test_released_and_left_leases_are_free_but_keep_their_token(
    engine: AsyncEngine,
) -> None:
    async with engine.begin() as c:
        assert await leases.take_lease(c, "a.test", "w1", now_ms=0, until_ms=10_000) == 1
        assert await leases.take_lease(c, "b.test", "w1", now_ms=0, until_ms=10_000) == 1
        await leases.release_lease(c, "a.test", "w1", 1)
        assert await leases.take_lease(c, "a.test", "w2", now_ms=1, until_ms=10_000) == 2
        assert await leases.heartbeat(c, "w1", now_ms=1, live_after_ms=0,
                                      reap_before_ms=0) == {"w1"}
        assert await leases.heartbeat(c, "w2", now_ms=2, live_after_ms=0,
                                      reap_before_ms=0) == {"w1", "w2"}
        await leases.leave(c, "w1")
        assert await leases.held_leases(c, "w1") == {}
        assert await leases.take_lease(c, "b.test", "w2", now_ms=3, until_ms=10_000) == 2
        assert await leases.heartbeat(c, "w2", now_ms=4, live_after_ms=0,
                                      reap_before_ms=0) == {"w2"}
