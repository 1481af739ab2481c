"""server.py: the stream id generator (streams.md's table), RDATA/POSITION emission,
the backlog and PSYNC answers."""

from __future__ import annotations

import pytest

from federation_sender.replication import commands as c
from federation_sender.replication.server import ReplicationWriter, StreamIdGenerator, WriterStream


def test_streams_md_worked_example() -> None:
    gen = StreamIdGenerator(current=1)
    table = [
        ("reserve", 2, 1),
        ("reserve", 3, 1),
        ("complete", 3, 1),
        ("complete", 2, 3),
        ("reserve", 4, 3),
        ("reserve", 5, 3),
        ("reserve", 6, 3),
        ("complete", 5, 3),
        ("complete", 4, 5),
        ("complete", 6, 6),
    ]
    for action, token, expected_current in table:
        if action == "reserve":
            assert gen.reserve() == token
        else:
            gen.complete(token)
        assert gen.current == expected_current, (action, token)


def test_completing_twice_or_unreserved_is_a_bug() -> None:
    gen = StreamIdGenerator()
    with pytest.raises(ValueError):
        gen.complete(1)
    gen.complete(gen.reserve())
    with pytest.raises(ValueError):
        gen.complete(1)


def test_rdata_for_every_row_in_order_when_the_prefix_completes() -> None:
    s = WriterStream("caches", "master", current=1)
    t2, t3, t4 = s.reserve(), s.reserve(), s.reserve()
    assert s.complete(t3, [["c", None, 3]]) == []
    assert s.complete(t4, []) == []
    assert s.complete(t2, [["a", None, 2], ["b", None, 2]]) == [
        c.RdataCommand("caches", "master", None, ["a", None, 2]),
        c.RdataCommand("caches", "master", 2, ["b", None, 2]),
        c.RdataCommand("caches", "master", 3, ["c", None, 3]),
        c.PositionCommand("caches", "master", 3, 4),  # 4 completed without rows
    ]


def test_position_when_advancing_without_rows() -> None:
    s = WriterStream("to_device", "master", current=5)
    assert s.complete(s.reserve()) == [c.PositionCommand("to_device", "master", 5, 6)]


def test_writer_broadcasts_to_subscribers_and_typed_rows_are_serialised() -> None:
    from federation_sender.replication.rows import TypingRow

    w = ReplicationWriter("hs")
    w.add_stream("typing")
    seen: list[c.Command] = []
    w.subscribe("t", seen.extend)
    assert w.publish("typing", TypingRow("!r", ("@a:hs",))) == 1
    assert seen == [c.RdataCommand("typing", "master", 1, ["!r", ["@a:hs"]])]


def _stream_with_rows(n: int, backlog_tokens: int = 100) -> WriterStream:
    s = WriterStream("caches", "master", history_id="h1", backlog_tokens=backlog_tokens)
    for i in range(n):
        s.complete(s.reserve(), [["f", None, i]])
    return s


def test_plain_replicate_gets_position_only() -> None:
    s = _stream_with_rows(3)
    assert s.answer_replicate(None) == [c.PositionCommand("caches", "master", 3, 3)]


def test_psync_same_history_continues_from_the_backlog() -> None:
    s = _stream_with_rows(5)
    offer = c.PsyncOffer((c.StreamHave("caches", "master", "h1", 3),))
    assert s.answer_replicate(offer) == [
        c.HistoryCommand("caches", "master", "h1", 0),
        c.RdataCommand("caches", "master", 4, ["f", None, 3]),
        c.RdataCommand("caches", "master", 5, ["f", None, 4]),
        c.PositionCommand("caches", "master", 5, 5),
    ]


def test_psync_beyond_the_backlog_falls_back_to_the_database() -> None:
    s = _stream_with_rows(10, backlog_tokens=4)  # holds tokens 7..10
    offer = c.PsyncOffer((c.StreamHave("caches", "master", "h1", 5),))
    assert s.answer_replicate(offer) == [
        c.HistoryCommand("caches", "master", "h1", 0),
        c.PositionCommand("caches", "master", 10, 10),
    ]
    offer = c.PsyncOffer((c.StreamHave("caches", "master", "h1", 6),))
    assert len(s.answer_replicate(offer)) == 6  # HISTORY, 4 rows, POSITION


def test_psync_after_a_reset_serves_the_new_history_from_its_start() -> None:
    s = _stream_with_rows(5)
    s.reset(0, history_id="h2")
    s.complete(s.reserve(), [["new", None, 1]])
    offer = c.PsyncOffer((c.StreamHave("caches", "master", "h1", 5),))
    assert s.answer_replicate(offer) == [
        c.HistoryCommand("caches", "master", "h2", 0),
        c.RdataCommand("caches", "master", 1, ["new", None, 1]),
        c.PositionCommand("caches", "master", 1, 1),
    ]


def test_reset_tells_readers_history_and_position() -> None:
    w = ReplicationWriter("hs")
    w.add_stream("typing", history_id="h1")
    seen: list[c.Command] = []
    w.subscribe("t", seen.extend)
    w.reset_stream("typing", 0, history_id="h2")
    assert seen == [
        c.HistoryCommand("typing", "master", "h2", 0),
        c.PositionCommand("typing", "master", 0, 0),
    ]


def test_remote_server_up_is_relayed_to_everyone_but_its_origin() -> None:
    w = ReplicationWriter("hs")
    a: list[c.Command] = []
    b: list[c.Command] = []
    w.subscribe("a", a.extend)
    w.subscribe("b", b.extend)
    w.on_client_command(c.RemoteServerUpCommand("remote"), origin="a")
    assert a == [] and b == [c.RemoteServerUpCommand("remote")]
    w.on_client_command(c.FederationAckCommand("fed1", 7), origin="a")
    assert w.federation_acks == {"fed1": 7}
