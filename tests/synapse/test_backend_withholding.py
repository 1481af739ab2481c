"""Catch-up withholds what Synapse's sender withholds, on a real Synapse 1.163.

Synapse filters the events its sender sends in catch-up with
``filter_events_for_server(..., filter_out_erased_senders=True, redact=False, ...)``
(docs/synapse-reference.md, "What catch-up withholds"). Two scenarios, each with our worker as
``fed1`` and a fake remote server that is down (503) while things happen, then our
worker restarted (every destination starts in catch-up, as Synapse's) and the remote
back, contacting main:

* a user sends messages while the remote is down and is then **erased** (the admin
  API's deactivation with ``erase: true``): none of the user's events reaches the
  remote, neither the messages nor the leave the deactivation makes; the other user's
  message of the same gap does. With a one-event gap limit (the room's forward
  extremity, else the row's own event: both the leave) nothing of the room goes, where
  Synapse's own worker, the reference here too, sends the leave;
* a room with ``joined`` **history visibility**: the remote's only user is kicked,
  a message is sent, the user joins again, another message: the kick and the last
  message reach it, the message sent while it had no member does not. The facts read
  from Synapse's state groups for these events are checked too.
"""

from __future__ import annotations

import asyncio
import json
import urllib.parse
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from federation_sender.model import EventRow
from federation_sender.storage.synapse import events as ev
from federation_sender.storage.synapse.database import create_synapse_engine
from federation_sender.storage.synapse.visibility import visibility_facts
from federation_sender.testing.synapse_deployment import SynapseDeployment
from federation_sender.testing.synapse_peer import FederationPeer, PeerNetwork
from federation_sender.testing.waiting import wait_until_blocking
from federation_sender.visibility import EventFacts, Verdict, decide
from tests.synapse.backend_support import OurWorker

pytestmark = pytest.mark.postgres


