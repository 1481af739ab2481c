"""Chaos beside a real Synapse 1.163 (issue 34 item 4): our worker as ``fed1``, faults at
random, and at the end nothing lost.

A deployment of its own on a PostgreSQL cluster and a Redis of its own (both are
restarted), fake servers joined to two rooms over federation, and a steady stream
from a client thread: messages into both rooms, typing, receipts, to-device messages to
a device of every server, device-list changes (a device renamed). Faults, one at a time
in a seeded random order (each kind at least once), while the stream goes on:

* ``kill``: SIGKILL of our worker, then a start;
* ``redis``: Redis stopped and started on the same port (main and ours reconnect);
* ``postgres``: PostgreSQL restarted;
* ``main``: Synapse's main stopped and started;
* ``peer``: a server refuses every transaction for a few seconds, then sends main a
  transaction (main clears its backoff) and accepts again;
* ``handover``: our worker stopped, Synapse's own ``fed1`` runs for a few seconds,
  then ours again.

At the end (everything up, ours sending, a fence per room at every server):

* every message sent is at every server, or represented by a later event of its room
  that the server received (the catch-up rule: Synapse's sender sends a room's newest
  event only while it catches up, and the receiver fetches the rest);
* every to-device message reached its server, once after deduplication by
  ``message_id`` (as receivers deduplicate);
* every device-list update a sender recorded as delivered
  (``device_lists_outbound_last_success``) is at its server, nothing is left in
  ``device_lists_outbound_pokes``;
* duplicates (a PDU, to-device message or device-list update received twice: a
  transaction resent after a SIGKILL) are counted and printed, not failed.

``CHAOS_LONG=1`` runs 15 minutes of faults (``SYNAPSE_CHAOS_SECONDS`` and
``CHAOS_SEED`` override); the default is 40 s of faults (60 s before 2026-12-02), about 90 s in all.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
import tempfile
import threading
import urllib.parse
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from federation_sender.clock import SystemClock
from federation_sender.testing.certs import LoopbackCA
from federation_sender.testing.ports import free_port
from federation_sender.testing.postgres import PostgresCluster, ephemeral_cluster
from federation_sender.testing.prereq import missing
from federation_sender.testing.synapse_client import User
from federation_sender.testing.synapse_config import RedisAddress
from federation_sender.testing.synapse_deployment import SynapseDeployment, create_deployment
from federation_sender.testing.synapse_peer import FederationPeer, PeerNetwork
from tests.synapse.backend_support import OurWorker

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

LONG = bool(os.environ.get("CHAOS_LONG"))
CHAOS_S = float(os.environ.get("SYNAPSE_CHAOS_SECONDS", 900 if LONG else 40))
SEED = int(os.environ.get("CHAOS_SEED", 1))
FAULTS = ("kill", "redis", "postgres", "main", "peer", "handover")
N_PEERS = 3
N_ROOMS = 2


class RestartableRedis:
    """A redis-server on a fixed loopback port that can be stopped and started."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            missing("redis-server")
        self.binary = binary
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="fedsender-redis-chaos-")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir],
            stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        clock = SystemClock()
        deadline = clock.monotonic_s() + 10
        while clock.monotonic_s() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(
                ("127.0.0.1", self.port), 0.2
            ):
                return
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(0.05)
                raise RuntimeError("redis-server exited at start")
        raise RuntimeError("redis-server did not listen")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@dataclass
class Traffic:
    """What the client thread sent and Synapse acknowledged."""

    events: dict[str, str] = field(default_factory=dict)
    """event id -> room id."""
    to_device: dict[str, str] = field(default_factory=dict)
    """marker -> destination."""
    renames: int = 0
    receipts: int = 0
    typing: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    stop: threading.Event = field(default_factory=threading.Event)


@dataclass
class Scene:
    d: SynapseDeployment
    cluster: PostgresCluster
    redis: RestartableRedis
    ours: OurWorker
    alice: User
    device_id: str
    rooms: list[str]
    peers: list[FederationPeer]


def q(s: str) -> str:
    return urllib.parse.quote(s, safe="")


