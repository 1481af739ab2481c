"""The stream table (``intake/streams.py``) is the one list of consumed streams: the
parsers the replication client is given are its streams' own (each parser's errors name
the stream it is filed under), none of them is among the streams the client skips, and
every stream name a backend keys its gap fetchers and gap notes by is a consumed stream
(the storage layer cannot import the table, so this is where the two are tied). On
each backend a gap in every consumed stream is either filled by a fetcher or described
by a note; none falls through to the bare "its rows are skipped"."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from federation_sender.clock import SystemClock
from federation_sender.errors import ProtocolError
from federation_sender.intake.streams import (
    CONSUMED_STREAMS,
    ROW_PARSERS,
    STREAMS,
    gap_notes,
    parse_row,
)
from federation_sender.replication.client import ROWS_SKIPPED, SKIPPED_STREAMS
from federation_sender.storage.backend import NativeBackend
from federation_sender.storage.capabilities import Capabilities
from federation_sender.storage.synapse.backend import SynapseBackend
from federation_sender.storage.synapse.database import create_synapse_engine
from federation_sender.synapse.config import parse_synapse_config
from federation_sender.testing.synapse_config import minimal_worker_tree

SYNAPSE = minimal_worker_tree()


@pytest.fixture
async def backends() -> AsyncIterator[dict[str, Capabilities]]:
    """Both backends' capabilities, on engines that never connect (building a fetcher
    does not)."""
    native = create_async_engine("sqlite+aiosqlite://")
    synapse = create_synapse_engine("postgresql://nobody@127.0.0.1:1/none")
    syn = SynapseBackend(synapse, parse_synapse_config(SYNAPSE), "fed1", SystemClock())
    try:
        yield {"native": NativeBackend(native).capabilities(), "synapse": syn.capabilities()}
    finally:
        await native.dispose()
        await synapse.dispose()


def test_the_parsers_and_names_are_the_tables() -> None:
    assert tuple(ROW_PARSERS) == tuple(STREAMS) == CONSUMED_STREAMS
    assert all(ROW_PARSERS[name] is s.parse for name, s in STREAMS.items())
    assert not set(STREAMS) & SKIPPED_STREAMS, "a consumed stream would be skipped"


@pytest.mark.parametrize("name", list(STREAMS))
def test_each_parser_reads_the_stream_it_is_filed_under(name: str) -> None:
    with pytest.raises(ProtocolError, match=f"^invalid {name} row"):
        STREAMS[name].parse(42)


def test_a_stream_outside_the_table_is_not_parsed() -> None:
    with pytest.raises(ProtocolError, match="not consumed"):
        parse_row(next(iter(SKIPPED_STREAMS)), [])


async def test_backends_name_only_consumed_streams(backends: dict[str, Capabilities]) -> None:
    for backend, caps in backends.items():
        assert set(caps.fetchers) <= set(STREAMS), backend
        assert set(caps.gap_notes) <= set(STREAMS), backend


async def test_every_gap_is_filled_or_described_on_each_backend(
    backends: dict[str, Capabilities],
) -> None:
    for backend, caps in backends.items():
        notes = gap_notes(caps.gap_notes)
        assert set(notes) == set(STREAMS), backend
        bare = [n for n in STREAMS if n not in caps.fetchers and notes[n] is ROWS_SKIPPED]
        assert bare == [], f"{backend}: a gap in {bare} would skip rows without saying which"
