from __future__ import annotations

import json

from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.storage import outboxes as ob
from federation_sender.storage import positions as pos
from federation_sender.storage import txlog
from federation_sender.testing.queue_writer import HomeserverWriter


async def test_outboxes_read_by_stream_id_and_mark_sent(engine: AsyncEngine) -> None:
    w = HomeserverWriter(engine)
    t1 = await w.to_device("d", {"m": 1})
    t2 = await w.to_device("d", {"m": 2})
    await w.to_device("other", {"m": 3})
    d1 = await w.device_list("d", "@u:l", "DEV1")
    async with engine.begin() as conn:
        rows = await ob.unsent_to_device(conn, "d", -1, 10)
        assert [r.stream_id for r in rows] == [t1, t2]
        assert [r.stream_id for r in await ob.unsent_to_device(conn, "d", t1, 10)] == [t2]
        await ob.mark_to_device_sent(conn, "d", [t1], 5)
        assert [r.stream_id for r in await ob.unsent_to_device(conn, "d", -1, 10)] == [t2]
        dl = await ob.unsent_device_lists(conn, "d", -1, 10)
        assert [(r.stream_id, r.user_id, r.device_id) for r in dl] == [(d1, "@u:l", "DEV1")]
        assert await ob.has_unsent(conn, "d")
        await ob.mark_device_lists_sent(conn, "d", [(d1, "@u:l", "DEV1")])
        await ob.mark_to_device_sent(conn, "d", [t2], 6)
        assert not await ob.has_unsent(conn, "d")
        assert await ob.has_unsent(conn, "other")


async def test_positions_never_move_backwards(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        assert await pos.load_position(conn, "s", "i") is None
        await pos.save_position(conn, "s", "i", 10)
        await pos.save_position(conn, "s", "i", 5)
        assert await pos.load_position(conn, "s", "i") == 10
        await pos.save_position(conn, "s", "i", 12)
        assert await pos.load_position(conn, "s", "i") == 12
        assert await pos.load_position(conn, "s", "j") is None


async def test_txlog_round_trip(engine: AsyncEngine) -> None:
    row = txlog.TxnLogRow("t1", "d", "w1", 2, 1, 300, "success", 200, 1000, 12, True, 9,
                          ("$a", "$b"), None)
    async with engine.begin() as conn:
        await txlog.log_transactions(conn, [row])
        await txlog.log_transactions(conn, [])
        got = await txlog.recent_transactions(conn, "d")
    assert got == [row]


async def test_txlog_keeps_any_event_id_and_null_fields(engine: AsyncEngine) -> None:
    """Rows travel to PostgreSQL by COPY (text format): ids that need escaping (quotes,
    backslashes, control or non-ASCII characters, as a hostile room v1 id could hold)
    and NULL columns read back exactly, on both databases."""
    odd = ('$plain:l', '$q"uote:l', "$back\\slash:l", "$ctl\x01:l", "$ünï:l", "$tab\t:l")
    rows = [
        txlog.TxnLogRow("t1", "d2", "w1", 1, 0, 10, "success", 200, 1000, 1, False, 5,
                        ("$abc:l", "$def_-1"), None),
        txlog.TxnLogRow("t2", "d2", "w1", len(odd), 0, 10, "transient", None, 1001, 0, True,
                        None, odd, 'connection "refused" \\N\t\n\r é'),
        txlog.TxnLogRow("t3", "d2", "w1", 0, 3, 10, "success", 200, 1002, 0, False, None,
                        (), None),
    ]
    async with engine.begin() as conn:
        await txlog.log_transactions(conn, rows)
        got = await txlog.recent_transactions(conn, "d2")
    assert got == rows[::-1]
    for ids in ((), ("$a",), odd):
        assert json.loads(txlog.event_ids_json(ids)) == list(ids)
