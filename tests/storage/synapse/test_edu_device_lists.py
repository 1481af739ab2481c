"""Device-list and cross-signing EDUs built from a database a real Synapse 1.163 wrote
(logins, device keys, cross-signing upload, a cross-signature, a deleted device),
compared with what Synapse's own code builds from the same rows."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.storage.synapse import device_lists as dl
from federation_sender.storage.synapse.database import create_synapse_engine
from federation_sender.testing.synapse_deployment import SynapseDeployment
from tests.synapse import edu_support as e2ee

_names = itertools.count()


@pytest.fixture
async def engine(synapse_deployment: SynapseDeployment) -> AsyncIterator[AsyncEngine]:
    eng = create_synapse_engine(synapse_deployment.database_url, pool_size=2)
    yield eng
    await eng.dispose()


def poke_everything(d: SynapseDeployment, destination: str, user_id: str) -> int:
    """Pokes for ``destination`` as Synapse writes them when the destination shares a
    room with the user: one per device-list stream row of the user. Returns the
    stream's current position."""
    d.sql(
        "INSERT INTO device_lists_outbound_pokes"
        " (destination, stream_id, user_id, device_id, sent, ts, opentracing_context)"
        f" SELECT '{destination}', stream_id, user_id, device_id, false, 0, '{{}}'"
        f" FROM device_lists_stream WHERE user_id = '{user_id}'"
    )
    return int(d.sql("SELECT max(stream_id) FROM device_lists_stream").strip())


def canonical(edus: list[Any]) -> list[str]:
    """Synapse's order across users follows its database reads; compare as a multiset."""
    return sorted(json.dumps(list(e), sort_keys=True) for e in edus)


async def ours(engine: AsyncEngine, dest: str, frm: int, now: int, limit: int,
               names: bool = False) -> dl.DeviceUpdates:
    async with engine.connect() as conn:
        return await dl.device_updates_by_remote(conn, dest, frm, now, limit,
                                                 allow_device_names=names)


async def test_device_list_edus_are_synapses(
    synapse_deployment: SynapseDeployment, engine: AsyncEngine
) -> None:
    d = synapse_deployment
    n = next(_names)
    alice = d.client.register(f"dl_alice{n}")
    phone = e2ee.login(d, alice, "Phone")
    tablet = e2ee.login(d, alice, "Tablet")
    laptop_keys, _ = e2ee.upload_device_keys(d, alice)
    e2ee.upload_device_keys(d, phone)
    cs = e2ee.upload_cross_signing(d, alice)
    e2ee.sign_device(d, alice, laptop_keys, cs)
    e2ee.delete_device(d, alice, tablet.device_id)
    dest = f"dl{n}.test"
    now = poke_everything(d, dest, alice.user_id)

    limits = (100, 1, 2, 3, 4)  # one run of Synapse's code answers every window size
    answers = e2ee.reference(d, "device_lists", dest, "0", ",".join(map(str, limits)))
    mine = await ours(engine, dest, 0, now, 100)
    upto, theirs = answers[0]
    assert mine.upto == upto
    assert canonical([(e.edu_type, e.content) for e in mine.edus]) == canonical(theirs)

    by_device = {e.content["device_id"]: e.content for e in mine.edus
                 if e.edu_type == dl.DEVICE_LIST_UPDATE}
    laptop = by_device[alice.device_id]
    assert laptop["keys"]["signatures"][alice.user_id] == {
        f"ed25519:{alice.device_id}": laptop_keys["signatures"][alice.user_id][
            f"ed25519:{alice.device_id}"],
        f"ed25519:{cs.self_signing_pub}": laptop["keys"]["signatures"][alice.user_id][
            f"ed25519:{cs.self_signing_pub}"],
    }
    assert by_device[tablet.device_id]["deleted"] is True
    assert "device_display_name" not in by_device[phone.device_id]
    chain = sorted(c["stream_id"] for c in by_device.values())
    assert sorted(c["prev_id"][0] for c in by_device.values() if c["prev_id"]) == chain[:-1]
    signing = [e for e in mine.edus if e.edu_type != dl.DEVICE_LIST_UPDATE]
    assert [e.edu_type for e in signing] == [dl.SIGNING_KEY_UPDATE, dl.UNSTABLE_SIGNING_KEY_UPDATE]
    assert signing[0].content["master_key"]["keys"] == {
        f"ed25519:{cs.master_pub}": cs.master_pub}
    assert set(signing[0].content) == {"user_id", "master_key", "self_signing_key"}

    named = await ours(engine, dest, 0, now, 100, names=True)
    assert {e.content.get("device_display_name") for e in named.edus} >= {"Phone"}

    # Small windows: the budget rule (signing keys count twice) and where each stops.
    for limit, (upto, theirs) in zip(limits[1:], answers[1:], strict=True):
        part = await ours(engine, dest, 0, now, limit)
        assert (part.upto, canonical([(e.edu_type, e.content) for e in part.edus])) == (
            upto, canonical(theirs)), limit


