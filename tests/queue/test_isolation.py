"""Item isolation and 429 handling of one sans-I/O DestinationCore, driven step by step
against a scripted remote (what the remote refuses, how it answers)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from federation_sender.queue.core.backoff import RESET, BackoffPolicy
from federation_sender.queue.core.batching import Limits
from federation_sender.queue.core.destination import DestinationCore
from federation_sender.queue.core.isolation import RETRY_BASE_MS, describe, retry_delay_ms
from federation_sender.queue.core.items import EduItem, PduItem
from federation_sender.queue.core.steps import FrozenTxn, Idle, NeedCatchup, NeedOutbox, Send, Wait
from federation_sender.transport.result import Outcome, SendResult

OK = SendResult(Outcome.SUCCESS, status=200, duration_s=0.05)


@dataclass
class Drive:
    """One core outside catch-up, a clock in ms, and a log of what happened."""

    answer: Callable[[FrozenTxn], SendResult]
    core: DestinationCore = field(init=False)
    now: int = 1_000_000
    sent: list[tuple[int, FrozenTxn, SendResult]] = field(default_factory=list)
    dropped: list[PduItem | EduItem] = field(default_factory=list)
    backoffs: int = 0
    delivered_messages: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        ids = itertools.count()
        self.core = DestinationCore("d.test", BackoffPolicy(), Limits(), random.Random(0),
                                    lambda: f"t{next(ids)}", max_item_failures=3,
                                    catching_up=False)
        self.core.load(RESET, None)
        self.core.outbox_read_started()  # the bootstrap's read
        self.core.add_outbox([], [], True)

    def message(self, mid: str, sid: int) -> None:
        self.core.add_outbox([(sid, {"message_id": mid, "messages": {}})], [], True)

    def run(self, max_steps: int = 1_000, until_ms: int | None = None) -> None:
        """Until the queue is idle (advancing the clock through every wait), or until
        the clock reaches ``until_ms``."""
        for _ in range(max_steps):
            if until_ms is not None and self.now >= until_ms:
                return
            step = self.core.next_step(self.now)
            if isinstance(step, Idle):
                return
            if isinstance(step, Wait):
                self.now = max(self.now + 1, step.until_ms)
            elif isinstance(step, NeedOutbox):
                self.core.add_outbox([], [], True)
            elif isinstance(step, NeedCatchup):
                self.core.catchup_finished()
            elif isinstance(step, Send):
                res = self.answer(step.txn)
                self.sent.append((self.now, step.txn, res))
                eff = self.core.on_result(step.txn, res, self.now)
                if res.outcome is Outcome.SUCCESS:
                    self.delivered_messages += [str(e.content.get("message_id"))
                                                for e in step.txn.batch.edus]
                self.dropped += [i for i, _ in eff.dropped]
                if eff.backoff is not None and eff.backoff.backing_off:
                    self.backoffs += 1
                self.now += 10
        raise AssertionError("queue did not go idle")


def refusing(bad: set[str], status: int = 400) -> Callable[[FrozenTxn], SendResult]:
    def answer(txn: FrozenTxn) -> SendResult:
        if any(e.content.get("message_id") in bad for e in txn.batch.edus):
            return SendResult(Outcome.PERMANENT, status=status, error="bad")
        return OK
    return answer


def test_poison_messages_one_after_another_are_each_dropped_alone() -> None:
    """A burst of poison to-device messages, then more, each refused alone: every one
    is dropped on its own, the destination is never blamed, good messages flow."""
    bad = {f"bad{i}" for i in range(12)}
    d = Drive(refusing(bad, status=500))
    sid = itertools.count(1)
    for i in range(6):
        d.message(f"bad{i}", next(sid))
    d.message("good0", next(sid))
    d.run()
    for i in range(6, 12):  # the next poison items, one after another
        d.message(f"bad{i}", next(sid))
        d.message(f"good{i}", next(sid))
        d.run()
    assert d.backoffs == 0
    assert sorted(str(e.content["message_id"]) for e in d.dropped  # type: ignore[union-attr]
                  ) == sorted(bad)
    assert set(d.delivered_messages) == {"good0", *(f"good{i}" for i in range(6, 12))}


def test_isolation_retries_of_one_item_are_spaced() -> None:
    d = Drive(refusing({"bad"}))
    d.message("bad", 1)
    d.run()
    alone = [t for t, txn, res in d.sent if res.status == 400 and txn.batch.item_count == 1]
    assert len(alone) == 4  # three refusals, a probe, the fourth drops it
    gaps = [b - a for a, b in itertools.pairwise(alone)]
    assert gaps[0] >= retry_delay_ms(1) == RETRY_BASE_MS
    assert gaps[1] >= retry_delay_ms(2) == 2 * RETRY_BASE_MS
    assert len(d.dropped) == 1


def test_an_item_is_dropped_only_when_something_else_got_through() -> None:
    """A destination refusing everything (even the empty probe) must back off with
    the item held, never drop it: otherwise it would drop every event."""
    d = Drive(lambda _txn: SendResult(Outcome.PERMANENT, status=400, error="no"))
    d.message("m1", 1)
    for _ in range(200):
        step = d.core.next_step(d.now)
        if isinstance(step, Wait) and d.core.backoff.backing_off:
            break
        if isinstance(step, Wait):
            d.now = step.until_ms
        elif isinstance(step, Send):
            eff = d.core.on_result(step.txn, d.answer(step.txn), d.now)
            d.dropped += [i for i, _ in eff.dropped]
            d.now += 10
    assert d.core.backoff.backing_off
    assert not d.dropped
    assert d.core.pending_edus == 1


def test_the_same_item_is_dropped_once_a_probe_got_through() -> None:
    d = Drive(refusing({"bad"}))
    d.message("bad", 1)
    d.run()
    probes = [txn for _, txn, res in d.sent if txn.batch.probe]
    assert len(probes) == 1 and d.backoffs == 0
    assert [describe(i) for i in d.dropped] == ["m.direct_to_device message_id bad (stream 1)"]


def test_describe_names_an_event_and_its_stream_id() -> None:
    item = PduItem(42, "$ev", "!r", {}, 10)
    assert describe(item) == "event $ev (stream 42)"


def _rate_limited(retry_after_s: float | None, times: int) -> Callable[[FrozenTxn], SendResult]:
    left = [times]

    def answer(txn: FrozenTxn) -> SendResult:
        if left[0] > 0:
            left[0] -= 1
            return SendResult(Outcome.TRANSIENT, status=429, error="HTTP 429",
                              retry_after_s=retry_after_s)
        return OK
    return answer


def test_429_without_retry_after_pauses_briefly_and_resends_the_same_txn() -> None:
    d = Drive(_rate_limited(None, 3))
    d.message("m", 1)
    d.run()
    times = [t for t, _, _ in d.sent]
    ids = {txn.txn_id for _, txn, _ in d.sent}
    assert len(ids) == 1 and len(d.sent) == 4
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert [g // 1000 for g in gaps] == [2, 4, 8]  # seconds, doubling; not ten minutes
    assert d.backoffs == 0 and d.core.backoff == RESET


def test_429_honours_retry_after() -> None:
    d = Drive(_rate_limited(30.0, 1))
    d.message("m", 1)
    step = d.core.next_step(d.now)
    assert isinstance(step, Send)
    eff = d.core.on_result(step.txn, d.answer(step.txn), d.now)
    assert eff.backoff is None  # nothing persisted: an overloaded peer is not a failed one
    wait = d.core.next_step(d.now)
    assert wait == Wait(d.now + 30_000)
    assert d.core.retry_at_ms() == d.now + 30_000
    d.run()
    assert d.delivered_messages == ["m"]


def test_429_with_a_long_retry_after_is_a_persisted_backoff_of_at_least_that() -> None:
    d = Drive(_rate_limited(7200.0, 1))
    d.message("m", 1)
    step = d.core.next_step(d.now)
    assert isinstance(step, Send)
    eff = d.core.on_result(step.txn, d.answer(step.txn), d.now)
    assert eff.backoff is not None and eff.backoff.retry_interval_ms >= 7_200_000


@pytest.mark.parametrize("hint_s", [0.0, -1.0, -1e9, 0.001, 1e-9, 0.5, None])
def test_a_peer_answering_only_429_gets_bounded_attempts_whatever_its_hint(
    hint_s: float | None,
) -> None:
    """``Retry-After: 0``, a negative or tiny ``retry_after_ms`` used to pause 1 ms: a
    peer answering 429 to everything got 1,000 attempts a second. The pause is now at
    least the unhinted one and grows at each 429; the 8th in a row is a failure with the
    persisted backoff (10 minutes, then doubling)."""
    d = Drive(_rate_limited(hint_s, 10**9))
    d.message("m", 1)
    start = d.now
    d.run(max_steps=10_000, until_ms=start + 3_600_000)
    times = [t - start for t, _, _ in d.sent]
    assert len([t for t in times if t < 10_000]) == 3  # 0, 2 and 6 s
    assert len([t for t in times if t < 60_000]) == 5  # then 14 and 30 s
    # Pauses of 2, 4, 8, 16, 32, 60 and 60 s, then the 8th 429 is a failure.
    assert len([t for t in times if t < 600_000]) == 8
    assert d.backoffs == len(times) - 7
    assert d.core.backoff.backing_off and d.core.backoff.retry_interval_ms >= 600_000
    assert len(times) <= 10  # in the first hour
    assert {txn.txn_id for _, txn, _ in d.sent} == {d.sent[0][1].txn_id}


def test_429s_interrupted_by_a_success_start_again_from_the_shortest_pause() -> None:
    d = Drive(_rate_limited(0.0, 5))
    d.message("m", 1)
    d.run()
    assert d.delivered_messages == ["m"] and d.backoffs == 0
    d.answer = _rate_limited(0.0, 1)
    d.message("n", 2)
    start = d.now
    d.run()
    assert [t - start for t, _, _ in d.sent[-2:]] == [0, 2_000]


def test_every_real_success_asks_for_the_persisted_backoff_to_be_reset() -> None:
    d = Drive(lambda _t: OK)
    d.message("m", 1)
    step = d.core.next_step(d.now)
    assert isinstance(step, Send)
    eff = d.core.on_result(step.txn, OK, d.now)
    assert eff.succeeded and eff.backoff is None  # in memory it was never backing off


def test_dropping_an_item_ends_the_run_of_refusals() -> None:
    """The policy alone: a drop proves something got through, so the refusals before it
    no longer count towards asking whether the destination is up."""
    from federation_sender.queue.core.batching import Batch
    from federation_sender.queue.core.isolation import (
        MAX_REFUSALS_WITHOUT_SUCCESS,
        ItemIsolation,
        Verdict,
    )

    iso = ItemIsolation(max_item_failures=3)
    x = Batch((PduItem(1, "$x", "!r", {}, 10),), ())
    assert iso.on_refusal(x, 400, 0) is Verdict.QUARANTINED
    iso.on_success(Batch((PduItem(2, "$ok", "!r", {}, 10),), ()))
    assert iso.on_refusal(x, 400, 0) is Verdict.QUARANTINED
    assert iso.on_refusal(x, 400, 0) is Verdict.DROP
    pair = Batch((PduItem(3, "$a", "!r", {}, 10), PduItem(4, "$b", "!r", {}, 10)), ())
    verdicts = [iso.on_refusal(pair, 400, 0) for _ in range(MAX_REFUSALS_WITHOUT_SUCCESS)]
    assert verdicts[:-1] == [Verdict.SPLIT] * (MAX_REFUSALS_WITHOUT_SUCCESS - 1)
    assert verdicts[-1] is Verdict.PROBE
