"""The device_lists stream with two writers (``stream_writers.device_lists``, which
Synapse 1.163 allows, unlike ``to_device``): outbox reads are bounded by what every
writer finished, and a destination whose rows came in above that bound is told once
the bound reaches them (native schema, real queues, loopback HTTP)."""

from __future__ import annotations

from federation_sender.replication.rows import DeviceListsRow
from federation_sender.storage import schema
from federation_sender.storage.backend import NativeBackend
from federation_sender.testing.intake import native_intake
from federation_sender.testing.main_writes import insert_rows, poke_row
from federation_sender.testing.queue_harness import ALICE, ME, Harness

DEST = "r1.test"


def device_list_edus(h: Harness) -> list[dict[str, object]]:
    return [e for e in h.fake.received_edus(DEST) if e.get("edu_type") == "m.device_list_update"]


async def test_a_row_above_a_slow_writer_waits_for_it(h: Harness) -> None:
    await h.start()
    handler = native_intake(
        h.m, NativeBackend(h.engine), ME, h.clock, device_list_writers=("w1", "w2")
    )
    await handler.prepare()
    for w in ("w1", "w2"):
        await handler.on_rows("device_lists", w, 5, [])  # both announce where they are
    assert handler.tokens["device_lists"] == 5

    # w2 took 6 and is slow to commit it; w1 commits 7 meanwhile.
    async with h.engine.begin() as conn:
        await insert_rows(conn, schema.device_lists_outbound_pokes,
                          [poke_row(DEST, 7, ALICE, "DEV7", 0, {"device_id": "DEV7"})])
    await handler.on_rows("device_lists", "w1", 7, [DeviceListsRow(ALICE, False, True)])
    await h.settle()
    assert handler.tokens["device_lists"] == 5, "a read up to 7 would skip 6 for good"
    assert device_list_edus(h) == []  # not told yet: its read would stop below 6

    await handler.on_rows("device_lists", "w2", 6, [])  # 6 committed: 6 and 7 are done
    await h.settle()
    assert handler.tokens["device_lists"] == 7
    assert [e["content"]["device_id"] for e in device_list_edus(h)] == ["DEV7"]  # type: ignore[index]


async def test_one_writer_is_its_token(h: Harness) -> None:
    """The single-writer shape (main alone, or no Synapse configuration)."""
    await h.start()
    for writers in (("master",), None):
        handler = native_intake(
            h.m, NativeBackend(h.engine), ME, h.clock, device_list_writers=writers
        )
        await handler.prepare()
        await handler.on_rows("device_lists", "master", 9, [])
        assert handler.tokens["device_lists"] == 9
