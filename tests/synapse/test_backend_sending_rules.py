"""The sending rules of ``storage/synapse/events.py``, pinned on events a real Synapse 1.163
stored, with our worker as ``fed1`` and fake servers that speak federation with it.

Never sent (Synapse's ``_process_event_queue_loop`` and ``get_events_as_list``):

* an **out-of-band membership**: a local user rejects an invite from a server the
  homeserver is not in a room with (it left; the inviter's server is still joined).
  Synapse rejects it through the inviter (``make_leave``, ``send_leave``) and stores
  the leave as an outlier flagged ``out_of_band_membership``. Its prev event is the
  last one Synapse has state for, whose joined hosts hold the inviter: without the
  rule the leave would be sent there (and, were the invite its prev event instead, the
  room's current hosts would be used, which Synapse empties when it leaves a room);
* an event stored with **``proactively_send: false``**: Synapse sets it on a local
  user's join to a room another server hosts (``process_remote_join`` in
  ``handlers/federation_event.py``: the resident server sends the join to the room),
  and on the dummy events it sends to prune forward extremities. The join goes nowhere
  although its room's servers receive the user's next message;
* a **rejected** event: a server sends a message from a user of its own who is not in
  the room; Synapse stores it with a ``rejection_reason``. It is not ours (the sender
  rule withholds it as well), so what pins the rule is the row as we read it:
  ``rejected``, never sendable.

Each test fails with its rule removed (docs/synapse-reference.md, "Which events go where").
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable

import pytest

from federation_sender.queue.core.catchup import is_sendable
from federation_sender.storage.synapse import events as ev
from federation_sender.storage.synapse.database import create_synapse_engine
from federation_sender.testing.synapse_client import User
from federation_sender.testing.synapse_deployment import SynapseDeployment
from federation_sender.testing.synapse_peer import FederationPeer, PeerNetwork
from federation_sender.testing.waiting import wait_until_blocking
from tests.synapse.backend_support import OurWorker

pytestmark = pytest.mark.postgres


def _one(d: SynapseDeployment, query: str) -> str:
    out = d.sql(query).strip()
    assert out and "\n" not in out, (query, out)
    return out


def _metadata(d: SynapseDeployment, event_id: str) -> dict[str, object]:
    text = _one(d, f"SELECT internal_metadata FROM event_json WHERE event_id = '{event_id}'")
    meta: dict[str, object] = json.loads(text)
    return meta


def _until(cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Poll Synapse's database (it processes inbound PDUs after answering /send)."""
    wait_until_blocking(cond, what, timeout_s=timeout_s)


def _fence(d: SynapseDeployment, net: PeerNetwork, alice: User, peers: list[FederationPeer],
           room_id: str) -> None:
    """A message from alice that every peer must get: one transaction per destination is
    in flight and PDUs go in stream order, so what was going to be sent before it has
    been."""
    fence = d.client.send_message(alice, room_id, "fence")
    net.wait_for(lambda: all(fence in p.event_counts(room_id) for p in peers),
                 what="the fence at every peer")


