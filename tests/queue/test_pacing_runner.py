"""Pacing in the queue (``queue/core/pacing.py``) over real HTTP to the fake homeserver,
with a receiver that answers ``GET /event`` as told: the next transaction waits for a
room's 40 unconfirmed PDUs to be confirmed, and a receiver that never confirms holds
the queue up for one deadline only."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from federation_sender.testing.queue_harness import ALICE, Harness, room_with
from federation_sender.testing.waiting import wait_until
from federation_sender.transport.result import EventHeld, SendResult, Transaction

D = "r1.test"
ROOM = "!paced:l"


class Probing:
    """The harness's sender, answering ``event_persisted`` with ``answer``."""

    def __init__(self, inner: object, answer: EventHeld) -> None:
        self.inner = inner
        self.answer = answer
        self.asked: list[str] = []

    async def send_transaction(self, txn: Transaction) -> SendResult:
        result: SendResult = await self.inner.send_transaction(txn)  # type: ignore[attr-defined]
        return result

    async def event_persisted(self, destination: str, event_id: str) -> EventHeld:
        self.asked.append(event_id)
        return self.answer


def _received(h: Harness, event_id: str) -> bool:
    return event_id in h.fake.received_event_ids(D)


def _probing(h: Harness, answer: EventHeld, deadline_s: float = 5.0) -> Probing:
    probe = Probing(h.sender, answer)
    h.sender = probe  # type: ignore[assignment]
    h.settings = replace(h.settings, pacing_confirm_deadline_s=deadline_s)
    return probe


async def test_the_next_transaction_waits_for_the_confirmation(h: Harness) -> None:
    await room_with(h, ROOM, D)
    probe = _probing(h, EventHeld.NOT_YET, deadline_s=30.0)
    await h.start()
    evs = await h.writer.messages(ROOM, ALICE, 120)
    h.poke()
    await h.settle()
    got = h.fake.received_event_ids(D)
    # One transaction of 50 went out; the queue now asks for the one that leaves 39 of
    # them unconfirmed (the 11th) and waits.
    assert len([e for e in got if e in {x.event_id for x in evs}]) == 50
    assert probe.asked and set(probe.asked) == {evs[10].event_id}
    probe.answer = EventHeld.YES
    await h.advance(2.0)
    await wait_until(lambda: set(h.fake.received_event_ids(D)) >= {e.event_id for e in evs},
                     timeout_s=10.0, what="all 120")
    assert ("r1.test", "confirmed") in h.observer.confirmations
    assert all(o == "confirmed" for _, o in h.observer.confirmations)


async def test_a_receiver_that_never_confirms_holds_the_queue_one_deadline(
    h: Harness,
) -> None:
    await room_with(h, ROOM, D)
    probe = _probing(h, EventHeld.NOT_YET, deadline_s=5.0)
    await h.start()
    evs = await h.writer.messages(ROOM, ALICE, 200)
    h.poke()
    waited = await h.advance_until(
        lambda: set(h.fake.received_event_ids(D)) >= {e.event_id for e in evs}, step_s=1.0,
        max_s=60.0)
    assert 5.0 <= waited <= 7.0
    # Once, then unpaced: one give-up, and no question after it.
    assert h.observer.confirmations == [(D, "not_yet")]
    assert set(probe.asked) == {evs[10].event_id}


async def test_a_receiver_without_the_endpoint_is_not_waited_for(h: Harness) -> None:
    await room_with(h, ROOM, D)
    probe = _probing(h, EventHeld.UNSUPPORTED, deadline_s=30.0)
    await h.start()
    evs = await h.writer.messages(ROOM, ALICE, 200)
    h.poke()
    await h.settle()
    assert set(h.fake.received_event_ids(D)) >= {e.event_id for e in evs}
    assert h.observer.confirmations == [(D, "unsupported")] and len(probe.asked) == 1


async def test_a_held_room_holds_back_only_its_own_pdus(h: Harness) -> None:
    """Issue #44: while a room's backlog waits for the receiver's confirmation, a
    message in another room and a to-device message go at once, and the backlog goes
    on, in order, once confirmed."""
    other = "!other:l"
    await room_with(h, ROOM, D)
    await room_with(h, other, D)
    probe = _probing(h, EventHeld.NOT_YET, deadline_s=30.0)
    await h.start()
    backlog = await h.writer.messages(ROOM, ALICE, 200)
    h.poke()
    await h.settle()
    assert len(h.fake.received_event_ids(D)) == 50 and probe.asked
    # The room is held (no clock moves: its confirmation cannot have come).
    message = await h.writer.message(other, ALICE)
    await h.writer.to_device(D, {"message_id": "td-during-backlog"})
    h.m.notify_outbox(D)
    h.poke()
    await wait_until(lambda: message.event_id in h.fake.received_event_ids(D),
                     timeout_s=10.0, what="the other room's message")
    await wait_until(
        lambda: any(e.get("content", {}).get("message_id") == "td-during-backlog"
                    for e in h.fake.received_edus(D)),
        timeout_s=10.0, what="the to-device message")
    got = h.fake.received_event_ids(D)
    assert len([e for e in got if e in {x.event_id for x in backlog}]) == 50
    probe.answer = EventHeld.YES
    await h.advance(2.0)
    await wait_until(
        lambda: set(h.fake.received_event_ids(D)) >= {e.event_id for e in backlog},
        timeout_s=10.0, what="the whole backlog")
    got = [e for e in h.fake.received_event_ids(D) if e in {x.event_id for x in backlog}]
    assert got == [e.event_id for e in backlog]  # the room's order


async def test_a_receiver_that_never_confirms_holds_back_no_other_room(h: Harness) -> None:
    """The deadline bounds the held room's wait; the other room's messages never wait."""
    other = "!other:l"
    await room_with(h, ROOM, D)
    await room_with(h, other, D)
    _probing(h, EventHeld.NOT_YET, deadline_s=5.0)
    await h.start()
    backlog = await h.writer.messages(ROOM, ALICE, 120)
    h.poke()
    await h.settle()
    for i in range(3):
        eid = (await h.writer.message(other, ALICE)).event_id
        h.poke()
        await wait_until(partial(_received, h, eid), timeout_s=10.0,
                         what=f"message {i} of the other room")
    waited = await h.advance_until(
        lambda: set(h.fake.received_event_ids(D)) >= {e.event_id for e in backlog},
        step_s=1.0, max_s=60.0)
    assert 4.0 <= waited <= 7.0
    assert h.observer.confirmations == [(D, "not_yet")]
