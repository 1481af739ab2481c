"""A to-device message a destination keeps refusing, on Synapse's own outbox table: it
is isolated and dropped alone as in the native backend, the messages around it are
delivered, and every row is deleted (Synapse's semantics: a dropped row must not poison
the queue again), without the destination ever backing off."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
from sqlalchemy import text

from federation_sender.config import QueueSettings
from federation_sender.queue.manager import QueueManager
from federation_sender.storage.synapse.backend import SynapseBackend
from federation_sender.storage.synapse.database import create_synapse_engine, upgrade_own_schema
from federation_sender.synapse.config import SynapseConfig
from federation_sender.testing.clock import FakeClock
from federation_sender.testing.fake_homeserver import FakeHomeserver
from federation_sender.testing.http_sender import HttpTransactionSender
from federation_sender.testing.queue_harness import ME, Harness, RecordingObserver
from federation_sender.testing.queue_writer import HomeserverWriter
from tests.synapse.backend_support import (  # noqa: F401 (fixtures)
    synapse_db_url_fixture,
    synapse_template_fixture,
)

pytestmark = pytest.mark.postgres
D = "remote.test"


def config() -> SynapseConfig:
    return SynapseConfig(
        server_name=ME, database_url="", redis_url="", signing_key_path="",
        worker_name="fed1", federation_sender_instances=("fed1",),
        federation_domain_whitelist=None, ip_range_blacklist=(), ip_range_whitelist=(),
        verify_tls=True, extra_ca_file=None, min_retry_interval_ms=600_000,
        retry_multiplier=2.0, max_retry_interval_ms=7 * 86_400_000,
    )


@pytest.fixture
async def harness(synapse_db_url: str) -> AsyncIterator[tuple[Harness, SynapseBackend]]:
    engine = create_synapse_engine(synapse_db_url, pool_size=4)
    await upgrade_own_schema(engine)
    clock = FakeClock()
    fake = FakeHomeserver()
    await fake.start()
    sender = HttpTransactionSender(fake.url, ME, clock, timeout_s=20)
    backend = SynapseBackend(engine, config(), "fed1", clock)
    backend.capabilities().bind_stream_tokens({"to_device": 10})
    settings = replace(QueueSettings(), wakeup_interval_s=60.0)
    h = Harness(engine, clock, fake, sender, HomeserverWriter(engine, ME), settings)
    h.manager = QueueManager(backend, sender, settings, ME, "fed1", clock, random.Random(1),
                             lambda _d: True, h.observer, attempt_deadline_s=30.0)
    try:
        yield h, backend
    finally:
        await h.m.stop(0.0)
        await sender.close()
        await fake.close()
        await engine.dispose()


async def test_poison_to_device_is_dropped_alone_and_deleted(
    harness: tuple[Harness, SynapseBackend],
) -> None:
    h, _backend = harness
    assert isinstance(h.observer, RecordingObserver)
    async with h.engine.begin() as conn:
        for sid, mid in enumerate(["good1", "bad", "good2"], start=1):
            await conn.execute(text(
                "INSERT INTO device_federation_outbox"
                " (destination, stream_id, queued_ts, messages_json, instance_name)"
                " VALUES (:d, :s, 0, :m, 'master')"),
                {"d": D, "s": sid, "m": json.dumps({"message_id": mid, "messages": {}})})
    h.fake.behave(D, reject_message_ids={"bad"}, reject_status=400)
    await h.m.start()
    h.m.notify_outbox(D)
    await h.advance_until(lambda: len(h.observer.dropped) == 1, step_s=5, max_s=600)
    await h.settle()
    got = [e["content"]["message_id"] for e in h.fake.received_edus(D)]
    assert sorted(got) == ["good1", "good2"]
    assert h.observer.dropped == [(D, "m.direct_to_device", "refused")]
    async with h.engine.connect() as conn:
        left = (await conn.execute(text(
            "SELECT count(*) FROM device_federation_outbox WHERE destination = :d"),
            {"d": D})).scalar()
    assert left == 0
    st = h.m.status(D)
    assert st is None or st.retry_interval_ms == 0  # the destination was never blamed
