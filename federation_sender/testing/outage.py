"""A short outage of a real Synapse receiver, timed from its senders' side.

A receiving Synapse (``receiver``, on SQLite, sending for itself) has a user who joined
one room on each sending deployment (ours or Synapse's own worker as each one's
federation sender). :func:`short_outage` stops the receiver, sends one message into each
room while it is down, starts it again after ``outage_s`` and times, for each sender,
when its message became visible to the receiver's user (the client API's
``GET /rooms/{roomId}/event/{eventId}``) against when the receiver's federation port
accepted connections again. Nobody contacts the senders meanwhile: the receiver has
nothing to send them, so neither main's invalidation of the retry timings nor
REMOTE_SERVER_UP can wake them.

The API is blocking (tests and ``bench/`` scripts share it).
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from federation_sender.clock import SystemClock
from federation_sender.testing.synapse_client import ClientApiError, User
from federation_sender.testing.synapse_deployment import SynapseDeployment

POLL_S = 0.05
_CLOCK = SystemClock()


@dataclass(frozen=True)
class SendingRoom:
    """A room on a sending deployment that the receiver's user joined."""

    deployment: SynapseDeployment
    user: User
    room_id: str


@dataclass
class OutageResult:
    outage_s: float
    """From stopping the receiver to starting it again."""
    start_s: float
    """From starting the receiver to its federation port accepting connections."""
    arrival_s: dict[str, float | None] = field(default_factory=dict)
    """Per sender: from the receiver's return (its port accepting) to its message being
    visible there; None when it was not within the wait."""
    event_ids: dict[str, str] = field(default_factory=dict)


def join_rooms(receiver: SynapseDeployment, user: User,
               senders: Mapping[str, SendingRoom]) -> None:
    """The receiver's ``user`` joins each sender's room over federation; a first message
    in each is then seen by the receiver (each sender has reached it once)."""
    for room in senders.values():
        receiver.client.join(user, room.room_id, via=[room.deployment.server_name])
    warm = {name: room.deployment.client.send_message(room.user, room.room_id, "warm-up")
            for name, room in senders.items()}
    deadline = _CLOCK.monotonic_s() + 60.0
    while not all(visible(receiver, user, senders[n].room_id, e) for n, e in warm.items()):
        if _CLOCK.monotonic_s() > deadline:
            raise TimeoutError("the warm-up messages did not reach the receiver in 60 s")
        time.sleep(0.2)


def visible(receiver: SynapseDeployment, user: User, room_id: str, event_id: str) -> bool:
    q = urllib.parse.quote
    path = f"/_matrix/client/v3/rooms/{q(room_id, safe='')}/event/{q(event_id, safe='')}"
    try:
        receiver.client.call("GET", path, None, user.access_token)
    except ClientApiError:
        return False
    except OSError:  # the receiver is not up yet
        return False
    return True


def accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def short_outage(receiver: SynapseDeployment, user: User,
                 senders: Mapping[str, SendingRoom], outage_s: float = 10.0,
                 wait_s: float = 60.0,
                 before_return: Callable[[], None] | None = None) -> OutageResult:
    """Stop the receiver, send one message per sender, start it after ``outage_s``
    (calling ``before_return`` first), and wait up to ``wait_s`` after its return for
    every message."""
    receiver.main.stop()
    stopped = _CLOCK.monotonic_s()
    sent = {name: room.deployment.client.send_message(room.user, room.room_id,
                                                      "sent while the receiver is down")
            for name, room in senders.items()}
    time.sleep(max(0.0, stopped + outage_s - _CLOCK.monotonic_s()))  # the outage itself
    if before_return is not None:
        before_return()
    port = receiver.layout.ports.federation
    failure: list[BaseException] = []

    def start() -> None:
        try:
            receiver.main.start()
        except BaseException as e:  # reported in the caller's thread
            failure.append(e)

    started = _CLOCK.monotonic_s()
    starter = threading.Thread(target=start, name="receiver-start", daemon=True)
    starter.start()
    while not accepts(port):
        if failure or _CLOCK.monotonic_s() - started > 120.0:
            starter.join()
            raise RuntimeError(f"the receiver did not come back: {failure}")
        time.sleep(0.02)
    up = _CLOCK.monotonic_s()
    result = OutageResult(outage_s=round(started - stopped, 2), start_s=round(up - started, 2),
                          event_ids=sent)
    pending = dict(sent)
    while pending and _CLOCK.monotonic_s() - up < wait_s:
        for name, event_id in list(pending.items()):
            if visible(receiver, user, senders[name].room_id, event_id):
                result.arrival_s[name] = round(_CLOCK.monotonic_s() - up, 2)
                del pending[name]
        time.sleep(POLL_S)
    for name in pending:
        result.arrival_s[name] = None
    starter.join()
    if failure:
        raise RuntimeError(f"the receiver failed to start: {failure[0]}")
    return result


def shared_room(sender: SynapseDeployment, receiver: SynapseDeployment
                ) -> tuple[SendingRoom, User]:
    """A new user's new room on ``sender`` that a new user of ``receiver`` joined over
    federation (:func:`join_rooms`, warm-up seen): the room and the receiver's user."""
    alice = sender.client.register(f"alice_{uuid.uuid4().hex[:8]}")
    room = SendingRoom(sender, alice, sender.client.create_room(alice))
    bob = receiver.client.register(f"bob_{uuid.uuid4().hex[:8]}")
    join_rooms(receiver, bob, {"ours": room})
    return room, bob


def persisted_retry_interval(sender: SynapseDeployment, destination: str) -> int:
    """The ``retry_interval`` ``sender``'s database holds for ``destination`` (0: none)."""
    return int(sender.sql("SELECT coalesce(max(retry_interval), 0) FROM destinations "
                          f"WHERE destination = '{destination}'").strip())
