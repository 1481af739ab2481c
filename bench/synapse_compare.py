"""Synapse's own federation sender against ours, on one real Synapse deployment.

One deployment per load (``--loads``, default ``spike light``): a fresh Synapse 1.163
main on PostgreSQL and Redis (``testing/synapse_deployment``) with Synapse's *default*
logging configuration (its generated log config: INFO lines buffered ten at a time and
flushed every 5 s, not written one by one), ``--dests`` fake remote servers
(``testing/synapse_peer``) joined to ``--rooms`` rooms over federation. On it the senders
(``--senders``, default ``ours synapse``) take turns as instance ``fed1``, interleaved:
ours, Synapse's, ours, Synapse's... ``--samples`` times each (a hand-over each time, as
an operator's: both keep their positions in Synapse's tables). A sample starts the
sender, sends one warm-up message per room and waits until every destination has it,
then measures:

* ``spike``: ``--events`` messages sent through the client API by ``--concurrency``
  threads, round-robin over the rooms, as fast as main persists them;
* ``light``: a fixed rate, ``--rate`` messages a second for ``--duration-s`` seconds
  (``--rate 1 --duration-s 60``: one chat message a second to every destination);

and waits until every destination has every message (or ``--timeout-s``), then stops
the sender. ``--mode backlog`` (spike only) stops the sender for the spike and starts it
afterwards, and times then count from its start (Synapse's sender reads a backlog only
when a new event arrives, so one more message is sent right after the start;
``--no-poke`` leaves it out).

Reported per sample:

* ``drain_s``: from the last message persisted (its client-API call returned) to the
  last delivery of any of the sample's messages to any destination;
* ``delay_p50_s`` / ``delay_p99_s``: per (message, destination), persisted to received;
* ``pdus_per_txn``: the sample's PDUs over the transactions that carried them;
* ``txn_interval_p50_s``: the median time between one destination's consecutive
  transactions of the sample (as received). While messages keep coming (the spike) a
  destination sends its next transaction as soon as the one in flight is answered, so
  this is the round trip a message waits behind; at light load, the messages' spacing;
* ``cpu_ms_per_pdu``: user+system CPU of the sender process from the first message
  (backlog: from its start, start-up excluded) to the last delivery, over the PDUs
  delivered (per destination-delivery);
* ``db_cpu_ms_per_pdu``: the same for the sender's PostgreSQL backends (found in
  ``pg_stat_activity`` by ``application_name``, which the sender's libpq takes from
  ``PGAPPNAME``; ours also names its instance-lock connection ``federation-sender ...``;
  ``/proc/PID/stat`` read at the start, about once a second, and at the end);
  ``total_cpu_ms_per_pdu`` is their sum (what the sender costs the machine: Synapse's
  main and the event persisters do the same work for either sender and are not
  counted);
* ``harness_cores`` / ``main_cores``: CPU seconds per second of the same window of this
  process (the fake remote servers and the client-API threads) and of Synapse's main,
  to tell a saturated machine or harness from a slow sender;
* ``duplicates``: deliveries of a message to a destination beyond the first (a retried
  transaction id is not counted: receivers deduplicate those);
* ``missing``: (message, destination) pairs not delivered by the deadline;
* ``reset_destinations``: destinations the previous sample's sender left behind (its
  ``missing``, or in backoff), which this sample found and marked caught up before it
  started the sender (below).

A sample begins with every destination caught up. A sender that did not deliver its
sample by the deadline (Synapse's own, at 4,500 messages in a fast hour: it falls
minutes behind) leaves destinations behind in Synapse's tables, and the next sender
would start by catching them up: its sample would measure the other's leftovers. So
before each sample, a destination with a ``destination_rooms`` row past its
``last_successful_stream_ordering``, or with a retry interval, is given that row's
stream ordering and its retry state is cleared, as if delivered; what it stood for is
already counted in the previous sample's ``missing``.

The summary gives, per load and sender, the median and the range (min-max) over the
samples, and the ratios Synapse / ours of the medians. The peers, the client-API
threads and Synapse share this machine's cores: the figures compare the senders under
the same conditions, they are not absolute.

    .venv/bin/python bench/synapse_compare.py [--loads spike light] \
        [--senders ours synapse] [--samples 3] [--dests 10] [--rooms 1] \
        [--events 200] [--concurrency 4] [--rate 1] [--duration-s 60] \
        [--mode live|backlog] [--json out.json] [--coalesce-hold-s S] \
        [--event-loop asyncio|uvloop] [--event-persisters N] \
        [--senders ours base --base-source DIR]

``--senders ours base --base-source DIR`` races two versions of ours (``DIR`` holding
another checkout's ``federation_sender`` package) the same way; ``--senders ours
unfiltered`` races ours against itself with ``queue.send_time_filter: false`` (the
send-time read of erasures and redactions off: its cost per transaction). Per sample
``cpu_ms_per_txn`` and ``total_cpu_ms_per_txn`` are the CPU figures per transaction
carrying the sample's PDUs, and ``erased_users_scans`` counts the scans of
``erased_users`` during the sample (``pg_stat_user_tables``; one per send-time read,
gathered reads counting once; read 11 s after the last delivery, by when PostgreSQL has
published an idle backend's statistics).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from federation_sender.testing.certs import LoopbackCA
from federation_sender.testing.our_sender import OurSender, OurSenderError
from federation_sender.testing.postgres import PostgresCluster, ephemeral_cluster
from federation_sender.testing.redis_server import ephemeral_redis
from federation_sender.testing.synapse_client import User
from federation_sender.testing.synapse_config import RedisAddress
from federation_sender.testing.synapse_deployment import (
    SynapseDeployment,
    create_deployment,
    event_writer,
)
from federation_sender.testing.synapse_peer import FederationPeer, PeerNetwork

CLK_TCK = os.sysconf("SC_CLK_TCK")
APP_NAMES = {"ours": "bench-ours", "synapse": "bench-synapse", "base": "bench-base",
             "unfiltered": "bench-unfiltered"}
"""``application_name`` of each sender's PostgreSQL connections (through PGAPPNAME)."""


