from __future__ import annotations

from typing import Any

import pytest
from admin_helpers import AUTH, TOKEN, add_destinations, add_rooms
from aiohttp.test_utils import TestClient
from sqlalchemy import insert, select
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.storage.schema import destinations, federation_transaction_log
from federation_sender.testing.admin_fakes import FakeQueueControl

API = "/_synapse/admin/v1/federation"
LIST = API + "/destinations"


async def get(client: TestClient[Any, Any], path: str, expect: int = 200,
              **params: Any) -> Any:
    resp = await client.get(path, headers=AUTH, params={k: str(v) for k, v in params.items()})
    body = await resp.json()
    assert resp.status == expect, body
    return body


@pytest.fixture
async def five(engine: AsyncEngine) -> None:
    await add_destinations(engine, [
        {"destination": "alpha.org", "retry_last_ts": 500, "retry_interval": 60_000,
         "failure_ts": 100, "last_successful_stream_ordering": 7},
        {"destination": "beta.org"},
        {"destination": "Gamma.NET", "retry_last_ts": 900, "retry_interval": 10,
         "failure_ts": 300, "last_successful_stream_ordering": 3},
        {"destination": "delta.org", "retry_last_ts": 0, "retry_interval": 0,
         "last_successful_stream_ordering": 99},
        {"destination": "100%_sure.org", "retry_last_ts": 200, "retry_interval": 5,
         "failure_ts": 200},
    ])


def names(body: Any) -> list[str]:
    return [d["destination"] for d in body["destinations"]]


async def test_list_shape_matches_synapse(client: TestClient[Any, Any], five: None) -> None:
    body = await get(client, LIST)
    assert body["total"] == 5
    assert "next_token" not in body
    assert names(body) == ["100%_sure.org", "Gamma.NET", "alpha.org", "beta.org", "delta.org"]
    beta = body["destinations"][3]
    # Synapse reports missing retry timings as 0 and the others as null.
    assert {k: v for k, v in beta.items() if k != "queue"} == {
        "destination": "beta.org", "retry_last_ts": 0, "retry_interval": 0,
        "failure_ts": None, "last_successful_stream_ordering": None}
    assert beta["queue"]["live"] is False and beta["queue"]["state"] == "idle"
    alpha = body["destinations"][2]
    assert alpha["queue"]["state"] == "backing_off"
    assert alpha["queue"]["next_retry_ts"] == 60_500


async def test_pagination_follows_next_token(client: TestClient[Any, Any], five: None) -> None:
    seen: list[str] = []
    params: dict[str, Any] = {"limit": 2}
    pages = 0
    while True:
        body = await get(client, LIST, **params)
        assert body["total"] == 5
        seen += names(body)
        pages += 1
        if "next_token" not in body:
            break
        params["from"] = body["next_token"]
    assert pages == 3
    assert seen == names(await get(client, LIST))
    assert names(await get(client, LIST, limit=0)) == []


@pytest.mark.parametrize("order_by, expected", [
    ("destination", ["100%_sure.org", "Gamma.NET", "alpha.org", "beta.org", "delta.org"]),
    ("retry_last_ts", ["beta.org", "delta.org", "100%_sure.org", "alpha.org", "Gamma.NET"]),
    ("retry_interval", ["beta.org", "delta.org", "100%_sure.org", "Gamma.NET", "alpha.org"]),
    ("failure_ts", ["beta.org", "delta.org", "alpha.org", "100%_sure.org", "Gamma.NET"]),
    ("last_successful_stream_ordering",
     ["100%_sure.org", "beta.org", "Gamma.NET", "alpha.org", "delta.org"]),
])
async def test_order_by_both_directions(client: TestClient[Any, Any], five: None,
                                        order_by: str, expected: list[str]) -> None:
    assert names(await get(client, LIST, order_by=order_by)) == expected
    backwards = names(await get(client, LIST, order_by=order_by, dir="b"))
    # Reversed, except that ties stay in ascending destination order.
    assert sorted(backwards) == sorted(expected)
    if order_by in ("destination", "last_successful_stream_ordering"):
        assert backwards[0] == expected[-1]
    if order_by == "destination":
        assert backwards == expected[::-1]


@pytest.mark.parametrize("search, expected", [
    ("org", ["100%_sure.org", "alpha.org", "beta.org", "delta.org"]),
    ("GAMMA", ["Gamma.NET"]),
    ("%", ["100%_sure.org"]),
    ("_", ["100%_sure.org"]),
    ("zzz", []),
])
async def test_destination_filter_is_a_literal_case_insensitive_substring(
        client: TestClient[Any, Any], five: None, search: str, expected: list[str]) -> None:
    body = await get(client, LIST, destination=search)
    assert names(body) == expected
    assert body["total"] == len(expected)


