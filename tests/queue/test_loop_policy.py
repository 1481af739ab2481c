"""The runner's loop policy (``queue/loop_policy.py``), sans-I/O through the core: the
steady-stream hold, whether an added item wakes the queue, idle eviction and parking.
The end-to-end behaviour of the hold is pinned in ``test_coalesce.py``."""

from __future__ import annotations

import itertools
import random

import pytest

from federation_sender.queue.backoff import RESET, BackoffPolicy
from federation_sender.queue.batching import Batch, Limits
from federation_sender.queue.core import DestinationCore
from federation_sender.queue.items import PduItem
from federation_sender.queue.loop_policy import LoopPolicy
from federation_sender.queue.steps import FrozenTxn, Send
from federation_sender.transport.result import Outcome, SendResult

NOW_MS = 1_000_000


def _core(catching_up: bool = False) -> DestinationCore:
    ids = itertools.count()
    c = DestinationCore("d.test", BackoffPolicy(), Limits(max_pdus=5), random.Random(0),
                        lambda: f"t{next(ids)}", catching_up=catching_up,
                        loop_policy=LoopPolicy(interval_s=1.0, min_pdus=3))
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


def _send(c: DestinationCore, now_s: float, ok: bool = True) -> FrozenTxn:
    """Take the next transaction as the runner does (counted before it goes out), and
    answer it."""
    step = c.next_step(NOW_MS)
    assert isinstance(step, Send)
    c.note_sent(step.txn, now_s)
    result = SendResult(Outcome.SUCCESS, 200) if ok else SendResult(Outcome.TRANSIENT)
    c.on_result(step.txn, result, NOW_MS)
    return step.txn


def test_a_stream_holds_the_next_part_filled_batch_one_interval_after_its_last_send() -> None:
    c = _core()
    c.add_pdus(_pdus(1))
    _send(c, 0.0)
    assert c.steady_hold_s(NOW_MS, lambda: 0.0) == 0.0  # one PDU: no stream yet
    c.add_pdus(_pdus(3))
    _send(c, 0.1)  # four PDUs within the interval: a stream
    c.add_pdus(_pdus(2))
    assert c.steady_hold_s(NOW_MS, lambda: 0.5) == pytest.approx(0.6)
    assert c.steady_hold_s(NOW_MS, lambda: 1.1) == 0.0  # the interval ended: the stream too
    assert c.loop_policy.steady_until == 0.0
    _send(c, 1.1)  # a new interval: two PDUs, below three


def test_a_full_batch_a_retry_catch_up_and_edus_never_wait() -> None:
    c = _core()
    c.add_pdus(_pdus(4))
    _send(c, 0.0)
    c.add_pdus(_pdus(5))
    assert c.steady_hold_s(NOW_MS, lambda: 0.2) == 0.0  # full: goes at once
    txn = _send(c, 0.2)
    c.add_pdus(_pdus(1))
    assert c.steady_hold_s(NOW_MS, lambda: 0.3) > 0  # part-filled: held
    _send(c, 0.3, ok=False)  # (a transaction sent on a stop, not answered)
    assert c.steady_hold_s(NOW_MS, lambda: 0.4) == 0.0  # a retry is owed: no hold
    policy = LoopPolicy(1.0, 3)
    policy.note_sent(FrozenTxn("r", txn.batch, attempts=1), False, 0.0)
    policy.note_sent(FrozenTxn("c", Batch(txn.batch.pdus, (), catchup=True)), False, 0.0)
    policy.note_sent(FrozenTxn("e", Batch((), ())), False, 0.0)
    assert policy.steady_until == 0.0


def test_a_batch_cut_by_the_limits_counts_nothing_but_its_remainder_waits() -> None:
    policy = LoopPolicy(1.0, 3)
    five = Batch(tuple(_pdus(5)), ())
    policy.note_sent(FrozenTxn("a", five), True, 0.0)  # a backlog: not a stream
    assert policy.steady_until == 0.0
    policy.note_sent(FrozenTxn("b", Batch(tuple(_pdus(3)), ())), False, 0.1)
    assert policy.steady_until == 1.1
    policy.note_sent(FrozenTxn("c", five), True, 0.5)  # within the stream: extends it
    assert policy.steady_until == 1.5


def test_items_do_not_wake_a_held_queue_until_its_batch_is_full() -> None:
    c = _core()
    assert c.wakes_on_add()
    c.set_holding(True)
    c.add_pdus(_pdus(4))
    assert not c.wakes_on_add()
    c.add_pdus(_pdus(1))
    assert c.wakes_on_add()
    c.set_holding(False)


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
