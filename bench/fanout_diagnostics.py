"""Where the fan-out engine's time goes: the measurements behind docs/benchmarks.md,
"Fan-out: closing the gap".

    .venv/bin/python bench/fanout_diagnostics.py timeline [--dests 200] [--every 0.02]
    .venv/bin/python bench/fanout_diagnostics.py postgres-cpu [--dests 200 1000]
    .venv/bin/python bench/fanout_diagnostics.py null-sender [--dests 1000] [--runs 5] \
        [--cprofile]

* ``timeline``: runs ``fanout.py``'s engine phase and prints, every ``--every`` seconds,
  the process's CPU share, transactions in flight, PDUs waiting in queues and events the
  intake has handled. Stalls show as rows with work waiting and the CPU well below 100 %.
* ``postgres-cpu``: the CPU the PostgreSQL processes and the receiver process used during
  the engine phase, and the receiver's during the bare loop, next
  to the engine's own.
* ``null-sender``: the engine with a sender that answers 200 at once (no HTTP): its own
  CPU per transaction, intake and database included. ``--cprofile`` prints the top
  functions by own time.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import random
import time
from dataclasses import replace
from typing import Any

import fanout
from common import ME, build_rooms, clock, database, receivers

from federation_sender.config import QueueSettings
from federation_sender.queue.manager import QueueManager
from federation_sender.storage.backend import NativeBackend
from federation_sender.testing.queue_writer import HomeserverWriter
from federation_sender.transport.result import Outcome, SendResult, Transaction


def _cpu_s(name: str, parent: int | None = None) -> float:
    """User + system CPU seconds of every process whose name holds ``name`` (and whose
    parent is ``parent``, if given), from Linux /proc."""
    ticks = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if name not in stat[stat.index("(") + 1:stat.rindex(")")]:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if parent is not None and int(fields[1]) != parent:
            continue
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def postgres_cpu_s() -> float:
    """CPU seconds of every PostgreSQL process."""
    return _cpu_s("postgres")


def receiver_cpu_s() -> float:
    """CPU seconds of this process's receiver processes (``common.receivers``)."""
    return _cpu_s("python", os.getpid())


class Window:
    """Duck-types ``fanout.PROFILE``: called around the engine phase."""

    def __init__(self, every_s: float | None = None) -> None:
        self.every_s = every_s
        self.rows: list[tuple[int, int, int, int]] = []
        self.manager: QueueManager | None = None
        self._task: asyncio.Task[None] | None = None

    def enable(self) -> None:
        self.t0 = time.perf_counter()
        self.pg0 = postgres_cpu_s()
        self.rx0 = receiver_cpu_s()
        if self.every_s is not None:
            self._task = asyncio.get_running_loop().create_task(self._sample())

    def disable(self) -> None:
        self.wall_s = time.perf_counter() - self.t0
        self.pg_s = postgres_cpu_s() - self.pg0
        self.rx_s = receiver_cpu_s() - self.rx0
        if self._task is not None:
            self._task.cancel()

    async def _sample(self) -> None:
        assert self.every_s is not None
        c0, t0 = time.process_time(), time.perf_counter()
        start = None
        while True:
            await asyncio.sleep(self.every_s)
            c1, t1 = time.process_time(), time.perf_counter()
            m = self.manager
            if m is None:
                continue
            start = m.fanout.position if start is None else start
            runners = list(m.queues.runners.values())
            self.rows.append((
                round(1000 * (t1 - self.t0)),
                round(100 * (c1 - c0) / (t1 - t0)),
                sum(1 for r in runners if r.in_flight_since is not None),
                sum(r.core.pending.pdu_count for r in runners),
            ))
            c0, t0 = c1, t1


def _watch(w: Window) -> None:
    """Let the window see the engine's QueueManager."""
    init = QueueManager.__init__

    def patched(self: QueueManager, *a: Any, **kw: Any) -> None:
        init(self, *a, **kw)
        w.manager = self

    QueueManager.__init__ = patched  # type: ignore[method-assign]


