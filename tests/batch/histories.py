"""Hand-built histories for the batch tests, and the expected results computed from them
in plain Python, straight from the definitions (no Spark, no intervals, no SQL)."""

from __future__ import annotations

import json
import random
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import psycopg

from federation_sender.batch.io import DataFrameSource

OUR = "us.example"


def server(user_id: str) -> str:
    return user_id.split(":", 1)[1]


@dataclass
class History:
    server_name: str = OUR
    events: list[dict[str, Any]] = field(default_factory=list)
    memberships: list[dict[str, Any]] = field(default_factory=list)
    partial_state_rooms: set[str] = field(default_factory=set)
    destination_rooms: dict[tuple[str, str], int] = field(default_factory=dict)
    destinations: dict[str, int | None] = field(default_factory=dict)
    txn_log: list[dict[str, Any]] = field(default_factory=list)
    next_so: int = 1

    # --- building -------------------------------------------------------------------
    def event(self, room: str, sender: str, *, type: str = "m.room.message",
              state_key: str | None = None, outlier: bool = False,
              rejected: bool = False) -> dict[str, Any]:
        so = self.next_so
        self.next_so += 1
        ev = {"stream_ordering": so, "event_id": f"$e{so}", "room_id": room, "type": type,
              "state_key": state_key, "sender": sender, "outlier": outlier,
              "rejected": rejected}
        self.events.append(ev)
        return ev

    def msg(self, room: str, sender: str, **kw: Any) -> int:
        return int(self.event(room, sender, **kw)["stream_ordering"])

    def member(self, room: str, user: str, membership: str, *,
               sender: str | None = None) -> int:
        ev = self.event(room, sender or user, type="m.room.member", state_key=user)
        self.memberships.append({
            "event_id": ev["event_id"], "event_stream_ordering": ev["stream_ordering"],
            "room_id": room, "user_id": user, "server_name": server(user),
            "sender": sender or user, "membership": membership,
        })
        return int(ev["stream_ordering"])

    def purge(self, room: str) -> None:
        self.events = [e for e in self.events if e["room_id"] != room]
        self.memberships = [m for m in self.memberships if m["room_id"] != room]

    def send(self, dest: str, event_ids: list[str], *, status: str = "success",
             started_ts: int = 0, duration_ms: int = 10, catchup: bool = False,
             txn_id: str | None = None) -> None:
        self.txn_log.append({
            "id": len(self.txn_log) + 1, "txn_id": txn_id or f"t{len(self.txn_log)}",
            "destination": dest, "status": status,
            "http_status": 200 if status == "success" else 502,
            "started_ts": started_ts, "duration_ms": duration_ms, "catchup": catchup,
            "pdu_count": len(event_ids), "edu_count": 0, "request_bytes": 100,
            "max_stream_ordering": None, "pdu_event_ids": json.dumps(event_ids),
        })

    @property
    def high_water_mark(self) -> int:
        return max((e["stream_ordering"] for e in self.events), default=0)


# --- expected results, from the definitions ---------------------------------------------

def joined_servers(h: History, room: str, pos: int) -> set[str]:
    """Servers with a user whose latest membership row at or before ``pos`` is join."""
    latest: dict[str, tuple[int, str]] = {}
    for m in h.memberships:
        if m["room_id"] == room and m["event_stream_ordering"] <= pos:
            prev = latest.get(m["user_id"])
            if prev is None or prev[0] < m["event_stream_ordering"]:
                latest[m["user_id"]] = (m["event_stream_ordering"], m["membership"])
    return {server(u) for u, (_, ms) in latest.items() if ms == "join"}


def is_sent(h: History, ev: dict[str, Any]) -> bool:
    return (not ev["outlier"] and not ev["rejected"]
            and server(ev["sender"]) == h.server_name)


def event_destinations(h: History, ev: dict[str, Any]) -> set[str]:
    so = ev["stream_ordering"]
    before = joined_servers(h, ev["room_id"], so - 1)
    after = joined_servers(h, ev["room_id"], so)
    return (before | after) - {h.server_name}


