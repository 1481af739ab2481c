"""positions.py: batches, stale rows, gaps, resets, histories, linear positions."""

from __future__ import annotations

from federation_sender.replication.positions import (
    Advance,
    Fetch,
    Reset,
    StreamPositions,
    Update,
    fetch_gap,
)
from federation_sender.replication.rows import CachesRow, ToDeviceStreamRow
from federation_sender.testing.replication import WriterDatabase

A, B, C = ToDeviceStreamRow("a"), ToDeviceStreamRow("b"), ToDeviceStreamRow("c")


def test_batch_is_delivered_with_the_next_numeric_token() -> None:
    p = StreamPositions({("to_device", "master"): 1})
    assert p.on_rdata("to_device", "master", None, A) is None
    assert p.on_rdata("to_device", "master", None, B) is None
    assert p.get("to_device", "master") == 1
    assert p.on_rdata("to_device", "master", 2, C) == Update("to_device", "master", 2, (A, B, C))
    assert p.get("to_device", "master") == 2


def test_batches_are_per_writer() -> None:
    p = StreamPositions()
    p.on_rdata("to_device", "w1", None, A)
    assert p.on_rdata("to_device", "w2", 5, B) == Update("to_device", "w2", 5, (B,))
    assert p.on_rdata("to_device", "w1", 3, C) == Update("to_device", "w1", 3, (A, C))


def test_position_discards_a_pending_batch() -> None:
    p = StreamPositions({("to_device", "master"): 1})
    p.on_rdata("to_device", "master", None, A)
    assert p.on_position("to_device", "master", 1, 4) == Advance(4)
    assert p.on_rdata("to_device", "master", 5, B) == Update("to_device", "master", 5, (B,))


def test_rows_at_or_below_the_position_are_dropped() -> None:
    p = StreamPositions({("to_device", "master"): 5})
    assert p.on_rdata("to_device", "master", 5, A) is None
    assert p.on_rdata("to_device", "master", 3, A) is None
    assert p.get("to_device", "master") == 5


def test_position_rules() -> None:
    p = StreamPositions({("s", "m"): 5})
    assert p.on_position("s", "m", 5, 5) is None
    assert p.on_position("s", "m", 3, 8) == Advance(8)  # prev <= cur <= new
    assert p.on_position("s", "m", 10, 12) == Fetch(8, 12)  # cur < prev: a gap
    assert p.get("s", "m") == 8  # fetch first, then move
    p.advance("s", "m", 12)
    assert p.on_position("s", "m", 2, 2) == Reset(2)  # went backwards: a reset
    assert p.get("s", "m") == 2
    fresh = StreamPositions()
    assert fresh.on_position("s", "m", 7, 9) == Advance(9)  # nothing known: adopt


def test_history_change_resets_to_the_start_of_the_new_history() -> None:
    p = StreamPositions({("typing", "master"): 500})
    assert p.on_history("typing", "master", "h1", 0) is False  # first sight: just record
    assert p.get("typing", "master") == 500
    assert p.on_history("typing", "master", "h1", 0) is False
    assert p.on_history("typing", "master", "h2", 0) is True
    assert p.get("typing", "master") == 0
    # and then rows of the new history are not stale
    assert p.on_rdata("typing", "master", 1, A) == Update("typing", "master", 1, (A,))


def test_history_change_keeps_a_lower_position() -> None:
    p = StreamPositions({("events", "master"): 300})
    p.on_history("events", "master", "h1", 0)
    p.on_history("events", "master", "h2", 400)
    assert p.get("events", "master") == 300


def test_linear_and_per_writer_positions() -> None:
    p = StreamPositions({("events", "w1"): 10, ("events", "w2"): 7, ("caches", "w1"): 99})
    assert p.linear("events") == 7
    assert p.writer_positions("events") == {"w1": 10, "w2": 7}
    assert p.linear("typing") is None


def test_rollback_to_persisted() -> None:
    p = StreamPositions({("s", "m"): 1})
    p.on_rdata("s", "m", 2, A)
    p.mark_persisted("s", "m", 2)
    p.on_rdata("s", "m", 3, A)
    p.rollback_to_persisted()
    assert p.get("s", "m") == 2


async def test_fetch_gap_in_batches_while_limited() -> None:
    db = WriterDatabase()
    db.rows[("to_device", "master")] = [(t, ToDeviceStreamRow(str(t))) for t in range(1, 251)]
    fetcher = db.fetcher("to_device")
    updates = [u async for u in fetch_gap(fetcher, "to_device", "master", 0, 260)]
    assert [u.token for u in updates] == [100, 200, 260]
    assert [len(u.rows) for u in updates] == [100, 100, 50]
    assert [call[1:] for call in fetcher.calls] == [(0, 260, 100), (100, 260, 100), (200, 260, 100)]


async def test_fetch_gap_with_nothing_to_fetch() -> None:
    db = WriterDatabase()
    updates = [u async for u in fetch_gap(db.fetcher("s"), "s", "m", 5, 5)]
    assert updates == []


def test_out_of_order_tokens_of_a_multi_writer_stream_are_delivered_once() -> None:
    p = StreamPositions()
    row = CachesRow("get_user", ("@u:hs",), 1)
    assert p.on_rdata("caches", "w1", 5, row) == Update("caches", "w1", 5, (row,))
    # Token 3 completed after 5 on the writer: never seen, so not a duplicate.
    assert p.on_rdata("caches", "w1", 3, row) == Update("caches", "w1", 3, (row,))
    assert p.get("caches", "w1") == 5  # the position does not move back
    assert p.on_rdata("caches", "w1", 3, row) is None
    assert p.on_rdata("caches", "w1", 5, row) is None
    # Single-writer streams keep the plain rule: at or below the position is stale.
    p.on_rdata("to_device", "m", 5, A)
    assert p.on_rdata("to_device", "m", 3, A) is None


def test_the_persisted_position_never_moves_back_like_the_database() -> None:
    p = StreamPositions({("s", "m"): 10})
    assert p.on_position("s", "m", 2, 2) == Reset(2)
    p.on_rdata("s", "m", 3, A)
    p.mark_persisted("s", "m", 3)  # the database ignored it: 10 stays
    assert p.persisted() == {("s", "m"): 10}
