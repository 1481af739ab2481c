"""What our worker logs as ``fed1`` of a real Synapse 1.163 when it restarts behind and
when main wakes a destination: one INFO line with how many destinations start in
catch-up, no WARNING about the events stream (nothing is skipped: the intake reads
events from the database), and an INFO line naming a destination main's
``get_destination_retry_timings`` invalidation woke."""

from __future__ import annotations

import uuid

import pytest

from federation_sender.testing.replication_tap import ReplicationTap, cache_invalidations
from federation_sender.testing.synapse_peer import PeerNetwork
from tests.synapse.backend_support import OurWorker

pytestmark = pytest.mark.postgres


def test_restart_behind_logs_catch_up_and_no_events_warning(
    ours: OurWorker, network: PeerNetwork
) -> None:
    """A destination refusing when the worker stops is owed an event: it starts in
    catch-up. Events persisted while the worker was stopped are a gap in the events
    stream's position, which is no WARNING: the intake reads them and they arrive."""
    d = ours.d
    alice = d.client.register(f"alice_{uuid.uuid4().hex[:8]}")
    room_id = d.client.create_room(alice)
    down, up = network.add_peers(2)
    network.join(down, room_id, d.server_name)
    network.join(up, room_id, d.server_name)
    down.send_status = 503
    first = d.client.send_message(alice, room_id, "before the stop")
    network.wait_for(lambda: first in up.event_counts(room_id) and down.refused_transactions > 0,
                     what="the first message delivered to one, refused by the other")
    ours.stop()
    offset = len(ours.log_path.read_bytes())
    missed = [d.client.send_message(alice, room_id, f"while stopped {i}") for i in range(3)]
    ours.start()
    network.wait_for(lambda: all(e in up.event_counts(room_id) for e in missed),
                     what="the messages persisted while stopped")
    log = ours.log_path.read_bytes()[offset:].decode(errors="replace").splitlines()
    starts = [ln for ln in log if "in catch-up at start" in ln]
    assert len(starts) == 1 and " INFO " in starts[0], starts
    # Other tests' peers on the session's Synapse may be owed events too (how many
    # depends on which tests ran before this one on this worker's Synapse): the line
    # counts them all and names the first five, so it names the refusing one when there
    # are five or fewer, and never the one that took everything.
    head, _, names = starts[0].partition(
        " (events owed to them were recorded before the last stop): ")
    count = int(head.rsplit("destinations in catch-up at start: ", 1)[1])
    listed = [n for n in names.split(", ") if n != "…"]
    assert len(listed) == min(count, 5) and names.endswith("…") == (count > 5), starts[0]
    assert up.server_name not in listed, starts[0]
    if count <= 5:
        assert down.server_name in listed, starts[0]
    assert [ln for ln in log if " WARNING " in ln and "events/" in ln] == []
    down.send_status = 200
    network.send_transaction(down, d.server_name)  # back: main clears the backoff
    network.wait_for(lambda: all(e in down.event_counts(room_id) for e in missed),
                     what="the catch-up of the server that was down")


def test_destination_woken_by_mains_invalidation_is_logged(
    ours: OurWorker, network: PeerNetwork
) -> None:
    d = ours.d
    alice = d.client.register(f"alice_{uuid.uuid4().hex[:8]}")
    room_id = d.client.create_room(alice)
    peer = network.add_peer()
    network.join(peer, room_id, d.server_name)
    peer.send_status = 503

    def invalidated(tap: ReplicationTap, instance: str) -> bool:
        found = (cache_invalidations(ln, "get_destination_retry_timings") for ln in tap.lines)
        return any(f == (instance, [peer.server_name]) for f in found)

    with ReplicationTap(d.redis_url, d.server_name) as tap:
        missed = d.client.send_message(alice, room_id, "to a server that is down")
        tap.wait_for(lambda _: invalidated(tap, d.instance_name), what="our backoff")
        peer.send_status = 200
        network.send_transaction(peer, d.server_name)  # back, and it talks to main
        tap.wait_for(lambda _: invalidated(tap, "master"), what="main's invalidation")
        network.wait_for(lambda: missed in peer.event_counts(room_id), what="the missed event")
    woken = [ln for ln in ours.log_tail(100_000).splitlines()
             if f"destination {peer.server_name} woken: " in ln]
    assert len(woken) == 1 and " INFO " in woken[0], woken
    assert "get_destination_retry_timings invalidated" in woken[0]
