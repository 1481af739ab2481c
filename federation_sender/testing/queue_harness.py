"""Harness for queue tests: a migrated database, a fake clock, a real loopback fake
homeserver serving every remote name, the HTTP sender, a writer standing in for the main
process, and a QueueManager wired to them. Shipped in the package so benchmarks and other
suites can reuse it."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.config import QueueSettings
from federation_sender.queue.core.states import DestinationState
from federation_sender.queue.manager import QueueManager
from federation_sender.queue.observer import NoopObserver
from federation_sender.storage import schema as s
from federation_sender.storage.backend import NativeBackend
from federation_sender.testing.clock import FakeClock
from federation_sender.testing.fake_homeserver import FakeHomeserver
from federation_sender.testing.http_sender import HttpTransactionSender
from federation_sender.testing.queue_writer import HomeserverWriter
from federation_sender.transport.result import Outcome

ME = "local.test"
SETTLE_QUIET_TURNS = 4
"""settle(): loop turns in a row the manager must stay quiescent (what a turn can bring
that no component has counted yet: a task created but not started, a helper task's end
reaching its caller, loopback I/O read and handed on)."""
ALICE = f"@alice:{ME}"


class RecordingObserver(NoopObserver):
    def __init__(self) -> None:
        self.sent: list[tuple[str, Outcome, int | None, int, int]] = []
        self.dropped: list[tuple[str, str, str]] = []
        self.states: list[tuple[str, DestinationState, DestinationState]] = []
        self.catchups: list[tuple[str, int]] = []
        self.confirmations: list[tuple[str, str]] = []
        self.short_retries: list[tuple[str, bool]] = []
        self.return_probes: list[tuple[str, bool]] = []

    def transaction_sent(
        self,
        destination: str,
        txn_id: str,
        outcome: Outcome,
        http_status: int | None,
        pdu_count: int,
        edu_count: int,
        edu_types: Any,
        request_bytes: int,
        duration_s: float,
        catchup: bool,
    ) -> None:
        self.sent.append((destination, outcome, http_status, pdu_count, edu_count))

    def item_dropped(self, destination: str, item_type: str, reason: str) -> None:
        self.dropped.append((destination, item_type, reason))

    def state_changed(self, destination: str, old: DestinationState, new: DestinationState) -> None:
        self.states.append((destination, old, new))

    def backoff_changed(self, destination: str, retry_interval_s: float) -> None:
        pass

    def catchup_entered(self, destination: str, dropped_items: int) -> None:
        self.catchups.append((destination, dropped_items))

    def catchup_progress(self, destination: str, rooms: int, pdus: int) -> None:
        pass

    def pacing_confirmed(self, destination: str, outcome: str, waited_s: float) -> None:
        self.confirmations.append((destination, outcome))

    def short_retry(self, destination: str, answered: bool) -> None:
        self.short_retries.append((destination, answered))

    def short_retry_phase_ended(self, destination: str, answered: bool) -> None:
        pass

    def return_probe(self, destination: str, up: bool) -> None:
        self.return_probes.append((destination, up))

    def queues_changed(self, active: int) -> None:
        pass


@dataclass
class Harness:
    engine: AsyncEngine
    clock: FakeClock
    fake: FakeHomeserver
    sender: HttpTransactionSender
    writer: HomeserverWriter
    settings: QueueSettings
    observer: RecordingObserver = field(default_factory=RecordingObserver)
    shard: Callable[[str], bool] = lambda _d: True
    manager: QueueManager | None = None
    settle_turns: int = 0  # loop turns settle() has given quiescence, to follow it
    settle_waits: int = 0  # times settle() found something busy and waited for it

    def without_short_retry(self) -> None:
        """The first failure goes straight to the persisted backoff (for tests of that
        schedule); call before :meth:`start`."""
        self.settings = replace(self.settings, max_long_retries=0,
                                short_retry_probe_window_s=0.0)

    def make_manager(self, **kw: Any) -> QueueManager:
        return QueueManager(
            NativeBackend(self.engine),
            self.sender,
            self.settings,
            ME,
            "fs1",
            self.clock,
            random.Random(1),
            lambda d: self.shard(d),
            self.observer,
            attempt_deadline_s=kw.pop("attempt_deadline_s", 30.0),
            **kw,
        )

    async def start(self, **kw: Any) -> QueueManager:
        self.manager = self.make_manager(**kw)
        await self.manager.start()
        return self.manager

    @property
    def m(self) -> QueueManager:
        assert self.manager is not None
        return self.manager

    def poke(self) -> None:
        self.m.notify_new_events(self.writer.stream_ordering)

    async def settle(self) -> None:
        """Let the queues run until the manager is quiescent (every queue waits on a
        wake-up or the clock, none bootstrapping, reading, sending or persisting, the
        fan-out caught up, no sweep running) and every task the clock woke sleeps on it
        again or has ended (:attr:`FakeClock.woken`), and stays so for
        :data:`SETTLE_QUIET_TURNS` loop turns.

        Event-driven: while something is busy it waits for the manager's
        :attr:`~QueueManager.idle_signal` (every component raises it when it may have
        gone idle) or for the clock's woken tasks to come back, and looks again only
        then. Once quiescent, the few turns run what is already scheduled (a callback
        chain, a task created but not started, loopback I/O that has arrived); busy
        again on any of them, it waits again. A settle of an idle manager costs those
        turns, no real time. Fails after 15 s (real time: HTTP is real) with the
        statuses."""
        m, clock = self.m, self.clock
        try:
            async with asyncio.timeout(15):
                quiet = 0
                while quiet < SETTLE_QUIET_TURNS:
                    if clock.woken:
                        quiet = 0
                        self.settle_waits += 1
                        await clock.woken_back()
                    elif not m.quiescent():
                        quiet = 0
                        self.settle_waits += 1
                        await m.idle_signal.wait()
                    else:
                        await asyncio.sleep(0)  # noqa: TID251 - a yield, not a wait
                        quiet += 1
                        self.settle_turns += 1
        except TimeoutError:
            raise AssertionError(
                f"did not settle (quiescent: {m.quiescent()}, tasks the clock woke: "
                f"{clock.woken}): {m.statuses()}") from None

    async def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)
        await self.settle()

    async def advance_until(
        self, cond: Callable[[], bool], step_s: float = 1.0, max_s: float = 3600.0
    ) -> float:
        """Advance the fake clock ``step_s`` at a time, settling after each step, until
        ``cond()``; returns the fake seconds it took."""
        await self.settle()
        waited = 0.0
        while not cond():
            if waited >= max_s:
                raise AssertionError(f"not within {max_s}s: {self.m.statuses()}")
            await self.advance(step_s)
            waited += step_s
        return waited

    async def dest_row(self, d: str) -> Any:
        async with self.engine.connect() as conn:
            return (
                await conn.execute(select(s.destinations).where(s.destinations.c.destination == d))
            ).first()

    async def txlog(self, d: str | None = None) -> list[Any]:
        q = select(s.federation_transaction_log).order_by(s.federation_transaction_log.c.id)
        if d is not None:
            q = q.where(s.federation_transaction_log.c.destination == d)
        async with self.engine.connect() as conn:
            return list((await conn.execute(q)).all())


async def room_with(h: Harness, room: str, *remotes: str) -> None:
    await h.writer.join(room, ALICE)
    for r in remotes:
        await h.writer.join(room, f"@bob:{r}")