def _until(cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Poll Synapse's database."""
    wait_until_blocking(cond, what, timeout_s=timeout_s)


def _backing_off(d: SynapseDeployment, peer: FederationPeer) -> bool:
    q = ("SELECT coalesce(retry_interval, 0) > 0 FROM destinations "
         f"WHERE destination = '{peer.server_name}'")  # fmt: skip
    return d.sql(q).strip() == "t"


def _event_id(d: SynapseDeployment, query: str) -> str:
    out = d.sql(query).strip()
    assert out and "\n" not in out, (query, out)
    return out


def _catch_up(ours: OurWorker, network: PeerNetwork, peer: FederationPeer) -> None:
    """Restart our worker (it starts the destination in catch-up) and bring the peer
    back; it contacts main, whose invalidation wakes it."""
    ours.stop()
    ours.start()
    peer.send_status = 200
    network.send_transaction(peer, ours.d.server_name)


def _facts(
    d: SynapseDeployment, destination: str, event_ids: Sequence[str]
) -> dict[str, EventFacts]:
    ids = "', '".join(event_ids)
    sos = [int(x) for x in d.sql(
        f"SELECT stream_ordering FROM events WHERE event_id IN ('{ids}')").split()]  # fmt: skip

    async def read() -> dict[str, EventFacts]:
        engine = create_synapse_engine(d.database_url, pool_size=1)
        try:
            async with engine.connect() as conn:
                rows: list[EventRow] = list((await ev.events_at(conn, sos)).values())
                return await visibility_facts(conn, destination, d.server_name, rows)
        finally:
            await engine.dispose()

    return asyncio.run(read())


@dataclass
class Erased:
    room: str
    eves: list[str]
    eve_leave: str
    alices: str


def _erase_while_down(ours: OurWorker, network: PeerNetwork, peer: FederationPeer) -> Erased:
    """eve sends three messages and alice one while ``peer`` is down; eve is erased
    (her deactivation makes her leave the room)."""
    d = ours.d
    admin = d.client.register(f"admin_{uuid.uuid4().hex[:8]}", admin=True)
    alice = d.client.register(f"alice_{uuid.uuid4().hex[:8]}")
    eve = d.client.register(f"eve_{uuid.uuid4().hex[:8]}")
    room = d.client.create_room(alice)
    d.client.join(eve, room)
    network.join(peer, room, d.server_name)
    before = d.client.send_message(alice, room, "before")
    network.wait_for(lambda: before in peer.event_counts(room), what="the first message")

    peer.send_status = 503
    eves = [d.client.send_message(eve, room, f"eve {i}") for i in range(3)]
    alices = d.client.send_message(alice, room, "alice, while the peer is down")
    _until(lambda: _backing_off(d, peer), what="our backoff for the peer")
    quoted = urllib.parse.quote(eve.user_id, safe="")
    d.client.call("POST", f"/_synapse/admin/v1/deactivate/{quoted}", {"erase": True},
                  admin.access_token)  # fmt: skip
    erased = f"SELECT count(*) FROM erased_users WHERE user_id = '{eve.user_id}'"
    assert d.sql(erased).strip() == "1"
    hers = (f"FROM events WHERE room_id = '{room}' AND type = 'm.room.member'"
            f" AND state_key = '{eve.user_id}' AND sender = '{eve.user_id}'")  # fmt: skip
    _until(lambda: d.sql(f"SELECT count(*) FROM room_memberships WHERE room_id = '{room}' AND "
                         f"user_id = '{eve.user_id}' AND membership = 'leave'").strip() == "1",
           what="the deactivation's leave")  # fmt: skip
    assert int(d.sql(f"SELECT count(*) {hers}")) == 2  # her join and her leave
    eve_leave = _event_id(d, f"SELECT event_id {hers} ORDER BY stream_ordering DESC LIMIT 1")
    return Erased(room, eves, eve_leave, alices)


def _fence(ours: OurWorker, network: PeerNetwork, peer: FederationPeer, room: str) -> None:
    alice = ours.d.client.register(f"fence_{uuid.uuid4().hex[:8]}")
    ours.d.client.join(alice, room)
    fence = ours.d.client.send_message(alice, room, "fence")
    network.wait_for(lambda: fence in peer.event_counts(room), timeout_s=120, what="the fence")


def test_erased_users_events_are_withheld_in_catch_up(
    ours: OurWorker, network: PeerNetwork
) -> None:
    peer = network.add_peer()
    x = _erase_while_down(ours, network, peer)
    _catch_up(ours, network, peer)
    network.wait_for(lambda: x.alices in peer.event_counts(x.room), timeout_s=60,
                     what="alice's missed message in catch-up")  # fmt: skip
    _fence(ours, network, peer, x.room)
    counts = peer.event_counts(x.room)
    assert [counts[e] for e in x.eves] == [0, 0, 0]
    assert counts[x.eve_leave] == 0
    assert counts[x.alices] == 1
    assert "withholds 4 events (erased_sender: 4)" in ours.log_tail(20_000)


def test_erased_users_newest_event_is_withheld_where_synapse_sends_it(
    ours: OurWorker, network: PeerNetwork, tmp_path: Path
) -> None:
    """With ``catchup_max_gap_events: 1`` the room's gap is long: catch-up sends the
    forward extremity (eve's leave), or else the row's own event (the same leave).
    Synapse's worker sends it unfiltered; ours withholds both, so nothing of the room
    goes, and the row is consumed."""
    d = ours.d
    peer = network.add_peer()
    x = _erase_while_down(ours, network, peer)
    ours.stop()
    short = OurWorker(d, tmp_path / "short-gap")
    config = json.loads(short.config.read_text())
    config["queue"]["catchup_max_gap_events"] = 1
    short.config.write_text(json.dumps(config))
    leave_so = int(d.sql(f"SELECT stream_ordering FROM events WHERE event_id = '{x.eve_leave}'"))
    position = ("SELECT coalesce(last_successful_stream_ordering, 0) FROM destinations "
                f"WHERE destination = '{peer.server_name}'")  # fmt: skip
    short.start()
    try:
        peer.send_status = 200
        network.send_transaction(peer, d.server_name)
        _until(lambda: int(d.sql(position)) >= leave_so, timeout_s=60,
               what="our catch-up past eve's leave")  # fmt: skip
        log = short.log_tail(20_000)
    finally:
        short.stop()
        ours.start()
    counts = peer.event_counts(x.room)
    assert [counts[e] for e in x.eves] == [0, 0, 0]
    assert (counts[x.eve_leave], counts[x.alices]) == (0, 0)
    assert "withholds 1 events (erased_sender: 1)" in log


def test_history_visibility_joined_withholds_what_the_destination_may_not_see(
    ours: OurWorker, network: PeerNetwork
) -> None:
    d = ours.d
    alice = d.client.register(f"alice_{uuid.uuid4().hex[:8]}")
    room = d.client.create_room(alice)
    d.client.send_state(alice, room, "m.room.history_visibility", {"history_visibility": "joined"})
    peer = network.add_peer()
    network.join(peer, room, d.server_name)
    before = d.client.send_message(alice, room, "before")
    network.wait_for(lambda: before in peer.event_counts(room), what="the first message")

    peer.send_status = 503
    d.client.kick(alice, room, peer.user_id("peer"))
    kick = _event_id(d, f"SELECT event_id FROM events WHERE room_id = '{room}' AND "
                        f"type = 'm.room.member' AND state_key = '{peer.user_id('peer')}' "
                        "ORDER BY stream_ordering DESC LIMIT 1")  # fmt: skip
    _until(lambda: _backing_off(d, peer), what="our backoff for the peer")
    hidden = d.client.send_message(alice, room, "while the peer has nobody in the room")
    network.join(peer, room, d.server_name)
    after = d.client.send_message(alice, room, "after the peer joined again")

    facts = _facts(d, peer.server_name, [kick, hidden, after])
    assert facts[hidden].history_visibility == "joined"
    assert list(facts[hidden].memberships) == ["leave"]
    assert decide(facts[hidden]) is Verdict.HISTORY_VISIBILITY
    assert facts[kick].own_membership and decide(facts[kick]) is Verdict.SEND
    assert list(facts[after].memberships) == ["join"] and decide(facts[after]) is Verdict.SEND

    _catch_up(ours, network, peer)
    network.wait_for(lambda: after in peer.event_counts(room), timeout_s=60,
                     what="the message after the peer joined again")  # fmt: skip
    counts = peer.event_counts(room)
    assert (counts[kick], counts[hidden], counts[after]) == (1, 0, 1)


def test_synapse_own_sender_in_the_same_erasure_scenario(
    ours: OurWorker, network: PeerNetwork
) -> None:
    """The reference: Synapse's own worker does the catch-up. It sends each room's
    newest event owed to the destination without filtering it when it is a forward
    extremity: here eve's leave, an erased user's event; her messages are not sent, and
    neither is alice's (only the newest event goes)."""
    d = ours.d
    peer = network.add_peer()
    x = _erase_while_down(ours, network, peer)
    leave_so = int(d.sql(f"SELECT stream_ordering FROM events WHERE event_id = '{x.eve_leave}'"))
    # Ours has handed eve's leave to the peer's row before it stops, so that Synapse's
    # worker only catches up. Stopped before that, Synapse's worker met the leave in the
    # event stream as it started: its catch-up sent the row's older event, marked 41 as
    # sent, and the leave never went (a PDU queued before the first catch-up check is
    # dropped when catch-up begins, most likely before the leave's row was there). One
    # of this stop's three full runs waited the 120 s for it.
    row = ("SELECT coalesce(max(stream_ordering), 0) FROM destination_rooms "
           f"WHERE destination = '{peer.server_name}' AND room_id = '{x.room}'")  # fmt: skip
    _until(lambda: int(d.sql(row)) >= leave_so, what="our row for the peer at eve's leave")
    ours.stop()
    # Back before Synapse's worker starts: it wakes destinations owed catch-up at once
    # at its start, and then only every minute.
    peer.send_status = 200
    network.send_transaction(peer, d.server_name)
    _until(lambda: not _backing_off(d, peer), what="main clearing our backoff")
    d.start_federation_sender()
    try:
        # Its catch-up done (a fence would replace the room's row: Synapse keeps one).
        position = ("SELECT coalesce(last_successful_stream_ordering, 0) FROM destinations "
                    f"WHERE destination = '{peer.server_name}'")  # fmt: skip
        _until(lambda: int(d.sql(position)) >= leave_so, timeout_s=120,
               what="Synapse's catch-up past eve's leave")  # fmt: skip
    finally:
        d.stop_federation_sender()
        ours.start()
    counts = peer.event_counts(x.room)
    assert [counts[e] for e in x.eves] == [0, 0, 0]
    assert (counts[x.eve_leave], counts[x.alices]) == (1, 0)
