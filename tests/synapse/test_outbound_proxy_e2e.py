"""A Synapse 1.163 deployment whose outbound federation is restricted to our worker.

Main and a generic worker both have ``outbound_federation_restricted_to: [fed1]``; our
worker runs as ``fed1`` and serves the proxy where ``instance_map`` puts it. A second
real Synapse (SQLite, sending for itself) hosts a room. A user of the restricted
deployment joins it (key fetch, ``make_join``, ``send_join``), reads a remote profile
through the generic worker, and reads history that main backfills; every one of those
requests is in our worker's access log and metrics. With our worker stopped the
deployment reaches nothing remote: it never went around us.
"""

from __future__ import annotations

import re
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from federation_sender.testing.certs import LoopbackCA
from federation_sender.testing.our_sender import OurSender
from federation_sender.testing.ports import free_port
from federation_sender.testing.postgres import PostgresCluster
from federation_sender.testing.redis_server import ephemeral_redis
from federation_sender.testing.synapse_client import ClientApiError
from federation_sender.testing.synapse_config import RedisAddress
from federation_sender.testing.synapse_deployment import SynapseDeployment, create_deployment
from federation_sender.testing.synapse_egress import (
    add_generic_worker,
    restrict_outbound_federation,
)
from federation_sender.testing.waiting import wait_until_blocking
from federation_sender.transport.outbound_proxy import REQUESTS_METRIC

pytestmark = pytest.mark.postgres
WAIT_S = 30.0


def q(s: str) -> str:
    return urllib.parse.quote(s, safe="")


@pytest.fixture(scope="module")
def peer(loopback_ca: LoopbackCA, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[SynapseDeployment]:
    deployment = create_deployment(tmp_path_factory.mktemp("synapse-peer"), ca=loopback_ca)
    deployment.start()
    yield deployment
    deployment.stop()


def _metric(port: int, name: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "_total{"):
            labels, _, value = line.rpartition(" ")
            out[labels[len(name) + 6:]] = float(value)
    return out


def test_restricted_deployment_reaches_federation_only_through_our_worker(
    pg_cluster: PostgresCluster, loopback_ca: LoopbackCA, peer: SynapseDeployment,
    tmp_path: Path,
) -> None:
    with ephemeral_redis() as redis:
        d = create_deployment(
            tmp_path / "synapse", ca=loopback_ca, cluster=pg_cluster,
            database_name=f"synapse_egress_{uuid.uuid4().hex[:8]}",
            redis=RedisAddress(redis.host, redis.port),
        )  # fmt: skip
        restrict_outbound_federation(d)
        worker, worker_client = add_generic_worker(d, "generic1")
        metrics_port = free_port()
        ours = OurSender(d, tmp_path / "ours", {"telemetry": {"metrics_port": metrics_port}})
        try:
            d.start()
            worker.start()
            ours.start()
            _scenario(d, worker_client, peer, ours, metrics_port)
        finally:
            ours.stop()
            worker.stop()
            d.stop()


def _scenario(d: SynapseDeployment, worker_client: object, peer: SynapseDeployment,
              ours: OurSender, metrics_port: int) -> None:
    from federation_sender.testing.synapse_client import SynapseClient

    assert isinstance(worker_client, SynapseClient)
    bob = peer.client.register(f"bob_{uuid.uuid4().hex[:8]}")
    peer.client.call("PUT", f"/_matrix/client/v3/profile/{q(bob.user_id)}/displayname",
                     {"displayname": "Bob of the peer"}, bob.access_token)
    room_id = peer.client.create_room(bob)
    history = [peer.client.send_message(bob, room_id, f"before the join {i}") for i in range(5)]

    alice = d.client.register(f"alice_{uuid.uuid4().hex[:8]}")
    d.client.join(alice, room_id, via=[peer.server_name])
    assert alice.user_id in peer.client.joined_members(bob, room_id)

    profile = worker_client.call("GET", f"/_matrix/client/v3/profile/{q(bob.user_id)}",
                                 None, alice.access_token)
    assert profile.get("displayname") == "Bob of the peer"

    def seen() -> set[str]:
        page = d.client.call(
            "GET", f"/_matrix/client/v3/rooms/{q(room_id)}/messages?dir=b&limit=50",
            None, alice.access_token)  # fmt: skip
        return {e["event_id"] for e in page["chunk"]}

    wait_until_blocking(seen, "main backfilling the history before the join",
                        timeout_s=WAIT_S, accept=lambda got: set(history) <= got,
                        every_s=0.2)

    log = ours.log_path.read_text(errors="replace")
    proxied = re.findall(r"(GET|PUT|POST) (\S+?)(/_matrix/\S+) -> (\d+|failed)", log)
    paths = [(m, dest, path) for m, dest, path, _ in proxied if dest == peer.server_name]
    for method, fragment in (("GET", "/_matrix/key/v2/server"),
                             ("GET", "/_matrix/federation/v1/make_join/"),
                             ("PUT", "/_matrix/federation/v2/send_join/"),
                             ("GET", "/_matrix/federation/v1/query/profile"),
                             ("GET", "/_matrix/federation/v1/backfill/")):
        assert any(m == method and p.startswith(fragment) for m, _, p in paths), (
            f"{method} {fragment} not proxied; access log: {proxied}")
    counts = _metric(metrics_port, REQUESTS_METRIC)
    assert counts.get('{code="200",method="GET"}', 0) >= 3
    assert counts.get('{code="200",method="PUT"}', 0) >= 1

    # Without our worker nothing remote is reachable: no process went around it.
    ours.stop()
    with pytest.raises(ClientApiError) as failed:
        worker_client.call("GET", f"/_matrix/client/v3/profile/{q(bob.user_id)}", None,
                           alice.access_token)
    assert failed.value.status >= 500, failed.value
