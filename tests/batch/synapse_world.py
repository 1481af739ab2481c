"""A Synapse deployment with every class of the Synapse audit in it, for
tests/batch/test_synapse_jobs.py.

:func:`build` makes it for real: rooms on the suite's Synapse, fake remote servers
joined over federation, messages our worker delivers; then some remotes refuse while
more is sent (our worker backs them off), the worker stops, one more event is sent
(nobody processes it), and the divergence is planted in Synapse's tables. What each
(destination, room) must then be classified as is :attr:`World.expected`.

=========  ==========  =========================================================
remote     room        what was done                        -> expected
=========  ==========  =========================================================
A          ``a``       delivered, row deleted               -> missing_row/no_row
A          ``a2``      delivered, row set to an older event -> missing_row/row_behind
B          ``b``       refused, backed off (10 min)         -> pending/backoff
C          ``c``       refused, backoff then cleared        -> pending/catch_up
L          ``l1``      delivered                            -> delivered
L          ``l2``      refused; position raised past it     -> lost/not_in_log
L          ``l3``      newest refused, then flagged ``proactively_send: false``
L          ``l4``      newest by bob, refused, then bob erased
L          ``l5``      newest refused, then rejected        (l3-l5: delivered, not lost)
M          ``m``       refused, backoff cleared, row deleted -> missing_row/no_row
S          ``s``       sent while no sender runs            -> pending/sender_behind
J1, J2     ``j``       J2 joins through us last: J1 has its relayed join (delivered);
                       J2 is owed nothing (its own join never goes back to it)
=========  ==========  =========================================================
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path

from federation_sender.testing.synapse_client import User
from federation_sender.testing.synapse_deployment import SynapseDeployment
from federation_sender.testing.synapse_peer import FederationPeer, PeerNetwork
from federation_sender.testing.waiting import wait_until_blocking
from tests.synapse.backend_support import OurWorker

ROLES = ("A", "B", "C", "L", "M", "S", "J1", "J2")
ROOMS = {"a": "A", "a2": "A", "b": "B", "c": "C", "l1": "L", "l2": "L", "l3": "L",
         "l4": "L", "l5": "L", "m": "M", "s": "S"}
DOWN = ("B", "C", "L", "M")

QUEUE = {"wakeup_interval_s": 1.0, "idle_queue_ttl_s": 2.0}
"""The worker's wake-up sweep each second and idle queues gone after 2 s: a repaired
position is acted on within seconds (the defaults are a minute each)."""


@dataclass
class World:
    d: SynapseDeployment
    net: PeerNetwork
    worker: OurWorker
    alice: User
    bob: User
    peers: dict[str, FederationPeer]
    rooms: dict[str, str]
    events: dict[str, str] = field(default_factory=dict)
    """label -> event id"""
    expected: dict[tuple[str, str], tuple[str, str, str]] = field(default_factory=dict)
    """(remote role, room label) -> (status, reason, event label), every finding that is
    not ``delivered``."""

    def name(self, role: str) -> str:
        return self.peers[role].server_name

    def so(self, label: str) -> int:
        eid = self.events[label]
        return int(self.d.sql(f"SELECT stream_ordering FROM events WHERE event_id = '{eid}'"))

    def send(self, label: str, room: str, *, user: User | None = None) -> str:
        eid = self.d.client.send_message(user or self.alice, self.rooms[room], label)
        self.events[label] = eid
        return eid

    def delivered(self, role: str, *labels: str, timeout_s: float = 60.0) -> None:
        peer = self.peers[role]
        ids = [self.events[x] for x in labels]
        try:
            self.net.wait_for(lambda: all(i in peer.event_ids_seen for i in ids),
                              timeout_s=timeout_s, what=f"{labels} at {role}")
        except TimeoutError as e:
            raise TimeoutError(f"{e}; the worker's log ends:\n{self.worker.log_tail()}") from None

    def sql_value(self, query: str) -> str:
        return self.d.sql(query).strip()

    def row(self, role: str, room: str) -> int | None:
        v = self.sql_value(
            "SELECT stream_ordering FROM destination_rooms WHERE destination = "
            f"'{self.name(role)}' AND room_id = '{self.rooms[room]}'")
        return int(v) if v else None

    def position(self, role: str) -> int | None:
        v = self.sql_value("SELECT last_successful_stream_ordering FROM destinations "
                           f"WHERE destination = '{self.name(role)}'")
        return int(v) if v else None

    def findings_of_mine(self, findings: list[dict[str, object]]
                         ) -> dict[tuple[str, str], tuple[str, str, str]]:
        """Findings of this world's remotes and rooms, as (role, room) -> (status,
        reason, event id); other modules' remotes share the deployment."""
        roles = {p.server_name: r for r, p in self.peers.items()}
        labels = {rid: lbl for lbl, rid in self.rooms.items()}
        return {(roles[str(f["destination"])], labels[str(f["room_id"])]):
                (str(f["status"]), str(f["reason"]), str(f["event_id"]))
                for f in findings
                if f["destination"] in roles and f["room_id"] in labels}


