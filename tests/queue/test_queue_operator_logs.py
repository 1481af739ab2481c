"""What an operator reads in the queue's INFO lines: how many destinations start in
catch-up, and a destination woken by another process's signal (main's retry-timings
invalidation, ``REMOTE_SERVER_UP``), rate-limited. Real HTTP, fake clock."""

from __future__ import annotations

import logging

import pytest

from federation_sender.queue.destination import DestinationState
from federation_sender.queue.wakelog import WakeLog
from federation_sender.storage import destinations as dst
from federation_sender.testing.clock import FakeClock
from federation_sender.testing.queue_harness import ALICE, Harness, room_with

D = "r1.test"
MANAGER = "federation_sender.queue.manager"


def infos(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [
        r.getMessage() for r in caplog.records
        if r.name == MANAGER and r.levelno == logging.INFO and text in r.getMessage()
    ]  # fmt: skip


async def test_start_logs_how_many_destinations_start_in_catch_up(
    h: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=MANAGER)
    await room_with(h, "!a:l", D, "r2.test")
    await h.start()
    assert infos(caplog, "in catch-up at start") == [
        "destinations in catch-up at start: 0 (events owed to them were recorded before "
        "the last stop)"
    ]
    h.fake.behave(D, status=503)
    h.fake.behave("r2.test", status=503)
    await h.writer.message("!a:l", ALICE)
    h.poke()
    await h.settle()
    await h.m.stop(0.0)
    caplog.clear()
    await h.start()
    assert infos(caplog, "in catch-up at start") == [
        "destinations in catch-up at start: 2 (events owed to them were recorded before "
        "the last stop): r1.test, r2.test"
    ]


async def backing_off(h: Harness) -> None:
    await room_with(h, "!a:l", D)
    await h.start()
    h.fake.behave(D, status=503)
    await h.writer.message("!a:l", ALICE)
    h.poke()
    await h.settle()
    assert h.m.status(D).state is DestinationState.BACKING_OFF  # type: ignore[union-attr]
    h.fake.behave(D)


async def test_remote_server_up_wake_is_logged(
    h: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=MANAGER)
    await backing_off(h)
    await h.m.remote_server_up(D)
    await h.settle()
    assert infos(caplog, "woken") == [f"destination {D} woken: REMOTE_SERVER_UP"]


async def test_invalidation_wake_is_logged_once_and_not_when_nothing_woke(
    h: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=MANAGER)
    await backing_off(h)
    await h.m.retry_timings_changed(D)  # the row still holds it back: nothing woken
    assert infos(caplog, "woken") == []
    async with h.engine.begin() as conn:  # as main does when the server contacts it
        await dst.set_retry_timings(conn, D, None, 0, 0)
    await h.m.retry_timings_changed(D)
    await h.settle()
    assert len(h.fake.accepted(D)) == 1
    assert infos(caplog, "woken") == [
        f"destination {D} woken: its retry timings were cleared by another process "
        "(get_destination_retry_timings invalidated)"
    ]
    await h.m.retry_timings_changed(D)  # sending normally: nothing to wake
    assert len(infos(caplog, "woken")) == 1


def test_wake_lines_are_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=MANAGER)
    clock = FakeClock()
    wakes = WakeLog(clock, burst=3, window_s=60.0)
    for i in range(10):
        wakes.woken(f"d{i}.test", "REMOTE_SERVER_UP")
    assert infos(caplog, "woken") == [
        f"destination d{i}.test woken: REMOTE_SERVER_UP" for i in range(3)
    ]
    assert wakes.suppressed == 7
    clock.advance(60.0)
    wakes.woken("d10.test", "REMOTE_SERVER_UP")
    assert infos(caplog, "woken")[-1] == (
        "destination d10.test woken: REMOTE_SERVER_UP "
        "(7 more destinations woken before were not logged)"
    )
