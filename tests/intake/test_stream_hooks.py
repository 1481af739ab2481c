"""The hooks of the stream table reached through the intake's dispatch (native schema,
real queues, loopback HTTP), for the streams no other intake test feeds directly:
``to_device`` pokes a remote server's outbox (not a local user's), ``federation`` hands
main's EDUs to the queues, and a stream outside the table only has its token noted."""

from __future__ import annotations

from federation_sender.replication.rows import Edu, EduRow, KeyedEduRow, ToDeviceStreamRow
from federation_sender.storage.backend import NativeBackend
from federation_sender.testing.intake import native_intake
from federation_sender.testing.queue_harness import ALICE, ME, Harness

D = "r1.test"


async def test_to_device_rows_poke_the_remote_servers_outbox(h: Harness) -> None:
    await h.start()
    intake = native_intake(h.m, NativeBackend(h.engine), ME, h.clock)
    h.m.enqueue_edu(D, "m.warmup", {})  # a live queue that has read its outbox
    await intake.on_rows("to_device", "master", 1, [])  # the first token: every queue reads
    await h.settle()
    sid = await h.writer.to_device(D, {"message": 1})  # not announced to the queue yet
    await intake.on_rows("to_device", "master", sid, [ToDeviceStreamRow(ALICE)])
    await h.settle()
    assert [e["edu_type"] for e in h.fake.received_edus(D)] == ["m.warmup"], \
        "a local user's row pokes no remote outbox"
    await intake.on_rows("to_device", "master", sid, [ToDeviceStreamRow(D)])
    await h.settle()
    assert [e["edu_type"] for e in h.fake.received_edus(D)] == [
        "m.warmup", "m.direct_to_device"]


async def test_federation_rows_become_queued_edus(h: Harness) -> None:
    await h.start()
    intake = native_intake(h.m, NativeBackend(h.engine), ME, h.clock)
    await intake.on_rows("federation", "master", 3, [
        EduRow(Edu(ME, D, "m.custom", {"n": 1})),
        KeyedEduRow(("k",), Edu(ME, D, "m.keyed", {"n": 2})),
    ])  # fmt: skip
    await h.settle()
    assert sorted((e["edu_type"], e["content"]["n"]) for e in h.fake.received_edus(D)) == [
        ("m.custom", 1), ("m.keyed", 2)]


async def test_a_stream_outside_the_table_only_has_its_token_noted(h: Harness) -> None:
    await h.start()
    intake = native_intake(h.m, NativeBackend(h.engine), ME, h.clock)
    await intake.on_rows("backfill", "master", 4, [])
    assert intake.tokens == {"backfill": 4}
