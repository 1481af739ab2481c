"""Stream ids of the simulated main process."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine


async def test_restarted_writer_never_reuses_an_abandoned_id(engine: AsyncEngine) -> None:
    """Ids reserved by a previous writer for a transaction that failed stay used."""
    from federation_sender.sim.publish import WriterPublisher

    first = await WriterPublisher.for_database(engine, "sim.local")
    ids = await first.reserve("events", 3)
    await first.complete("events", {i: [] for i in ids})  # abandoned: nothing persisted
    plain = await WriterPublisher.for_database(engine, "sim.local")
    assert (await plain.reserve("events", 1))[0] == ids[0]  # the hazard without a floor
    again = await WriterPublisher.for_database(engine, "sim.local", floor=first.positions())
    assert (await again.reserve("events", 1))[0] == ids[-1] + 1
