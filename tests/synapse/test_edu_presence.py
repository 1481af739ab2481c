"""Presence states, rooms and hosts read from a real Synapse 1.163's tables match what
main publishes on the presence stream."""

from __future__ import annotations

import itertools
import json
import urllib.parse
from collections.abc import AsyncIterator

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.replication.rows import PresenceRow, parse_row
from federation_sender.storage.stream_fetchers import stream_fetchers
from federation_sender.synapse.database import create_synapse_engine
from federation_sender.synapse.edus.rooms import SynapsePresenceSource
from federation_sender.testing.replication_tap import ReplicationTap
from federation_sender.testing.synapse_deployment import SynapseDeployment

_names = itertools.count()


@pytest.fixture
async def engine(synapse_deployment: SynapseDeployment) -> AsyncIterator[AsyncEngine]:
    eng = create_synapse_engine(synapse_deployment.database_url, pool_size=2)
    yield eng
    await eng.dispose()


def presence_rows(lines: list[str], user_id: str) -> list[tuple[int, PresenceRow]]:
    out = []
    for line in lines:
        parts = line.split(" ", 4)
        if parts[:2] == ["RDATA", "presence"] and parts[3] != "batch":
            row = parse_row("presence", json.loads(parts[4]))
            assert isinstance(row, PresenceRow)
            if row.state.user_id == user_id:
                out.append((int(parts[3]), row))
    return out


async def test_presence_source_reads_what_main_published(
    synapse_deployment: SynapseDeployment, engine: AsyncEngine
) -> None:
    d = synapse_deployment
    alice = d.client.register(f"pr_alice{next(_names)}")
    room = d.client.create_room(alice)
    path = f"/_matrix/client/v3/presence/{urllib.parse.quote(alice.user_id)}/status"
    with ReplicationTap(d.redis_url, d.server_name) as tap:
        d.client.call("PUT", path, {"presence": "unavailable", "status_msg": "lunch"},
                      alice.access_token)
        tap.wait_for(lambda lines: any(r.state.status_msg == "lunch"
                                       for _, r in presence_rows(lines, alice.user_id)),
                     what="alice's presence")
        token, live = [(t, r) for t, r in presence_rows(tap.lines, alice.user_id)
                       if r.state.status_msg == "lunch"][-1]
    source = SynapsePresenceSource(engine)
    stored = await source.states_for_users([alice.user_id, "@nobody:nowhere"])
    assert stored == {alice.user_id: live.state}
    assert live.state in await source.startup_states()
    assert await source.rooms_for_user(alice.user_id) == [room]
    assert await source.current_hosts(room) == {d.server_name}
    # A gap in the presence stream is read back from presence_stream.
    fetcher = stream_fetchers(engine, synapse=True)["presence"]
    rows, upto, limited = await fetcher.fetch("master", token - 1, token, 100)
    assert (rows, upto, limited) == ([(token, live)], token, False)
