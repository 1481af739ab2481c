"""Our worker as Synapse 1.163's federation sender in a room Synapse holds with partial state.

A local user joins a room a fake peer hosts; the peer's ``send_join`` answer omits
members ("faster joins") and names one more server, so main records the room in
``partial_state_rooms`` with the servers named at the join. A third server's user is
in the room's state (kept in the answer, as a hero's membership is) but its server is
not named: the joined hosts of the state would include it, Synapse's rule does not. As
Synapse's own worker does (``test_synapse_own_sender.py``), ours sends the room's events
to exactly the servers named at the join.
"""

from __future__ import annotations

import uuid

import pytest

from federation_sender.testing.synapse_peer import PeerNetwork
from tests.synapse.backend_support import OurWorker

pytestmark = pytest.mark.postgres




def test_backend_partial_state_room_goes_to_the_servers_named_at_join(
    ours: OurWorker, network: PeerNetwork
) -> None:
    d = ours.d
    alice = d.client.register(f"alice_{uuid.uuid4().hex[:8]}")
    host, named, unnamed = network.add_peers(3)
    room_id = network.host_room(host, [named.server_name], members=[unnamed])
    d.client.join(alice, room_id, via=[host.server_name])

    def sql(query: str) -> str:
        return d.sql(query).strip()

    assert sql(f"SELECT count(*) FROM partial_state_rooms WHERE room_id = '{room_id}'") == "1"
    servers = sql(
        f"SELECT server_name FROM partial_state_rooms_servers WHERE room_id = '{room_id}'"
    ).split()
    assert sorted(servers) == sorted([host.server_name, named.server_name])
    # The state Synapse holds says the unnamed server is in the room.
    assert (
        sql(
            "SELECT membership FROM current_state_events WHERE type = 'm.room.member' "
            f"AND room_id = '{room_id}' AND state_key = '{unnamed.user_id()}'"
        )
        == "join"
    )
    # A room of main's the unnamed server is in, for a fence after the messages.
    fence_room = d.client.create_room(alice)
    network.join(unnamed, fence_room, d.server_name)

    sent = [d.client.send_message(alice, room_id, f"partial {i}") for i in range(3)]
    network.wait_for(
        lambda: all(e in p.event_counts(room_id) for p in (host, named) for e in sent),
        what="the messages at both servers named at the join",
    )
    # One transaction in flight per destination, in stream order: had the messages (or
    # alice's join) been meant for the unnamed server, they would be there before this.
    fence = d.client.send_message(alice, fence_room, "fence")
    network.wait_for(lambda: fence in unnamed.event_counts(fence_room), what="the fence")
    for p in (host, named):
        counts = p.event_counts(room_id)
        assert {e: counts[e] for e in sent} == dict.fromkeys(sent, 1), p.server_name
        assert [c for c in counts.values() if c != 1] == [], p.server_name
        assert p.rejected == []
    assert unnamed.event_counts(room_id) == {}
    assert ours.running