def build(d: SynapseDeployment, net: PeerNetwork, directory: Path) -> World:
    d.stop_federation_sender()
    worker = OurWorker(d, directory, queue=QUEUE)
    worker.start()
    tag = uuid.uuid4().hex[:8]
    alice = d.client.register(f"alice_{tag}")
    d.client.exempt_from_ratelimits(d.client.register(f"admin_{tag}", admin=True), alice)
    bob = d.client.register(f"bob_{tag}")
    peers = dict(zip(ROLES, net.add_peers(len(ROLES)), strict=True))
    rooms = {label: d.client.create_room(alice) for label in (*ROOMS, "j")}
    w = World(d, net, worker, alice, bob, peers, rooms)
    for label, role in ROOMS.items():
        net.join(peers[role], rooms[label], d.server_name)
    d.client.join(bob, rooms["l4"])
    net.join(peers["J1"], rooms["j"], d.server_name)
    w.send("j hello", "j")
    w.delivered("J1", "j hello")
    j2 = net.join(peers["J2"], rooms["j"], d.server_name)
    w.events["j2 join"] = j2.join_event_id
    w.delivered("J1", "j2 join")  # relayed to J1, never back to J2

    # Delivered first: a message in every room (two in a2).
    for label in ROOMS:
        w.send(f"{label} hello", label)
    w.send("a2 second", "a2")
    for role in ("A", *DOWN, "S"):
        w.delivered(role, *[f"{lbl} hello" for lbl, r in ROOMS.items() if r == role])
    w.delivered("A", "a2 second")

    # Then B, C, L and M refuse what follows; the worker backs them off.
    for role in DOWN:
        peers[role].send_status = 503
    w.send("b refused", "b")
    w.send("c refused", "c")
    w.send("m refused", "m")
    w.send("l3 not proactive", "l3")
    w.send("l4 by bob", "l4", user=bob)
    w.send("l5 rejected", "l5")
    w.send("l2 lost", "l2")  # the newest of L's rooms
    for role in DOWN:
        wait_until_blocking(
            lambda r=role: w.sql_value("SELECT COALESCE(retry_interval, 0) FROM destinations "
                                       f"WHERE destination = '{w.name(r)}'"),
            f"{role}'s backoff persisted", accept=lambda v: v not in ("", "0"),
            timeout_s=60, details=worker.log_tail)
    newest = {"B": ("b", "b refused"), "C": ("c", "c refused"), "M": ("m", "m refused"),
              "L": ("l2", "l2 lost")}
    for role, (room, label) in newest.items():
        wait_until_blocking(lambda r=role, rm=room: w.row(r, rm), f"{role}'s row",
                            accept=lambda v, lb=label: v == w.so(lb), timeout_s=30)
    worker.stop()

    # Nobody processes this one: the sender is behind it.
    w.send("s behind", "s")
    _plant(w)
    for role in DOWN:
        if role != "B":
            peers[role].send_status = 200
    w.expected = {
        ("A", "a"): ("missing_row", "no_row", "a hello"),
        ("A", "a2"): ("missing_row", "row_behind", "a2 second"),
        ("B", "b"): ("pending", "backoff", "b refused"),
        ("C", "c"): ("pending", "catch_up", "c refused"),
        ("L", "l2"): ("lost", "not_in_log", "l2 lost"),
        ("M", "m"): ("missing_row", "no_row", "m refused"),
        ("S", "s"): ("pending", "sender_behind", "s behind"),
    }
    return w


def _plant(w: World) -> None:
    """The divergence of the table in the module docstring, in Synapse's tables."""
    def dest(role: str) -> str:
        return f"destination = '{w.name(role)}'"

    def room(label: str) -> str:
        return f"room_id = '{w.rooms[label]}'"

    clear = "retry_last_ts = 0, retry_interval = 0, failure_ts = NULL"
    w.d.sql(f"DELETE FROM destination_rooms WHERE {dest('A')} AND {room('a')}")
    w.d.sql(f"UPDATE destination_rooms SET stream_ordering = {w.so('a2 hello')} "
            f"WHERE {dest('A')} AND {room('a2')}")
    w.d.sql(f"UPDATE destinations SET {clear} WHERE {dest('C')}")
    w.d.sql(f"UPDATE destinations SET {clear}, last_successful_stream_ordering = "
            f"{w.so('l2 lost')} WHERE {dest('L')}")
    w.d.sql(f"UPDATE destinations SET {clear} WHERE {dest('M')}")
    w.d.sql(f"DELETE FROM destination_rooms WHERE {dest('M')} AND {room('m')}")
    w.d.sql("UPDATE event_json SET internal_metadata = jsonb_set(internal_metadata::jsonb, "
            "'{proactively_send}', 'false')::text "
            f"WHERE event_id = '{w.events['l3 not proactive']}'")
    w.d.sql(f"INSERT INTO erased_users (user_id) VALUES ('{w.bob.user_id}')")
    rejected = w.events["l5 rejected"]
    w.d.sql("INSERT INTO rejections (event_id, reason, last_check) "
            f"VALUES ('{rejected}', 'planted', '1')")
    w.d.sql(f"UPDATE events SET rejection_reason = 'planted' WHERE event_id = '{rejected}'")
