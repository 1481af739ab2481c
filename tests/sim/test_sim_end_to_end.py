"""The simulator against the real federation client: rows in, signed /send out, check.

A minimal stand-in for the worker reads what the simulator wrote (events JSON, the
outboxes), sends it to each destination with
:class:`~federation_sender.transport.client.FederationClient`, and the delivery check
must pass; holding back one room's latest event must make it fail. This pins the
simulator's contract (rows, event ids, EDU shapes) to what the real client sends.
"""

from __future__ import annotations

import json
from pathlib import Path

from sqlalchemy import select

from federation_sender.clock import SystemClock
from federation_sender.sim.check import check_delivery
from federation_sender.sim.driver import Driver, Scenario
from federation_sender.sim.fleet import RemoteFleet
from federation_sender.sim.publish import RecordingPublisher
from federation_sender.storage import schema
from federation_sender.storage.engine import create_engine
from federation_sender.storage.migrate import upgrade
from federation_sender.testing.faults import FaultProfile
from federation_sender.transport.client import FederationClient
from federation_sender.transport.result import Outcome, Transaction
from federation_sender.transport.signing import SigningKey, verify_key_lookup

US = "us.test"


async def test_real_client_delivery_passes_the_check(tmp_path: Path) -> None:
    clock = SystemClock()
    engine = create_engine(f"sqlite:///{tmp_path}/e2e.db")
    await upgrade(engine)
    scenario = Scenario(
        server_name=US, remote_servers=4, rooms=4, partial_state_rooms=1, steps=300,
        rate_per_s=None, seed=5,
    )  # fmt: skip
    driver = Driver.build(scenario, engine=engine, publisher=RecordingPublisher(), clock=clock)
    await driver.setup()
    await driver.run()
    async with engine.connect() as conn:
        pdu_json = dict(
            (await conn.execute(select(schema.events.c.event_id, schema.events.c.json)))
            .tuples()
            .all()
        )
        outbox = (await conn.execute(select(schema.device_federation_outbox))).all()
        pokes = (await conn.execute(select(schema.device_lists_outbound_pokes))).all()
    await engine.dispose()

    key = SigningKey.generate("e2e")
    lookup = verify_key_lookup({US: {key.key_id: key.verify_key}})
    names = scenario.remote_server_names
    slow = {names[0]: FaultProfile(slow_s=0.01, max_body_bytes=10_000_000)}
    async with (
        RemoteFleet(names, lookup_key=lookup, clock=clock, faults=slow) as fleet,
        FederationClient(
            server_name=US,
            signing_key=key,
            clock=clock,
            destination_overrides=fleet.overrides(),
            ip_allow_list=["127.0.0.0/8"],
            plain_http=True,
            attempt_timeout_s=10,
        ) as client,
    ):
        held_back = None
        for n, dest in enumerate(names):
            expected = driver.oracle.should_receive(dest)
            if n == 1 and expected:
                held_back = expected.pop()  # the room's latest, for the negative check
            pdus = [json.loads(pdu_json[e.event_id]) for e in expected]
            edus = [
                {"edu_type": "m.direct_to_device", "content": json.loads(o.messages_json)}
                for o in outbox
                if o.destination == dest
            ] + [
                {
                    "edu_type": "m.device_list_update",
                    "content": {
                        "user_id": p.user_id,
                        "device_id": p.device_id,
                        "stream_id": p.stream_id,
                    },
                }
                for p in pokes
                if p.destination == dest
            ]
            for i in range(0, max(len(pdus), len(edus)), 50):
                txn = Transaction(dest, f"txn{i}", pdus[i : i + 50], edus[i : i + 50])
                result = await client.send_transaction(txn)
                assert result.outcome is Outcome.SUCCESS, result

    report = check_delivery(driver.oracle, fleet.records())
    assert held_back is not None
    behind = [
        (name, s.expected.event_id)
        for name, d in report.destinations.items()
        for s in d.missing_rooms
    ]
    assert behind == [(names[1], held_back.event_id)], report.summary()
    assert report.total("unknown") == report.total("unexpected") == 0
    assert report.total("to_device_missing") == report.total("device_updates_missing") == 0
    assert report.total("events_received") == report.total("events_expected") - 1 > 100
