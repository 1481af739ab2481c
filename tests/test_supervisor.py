from __future__ import annotations

import asyncio

import pytest

from federation_sender.clock import SystemClock
from federation_sender.storage.instance_lock import InstanceLockLost
from federation_sender.supervisor import Supervisor, every
from federation_sender.testing.clock import FakeClock
from federation_sender.testing.waiting import wait_until


async def test_restartable_task_is_restarted_then_gives_up() -> None:
    runs = 0

    async def flaky() -> None:
        nonlocal runs
        runs += 1
        raise RuntimeError("boom")

    sup = Supervisor(SystemClock(), max_restarts=2, window_s=60)
    sup.start("flaky", flaky, restart=True)
    failed = await asyncio.wait_for(sup.wait(asyncio.Event()), timeout=10)
    assert failed is not None and failed.name == "flaky"
    assert isinstance(failed.cause, RuntimeError)
    assert runs == 3
    await sup.shutdown()


async def test_unexpected_return_is_a_failure() -> None:
    async def quits() -> None:
        return None

    sup = Supervisor(SystemClock())
    sup.start("quits", quits)
    failed = await asyncio.wait_for(sup.wait(asyncio.Event()), timeout=5)
    assert failed is not None and failed.cause is None
    await sup.shutdown()


async def test_stop_event_and_shutdown_cancel_tasks() -> None:
    cancelled = asyncio.Event()

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()

    sup = Supervisor(SystemClock())
    sup.start("forever", forever)
    stop = asyncio.Event()
    stop.set()
    assert await sup.wait(stop) is None
    await sup.shutdown()
    assert cancelled.is_set()


async def test_an_expected_operational_stop_is_one_line_without_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A task ending in a LocalPermanentError (the instance lock lost) says why in one
    ERROR line; a bug still gets its traceback."""

    async def lock_lost() -> None:
        raise InstanceLockLost("lost the instance lock of 'fed1': another process took it")

    async def bug() -> None:
        raise RuntimeError("boom")

    for name, task in (("instance-lock", lock_lost), ("bug", bug)):
        sup = Supervisor(SystemClock())
        sup.start(name, task)
        failed = await asyncio.wait_for(sup.wait(asyncio.Event()), timeout=5)
        assert failed is not None and failed.name == name
        await sup.shutdown()
    lines = [(r.getMessage(), r.exc_info is not None) for r in caplog.records
             if r.name == "federation_sender.supervisor"]
    assert lines == [
        ("supervised task 'instance-lock' stopped: lost the instance lock of 'fed1': another "
         "process took it", False),
        ("supervised task 'bug' crashed", True),
    ]


# --- every: periodic work on the injected clock ------------------------------------------

class Ticks:
    """A tick function that records each call and lets the test wait for the n-th."""

    def __init__(self, fail: dict[int, BaseException] | None = None) -> None:
        self.n = 0
        self.fail = fail or {}
        self.changed = asyncio.Event()

    async def __call__(self) -> None:
        self.n += 1
        self.changed.set()
        if self.n in self.fail:
            raise self.fail[self.n]

    async def reach(self, n: int) -> None:
        await wait_until(lambda: self.n, f"tick {n}", accept=lambda seen: seen >= n,
                         wake=self.changed, timeout_s=5)


def _outage(exc: BaseException) -> str | None:
    return f"down: {exc}" if isinstance(exc, ConnectionError) else None


async def test_every_ticks_on_the_fake_clock_only() -> None:
    clock = FakeClock()
    ticks = Ticks()
    sup = Supervisor(clock)
    sup.every("tick", 5.0, ticks)
    await wait_until(lambda: clock.pending_sleepers, "the first wait on the clock",
                     timeout_s=5)
    await clock.advance_and_settle(4.9)
    assert ticks.n == 0  # not before one interval
    clock.advance(0.1)
    await ticks.reach(1)
    clock.advance(5.0)
    await ticks.reach(2)
    assert ticks.n == 2
    await sup.shutdown()


async def test_every_draws_its_first_wait_and_each_interval() -> None:
    clock = FakeClock()
    ticks = Ticks()
    waits = iter([2.0, 3.0, 4.0])
    sup = Supervisor(clock)
    sup.every("tick", lambda: next(waits), ticks, first_s=lambda: 1.0)
    await wait_until(lambda: clock.pending_sleepers, "the first wait", timeout_s=5)
    for step, expected in ((1.0, 1), (2.0, 2), (3.0, 3)):
        clock.advance(step)
        await ticks.reach(expected)
    await sup.shutdown()


async def test_every_survives_a_failed_tick_and_logs_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A bug is an ERROR with its traceback; an expected outage one WARNING line; the
    next tick runs either way."""
    clock = FakeClock()
    ticks = Ticks(fail={1: RuntimeError("boom"), 2: ConnectionError("refused")})
    sup = Supervisor(clock)
    sup.every("the tick", 1.0, ticks, db_outage=_outage)
    for n in (1, 2, 3):
        await wait_until(lambda: clock.pending_sleepers, "a wait", timeout_s=5)
        clock.advance(1.0)
        await ticks.reach(n)
    stop = asyncio.Event()
    stop.set()
    assert await sup.wait(stop) is None  # no failure of the process
    lines = [(r.levelname, r.getMessage(), r.exc_info is not None) for r in caplog.records
             if r.name == "federation_sender.supervisor"]
    assert lines == [
        ("ERROR", "the tick failed", True),
        ("WARNING", "the tick skipped, the database is unavailable (down: refused)", False),
    ]
    await sup.shutdown()