async def timeline(a: argparse.Namespace) -> None:
    w = Window(a.every)
    _watch(w)
    fanout.PROFILE = w
    with receivers(1) as urls:
        r = await fanout.run_one("postgres", a.dests[0], urls, a.events, 5)
    print(f"ratio {r['engine_tps'] / r['bare_tps']:.2f}, engine {r['engine_s']:.2f} s, "
          f"bare {r['bare_s']:.2f} s, {int(r['txns'])} txns")
    print(f"{'ms':>6} {'cpu %':>6} {'in flight':>10} {'PDUs waiting':>13}")
    for ms, cpu, infl, pend in w.rows:
        print(f"{ms:6d} {cpu:6d} {infl:10d} {pend:13d}")


async def postgres_cpu(a: argparse.Namespace) -> None:
    bare = fanout.bare_loop
    receiver_s: list[float] = []

    async def bare_measured(*args: Any, **kwargs: Any) -> tuple[float, float]:
        rx0 = receiver_cpu_s()
        out = await bare(*args, **kwargs)
        receiver_s.append(receiver_cpu_s() - rx0)
        return out

    fanout.bare_loop = bare_measured  # type: ignore[assignment]
    with receivers(1) as urls:
        for n in a.dests:
            w = Window()
            fanout.PROFILE = w
            r = await fanout.run_one("postgres", n, urls, a.events, 5)
            engine_cpu = r["engine_cpu_ms_per_txn"] * r["txns"] / 1000
            print(f"{n} destinations: ratio {r['engine_tps'] / r['bare_tps']:.2f}; engine "
                  f"{w.wall_s:.2f} s wall / {engine_cpu:.2f} s CPU, PostgreSQL {w.pg_s:.2f} s "
                  f"CPU, receiver {w.rx_s:.2f} s CPU; bare loop {r['bare_s']:.2f} s wall, "
                  f"receiver {receiver_s[-1]:.2f} s CPU")


class NullSender:
    def __init__(self) -> None:
        self.txns = self.pdus = self.target = 0
        self.done = asyncio.Event()

    async def send_transaction(self, txn: Transaction) -> SendResult:
        await asyncio.sleep(0)
        self.txns += 1
        self.pdus += len(txn.pdus)
        if self.target and self.pdus >= self.target:
            self.done.set()
        return SendResult(Outcome.SUCCESS, status=200, duration_s=0.001)


async def null_run(n: int, events: int, prof: cProfile.Profile | None) -> float:
    settings = replace(QueueSettings(), max_concurrent_transactions=500)
    async with database("postgres") as engine:
        rooms = await build_rooms(engine, n, 1)
        writer = await HomeserverWriter(engine, ME).init()
        s = NullSender()
        m = QueueManager(NativeBackend(engine), s, settings, ME, "bench", clock(), random.Random(1),
                         lambda _d: True, attempt_deadline_s=60)
        await m.start()
        s.target = n
        await writer.message(rooms[0], f"@alice:{ME}")
        m.notify_new_events(writer.stream_ordering)
        await asyncio.wait_for(s.done.wait(), 120)
        s.done.clear()
        s.txns = s.pdus = 0
        s.target = events * n
        start = writer.stream_ordering
        await writer.messages(rooms[0], f"@alice:{ME}", events)
        c0 = time.process_time()
        if prof is not None:
            prof.enable()
        await fanout.announce(m, start, events, 5, "clock")
        await asyncio.wait_for(s.done.wait(), 600)
        if prof is not None:
            prof.disable()
        cpu = time.process_time() - c0
        await m.stop(5)
        return 1000 * cpu / s.txns


async def null_sender(a: argparse.Namespace) -> None:
    prof = cProfile.Profile() if a.cprofile else None
    runs = [await null_run(a.dests[0], a.events, prof) for _ in range(a.runs)]
    print(f"engine CPU per transaction with a null sender, {a.dests[0]} destinations: "
          f"min {min(runs):.3f} ms, median {sorted(runs)[len(runs) // 2]:.3f} ms "
          f"({', '.join(f'{x:.3f}' for x in runs)})")
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["timeline", "postgres-cpu", "null-sender"])
    ap.add_argument("--dests", type=int, nargs="+", default=None)
    ap.add_argument("--events", type=int, default=400)
    ap.add_argument("--every", type=float, default=0.02)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--cprofile", action="store_true")
    a = ap.parse_args()
    if a.dests is None:
        a.dests = {"timeline": [200], "postgres-cpu": [200, 1000], "null-sender": [1000]}[a.what]
    fn = {"timeline": timeline, "postgres-cpu": postgres_cpu, "null-sender": null_sender}
    asyncio.run(fn[a.what](a))


if __name__ == "__main__":
    main()
