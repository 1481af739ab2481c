"""A backlog in one room reaches a real Synapse receiver whole, with our default
settings (issue 33, item 2).

Synapse answers ``/send`` once the PDUs are staged (``federation_inbound_events_staging``),
processes them afterwards, and prunes a room's staging queue once it holds 100 events
(``prune_staged_events_in_room``): what it prunes is absent until someone backfills;
of what it never got, ``get_missing_events`` fetches at most 10. Our worker (the session
deployment's federation sender, its default configuration) is stopped, or killed
(SIGKILL) mid-burst, while 150 messages are sent into a room a receiving Synapse 1.163
(SQLite, its default settings) has a user in; it is then started again and catches
up: the room's gap is read and sent a page of 50 at a time (``queue/core/catchup.py``), each
page confirmed processed by the receiver before the next (``queue/core/pacing.py``). Every
event must then be live at the receiver (neither an outlier nor backfilled, in the
room's timeline as its user reads it through /messages), its staging queue of the room
empty, and its log without a ``Pruning`` line. A second SIGKILL, in the middle of
the catch-up, loses nothing either.

``BACKLOG_LONG=1``: 1,000 messages instead of 150 (minutes).
bench/catchup_backlog.py measures the same beside Synapse's own sender.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest

from federation_sender.queue.core.catchup import GAP_PAGE_EVENTS
from federation_sender.testing.backlog import (
    receiver_state,
    send_burst,
    timeline_ids,
    wait_live,
)
from federation_sender.testing.certs import LoopbackCA
from federation_sender.testing.outage import (
    SendingRoom,
    shared_room,
)
from federation_sender.testing.synapse_client import User
from federation_sender.testing.synapse_deployment import SynapseDeployment, create_deployment
from federation_sender.testing.waiting import wait_until_blocking
from tests.synapse.backend_support import OurWorker

LONG = bool(os.environ.get("BACKLOG_LONG"))
COUNT = 1000 if LONG else 150
WAIT_S = 600.0 if LONG else 60.0

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(1800 if LONG else 300)]
log = logging.getLogger(__name__)


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
    worker = OurWorker(synapse_deployment, tmp_path_factory.mktemp("backlog-ours"))
    worker.start()
    yield worker
    worker.stop()


def _room(ours: OurWorker, receiver: SynapseDeployment) -> tuple[SendingRoom, User]:
    return shared_room(ours.d, receiver)


def _check(ours: OurWorker, receiver: SynapseDeployment, room: SendingRoom, bob: User,
           ids: list[str], case: str) -> None:
    took, state = wait_live(receiver, room.room_id, ids, timeout_s=WAIT_S)
    assert took is not None, (state, ours.log_tail())
    assert state.outliers == 0 and state.backfilled == 0 and not state.pruned, state
    assert "not confirmed" not in ours.log_tail(50_000)
    # As the receiver's user reads the room: every message, in the order sent.
    timeline = timeline_ids(receiver, bob, room.room_id, COUNT + 20)
    assert [e for e in timeline if e in set(ids)] == ids
    log.info("%d events after %s: all live %.1f s after the restart", COUNT, case, took)


def test_a_backlog_after_a_stop_is_all_live_at_the_receiver(
    paced: OurWorker, receiver: SynapseDeployment
) -> None:
    room, bob = _room(paced, receiver)
    paced.stop()
    try:
        ids = send_burst(paced.d, room.user, room.room_id, COUNT)
    finally:
        paced.start()
    _check(paced, receiver, room, bob, ids, "a stop")


def test_a_backlog_after_a_sigkill_mid_burst_is_all_live_at_the_receiver(
    paced: OurWorker, receiver: SynapseDeployment
) -> None:
    room, bob = _room(paced, receiver)
    try:
        ids = send_burst(paced.d, room.user, room.room_id, COUNT, after=COUNT // 5,
                         then=lambda: paced.stop(kill=True))
    finally:
        paced.start()
    _check(paced, receiver, room, bob, ids, "a SIGKILL mid-burst")


def test_a_second_sigkill_in_the_middle_of_the_catch_up_loses_nothing(
    paced: OurWorker, receiver: SynapseDeployment
) -> None:
    """Killed mid-burst, restarted, and killed again once the receiver holds two pages
    of the catch-up: the position did not move past what the receiver confirmed, so the
    third start finishes the room, without sending the pages the receiver holds back to
    back (Synapse stages duplicates too: it pruned the room without that)."""
    room, bob = _room(paced, receiver)
    before = COUNT // 5
    try:
        ids = send_burst(paced.d, room.user, room.room_id, COUNT, after=before,
                         then=lambda: paced.stop(kill=True))
    finally:
        paced.start()
    try:
        state = wait_until_blocking(
            lambda: receiver_state(receiver, room.room_id, ids),
            "a page of the catch-up live at the receiver", timeout_s=WAIT_S,
            accept=lambda s: s.live >= before + 2 * GAP_PAGE_EVENTS, every_s=0.05)
    finally:
        paced.stop(kill=True)
    assert state.live < COUNT, state  # the second kill came in the middle
    paced.start()
    _check(paced, receiver, room, bob, ids, "a second SIGKILL in the middle of the catch-up")