def expected_destination_rooms(h: History) -> dict[tuple[str, str], int]:
    out: dict[tuple[str, str], int] = {}
    for ev in h.events:
        if not is_sent(h, ev):
            continue
        for d in event_destinations(h, ev):
            key = (d, ev["room_id"])
            out[key] = max(out.get(key, 0), ev["stream_ordering"])
    return out


def expected_diff(h: History) -> dict[tuple[str, str], str]:
    exp = expected_destination_rooms(h)
    act = {k: v for k, v in h.destination_rooms.items() if v <= h.high_water_mark}
    out: dict[tuple[str, str], str] = {}
    for k in exp.keys() | act.keys():
        e, a = exp.get(k), act.get(k)
        if e == a:
            continue
        if a is None:
            out[k] = "missing"
        elif e is None:
            out[k] = "stale"
        else:
            out[k] = "behind" if a < e else "ahead"
    return out


def expected_undelivered(h: History) -> dict[tuple[str, str], str]:
    by_id = {e["event_id"]: e for e in h.events}
    delivered: dict[tuple[str, str], int] = {}
    for t in h.txn_log:
        if t["status"] != "success":
            continue
        for eid in json.loads(t["pdu_event_ids"]):
            ev = by_id.get(eid)
            if ev is None:
                continue
            key = (t["destination"], ev["room_id"])
            delivered[key] = max(delivered.get(key, -1), ev["stream_ordering"])
    out: dict[tuple[str, str], str] = {}
    for key, so in expected_destination_rooms(h).items():
        if delivered.get(key, -1) >= so:
            continue
        pos = h.destinations.get(key[0])
        out[key] = "lost" if pos is not None and pos >= so else "pending"
    return out


def _percentile(values: list[float], q: float) -> float:
    xs = sorted(values)
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def expected_health(h: History, horizon_ms: int) -> dict[str, dict[str, Any]]:
    by_dest: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for t in h.txn_log:
        by_dest[t["destination"]].append(t)
    dests = set(by_dest) | set(h.destinations) | {d for d, _ in h.destination_rooms}
    out: dict[str, dict[str, Any]] = {}
    for d in dests:
        rows = sorted(by_dest.get(d, []), key=lambda t: (t["started_ts"], t["id"]))
        ok = [t for t in rows if t["status"] == "success"]
        backoff = 0
        streak_start: int | None = None
        for t in rows:
            if t["status"] != "success":
                if streak_start is None:
                    streak_start = t["started_ts"]
            elif streak_start is not None:
                backoff += t["started_ts"] - streak_start
                streak_start = None
        if streak_start is not None:
            backoff += horizon_ms - streak_start
        catchup = 0
        run: list[dict[str, Any]] = []
        for t in [*rows, None]:
            if t is not None and t["catchup"]:
                run.append(t)
                continue
            if run:
                catchup += max(r["started_ts"] + r["duration_ms"] for r in run) - run[0][
                    "started_ts"]
                run = []
        pos = h.destinations.get(d)
        sos = [so for (dd, _), so in h.destination_rooms.items() if dd == d]
        lag = max(0, max(sos) - (pos or 0)) if sos else 0
        lat = [float(t["duration_ms"]) for t in rows]
        out[d] = {
            "transactions": len(rows),
            "successes": len(ok),
            "failures": len(rows) - len(ok),
            "success_rate": len(ok) / len(rows) if rows else None,
            "latency_p50_ms": _percentile(lat, 0.5) if lat else None,
            "latency_p95_ms": _percentile(lat, 0.95) if lat else None,
            "latency_p99_ms": _percentile(lat, 0.99) if lat else None,
            "backoff_ms": backoff,
            "catchup_ms": catchup,
            "catchup_transactions": sum(1 for t in rows if t["catchup"]),
            "lag_stream_positions": lag,
            "outstanding_rooms": sum(1 for so in sos if so > (pos if pos is not None else -1)),
        }
    return out


# --- scenarios -----------------------------------------------------------------------------

