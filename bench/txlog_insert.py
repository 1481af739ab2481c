"""Cost of writing the transaction log: ``storage/txlog.py`` (COPY in the text format)
against the two statements it replaced, one ``INSERT`` of a parameter holding every row
as a ``jsonb`` array expanded server-side (``jsonb_array_elements``), and the same over
``json``, whose ``->>`` parses the whole row again for every column.

For each: the wall time of the write, this process's CPU (encoding, the driver) and the
PostgreSQL server processes' CPU (``/proc``), per batch of ``--rows`` rows of ``--ids``
event ids each (the group commit writes a few hundred rows of 50 ids under load).

    .venv/bin/python bench/txlog_insert.py [--rows 300] [--ids 50] [--repeat 10]

Each write runs in a transaction that is rolled back; the variants alternate.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson
from common import database, report
from fanout_diagnostics import postgres_cpu_s
from sqlalchemy import text

from federation_sender.model import TxnLogRow
from federation_sender.storage import txlog

_COLUMNS = ", ".join(txlog._COLUMNS)
_CASTS = ("", "", "", "::integer", "::integer", "::integer", "", "::integer", "::bigint",
          "::integer", "::boolean", "::bigint", "")
_SELECT = ", ".join(f"(r->>{i}){c}" for i, c in enumerate(_CASTS))
JSONB_INSERT = text(
    f"INSERT INTO federation_transaction_log ({_COLUMNS}) SELECT {_SELECT},"
    f" (r->{len(_CASTS)})::text FROM jsonb_array_elements(CAST(:rows AS jsonb)) AS x(r)")
JSON_INSERT = text(JSONB_INSERT.text.replace(
    "jsonb_array_elements(CAST(:rows AS jsonb))", "json_array_elements(CAST(:rows AS json))"))


def one_param(rows: Sequence[TxnLogRow]) -> str:
    return orjson.dumps([(*r[:12], r.error, r.pdu_event_ids) for r in rows]).decode()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=300)
    ap.add_argument("--ids", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=10)
    a = ap.parse_args()
    rows = [
        TxnLogRow(f"t{i}", f"d{i}.test", "w1", a.ids, 0, 15_000, "success", 200,
                  1_700_000_000_000 + i, 3, False, 100_000 + i,
                  tuple(f"${i:08d}abcdefghijklmnopqrstuvwxyzABCDEFGH{j:02d}"
                        for j in range(a.ids)), None)
        for i in range(a.rows)
    ]

    async def copy(conn: Any) -> None:
        await txlog.log_transactions(conn, rows)

    async def jsonb(conn: Any) -> None:
        await conn.execute(JSONB_INSERT, {"rows": one_param(rows)})

    async def json_(conn: Any) -> None:
        await conn.execute(JSON_INSERT, {"rows": one_param(rows)})

    variants: list[tuple[str, Callable[[Any], Awaitable[None]]]] = [
        ("COPY (storage/txlog.py)", copy), ("INSERT of one jsonb array", jsonb),
        ("INSERT of one json array", json_)]
    totals = {name: [0.0, 0.0, 0.0] for name, _ in variants}
    async with database("postgres") as engine:
        for _ in range(a.repeat):
            for name, fn in variants:
                async with engine.begin() as conn:
                    pg0, c0, w0 = postgres_cpu_s(), time.process_time(), time.perf_counter()
                    await fn(conn)
                    t = totals[name]
                    t[0] += time.perf_counter() - w0
                    t[1] += time.process_time() - c0
                    t[2] += postgres_cpu_s() - pg0
                    await conn.rollback()
    report(f"transaction log: {a.rows} rows x {a.ids} event ids, {a.repeat} writes each "
           "(ms per write: wall / this process's CPU / PostgreSQL's CPU)",
           [(name, " / ".join(f"{1000 * x / a.repeat:.1f}" for x in totals[name]))
            for name, _ in variants])


if __name__ == "__main__":
    asyncio.run(main())
