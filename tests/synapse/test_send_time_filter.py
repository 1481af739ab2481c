"""What a user erased or redacted while a real Synapse receiver was down (issue #44,
item 3), with our worker as the session deployment's federation sender.

A second Synapse 1.163 (SQLite, its default settings) has a user in a room of ours. It
is stopped, things happen, our worker persists its backoff (the suite's Synapse
settings: about a second after the first refused connection) and keeps the PDUs in its
live queue (not catch-up: the outage is short), the receiver starts again, and the
return probe (here every second) sends at once:

* **erased**: eve sends 5 messages, then is deactivated with ``erase: true``; alice sends
  one. None of eve's bodies may reach the receiver (it may fetch her events from main
  later, which serves them redacted), alice's message must;
* **redacted**: alice sends a message and redacts it; the receiver must store it
  redacted in its own ``event_json`` (the content-hash check of the pruned PDU), not
  with the body beside a redaction.

Before ``queue/send_time.py`` both sent the events as queued: all 5 bodies, and the
redacted message whole (Synapse's own sender does the same).
"""

from __future__ import annotations

import json
import os
import sqlite3
import urllib.parse
import uuid
from collections.abc import Iterator, Sequence

import pytest

from federation_sender.testing.certs import LoopbackCA
from federation_sender.testing.outage import (
    SendingRoom,
    persisted_retry_interval,
    shared_room,
    visible,
)
from federation_sender.testing.synapse_client import User
from federation_sender.testing.synapse_deployment import SynapseDeployment, create_deployment
from federation_sender.testing.waiting import wait_until_blocking
from tests.synapse.backend_support import OurWorker

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def receiver(loopback_ca: LoopbackCA, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[SynapseDeployment]:
    d = create_deployment(tmp_path_factory.mktemp("send-time-receiver"), ca=loopback_ca)
    d.start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def ours(synapse_deployment: SynapseDeployment, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[OurWorker]:
    """Our worker with the return probe every second (the default is 60 s): the test
    waits for the receiver's start, not for the probe."""
    synapse_deployment.stop_federation_sender()
    worker = OurWorker(synapse_deployment, tmp_path_factory.mktemp("send-time-ours"),
                       queue={"return_probe_interval_s": 1.0})
    worker.start()
    yield worker
    worker.stop()


def _stored(receiver: SynapseDeployment, event_ids: Sequence[str]) -> dict[str, dict]:  # type: ignore[type-arg]
    """The events the receiver holds, as in its ``event_json``."""
    conn = sqlite3.connect(f"file:{receiver.layout.directory / 'homeserver.db'}?mode=ro",
                           uri=True, timeout=10)
    try:
        marks = ",".join("?" * len(event_ids))
        rows = conn.execute(f"SELECT event_id, json FROM event_json WHERE event_id IN ({marks})",
                            tuple(event_ids)).fetchall()
    finally:
        conn.close()
    return {str(e): json.loads(j) for e, j in rows}


def _down_with_backoff(ours: OurWorker, receiver: SynapseDeployment, room: str,
                       user: User) -> str:
    """Stop the receiver; a first message makes our worker fail and persist its backoff
    (the PDUs after it wait in the live queue)."""
    receiver.main.stop()
    first = ours.d.client.send_message(user, room, "sent while the receiver is down")
    wait_until_blocking(lambda: persisted_retry_interval(ours.d, receiver.server_name),
                        "our persisted backoff for the receiver", timeout_s=30,
                        accept=lambda v: v > 0)  # fmt: skip
    return first


def _back(ours: OurWorker, receiver: SynapseDeployment, bob: User, room: str,
          event_ids: Sequence[str]) -> None:
    receiver.main.start()
    for event_id in event_ids:
        wait_until_blocking(lambda e=event_id: visible(receiver, bob, room, e),  # type: ignore[misc]
                            f"{event_id} at the receiver", timeout_s=60,
                            accept=bool)  # fmt: skip


def _room_with_eve(ours: OurWorker, receiver: SynapseDeployment
                   ) -> tuple[SendingRoom, User, User]:
    """A room shared with the receiver's user (bob), which eve joined and wrote in once
    (seen at the receiver): the room, bob, eve."""
    d = ours.d
    room, bob = shared_room(d, receiver)
    eve = d.client.register(f"eve_{uuid.uuid4().hex[:8]}")
    d.client.join(eve, room.room_id)
    hello = d.client.send_message(eve, room.room_id, "eve is here")
    wait_until_blocking(lambda: visible(receiver, bob, room.room_id, hello),
                        "eve's first message at the receiver", timeout_s=30, accept=bool)
    return room, bob, eve


def _eve_writes_then_is_erased(d: SynapseDeployment, room_id: str, eve: User) -> list[str]:
    """Eve's 5 messages, then her deactivation with ``erase: true``; their event ids."""
    eves = [d.client.send_message(eve, room_id, f"eve's secret {i}") for i in range(5)]
    admin = d.client.register(f"admin_{uuid.uuid4().hex[:8]}", admin=True)
    quoted = urllib.parse.quote(eve.user_id, safe="")
    d.client.call("POST", f"/_synapse/admin/v1/deactivate/{quoted}", {"erase": True},
                  admin.access_token)  # fmt: skip
    return eves


def test_an_erased_users_messages_queued_while_the_receiver_was_down_never_reach_it(
    ours: OurWorker, receiver: SynapseDeployment
) -> None:
    d = ours.d
    room, bob, eve = _room_with_eve(ours, receiver)

    first = _down_with_backoff(ours, receiver, room.room_id, room.user)
    eves = _eve_writes_then_is_erased(d, room.room_id, eve)
    alices = d.client.send_message(room.user, room.room_id, "alice, after eve's erasure")
    _back(ours, receiver, bob, room.room_id, [first, alices])

    stored = _stored(receiver, eves)
    bodies = [e for e, pdu in stored.items() if pdu.get("content", {}).get("body")]
    assert bodies == [], (stored, ours.log_tail())
    # Main serves the receiver what it asks for (missing events) redacted, if at all.
    assert all(pdu.get("content") == {} for pdu in stored.values()), stored


def test_a_message_redacted_while_the_receiver_was_down_arrives_redacted(
    ours: OurWorker, receiver: SynapseDeployment
) -> None:
    d = ours.d
    room, bob = shared_room(d, receiver)
    secret = _down_with_backoff(ours, receiver, room.room_id, room.user)
    q = urllib.parse.quote
    path = (f"/_matrix/client/v3/rooms/{q(room.room_id, safe='')}/redact/"
            f"{q(secret, safe='')}/r{uuid.uuid4().hex[:8]}")  # fmt: skip
    redaction = d.client.call("PUT", path, {"reason": "oops"}, room.user.access_token)["event_id"]
    after = d.client.send_message(room.user, room.room_id, "after the redaction")
    _back(ours, receiver, bob, room.room_id, [secret, redaction, after])

    stored = _stored(receiver, [secret])[secret]
    assert stored["content"] == {}, (stored, ours.log_tail())
    assert "hashes" in stored and "signatures" in stored
    seen = receiver.client.call(
        "GET", f"/_matrix/client/v3/rooms/{q(room.room_id, safe='')}/event/{q(secret, safe='')}",
        None, bob.access_token)
    assert seen["content"] == {} and "redacted_because" in seen.get("unsigned", {}), seen


@pytest.mark.skipif(not os.environ.get("SEND_TIME_REFERENCE"),
                    reason="the reference run of Synapse's own sender: SEND_TIME_REFERENCE=1")
def test_synapse_own_sender_in_the_same_erasure_scenario(
    ours: OurWorker, receiver: SynapseDeployment
) -> None:
    """The reference, in the same scenario: Synapse's own federation sender, which
    sends what it queued. The receiver's user writes once it is back, so that main sees
    the receiver up and wakes its sender (it has no return probe)."""
    d = ours.d
    room, bob, eve = _room_with_eve(ours, receiver)
    ours.stop()
    d.start_federation_sender()
    try:
        first = _down_with_backoff(ours, receiver, room.room_id, room.user)
        eves = _eve_writes_then_is_erased(d, room.room_id, eve)
        alices = d.client.send_message(room.user, room.room_id, "alice, after eve's erasure")
        receiver.main.start()
        wait_until_blocking(lambda: receiver.client.send_message(bob, room.room_id, "back"),
                            "the receiver's user writing again", timeout_s=60, accept=bool)
        for event_id in (first, alices):
            wait_until_blocking(lambda e=event_id: visible(receiver, bob, room.room_id, e),  # type: ignore[misc]
                                f"{event_id} at the receiver", timeout_s=120, accept=bool)
    finally:
        d.stop_federation_sender()
        ours.start()
    stored = _stored(receiver, eves)
    bodies = [e for e, pdu in stored.items() if pdu.get("content", {}).get("body")]
    assert len(bodies) == 5, stored  # every body reached the receiver