@pytest.fixture(scope="module")
def scene(
    loopback_ca: LoopbackCA, network: PeerNetwork, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Scene]:
    redis = RestartableRedis()
    redis.start()
    try:
        with ephemeral_cluster() as cluster:
            d = create_deployment(
                tmp_path_factory.mktemp("synapse-chaos"),
                ca=loopback_ca,
                cluster=cluster,
                database_name="synapse_chaos",
                redis=RedisAddress("127.0.0.1", redis.port),
            )
            d.start()
            try:
                alice = d.client.register(f"alice_{uuid.uuid4().hex[:8]}")
                rooms = [d.client.create_room(alice) for _ in range(N_ROOMS)]
                peers = network.add_peers(N_PEERS)
                for r in rooms:
                    for p in peers:
                        network.join(p, r, d.server_name)
                ours = OurWorker(d, tmp_path_factory.mktemp("ours"))
                ours.start()
                try:
                    yield Scene(d, cluster, redis, ours, alice, alice.device_id or "",
                                rooms, peers)
                finally:
                    ours.stop()
                    d.stop_federation_sender()
            finally:
                d.stop()
    finally:
        redis.close()


def traffic(s: Scene, t: Traffic, rng: random.Random) -> None:
    """The client's stream until ``t.stop``; a call that fails (main or its database
    down) is counted and the stream goes on."""
    d, alice = s.d, s.alice
    i = 0
    while not t.stop.is_set():
        i += 1
        room = s.rooms[i % len(s.rooms)]
        kind = rng.choice(["msg", "msg", "msg", "typing", "receipt", "to_device", "rename"])
        try:
            if kind == "msg":
                t.events[d.client.send_message(alice, room, f"chaos {i}")] = room
            elif kind == "typing":
                path = f"/_matrix/client/v3/rooms/{q(room)}/typing/{q(alice.user_id)}"
                d.client.call("PUT", path, {"typing": i % 2 == 0, "timeout": 5000},
                              alice.access_token)
                t.typing += 1
            elif kind == "receipt" and t.events:
                event_id = next(e for e in reversed(t.events) if t.events[e] == room)
                path = f"/_matrix/client/v3/rooms/{q(room)}/receipt/m.read/{q(event_id)}"
                d.client.call("POST", path, {}, alice.access_token)
                t.receipts += 1
            elif kind == "to_device":
                peer = s.peers[i % len(s.peers)]
                marker = f"td {i} {uuid.uuid4().hex[:8]}"
                body = {"messages": {peer.user_id(): {"DEV": {"m": marker}}}}
                d.client.call("PUT", f"/_matrix/client/v3/sendToDevice/m.test/{uuid.uuid4().hex}",
                              body, alice.access_token)
                t.to_device[marker] = peer.server_name
            elif kind == "rename":
                d.client.call("PUT", f"/_matrix/client/v3/devices/{q(s.device_id)}",
                              {"display_name": f"name {i}"}, alice.access_token)
                t.renames += 1
        except Exception as e:  # main, Redis or PostgreSQL down: counted, not fatal
            t.failures[f"{kind}: {type(e).__name__}"] += 1
        t.stop.wait(0.05)


def max_ordering(s: Scene) -> int:
    return int(s.d.sql("SELECT coalesce(max(stream_ordering), 0) FROM events"))


def min_last_successful(s: Scene) -> int:
    names = ", ".join(f"'{p.server_name}'" for p in s.peers)
    v = s.d.sql(
        "SELECT coalesce(min(coalesce(last_successful_stream_ordering, 0)), 0) "
        f"FROM destinations WHERE destination IN ({names})"
    )
    return int(v)


