from __future__ import annotations

import json

from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.model import DeviceListRow, ToDeviceRow
from federation_sender.storage import positions as pos
from federation_sender.storage import txlog
from federation_sender.storage.backend import NativeTx
from federation_sender.storage.hosts import RoomHostsCache
from federation_sender.testing.queue_writer import HomeserverWriter


async def test_outboxes_read_by_stream_id_and_mark_sent(engine: AsyncEngine) -> None:
    w = HomeserverWriter(engine)
    t1 = await w.to_device("d", {"m": 1})
    t2 = await w.to_device("d", {"m": 2})
    await w.to_device("other", {"m": 3})
    d1 = await w.device_list("d", "@u:l", "DEV1")
    async with engine.begin() as conn:
        outbox = NativeTx(conn, RoomHostsCache()).outbox

        def ids(rows: tuple[list[ToDeviceRow], list[DeviceListRow]]) -> tuple[list[int], ...]:
            return [r.stream_id for r in rows[0]], [r.stream_id for r in rows[1]]

        assert ids(await outbox.unsent_outbox("d", -1, -1, 10)) == ([t1, t2], [d1])
        assert ids(await outbox.unsent_outbox("d", t1, d1, 10)) == ([t2], [])
        assert ids(await outbox.unsent_outbox("d", -1, -1, 1)) == ([t1], [d1])
        await outbox.ack_to_device("d", [t1], 5)
        to_device, device_lists = await outbox.unsent_outbox("d", -1, -1, 10)
        assert [r.stream_id for r in to_device] == [t2]
        assert [(r.stream_id, r.user_id, r.device_id) for r in device_lists] == [
            (d1, "@u:l", "DEV1")
        ]
        assert await outbox.device_list_destinations(["@u:l"]) == ["d"]
        assert await outbox.destinations_with_unsent(["d", "other", "x"]) == {"d", "other"}
        await outbox.ack_device_lists("d", [(d1, "@u:l", "DEV1")])
        await outbox.ack_to_device("d", [t2], 6)
        assert await outbox.unsent_outbox("d", -1, -1, 10) == ([], [])
        assert await outbox.device_list_destinations(["@u:l"]) == []
        assert await outbox.destinations_with_unsent(["d", "other"]) == {"other"}
        assert await outbox.destinations_with_unsent([]) == set()


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
