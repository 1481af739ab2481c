"""Server time of the transaction log's insert: the statement in storage/txlog.py
(``jsonb_array_elements``) against the same statement over ``json``, whose ``->>`` parses
the whole row again for every column (the version that was measured and replaced).

    .venv/bin/python bench/txlog_insert.py [--rows 1000] [--ids 40] [--repeat 3]

Each insert runs in a transaction that is rolled back; the client-side encoding is
timed separately.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from common import database
from sqlalchemy import text

from federation_sender.storage import txlog

_JSONB = "jsonb_array_elements(CAST(:rows AS jsonb))"
assert _JSONB in txlog._PG_INSERT.text, "storage/txlog.py changed: update this script"
JSON_VARIANT = text(txlog._PG_INSERT.text.replace(
    _JSONB, "json_array_elements(CAST(:rows AS json))"))


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--ids", type=int, default=40)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    rows = [
        txlog.TxnLogRow(f"t{i}", f"d{i}.test", "w1", a.ids, 0, 15_000, "success", 200,
                        1_700_000_000_000 + i, 3, False, 100_000 + i,
                        tuple(f"${i:08d}abcdefghijklmnopqrstuvwxyzABCDEFGH{j:02d}"
                              for j in range(a.ids)), None)
        for i in range(a.rows)
    ]
    async with database("postgres") as engine:
        for _ in range(a.repeat):
            for name, stmt in (("jsonb (current)", txlog._PG_INSERT), ("json ->>", JSON_VARIANT)):
                t0 = time.perf_counter()
                param = txlog._COMPACT.encode(
                    [(*r[:12], r.error, r.pdu_event_ids) for r in rows])
                t1 = time.perf_counter()
                async with engine.begin() as conn:
                    await conn.execute(stmt, {"rows": param})
                    t2 = time.perf_counter()
                    await conn.rollback()
                print(f"{name:16s} {a.rows} rows x {a.ids} ids: encode {1000 * (t1 - t0):6.1f} ms,"
                      f" insert {1000 * (t2 - t1):6.1f} ms")


if __name__ == "__main__":
    asyncio.run(main())
