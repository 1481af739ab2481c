"""A catch-up transaction split after a refusal: the row of a room the destination left
is pruned only once the room's event is through (sans-I/O core)."""

from __future__ import annotations

import itertools
import json
import random

from federation_sender.model import EventRow
from federation_sender.queue.core.backoff import RESET, BackoffPolicy
from federation_sender.queue.core.batching import Limits
from federation_sender.queue.core.catchup import RoomPlan
from federation_sender.queue.core.destination import DestinationCore
from federation_sender.queue.core.steps import NeedCatchup, Send
from federation_sender.transport.result import Outcome, SendResult

ROOM = "!left:l"
REFUSED = SendResult(Outcome.TRANSIENT, 500, "HTTP 500")
OK = SendResult(Outcome.SUCCESS, 200)


def send(core: DestinationCore, now_ms: int) -> Send:
    step = core.next_step(now_ms)
    assert isinstance(step, Send), step
    return step


def test_pruned_rooms_row_waits_for_its_quarantined_event() -> None:
    """Seen in the chaos run (seed 3): the catch-up transaction [the room's last event,
    an EDU] got a 500 and was split; the event's half got a 500 again and was
    quarantined; the EDU half went through and deleted the room's row (the destination
    had left the room). The quarantine is memory only (lost on a crash, cleared when
    the queue re-enters catch-up): the event was then never sent again, while the
    position moved past it."""
    ids = itertools.count()
    core = DestinationCore("d.test", BackoffPolicy(), Limits(), random.Random(0),
                           lambda: f"t{next(ids)}")
    core.load(RESET, 100)
    now = 1_000_000
    core.outbox_read_started()
    core.add_outbox([], [], exhausted=True)
    assert isinstance(core.next_step(now), NeedCatchup)
    ev = EventRow(110, "$last", ROOM, "m.room.message", None, "@a:l", False, False,
                  json.dumps({"type": "m.room.message", "room_id": ROOM}))
    core.offer_catchup([RoomPlan(ROOM, 110, (ev,), prune=True, mode="event")], exhausted=True)
    core.add_edu("m.typing", {"room_id": "!other:l", "user_id": "@a:l", "typing": True})
    whole = send(core, now)
    assert [p.event_id for p in whole.txn.batch.pdus] == ["$last"]
    assert whole.txn.batch.edus and whole.txn.batch.catchup_prune == ((ROOM, 110),)
    core.on_result(whole.txn, REFUSED, now)  # split
    event_half = send(core, now)
    assert [p.event_id for p in event_half.txn.batch.pdus] == ["$last"]
    core.on_result(event_half.txn, REFUSED, now)  # quarantined
    edu_half = send(core, now)
    assert not edu_half.txn.batch.pdus
    eff = core.on_result(edu_half.txn, OK, now)
    assert eff.prune == [], "the row was pruned while its room's event is quarantined"
    # The episode ends below the held event; the event's retry prunes the row.
    assert isinstance(core.next_step(now), NeedCatchup)
    done = core.catchup_finished()
    assert done.last_successful is None or done.last_successful < 110
    retry = send(core, now + 60_000)
    assert [p.event_id for p in retry.txn.batch.pdus] == ["$last"]
    eff = core.on_result(retry.txn, OK, now + 60_000)
    assert eff.prune == [(ROOM, 110)] and eff.last_successful == 110