@pytest.mark.parametrize("params", [
    {"from": "-1"}, {"from": "x"}, {"from": "267844613659076620314971471872"},
    {"from": str(2**62 + 1)}, {"limit": "-5"}, {"limit": "1.5"}, {"limit": "1001"},
    {"limit": "+3"}, {"order_by": "bogus"}, {"dir": "sideways"}, {"destination": "x" * 300},
])
async def test_bad_parameters_are_400_invalid_param(client: TestClient[Any, Any],
                                                    params: dict[str, str]) -> None:
    body = await get(client, LIST, 400, **params)
    assert body["errcode"] == "M_INVALID_PARAM"
    assert next(iter(params)) in body["error"]


async def test_live_state_is_merged(client: TestClient[Any, Any], five: None,
                                    queues: FakeQueueControl) -> None:
    queues.set_state("beta.org", "sending", pending_pdus=4, pending_edus=2,
                     in_flight_txn_id="t1", in_flight_age_s=1.5)
    body = await get(client, LIST + "/beta.org")
    assert body["queue"] == {
        "state": "sending", "pending_pdus": 4, "pending_edus": 2, "in_flight_txn_id": "t1",
        "in_flight_age_s": 1.5, "last_error": None, "next_retry_ts": None, "last_success_ts": None,
        "catching_up": False, "live": True}
    listed = {d["destination"]: d for d in (await get(client, LIST))["destinations"]}
    assert listed["beta.org"]["queue"]["pending_pdus"] == 4


async def test_single_destination(client: TestClient[Any, Any], five: None,
                                  engine: AsyncEngine) -> None:
    body = await get(client, LIST + "/alpha.org")
    assert body["retry_interval"] == 60_000 and body["failure_ts"] == 100
    missing = await get(client, LIST + "/nope.org", 404)
    assert missing == {"errcode": "M_NOT_FOUND", "error": "Unknown destination"}
    # Known only through destination_rooms: Synapse answers with empty timings.
    await add_rooms(engine, "rooms-only.org", {"!r:x": 5})
    body = await get(client, LIST + "/rooms-only.org")
    assert (body["retry_last_ts"], body["retry_interval"], body["failure_ts"]) == (0, 0, None)


async def test_rooms_paginated(client: TestClient[Any, Any], five: None,
                               engine: AsyncEngine) -> None:
    await add_rooms(engine, "alpha.org", {f"!r{i}:x": i * 10 for i in range(5)})
    await add_rooms(engine, "beta.org", {"!other:x": 1})
    body = await get(client, LIST + "/alpha.org/rooms", limit=2)
    assert body == {"rooms": [{"room_id": "!r0:x", "stream_ordering": 0},
                              {"room_id": "!r1:x", "stream_ordering": 10}],
                    "total": 5, "next_token": "2"}
    body = await get(client, LIST + "/alpha.org/rooms", **{"from": 4, "limit": 2})
    assert [r["room_id"] for r in body["rooms"]] == ["!r4:x"] and "next_token" not in body
    body = await get(client, LIST + "/alpha.org/rooms", dir="b", limit=1)
    assert body["rooms"][0]["room_id"] == "!r4:x"
    assert (await get(client, LIST + "/nope.org/rooms", 404))["errcode"] == "M_NOT_FOUND"
    assert (await get(client, LIST + "/alpha.org/rooms", 400, limit="x"))["errcode"] == \
        "M_INVALID_PARAM"


async def test_reset_connection(client: TestClient[Any, Any], five: None,
                                engine: AsyncEngine, queues: FakeQueueControl) -> None:
    url = LIST + "/{}/reset_connection"
    resp = await client.post(url.format("nope.org"), headers=AUTH, json={})
    assert resp.status == 404
    resp = await client.post(url.format("beta.org"), headers=AUTH, json={})
    assert resp.status == 400
    assert (await resp.json())["errcode"] == "M_UNKNOWN"
    queues.set_state("alpha.org", "backing_off", pending_pdus=3)
    resp = await client.post(url.format("alpha.org"), headers=AUTH, json={})
    assert resp.status == 200 and await resp.json() == {}
    assert queues.resets == ["alpha.org"]
    async with engine.connect() as conn:
        row = (await conn.execute(select(destinations).where(
            destinations.c.destination == "alpha.org"))).one()
    assert (row.retry_last_ts, row.retry_interval, row.failure_ts) == (0, 0, None)
    assert queues.states["alpha.org"]["state"] == "sending"
    # A second reset has nothing to clear.
    resp = await client.post(url.format("alpha.org"), headers=AUTH)
    assert resp.status == 400
    # Persisted backoff without a loaded queue is reset too.
    resp = await client.post(url.format("Gamma.NET"), headers=AUTH)
    assert resp.status == 200
    assert queues.resets == ["alpha.org", "Gamma.NET"]


