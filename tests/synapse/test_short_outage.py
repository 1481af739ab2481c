"""A short outage of a real Synapse receiver (issue 33, item 1).

Our worker is the federation sender of a Synapse 1.163 deployment configured with
Synapse's default in-request retries (``federation.max_long_retries`` 10: the
session's deployment sets 2, which hid the difference), and a second Synapse 1.163
(on SQLite, sending for itself) has a user in one of its rooms. The receiver is
stopped for 10 s with a message sent meanwhile, then started again; nobody contacts
our homeserver. The message must be visible there within 3 s of the receiver's port
accepting connections again (before the short-retry phase: the first refused
connection persisted 600 s), and no backoff may have been persisted for it.
bench/short_outage.py measures the same with Synapse's own sender in the same run.

``OUTAGE_LONG=1`` adds issue #44.4's outage into the persisted backoff with every
default (the return probe).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator

import pytest

from federation_sender.testing.certs import LoopbackCA
from federation_sender.testing.outage import (
    persisted_retry_interval,
    shared_room,
    short_outage,
)
from federation_sender.testing.postgres import PostgresCluster
from federation_sender.testing.redis_server import ephemeral_redis
from federation_sender.testing.synapse_config import RedisAddress
from federation_sender.testing.synapse_deployment import SynapseDeployment, create_deployment
from federation_sender.testing.waiting import wait_until_blocking
from tests.synapse.backend_support import OurWorker

pytestmark = pytest.mark.postgres

TARGET_S = 3.0
LONG = bool(os.environ.get("OUTAGE_LONG"))


@pytest.fixture(scope="module")
def sender_deployment(
    pg_cluster: PostgresCluster, loopback_ca: LoopbackCA,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[SynapseDeployment]:
    """A deployment of its own with Synapse's default ``federation:`` section (and a
    Redis of its own: Synapse's external cache keys are not per server)."""
    with ephemeral_redis() as redis:
        d = create_deployment(
            tmp_path_factory.mktemp("outage-sender"), ca=loopback_ca, cluster=pg_cluster,
            database_name="synapse_outage", redis=RedisAddress(redis.host, redis.port),
            overrides={"federation": {}},
        )  # fmt: skip
        d.start()
        try:
            yield d
        finally:
            d.stop()


@pytest.fixture(scope="module")
def receiver(loopback_ca: LoopbackCA, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[SynapseDeployment]:
    d = create_deployment(tmp_path_factory.mktemp("outage-receiver"), ca=loopback_ca)
    d.start()
    yield d
    d.stop()


def test_a_receiver_back_after_10_s_gets_its_message_within_3_s(
    sender_deployment: SynapseDeployment, receiver: SynapseDeployment,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    d = sender_deployment
    assert "max_long_retries" not in d.homeserver_yaml.read_text()  # Synapse's default
    ours = OurWorker(d, tmp_path_factory.mktemp("outage-ours"),
                     queue={"short_retry_probe_window_s": 30.0})  # the default
    ours.start()
    try:
        room, bob = shared_room(d, receiver)
        result = short_outage(receiver, bob, {"ours": room}, outage_s=10.0, wait_s=30.0)
        arrival = result.arrival_s["ours"]
        assert arrival is not None and arrival <= TARGET_S, (result, ours.log_tail())
        # Retried in memory: nothing persisted, so main had no backoff to clear.
        assert persisted_retry_interval(d, receiver.server_name) == 0, ours.log_tail()
        assert "does not answer" in ours.log_tail(20_000)
        assert ours.running
    finally:
        ours.stop()


@pytest.mark.skipif(not LONG, reason="OUTAGE_LONG=1: an outage into the backoff (10 to 14 minutes)")
@pytest.mark.timeout(1800)
def test_a_receiver_back_23_s_into_the_backoff_gets_its_message_within_60_s(
    sender_deployment: SynapseDeployment, receiver: SynapseDeployment,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Issue #44.4's case with every default: the short-retry phase (30 s of probes,
    Synapse's 10 long retries) is over after 8 to 12 minutes and the 600 s backoff
    persisted; the receiver comes back 23 s into that backoff (574 s after it stopped
    in the issue's run); the return probe (every 60 s) finds it, and the message must
    be there within 60 s of its return (before the probe: 580 s)."""
    d = sender_deployment
    ours = OurWorker(d, tmp_path_factory.mktemp("outage-long-ours"),
                     queue={"short_retry_probe_window_s": 30.0})  # the default
    ours.start()
    try:
        room, bob = shared_room(d, receiver)

        def backoff_row() -> int:
            return persisted_retry_interval(d, receiver.server_name)

        def into_the_backoff() -> None:
            # The timing: back 23 s after the 600 s backoff was persisted (the
            # phase's end depends on its jitter: 8 to 12 minutes after the failure).
            wait_until_blocking(backoff_row, "the persisted backoff", timeout_s=900,
                                accept=lambda v: v == 600_000, every_s=0.5)
            time.sleep(23.0)  # the outage itself, in real time
            sys.stderr.write(f"\npersisted retry_interval before the return: "
                             f"{backoff_row()}\n")

        result = short_outage(receiver, bob, {"ours": room}, outage_s=30.0, wait_s=120.0,
                              before_return=into_the_backoff)
        sys.stderr.write(f"outage into the backoff: {result}\n")
        arrival = result.arrival_s["ours"]
        assert arrival is not None and arrival <= 60.0, (result, ours.log_tail())
    finally:
        ours.stop()
