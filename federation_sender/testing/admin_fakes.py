"""An in-memory :class:`QueueControl` and a seeder of simulated destinations, for the
admin API's tests, the dashboard's browser test and demos.

:class:`FakeQueueControl` keeps live states in a dict. With an engine it behaves like
the real queue engine on reset: a destination is "backing off" when its live state
says so or its persisted ``retry_last_ts`` is set, and a reset clears both.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from federation_sender.admin.protocols import LiveState, QueueStateName
from federation_sender.clock import Clock, time_ms
from federation_sender.storage.engine import run_in_transaction
from federation_sender.storage.schema import (
    destination_rooms,
    destinations,
    federation_transaction_log,
)


def live_state(state: QueueStateName = "idle", **fields: Any) -> LiveState:
    """A complete :class:`LiveState` with defaults for the fields not given."""
    out: dict[str, Any] = {
        "state": state,
        "pending_pdus": 0,
        "pending_edus": 0,
        "in_flight_txn_id": None,
        "in_flight_age_s": None,
        "last_error": None,
        "next_retry_ts": None,
        "last_success_ts": None,
        "catching_up": state == "catching_up",
    }
    unknown = set(fields) - set(out)
    if unknown:
        raise TypeError(f"unknown live state fields: {sorted(unknown)}")
    out.update(fields)
    return out  # type: ignore[return-value]  # keys checked above


class FakeQueueControl:
    """Implements :class:`federation_sender.admin.protocols.QueueControl`."""

    def __init__(self, engine: AsyncEngine | None = None) -> None:
        self._engine = engine
        self.states: dict[str, LiveState] = {}
        self.resets: list[str] = []
        """Destinations successfully reset, in order (the "wake-ups")."""

    def set_state(self, destination: str, state: QueueStateName = "idle", **fields: Any) -> None:
        self.states[destination] = live_state(state, **fields)

    def live_state(self, destination: str) -> Mapping[str, Any] | None:
        st = self.states.get(destination)
        return dict(st) if st is not None else None

    def live_states(self) -> Mapping[str, Mapping[str, Any]]:
        return {d: dict(s) for d, s in self.states.items()}

    async def reset_connection(self, destination: str) -> bool:
        live = self.states.get(destination)
        backing_off = live is not None and live["state"] == "backing_off"
        if self._engine is not None:

            async def clear(conn: AsyncConnection) -> bool:
                persisted = (
                    await conn.execute(
                        select(destinations.c.retry_last_ts).where(
                            destinations.c.destination == destination
                        )
                    )
                ).scalar_one_or_none()
                if not (persisted or backing_off):
                    return False
                await conn.execute(
                    update(destinations)
                    .where(destinations.c.destination == destination)
                    .values(retry_last_ts=0, retry_interval=0, failure_ts=None)
                )
                return True

            backing_off = await run_in_transaction(self._engine, clear)
        if not backing_off:
            return False
        if live is not None:
            self.states[destination] = live_state(
                "sending" if live["pending_pdus"] or live["pending_edus"] else "idle",
                pending_pdus=live["pending_pdus"],
                pending_edus=live["pending_edus"],
            )
        self.resets.append(destination)
        return True


async def seed_destinations(
    engine: AsyncEngine,
    clock: Clock,
    count: int,
    *,
    queues: FakeQueueControl | None = None,
    rooms_per_destination: int = 3,
    transactions_per_destination: int = 3,
    seed: int = 1,
) -> list[str]:
    """Write ``count`` simulated destinations with rooms and transaction log rows, in a
    deterministic mix of states, and (optionally) matching live states. Returns the
    names: ``{kind}-{i:04d}.example.org`` with kind in healthy/failing/catchup/busy."""
    rng = random.Random(seed)
    now = time_ms(clock)
    kinds = ("healthy", "failing", "catchup", "busy")
    names: list[str] = []
    dest_rows: list[dict[str, Any]] = []
    room_rows: list[dict[str, Any]] = []
    txn_rows: list[dict[str, Any]] = []
    for i in range(count):
        kind = kinds[i % len(kinds)]
        name = f"{kind}-{i:04d}.example.org"
        names.append(name)
        failing = kind in ("failing", "catchup")
        interval = (600_000 if kind == "failing" else 4 * 3_600_000) if failing else 0
        dest_rows.append(
            {
                "destination": name,
                "retry_last_ts": now - rng.randint(1, 300) * 1000 if failing else 0,
                "retry_interval": interval,
                "failure_ts": now - rng.randint(3600, 90_000) * 1000 if failing else None,
                "last_successful_stream_ordering": rng.randint(1, 10_000),
            }
        )
        for r in range(rooms_per_destination):
            room_rows.append(
                {
                    "destination": name,
                    "room_id": f"!room{r}-{i}:example.com",
                    "stream_ordering": rng.randint(1, 10_000),
                }
            )
        txn_rows.extend(
            _txn_rows(rng, name, i, kind, failing, transactions_per_destination, now)
        )
        if queues is not None:
            _live_state(queues, rng, name, i, kind, dest_rows[-1]["retry_last_ts"] + interval, now)

    async def write(conn: AsyncConnection) -> None:
        if dest_rows:
            await conn.execute(insert(destinations), dest_rows)
        if room_rows:
            await conn.execute(insert(destination_rooms), room_rows)
        if txn_rows:
            await conn.execute(insert(federation_transaction_log), txn_rows)

    await run_in_transaction(engine, write)
    return names


def _txn_rows(
    rng: random.Random, name: str, i: int, kind: str, failing: bool, count: int, now: int
) -> list[dict[str, Any]]:
    """Transaction-log rows of one seeded destination (the first one failed if failing)."""
    rows: list[dict[str, Any]] = []
    for t in range(count):
        ok = not failing or t > 0
        rows.append(
            {
                "txn_id": f"{1_700_000_000_000 + i * 100 + t}",
                "destination": name,
                "instance_name": "federation_sender1",
                "pdu_count": rng.randint(0, 50),
                "edu_count": rng.randint(0, 10),
                "request_bytes": rng.randint(200, 90_000),
                "status": "success" if ok else "transient",
                "http_status": 200 if ok else None,
                "started_ts": now - (count - t) * 60_000,
                "duration_ms": rng.randint(5, 2000),
                "catchup": kind == "catchup",
                "max_stream_ordering": rng.randint(1, 10_000),
                "pdu_event_ids": json.dumps([f"$ev{i}-{t}"]),
                "error": None if ok else "connection refused",
            }
        )
    return rows


def _live_state(
    queues: FakeQueueControl,
    rng: random.Random,
    name: str,
    i: int,
    kind: str,
    next_retry_ts: int,
    now: int,
) -> None:
    """The live queue state matching a seeded destination's kind."""
    if kind == "failing":
        queues.set_state(
            name,
            "backing_off",
            pending_pdus=rng.randint(1, 40),
            last_error="connection refused",
            next_retry_ts=next_retry_ts,
        )
    elif kind == "catchup":
        queues.set_state(name, "catching_up", last_error="timed out")
    elif kind == "busy":
        queues.set_state(
            name,
            "sending",
            pending_pdus=rng.randint(1, 200),
            pending_edus=rng.randint(0, 50),
            in_flight_txn_id=f"{now}{i}",
            in_flight_age_s=round(rng.uniform(0.1, 30.0), 1),
        )
