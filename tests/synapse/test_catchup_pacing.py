"""A backlog of 150 events in one room reaches a real Synapse receiver whole (issue 33,
item 2).

Synapse answers ``/send`` once the PDUs are staged (``federation_inbound_events_staging``),
processes them afterwards, and prunes a room's staging queue once it holds 100 events
(``prune_staged_events_in_room``): what it prunes is absent until someone backfills.
Our worker (the session deployment's federation sender, ``catchup_max_gap_events:
1000`` so that the gap is replayed) is stopped, or killed mid-burst, while 150
messages are sent into a room a receiving Synapse 1.163 (SQLite) has a user in; it is
then started again and catches up, pacing the replay (``queue/pacing.py``). Every
event must then be an ordinary (non-outlier) event at the receiver, its staging queue
of the room empty, and its log without a ``Pruning`` line. bench/catchup_backlog.py
measures 1,000 events, beside Synapse's own sender.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from federation_sender.testing.backlog import send_burst, wait_live
from federation_sender.testing.certs import LoopbackCA
from federation_sender.testing.outage import SendingRoom, join_rooms
from federation_sender.testing.synapse_deployment import SynapseDeployment, create_deployment
from tests.synapse.backend_support import OurWorker

pytestmark = pytest.mark.postgres

COUNT = 150


@pytest.fixture(scope="module")
def receiver(loopback_ca: LoopbackCA, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[SynapseDeployment]:
    d = create_deployment(tmp_path_factory.mktemp("backlog-receiver"), ca=loopback_ca)
    d.start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def paced(synapse_deployment: SynapseDeployment, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[OurWorker]:
    synapse_deployment.stop_federation_sender()
    worker = OurWorker(synapse_deployment, tmp_path_factory.mktemp("backlog-ours"),
                       queue={"catchup_max_gap_events": 1000})
    worker.start()
    yield worker
    worker.stop()


def _room(ours: OurWorker, receiver: SynapseDeployment) -> SendingRoom:
    d = ours.d
    alice = d.client.register(f"alice_{uuid.uuid4().hex[:8]}")
    room = SendingRoom(d, alice, d.client.create_room(alice))
    bob = receiver.client.register(f"bob_{uuid.uuid4().hex[:8]}")
    join_rooms(receiver, bob, {"ours": room})
    return room


def _check(ours: OurWorker, receiver: SynapseDeployment, room: SendingRoom,
           ids: list[str]) -> None:
    took, state = wait_live(receiver, room.room_id, ids, timeout_s=60.0)
    assert took is not None, (state, ours.log_tail())
    assert state.outliers == 0 and not state.pruned, state
    assert "not confirmed" not in ours.log_tail(50_000)


def test_150_events_after_a_stop_are_all_live_at_the_receiver(
    paced: OurWorker, receiver: SynapseDeployment, tmp_path: Path
) -> None:
    room = _room(paced, receiver)
    paced.stop()
    try:
        ids = send_burst(paced.d, room.user, room.room_id, COUNT)
    finally:
        paced.start()
    _check(paced, receiver, room, ids)


def test_150_events_after_a_sigkill_mid_burst_are_all_live_at_the_receiver(
    paced: OurWorker, receiver: SynapseDeployment
) -> None:
    room = _room(paced, receiver)
    try:
        ids = send_burst(paced.d, room.user, room.room_id, COUNT, after=30,
                         then=lambda: paced.stop(kill=True))
    finally:
        paced.start()
    _check(paced, receiver, room, ids)
