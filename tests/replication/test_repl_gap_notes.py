"""What the replication client logs for a gap no fetcher can fill (a POSITION past a
position restored at start): nothing above DEBUG for ``events`` (the intake reads
events from the database, nothing is missed), one INFO line saying what is skipped for
a volatile stream (typing), one WARNING line for rows lost (native receipts), and the
generic WARNING for a stream nobody described. The notes are the worker's own
(the stream table's, with the backends' gap notes over them); the input goes through
the real connection parser."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest

from federation_sender.intake.streams import ROW_PARSERS, gap_notes
from federation_sender.replication.client import ReplicationClient
from federation_sender.storage.stream_fetchers import native_gap_notes
from federation_sender.storage.synapse.stream_fetchers import synapse_gap_notes
from federation_sender.testing.clock import FakeClock
from federation_sender.testing.replication import (
    InMemoryPositionStore,
    MemorySession,
    MemoryTransport,
    RecordingHandler,
)

STREAMS = ["events", "typing", "receipts", "caches", "to_device"]


async def run_positions(synapse: bool, caplog: pytest.LogCaptureFixture) -> list[str]:
    clock = FakeClock()
    store = InMemoryPositionStore({(s, "master"): 5 for s in STREAMS})
    lines = "".join(f"POSITION {s} master 9 9\n" for s in STREAMS)
    session = MemorySession([b"SERVER hs\n" + lines.encode()], clock, hold_open=True)
    handler = RecordingHandler()
    client = ReplicationClient(
        MemoryTransport([session]), instance_name="fed1", store=store, fetchers={},
        handler=handler, clock=clock, streams={s: ROW_PARSERS[s] for s in STREAMS},
        gap_notes=gap_notes(synapse_gap_notes() if synapse else native_gap_notes()),
    )  # fmt: skip
    caplog.set_level(logging.DEBUG, logger="federation_sender.replication.client")
    task = asyncio.create_task(client.run())
    try:
        await handler.wait_for(lambda: all(handler.last_token(s) == 9 for s in STREAMS))
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    return [
        f"{r.levelname} {r.getMessage()}"
        for r in caplog.records
        if "missed" in r.getMessage() or "moved" in r.getMessage()
    ]


async def test_gaps_without_a_fetcher_say_what_they_skip(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lines = await run_positions(False, caplog)
    by_stream = {ln.split()[2].split("/")[0]: ln for ln in lines}
    assert by_stream["events"] == "DEBUG replication: events/master moved from 5 to 9 " \
        "(nothing to fetch)"
    assert by_stream["typing"].startswith(
        "INFO replication: typing/master missed (5, 9]: typing notifications in that range "
        "are not sent"
    )
    assert by_stream["caches"].startswith("INFO replication: caches/master missed (5, 9]: ")
    assert by_stream["receipts"].startswith(
        "WARNING replication: receipts/master missed (5, 9]: receipts in that range are not "
        "sent (the native schema keeps no receipts)"
    )
    assert by_stream["to_device"] == (
        "WARNING replication: to_device/master missed (5, 9]: its rows in that range are "
        "skipped (no fetcher)"
    )
    assert not [ln for ln in lines if "has no fetcher; skipping" in ln]


async def test_beside_synapse_events_gap_at_start_is_not_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lines = await run_positions(True, caplog)
    assert [ln for ln in lines if ln.startswith("WARNING") and "events/" in ln] == []