def run_faults(
    s: Scene, network: PeerNetwork, rng: random.Random, log: list[str],
    handovers: list[tuple[int, int]],
) -> None:
    """``handovers``: for each leg of Synapse's own sender, the stream orderings it may
    have sent as a room's newest event only: above every server's
    ``last_successful_stream_ordering`` when ours stopped, up to the end of the stream
    when ours was back."""
    clock = SystemClock()
    end = clock.monotonic_s() + CHAOS_S
    schedule = list(FAULTS)
    rng.shuffle(schedule)
    while schedule or clock.monotonic_s() < end:
        fault = schedule.pop() if schedule else rng.choice(FAULTS)
        started = clock.monotonic_s()
        pause = rng.uniform(1.0, 3.0)
        if fault == "kill":
            s.ours.stop(kill=True)
            s.ours.start()
        elif fault == "redis":
            s.redis.stop()
            threading.Event().wait(pause)
            s.redis.start()
        elif fault == "postgres":
            s.cluster.restart()
        elif fault == "main":
            s.d.main.stop()
            s.d.main.start()
        elif fault == "peer":
            peer = rng.choice(s.peers)
            with network.locked():
                peer.send_status = 503
            threading.Event().wait(pause * 2)
            with network.locked():
                peer.send_status = 200
            contact_main(s, network, peer)
        elif fault == "handover":
            s.ours.stop()
            low = min_last_successful(s)
            s.d.start_federation_sender()
            threading.Event().wait(pause)
            s.d.stop_federation_sender()
            s.ours.start()
            handovers.append((low, max_ordering(s)))
        log.append(f"{fault} {clock.monotonic_s() - started:.1f}s")
        threading.Event().wait(rng.uniform(0.5, 2.0))


def contact_main(s: Scene, network: PeerNetwork, peer: FederationPeer) -> None:
    """The server is back and talks to main, which clears its backoff and tells the
    sender (retried: main may be restarting)."""
    for _ in range(20):
        try:
            network.send_transaction(peer, s.d.server_name)
            return
        except Exception:  # main not answering yet
            threading.Event().wait(0.5)


def audit_events(s: Scene, t: Traffic, handovers: list[tuple[int, int]]) -> dict[str, int]:
    """Each (event, server): delivered; else represented (persisted during a leg of
    Synapse's sender, and the server got a later event of its room); else lost."""
    rows = s.d.sql(
        "SELECT event_id, room_id, stream_ordering FROM events WHERE room_id IN ("
        + ", ".join(f"'{r}'" for r in s.rooms) + ")"
    )
    parsed = [ln.split("|") for ln in rows.splitlines() if ln]
    order = {e: int(o) for e, _r, o in parsed}
    room_of = {e: r for e, r, _o in parsed}
    out = Counter[str]()
    for p in s.peers:
        counts = p.event_counts()
        newest_seen = {r: max((order[e] for e in counts if e in order and e in room_of
                               and room_of[e] == r), default=0) for r in s.rooms}
        for e, room in t.events.items():
            if counts[e] >= 1:
                out["delivered"] += 1
                out["duplicates"] += counts[e] - 1
            elif order.get(e, 1 << 62) < newest_seen[room] and any(
                lo < order[e] <= hi for lo, hi in handovers
            ):
                out["represented"] += 1
            else:
                out["lost"] += 1
    return dict(out)


def audit_edus(s: Scene, t: Traffic) -> dict[str, int]:
    out = Counter[str]()
    peers = {p.server_name: p for p in s.peers}
    for marker, dest in t.to_device.items():
        ids = [e["content"].get("message_id") for e in peers[dest].edus("m.direct_to_device")
               if any(m.get("m") == marker for per_user in e["content"]["messages"].values()
                      for m in per_user.values())]
        out["to_device_delivered" if ids else "to_device_lost"] += 1
        out["to_device_duplicates"] += len(ids) - len(set(ids)) if ids else 0
        out["to_device_twice_after_dedup"] += 1 if len(set(ids)) > 1 else 0
    for p in s.peers:
        got = Counter(e["content"]["stream_id"] for e in p.edus("m.device_list_update")
                      if e["content"].get("user_id") == s.alice.user_id)
        out["device_list_updates"] += len(got)
        out["device_list_duplicates"] += sum(n - 1 for n in got.values())
        last = s.d.sql(
            "SELECT stream_id FROM device_lists_outbound_last_success "
            f"WHERE destination = '{p.server_name}' AND user_id = '{s.alice.user_id}'"
        ).strip()
        if last and int(last) not in got:
            out["device_list_recorded_not_delivered"] += 1
    out["device_list_pokes_left"] = int(s.d.sql(
        f"SELECT count(*) FROM device_lists_outbound_pokes WHERE user_id = '{s.alice.user_id}'"
    ))  # fmt: skip
    return dict(out)


