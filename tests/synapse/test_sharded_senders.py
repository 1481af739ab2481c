"""Two of our workers as Synapse 1.163's federation senders: ``federation_sender_instances:
[fed1, fed2]`` (issue 34 item 2).

Main on PostgreSQL and Redis, our worker as ``fed1`` and as ``fed2`` (each started from
Synapse's files with its own worker file), 20 fake remote servers joined to one room.
Each destination belongs to one instance by Synapse's rule
(``ShardedWorkerHandlingConfig``: sha256 of the destination, little-endian, modulo the
number of instances); the split is asked from Synapse's own code in its virtualenv, not
re-derived. In order:

1. both run: messages, typing, a receipt, a to-device message to every server and a
   device-list change arrive once at every destination, each destination served by its
   instance only (our transaction log says which instance sent what);
2. fed2 stops: fed1's destinations go on receiving, fed2's receive nothing and lose
   nothing: when fed2 starts again it catches up from its own positions (the events
   position in ``federation_stream_position``, the to-device outbox, the device-list
   pokes, the receipts table);
3. one of fed2's destinations goes down (its events wait in ``destination_rooms``
   above its ``last_successful_stream_ordering``), then both stop, the list becomes
   ``[fed1]``, and fed1 alone starts: it takes the minimum events position of the
   table (Synapse's ``_reset_federation_positions_txn``), sends what was persisted
   while neither ran to all 20, and when the down server comes back (it contacts main,
   which clears its backoff) catches it up from ``destination_rooms``. Before that,
   fed2 stops first and fed1 serves its own destinations alone: fed1's takeover then
   starts from fed2's older position, and sends the events in between to fed2's
   destinations only, each destination resuming from its own delivered position
   (issue #44.2: no duplicate at fed1's destinations, new events during the takeover).

Main is not restarted, so it keeps ``[fed1, fed2]`` from its start: in 1.163 main uses
the list only to account the acknowledgements of the ``federation`` stream, which
nothing writes.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import threading
import urllib.parse
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from federation_sender.testing.certs import LoopbackCA
from federation_sender.testing.ports import free_port
from federation_sender.testing.postgres import PostgresCluster
from federation_sender.testing.redis_server import ephemeral_redis
from federation_sender.testing.synapse_client import User
from federation_sender.testing.synapse_config import RedisAddress, worker_config
from federation_sender.testing.synapse_deployment import SynapseDeployment, create_deployment
from federation_sender.testing.synapse_peer import FederationPeer, PeerNetwork
from federation_sender.testing.waiting import wait_until_blocking
from tests.synapse import edu_support as e2ee
from tests.synapse.backend_support import OurWorker

pytestmark = pytest.mark.postgres

INSTANCES = ["fed1", "fed2"]
N_PEERS = 20

SYNAPSE_SPLIT = """
import json, sys
from synapse.config._base import ShardedWorkerHandlingConfig
config = ShardedWorkerHandlingConfig(json.loads(sys.argv[1]))
print(json.dumps({d: [i for i in config.instances if config.should_handle(i, d)]
                  for d in json.loads(sys.argv[2])}))
"""


@dataclass
class Scene:
    d: SynapseDeployment
    workers: dict[str, OurWorker]
    alice: User
    room_id: str
    peers: list[FederationPeer]
    owner: dict[str, str]
    """destination -> the instance Synapse's own code says handles it."""

    def peers_of(self, instance: str) -> list[FederationPeer]:
        return [p for p in self.peers if self.owner[p.server_name] == instance]


def write_instances(d: SynapseDeployment, instances: list[str]) -> None:
    config = json.loads(d.homeserver_yaml.read_text())
    config["federation_sender_instances"] = instances
    d.homeserver_yaml.write_text(json.dumps(config, indent=1))


