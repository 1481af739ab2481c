"""Runtime choices: the event loop switch and the memory trimmer's trigger."""

from __future__ import annotations

import asyncio
import resource
import subprocess
import sys

import pytest

from federation_sender.runtime import MemoryTrimmer, loop_factory, malloc_trim, run
from federation_sender.testing.clock import FakeClock


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_asyncio_by_default_uvloop_on_request() -> None:
    assert run(_loop_module()).startswith("asyncio")
    assert loop_factory() is asyncio.new_event_loop
    pytest.importorskip("uvloop")
    assert run(_loop_module(), "uvloop").startswith("uvloop")
    assert run(_loop_module(), "auto").startswith("uvloop")


def test_trim_only_after_live_queues_fell_by_min_drop() -> None:
    live = [0]
    t = MemoryTrimmer(lambda: live[0], FakeClock(), min_drop=1000)
    for n, due in [(500, False), (3000, False), (2500, False), (1999, True),
                   (1999, False), (2500, False), (1000, True), (999, False), (0, True)]:
        live[0] = n
        assert t.check() is due, n
    assert malloc_trim()  # glibc on this platform


async def test_trimmer_loop_trims_on_its_clock() -> None:
    clock = FakeClock()
    live = [5000]
    t = MemoryTrimmer(lambda: live[0], clock, interval_s=10.0, min_drop=1000)
    task = asyncio.create_task(t.run())
    await asyncio.sleep(0)
    assert clock.pending_sleepers == 1
    await clock.advance_and_settle(10.0)  # sees the peak
    assert t.trims == 0
    live[0] = 0
    await clock.advance_and_settle(10.0)  # sees the drop: trims in a thread
    await asyncio.wait_for(t.trimmed.wait(), 10)  # the trim runs in a worker thread
    assert t.trims == 1
    task.cancel()


def test_the_worker_runs_with_the_open_file_limit_raised_to_the_hard_limit() -> None:
    """A 10,000-server room keeps 10,000 connections alive at once; a process often
    starts with a soft limit of 1,024 open files."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard <= 256:
        pytest.skip(f"hard open-file limit {hard}: nothing to raise")
    script = (
        "import resource\n"
        "from federation_sender.runtime import run\n"
        "_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "async def main() -> int:\n"
        "    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]\n"
        "print(run(main()))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    assert int(out) == hard
