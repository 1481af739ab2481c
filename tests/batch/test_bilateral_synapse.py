"""The audit's bilateral check against a real Synapse receiver (issue #43, item 3).

Our worker is the federation sender of the session's Synapse deployment; a second
Synapse 1.163 (SQLite, sending for itself) has a user, bob, in three rooms of it, and a
fake peer (:class:`PeerNetwork`) is in the first. A few messages go out and the
transaction log records them delivered. Then the peer goes away (its port closed) and
the newest event of the second room is taken out of the receiver's database: every
table with an ``event_id`` column loses its rows for it (events, event_json,
event_edges, event_to_state_groups, event_push_actions, event_search, ...; its prev
event is the room's forward extremity again), with the receiver stopped, so no cache
of its answers it from memory on return. Its ``GET /event`` then answers 404.

The audit, with the bilateral check, must find exactly that pair ``not_held``, the
other two ``held`` and the peer's ``unreachable``; with ``--repair`` it hands the pair
back to catch-up, and after a restart the worker resends the event and the receiver
holds it again (bob reads it); the audit is then clean.

The audit runs as an operator runs it (``federation-sender batch audit -c ours.yaml
--synapse-config … --ask-receivers``, parsed and merged by the main command line), on
Synapse's tables through the production source (``SynapseJdbcSource``), with ``--room``
for each of this module's rooms: the session's database holds other modules' rooms,
which must not count (and ``--room`` is what an operator gives to audit some rooms).
"""

from __future__ import annotations

import io
import json
import logging
import sqlite3
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from federation_sender import cli
from federation_sender.batch.arguments import EXIT_FINDINGS
from federation_sender.batch.cli import run_batch
from federation_sender.builders import running_federation_client
from federation_sender.clock import SystemClock
from federation_sender.testing.backlog import receiver_state
from federation_sender.testing.certs import LoopbackCA
from federation_sender.testing.outage import SendingRoom, join_rooms, visible
from federation_sender.testing.synapse_client import User
from federation_sender.testing.synapse_deployment import SynapseDeployment, create_deployment
from federation_sender.testing.synapse_peer import PeerNetwork
from federation_sender.testing.waiting import wait_until_blocking
from tests.synapse.backend_support import OurWorker

pytestmark = [pytest.mark.spark, pytest.mark.postgres, pytest.mark.timeout(600)]
log = logging.getLogger(__name__)

MESSAGES = 2
WAIT_S = 60.0