@dataclass
class Result:
    sender: str
    load: str
    sample: int
    mode: str
    dests: int
    rooms: int
    events: int
    rate: float | None = None
    event_persisters: int = 0
    send_s: float = 0.0
    drain_s: float | None = None
    delay_p50_s: float | None = None
    delay_p99_s: float | None = None
    pdus_per_txn: float | None = None
    txn_interval_p50_s: float | None = None
    cpu_ms_per_pdu: float | None = None
    db_cpu_ms_per_pdu: float | None = None
    total_cpu_ms_per_pdu: float | None = None
    cpu_ms_per_txn: float | None = None
    total_cpu_ms_per_txn: float | None = None
    db_backends: int = 0
    harness_cores: float | None = None
    main_cores: float | None = None
    duplicates: int = 0
    missing: int = 0
    reset_destinations: int = 0
    transactions: int = 0
    erased_users_scans: int | None = None
    error: str | None = None


RESET_BEHIND = """
WITH done AS (UPDATE destinations d
SET last_successful_stream_ordering = GREATEST(COALESCE(last_successful_stream_ordering, 0),
        (SELECT COALESCE(MAX(dr.stream_ordering), 0) FROM destination_rooms dr
         WHERE dr.destination = d.destination)),
    retry_last_ts = 0, retry_interval = 0, failure_ts = NULL
WHERE retry_interval > 0 OR EXISTS (
    SELECT 1 FROM destination_rooms dr WHERE dr.destination = d.destination
    AND dr.stream_ordering > COALESCE(d.last_successful_stream_ordering, -1))
RETURNING destination)
SELECT count(*) FROM done
"""


ERASED_USERS_SCANS = ("SELECT coalesce(seq_scan, 0) + coalesce(idx_scan, 0) "
                      "FROM pg_stat_user_tables WHERE relname = 'erased_users'")


def erased_users_scans(d: SynapseDeployment) -> int:
    out = d.sql(ERASED_USERS_SCANS).strip()
    return int(out) if out else 0


