"""Fault profiles: text form, validation, deterministic choice, the demo mix."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Coroutine
from typing import Any

import pytest

from federation_sender.sim.check import DeliveryReport, wait_for_delivery
from federation_sender.sim.expected import ExpectedEvent, Oracle
from federation_sender.sim.remotes import RemoteRecord
from federation_sender.testing.clock import FakeClock
from federation_sender.testing.faults import (
    ARCHETYPES,
    Fault,
    FaultProfile,
    choose_fault,
    varied_profiles,
)


def test_parse_and_describe_round_trip() -> None:
    spec = "down=30-90+200-260,max_body=65536,slow=0.5,errors=0.1,hang=0.02,reset=0.05"
    profile = FaultProfile.parse(spec)
    assert profile.down == ((30.0, 90.0), (200.0, 260.0))
    assert profile.max_body_bytes == 65536
    assert (profile.slow_s, profile.error_rate, profile.hang_rate) == (0.5, 0.1, 0.02)
    assert FaultProfile.parse(profile.describe()) == profile
    assert FaultProfile.parse("") == FaultProfile()
    assert FaultProfile().describe() == "healthy"
    for archetype in ARCHETYPES:
        assert FaultProfile.parse(archetype.describe()) == archetype


@pytest.mark.parametrize(
    "spec", ["errors=2", "down=5-1", "down=7", "bogus=1", "slow", "max_body=big"]
)
def test_parse_rejects_bad_specs(spec: str) -> None:
    with pytest.raises(ValueError):
        FaultProfile.parse(spec)


def test_down_windows() -> None:
    p = FaultProfile(down=((10.0, 20.0),))
    assert [p.is_down_at(t) for t in (0, 9.9, 10, 19.9, 20)] == [False, False, True, True, False]


def test_choose_fault_is_deterministic_and_follows_rates() -> None:
    profile = FaultProfile(error_rate=0.2, reset_rate=0.1, garbage_rate=0.05)

    def draw(seed: int) -> list[Fault]:
        rng = random.Random(seed)
        return [choose_fault(profile, rng, 100) for _ in range(5000)]

    first = draw(1)
    assert first == draw(1)
    assert first != draw(2)
    counts = Counter(first)
    assert abs(counts[Fault.RESET] / 5000 - 0.1) < 0.02
    # ERROR is drawn only when RESET did not hit: 0.9 * 0.2.
    assert abs(counts[Fault.ERROR] / 5000 - 0.18) < 0.025
    assert counts[Fault.HANG] == counts[Fault.TOO_LARGE] == 0


def test_adding_a_fault_does_not_reshuffle_the_others() -> None:
    base = FaultProfile(error_rate=0.3)
    more = FaultProfile(error_rate=0.3, garbage_rate=0.3)
    a = [choose_fault(base, r, None) for r in [random.Random(5)] for _ in range(500)]
    b = [choose_fault(more, r, None) for r in [random.Random(5)] for _ in range(500)]
    assert [x is Fault.ERROR for x in a] == [x is Fault.ERROR for x in b]


def test_size_limit_uses_content_length() -> None:
    p = FaultProfile(max_body_bytes=1000)
    rng = random.Random(0)
    assert choose_fault(p, rng, 1001) is Fault.TOO_LARGE
    assert choose_fault(p, rng, 1000) is Fault.NONE
    assert choose_fault(p, rng, None) is Fault.NONE  # checked after reading instead


def test_varied_profiles() -> None:
    names = [f"r{i}.test" for i in range(20)]
    profiles = varied_profiles(names, rng=random.Random(3), outage=(30.0, 600.0))
    assert profiles["r0.test"] == FaultProfile(down=((30.0, 600.0),))
    faulty = [n for n in names[1:] if not profiles[n].is_healthy]
    assert len(faulty) == round(19 * 0.5)
    assert {profiles[n] for n in faulty} == set(ARCHETYPES)
    assert profiles == varied_profiles(names, rng=random.Random(3), outage=(30.0, 600.0))


async def test_wait_for_delivery_polls_until_ok(clock: FakeClock) -> None:
    oracle = Oracle()
    ev = ExpectedEvent(1, "$e", "!r:us.test")
    oracle.events_by_id[ev.event_id] = ev
    dest = oracle._dest("a.test")
    dest.should_receive.append(ev)
    dest.latest[ev.room_id] = ev
    record = RemoteRecord()
    task = asyncio.create_task(
        wait_for_delivery(oracle, lambda: {"a.test": record}, clock, timeout_s=10, poll_s=1)
    )
    await clock.advance_and_settle(3)
    assert not task.done()
    record.pdu_counts["$e"] = 1
    await clock.advance_and_settle(1)
    assert task.done() and task.result().ok

    never = await asyncio.wait_for(
        _advancing(wait_for_delivery(oracle, lambda: {}, clock, timeout_s=5), clock), 5
    )
    assert not never.ok


async def _advancing(coro: Coroutine[Any, Any, DeliveryReport], clock: FakeClock) -> DeliveryReport:
    task = asyncio.ensure_future(coro)
    while not task.done():
        await clock.advance_and_settle(1)
    return task.result()