@pytest.mark.timeout(3600 if LONG else 420)
def test_chaos_beside_synapse_loses_nothing(scene: Scene, network: PeerNetwork) -> None:
    s = scene
    rng = random.Random(SEED)
    t = Traffic()
    sender = threading.Thread(target=traffic, args=(s, t, random.Random(SEED + 1)),
                              name="traffic", daemon=True)
    sender.start()
    faults: list[str] = []
    handovers: list[tuple[int, int]] = []
    try:
        run_faults(s, network, rng, faults, handovers)
    finally:
        t.stop.set()
        sender.join(60)
    assert s.ours.running
    for p in s.peers:  # every server up, its backoff cleared
        with network.locked():
            p.send_status = 200
        contact_main(s, network, p)
    fences = {r: s.d.client.send_message(s.alice, r, "fence") for r in s.rooms}
    marker = f"td fence {uuid.uuid4().hex[:8]}"
    s.d.client.call(
        "PUT", f"/_matrix/client/v3/sendToDevice/m.test/{uuid.uuid4().hex}",
        {"messages": {p.user_id(): {"DEV": {"m": marker}} for p in s.peers}},
        s.alice.access_token,
    )  # fmt: skip
    network.wait_for(
        lambda: all(set(fences.values()) <= p.event_ids_seen for p in s.peers),
        timeout_s=180 if LONG else 90,
        what="the fences at every server",
    )
    def outboxes_empty() -> bool:
        left = s.d.sql("SELECT count(*) FROM device_federation_outbox").strip()
        pokes = s.d.sql("SELECT count(*) FROM device_lists_outbound_pokes").strip()
        return left == "0" and pokes == "0"

    wait(outboxes_empty, 90, "the to-device outbox and the device-list pokes drained")
    events = audit_events(s, t, handovers)
    edus = to_device_audit(s, t, marker)
    print(f"\nsynapse chaos: {CHAOS_S:.0f} s, seed {SEED}, faults {faults}; sent "
          f"{len(t.events)} messages, {len(t.to_device)} to-device, {t.renames} renames, "
          f"{t.receipts} receipts, {t.typing} typing; client failures {dict(t.failures)}; "
          f"Synapse's legs {handovers}; refused by a server down "
          f"{sum(p.refused_transactions for p in s.peers)}; "
          f"events {events}; edus {edus}")
    assert set(FAULTS) <= {f.split()[0] for f in faults}
    assert events.get("lost", 0) == 0, events
    assert edus.get("to_device_lost", 0) == 0, edus
    assert edus.get("to_device_twice_after_dedup", 0) == 0, edus
    assert edus.get("device_list_recorded_not_delivered", 0) == 0, edus
    assert edus["device_list_pokes_left"] == 0, edus
    # Restarts are expected operational errors: one line each, never a traceback.
    lines = Path(s.ours.log_path).read_text(errors="replace").splitlines()
    traced = sorted({lines[i - 1][25:160] for i, ln in enumerate(lines)
                     if ln.startswith("Traceback") and i > 0})
    assert traced == [], traced


def to_device_audit(s: Scene, t: Traffic, fence_marker: str) -> dict[str, int]:
    """:func:`audit_edus`, with the fence's to-device message (one per server)."""
    out = audit_edus(s, t)
    for p in s.peers:
        n = sum(1 for e in p.edus("m.direct_to_device")
                for per_user in e["content"]["messages"].values()
                for m in per_user.values() if m.get("m") == fence_marker)
        out["to_device_delivered" if n else "to_device_lost"] = (
            out.get("to_device_delivered" if n else "to_device_lost", 0) + 1)
    return out


def wait(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    clock = SystemClock()
    deadline = clock.monotonic_s() + timeout_s
    while not cond():
        if clock.monotonic_s() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        threading.Event().wait(0.2)