async def test_sent_pokes_are_deleted_and_prev_id_continues(
    synapse_deployment: SynapseDeployment, engine: AsyncEngine
) -> None:
    d = synapse_deployment
    n = next(_names)
    bob = d.client.register(f"dl_bob{n}")
    e2ee.upload_device_keys(d, bob)
    dest = f"dl{n}.test"
    now = poke_everything(d, dest, bob.user_id)
    first = await ours(engine, dest, 0, now, 100)
    assert first.edus
    async with engine.begin() as conn:
        await dl.mark_sent(conn, dest, first.upto)
    assert d.sql(f"SELECT count(*) FROM device_lists_outbound_pokes WHERE destination = '{dest}'"
                 ).strip() == "0"
    assert d.sql("SELECT user_id, stream_id FROM device_lists_outbound_last_success"
                 f" WHERE destination = '{dest}'").strip() == f"{bob.user_id}|{first.upto}"

    phone = e2ee.login(d, bob, "Phone")
    d.sql(f"DELETE FROM device_lists_outbound_pokes WHERE destination = '{dest}'")
    now = poke_everything(d, dest, bob.user_id)
    d.sql(f"DELETE FROM device_lists_outbound_pokes WHERE destination = '{dest}'"
          f" AND stream_id <= {first.upto}")
    second = await ours(engine, dest, first.upto, now, 100)
    upto, theirs = e2ee.reference(d, "device_lists", dest, str(first.upto), "100")
    assert second.upto == upto
    assert canonical([(e.edu_type, e.content) for e in second.edus]) == canonical(theirs)
    [update] = second.edus
    assert update.content["device_id"] == phone.device_id
    assert update.content["prev_id"] == [first.upto]  # from device_lists_outbound_last_success

    async with engine.begin() as conn:
        await dl.mark_covered_sent(conn, dest, update.covers)
        assert await dl.destinations_for_token(conn, now) == []
    assert d.sql("SELECT stream_id FROM device_lists_outbound_last_success"
                 f" WHERE destination = '{dest}'").strip() == str(update.content["stream_id"])


async def test_windows_read_ahead_chain_as_synapse_does_after_each_200(
    synapse_deployment: SynapseDeployment, engine: AsyncEngine
) -> None:
    """The queue reads the next window before the previous one is acknowledged; the
    prev_id chain must still be the one Synapse builds window after window."""
    d = synapse_deployment
    n = next(_names)
    carol = d.client.register(f"dl_carol{n}")
    for name in ("Phone", "Tablet"):
        e2ee.upload_device_keys(d, e2ee.login(d, carol, name))
    e2ee.upload_cross_signing(d, carol)
    dest = f"dl{n}.test"
    now = poke_everything(d, dest, carol.user_id)
    read: list[list[Any]] = []
    cursor = -1
    async with engine.connect() as conn:
        while rows := await dl.device_list_rows(conn, dest, cursor, now, 2,
                                                allow_device_names=False):
            read.append([[r.edu_type, json.loads(r.content_json)] for r in rows])
            cursor = max(r.stream_id for r in rows)
    windows = e2ee.reference(d, "device_lists_drain", dest, "2")
    # Where windows end is the queue's business (a cross-signing pair may take a read one
    # past its limit); the EDUs, their order and their prev_id chain must be Synapse's.
    assert [e for w in read for e in w] == [e for _, w in windows for e in w]
    assert len(windows) == 3 and all(len(w) <= 3 for w in read)
