"""What any storage backend must do with the main process's rows (events,
memberships, extremities, outbox rows), through the Protocols only; run on the backends
that have a writer of those rows (``seeded`` in ``conftest.py``).
"""

from __future__ import annotations

from typing import Any

from contract_support import Seeded

from federation_sender.storage.protocols import Tx


async def test_wakeup_sweep_and_behind(seeded: Seeded) -> None:
    now = 10_000_000
    await seeded.main.to_device("outbox.test", {"m": 1})

    async def writes(tx: Tx) -> None:
        await tx.destinations.ensure_destinations(["outbox.test", "idle.test"])
        await tx.destinations.upsert_destination_rooms([
            ("behind.test", "!r:l", 5), ("caught-up.test", "!r:l", 5),
            ("backing-off.test", "!r:l", 5), ("expired.test", "!r:l", 5),
        ])
        await tx.destinations.set_last_successful_many([
            ("caught-up.test", 5, -1), ("behind.test", 3, -1)])
        await tx.destinations.set_retry_timings("backing-off.test", 0, now - 10, 600_000)
        await tx.destinations.set_retry_timings("expired.test", 0, now - 10, 5)

    await seeded.run(writes)

    async def sweep(tx: Tx) -> tuple[list[str], list[str], list[str]]:
        return (
            await tx.destinations.destinations_with_outstanding_work(None, 2, now),
            await tx.destinations.destinations_with_outstanding_work("expired.test", 2, now),
            sorted(await tx.destinations.destinations_behind()),
        )

    page1, page2, behind = await seeded.run(sweep)
    # Each with its persisted position (a live queue compares it with its own).
    assert page1 + page2 == [("behind.test", 3), ("expired.test", None), ("outbox.test", None)]
    assert behind == ["backing-off.test", "behind.test", "expired.test"]


async def test_outbox_reads_past_a_stream_id_until_acknowledged(seeded: Seeded) -> None:
    td = [await seeded.main.to_device("a.test", {"n": i}) for i in range(3)]
    dl = [await seeded.main.device_list("a.test", "@u:local.test", f"D{i}") for i in range(2)]
    await seeded.main.device_list("b.test", "@v:local.test", "DV")

    async def unsent(after_td: int, after_dl: int, limit: int = 10) -> tuple[Any, Any]:
        async def fn(tx: Tx) -> tuple[Any, Any]:
            return await tx.outbox.unsent_outbox("a.test", after_td, after_dl, limit)

        return await seeded.run(fn)

    t, d = await unsent(-1, -1)
    assert [r.stream_id for r in t] == td and [r.stream_id for r in d] == dl
    assert [(r.user_id, r.device_id) for r in d] == [("@u:local.test", "D0"),
                                                    ("@u:local.test", "D1")]
    t, d = await unsent(td[0], dl[0])
    assert [r.stream_id for r in t] == td[1:] and [r.stream_id for r in d] == dl[1:]
    t, d = await unsent(-1, -1, limit=1)
    assert [r.stream_id for r in t] == td[:1] and [r.stream_id for r in d] == dl[:1]

    async def dests(tx: Tx) -> list[str]:
        return sorted(await tx.outbox.device_list_destinations(["@u:local.test", "@v:local.test"]))

    assert await seeded.run(dests) == ["a.test", "b.test"]

    async def ack(tx: Tx) -> None:
        await tx.outbox.ack_to_device("a.test", td[:2], 1)
        await tx.outbox.ack_device_lists("a.test", [(dl[0], "@u:local.test", "D0")])

    await seeded.run(ack)
    t, d = await unsent(-1, -1)
    assert [r.stream_id for r in t] == td[2:] and [r.stream_id for r in d] == dl[1:]

    async def ack_rest(tx: Tx) -> list[str]:
        await tx.outbox.ack_device_lists("a.test", [(dl[1], "@u:local.test", "D1")])
        return await tx.outbox.device_list_destinations(["@u:local.test", "@v:local.test"])

    assert await seeded.run(ack_rest) == ["b.test"]


async def test_destinations_with_unsent_covers_every_nonempty_outbox(seeded: Seeded) -> None:
    """The gathered first read (``QueuePersistence.bootstrap_gathered``) reads the outbox only
    of the destinations this names: every one whose read from the start has a row must
    be among them, and one whose rows were all acknowledged may not stay."""
    td = await seeded.main.to_device("td.test", {"n": 1})
    dl = await seeded.main.device_list("dl.test", "@u:local.test", "D0")
    await seeded.main.to_device("both.test", {"n": 2})
    await seeded.main.device_list("both.test", "@u:local.test", "D1")
    await seeded.main.to_device("unasked.test", {"n": 3})
    names = ["td.test", "dl.test", "both.test", "none.test"]

    async def check(tx: Tx) -> tuple[set[str], set[str]]:
        named = await tx.outbox.destinations_with_unsent(names)
        nonempty = set()
        for d in names:
            t, d_rows = await tx.outbox.unsent_outbox(d, -1, -1, 10)
            if t or d_rows:
                nonempty.add(d)
        return named, nonempty

    named, nonempty = await seeded.run(check)
    assert nonempty == {"td.test", "dl.test", "both.test"}
    assert nonempty <= named <= set(names)  # never one it was not asked about
    assert "none.test" not in named

    async def ack(tx: Tx) -> set[str]:
        await tx.outbox.ack_to_device("td.test", [td], 1)
        await tx.outbox.ack_device_lists("dl.test", [(dl, "@u:local.test", "D0")])
        return await tx.outbox.destinations_with_unsent(names)

    assert await seeded.run(ack) == {"both.test"}

    async def empty(tx: Tx) -> set[str]:
        return await tx.outbox.destinations_with_unsent([])

    assert await seeded.run(empty) == set()


