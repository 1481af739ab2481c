"""Typing from the replication ``typing`` stream to remote servers (real queues, real
loopback HTTP, the native schema for room hosts)."""

from __future__ import annotations

import asyncio

from federation_sender.edus.typing_edus import PING_INTERVAL_MS, TypingState
from federation_sender.intake import ReplicationIntake
from federation_sender.replication.rows import TypingRow
from federation_sender.storage.backend import NativeBackend
from federation_sender.testing.intake import native_intake
from federation_sender.testing.queue_harness import ALICE, ME, Harness, room_with
from federation_sender.testing.waiting import wait_until

BOB = "@bob:r1.test"
CAROL = f"@carol:{ME}"


def typing_edus(h: Harness, d: str) -> list[tuple[str, bool]]:
    return [
        (e["content"]["user_id"], e["content"]["typing"])
        for e in h.fake.received_edus(d)
        if e["edu_type"] == "m.typing"
    ]


async def handler_for(h: Harness) -> ReplicationIntake:
    await room_with(h, "!a:l", "r1.test", "r2.test")
    await h.start()
    return native_intake(h.m, NativeBackend(h.engine), ME, h.clock)


def test_state_diffs_local_users_and_resets_when_the_stream_goes_back() -> None:
    st = TypingState(ME)
    on = st.apply(5, [TypingRow("!a", (ALICE, BOB))])
    assert [(c.user_id, c.typing) for c in on] == [(ALICE, True)]  # bob is not ours
    assert st.apply(6, [TypingRow("!a", (ALICE, BOB))]) == []  # no change, nothing sent
    st.sent("!a", ALICE, 1_000)
    assert st.due(1_000 + PING_INTERVAL_MS - 1) == []
    assert st.due(1_000 + PING_INTERVAL_MS) == [("!a", ALICE)]
    # Main restarted: its stream starts again, the old sets are void, so Alice typing
    # again is a change (without the reset it would be sent by nobody).
    again = st.apply(1, [TypingRow("!a", (ALICE,))])
    assert [(c.user_id, c.typing) for c in again] == [(ALICE, True)]
    off = st.apply(2, [TypingRow("!a", ())])
    assert [(c.user_id, c.typing) for c in off] == [(ALICE, False)]
    assert st.rooms == {} and st.due(10**12) == []


async def test_local_typers_reach_every_current_host(h: Harness) -> None:
    handler = await handler_for(h)
    await handler.on_rows("typing", "master", 1, [TypingRow("!a:l", (ALICE, BOB))])
    await h.settle()
    for d in ("r1.test", "r2.test"):
        assert typing_edus(h, d) == [(ALICE, True)]
        edu = next(e for e in h.fake.received_edus(d) if e["edu_type"] == "m.typing")
        assert edu["content"] == {"room_id": "!a:l", "user_id": ALICE, "typing": True}
    await handler.on_rows("typing", "master", 2, [TypingRow("!a:l", (BOB,))])
    await h.settle()
    assert typing_edus(h, "r1.test") == [(ALICE, True), (ALICE, False)]
    assert handler.tokens == {"typing": 2}


async def test_a_newer_state_replaces_a_queued_one_per_room_and_user(h: Harness) -> None:
    handler = await handler_for(h)
    d = "r1.test"
    h.fake.behave(d, hang=True)
    h.m.enqueue_edu(d, "m.warmup", {})
    await wait_until(lambda: h.fake.in_progress, "the warm-up in flight", timeout_s=10)
    await handler.on_rows("typing", "master", 1, [TypingRow("!a:l", (ALICE, CAROL))])
    await handler.on_rows("typing", "master", 2, [TypingRow("!a:l", (CAROL,))])
    h.fake.behave(d)
    h.fake.release()
    await h.settle()
    # Alice's true was replaced by her false; Carol's true (another key) stayed.
    assert sorted(typing_edus(h, d)) == [(ALICE, False), (CAROL, True)]


async def test_resent_every_40_s_while_typing(h: Harness) -> None:
    handler = await handler_for(h)
    loop = asyncio.create_task(handler.fanouts.typing.run())
    try:
        await handler.on_rows("typing", "master", 1, [TypingRow("!a:l", (ALICE,))])
        await h.settle()
        await h.advance(35)
        assert typing_edus(h, "r1.test") == [(ALICE, True)]
        await h.advance(10)
        assert typing_edus(h, "r1.test") == [(ALICE, True), (ALICE, True)]
        await handler.on_rows("typing", "master", 2, [TypingRow("!a:l", ())])
        await h.settle()
        await h.advance(90)
        assert typing_edus(h, "r1.test") == [(ALICE, True), (ALICE, True), (ALICE, False)]
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
