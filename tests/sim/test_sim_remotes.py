"""Fake remotes: X-Matrix verification, Synapse's transaction rules, fault profiles."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from sim_support import ORIGIN, PutTxn

from federation_sender.clock import SystemClock
from federation_sender.sim.fleet import RemoteFleet
from federation_sender.sim.pdu import build_pdu, reference_event_id
from federation_sender.sim.remotes import FakeRemote
from federation_sender.testing.clock import FakeClock
from federation_sender.testing.faults import FaultProfile
from federation_sender.testing.waiting import wait_until
from federation_sender.transport.signing import SigningKey, VerifyKeyLookup


def pdu(n: int) -> dict[str, Any]:
    _, p = build_pdu(
        room_id="!room:us.test",
        sender="@alice:us.test",
        origin=ORIGIN,
        event_type="m.room.message",
        content={"body": f"hello {n}"},
        state_key=None,
        prev_events=[],
        auth_events=[],
        depth=n,
        origin_server_ts=1000 + n,
    )
    return p


@pytest.fixture
async def make_remote(lookup: VerifyKeyLookup) -> AsyncIterator[Any]:
    started: list[FakeRemote] = []

    async def make(
        faults: FaultProfile | None = None, clock: Any = None, name: str = "them.test"
    ) -> FakeRemote:
        remote = FakeRemote(
            name,
            lookup_key=lookup,
            clock=clock or SystemClock(),
            rng=random.Random(7),
            faults=faults,
        )
        await remote.start()
        started.append(remote)
        return remote

    yield make
    for r in started:
        await r.stop()


# --- authentication -------------------------------------------------------------


async def test_correctly_signed_transaction_is_accepted_and_recorded(
    make_remote: Any, put_txn: PutTxn
) -> None:
    remote = await make_remote()
    pdus = [pdu(1), pdu(2)]
    edus = [{"edu_type": "m.typing", "content": {"room_id": "!room:us.test"}}]
    status, body = await put_txn(remote, "t1", pdus=pdus, edus=edus)
    ids = [reference_event_id(p) for p in pdus]
    assert status == 200
    assert body == {"pdus": {i: {} for i in ids}}
    assert dict(remote.record.pdu_counts) == {i: 1 for i in ids}
    assert remote.record.edus == edus
    [txn] = remote.record.txns
    assert (txn.txn_id, txn.origin, txn.pdu_event_ids) == ("t1", ORIGIN, tuple(ids))


async def test_unsigned_age_does_not_change_the_recorded_event_id(
    make_remote: Any, put_txn: PutTxn
) -> None:
    remote = await make_remote()
    p = pdu(1)
    expected = reference_event_id(p)
    p["unsigned"] = {"age": 1234}
    assert (await put_txn(remote, "t1", pdus=[p]))[0] == 200
    assert list(remote.record.pdu_counts) == [expected]


@pytest.mark.parametrize("case", ["wrong_key", "wrong_destination", "missing", "garbage"])
async def test_badly_signed_request_gets_401_and_is_not_recorded(
    make_remote: Any, put_txn: PutTxn, case: str
) -> None:
    remote = await make_remote()
    kwargs: dict[str, Any] = {}
    if case == "wrong_key":
        kwargs["key"] = SigningKey.generate("sim1")  # same key id, different key
    elif case == "wrong_destination":
        kwargs["destination"] = "someone-else.test"
    elif case == "missing":
        kwargs["authorization"] = ""
    else:
        kwargs["authorization"] = 'X-Matrix origin="us.test",key="ed25519:sim1",sig=bad'
    status, body = await put_txn(remote, "t1", pdus=[pdu(1)], **kwargs)
    assert status == 401
    assert body["errcode"] == "M_UNAUTHORIZED"
    assert not remote.record.pdu_counts
    assert remote.record.outcomes["401"] == 1


# --- Synapse's transaction rules ------------------------------------------------


async def test_over_50_pdus_or_100_edus_is_400(make_remote: Any, put_txn: PutTxn) -> None:
    remote = await make_remote()
    assert (await put_txn(remote, "a", pdus=[pdu(i) for i in range(51)])) == (400, {})
    edus = [{"edu_type": "m.typing", "content": {}}] * 101
    assert (await put_txn(remote, "b", edus=edus)) == (400, {})
    assert (await put_txn(remote, "c", pdus=[pdu(i) for i in range(50)]))[0] == 200
    assert not remote.record.edus
    assert len(remote.record.pdu_counts) == 50


async def test_retransmitted_txn_id_is_answered_again_without_reprocessing(
    make_remote: Any, put_txn: PutTxn
) -> None:
    remote = await make_remote()
    first = await put_txn(remote, "t1", pdus=[pdu(1)])
    again = await put_txn(remote, "t1", pdus=[pdu(1)])
    assert first == again
    assert remote.record.retransmits == 1
    assert remote.record.pdu_counts[reference_event_id(pdu(1))] == 1
    # A new transaction carrying the same PDU is processed: that is a duplicate.
    await put_txn(remote, "t2", pdus=[pdu(1)])
    assert remote.record.pdu_counts[reference_event_id(pdu(1))] == 2


async def test_second_concurrent_transaction_from_same_origin_gets_429(
    make_remote: Any, put_txn: PutTxn, clock: FakeClock
) -> None:
    remote = await make_remote(FaultProfile(slow_s=5.0), clock=clock)
    first = asyncio.create_task(put_txn(remote, "t1", pdus=[pdu(1)]))
    await wait_until(lambda: clock.pending_sleepers, "a sleeper on the clock", timeout_s=5)
    status, body = await put_txn(remote, "t2", pdus=[pdu(2)])
    assert status == 429
    assert body["errcode"] == "M_UNKNOWN"
    # The same transaction id again waits for the first answer rather than 429.
    retry = asyncio.create_task(put_txn(remote, "t1", pdus=[pdu(1)]))
    await wait_until(lambda: remote.record.retransmits, "one retransmit",
                     accept=lambda n: n == 1, timeout_s=5)
    assert not first.done()
    clock.advance(5.0)
    assert (await first)[0] == 200
    assert await retry == await first
    assert remote.record.pdu_counts[reference_event_id(pdu(1))] == 1
    assert remote.record.max_concurrent == 2
    # Once the first is done, the other transaction goes through.
    assert (await asyncio.wait_for(_put_advancing(put_txn, remote, clock), 5))[0] == 200


async def _put_advancing(put_txn: PutTxn, remote: FakeRemote, clock: FakeClock) -> Any:
    task = asyncio.create_task(put_txn(remote, "t2", pdus=[pdu(2)]))
    while not task.done():
        clock.advance(5.0)
        await asyncio.sleep(0.005)
    return await task


# --- faults ---------------------------------------------------------------------


async def test_413_above_max_body(make_remote: Any, put_txn: PutTxn) -> None:
    remote = await make_remote(FaultProfile(max_body_bytes=2000))
    assert (await put_txn(remote, "small", pdus=[pdu(1)]))[0] == 200
    status, body = await put_txn(remote, "big", pdus=[pdu(i) for i in range(20)])
    assert status == 413
    assert body["errcode"] == "M_TOO_LARGE"
    assert len(remote.record.pdu_counts) == 1


async def test_error_rate_one_gives_500_and_processes_nothing(
    make_remote: Any, put_txn: PutTxn
) -> None:
    remote = await make_remote(FaultProfile(error_rate=1.0))
    for i in range(3):
        status, body = await put_txn(remote, f"t{i}", pdus=[pdu(i)])
        assert (status, body["errcode"]) == (500, "M_UNKNOWN")
    assert not remote.record.pdu_counts


async def test_error_rate_is_roughly_honoured(make_remote: Any, put_txn: PutTxn) -> None:
    remote = await make_remote(FaultProfile(error_rate=0.3))
    statuses = [(await put_txn(remote, f"t{i}", pdus=[pdu(i)]))[0] for i in range(100)]
    assert 15 <= statuses.count(500) <= 45
    assert statuses.count(500) + statuses.count(200) == 100


async def test_reset_before_processing(make_remote: Any, put_txn: PutTxn) -> None:
    remote = await make_remote(FaultProfile(reset_rate=1.0))
    with pytest.raises(aiohttp.ClientError):
        await put_txn(remote, "t1", pdus=[pdu(1)])
    assert not remote.record.pdu_counts
    assert remote.record.outcomes["reset"] >= 1


async def test_reset_after_processing_then_retry_is_deduplicated(
    make_remote: Any, put_txn: PutTxn
) -> None:
    remote = await make_remote(FaultProfile(reset_after_rate=1.0))
    with pytest.raises(aiohttp.ClientError):
        await put_txn(remote, "t1", pdus=[pdu(1)])
    assert remote.record.pdu_counts[reference_event_id(pdu(1))] == 1
    remote.faults = FaultProfile()
    status, _ = await put_txn(remote, "t1", pdus=[pdu(1)])
    assert status == 200
    assert remote.record.pdu_counts[reference_event_id(pdu(1))] == 1
    assert remote.record.retransmits >= 1


async def test_garbage_body_after_processing(make_remote: Any, put_txn: PutTxn) -> None:
    remote = await make_remote(FaultProfile(garbage_rate=1.0))
    status, body = await put_txn(remote, "t1", pdus=[pdu(1)])
    assert status == 200
    assert isinstance(body, str) and "Bad Gateway" in body
    assert remote.record.outcomes["garbage"] == 1
    assert len(remote.record.pdu_counts) == 1


async def test_hang_until_clock_passes_hang_s_then_reset(
    make_remote: Any, put_txn: PutTxn, clock: FakeClock
) -> None:
    remote = await make_remote(FaultProfile(hang_rate=1.0, hang_s=30.0), clock=clock)
    task = asyncio.create_task(put_txn(remote, "t1", pdus=[pdu(1)]))
    await wait_until(lambda: clock.pending_sleepers, "a sleeper on the clock", timeout_s=5)
    await clock.advance_and_settle(29.0)
    assert clock.pending_sleepers == 1  # the 30 s hang is still parked on the clock
    assert not task.done()
    assert remote.record.outcomes["hang"] == 0
    clock.advance(1.0)
    await wait_until(lambda: remote.record.outcomes["hang"], "one hang recorded",
                     accept=lambda n: n == 1, timeout_s=5)
    # aiohttp's client retries an idempotent PUT once after a reset; that hangs too.
    async with asyncio.timeout(5):
        while not task.done():
            clock.advance(30.0)
            await asyncio.sleep(0.01)
    with pytest.raises(aiohttp.ClientError):
        await task
    assert not remote.record.pdu_counts


async def test_hang_ends_when_remote_stops(lookup: VerifyKeyLookup, put_txn: PutTxn) -> None:
    remote = FakeRemote(
        "them.test",
        lookup_key=lookup,
        clock=FakeClock(),
        rng=random.Random(1),
        faults=FaultProfile(hang_rate=1.0),
    )
    await remote.start()
    task = asyncio.create_task(put_txn(remote, "t1", pdus=[pdu(1)]))
    await wait_until(lambda: remote.record.max_concurrent, "one request at a time",
                     accept=lambda n: n == 1, timeout_s=5)
    await asyncio.wait_for(remote.stop(), 5)
    with pytest.raises(aiohttp.ClientError):
        await asyncio.wait_for(task, 5)


async def test_down_window_refuses_connections_then_recovers(
    make_remote: Any, put_txn: PutTxn, clock: FakeClock
) -> None:
    remote = await make_remote(FaultProfile(down=((10.0, 20.0),)), clock=clock)
    assert (await put_txn(remote, "t1", pdus=[pdu(1)]))[0] == 200
    clock.advance(10.0)
    await wait_until(lambda: remote.down, "the remote down", timeout_s=5)
    with pytest.raises(aiohttp.ClientConnectorError):
        await put_txn(remote, "t2", pdus=[pdu(2)])
    clock.advance(10.0)
    await wait_until(lambda: not remote.down, "the remote back up", timeout_s=5)
    assert (await put_txn(remote, "t3", pdus=[pdu(3)]))[0] == 200
    assert len(remote.record.pdu_counts) == 2


async def test_going_down_resets_open_keepalive_connections(
    make_remote: Any, put_txn: PutTxn
) -> None:
    remote = await make_remote()
    assert (await put_txn(remote, "t1", pdus=[pdu(1)]))[0] == 200  # pooled connection
    await remote.go_down()
    with pytest.raises(aiohttp.ClientError):
        await put_txn(remote, "t2", pdus=[pdu(2)])
    await remote.come_up()
    assert (await put_txn(remote, "t3", pdus=[pdu(3)]))[0] == 200


async def test_fleet_gives_overrides_and_records(lookup: VerifyKeyLookup, put_txn: PutTxn) -> None:
    names = ["a.test", "b.test"]
    async with RemoteFleet(names, lookup_key=lookup, clock=SystemClock(), seed=1) as fleet:
        overrides = fleet.overrides()
        assert set(overrides) == set(names)
        assert len({v for v in overrides.values()}) == 2
        assert all(v.startswith("127.0.0.1:") for v in overrides.values())
        await put_txn(fleet["a.test"], "t1", pdus=[pdu(1)])
        assert fleet.records()["a.test"].pdus_received == 1
        assert fleet.records()["b.test"].pdus_received == 0
        # A request signed for a.test is refused by b.test.
        status, _ = await put_txn(fleet["b.test"], "t1", pdus=[pdu(1)], destination="a.test")
        assert status == 401