def synapse_split(d: SynapseDeployment, destinations: list[str]) -> dict[str, str]:
    done = subprocess.run(
        [str(d.python), "-c", SYNAPSE_SPLIT, json.dumps(INSTANCES), json.dumps(destinations)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    handled: dict[str, list[str]] = json.loads(done.stdout)
    assert all(len(v) == 1 for v in handled.values()), handled  # exactly one each
    return {dest: v[0] for dest, v in handled.items()}


@pytest.fixture(scope="module")
def deployment(
    pg_cluster: PostgresCluster, loopback_ca: LoopbackCA, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SynapseDeployment]:
    """A deployment of its own (its list of senders changes)."""
    with ephemeral_redis() as redis_server:
        d = create_deployment(
            tmp_path_factory.mktemp("synapse-sharded"),
            ca=loopback_ca,
            cluster=pg_cluster,
            database_name="synapse_sharded",
            redis=RedisAddress(redis_server.host, redis_server.port),
        )
        write_instances(d, INSTANCES)
        # fed2's own health port: both of ours serve their worker file's listeners.
        layout2 = dataclasses.replace(
            d.layout, instance_name="fed2",
            ports=dataclasses.replace(d.layout.ports, worker_health=free_port()),
        )
        fed2 = worker_config(layout2)
        (d.directory / "fed2.yaml").write_text(json.dumps(fed2))
        d.start()
        try:
            yield d
        finally:
            d.stop()


def start_all(workers: list[OurWorker]) -> None:
    """Start several of ours at once (each waits for its own replication start)."""
    errors: list[BaseException] = []

    def start(w: OurWorker) -> None:
        try:
            w.start()
        except BaseException as e:  # re-raised below
            errors.append(e)

    threads = [threading.Thread(target=start, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


@pytest.fixture(scope="module")
def scene(
    deployment: SynapseDeployment,
    network: PeerNetwork,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Scene]:
    d = deployment
    alice = d.client.register(f"alice_{uuid.uuid4().hex[:8]}")
    room_id = d.client.create_room(alice)
    peers = network.add_peers(N_PEERS)
    for p in peers:
        network.join(p, room_id, d.server_name)
    owner = synapse_split(d, [p.server_name for p in peers])
    workers = {i: OurWorker(d, tmp_path_factory.mktemp(i), instance=i) for i in INSTANCES}
    start_all(list(workers.values()))
    try:
        yield Scene(d, workers, alice, room_id, peers, owner)
    finally:
        for w in workers.values():
            w.stop()


def q(s: str) -> str:
    return urllib.parse.quote(s, safe="")


def send(s: Scene, n: int, tag: str) -> list[str]:
    return [s.d.client.send_message(s.alice, s.room_id, f"{tag} {i}") for i in range(n)]


def wait_events(net: PeerNetwork, peers: list[FederationPeer], ids: list[str], what: str,
                timeout_s: float = 60.0) -> None:
    net.wait_for(lambda: all(set(ids) <= p.event_ids_seen for p in peers),
                 timeout_s=timeout_s, what=what)


def to_device(s: Scene, tag: str) -> str:
    """One to-device message to a device of every peer; returns its marker."""
    marker = f"{tag} {uuid.uuid4().hex}"
    body = {"messages": {p.user_id(): {"DEV": {"m": marker}} for p in s.peers}}
    s.d.client.call("PUT", f"/_matrix/client/v3/sendToDevice/m.test/{uuid.uuid4().hex}", body,
                    s.alice.access_token)
    return marker


def to_device_count(p: FederationPeer, marker: str) -> int:
    return sum(1 for e in p.edus("m.direct_to_device")
               for per_user in e["content"]["messages"].values()
               for msg in per_user.values() if msg.get("m") == marker)


def receipt(s: Scene, event_id: str) -> None:
    path = f"/_matrix/client/v3/rooms/{q(s.room_id)}/receipt/m.read/{q(event_id)}"
    s.d.client.call("POST", path, {}, s.alice.access_token)


def receipt_count(p: FederationPeer, s: Scene, event_id: str) -> int:
    return sum(1 for e in p.edus("m.receipt")
               if e["content"].get(s.room_id, {}).get("m.read", {})
               .get(s.alice.user_id, {}).get("event_ids") == [event_id])


def new_device(s: Scene, name: str) -> str:
    """Log in a device and publish its keys (device-list pokes for every server)."""
    device = e2ee.login(s.d, s.alice, name)
    e2ee.upload_device_keys(s.d, device)
    return device.device_id


def device_updates(p: FederationPeer, s: Scene, device_id: str) -> list[dict[str, Any]]:
    return [e["content"] for e in p.edus("m.device_list_update")
            if e["content"].get("user_id") == s.alice.user_id
            and e["content"].get("device_id") == device_id]


def device_has_keys(p: FederationPeer, s: Scene, device_id: str) -> bool:
    return any("keys" in u for u in device_updates(p, s, device_id))


def stream_id_twice(p: FederationPeer, s: Scene) -> list[int]:
    ids = Counter(e["content"]["stream_id"] for e in p.edus("m.device_list_update")
                  if e["content"].get("user_id") == s.alice.user_id)
    return [i for i, n in ids.items() if n > 1]


def senders(s: Scene, after_id: int = 0) -> dict[str, set[str]]:
    """destination -> the instances whose transactions to it succeeded (our log)."""
    rows = s.d.sql(
        "SELECT DISTINCT destination, instance_name "
        "FROM federation_sender.federation_transaction_log "
        f"WHERE status = 'success' AND id > {after_id}"
    )
    out: dict[str, set[str]] = {}
    for line in rows.splitlines():
        dest, instance = line.split("|")
        out.setdefault(dest, set()).add(instance)
    return out


def last_log_id(s: Scene) -> int:
    v = s.d.sql("SELECT coalesce(max(id), 0) FROM federation_sender.federation_transaction_log")
    return int(v)


def assert_once(s: Scene, peers: list[FederationPeer], ids: list[str]) -> None:
    for p in peers:
        counts = p.event_counts(s.room_id)
        if {e: counts[e] for e in ids} != dict.fromkeys(ids, 1):
            raise AssertionError(f"{p.server_name}: {explain(s, p, ids, counts)}")


def explain(s: Scene, p: FederationPeer, ids: list[str], counts: Counter[str]) -> str:
    """Which transactions carried an event that is missing or arrived twice, and which
    instance sent each (our transaction log)."""
    odd = [e for e in ids if counts[e] != 1]
    txns = {e: [t.txn_id for t in p.transactions if e in t.event_ids] for e in odd}
    ids_sql = ", ".join(f"'{t}'" for v in txns.values() for t in v) or "''"
    log = s.d.sql(
        "SELECT txn_id, instance_name, status, catchup, started_ts "
        "FROM federation_sender.federation_transaction_log "
        f"WHERE destination = '{p.server_name}' AND txn_id IN ({ids_sql})"
    )
    return f"counts {[(e, counts[e]) for e in odd]}, carried by {txns}; our log: {log!r}"


def test_two_of_ours_split_by_synapses_rule_and_fed1_takes_over(
    scene: Scene, network: PeerNetwork
) -> None:
    s, d = scene, scene.d
    fed1, fed2 = s.workers["fed1"], s.workers["fed2"]
    mine1, mine2 = s.peers_of("fed1"), s.peers_of("fed2")
    assert mine1 and mine2, s.owner  # 20 destinations: both have some
    path = f"/_matrix/client/v3/rooms/{q(s.room_id)}/typing/{q(s.alice.user_id)}"
    typing = {"room_id": s.room_id, "user_id": s.alice.user_id, "typing": True}

    # 1. Both run.
    ids1 = send(s, 10, "both")
    d.client.call("PUT", path, {"typing": True, "timeout": 30000}, s.alice.access_token)
    receipt(s, ids1[-1])
    marker1 = to_device(s, "both")
    phone = new_device(s, "phone")
    wait_events(network, s.peers, ids1, "phase 1 events everywhere")
    network.wait_for(
        lambda: all(
            any(e["content"] == typing for e in p.edus("m.typing"))
            and receipt_count(p, s, ids1[-1]) >= 1
            and to_device_count(p, marker1) >= 1
            and device_has_keys(p, s, phone)
            for p in s.peers
        ),
        what="phase 1 EDUs everywhere",
    )
    assert_once(s, s.peers, ids1)
    for p in s.peers:
        assert sum(1 for e in p.edus("m.typing") if e["content"] == typing) == 1, p.server_name
        assert receipt_count(p, s, ids1[-1]) == 1, p.server_name
        assert to_device_count(p, marker1) == 1, p.server_name
        assert stream_id_twice(p, s) == [], p.server_name
    # Our log row of a transaction is written after its 200, so a moment after the
    # server recorded it.
    wait_until_blocking(lambda: set(senders(s)) == set(s.owner), "our log of phase 1",
                        timeout_s=20)
    by = senders(s)
    assert {dest: sorted(i) for dest, i in by.items()} == {
        dest: [i] for dest, i in s.owner.items()
    }

    # 2. fed2 stops: its destinations wait, and nothing is lost when it is back.
    assert fed2.stop() == 0
    ids2 = send(s, 10, "fed2 down")
    receipt(s, ids2[-1])
    marker2 = to_device(s, "fed2 down")
    tablet = new_device(s, "tablet")
    wait_events(network, mine1, ids2, "phase 2 events at fed1's destinations")
    network.wait_for(
        lambda: all(
            receipt_count(p, s, ids2[-1]) >= 1
            and to_device_count(p, marker2) >= 1
            and device_has_keys(p, s, tablet)
            for p in mine1
        ),
        what="phase 2 EDUs at fed1's destinations",
    )
    for p in mine2:  # nothing of phase 2 went to fed2's destinations
        assert not set(ids2) & p.event_ids_seen, p.server_name
        assert to_device_count(p, marker2) == 0 and device_updates(p, s, tablet) == []
    fed2.start()
    wait_events(network, mine2, ids2, "fed2 catching up its destinations")
    network.wait_for(
        lambda: all(
            receipt_count(p, s, ids2[-1]) >= 1
            and to_device_count(p, marker2) >= 1
            and device_has_keys(p, s, tablet)
            for p in mine2
        ),
        what="fed2 catching up the EDUs",
    )
    assert_once(s, s.peers, ids1 + ids2)
    for p in s.peers:
        assert receipt_count(p, s, ids2[-1]) == 1, p.server_name
        assert to_device_count(p, marker2) == 1, p.server_name
        assert stream_id_twice(p, s) == [], p.server_name

    # 3. One of fed2's destinations goes down and misses events; fed2 stops and fed1
    # goes on serving its own (fed2's position stays behind fed1's); fed1 stops; fed1
    # alone takes over every destination from the stored positions, with new events
    # arriving while it starts. Synapse's reset gives fed1 fed2's older position: the
    # events in between go to fed2's destinations, once, and not again to fed1's own
    # (issue #44.2: 420 and 84 duplicates there before).
    down = mine2[0]
    down.send_status = 503
    missed = send(s, 3, "down")
    wait_events(network, mine1 + mine2[1:], missed, "phase 3 events at the servers up")
    network.wait_for(lambda: down.refused_transactions > 0, what="the down server refusing")
    assert not set(missed) & down.event_ids_seen
    assert fed2.stop() == 0
    only1 = send(s, 6, "fed1 alone")
    wait_events(network, mine1, only1, "fed1's destinations served while fed2 is down")
    assert fed1.stop() == 0
    neither = send(s, 4, "neither")
    marker3 = to_device(s, "neither")
    write_instances(d, ["fed1"])
    log_before = last_log_id(s)
    fed1.start()
    during = send(s, 3, "takeover")
    up = [p for p in s.peers if p is not down]
    wait_events(network, mine2[1:], only1, "fed1 sending fed2's destinations what fed2 missed")
    wait_events(network, up, neither + during, "fed1 sending what neither sent, to all but one")
    network.wait_for(lambda: all(to_device_count(p, marker3) >= 1 for p in up),
                     what="fed1 sending the to-device message to all but one")
    down.send_status = 200
    network.send_transaction(down, d.server_name)  # back: it talks to main
    wait_events(network, [down], missed + only1 + neither + during,
                "the down server caught up by fed1")
    network.wait_for(lambda: to_device_count(down, marker3) >= 1, what="its to-device")
    assert_once(s, s.peers, ids1 + ids2 + missed + only1 + neither + during)
    window = Path(fed1.log_path).read_text(errors="replace")
    assert "Replay window ended" in window, "fed1 never resumed from an older position"
    for p in s.peers:
        assert to_device_count(p, marker3) == 1, p.server_name
        assert stream_id_twice(p, s) == [], p.server_name
    wait_until_blocking(lambda: set(senders(s, log_before)) == set(s.owner),
                        "our log of phase 3", timeout_s=20)
    assert all(i == {"fed1"} for i in senders(s, log_before).values())
    rows = d.sql("SELECT DISTINCT instance_name FROM federation_stream_position").split()
    assert rows == ["fed1"]
    for w in (fed1, fed2):
        log = Path(w.log_path).read_text(errors="replace")
        assert "Traceback" not in log, w.instance
