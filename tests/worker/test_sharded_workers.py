"""Two worker processes share the destinations by dynamic sharding (heartbeats,
rendezvous hashing, fenced leases) on one PostgreSQL: no destination is served by both,
and when one leaves, the other takes its destinations over without a restart."""

from __future__ import annotations

import signal
from pathlib import Path

import yaml
from worker_harness import (
    REMOTES,
    MainProcess,
    start_worker,
    stop,
    wait_ready,
    write_config,
)

from federation_sender.testing.fake_homeserver import FakeHomeserver
from federation_sender.testing.waiting import wait_until

ROOM = "!shared:local.test"
DESTS = [*REMOTES, *(f"extra{i}.test" for i in range(1, 8))]


def _sharded_config(
    tmp_path: Path, name: str, pg_url: str, port: int, url: str
) -> tuple[Path, int]:
    sub = tmp_path / name
    sub.mkdir()
    path, admin_port = write_config(sub, pg_url, port, url)
    cfg = yaml.safe_load(path.read_text())
    cfg["instance_name"] = name
    host_port = url.split("//", 1)[1]
    cfg["federation"]["destination_overrides"] = {d: host_port for d in DESTS}
    cfg["sharding"] = {"mode": "dynamic", "heartbeat_interval_s": 0.5, "lease_s": 3.0}
    cfg["queue"]["wakeup_interval_s"] = 0.5
    path.write_text(yaml.safe_dump(cfg))
    return path, admin_port


def _log(worker_dir: Path) -> str:
    log = worker_dir / "worker.log"
    return log.read_text(errors="replace") if log.exists() else ""


def _senders(hs: FakeHomeserver, dest: str) -> set[str]:
    """Which worker processes sent to ``dest``: txn ids start with a per-process base."""
    return {t.txn_id.split(".", 1)[0] for t in hs.accepted(dest)}


async def test_two_workers_share_destinations_and_hand_over(
    tmp_path: Path, pg_url: str, main_process: MainProcess, remotes: FakeHomeserver
) -> None:
    mp = main_process
    assert mp.server is not None
    setup = [await mp.db.join(ROOM, "@alice:local.test")]
    for d in DESTS:
        setup.append(await mp.db.join(ROOM, f"@u:{d}"))
    mp.announce(setup)
    cfg1, admin1 = _sharded_config(tmp_path, "fed1", pg_url, mp.server.port, remotes.url)
    cfg2, admin2 = _sharded_config(tmp_path, "fed2", pg_url, mp.server.port, remotes.url)
    w1 = start_worker(cfg1, tmp_path / "fed1")
    w2 = start_worker(cfg2, tmp_path / "fed2")
    try:
        await wait_ready(admin1, w1)
        await wait_ready(admin2, w2)
        # Each worker has seen the other (its log says so), so the destinations are
        # split between them before the first events.
        both = "shard membership now ['fed1', 'fed2']"
        await wait_until(
            lambda: all(both in _log(tmp_path / n) for n in ("fed1", "fed2")),
            "both workers to see each other",
            timeout_s=60,
            every_s=0.1,
        )
        first = await mp.db.messages(ROOM, "@alice:local.test", 10)
        mp.announce(first)
        ids = {e.event_id for e in first}
        await wait_until(
            lambda: all(ids <= set(remotes.received_event_ids(d)) for d in DESTS),
            "delivery by two workers",
            timeout_s=60,
            every_s=0.1,
        )
        senders = {d: _senders(remotes, d) for d in DESTS}
        assert all(len(s) == 1 for s in senders.values()), senders
        assert len(set().union(*senders.values())) == 2, "both instances should serve some"

        # fed2 leaves: its destinations move to fed1 without restarting it.
        assert await stop(w2, signal.SIGTERM) == 0
        second = await mp.db.messages(ROOM, "@alice:local.test", 5)
        mp.announce(second)
        ids2 = {e.event_id for e in second}
        await wait_until(
            lambda: all(ids2 <= set(remotes.received_event_ids(d)) for d in DESTS),
            "hand-over after one worker left",
            timeout_s=60,
            every_s=0.1,
        )
        assert await stop(w1, signal.SIGTERM) == 0
    finally:
        for w in (w1, w2):
            if w.poll() is None:
                w.kill()