@pytest.fixture(scope="module")
def receiver(loopback_ca: LoopbackCA, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[SynapseDeployment]:
    d = create_deployment(tmp_path_factory.mktemp("bilateral-receiver"), ca=loopback_ca)
    d.start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def sender(synapse_deployment: SynapseDeployment, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[OurWorker]:
    synapse_deployment.stop_federation_sender()
    worker = OurWorker(synapse_deployment, tmp_path_factory.mktemp("bilateral-ours"))
    worker.start()
    yield worker
    worker.stop()


@dataclass(frozen=True)
class Scene:
    rooms: list[str]
    bob: User
    newest: dict[str, str]
    """Room -> the newest message in it."""
    peer: str


def run_audit(spark: Any, worker: OurWorker, rooms: list[str], *, repair: bool
              ) -> dict[str, Any]:
    """``federation-sender batch audit -c ours.yaml --synapse-config homeserver.yaml
    --synapse-config fed1.yaml --room … --ask-receivers`` as the main command line
    parses, merges and runs it (its receivers: the worker's federation client), on the
    shared Spark session; the JSON document."""
    synapse = [a for f in (worker.d.homeserver_yaml, worker.worker_yaml)
               for a in ("--synapse-config", str(f))]
    args = cli.build_parser().parse_args(
        ["batch", "audit", "-c", str(worker.config), *synapse,
         *[a for r in rooms for a in ("--room", r)], "--ask-receivers", "--ask-seed", "43",
         *(["--repair"] if repair else []), "--json", "--quiet", "--partitions", "2"])
    settings = cli._load(args)  # the main command line's merge of ours and Synapse's files
    out = io.StringIO()
    run_batch(args, settings, spark=spark, out=out,
              receivers=lambda c: running_federation_client(settings, c, synapse_key=True))
    doc: dict[str, Any] = json.loads(out.getvalue())
    log.info("audit%s: %s; steps %s", " --repair" if repair else "", doc["summary"],
             doc["steps"])
    return doc


def delivered(d: SynapseDeployment, destination: str) -> set[str]:
    """The event ids our log records as delivered to ``destination``."""
    rows = d.sql("SELECT pdu_event_ids FROM federation_sender.federation_transaction_log "
                 f"WHERE status = 'success' AND destination = '{destination}'")
    return {e for line in rows.splitlines() if line for e in json.loads(line)}


def forget_event(db_path: Path, event_id: str) -> list[str]:
    """Remove ``event_id`` from every table of a stopped Synapse's SQLite database that
    has an ``event_id`` column, its prev events the room's forward extremities again;
    the tables it was in."""
    conn = sqlite3.connect(db_path)
    try:
        with conn:
            (room_id,) = conn.execute(
                "SELECT room_id FROM events WHERE event_id = ?", (event_id,)).fetchone()
            conn.execute(
                "INSERT OR IGNORE INTO event_forward_extremities (event_id, room_id) "
                "SELECT prev_event_id, ? FROM event_edges WHERE event_id = ?",
                (room_id, event_id))
            names = [n for (n,) in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
            found = []
            for name in names:
                columns = {c[1] for c in conn.execute(f'PRAGMA table_info("{name}")')}
                if "event_id" in columns and conn.execute(
                        f'DELETE FROM "{name}" WHERE event_id = ?', (event_id,)).rowcount:
                    found.append(name)
    finally:
        conn.close()
    return found


def set_scene(sender: OurWorker, receiver: SynapseDeployment, network: PeerNetwork) -> Scene:
    """Three rooms bob is in, a peer in the first, a few messages delivered to both."""
    d = sender.d
    alice = d.client.register(f"alice_{uuid.uuid4().hex[:8]}")
    rooms = [d.client.create_room(alice) for _ in range(3)]
    bob = receiver.client.register(f"bob_{uuid.uuid4().hex[:8]}")
    join_rooms(receiver, bob, {r: SendingRoom(d, alice, r) for r in rooms})
    peer = network.add_peer()
    network.join(peer, rooms[0], d.server_name)
    newest = {}
    for r in rooms:
        for i in range(MESSAGES):
            newest[r] = d.client.send_message(alice, r, f"bilateral {i}")
    for r, e in newest.items():
        wait_until_blocking(lambda r=r, e=e: visible(receiver, bob, r, e),
                            f"{e} at the receiver", timeout_s=WAIT_S)
    network.wait_for(lambda: newest[rooms[0]] in peer.event_counts(rooms[0]),
                     timeout_s=WAIT_S, what="the newest message at the peer")
    wanted = {receiver.server_name: set(newest.values()), peer.server_name: {newest[rooms[0]]}}
    for dest, ids in wanted.items():
        wait_until_blocking(lambda dest=dest: delivered(d, dest), f"{ids} logged delivered",
                            accept=lambda got, ids=ids: ids <= got, timeout_s=WAIT_S)
    return Scene(rooms, bob, newest, peer.server_name)


def answers(doc: dict[str, Any]) -> dict[tuple[str, str], str]:
    return {(row["destination"], row["room_id"]): row["answer"]
            for name, rows in doc["samples"].items() if name.startswith("bilateral_")
            for row in rows}


def test_the_audit_finds_the_event_the_receiver_lost_and_catch_up_resends_it(
    spark: Any, sender: OurWorker, receiver: SynapseDeployment, loopback_ca: LoopbackCA,
    tmp_path: Path,
) -> None:
    with PeerNetwork(loopback_ca, tmp_path / "peers") as network:
        scene = set_scene(sender, receiver, network)
    # The peer's port is closed now. Our worker stops before the receiver does, so it
    # never backs off from it.
    sender.stop()
    lost_room = scene.rooms[1]
    lost = scene.newest[lost_room]
    receiver.main.stop()
    tables = forget_event(receiver.layout.directory / "homeserver.db", lost)
    receiver.main.start()
    log.info("%s removed from the receiver's %s", lost, ", ".join(tables))
    assert {"events", "event_json"} <= set(tables)
    assert not visible(receiver, scene.bob, lost_room, lost)

    found = run_audit(spark, sender, scene.rooms, repair=False)
    r = receiver.server_name
    s = found["summary"]
    assert answers(found) == {
        (r, scene.rooms[0]): "held", (r, lost_room): "not_held", (r, scene.rooms[2]): "held",
        (scene.peer, scene.rooms[0]): "unreachable",
    }, found["samples"]
    # The pairs of these rooms only, the rest of the session's database not read.
    assert (s["only_rooms"], s["pairs"], s["schema"]) == (3, 4, "synapse"), s
    assert (s["bilateral_delivered_pairs"], s["bilateral_asked"], s["bilateral_held"],
            s["bilateral_not_held"], s["bilateral_unreachable"]) == (4, 4, 2, 1, 1), s
    assert s["lost"] == 0 and found["exit_status"] == EXIT_FINDINGS  # theirs only
    [row] = found["samples"]["bilateral_not_held"]
    assert row["event_id"] == lost

    repaired = run_audit(spark, sender, scene.rooms, repair=True)
    s = repaired["summary"]
    # The row is at the event already (the worker wrote it when it sent it), and on
    # Synapse's schema only a newer event raises a row: the position is what goes back.
    assert (s["bilateral_rows_upserted"], s["bilateral_positions_lowered"]) == (0, 1), s
    so = int(sender.d.sql(f"SELECT stream_ordering FROM events WHERE event_id = '{lost}'"))
    position = sender.d.sql("SELECT last_successful_stream_ordering FROM destinations "
                            f"WHERE destination = '{r}'")
    assert int(position) == so - 1
    row = sender.d.sql("SELECT stream_ordering FROM destination_rooms WHERE destination = "
                       f"'{r}' AND room_id = '{lost_room}'")
    assert int(row) == so

    clock = SystemClock()
    sender.start()
    started = clock.monotonic_s()
    wait_until_blocking(lambda: visible(receiver, scene.bob, lost_room, lost),
                        f"{lost} back at the receiver", timeout_s=WAIT_S,
                        details=sender.log_tail)
    log.info("%s back at the receiver %.1f s after the worker's start", lost,
             clock.monotonic_s() - started)
    assert receiver_state(receiver, lost_room, [lost]).live == 1  # in the timeline again
    again = run_audit(spark, sender, scene.rooms, repair=False)
    assert answers(again) == {
        (r, room): "held" for room in scene.rooms} | {(scene.peer, scene.rooms[0]): "unreachable"}
    assert again["exit_status"] == 0  # an unreachable receiver is reported, not a finding