def scenario() -> History:
    """Kicks, leaves, a rejoin, a ban, an invite, a partial-state room, a purged room,
    outliers and rejected events, remote senders, and a destination_rooms table with
    every kind of disagreement."""
    h = History()
    a, b, c = "@alice:us.example", "@bob:b.example", "@carol:c.example:8448"
    b2 = "@bert:b.example"
    # !r1: b and c join; c is kicked by alice; b leaves; b rejoins.
    h.member("!r1", a, "join")
    h.msg("!r1", a)                      # no remote server yet: no destination
    h.member("!r1", b, "join")           # remote join: b gets nothing until a local event
    h.member("!r1", c, "join")
    h.msg("!r1", a)                      # -> b, c
    h.member("!r1", c, "leave", sender=a)  # kick of c by alice: c still receives it
    h.msg("!r1", a)                      # -> b only
    h.member("!r1", b, "leave")          # b leaves (remote event, not sent)
    h.msg("!r1", a)                      # -> nobody
    h.member("!r1", b, "join")           # b rejoins
    h.msg("!r1", a)                      # -> b
    h.msg("!r1", b)                      # remote event: not sent
    h.msg("!r1", a, outlier=True)        # outlier: not sent
    h.msg("!r1", a, rejected=True)       # rejected: not sent
    # !r2: two users of b; one leaves, the server stays joined through the other.
    h.member("!r2", a, "join")
    h.member("!r2", b, "join")
    h.member("!r2", b2, "join")
    h.member("!r2", b, "leave")
    h.msg("!r2", a)                      # -> b (bert still there)
    h.member("!r2", b2, "ban", sender=a)  # ban by alice: b receives its ban
    h.msg("!r2", a)                      # -> nobody
    h.member("!r2", "@dave:d.example", "invite", sender=a)  # invite only: not joined
    h.msg("!r2", a)                      # -> nobody (d only invited)
    # !p: partial-state room, memberships as far as we know them.
    h.partial_state_rooms.add("!p")
    h.member("!p", c, "join")
    h.member("!p", a, "join")            # our join -> c
    h.msg("!p", a)                       # -> c
    # !gone: purged later; its destination_rooms row is stale.
    h.member("!gone", a, "join")
    h.member("!gone", b, "join")
    h.msg("!gone", a)
    h.purge("!gone")
    return h


def random_history(seed: int, *, rooms: int = 4, steps: int = 120) -> History:
    rng = random.Random(seed)
    h = History()
    servers = [OUR, "b.example", "c.example", "d.example:8448"]
    users = [f"@u{i}:{s}" for s in servers for i in range(2)]
    for r in range(rooms):
        h.member(f"!room{r}", f"@u0:{OUR}", "join")
    for _ in range(steps):
        room = f"!room{rng.randrange(rooms)}"
        user = rng.choice(users)
        x = rng.random()
        if x < 0.35:
            h.member(room, user, rng.choice(["join", "join", "leave", "ban", "invite", "knock"]),
                     sender=rng.choice([user, f"@u0:{OUR}", f"@u1:{OUR}"]))
        else:
            h.msg(room, rng.choice([user, f"@u0:{OUR}"]), outlier=rng.random() < 0.05,
                  rejected=rng.random() < 0.05)
    return h


def with_every_finding(h: History) -> History:
    """``h`` with ``destination_rooms`` rows right, behind, ahead, missing and stale,
    half the expected pairs sent, and half the destinations' positions past every event
    (so some undelivered pairs are lost, some pending)."""
    exp = expected_destination_rooms(h)
    h.destination_rooms = {}
    for i, (key, so) in enumerate(sorted(exp.items())):
        if i % 5 != 1:
            h.destination_rooms[key] = so + (i % 5 == 2) - 2 * (i % 5 == 3)
    h.destination_rooms[("stale.example", "!nowhere")] = 3
    by_dest: dict[str, list[str]] = {}
    for i, ((dest, _room), so) in enumerate(sorted(exp.items())):
        if i % 2 == 0:
            by_dest.setdefault(dest, []).append(f"$e{so}")
    for n, (dest, ids) in enumerate(sorted(by_dest.items())):
        h.send(dest, ids, started_ts=n, duration_ms=1)
    h.destinations = {dest: (max(exp.values()) if n % 2 else None)
                      for n, dest in enumerate(sorted({d for d, _ in exp}))}
    return h


# --- loading into PostgreSQL -----------------------------------------------------------

