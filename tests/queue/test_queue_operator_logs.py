"""What an operator reads in the INFO lines: how many destinations start in catch-up
(the worker's start line), and a destination woken by another process's signal (main's
retry-timings invalidation, ``REMOTE_SERVER_UP``), rate-limited, with the destination
in the line's context like every queue line. Real HTTP, fake clock."""

from __future__ import annotations

import logging

import pytest

from federation_sender.app.worker import catchup_at_start_line
from federation_sender.queue.core.states import DestinationState
from federation_sender.queue.wakelog import WakeLog
from federation_sender.storage import destinations as dst
from federation_sender.telemetry.logging import ContextFilter
from federation_sender.testing.clock import FakeClock
from federation_sender.testing.queue_harness import ALICE, Harness, room_with

D = "r1.test"
MANAGER = "federation_sender.queue.manager"


def infos(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [
        r.getMessage() for r in caplog.records
        if r.name == MANAGER and r.levelno == logging.INFO and text in r.getMessage()
    ]  # fmt: skip


async def test_start_finds_the_destinations_in_catch_up(h: Harness) -> None:
    """What the worker's start line counts (app/worker.py, ``catchup_at_start_line``)."""
    await room_with(h, "!a:l", D, "r2.test")
    await h.start()
    assert h.m.catchup_at_start == []
    assert catchup_at_start_line([]) == (
        "destinations in catch-up at start: 0 (events owed to them were recorded before "
        "the last stop)"
    )
    h.fake.behave(D, status=503)
    h.fake.behave("r2.test", status=503)
    await h.writer.message("!a:l", ALICE)
    h.poke()
    await h.settle()
    await h.m.stop(0.0)
    await h.start()
    assert h.m.catchup_at_start == [D, "r2.test"]
    assert catchup_at_start_line([f"d{i}" for i in range(7)]).endswith(
        "before the last stop): d0, d1, d2, d3, d4, …"
    )


async def backing_off(h: Harness) -> None:
    h.without_short_retry()  # a persisted backoff, which only a wake-up cuts short
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
    caplog.handler.addFilter(ContextFilter())
    await backing_off(h)
    await h.m.remote_server_up(D)
    await h.settle()
    assert infos(caplog, "woken") == [f"destination {D} woken: REMOTE_SERVER_UP"]
    woken = [r for r in caplog.records if "woken" in r.getMessage()]
    assert [getattr(r, "context", {}).get("destination") for r in woken] == [D]


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
