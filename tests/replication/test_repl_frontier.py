"""The events frontier with several writers (replication/frontier.py): the intake reads
only below what every writer finished, an idle writer holds it back only until its
next POSITION, gapless runs move it, and nothing goes backwards."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random

import pytest

from federation_sender.intake.streams import ROW_PARSERS
from federation_sender.replication.client import ReplicationClient
from federation_sender.replication.frontier import WritersFrontier
from federation_sender.testing.clock import FakeClock
from federation_sender.testing.replication import (
    InMemoryPositionStore,
    MemorySession,
    MemoryTransport,
    RecordingHandler,
)

W = ("persister1", "persister2")


def test_frontier_is_the_minimum_over_writers() -> None:
    f = WritersFrontier(W, start=200)
    # The scenario of issue 34: persister1 publishes 209..213 while persister2 still
    # has 206 in flight. Reading up to 213 would skip 206.
    for token in range(209, 214):
        assert f.advance("persister1", token) == 200
    assert f.advance("persister2", 205) == 205
    assert f.advance("persister2", 206) == 206
    # 207 and 208 were never reported (allocated, unused): the minimum decides.
    assert f.advance("persister2", 213) == 213


def test_idle_writer_holds_back_until_its_position_command() -> None:
    f = WritersFrontier(W, start=10)
    f.advance("persister2", 10)
    assert f.advance("persister1", 12) == 10
    assert f.advance("persister1", 14) == 10
    # persister2 has nothing in flight: it adopts the highest token it saw and says so
    # with a POSITION about a second later (Synapse's ReplicationStreamer).
    assert f.advance("persister2", 14) == 14


def test_gapless_run_moves_without_the_idle_writer() -> None:
    f = WritersFrontier(W, start=100)
    assert f.advance("persister1", 101) == 101
    assert f.advance("persister1", 102) == 102
    assert f.advance("persister1", 104) == 102  # 103 unknown: stop there
    assert f.advance("persister2", 103) == 104  # 103 fills the gap; 104 was seen


def test_writer_that_never_reported_counts_at_start() -> None:
    f = WritersFrontier(W, start=50)
    assert f.advance("persister1", 60) == 50
    assert f.advance("persister1", 70) == 50
    f.seed("persister2", 55)  # stored: everything of persister2 up to 55 was read
    assert f.frontier == 55


def test_seeds_are_lower_bounds_and_ignored_without_configured_writers() -> None:
    f = WritersFrontier(W, start=50)
    f.seed("persister1", 80)
    f.seed("persister2", 40)  # below start: start stands
    assert f.frontier == 50
    f.seed("persister2", 70)
    assert f.frontier == 70
    f.seed("stranger", 90)  # not configured: not seeded
    assert f.positions.keys() == set(W)
    dyn = WritersFrontier(None, start=5)
    dyn.seed("old-writer", 3)  # a stored name may be gone: it must not hold us back
    assert dyn.advance("master", 9) == 9


def test_single_writer_is_its_latest_token() -> None:
    f = WritersFrontier(None, start=0)
    assert [f.advance("master", t) for t in (3, 4, 9)] == [3, 4, 9]
    g = WritersFrontier(["master"], start=2)
    assert [g.advance("master", t) for t in (3, 4, 9)] == [3, 4, 9]


def test_unconfigured_writer_is_counted_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    f = WritersFrontier(["persister1"], start=10)
    with caplog.at_level(logging.WARNING):
        assert f.advance("persister9", 12) == 10
        assert f.advance("persister1", 15) == 12
        f.advance("persister9", 16)
    notes = [r.getMessage() for r in caplog.records if "not in stream_writers" in r.getMessage()]
    assert len(notes) == 1 and "persister9" in notes[0]
    assert f.frontier == 16  # 16 follows 15 (a gapless run)


def test_nothing_goes_backwards() -> None:
    f = WritersFrontier(W, start=0)
    f.advance("persister1", 30)
    f.advance("persister2", 30)
    assert f.frontier == 30
    assert f.advance("persister2", 20) == 30  # a replay or a reset: nothing moves back
    assert f.positions["persister2"] == 30
    assert f.advance("persister1", 31) == 31


async def test_an_events_writer_going_backwards_is_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A restored database: the writer's POSITION is below what we stored. The client
    adopts it (later rows are not stale) and says so as a warning for ``events``, at
    info level for an in-memory stream such as ``typing`` (reset at every restart)."""
    clock = FakeClock()
    store = InMemoryPositionStore({("events", "persister1"): 50, ("typing", "master"): 9})
    session = MemorySession(
        [b"SERVER hs\nPOSITION events persister1 20 20\nPOSITION typing master 1 1\n"],
        clock, hold_open=True,
    )  # fmt: skip
    handler = RecordingHandler()
    client = ReplicationClient(
        MemoryTransport([session]), instance_name="fed1", store=store, fetchers={},
        handler=handler, clock=clock, streams={s: ROW_PARSERS[s] for s in ("events", "typing")},
    )  # fmt: skip
    task = asyncio.create_task(client.run())
    try:
        with caplog.at_level(logging.INFO):
            await handler.wait_for(lambda: handler.last_token("typing") == 1)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    notes = {(r.levelno, r.getMessage()) for r in caplog.records if "backwards" in r.getMessage()}
    assert notes == {
        (logging.WARNING, "replication: events/persister1 went backwards from 50 to 20"),
        (logging.INFO, "replication: typing/master went backwards from 9 to 1"),
    }


def test_replayed_tokens_below_a_seed_are_quiet(caplog: pytest.LogCaptureFixture) -> None:
    """After a restart the replication client may deliver again rows above its stored
    position but below the intake's: not a regression, no warning."""
    f = WritersFrontier(W, start=100)
    with caplog.at_level(logging.WARNING):
        assert f.advance("persister1", 90) == 100
        assert f.advance("persister2", 95) == 100
        assert f.advance("persister1", 110) == 100
        assert f.advance("persister2", 120) == 110
    assert caplog.records == []


def test_interleaved_commits_never_pass_an_unfinished_ordering() -> None:
    """Random commit orders of two writers sharing one sequence: the frontier never
    passes a stream ordering that is not committed yet."""
    rng = random.Random(34)
    for _ in range(200):
        orderings = list(range(1, 41))
        owner = {o: W[rng.randrange(2)] for o in orderings}
        committed: set[int] = set()
        f = WritersFrontier(W, start=0)
        # Each writer commits its own orderings in order, the two interleave at random.
        queues = {w: [o for o in orderings if owner[o] == w] for w in W}
        while any(queues.values()):
            w = rng.choice([w for w in W if queues[w]])
            o = queues[w].pop(0)
            committed.add(o)
            upto = f.advance(w, o)
            assert all(x in committed for x in range(1, upto + 1)), (upto, sorted(committed))
        for w in W:  # both idle: each announces the highest token it saw
            f.advance(w, 40)
        assert f.frontier == 40


def test_committed_orderings_bridge_a_writer_that_is_down() -> None:
    """After our restart, persister2 is down at its stored 100; persister1 wrote 101..120
    before the restart (not reported again) and writes on from 121. The committed rows
    read at start make a gapless run with persister1's new tokens."""
    f = WritersFrontier(W, start=100)
    f.seed("persister1", 120)
    assert f.advance("persister1", 121) == 100
    assert f.committed(range(101, 121)) == 121
    assert f.advance("persister1", 122) == 122
    # A hole (an ordering taken and not committed, perhaps in flight) stops the run.
    g = WritersFrontier(W, start=100)
    assert g.committed([101, 102, 104]) == 102
    assert g.advance("persister1", 105) == 102