def load_pg(h: History, url: str) -> None:
    """Insert the history into a migrated, empty database."""
    with psycopg.connect(url.replace("+psycopg", "")) as conn, conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO events (stream_ordering, event_id, room_id, type, state_key, sender,"
            " origin_server_ts, outlier, rejected, json) VALUES (%(stream_ordering)s,"
            " %(event_id)s, %(room_id)s, %(type)s, %(state_key)s, %(sender)s, 0, %(outlier)s,"
            " %(rejected)s, '{}')", h.events)
        cur.executemany(
            "INSERT INTO room_memberships VALUES (%(event_id)s, %(event_stream_ordering)s,"
            " %(room_id)s, %(user_id)s, %(server_name)s, %(sender)s, %(membership)s)",
            h.memberships)
        cur.executemany("INSERT INTO partial_state_rooms VALUES (%s)",
                        [(r,) for r in h.partial_state_rooms])
        cur.executemany("INSERT INTO destination_rooms VALUES (%s, %s, %s)",
                        [(d, r, so) for (d, r), so in h.destination_rooms.items()])
        cur.executemany(
            "INSERT INTO destinations (destination, last_successful_stream_ordering)"
            " VALUES (%s, %s)", list(h.destinations.items()))
        cur.executemany(
            "INSERT INTO federation_transaction_log (txn_id, destination, pdu_count,"
            " edu_count, request_bytes, status, http_status, started_ts, duration_ms,"
            " catchup, max_stream_ordering, pdu_event_ids) VALUES (%(txn_id)s,"
            " %(destination)s, %(pdu_count)s, %(edu_count)s, %(request_bytes)s, %(status)s,"
            " %(http_status)s, %(started_ts)s, %(duration_ms)s, %(catchup)s,"
            " %(max_stream_ordering)s, %(pdu_event_ids)s)", h.txn_log)


def read_destination_rooms(url: str) -> dict[tuple[str, str], int]:
    with psycopg.connect(url.replace("+psycopg", "")) as conn:
        rows = conn.execute("SELECT destination, room_id, stream_ordering"
                            " FROM destination_rooms").fetchall()
    return {(d, r): so for d, r, so in rows}


def read_positions(url: str) -> dict[str, int | None]:
    with psycopg.connect(url.replace("+psycopg", "")) as conn:
        rows = conn.execute("SELECT destination, last_successful_stream_ordering"
                            " FROM destinations").fetchall()
    return dict(rows)


def frames(spark: Any, h: History) -> DataFrameSource:
    """The history's tables as DataFrames with the database's column types."""
    ev = spark.createDataFrame(
        [(e["stream_ordering"], e["event_id"], e["room_id"], e["sender"], e["outlier"],
          e["rejected"]) for e in h.events],
        "stream_ordering long, event_id string, room_id string, sender string, "
        "outlier boolean, rejected boolean")
    mem = spark.createDataFrame(
        [(m["event_stream_ordering"], m["room_id"], m["user_id"], m["server_name"],
          m["membership"]) for m in h.memberships],
        "event_stream_ordering long, room_id string, user_id string, server_name string, "
        "membership string")
    dr = spark.createDataFrame(
        [(d, r, so) for (d, r), so in h.destination_rooms.items()],
        "destination string, room_id string, stream_ordering long")
    dests = spark.createDataFrame(list(h.destinations.items()),
                                  "destination string, last_successful_stream_ordering long")
    log = spark.createDataFrame(
        [(t["id"], t["destination"], t["status"], t["http_status"], t["started_ts"],
          t["duration_ms"], t["catchup"], t["pdu_count"], t["max_stream_ordering"],
          t["pdu_event_ids"]) for t in h.txn_log],
        "id int, destination string, status string, http_status int, started_ts long, "
        "duration_ms int, catchup boolean, pdu_count int, max_stream_ordering long, "
        "pdu_event_ids string")
    partial = spark.createDataFrame([(r,) for r in h.partial_state_rooms], "room_id string")
    return DataFrameSource({
        "events": ev, "room_memberships": mem, "destination_rooms": dr,
        "destinations": dests, "federation_transaction_log": log,
        "partial_state_rooms": partial,
    }, h.high_water_mark)
