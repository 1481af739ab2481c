"""A real Synapse receiver back during our persisted backoff (issue #44.4).

Our worker is the session deployment's federation sender (the suite's Synapse settings:
2 long retries 500 ms apart, so a receiver that refuses connections is backed off 600 s
about a second after its first failure, as Synapse's own sender is there). A second
Synapse 1.163 (SQLite, its defaults) has a user in our room. It is stopped, a message
is sent, our worker persists its 600 s backoff, and the receiver starts again 20 s
later; nobody contacts our homeserver. The return probe (here every 10 s, to keep the
test short; the default is 60 s) must find it and the message must be visible there
within the probe interval and 3 s of its port accepting connections, where the
backoff alone held it for the rest of 600 s (and Synapse's sender does).

``OUTAGE_LONG=1`` runs tests/synapse/test_short_outage.py's 574 s outage with the
default settings (60 s probes, Synapse's 10 long retries).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from federation_sender.testing.certs import LoopbackCA
from federation_sender.testing.outage import (
    persisted_retry_interval,
    shared_room,
    short_outage,
)
from federation_sender.testing.synapse_deployment import SynapseDeployment, create_deployment
from federation_sender.testing.waiting import wait_until_blocking
from tests.synapse.backend_support import OurWorker

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(300)]

PROBE_S = 10.0


@pytest.fixture(scope="module")
def receiver(loopback_ca: LoopbackCA, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[SynapseDeployment]:
    d = create_deployment(tmp_path_factory.mktemp("probe-receiver"), ca=loopback_ca)
    d.start()
    yield d
    d.stop()


def test_a_receiver_back_during_the_backoff_gets_its_message_at_the_next_probe(
    synapse_deployment: SynapseDeployment, receiver: SynapseDeployment,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    d = synapse_deployment
    d.stop_federation_sender()
    ours = OurWorker(d, tmp_path_factory.mktemp("probe-ours"),
                     queue={"return_probe_interval_s": PROBE_S})
    ours.start()
    try:
        room, bob = shared_room(d, receiver)

        def backed_off() -> int:
            return persisted_retry_interval(d, receiver.server_name)

        def persisted_before_return() -> None:
            # The outage reached the persisted backoff: without the probe, the message
            # would wait the rest of its 600 s.
            wait_until_blocking(backed_off, "the persisted backoff", timeout_s=15,
                                accept=lambda v: v == 600_000)

        result = short_outage(receiver, bob, {"ours": room}, outage_s=20.0, wait_s=60.0,
                              before_return=persisted_before_return)
        arrival = result.arrival_s["ours"]
        sys.stderr.write(f"\nreturn probe: {result}\n")
        assert arrival is not None and arrival <= PROBE_S + 3.0, (result, ours.log_tail())
        log = ours.log_tail(50_000)
        assert "answers again during its backoff: sending now" in log, log[-3000:]
        # The success reset the persisted backoff (main and Synapse's workers see it).
        wait_until_blocking(backed_off, "the backoff reset", timeout_s=10,
                            accept=lambda v: v == 0)
        assert ours.running
    finally:
        ours.stop()