async def test_transactions_newest_first(client: TestClient[Any, Any], five: None,
                                         engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.execute(insert(federation_transaction_log), [
            {"txn_id": f"t{i}", "destination": "alpha.org", "instance_name": "w1",
             "pdu_count": i, "edu_count": 0, "request_bytes": 10,
             "status": "success" if i % 2 else "transient",
             "http_status": 200 if i % 2 else None, "started_ts": 1000 + i,
             "duration_ms": 5, "catchup": False, "max_stream_ordering": None,
             "pdu_event_ids": '["$a", "$b"]', "error": None if i % 2 else "refused"}
            for i in range(4)])
    body = await get(client, LIST + "/alpha.org/transactions", limit=3)
    assert [t["txn_id"] for t in body["transactions"]] == ["t3", "t2", "t1"]
    assert body["total"] == 4 and body["next_token"] == "3"
    assert body["transactions"][0]["pdu_event_ids"] == ["$a", "$b"]
    body = await get(client, LIST + "/alpha.org/transactions", status="transient")
    assert [t["txn_id"] for t in body["transactions"]] == ["t2", "t0"]
    assert body["transactions"][0]["error"] == "refused"
    await get(client, LIST + "/alpha.org/transactions", 400, status="meh")
    assert (await get(client, LIST + "/beta.org/transactions"))["transactions"] == []


async def test_summary(client: TestClient[Any, Any], five: None,
                       queues: FakeQueueControl) -> None:
    queues.set_state("beta.org", "sending", pending_pdus=4, pending_edus=1, in_flight_age_s=2.0)
    queues.set_state("alpha.org", "backing_off", pending_pdus=6)
    body = await get(client, API + "/summary")
    assert body["total_destinations"] == 5
    assert body["backing_off_destinations"] == 3
    assert body["live_states"] == {"idle": 0, "sending": 1, "backing_off": 1, "catching_up": 0}
    assert (body["pending_pdus"], body["pending_edus"]) == (10, 1)
    assert body["oldest_in_flight_age_s"] == 2.0
    assert body["now_ts"] == 1_700_000_000_000


async def test_unknown_route_and_method(client: TestClient[Any, Any]) -> None:
    resp = await client.get(API + "/nothing", headers=AUTH)
    assert resp.status == 404 and (await resp.json())["errcode"] == "M_UNRECOGNIZED"
    resp = await client.delete(LIST, headers=AUTH)
    assert resp.status == 405 and (await resp.json())["errcode"] == "M_UNRECOGNIZED"
    resp = await client.get("/nothing")
    assert resp.status == 404 and (await resp.json())["errcode"] == "M_UNRECOGNIZED"


async def test_every_admin_action_leaves_an_audit_line(
        client: TestClient[Any, Any], five: None, queues: FakeQueueControl,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="federation_sender.admin.audit")
    url = LIST + "/{}/reset_connection"
    queues.set_state("alpha.org", "backing_off", pending_pdus=3)
    assert (await client.post(url.format("alpha.org"), headers=AUTH)).status == 200
    assert (await client.post(url.format("alpha.org"), headers=AUTH)).status == 400
    assert (await client.post(url.format("alpha.org"),
                              headers={"Authorization": "Bearer wrong"})).status == 401
    await get(client, LIST)  # reads are not audited
    lines = [r.getMessage() for r in caplog.records if r.name == "federation_sender.admin.audit"]
    path = "/_synapse/admin/v1/federation/destinations/alpha.org/reset_connection"
    assert [line.split(" from ")[0] for line in lines] == [
        "admin action by admin token", "admin action by admin token",
        "admin action by unauthenticated"]
    assert [line.split(": ", 1)[1] for line in lines] == [
        f"POST {path} -> 200 ok", f"POST {path} -> 400 refused", f"POST {path} -> 401 refused"]
    assert not any(TOKEN in line or "wrong" in line for line in lines)


@pytest.mark.parametrize(("body", "errcode"), [
    (b"not json", "M_NOT_JSON"), (b"{", "M_NOT_JSON"), (b"\xff\xfe", "M_NOT_JSON"),
    (b"[]", "M_BAD_JSON"), (b'"x"', "M_BAD_JSON"), (b"1", "M_BAD_JSON"),
])
async def test_reset_connection_refuses_a_body_that_is_not_a_json_object(
        client: TestClient[Any, Any], five: None, queues: FakeQueueControl,
        body: bytes, errcode: str) -> None:
    """Issue #42.6: a non-JSON body used to answer 200 (and reset the destination)."""
    queues.set_state("alpha.org", "backing_off", pending_pdus=3)
    url = LIST + "/alpha.org/reset_connection"
    resp = await client.post(url, headers={**AUTH, "Content-Type": "application/json"},
                             data=body)
    assert resp.status == 400
    assert (await resp.json())["errcode"] == errcode
    assert queues.resets == []
    resp = await client.post(url, headers=AUTH, data=b" \r\n")  # blank: like none
    assert resp.status == 200 and queues.resets == ["alpha.org"]
