"""Memory of one destination queue before it sends anything: ``--queues`` queues created
as the manager creates them (runner, core, pending items, catch-up episode, isolation),
measured with tracemalloc, with the allocation sites that hold the most per queue.

    .venv/bin/python bench/queue_memory.py [--queues 1000] [--top 12]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import tracemalloc

from federation_sender.config import QueueSettings
from federation_sender.queue.manager import QueueManager
from federation_sender.storage.backend import NativeBackend
from federation_sender.storage.engine import create_engine
from federation_sender.testing.clock import FakeClock


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--queues", type=int, default=1000)
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()
    engine = create_engine("sqlite+aiosqlite://")
    m = QueueManager(NativeBackend(engine), None, QueueSettings(), "me.test", "fs1",  # type: ignore[arg-type]
                     FakeClock(), random.Random(1), lambda _d: True, None,
                     attempt_deadline_s=30)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    queues = [m.runners(f"d{i}.test", False) for i in range(a.queues)]
    gc.collect()
    after = tracemalloc.take_snapshot()
    diff = after.compare_to(before, "lineno")
    total = sum(d.size_diff for d in diff)
    print(f"{a.queues} queues: {total / a.queues:,.0f} bytes each")
    for d in diff[: a.top]:
        print(f"  {d.size_diff / a.queues:7,.0f} B/queue  {d.traceback[0]}")
    del queues
    await engine.dispose()


if __name__ == "__main__":
    asyncio.run(main())