def reset_behind(d: SynapseDeployment) -> int:
    """Mark every destination left behind (or in backoff) caught up; how many were."""
    return int(d.sql(RESET_BEHIND).strip())


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def synapse_default_log_config(log_file: Path) -> str:
    """Synapse 1.163's generated log configuration (``synapse/config/logger.py``,
    DEFAULT_LOG_CONFIG) for ``log_file``: INFO, lines buffered in memory (ten, or 5 s)."""
    return f"""version: 1
formatters:
  precise:
    format: '%(asctime)s - %(name)s - %(lineno)d - %(levelname)s - %(request)s - %(message)s'
handlers:
  file:
    class: logging.handlers.TimedRotatingFileHandler
    formatter: precise
    filename: {log_file}
    when: midnight
    backupCount: 3
    encoding: utf8
  buffer:
    class: synapse.logging.handlers.PeriodicallyFlushingMemoryHandler
    target: file
    capacity: 10
    flushLevel: 30
    period: 5
loggers:
  synapse.storage.SQL:
    level: INFO
root:
  level: INFO
  handlers: [buffer]
disable_existing_loggers: false
"""


class BackendCpu:
    """CPU of the PostgreSQL backends whose ``application_name`` is the sender's: each
    backend's CPU at the first reading (0 for one that appeared later) and at its last,
    polled by :meth:`poll` (a backend that exits between polls loses what it did since
    the last one; both senders keep pooled connections)."""

    def __init__(self, d: SynapseDeployment, kind: str) -> None:
        self.d = d
        where = f"application_name = '{APP_NAMES[kind]}'"
        if kind != "synapse":  # (one sender runs at a time)
            where += " OR application_name LIKE 'federation-sender %'"
        self.query = f"SELECT pid FROM pg_stat_activity WHERE {where}"
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.started = False

    def poll(self) -> None:
        out = self.d.sql(self.query)
        for line in out.split():
            pid = int(line)
            try:
                now = cpu_s(pid)
            except (OSError, ValueError):
                continue
            self.last[pid] = now
            if pid not in self.first:
                self.first[pid] = now if not self.started else 0.0
        self.started = True

    def start(self) -> None:
        self.first.clear()
        self.last.clear()
        self.started = False
        self.poll()

    def total_s(self) -> float:
        self.poll()
        return sum(self.last[p] - self.first[p] for p in self.last)


class Sender:
    """Starts and stops one sender implementation as instance ``fed1``, its database
    connections named ``APP_NAMES[kind]``."""

    def __init__(self, kind: str, d: SynapseDeployment, workdir: Path,
                 settings: dict[str, Any] | None = None,
                 worker_args: tuple[str, ...] = (), base_source: Path | None = None) -> None:
        """``kind`` "base": our worker from ``base_source`` (another checkout's
        package, e.g. ``git archive main``), to compare two versions of ours;
        "unfiltered": ours without the send-time filter."""
        self.kind, self.d = kind, d
        if kind == "unfiltered":
            settings = dict(settings or {})
            settings["queue"] = {**settings.get("queue", {}), "send_time_filter": False}
        self.ours = (OurSender(d, workdir / kind, settings, worker_args,
                               base_source if kind == "base" else None)
                     if kind != "synapse" else None)
        if self.ours is not None:
            self.ours.env["PGAPPNAME"] = APP_NAMES[kind]

    def start(self) -> int:
        if self.ours is not None:
            self.ours.start()
            assert self.ours.pid is not None
            return self.ours.pid
        with _environ(PGAPPNAME=APP_NAMES["synapse"]):
            self.d.start_federation_sender()
        assert self.d.sender is not None and self.d.sender.pid is not None
        return self.d.sender.pid

    def check_alive(self) -> None:
        if self.ours is not None and not self.ours.running:
            raise RuntimeError(f"our worker exited: {self.ours.log_tail(1)}")

    def stop(self) -> None:
        if self.ours is not None:
            self.ours.stop()
        else:
            self.d.stop_federation_sender()


