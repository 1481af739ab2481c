from __future__ import annotations

import asyncio

import pytest

from federation_sender.clock import SystemClock
from federation_sender.storage.instance_lock import InstanceLockLost
from federation_sender.supervisor import Supervisor


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
