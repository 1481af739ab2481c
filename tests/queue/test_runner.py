"""The runner on its own (``queue/runner.py``), without the manager: it adds and wakes,
runs what the core decides, and exits when the core says so. A real database (SQLite),
a real HTTP receiver on loopback and the fake clock."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.aio.slots import Slots
from federation_sender.config import QueueSettings
from federation_sender.queue.core.backoff import BackoffPolicy
from federation_sender.queue.core.batching import Limits
from federation_sender.queue.core.destination import DestinationCore
from federation_sender.queue.core.items import PduItem
from federation_sender.queue.observer import NoopObserver
from federation_sender.queue.persistence import QueuePersistence
from federation_sender.queue.runner import DestinationRunner, RunnerConfig
from federation_sender.storage.backend import NativeBackend
from federation_sender.storage.engine import create_engine
from federation_sender.storage.migrate import upgrade
from federation_sender.testing.clock import FakeClock
from federation_sender.testing.fake_homeserver import FakeHomeserver
from federation_sender.testing.http_sender import HttpTransactionSender
from federation_sender.testing.queue_harness import ME
from federation_sender.testing.waiting import wait_until

DEST = "r1.test"


@dataclass
class Parts:
    engine: AsyncEngine
    clock: FakeClock
    fake: FakeHomeserver
    sender: HttpTransactionSender
    store: QueuePersistence

    def runner(self, *, catching_up: bool = False,
               last_error: str | None = None) -> DestinationRunner:
        ids = itertools.count()
        core = DestinationCore(DEST, BackoffPolicy(), Limits(max_pdus=5), random.Random(0),
                               lambda: f"t{next(ids)}", catching_up=catching_up,
                               last_error=last_error)
        config = RunnerConfig.from_settings(QueueSettings(), ME, "fs1", 30.0)
        return DestinationRunner(core, self.store, self.sender, Slots(4), Slots(4),
                                 self.clock, NoopObserver(), config)


@pytest.fixture
async def parts(sqlite_url: str, clock: FakeClock) -> AsyncIterator[Parts]:
    engine = create_engine(sqlite_url)
    await upgrade(engine)
    fake = FakeHomeserver()
    await fake.start()
    sender = HttpTransactionSender(fake.url, ME, clock, timeout_s=20)
    store = QueuePersistence(NativeBackend(engine))
    try:
        yield Parts(engine, clock, fake, sender, store)
    finally:
        await store.drain()
        await sender.close()
        await fake.close()
        await engine.dispose()


_so = itertools.count(1)


def _pdus(n: int) -> list[PduItem]:
    out = []
    for _ in range(n):
        so = next(_so)
        out.append(PduItem(so, f"$e{so}", "!r:l", {"event_id": f"$e{so}"}, 30))
    return out


async def _quiet(r: DestinationRunner) -> None:
    await wait_until(lambda: r.quiescent, "the runner waits", timeout_s=10)


async def _stop(r: DestinationRunner, task: asyncio.Task[None]) -> None:
    r.request_stop()
    await asyncio.wait_for(task, 10)
    assert r.finished


async def test_adding_wakes_the_runner_and_it_sends(parts: Parts) -> None:
    r = parts.runner()
    task = asyncio.create_task(r.run())
    await _quiet(r)
    assert not r.wake_if_owed()  # nothing held: nothing to wake for
    items = _pdus(3)
    r.add_pdus(items)
    await wait_until(lambda: len(parts.fake.received_event_ids(DEST)) == 3,
                     "three PDUs received", timeout_s=10)
    assert parts.fake.received_event_ids(DEST) == [p.event_id for p in items]
    await _quiet(r)
    assert r.left_clean() and r.last_error is None
    await _stop(r, task)


async def test_a_receipt_added_without_waking_rides_on_the_next_transaction(
    parts: Parts,
) -> None:
    r = parts.runner()
    task = asyncio.create_task(r.run())
    await _quiet(r)
    r.add_receipt("!r:l", "m.read", "@a:l", {"event_ids": ["$x"]}, wake=False)
    assert not r.wake.is_set() and r.owes_something()
    r.add_pdus(_pdus(1))
    await wait_until(lambda: parts.fake.received_edus(DEST), "the receipt", timeout_s=10)
    assert parts.fake.received_edus(DEST)[0]["edu_type"] == "m.receipt"
    await _stop(r, task)


async def test_every_item_added_wakes_the_runner(parts: Parts) -> None:
    r = parts.runner()
    task = asyncio.create_task(r.run())
    await _quiet(r)
    for n in range(1, 8):  # a steady stream: each PDU wakes the queue and goes alone
        r.add_pdus(_pdus(1))
        assert r.wake.is_set()
        await wait_until(lambda n=n: len(parts.fake.received_event_ids(DEST)) == n,
                         timeout_s=10)
        await _quiet(r)
    await _stop(r, task)


async def test_the_runner_exits_when_evicted_idle_and_keeps_its_last_error(
    parts: Parts,
) -> None:
    r = parts.runner(last_error="HTTP 503")
    task = asyncio.create_task(r.run())
    await _quiet(r)
    now = parts.clock.monotonic_s()
    assert not r.evict_if_idle(now, 60.0)  # idle, not for long enough
    parts.clock.advance(61.0)
    assert r.evict_if_idle(parts.clock.monotonic_s(), 60.0)
    await asyncio.wait_for(task, 10)
    assert r.finished and r.left_clean()
    assert r.last_error == "HTTP 503"  # no answer since: still the predecessor's