@contextmanager
def _environ(**values: str) -> Iterator[None]:
    """Set environment variables for the children started within (Synapse's processes
    inherit this process's environment)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def wait_delivered(
    net: PeerNetwork, peers: list[FederationPeer], ids: set[str], timeout_s: float, s: Sender,
    tick: Callable[[], None] = lambda: None,
) -> None:
    deadline = time.monotonic() + timeout_s

    def done() -> bool:  # runs on every recording: the cheap size test first
        return all(len(p.event_ids_seen) >= len(ids) and ids <= p.event_ids_seen
                   for p in peers)

    while True:
        s.check_alive()
        tick()
        try:
            net.wait_for(done, 1.0)
            return
        except TimeoutError:
            if time.monotonic() > deadline:
                return  # reported as missing


Rooms = list[tuple[User, str]]


def spike(d: SynapseDeployment, users: Rooms, n: int, threads: int, tag: str
          ) -> dict[str, float]:
    """Send ``n`` messages; event id -> monotonic time its client-API call returned."""

    def one(i: int) -> tuple[str, float]:
        user, room = users[i % len(users)]
        eid = d.client.send_message(user, room, f"{tag} {i}")
        return eid, time.monotonic()

    with ThreadPoolExecutor(threads) as pool:
        return dict(pool.map(one, range(n)))


def paced(d: SynapseDeployment, users: Rooms, rate: float, duration_s: float, tag: str,
          tick: Callable[[], None]) -> dict[str, float]:
    """Send ``rate`` messages a second for ``duration_s`` (each at its slot, from up to
    eight threads so that a slow call does not delay the next); as :func:`spike`."""
    n = max(1, round(rate * duration_s))
    t0 = time.monotonic() + 0.2

    def one(i: int) -> tuple[str, float]:
        wait = t0 + i / rate - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        user, room = users[i % len(users)]
        eid = d.client.send_message(user, room, f"{tag} {i}")
        return eid, time.monotonic()

    out: dict[str, float] = {}
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(n)]
        for f in futures:
            while True:
                try:
                    eid, at = f.result(timeout=1.0)
                    break
                except TimeoutError:
                    tick()
            out[eid] = at
    return out


def measure(peers: list[FederationPeer], persisted: dict[str, float], r: Result) -> None:
    delays, last = [], 0.0
    intervals: list[float] = []
    pdus = txns = 0
    for p in peers:
        seen: set[str] = set()
        previous: float | None = None
        for t in p.transactions:
            mine = [e for e in t.event_ids if e in persisted]
            if mine:
                txns += 1
                pdus += len(mine)
                if previous is not None:
                    intervals.append(t.received_s - previous)
                previous = t.received_s
            for eid in mine:
                if eid in seen:
                    r.duplicates += 1
                    continue
                seen.add(eid)
                delays.append(t.received_s - persisted[eid])
                last = max(last, t.received_s)
        r.missing += len(persisted.keys() - seen)
    if delays:
        q = statistics.quantiles(delays, n=100, method="inclusive")
        r.delay_p50_s, r.delay_p99_s = round(q[49], 3), round(q[98], 3)
        r.drain_s = round(last - max(persisted.values()), 3)
    r.pdus_per_txn = round(pdus / txns, 2) if txns else None
    r.transactions = txns
    if intervals:
        r.txn_interval_p50_s = round(statistics.median(intervals), 3)


class _Around:
    """CPU of this process (the peers, the client-API threads) and of Synapse's main
    from now on, as cores used on average."""

    def __init__(self, d: SynapseDeployment) -> None:
        self.main = d.main.pid
        self.t0 = time.monotonic()
        self.own0 = sum(os.times()[:2])
        self.main0 = cpu_s(self.main) if self.main is not None else 0.0

    def cores(self) -> tuple[float, float | None]:
        wall = max(1e-9, time.monotonic() - self.t0)
        own = (sum(os.times()[:2]) - self.own0) / wall
        main = None if self.main is None else (cpu_s(self.main) - self.main0) / wall
        return round(own, 2), None if main is None else round(main, 2)


@dataclass
class Scene:
    d: SynapseDeployment
    net: PeerNetwork
    peers: list[FederationPeer]
    users: Rooms


def make_scene(d: SynapseDeployment, net: PeerNetwork, a: argparse.Namespace) -> Scene:
    peers = net.add_peers(a.dests)
    users = []
    writers = d.event_writers
    per = dict.fromkeys(writers, 0)
    for i in range(a.rooms):
        user = d.client.register(f"bench{i}")
        while True:  # spread the rooms evenly over the event persisters
            room = d.client.create_room(user)
            w = event_writer(room, writers)
            if per[w] == min(per.values()):
                per[w] += 1
                break
        for p in peers:
            net.join(p, room, d.server_name)
        users.append((user, room))
    return Scene(d, net, peers, users)


def run_sample(scene: Scene, sender: Sender, load: str, sample: int, a: argparse.Namespace
               ) -> Result:
    d, net, peers, users = scene.d, scene.net, scene.peers, scene.users
    r = Result(sender.kind, load, sample, a.mode if load == "spike" else "live", a.dests,
               a.rooms, 0, a.rate if load == "light" else None, a.event_persisters)
    db = BackendCpu(d, sender.kind)
    tag = f"{load}{sample}{sender.kind}"
    try:
        r.reset_destinations = reset_behind(d)
        pid = sender.start()
        warm = {d.client.send_message(u, room, f"warm-up {tag}") for u, room in users}
        wait_delivered(net, peers, warm, a.timeout_s, sender)
        backlog = load == "spike" and a.mode == "backlog"
        if backlog:
            sender.stop()  # the spike is persisted while no sender runs
        cpu0 = cpu_s(pid)
        db.start()
        scans0 = erased_users_scans(d)
        t0 = time.monotonic()
        around = _Around(d)
        if load == "spike":
            persisted = spike(d, users, a.events, a.concurrency, tag)
        else:
            persisted = paced(d, users, a.rate, a.duration_s, tag, db.poll)
        r.events = len(persisted)
        r.send_s = round(time.monotonic() - t0, 3)
        if backlog:
            pid = sender.start()
            cpu0 = cpu_s(pid)
            db.start()
            started = time.monotonic()
            persisted = dict.fromkeys(persisted, started)  # delays count from the start
            if a.poke:
                # Synapse's worker reads the backlog only when a new event pokes it.
                user, room = users[0]
                persisted[d.client.send_message(user, room, "poke")] = started
        wait_delivered(net, peers, set(persisted), a.timeout_s, sender, db.poll)
        cpu = cpu_s(pid) - cpu0
        db_cpu = db.total_s()
        # An idle backend publishes its table statistics within 10 s (PostgreSQL 15).
        time.sleep(11.0)
        r.erased_users_scans = erased_users_scans(d) - scans0
        r.harness_cores, r.main_cores = around.cores()
        r.db_backends = len(db.last)
        with net.locked():
            measure(peers, persisted, r)
        delivered = len(persisted) * a.dests - r.missing
        if delivered:
            r.cpu_ms_per_pdu = round(1000 * cpu / delivered, 4)
            r.db_cpu_ms_per_pdu = round(1000 * db_cpu / delivered, 4)
            r.total_cpu_ms_per_pdu = round(1000 * (cpu + db_cpu) / delivered, 4)
        if r.transactions:
            r.cpu_ms_per_txn = round(1000 * cpu / r.transactions, 4)
            r.total_cpu_ms_per_txn = round(1000 * (cpu + db_cpu) / r.transactions, 4)
    except (RuntimeError, TimeoutError, OSError, OurSenderError) as e:
        r.error = str(e).splitlines()[0][:300]
    finally:
        sender.stop()
    return r


def run_load(load: str, a: argparse.Namespace, cluster: PostgresCluster, root: Path,
             index: int, report: Callable[[Result], None]) -> None:
    # A Redis of its own: Synapse's external cache keys (cache_v1:get_joined_hosts:<state
    # group>) are not per server, and state group ids repeat across fresh databases.
    with ephemeral_redis() as redis_server:
        redis = RedisAddress(redis_server.host, redis_server.port)
        ca = LoopbackCA.create(root / f"ca{index}")
        d = create_deployment(root / f"hs{index}", ca=ca, cluster=cluster,
                              database_name=f"synapse_{index}", redis=redis,
                              event_persisters=a.event_persisters)
        for name in ["main", *(["worker"] if d.sender is not None else []),
                     *(p.name for p in d.persisters)]:
            log = d.sender.log_path if name == "worker" and d.sender else (
                root / f"hs{index}" / f"{name}.log")
            (root / f"hs{index}" / f"{name}.log.yaml").write_text(
                synapse_default_log_config(log))
        d.start()
        queue = {k: v for k, v in (("coalesce_hold_s", a.coalesce_hold_s),) if v is not None}
        loop = ("--event-loop", a.event_loop) if a.event_loop else ()
        senders = [Sender(k, d, root / f"hs{index}", {"queue": queue} if queue else None, loop,
                          a.base_source) for k in a.senders]
        try:
            with PeerNetwork(ca, root / f"peers{index}", reuse_event_ids=True,
                             keep_pdus=False) as net:
                scene = make_scene(d, net, a)
                for sample in range(a.samples):
                    for sender in senders:  # interleaved: ours, Synapse's, ours, ...
                        report(run_sample(scene, sender, load, sample, a))
        finally:
            for sender in senders:
                sender.stop()
            d.stop()


SUMMARY_KEYS = ("delay_p50_s", "delay_p99_s", "drain_s", "pdus_per_txn", "txn_interval_p50_s",
                "cpu_ms_per_pdu", "db_cpu_ms_per_pdu", "total_cpu_ms_per_pdu",
                "cpu_ms_per_txn", "total_cpu_ms_per_txn")


def summarize(results: list[Result]) -> list[dict[str, Any]]:
    """Per load and sender: median and [min, max] of each figure over the samples, the
    samples' duplicates and missing; and per load the Synapse / ours ratios of the
    medians."""
    rows: list[dict[str, Any]] = []
    for load in dict.fromkeys(r.load for r in results):
        medians: dict[str, dict[str, float]] = {}
        for kind in dict.fromkeys(r.sender for r in results):
            rs = [r for r in results if r.load == load and r.sender == kind]
            row: dict[str, Any] = {"load": load, "sender": kind, "samples": len(rs),
                                   "errors": sum(r.error is not None for r in rs),
                                   "duplicates": sum(r.duplicates for r in rs),
                                   "missing": sum(r.missing for r in rs),
                                   "reset_destinations": sum(r.reset_destinations for r in rs)}
            for key in SUMMARY_KEYS:
                vals = [v for r in rs if (v := getattr(r, key)) is not None]
                if vals:
                    row[key] = [statistics.median(vals), min(vals), max(vals)]
                    medians.setdefault(kind, {})[key] = statistics.median(vals)
            rows.append(row)
        ours = medians.get("ours")
        for other in ("synapse", "base", "unfiltered"):
            theirs = medians.get(other)
            if ours and theirs:
                rows.append({"load": load, f"ratio_{other}_over_ours": {
                    k: round(theirs[k] / ours[k], 2) for k in SUMMARY_KEYS
                    if ours.get(k) and k in theirs}})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--loads", nargs="+", default=["spike", "light"],
                   choices=["spike", "light"])
    p.add_argument("--senders", nargs="+", default=["ours", "synapse"],
                   choices=["synapse", "ours", "base", "unfiltered"])
    p.add_argument("--base-source", type=Path,
                   help="sender 'base': our worker from this directory's federation_sender "
                        "package (e.g. git archive main federation_sender | tar -x -C DIR)")
    p.add_argument("--samples", type=int, default=3, help="samples per sender and load")
    p.add_argument("--dests", type=int, default=10)
    p.add_argument("--rooms", type=int, default=1)
    p.add_argument("--events", type=int, default=200, help="spike: messages")
    p.add_argument("--concurrency", type=int, default=4, help="spike: client-API threads")
    p.add_argument("--rate", type=float, default=1.0, help="light: messages a second")
    p.add_argument("--duration-s", type=float, default=60.0, help="light: seconds")
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--mode", choices=["live", "backlog"], default="live")
    p.add_argument(
        "--no-poke", dest="poke", action="store_false",
        help="backlog mode: do not send one new message after the sender starts",
    )  # fmt: skip
    p.add_argument("--event-persisters", type=int, default=0,
                   help="generic workers persisting the events (stream_writers.events) "
                        "instead of main; rooms are spread evenly over them")
    p.add_argument("--json", type=Path)
    p.add_argument("--coalesce-hold-s", type=float,
                   help="our worker's queue.coalesce_hold_s (default: the worker's own)")
    p.add_argument("--event-loop", choices=["asyncio", "uvloop"],
                   help="our worker's --event-loop (default: the worker's own)")
    a = p.parse_args(argv)
    results: list[Result] = []

    def report(r: Result) -> None:
        results.append(r)
        print(json.dumps(asdict(r)), flush=True)

    with (
        ephemeral_cluster() as cluster,
        tempfile.TemporaryDirectory(prefix="synapse-compare-") as tmp,
    ):
        for i, load in enumerate(a.loads):
            run_load(load, a, cluster, Path(tmp), i, report)
    summary = summarize(results)
    for row in summary:
        print(json.dumps(row), flush=True)
    if a.json:
        a.json.write_text(json.dumps({"samples": [asdict(r) for r in results],
                                      "summary": summary, "argv": sys.argv[1:]}, indent=1))
    return 0 if all(r.error is None and r.missing == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
