"""Replication gaps of the outbox streams filled from the database (native schema)."""

from __future__ import annotations

from federation_sender.replication.positions import fetch_gap
from federation_sender.replication.rows import DeviceListsRow, ToDeviceStreamRow
from federation_sender.storage.stream_fetchers import common_fetchers
from federation_sender.testing.queue_harness import ALICE, Harness


async def test_outbox_gaps_are_read_back(h: Harness) -> None:
    fetchers = common_fetchers(h.engine)
    assert set(fetchers) == {"to_device", "device_lists"}
    before = await h.writer.to_device("r1.test", {"message_id": "m0"})
    for i in range(5):
        await h.writer.to_device(f"r{i % 2}.test", {"message_id": f"m{i}"})
    await h.writer.device_list("r1.test", ALICE, "DEV")
    last = await h.writer.device_list("r2.test", ALICE, "DEV2")

    updates = [u async for u in fetch_gap(fetchers["to_device"], "to_device", "master",
                                          before, last, batch_rows=2)]
    rows = [r for u in updates for r in u.rows]
    assert rows == [ToDeviceStreamRow(f"r{i % 2}.test") for i in range(5)]
    assert updates[-1].token == last and len(updates) >= 3  # batches of two, then the rest

    lists = [r for u in [u async for u in fetch_gap(fetchers["device_lists"], "device_lists",
                                                    "master", before, last)] for r in u.rows]
    assert lists == [DeviceListsRow(ALICE, False, True)] * 2


async def test_rows_of_one_stream_id_are_never_split(h: Harness) -> None:
    fetcher = common_fetchers(h.engine)["device_lists"]
    sid = await h.writer.device_list("r1.test", ALICE, "DEV")
    from sqlalchemy import insert

    from federation_sender.storage import schema as s
    async with h.engine.begin() as conn:  # the same change poked to more servers
        await conn.execute(insert(s.device_lists_outbound_pokes), [
            {"destination": d, "stream_id": sid, "user_id": f"@{d}:x", "device_id": "D",
             "ts": 0, "content_json": "{}"} for d in ("r2.test", "r3.test")])
    rows, upto, limited = await fetcher.fetch("master", 0, sid + 5, 2)
    assert (len(rows), upto, limited) == (3, sid, True)
    rows, upto, limited = await fetcher.fetch("master", sid, sid + 5, 2)
    assert (rows, upto, limited) == ([], sid + 5, False)


async def test_the_first_outbox_token_makes_live_queues_read_again(h: Harness) -> None:
    """Beside Synapse, outbox reads stop at the stream's token; a queue that read before
    the first token arrived found nothing and must read again once it is known."""
    from federation_sender.storage.backend import NativeBackend
    from federation_sender.testing.intake import native_intake
    from federation_sender.testing.queue_harness import ME

    await h.start()
    handler = native_intake(h.m, NativeBackend(h.engine), ME, h.clock)
    h.m.enqueue_edu("r1.test", "m.warmup", {})  # a live queue that has read its outbox
    await h.settle()
    await h.writer.device_list("r1.test", ALICE, "DEV")  # not announced to the queue
    await handler.on_rows("device_lists", "master", 7, [])  # the first token, no rows
    await h.settle()
    assert [e["edu_type"] for e in h.fake.received_edus("r1.test")] == [
        "m.warmup", "m.device_list_update"]
    assert handler.tokens == {"device_lists": 7}
