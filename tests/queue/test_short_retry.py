"""The short-retry phase over real HTTP with the fake clock: a destination that does not
answer is retried in memory every 2 s or sooner for 30 s, then on Synapse's in-request
schedule, before the persisted backoff; a wake-up (main's invalidation of the retry
timings, REMOTE_SERVER_UP) cuts its wait short."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from federation_sender.queue.core.states import DestinationState
from federation_sender.testing.queue_harness import ALICE, Harness, room_with

D = "r1.test"


async def start_down(h: Harness) -> str:
    await room_with(h, "!a:l", D)
    await h.start()
    h.fake.behave(D, status=503)
    e = await h.writer.message("!a:l", ALICE)
    h.poke()
    await h.settle()
    return e.event_id


async def test_a_short_outage_is_over_within_2_s_of_the_return_and_nothing_persists(
    h: Harness,
) -> None:
    event_id = await start_down(h)
    st = h.m.status(D)
    assert st is not None and st.short_retrying and st.state is DestinationState.BACKING_OFF
    assert st.retry_interval_ms == 0 and st.next_retry_ts_ms is not None
    snap = h.m.snapshot()  # the metrics' gauges
    assert (snap.short_retrying, snap.backing_off) == (1, 1), snap
    # The statuses' sums: the one event held, nothing in flight between retries.
    assert (snap.pending_destinations, snap.pending_pdus, snap.pending_edus,
            snap.catching_up, snap.in_flight_transactions) == (1, 1, 0, 0, 0), snap
    await h.advance_until(lambda: len(h.fake.attempts[D]) >= 6,
                          step_s=0.5, max_s=10)
    assert not (await h.dest_row(D)).retry_interval  # in memory only: main sees nothing
    h.fake.behave(D)  # back
    waited = await h.advance_until(lambda: bool(h.fake.accepted(D)), step_s=0.25, max_s=60)
    assert waited <= 2.0
    assert {a.txn_id for a in h.fake.attempts[D]} == {h.fake.attempts[D][0].txn_id}
    assert h.fake.received_event_ids(D) == [event_id]
    st = h.m.status(D)
    assert st is not None and not st.short_retrying
    assert h.m.snapshot().short_retrying == 0
    assert h.observer.short_retries[-1] == (D, True)  # the retry that got through
    assert all(not answered for _d, answered in h.observer.short_retries[:-1])
    assert not (await h.dest_row(D)).retry_interval


def phase_end_line(caplog: pytest.LogCaptureFixture) -> tuple[str, int, int, int]:
    """The phase's last line: (how it ended, retries, short ones, long ones)."""
    (line,) = [r.getMessage() for r in caplog.records
               if re.search(r" (answers again|did not answer) ", r.getMessage())]
    m = re.fullmatch(rf"destination {D} (answers again after|did not answer) (\d+) retries "
                     r"\((\d+) short, (\d+) long\)(; backing off)?", line)
    assert m is not None, line
    return m[1], int(m[2]), int(m[3]), int(m[4])


async def test_a_destination_that_stays_down_reaches_the_persisted_backoff(
    h: Harness, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="federation_sender.queue")
    await start_down(h)
    waited = await h.advance_until(
        lambda: h.m.status(D).retry_interval_ms > 0,  # type: ignore[union-attr]
        step_s=2, max_s=1_000)
    # 30 s of probes, then Synapse's 10 long retries (4 s, 16 s, 8 x 60 s, jitter 0.8-1.4).
    assert 30 + (4 + 16 + 480) * 0.8 <= waited <= 30 + (4 + 16 + 480) * 1.4 + 4
    attempts = len(h.fake.attempts[D])
    assert 1 + 15 + 10 <= attempts <= 1 + 60 + 10
    # The line tells the probe window's retries from the long schedule's (#42.6: it
    # called all of them short).
    ended, retries, short, long = phase_end_line(caplog)
    assert (ended, retries, short, long) == ("did not answer", attempts - 1, retries - 10, 10)
    row = await h.dest_row(D)
    assert row.retry_interval == 600_000  # then the schedule as before: no second phase
    st = h.m.status(D)
    assert st is not None and not st.short_retrying
    await h.advance(600)
    assert len(h.fake.attempts[D]) == attempts + 1
    assert (await h.dest_row(D)).retry_interval >= 600_000 * 2 * 0.8


async def test_a_return_during_the_long_retries_says_how_many_were_long(
    h: Harness, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="federation_sender.queue")
    await start_down(h)
    # 30 s of probes, then long retries 4 s and 16 s (x 0.8-1.4) apart, the third 60 s.
    for _ in range(int(30 + 4 * 1.4 + 16 * 1.4 + 1)):
        await h.advance(1)
    h.fake.behave(D)  # back
    await h.advance_until(lambda: bool(h.fake.accepted(D)), step_s=1, max_s=200)
    ended, retries, short, long = phase_end_line(caplog)
    assert (ended, retries) == ("answers again after", len(h.fake.attempts[D]) - 1)
    assert long == 3 and short == retries - long and short >= 15


async def test_main_s_invalidation_and_remote_server_up_cut_a_long_retry_short(
    h: Harness,
) -> None:
    h.settings = replace(h.settings, short_retry_probe_window_s=0.0)  # long retries at once
    await start_down(h)
    await h.advance(6)  # past the first long retry (4 s at most 5.6): now a 16 s wait
    n = len(h.fake.attempts[D])
    assert n == 2 and h.m.status(D).short_retrying  # type: ignore[union-attr]
    await h.m.retry_timings_changed(D)  # main: the destination contacted us
    await h.settle()
    assert len(h.fake.attempts[D]) == 3  # at once, and still down: the phase goes on
    st = h.m.status(D)
    assert st is not None and st.short_retrying and st.retry_interval_ms == 0
    h.fake.behave(D)
    await h.m.remote_server_up(D)
    await h.settle()
    assert len(h.fake.accepted(D)) == 1
