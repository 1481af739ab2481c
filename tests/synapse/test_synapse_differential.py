"""The same scripted traffic with Synapse's own federation sender and with ours.

Each run gets its own room, users and four fake remote servers on the shared
deployment; the script is the same: three servers join over federation, messages,
a fourth server joins (a join main accepted for a remote server, relayed to the
others), a local user joins, the topic changes, more messages, one remote user is
kicked (its server still receives the kick, not what follows), more messages. Per
destination (by its place in the script), the events received are compared as labels
(``msg:<body>``, ``member:<who>:<membership>``, the state type), which are the same
in both runs although ids and server names differ. Both must match, and each must be
what the script implies.
"""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from federation_sender.testing.our_sender import OurSender
from federation_sender.testing.synapse_deployment import SynapseDeployment
from federation_sender.testing.synapse_peer import FederationPeer, PeerNetwork

Labels = list[Counter[str]]



def label(pdu: dict[str, Any], who: dict[str, str]) -> str:
    content = pdu.get("content", {})
    if pdu["type"] == "m.room.message":
        return f"msg:{content.get('body')}"
    if pdu["type"] == "m.room.member":
        return f"member:{who.get(pdu['state_key'], '?')}:{content.get('membership')}"
    return str(pdu["type"])


def run_script(d: SynapseDeployment, net: PeerNetwork) -> Labels:
    tag = uuid.uuid4().hex[:8]
    alice = d.client.register(f"alice_{tag}")
    bob = d.client.register(f"bob_{tag}")
    room = d.client.create_room(alice)
    peers = net.add_peers(4)
    who = {p.user_id(): f"peer{i}" for i, p in enumerate(peers)}
    who |= {alice.user_id: "alice", bob.user_id: "bob"}
    for p in peers[:3]:
        net.join(p, room, d.server_name)
    for i in range(1, 6):
        d.client.send_message(alice, room, f"m{i}")
    net.join(peers[3], room, d.server_name)
    d.client.join(bob, room)
    d.client.send_state(alice, room, "m.room.topic", {"topic": "differential"})
    for i in range(6, 9):
        d.client.send_message(bob, room, f"m{i}")
    d.client.kick(alice, room, peers[1].user_id(), "script")
    for i in range(9, 11):
        last = d.client.send_message(alice, room, f"m{i}")

    def has(p: FederationPeer, text: str) -> bool:
        return any(label(pdu, who) == text for t in p.transactions for pdu in t.pdus)

    net.wait_for(
        lambda: has(peers[1], "member:peer1:leave")
        and all(last in p.event_counts(room) for p in (peers[0], peers[2], peers[3])),
        what="the last message and the kick",
    )
    with net.locked():
        return [
            Counter(label(pdu, who) for t in p.transactions for pdu in t.pdus
                    if pdu.get("room_id") == room)
            for p in peers
        ]  # fmt: skip


def test_synapse_sender_and_ours_deliver_the_same_events(
    synapse_deployment: SynapseDeployment, network: PeerNetwork, tmp_path: Path
) -> None:
    d = synapse_deployment
    d.start_federation_sender()
    try:
        theirs = run_script(d, network)
    finally:
        d.stop_federation_sender()
    ours = OurSender(d, tmp_path / "ours")
    ours.start()
    try:
        mine = run_script(d, network)
    finally:
        status = ours.stop()
    assert status == 0, ours.log_tail()  # an orderly exit on SIGTERM
    assert mine == theirs
    # What the script implies, so that both being wrong the same way fails too.
    after_all = ["member:peer3:join", "member:bob:join", "m.room.topic",
                 *(f"msg:m{i}" for i in range(6, 9)), "member:peer1:leave",
                 "msg:m9", "msg:m10"]  # fmt: skip
    assert theirs[3] == Counter(after_all[1:])  # a joiner never gets its own join back
    assert theirs[1] == Counter(
        ["member:peer2:join", *(f"msg:m{i}" for i in range(1, 6)), *after_all[:-2]]
    )
    assert theirs[0] == Counter(
        ["member:peer1:join", "member:peer2:join", *(f"msg:m{i}" for i in range(1, 6)),
         *after_all]
    )  # fmt: skip
