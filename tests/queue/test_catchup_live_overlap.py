"""An event caught up before the fan-out hands it over live is not sent again
(sans-I/O core).

Seen beside Synapse with two senders (tests/synapse/test_sharded_senders.py, 2 runs in
9): the fan-out commits an event's ``destination_rooms`` row, then hands the PDU to the
destination's queue. In between, a queue in catch-up read the row, sent the event and
ended its episode; the live PDU then arrived in a queue no longer catching up and went
out again in the next transaction (our log: ``...10 catchup=t``, ``...17 catchup=f``,
the same event 134 ms apart)."""

from __future__ import annotations

import itertools
import json
import random

from federation_sender.model import EventRow
from federation_sender.queue.core.backoff import RESET, BackoffPolicy
from federation_sender.queue.core.batching import Limits
from federation_sender.queue.core.catchup import RoomPlan, pdu_item
from federation_sender.queue.core.destination import DestinationCore
from federation_sender.queue.core.steps import NeedCatchup, Send
from federation_sender.transport.result import Outcome, SendResult

ROOM = "!r:l"
OK = SendResult(Outcome.SUCCESS, 200)


def event(so: int) -> EventRow:
    return EventRow(so, f"$e{so}", ROOM, "m.room.message", None, "@a:l", False, False,
                    json.dumps({"type": "m.room.message", "room_id": ROOM}))


def test_a_live_pdu_the_catch_up_already_sent_is_dropped() -> None:
    ids = itertools.count()
    core = DestinationCore("d.test", BackoffPolicy(), Limits(), random.Random(0),
                           lambda: f"t{next(ids)}")
    core.load(RESET, 100)
    now = 1_000_000
    core.outbox_read_started()
    core.add_outbox([], [], exhausted=True)
    assert isinstance(core.next_step(now), NeedCatchup)
    core.offer_catchup([RoomPlan(ROOM, 110, (event(110),), prune=False, mode="event")],
                       exhausted=True)
    caught = core.next_step(now)
    assert isinstance(caught, Send)
    assert [p.event_id for p in caught.txn.batch.pdus] == ["$e110"]
    core.on_result(caught.txn, OK, now)
    assert isinstance(core.next_step(now), NeedCatchup)
    core.catchup_finished()
    assert not core.catching_up
    # The fan-out hands over what it committed before the catch-up read it, and more.
    core.add_pdus([pdu_item(event(110)), pdu_item(event(111))])
    live = core.next_step(now)
    assert isinstance(live, Send)
    assert [p.event_id for p in live.txn.batch.pdus] == ["$e111"]