def test_out_of_band_leave_rejecting_an_invite_is_not_sent(
    ours: OurWorker, network: PeerNetwork
) -> None:
    d = ours.d
    alice = d.client.register(f"alice_{uuid.uuid4().hex[:8]}")
    bob = d.client.register(f"bob_{uuid.uuid4().hex[:8]}")
    inviter = network.add_peer()
    room = d.client.create_room(alice, room_version="10")
    network.join(inviter, room, d.server_name)
    fence_room = d.client.create_room(alice)
    network.join(inviter, fence_room, d.server_name)
    d.client.leave(alice, room)  # the homeserver is in the room no more; the inviter is

    def latest(event_type: str, state_key: str | None = "") -> str:
        key = "" if state_key is None else f" AND state_key = '{state_key}'"
        return _one(d, f"SELECT event_id FROM events WHERE room_id = '{room}' AND type = "
                       f"'{event_type}'{key} ORDER BY stream_ordering DESC LIMIT 1")

    alice_leave = latest("m.room.member", alice.user_id)
    depth = int(_one(d, f"SELECT depth FROM events WHERE event_id = '{alice_leave}'"))
    create, power = latest("m.room.create"), latest("m.room.power_levels")
    invite = network.invite(
        inviter, d.server_name,
        {
            "type": "m.room.member", "room_id": room, "sender": inviter.user_id(),
            "state_key": bob.user_id, "content": {"membership": "invite"},
            "prev_events": [alice_leave], "depth": depth + 1,
            "auth_events": [create, power, latest("m.room.member", inviter.user_id())],
        },
        "10",
        [{"type": "m.room.create", "state_key": "", "sender": alice.user_id,
          "content": {"room_version": "10", "creator": alice.user_id}}],
    )  # fmt: skip
    # The inviter builds bob's leave on the last event Synapse has a state for, as a
    # server in the room would (its own invite is an outlier to Synapse).
    inviter.leave_templates[room] = {
        "room_version": "10", "prev_events": [alice_leave], "depth": depth + 2,
        "auth_events": [create, power, invite],
    }  # fmt: skip
    d.client.leave(bob, room)  # rejected through the inviter: make_leave, send_leave
    leave = latest("m.room.member", bob.user_id)
    meta = _metadata(d, leave)
    assert meta.get("out_of_band_membership") is True, meta
    assert _one(d, f"SELECT outlier FROM events WHERE event_id = '{leave}'") == "t"
    assert [e.get("state_key") for e in inviter.leaves] == [bob.user_id]
    _fence(d, network, alice, [inviter], fence_room)
    assert inviter.event_counts(room)[leave] == 0


def test_local_join_to_a_remote_room_proactively_send_false_is_not_sent(
    ours: OurWorker, network: PeerNetwork
) -> None:
    d = ours.d
    alice = d.client.register(f"alice_{uuid.uuid4().hex[:8]}")
    host, named = network.add_peers(2)
    room = network.host_room(host, [named.server_name])
    d.client.join(alice, room, via=[host.server_name])
    join = _one(
        d, f"SELECT event_id FROM events WHERE room_id = '{room}' AND type = 'm.room.member'"
           f" AND state_key = '{alice.user_id}'",
    )  # fmt: skip
    assert _metadata(d, join).get("proactively_send") is False
    _fence(d, network, alice, [host, named], room)  # the room's servers get alice's events
    assert (host.event_counts(room)[join], named.event_counts(room)[join]) == (0, 0)


def test_event_synapse_rejected_is_read_as_rejected_and_not_sent(
    ours: OurWorker, network: PeerNetwork
) -> None:
    d = ours.d
    alice = d.client.register(f"alice_{uuid.uuid4().hex[:8]}")
    room = d.client.create_room(alice, room_version="10")
    mallory, witness = network.add_peers(2)
    network.join(mallory, room, d.server_name)
    network.join(witness, room, d.server_name)
    last, depth = _one(
        d, f"SELECT event_id, depth FROM events WHERE room_id = '{room}' "
           "ORDER BY stream_ordering DESC LIMIT 1",
    ).split("|")  # fmt: skip
    create = _one(d, f"SELECT event_id FROM current_state_events WHERE room_id = '{room}' "
                     "AND type = 'm.room.create'")
    outsider = mallory.user_id("outsider")  # never joined: fails the auth rules
    eid, pdu = network.sign_event(
        mallory,
        {"type": "m.room.message", "room_id": room, "sender": outsider,
         "content": {"msgtype": "m.text", "body": "not a member"},
         "prev_events": [last], "depth": int(depth) + 1, "auth_events": [create]},
        "10",
    )  # fmt: skip
    answer = network.send_transaction(mallory, d.server_name, pdus=[pdu])
    assert answer == {"pdus": {eid: {}}}, answer  # accepted for processing
    stored = f"SELECT coalesce(rejection_reason, '-') FROM events WHERE event_id = '{eid}'"
    _until(lambda: d.sql(stored).strip() != "", what="the event stored (staged first)")
    assert _one(d, stored) != "-"
    so = int(_one(d, f"SELECT stream_ordering FROM events WHERE event_id = '{eid}'"))

    async def read() -> ev.EventRow:
        engine = create_synapse_engine(d.database_url, pool_size=1)
        try:
            async with engine.connect() as conn:
                return (await ev.events_at(conn, [so]))[so]
        finally:
            await engine.dispose()

    row = asyncio.run(read())
    assert row.event_id == eid and row.rejected
    assert not is_sendable(row, d.server_name)
    _fence(d, network, alice, [mallory, witness], room)
    assert witness.event_counts(room)[eid] == 0
