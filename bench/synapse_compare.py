"""Synapse's own federation sender against ours, on one real Synapse deployment.

For each sender (``--senders``, default ``synapse``; ``ours`` once the Synapse backend
runs): a fresh Synapse 1.163 main on PostgreSQL and Redis (``testing/synapse_deployment``),
``--dests`` fake remote servers (``testing/synapse_peer``) that join ``--rooms`` rooms
over federation, the sender started as instance ``fed1``, one warm-up message per room
delivered everywhere; then a spike of ``--events`` messages sent through the client API
by ``--concurrency`` threads, round-robin over the rooms, and the run waits until every
destination has every message (or ``--timeout-s``). ``--mode live`` keeps the sender
running (it keeps up with main, so this measures latency); ``--mode backlog`` stops it
for the spike and starts it afterwards (a restart or handover: batching and catch-up),
and then times count from the sender's start instead of each message's persistence.
Synapse's own sender reads a backlog only when a new event arrives (its event loop is
poked by replication, not by its start), so backlog mode sends one more message right
after the start (``--no-poke`` leaves it out, and Synapse's sender then sends nothing).

Reported per sender:

* ``drain_s``: from the last message persisted (its client-API call returned; in backlog
  mode, the sender's start) to the last delivery of any spike message to any
  destination;
* ``delay_p50_s`` / ``delay_p99_s``: per (message, destination), persisted to received;
* ``pdus_per_txn``: spike PDUs over the transactions that carried them;
* ``cpu_s_per_pdu``: user+system CPU of the sender process from the spike (backlog: from
  when it was ready, start-up excluded) to the last delivery, over the spike PDUs
  delivered (so per destination-delivery);
* ``duplicates``: deliveries of a message to a destination beyond the first (a retried
  transaction id is not counted: receivers deduplicate those);
* ``missing``: (message, destination) pairs not delivered by the deadline.

The peers, the client-API threads and Synapse all share this machine's cores: the
figures compare the senders under the same conditions, they are not absolute.

    .venv/bin/python bench/synapse_compare.py [--senders synapse ours] [--dests 10] \
        [--rooms 1] [--events 200] [--concurrency 4] [--mode live|backlog] [--json out.json] \
        [--busy-interval-s S] [--event-loop asyncio|uvloop] [--event-persisters N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
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


@dataclass
class Result:
    sender: str
    mode: str
    dests: int
    rooms: int
    events: int
    event_persisters: int = 0
    send_s: float = 0.0
    drain_s: float | None = None
    delay_p50_s: float | None = None
    delay_p99_s: float | None = None
    pdus_per_txn: float | None = None
    cpu_s_per_pdu: float | None = None
    duplicates: int = 0
    missing: int = 0
    error: str | None = None


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


class Sender:
    """Starts and stops one sender implementation as instance ``fed1``."""

    def __init__(self, kind: str, d: SynapseDeployment, workdir: Path,
                 settings: dict[str, Any] | None = None,
                 worker_args: tuple[str, ...] = ()) -> None:
        self.kind, self.d = kind, d
        self.ours = (OurSender(d, workdir / "ours", settings, worker_args)
                     if kind == "ours" else None)

    def start(self) -> int:
        if self.ours is not None:
            self.ours.start()
            assert self.ours.pid is not None
            return self.ours.pid
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


def wait_delivered(
    net: PeerNetwork, peers: list[FederationPeer], ids: set[str], timeout_s: float, s: Sender
) -> None:
    deadline = time.monotonic() + timeout_s

    def done() -> bool:  # runs on every recording: the cheap size test first
        return all(len(p.event_ids_seen) >= len(ids) and ids <= p.event_ids_seen
                   for p in peers)

    while True:
        s.check_alive()
        try:
            net.wait_for(done, 1.0)
            return
        except TimeoutError:
            if time.monotonic() > deadline:
                return  # reported as missing


def spike(d: SynapseDeployment, users: list[tuple[User, str]], n: int, threads: int
          ) -> dict[str, float]:
    """Send ``n`` messages; event id -> monotonic time its client-API call returned."""

    def one(i: int) -> tuple[str, float]:
        user, room = users[i % len(users)]
        eid = d.client.send_message(user, room, f"spike {i}")
        return eid, time.monotonic()

    with ThreadPoolExecutor(threads) as pool:
        return dict(pool.map(one, range(n)))


def measure(peers: list[FederationPeer], persisted: dict[str, float], r: Result) -> None:
    delays, last = [], 0.0
    pdus = txns = 0
    for p in peers:
        seen: set[str] = set()
        for t in p.transactions:
            mine = [e for e in t.event_ids if e in persisted]
            if mine:
                txns += 1
                pdus += len(mine)
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


def run_one(kind: str, a: argparse.Namespace, cluster: PostgresCluster, root: Path, index: int
            ) -> Result:
    # A Redis of its own: Synapse's external cache keys (cache_v1:get_joined_hosts:<state
    # group>) are not per server, and state group ids repeat across fresh databases.
    with ephemeral_redis() as redis:
        return _run_one(kind, a, cluster, RedisAddress(redis.host, redis.port), root, index)


def _run_one(kind: str, a: argparse.Namespace, cluster: PostgresCluster, redis: RedisAddress,
             root: Path, index: int) -> Result:
    r = Result(kind, a.mode, a.dests, a.rooms, a.events, a.event_persisters)
    ca = LoopbackCA.create(root / f"ca{index}")
    d = create_deployment(root / f"hs{index}", ca=ca, cluster=cluster,
                          database_name=f"synapse_{index}", redis=redis,
                          event_persisters=a.event_persisters)
    d.start()
    queue = {k: v for k, v in (("coalesce_hold_s", a.coalesce_hold_s),
                               ("busy_txn_interval_s", a.busy_interval_s)) if v is not None}
    ours = {"queue": queue} if queue else None
    loop = ("--event-loop", a.event_loop) if a.event_loop else ()
    sender = Sender(kind, d, root / f"hs{index}", ours, loop)
    try:
        with PeerNetwork(ca, root / f"peers{index}", reuse_event_ids=True,
                         keep_pdus=False) as net:
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
            pid = sender.start()
            warm = {d.client.send_message(u, room, "warm-up") for u, room in users}
            wait_delivered(net, peers, warm, a.timeout_s, sender)
            cpu0 = cpu_s(pid)
            if a.mode == "backlog":
                sender.stop()  # the spike is persisted while no sender runs
            t0 = time.monotonic()
            persisted = spike(d, users, a.events, a.concurrency)
            r.send_s = round(time.monotonic() - t0, 3)
            if a.mode == "backlog":
                pid = sender.start()
                cpu0 = cpu_s(pid)
                started = time.monotonic()
                persisted = dict.fromkeys(persisted, started)  # delays count from the start
                if a.poke:
                    # Synapse's worker reads the backlog only when a new event pokes it.
                    user, room = users[0]
                    persisted[d.client.send_message(user, room, "poke")] = started
            wait_delivered(net, peers, set(persisted), a.timeout_s, sender)
            cpu = cpu_s(pid) - cpu0
            with net.locked():
                measure(peers, persisted, r)
            delivered = a.events * a.dests - r.missing
            r.cpu_s_per_pdu = round(cpu / delivered, 9) if delivered else None
    except (RuntimeError, TimeoutError, OSError, OurSenderError) as e:
        r.error = str(e).splitlines()[0][:300]
    finally:
        sender.stop()
        d.stop()
    return r


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--senders", nargs="+", default=["synapse"], choices=["synapse", "ours"])
    p.add_argument("--dests", type=int, default=10)
    p.add_argument("--rooms", type=int, default=1)
    p.add_argument("--events", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=4)
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
    p.add_argument("--busy-interval-s", type=float,
                   help="our worker's queue.busy_txn_interval_s (default: the worker's own)")
    p.add_argument("--event-loop", choices=["asyncio", "uvloop"],
                   help="our worker's --event-loop (default: the worker's own)")
    a = p.parse_args(argv)
    results: list[Result] = []
    with (
        ephemeral_cluster() as cluster,
        tempfile.TemporaryDirectory(prefix="synapse-compare-") as tmp,
    ):
        for i, kind in enumerate(a.senders):
            results.append(run_one(kind, a, cluster, Path(tmp), i))
            print(json.dumps(asdict(results[-1])), flush=True)
    rows: list[dict[str, Any]] = [asdict(r) for r in results]
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r.error is None and r.missing == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