async def test_events_reads(seeded: Seeded) -> None:
    async def top(tx: Tx) -> int:
        return await tx.events.max_stream_ordering()

    assert await seeded.run(top) == 0
    m = seeded.main
    await m.membership("!r:l", "@a:local.test", "join")
    msgs = [await m.message("!r:l", "@a:local.test") for _ in range(4)]
    other = await m.message("!s:l", "@a:local.test")
    await m.set_extremities("!r:l", [msgs[1].event_id, msgs[3].event_id])
    await m.mark_partial_state("!s:l")

    async def reads(tx: Tx) -> tuple[Any, ...]:
        return (
            await tx.events.max_stream_ordering(),
            await tx.events.events_after(msgs[0].stream_ordering, other.stream_ordering, 2),
            await tx.events.events_at([msgs[2].stream_ordering, 10_000]),
            await tx.events.room_events_between(
                ["!r:l", "!s:l", "!none:l"], msgs[0].stream_ordering, other.stream_ordering, 2
            ),
            await tx.events.forward_extremities(["!r:l"]),
            await tx.events.partial_state(["!r:l", "!s:l"]),
            await tx.events.sender_and_received_ts("!r:l", msgs[0].event_id),
            await tx.events.sender_and_received_ts("!r:l", other.event_id),
        )

    top_so, after, at, between, extremities, partial, meta, wrong_room = await seeded.run(reads)
    assert top_so == other.stream_ordering
    assert [e.event_id for e in after] == [msgs[1].event_id, msgs[2].event_id]
    assert list(at) == [msgs[2].stream_ordering]
    assert at[msgs[2].stream_ordering].room_id == "!r:l"
    assert at[msgs[2].stream_ordering].sender == "@a:local.test"
    assert {r: [e.event_id for e in evs] for r, evs in between.items()} == {
        "!r:l": [msgs[1].event_id, msgs[2].event_id], "!s:l": [other.event_id],
    }
    assert [e.event_id for e in extremities["!r:l"]] == [msgs[1].event_id, msgs[3].event_id]
    assert partial == {"!s:l"}
    assert meta is not None and meta[0] == "@a:local.test"
    assert wrong_room is None


async def test_hosts_of_an_event_and_now(seeded: Seeded) -> None:
    m = seeded.main
    await m.membership("!r:l", "@a:local.test", "join")
    await m.membership("!r:l", "@b:one.test", "join")
    await m.membership("!r:l", "@c:two.test", "join")
    await m.membership("!r:l", "@c:two.test", "leave")
    first = await m.message("!r:l", "@a:local.test")
    await m.membership("!r:l", "@d:three.test", "join")
    second = await m.message("!r:l", "@a:local.test")
    kick = await m.membership("!r:l", "@d:three.test", "leave", sender="@a:local.test")
    sos = [first.stream_ordering, second.stream_ordering, kick.stream_ordering]

    async def reads(tx: Tx) -> tuple[Any, Any]:
        rows = await tx.events.events_at(sos)
        return (await tx.hosts.hosts_for_events({"!r:l": [rows[so] for so in sos]}),
                await tx.hosts.current_hosts(["!r:l"]))

    at_events, now = await seeded.run(reads)
    one, two, kicked = at_events["!r:l"]
    assert "one.test" in one and "two.test" not in one and "three.test" not in one
    assert {"one.test", "three.test"} <= two and "two.test" not in two
    # A server whose last member is kicked receives its own kick.
    assert {"one.test", "three.test"} <= kicked
    assert "one.test" in now["!r:l"] and not {"two.test", "three.test"} & now["!r:l"]


async def test_server_membership_history_is_per_server_and_ascending(seeded: Seeded) -> None:
    m = seeded.main
    j = await m.membership("!r:l", "@b:one.test", "join")
    await m.membership("!r:l", "@x:other.test", "join")
    lv = await m.membership("!r:l", "@b:one.test", "leave")

    async def reads(tx: Tx) -> Any:
        return await tx.catchup.server_membership_history("one.test", ["!r:l", "!empty:l"])

    hist = await seeded.run(reads)
    assert hist["!empty:l"] == []
    assert [(r.stream_ordering, r.user_id, r.membership) for r in hist["!r:l"]] == [
        (j.stream_ordering, "@b:one.test", "join"), (lv.stream_ordering, "@b:one.test", "leave"),
    ]
