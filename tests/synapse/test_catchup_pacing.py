"""A backlog in one room reaches a real Synapse receiver whole, with our default
settings (issue 33, item 2).

Synapse answers ``/send`` once the PDUs are staged (``federation_inbound_events_staging``),
processes them afterwards, and prunes a room's staging queue once it holds 100 events
(``prune_staged_events_in_room``): what it prunes is absent until someone backfills;
of what it never got, ``get_missing_events`` fetches at most 10. Our worker (the session
deployment's federation sender, its default configuration) is stopped, or killed
(SIGKILL) mid-burst, while 200 messages are sent into a room a receiving Synapse 1.163
(SQLite, its default settings) has a user in; it is then started again and catches
up: the room's gap is read and sent a page of 50 at a time (``queue/core/catchup.py``), each
page confirmed processed by the receiver before the next (``queue/core/pacing.py``). Every
event must then be live at the receiver (neither an outlier nor backfilled, in the
room's timeline as its user reads it through /messages), its staging queue of the room
empty, and its log without a ``Pruning`` line. A second SIGKILL, in the middle of
the catch-up, loses nothing either. While the backlogs are paced, a message in another
room and a to-device message must reach the receiver within seconds: pacing holds back
only the room it paces (issue #44.1). Backlogs in several rooms take turns.

``BACKLOG_LONG=1``: 1,000 messages instead of 200 (ten rooms of 200 instead of three of
120; minutes).
bench/catchup_backlog.py measures the same beside Synapse's own sender.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator

import pytest

from federation_sender.queue.core.catchup import GAP_PAGE_EVENTS
from federation_sender.testing.backlog import (
    other_traffic,
    receiver_state,
    send_burst,
    sync_token,
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
COUNT = 1000 if LONG else 200
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
    timeline = timeline_ids(receiver, bob, room.room_id, len(ids) + 20)
    assert [e for e in timeline if e in set(ids)] == ids
    log.info("%d events after %s: all live %.1f s after the check began", len(ids), case,
             took)


PROMPT_S = 3.0
"""The test's bound on a message's and a to-device message's way to the receiver while
a backlog is paced (issue #44's target is 1.0 s; the measured figures are in
docs/synapse-reference.md, "A backlog in one room"; the bound leaves room for a loaded
CI machine). Before the composer: 26 to 123 s."""


def _prompt_behind_a_backlog(paced: OurWorker, receiver: SynapseDeployment,
                             kill: bool) -> None:
    room, bob = _room(paced, receiver)
    other, carol = _room(paced, receiver)
    since = sync_token(receiver, carol)
    count = COUNT
    if kill:
        try:
            ids = send_burst(paced.d, room.user, room.room_id, count, after=count // 5,
                             then=lambda: paced.stop(kill=True))
        finally:
            paced.start()
    else:
        paced.stop()
        try:
            ids = send_burst(paced.d, room.user, room.room_id, count)
        finally:
            paced.start()
    # The backlog is under way: its first page is live, most of it is not.
    state = wait_until_blocking(
        lambda: receiver_state(receiver, room.room_id, ids),
        "the backlog's next page live at the receiver", timeout_s=WAIT_S,
        accept=lambda s: s.live >= (count // 5 if kill else 0) + GAP_PAGE_EVENTS,
        every_s=0.05)
    assert state.live < count - GAP_PAGE_EVENTS, state
    other_got = other_traffic(paced.d, other.user, other.room_id, receiver, carol, since)
    message_s, to_device_s = other_got.message_s, other_got.to_device_s
    backlog_left = count - receiver_state(receiver, room.room_id, ids).live
    case = "a SIGKILL mid-burst (catch-up)" if kill else "a stop (live)"
    log.info("behind a paced backlog after %s (%d of %d events left): a message in "
             "another room live after %s s, a to-device message after %s s",
             case, backlog_left, count, message_s, to_device_s)
    assert message_s is not None and message_s <= PROMPT_S, (message_s, paced.log_tail())
    assert to_device_s is not None and to_device_s <= PROMPT_S, (to_device_s,
                                                                 paced.log_tail())
    assert backlog_left > 0, "the backlog was over before the message: nothing measured"
    if kill:
        # Killed again once the receiver holds two pages of the catch-up: the position
        # did not move past what the receiver confirmed, so the third start finishes
        # the room, without sending the pages the receiver holds back to back (Synapse
        # stages duplicates too: it pruned the room without that).
        try:
            state = wait_until_blocking(
                lambda: receiver_state(receiver, room.room_id, ids),
                "two pages of the catch-up live at the receiver", timeout_s=WAIT_S,
                accept=lambda s: s.live >= count // 5 + 2 * GAP_PAGE_EVENTS, every_s=0.05)
        finally:
            paced.stop(kill=True)
        assert state.live < count, state  # the second kill came in the middle
        paced.start()
        case += ", then a second SIGKILL in the middle of the catch-up"
    _check(paced, receiver, room, bob, ids, f"{case}, with other traffic meanwhile")


def test_a_backlog_after_a_stop_is_all_live_at_the_receiver(
    paced: OurWorker, receiver: SynapseDeployment
) -> None:
    """A backlog in room R (the worker stopped while it was sent, then started: the
    fan-out hands it over live) is paced to the receiver and all live there, unpruned;
    meanwhile a message in another room R2 and a to-device message to the receiver's
    user are live within seconds, not after R's backlog (issue #44.1)."""
    _prompt_behind_a_backlog(paced, receiver, kill=False)


