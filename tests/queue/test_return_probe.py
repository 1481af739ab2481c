"""The return probe (issue #44.4): a destination in its persisted backoff with something
to send, down for less than an hour, is asked once a minute whether it is back (``GET
/_matrix/federation/v1/version``) and sent to at once when it is, instead of waiting
out a 600 s backoff; none is asked with nothing to send, nor after an hour, nor in
catch-up. The core's rule first (pure), then over real HTTP with the fake clock."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace

from sqlalchemy import text

from federation_sender.clock import time_ms
from federation_sender.queue.core.backoff import NO_SHORT_RETRY, BackoffPolicy, BackoffState
from federation_sender.queue.core.batching import Limits
from federation_sender.queue.core.catchup import pdu_item
from federation_sender.queue.core.destination import DestinationCore
from federation_sender.queue.core.steps import ProbeReturn, Send, Wait
from federation_sender.testing.queue_harness import ALICE, Harness, room_with
from federation_sender.transport.result import Outcome, SendResult
from tests.queue.test_catchup_plan import ev

D = "r1.test"
MIN = 60_000
DOWN = SendResult(Outcome.TRANSIENT, error="connection refused")


def _ids() -> Callable[[], str]:
    n = iter(range(1, 1_000_000))
    return lambda: f"t{next(n)}"


def failed_core(policy: BackoffPolicy | None = None, at_ms: int = 0) -> DestinationCore:
    """A live queue whose one transaction failed at ``at_ms``: backing off 600 s."""
    c = DestinationCore(D, policy or BackoffPolicy(short_retry=NO_SHORT_RETRY), Limits(),
                        random.Random(0), _ids(), catching_up=False)
    c.load(BackoffState(), 10)
    c.add_outbox([], [], True)
    c.outbox_read_started()
    c.add_pdu(pdu_item(ev(11)))
    step = c.next_step(at_ms)
    assert isinstance(step, Send)
    c.on_result(step.txn, DOWN, at_ms)
    assert c.backoff.retry_interval_ms == 600_000
    return c


def test_a_backed_off_destination_with_a_transaction_owed_is_asked_once_a_minute() -> None:
    c = failed_core()
    txn = c.current
    assert c.next_step(1_000) == Wait(MIN)  # the probe, not the backoff's 600 s
    assert isinstance(c.next_step(MIN), ProbeReturn)
    assert not c.on_return_probe(False, MIN)
    assert c.next_step(MIN + 1) == Wait(2 * MIN)
    assert isinstance(c.next_step(2 * MIN), ProbeReturn)
    assert c.on_return_probe(True, 2 * MIN)
    step = c.next_step(2 * MIN)
    assert isinstance(step, Send) and step.txn.txn_id == txn.txn_id  # at once, same id
    eff = c.on_result(step.txn, SendResult(Outcome.SUCCESS, 200), 2 * MIN)
    assert eff.succeeded and c.last_successful == 11


def test_a_failed_attempt_after_a_probe_backs_off_further_without_a_new_phase() -> None:
    policy = BackoffPolicy()  # with the short-retry phase: it must not start again
    c = DestinationCore(D, policy, Limits(), random.Random(0), _ids(), catching_up=False)
    c.load(BackoffState(retry_last_ts_ms=0, retry_interval_ms=600_000, failure_ts_ms=0), 10)
    c.outbox_read_started()
    c.add_pdu(pdu_item(ev(11)))
    assert isinstance(c.next_step(MIN), ProbeReturn)
    c.on_return_probe(True, MIN)
    step = c.next_step(MIN)
    assert isinstance(step, Send)
    eff = c.on_result(step.txn, DOWN, MIN)
    assert not c.short_retry.in_phase and eff.short_retry_ms is None
    assert c.backoff.retry_interval_ms >= 600_000 * 2 * 0.8 and c.backoff.failure_ts_ms == 0
    assert c.next_step(MIN + 1) == Wait(2 * MIN)  # still asked once a minute


def test_no_probe_with_nothing_to_send_after_an_hour_down_or_when_turned_off() -> None:
    # Nothing owed: the backoff is waited out (a dead destination costs nothing).
    idle = DestinationCore(D, BackoffPolicy(), Limits(), random.Random(0), _ids(),
                           catching_up=False)
    idle.load(BackoffState(retry_last_ts_ms=0, retry_interval_ms=600_000, failure_ts_ms=0), 5)
    idle.outbox_read_started()
    assert idle.next_step(MIN) == Wait(600_000)
    # Down since more than an hour: only the backoff's own retry.
    old = failed_core(at_ms=0)
    old.backoff = replace(old.backoff, failure_ts_ms=-3_600_000)
    assert old.next_step(MIN) == Wait(600_000)
    # Turned off (queue.return_probe_interval_s: 0).
    off = failed_core(BackoffPolicy(short_retry=NO_SHORT_RETRY, return_probe_s=0.0))
    assert off.next_step(MIN) == Wait(600_000)
    # A probe that would fall at or after the backoff's own retry is not made.
    late = failed_core(BackoffPolicy(short_retry=NO_SHORT_RETRY, return_probe_s=700.0))
    assert late.next_step(MIN) == Wait(600_000)


async def test_a_destination_back_during_its_backoff_gets_its_event_within_a_minute(
    h: Harness,
) -> None:
    h.without_short_retry()
    await room_with(h, "!a:l", D)
    await h.start()
    h.fake.behave(D, status=503)
    e = await h.writer.message("!a:l", ALICE)
    h.poke()
    await h.settle()
    assert (await h.dest_row(D)).retry_interval == 600_000  # persisted
    await h.advance(59)
    assert not h.fake.version_requests
    await h.advance(1)
    await h.advance(60)
    assert h.fake.version_requests.get(D) == 2  # asked at 60 s and 120 s, answered 503
    assert h.observer.return_probes == [(D, False), (D, False)]
    h.fake.behave(D)  # back
    waited = await h.advance_until(lambda: bool(h.fake.accepted(D)), step_s=5, max_s=600)
    assert waited <= 60
    assert h.fake.received_event_ids(D) == [e.event_id]
    assert not (await h.dest_row(D)).retry_interval  # the success reset the backoff
    assert h.fake.version_requests[D] == 3 and h.observer.return_probes[-1] == (D, True)


async def test_ten_thousand_dead_destinations_with_nothing_to_send_are_never_probed(
    h: Harness,
) -> None:
    """The probe's cost bound: none for destinations with nothing pending. 10,000 rows
    backing off (as a large server's dead peers are), each with its room's row at its
    position, beside one destination that is down with an event owed; ten minutes of
    the fake clock: the owed one is asked once a minute until its backoff's own retry,
    the 10,000 never."""
    now = time_ms(h.clock)
    async with h.engine.begin() as conn:
        await conn.execute(
            text("INSERT INTO destinations (destination, retry_last_ts, retry_interval,"
                 " failure_ts, last_successful_stream_ordering) VALUES (:d, :t, 600000,"
                 " :t, 5)"),
            [{"d": f"dead{i}.test", "t": now - 1_000} for i in range(10_000)])
        await conn.execute(
            text("INSERT INTO destination_rooms (destination, room_id, stream_ordering)"
                 " VALUES (:d, '!a:l', 5)"),
            [{"d": f"dead{i}.test"} for i in range(10_000)])
    h.without_short_retry()
    await room_with(h, "!b:l", D)
    await h.start()
    h.fake.behave(D, status=503)
    await h.writer.message("!b:l", ALICE)
    h.poke()
    await h.settle()
    for _ in range(10):
        await h.advance(60)
    # At 60, 120, ... 540 s; at 600 s the backoff's own retry is due instead.
    assert h.fake.version_requests == {D: 9}
    assert h.observer.return_probes == [(D, False)] * 9
    assert {d for d, *_ in h.observer.sent} == {D}
