"""The EDU fan-outs' view of rooms through the storage backend (native schema)."""

from __future__ import annotations

from federation_sender.edus.room_hosts import StorageRoomHosts
from federation_sender.storage.backend import NativeBackend
from federation_sender.storage.protocols import EventMeta
from federation_sender.testing.queue_harness import ALICE, ME, Harness, room_with


async def test_hosts_follow_memberships_and_events_have_their_sender(h: Harness) -> None:
    await room_with(h, "!r:l", "a.test", "b.test")
    await h.writer.membership("!r:l", "@bob:b.test", "leave")
    ev = await h.writer.message("!r:l", ALICE)
    hosts = StorageRoomHosts(NativeBackend(h.engine))

    assert await hosts.current_hosts("!r:l") == {ME, "a.test"}
    assert await hosts.receipt_hosts("!r:l") == {ME, "a.test"}
    meta = await hosts.event_meta("!r:l", ev.event_id)
    assert meta is not None and meta.sender == ALICE
    assert meta == EventMeta(ALICE, meta.received_ts) and meta.received_ts > 0
    assert await hosts.event_meta("!r:l", "$unknown") is None
    assert await hosts.event_meta("!other:l", ev.event_id) is None
