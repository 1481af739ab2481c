"""Array literals read back by PostgreSQL as the values they were made from."""

from __future__ import annotations

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.storage.pgarray import bigint_array, text_array

AWKWARD = [
    "", "NULL", "null", "a,b", "{x}", '"quoted"', "back\\slash", "tail\\", " spaced ",
    "tab\there", "new\nline", "[::1]:8448", "!room:server.test", "é ünïcode", "'single'",
]


def test_literals() -> None:
    assert text_array([]) == "{}"
    assert text_array(["a", 'b"c']) == '{"a","b\\"c"}'
    assert bigint_array([1, -2, 3_000_000_000]) == "{1,-2,3000000000}"


@pytest.mark.parametrize("values", [[], ["one"], AWKWARD])
async def test_text_arrays_round_trip(pg_engine: AsyncEngine, values: list[str]) -> None:
    async with pg_engine.connect() as conn:
        got = (await conn.execute(
            text("SELECT CAST(:d AS text[])"), {"d": text_array(values)}
        )).scalar_one()
        rows = (await conn.execute(
            text("SELECT x FROM unnest(CAST(:d AS text[]), CAST(:s AS bigint[])) AS u(x, n)"
                 " ORDER BY n"),
            {"d": text_array(values), "s": bigint_array(range(len(values)))},
        )).scalars().all()
    assert got == values
    assert rows == values
