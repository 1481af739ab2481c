"""The runner's loop policy (``queue/core/loop_policy.py``), sans-I/O through the core: with
nothing in flight a PDU goes at once, what queues behind a transaction in flight goes in
the next; idle eviction and parking. End to end in ``test_coalesce.py``."""

from __future__ import annotations

import itertools
import random

import pytest

from federation_sender.queue.core.backoff import RESET, BackoffPolicy
from federation_sender.queue.core.batching import Limits
from federation_sender.queue.core.destination import DestinationCore
from federation_sender.queue.core.items import PduItem
from federation_sender.queue.core.loop_policy import LoopPolicy
from federation_sender.queue.core.steps import FrozenTxn, Send
from federation_sender.transport.result import Outcome, SendResult

NOW_MS = 1_000_000


def _core(catching_up: bool = False) -> DestinationCore:
    ids = itertools.count()
    c = DestinationCore("d.test", BackoffPolicy(), Limits(max_pdus=5), random.Random(0),
                        lambda: f"t{next(ids)}", catching_up=catching_up,
                        loop_policy=LoopPolicy())
    c.load(RESET, None)
    c.outbox_read_started()
    c.add_outbox([], [], True)
    return c


_so = itertools.count(1)


def _pdus(n: int) -> list[PduItem]:
    out = []
    for _ in range(n):
        so = next(_so)
        out.append(PduItem(so, f"$e{so}", "!r", {"event_id": f"$e{so}"}, 30))
    return out


def _answer(c: DestinationCore, step: object) -> FrozenTxn:
    assert isinstance(step, Send)
    c.on_result(step.txn, SendResult(Outcome.SUCCESS, 200), NOW_MS)
    return step.txn


def test_with_nothing_in_flight_each_pdu_of_a_stream_goes_at_once() -> None:
    c = _core()
    for _ in range(30):  # far past the former hold's 20 PDUs in 2 s
        c.add_pdus(_pdus(1))
        assert len(_answer(c, c.next_step(NOW_MS)).batch.pdus) == 1
    assert c.is_empty()


def test_what_queues_behind_a_transaction_in_flight_goes_in_the_next_within_limits(
) -> None:
    c = _core()
    c.add_pdus(_pdus(1))
    step = c.next_step(NOW_MS)  # in flight
    c.add_pdus(_pdus(7))
    assert c.next_step(NOW_MS) == step  # one in flight: it again, nothing new
    _answer(c, step)
    assert len(_answer(c, c.next_step(NOW_MS)).batch.pdus) == 5  # all it may take
    assert len(_answer(c, c.next_step(NOW_MS)).batch.pdus) == 2
    assert c.is_empty()


def test_eviction_asks_only_an_empty_queue_idle_past_the_ttl_and_it_exits_if_still_empty(
) -> None:
    c = _core()
    assert not c.evict_if_idle(100.0, 30.0)  # not idle
    c.idle_started(10.0)
    assert not c.evict_if_idle(39.0, 30.0)
    assert c.evict_if_idle(40.0, 30.0)
    assert c.idle_ended()
    c.idle_started(50.0)
    assert c.evict_if_idle(80.0, 30.0)
    c.add_pdus(_pdus(1))  # an item arrived with the request: it stays
    assert not c.idle_ended()
    c.idle_started(90.0)  # the request was forgotten
    assert not c.idle_ended()
    c.idle_started(90.0)
    assert not c.evict_if_idle(200.0, 30.0)  # not empty


def test_a_long_wait_parks_only_a_catching_up_queue_with_nothing_in_memory() -> None:
    c = _core(catching_up=True)
    assert c.parks(61.0, 60.0)
    assert not c.parks(60.0, 60.0)
    out = _core()
    assert not out.parks(3600.0, 60.0)


def test_the_steady_stream_holds_keys_are_accepted_and_warned_about_once_each(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from dataclasses import replace

    from federation_sender.config import QueueSettings
    from federation_sender.queue.manager import _warn_deprecated

    _warn_deprecated(QueueSettings())  # the defaults: silent
    assert caplog.records == []
    _warn_deprecated(replace(QueueSettings(), busy_txn_interval_s=0.0, busy_min_pdus=5))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("deprecated and ignored" in m for m in lines)
    assert "queue.busy_txn_interval_s" in lines[0] and "queue.busy_min_pdus" in lines[1]
