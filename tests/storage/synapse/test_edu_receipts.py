"""Receipts of a real Synapse 1.163: a replication gap read back from
``receipts_linearized`` gives exactly the rows main published on Redis, and the worker's
fan-out keeps the private one home."""

from __future__ import annotations

import itertools
import json
import urllib.parse
from collections.abc import AsyncIterator

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.edus.receipts import ReceiptFanout
from federation_sender.intake.streams import parse_row
from federation_sender.replication.positions import fetch_gap
from federation_sender.replication.rows import ReceiptsRow
from federation_sender.storage.synapse.database import create_synapse_engine
from federation_sender.storage.synapse.stream_fetchers import synapse_fetchers
from federation_sender.testing.clock import FakeClock
from federation_sender.testing.replication_tap import ReplicationTap
from federation_sender.testing.synapse_deployment import SynapseDeployment
from tests.edus.test_edus_receipts import Rooms, Sink

_names = itertools.count()


@pytest.fixture
async def engine(synapse_deployment: SynapseDeployment) -> AsyncIterator[AsyncEngine]:
    eng = create_synapse_engine(synapse_deployment.database_url, pool_size=2)
    yield eng
    await eng.dispose()


def published(lines: list[str], stream: str) -> list[tuple[int, ReceiptsRow]]:
    out = []
    for line in lines:
        parts = line.split(" ", 4)
        if parts[:2] == ["RDATA", stream] and parts[3] != "batch":
            row = parse_row(stream, json.loads(parts[4]))
            assert isinstance(row, ReceiptsRow)
            out.append((int(parts[3]), row))
    return out


async def test_receipt_gap_reads_back_what_main_published(
    synapse_deployment: SynapseDeployment, engine: AsyncEngine
) -> None:
    d = synapse_deployment
    alice = d.client.register(f"rc_alice{next(_names)}")
    room = d.client.create_room(alice)
    events = [d.client.send_message(alice, room, f"m{i}") for i in range(2)]
    quoted = urllib.parse.quote(room, safe="")
    sent = [("m.read", events[0], {}), ("m.read.private", events[1], {}),
            ("m.read", events[1], {"thread_id": "main"})]
    with ReplicationTap(d.redis_url, d.server_name) as tap:
        for rtype, event_id, body in sent:
            path = f"/_matrix/client/v3/rooms/{quoted}/receipt/{rtype}/" + urllib.parse.quote(
                event_id)
            d.client.call("POST", path, body, alice.access_token)
        tap.wait_for(lambda lines: len(published(lines, "receipts")) >= 3, what="3 receipts")
        live = published(tap.lines, "receipts")

    fetcher = synapse_fetchers(engine)["receipts"]
    first, last = live[0][0], live[-1][0]
    fetched = [r for u in [u async for u in fetch_gap(fetcher, "receipts", "master",
                                                      first - 1, last, batch_rows=2)]
               for r in u.rows]
    assert fetched == [row for _, row in live]
    assert [(r.receipt_type, r.thread_id) for r in fetched] == [
        ("m.read", None), ("m.read.private", None), ("m.read", "main")]

    # Through the fan-out: the private receipt stays home.
    sink = Sink()
    fan = ReceiptFanout(d.server_name, Rooms(["peer.test", d.server_name], None), sink, FakeClock())
    for row in fetched:
        sink.queued.clear()
        await fan.on_rows([row])
        assert sink.queued == ({} if row.receipt_type == "m.read.private" else {"peer.test": True})