async def test_every_stops_when_stopped_and_leaves_nothing_behind() -> None:
    clock = FakeClock()
    ticks = Ticks()
    sup = Supervisor(clock)
    sup.every("tick", 1.0, ticks)
    sup.every("other", 1.0, Ticks())
    await wait_until(lambda: clock.pending_sleepers, "both waits", accept=lambda n: n == 2,
                     timeout_s=5)
    await sup.stop("tick")
    assert clock.pending_sleepers == 1 and sup.names() == ["other"]
    assert "tick" not in {t.get_name() for t in asyncio.all_tasks()}
    clock.advance(1.0)
    await clock.advance_and_settle(0)
    assert ticks.n == 0
    sup.every("tick", 1.0, ticks)  # a stopped name may start again
    await sup.shutdown()
    assert clock.pending_sleepers == 0 and sup.names() == []
    assert not {"tick", "other"} & {t.get_name() for t in asyncio.all_tasks()}


async def test_the_module_function_runs_until_cancelled() -> None:
    clock = FakeClock()
    ticks = Ticks()
    task = asyncio.ensure_future(every("tick", 2.0, ticks, clock=clock))
    await wait_until(lambda: clock.pending_sleepers, "the first wait", timeout_s=5)
    clock.advance(2.0)
    await ticks.reach(1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert clock.pending_sleepers == 0


# --- keep_running: a loop that outlives its failures --------------------------------------

async def test_keep_running_restarts_after_its_delay_forever_and_may_return(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """More failures than ``max_restarts`` in the window: never a process failure (the
    database may be down for minutes); returning ends the task quietly."""
    clock = FakeClock()
    failures = 8
    ticks = Ticks(fail={i: ConnectionError("refused") for i in range(1, failures + 1)})
    sup = Supervisor(clock, max_restarts=2, window_s=60)
    sup.keep_running("intake", ticks, retry_s=1.0, db_outage=_outage)
    await ticks.reach(1)
    for n in range(2, failures + 2):
        await clock.advance_and_settle(0.9)
        assert ticks.n == n - 1  # the delay is the whole retry_s
        clock.advance(0.1)
        await ticks.reach(n)
    await wait_until(lambda: [t for t in asyncio.all_tasks() if t.get_name() == "intake"],
                     "the loop's end", accept=lambda left: not left, timeout_s=5)
    stop = asyncio.Event()
    stop.set()
    assert await sup.wait(stop) is None
    lines = {r.getMessage() for r in caplog.records if r.name == "federation_sender.supervisor"}
    assert lines == {"intake loop stopped, the database is unavailable (down: refused); "
                     "restarting"}
    await sup.shutdown()