def test_a_backlog_after_a_sigkill_mid_burst_is_all_live_at_the_receiver(
    paced: OurWorker, receiver: SynapseDeployment
) -> None:
    """The same when the backlog comes from catch-up (the worker killed mid-burst: the
    destination starts in catch-up and pages through R's gap): R2's message, recorded
    while R's next page awaits its confirmation, is read beside R and goes at once. Then
    a second SIGKILL in the middle of the catch-up loses nothing either."""
    _prompt_behind_a_backlog(paced, receiver, kill=True)


ROOMS = 10 if LONG else 3
ROOM_EVENTS = 200 if LONG else 120
"""More than two pages a room: sent one room after the other, the oldest-first order of
the queue before the composer gave the third room its first page in transaction 5."""


def test_backlogs_in_several_rooms_take_turns_and_are_all_live(
    paced: OurWorker, receiver: SynapseDeployment
) -> None:
    """Issue #44.1: backlogs in several rooms at once (the worker stopped while they
    were sent): every room is complete and live at the receiver, unpruned, and every
    room has its first page out before any room has its last (round-robin, read from
    our transaction log; oldest first, the first room would be done before the last
    began). Not "within the first ``ROOMS`` transactions": the worker reads the backlog
    from the stream in batches after it starts, and the rotation can only take in a
    room once its events are read (a CI run had the third room's first page in the
    fourth transaction, after the first room's second). ``BACKLOG_LONG=1``: ten rooms
    of 200 events each."""
    rooms = [_room(paced, receiver) for _ in range(ROOMS)]
    paced.stop()
    ids: dict[str, list[str]] = {}
    try:
        for room, _ in rooms:  # one room's backlog after the other's
            ids[room.room_id] = send_burst(paced.d, room.user, room.room_id, ROOM_EVENTS)
    finally:
        paced.start()
    for room, bob in rooms:
        _check(paced, receiver, room, bob, ids[room.room_id], f"backlogs in {ROOMS} rooms")
    owner = {e: r for r, evs in ids.items() for e in evs}
    rows = paced.d.sql(
        "SELECT pdu_event_ids FROM federation_sender.federation_transaction_log "
        f"WHERE destination = '{receiver.server_name}' AND status = 'success' ORDER BY id")
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    n = 0
    for line in rows.splitlines():
        got = {owner[e] for e in json.loads(line) if e in owner}
        if got:
            n += 1
            for r in got:
                first.setdefault(r, n)
                last[r] = n
    log.info("%d rooms of %d events: first page of each in transaction %s, last in %s, "
             "of %d", ROOMS, ROOM_EVENTS, sorted(first.values()), sorted(last.values()), n)
    assert len(first) == ROOMS and max(first.values()) < min(last.values()), (first, last)
