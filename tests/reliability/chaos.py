"""The chaos harness: the simulator, ~50 fake remotes and a worker subprocess on a real
PostgreSQL, with faults injected at random until a deadline, then healing, a delivery
check against the simulator's oracle and the Spark audit.

Faults (each drawn at random every few seconds, seeded):

* ``kill_worker``: SIGKILL the worker, restart it after up to 2 s;
* ``cut_replication``: close the replication listener (every reader is cut off),
  reopen it on the same port with the same writer (the reader resumes its history);
* ``restart_main``: a new replication writer over the database (a new stream history,
  as a main process restart), on the same port;
* ``restart_postgres``: restart the PostgreSQL cluster under everyone's feet (the
  simulator pauses: it stands in for the main process, which would be down too);
* ``outage``: a few destinations go down (listener closed, connections reset) for
  longer than the catch-up threshold.

Each round injects every kind once, in a random order.

Throughout, the remotes misbehave according to their fault profiles (timeouts, 500s,
resets before and after processing, slow answers, garbage 200s). At the end every fault
is healed and the run waits until the oracle's delivery check passes, then stops the
worker cleanly and runs the audit job. Worker RSS is sampled from ``/proc`` twice a
second for the whole run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.clock import SystemClock
from federation_sender.replication.tcp import TcpReplicationServer
from federation_sender.sim.check import DeliveryReport, check_delivery
from federation_sender.sim.driver import Driver, OperationMix, Scenario
from federation_sender.sim.fleet import RemoteFleet
from federation_sender.sim.publish import WriterPublisher
from federation_sender.storage.engine import create_engine
from federation_sender.storage.migrate import upgrade
from federation_sender.testing.faults import FaultProfile
from federation_sender.testing.ports import free_port
from federation_sender.testing.postgres import PostgresCluster
from federation_sender.testing.waiting import WaitTimedOut, wait_admin_ready, wait_until
from federation_sender.transport.signing import generate_key_file, verify_key_lookup

SERVER_NAME = "sim.local"
ADMIN_TOKEN = "chaos-admin-token-never-logged"
FAULTS = ("kill_worker", "cut_replication", "restart_main", "restart_postgres", "outage")


@dataclass
class ChaosConfig:
    chaos_s: float = 75.0
    seed: int = 1
    destinations: int = 50
    rooms: int = 30
    rate_per_s: float = 120.0
    fault_every_s: tuple[float, float] = (3.0, 7.0)
    converge_timeout_s: float = 120.0
    faults: tuple[str, ...] = FAULTS
    """The kinds injected (``()``: none, a baseline run)."""
    catchup_threshold_s: float = 3.0
    request_timeout_s: float = 3.0


@dataclass
class ChaosReport:
    faults: Counter[str] = field(default_factory=Counter)
    worker_self_exits: list[int] = field(default_factory=list)
    events_written: int = 0
    local_events: int = 0
    converge_s: float = 0.0
    delivery: DeliveryReport | None = None
    audit: dict[str, Any] = field(default_factory=dict)
    findings: str = ""
    """What the database says about the audit's findings, if it had any."""
    rss_kib: list[int] = field(default_factory=list)
    rss_by_run_kib: list[int] = field(default_factory=list)
    worker_log: str = ""

    @property
    def duplicates(self) -> int:
        d = self.delivery
        return 0 if d is None else d.total("duplicates") + d.total("to_device_duplicates")

    def summary(self) -> str:
        d = self.delivery
        lines = [
            f"faults injected: {dict(self.faults)}",
            f"worker exited by itself: {len(self.worker_self_exits)} {self.worker_self_exits}",
            f"events written: {self.events_written} ({self.local_events} local)",
            f"converged {self.converge_s:.1f} s after healing",
            d.summary().splitlines()[0] if d else "no delivery check",
            f"duplicates (PDUs + to-device): {self.duplicates}",
            f"audit: lost={self.audit.get('undelivered_lost')} "
            f"pending={self.audit.get('undelivered_pending')} "
            f"rows missing/behind/ahead/stale={self.audit.get('rows_missing')}/"
            f"{self.audit.get('rows_behind')}/{self.audit.get('rows_ahead')}/"
            f"{self.audit.get('rows_stale')}",
            f"worker RSS: peak {max(self.rss_kib, default=0) // 1024} MiB; peak per run "
            f"{[k // 1024 for k in self.rss_by_run_kib]} MiB",
        ]
        return "\n".join(lines)


def fault_profiles(names: list[str], rng: random.Random, hang_s: float) -> dict[str, FaultProfile]:
    """A fifth healthy, the rest with a random mix of misbehaviour."""
    out: dict[str, FaultProfile] = {}
    for i, name in enumerate(names):
        if i % 5 == 0:
            continue
        out[name] = FaultProfile(
            slow_s=rng.choice((0.0, 0.0, 0.2, 1.0)),
            error_rate=rng.choice((0.0, 0.05, 0.2)),
            hang_rate=rng.choice((0.0, 0.0, 0.03)),
            hang_s=hang_s,
            reset_rate=rng.choice((0.0, 0.03, 0.1)),
            reset_after_rate=rng.choice((0.0, 0.03, 0.1)),
            garbage_rate=rng.choice((0.0, 0.02, 0.05)),
        )
    return out


class MainProcess:
    """The simulator's replication side: a writer over the database and its listener."""

    def __init__(self, engine: AsyncEngine, port: int) -> None:
        self.engine = engine
        self.port = port
        self.publisher: WriterPublisher | None = None
        self.server: TcpReplicationServer | None = None

    async def start(self, new_history: bool) -> WriterPublisher:
        if new_history or self.publisher is None:
            floor = self.publisher.positions() if self.publisher is not None else None
            self.publisher = await WriterPublisher.for_database(
                self.engine, SERVER_NAME, floor=floor
            )
        self.server = TcpReplicationServer(
            self.publisher.writer, clock=SystemClock(), port=self.port
        )
        for _ in range(50):
            try:
                await self.server.start()
                break
            except OSError:  # the old listener's port is still being released
                await asyncio.sleep(0.1)
        return self.publisher

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.close()
            self.server = None


class WorkerProcess:
    def __init__(self, config: Path, workdir: Path) -> None:
        self.config = config
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / "worker.log"
        self.self_exits: list[int] = []
        self.rss_by_run: list[int] = []

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "federation_sender", "worker", "-c", str(self.config)],
            stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir, env=dict(os.environ),
        )
        log.close()
        self.rss_by_run.append(0)

    def rss_kib(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text()
        except OSError:
            return None
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                kib = int(line.split()[1])
                self.rss_by_run[-1] = max(self.rss_by_run[-1], kib)
                return kib
        return None

    def check_alive(self) -> None:
        """Restart a worker that exited on its own (and remember that it did)."""
        if self.proc is not None and self.proc.poll() is not None:
            self.self_exits.append(self.proc.returncode)
            self.start()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    async def stop(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is not None:
            return self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        proc = self.proc
        with contextlib.suppress(WaitTimedOut):
            return await wait_until(proc.poll, "the worker to exit after SIGTERM",
                                    accept=lambda rc: rc is not None, timeout_s=30,
                                    every_s=0.1)
        self.proc.kill()
        self.proc.wait()
        return -9


def write_config(path: Path, *, pg_url: str, repl_port: int, key_path: Path,
                 overrides: dict[str, str], cfg: ChaosConfig) -> None:
    settings: dict[str, Any] = {
        "server_name": SERVER_NAME,
        "instance_name": "fed1",
        "data_dir": str(path.parent / "data"),
        "database": {"url": pg_url, "pool_size": 5},
        "replication": {"transport": "tcp", "host": "127.0.0.1", "port": repl_port},
        "federation": {
            "signing_key_path": str(key_path),
            "use_tls": False,
            "ip_allow_list": ["127.0.0.0/8"],
            "request_timeout_s": cfg.request_timeout_s,
            "connect_timeout_s": 1.0,
            "destination_overrides": overrides,
        },
        "queue": {
            "backoff_initial_s": 0.5,
            "backoff_max_s": 4.0,
            "catchup_threshold_s": cfg.catchup_threshold_s,
            "wakeup_interval_s": 0.5,
        },
        "admin": {"port": free_port(), "token": ADMIN_TOKEN},
        "telemetry": {"metrics_port": None},
    }
    path.write_text(yaml.safe_dump(settings))


async def wait_ready(admin_port: int, worker: WorkerProcess, timeout_s: float = 60.0) -> None:
    """Wait for ``/ready``: started and connected to replication. A worker's first start
    begins at the end of the events table (it never owed anything before), so traffic
    that must be delivered may only start once it is up."""
    await wait_admin_ready(admin_port, worker.check_alive, timeout_s)


class Chaos:
    def __init__(self, cfg: ChaosConfig, cluster: PostgresCluster, pg_url: str,
                 workdir: Path) -> None:
        self.cfg = cfg
        self.cluster = cluster
        self.pg_url = pg_url
        self.workdir = workdir
        self.rng = random.Random(cfg.seed)
        self.report = ChaosReport()
        self.running = asyncio.Event()
        self.idle = asyncio.Event()
        self.stop_driving = False

    async def run(self) -> ChaosReport:
        cfg = self.cfg
        engine = create_engine(self.pg_url, pool_size=5)
        await upgrade(engine)
        key_path = self.workdir / "signing.key"
        key = generate_key_file(key_path)
        lookup = verify_key_lookup({SERVER_NAME: {key.key_id: key.verify_key}})
        clock = SystemClock()
        scenario = Scenario(
            server_name=SERVER_NAME, remote_servers=cfg.destinations, rooms=cfg.rooms,
            partial_state_rooms=2, servers_per_room=10, users_per_room=12, steps=10**9,
            rate_per_s=cfg.rate_per_s, batch_size=10, seed=cfg.seed,
            mix=OperationMix(finish_partial_state=0.0),
        )
        names = scenario.remote_server_names
        fleet = RemoteFleet(names, lookup_key=lookup, clock=clock, seed=cfg.seed,
                            faults=fault_profiles(names, self.rng, cfg.request_timeout_s + 2))
        main = MainProcess(engine, free_port())
        await fleet.start()
        publisher = await main.start(new_history=True)
        driver = Driver.build(scenario, engine=engine, publisher=publisher, clock=clock)
        config = self.workdir / "config.yaml"
        write_config(config, pg_url=self.pg_url, repl_port=main.port, key_path=key_path,
                     overrides=fleet.overrides(), cfg=cfg)
        worker = WorkerProcess(config, self.workdir)
        sampler = asyncio.create_task(self._sample(worker))
        try:
            await driver.setup()
            worker.start()
            await wait_ready(yaml.safe_load(config.read_text())["admin"]["port"], worker)
            self.running.set()
            driving = asyncio.create_task(self._drive(driver))
            await self._inject(worker, main, driver, fleet, engine)
            self.stop_driving = True
            self.running.set()
            await driving
            await self._heal(worker, main, fleet)
            await self._converge(worker, driver, fleet)
            code = await worker.stop()
            assert code == 0, f"worker exit status {code} on SIGTERM"
            self.report.audit = await self._audit()
            if self.report.audit.get("undelivered_lost") or self.report.audit["exit_status"]:
                await self._dump_lost(self.report.audit.get("samples") or {})
        finally:
            sampler.cancel()
            worker.kill()
            await main.stop()
            await fleet.stop()
            await engine.dispose()
        self.report.events_written = driver.progress.events
        self.report.local_events = driver.progress.local_events
        self.report.worker_self_exits = worker.self_exits
        self.report.rss_by_run_kib = worker.rss_by_run
        self.report.worker_log = worker.log_path.read_text(errors="replace")
        return self.report

    async def _sample(self, worker: WorkerProcess) -> None:
        while True:
            kib = worker.rss_kib()
            if kib is not None:
                self.report.rss_kib.append(kib)
            await asyncio.sleep(0.5)

    async def _drive(self, driver: Driver) -> None:
        """Write traffic in small chunks; pause (and say so) while ``running`` is clear."""
        while not self.stop_driving:
            if not self.running.is_set():
                self.idle.set()
                await self.running.wait()
                continue
            self.idle.clear()
            await driver.run(steps=driver.scenario.batch_size * 5)
        self.idle.set()

    async def _pause_driver(self) -> None:
        self.running.clear()
        await self.idle.wait()

    async def _inject(self, worker: WorkerProcess, main: MainProcess, driver: Driver,
                      fleet: RemoteFleet, engine: AsyncEngine) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.chaos_s
        outages: set[asyncio.Task[None]] = set()
        bag: list[str] = []
        while loop.time() < deadline:
            await asyncio.sleep(self.rng.uniform(*self.cfg.fault_every_s))
            worker.check_alive()
            if not self.cfg.faults:
                continue
            if not bag:  # every kind once per round, in a random order
                bag = self.rng.sample(self.cfg.faults, len(self.cfg.faults))
            fault = bag.pop()
            self.report.faults[fault] += 1
            if fault == "kill_worker":
                worker.kill()
                await asyncio.sleep(self.rng.uniform(0, 2))
                worker.start()
            elif fault == "cut_replication":
                await main.stop()
                await asyncio.sleep(self.rng.uniform(0.2, 2))
                await main.start(new_history=False)
            elif fault == "restart_main":
                await self._pause_driver()
                await main.stop()
                driver.store.publisher = await main.start(new_history=True)
                self.running.set()
            elif fault == "restart_postgres":
                await self._pause_driver()
                await asyncio.to_thread(self.cluster.restart)
                await engine.dispose()  # the pool's connections died with the server
                self.running.set()
            else:
                down = self.rng.sample(sorted(fleet.remotes), 3)
                seconds = self.rng.uniform(self.cfg.catchup_threshold_s * 2,
                                           self.cfg.catchup_threshold_s * 5)
                task = asyncio.create_task(self._outage(fleet, down, seconds))
                outages.add(task)
                task.add_done_callback(outages.discard)
        await asyncio.gather(*outages)

    @staticmethod
    async def _outage(fleet: RemoteFleet, names: list[str], seconds: float) -> None:
        for n in names:
            await fleet[n].go_down()
        await asyncio.sleep(seconds)
        for n in names:
            await fleet[n].come_up()

    async def _heal(self, worker: WorkerProcess, main: MainProcess, fleet: RemoteFleet) -> None:
        for remote in fleet.remotes.values():
            remote.faults = FaultProfile()
            await remote.come_up()
        if main.server is None:
            await main.start(new_history=False)
        worker.check_alive()

    async def _converge(self, worker: WorkerProcess, driver: Driver, fleet: RemoteFleet) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        report = check_delivery(driver.oracle, fleet.records())
        while not report.ok:
            if loop.time() - started > self.cfg.converge_timeout_s:
                self.report.delivery = report
                await self._dump_shortfalls(report)
                raise AssertionError(
                    "no convergence after healing:\n" + report.summary()
                    + "\n--- worker log tail ---\n"
                    + worker.log_path.read_text(errors="replace")[-4000:]
                )
            await asyncio.sleep(1.0)
            worker.check_alive()
            report = check_delivery(driver.oracle, fleet.records())
        self.report.converge_s = loop.time() - started
        self.report.delivery = report

    async def _dump_shortfalls(self, report: Any) -> None:
        """On failure, write what the database says about each missing pair."""
        from sqlalchemy import text

        from federation_sender.storage.engine import create_engine

        eng = create_engine(self.pg_url)
        lines: list[str] = []
        try:
            async with eng.connect() as conn:
                for d in report.destinations.values():
                    for s in d.missing_rooms:
                        lines.append(f"== {s.destination} {s.room_id} expected "
                                     f"{s.expected.stream_ordering} got {s.got_stream_ordering}")
                        for q in (
                            "SELECT * FROM destinations WHERE destination=:d",
                            "SELECT * FROM destination_rooms WHERE destination=:d AND room_id=:r",
                            "SELECT stream_ordering, event_id, type, state_key, sender FROM events"
                            " WHERE room_id=:r ORDER BY stream_ordering DESC LIMIT 8",
                            "SELECT event_stream_ordering, user_id, membership FROM"
                            " room_memberships WHERE room_id=:r AND server_name=:d"
                            " ORDER BY event_stream_ordering",
                            "SELECT stream_name, instance_name, stream_id FROM stream_positions",
                        ):
                            rows = (await conn.execute(text(q), {"d": s.destination,
                                                                 "r": s.room_id})).all()
                            lines.append(q)
                            lines.extend("   " + repr(tuple(r)) for r in rows)
        finally:
            await eng.dispose()
        (self.workdir / "shortfalls.txt").write_text("\n".join(lines))

    async def _dump_lost(self, samples: dict[str, Any]) -> None:
        """When the audit finds a lost row or a ``destination_rooms`` mismatch, write
        what the database says about it (``lost.txt`` in the run's directory, and the
        report's ``findings``): the destination's position, its row, the room's latest
        events, the destination's memberships and transaction log."""
        from sqlalchemy import text

        eng = create_engine(self.pg_url)
        lines: list[str] = []
        rows = [r for r in samples.get("undelivered", []) if r.get("status") == "lost"]
        rows += [{**r, "stream_ordering": r.get("expected_so") or r.get("actual_so") or 0}
                 for r in samples.get("mismatches", [])]
        try:
            async with eng.connect() as conn:
                for row in rows:
                    lines.append(f"== {row}")
                    for q in (
                        "SELECT * FROM destinations WHERE destination=:d",
                        "SELECT * FROM destination_rooms WHERE destination=:d AND room_id=:r",
                        "SELECT stream_ordering, event_id, type, state_key, sender, outlier,"
                        " rejected FROM events WHERE room_id=:r AND stream_ordering >= :s - 40"
                        " ORDER BY stream_ordering",
                        "SELECT event_stream_ordering, user_id, membership FROM"
                        " room_memberships WHERE room_id=:r AND server_name=:d"
                        " ORDER BY event_stream_ordering",
                        "SELECT id, txn_id, status, http_status, started_ts, duration_ms,"
                        " catchup, max_stream_ordering, pdu_event_ids, error FROM"
                        " federation_transaction_log WHERE destination=:d ORDER BY id",
                    ):
                        rows = (await conn.execute(text(q), {
                            "d": row["destination"], "r": row["room_id"],
                            "s": row["stream_ordering"]})).all()
                        lines.append(q)
                        lines.extend("   " + repr(tuple(r)) for r in rows)
        finally:
            await eng.dispose()
        (self.workdir / "lost.txt").write_text("\n".join(lines))
        self.report.findings = "\n".join(lines)

    async def _audit(self) -> dict[str, Any]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "federation_sender.batch", "audit",
            "--database-url", self.pg_url, "--server-name", SERVER_NAME,
            "--json", "--quiet", "--conf", "spark.ui.enabled=false",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
        text = out.decode()
        start = text.find("{")
        if start < 0:
            raise AssertionError(f"audit printed no JSON (status {proc.returncode}):\n"
                                 + err.decode()[-3000:])
        doc = json.loads(text[start:])
        summary: dict[str, Any] = doc["summary"]
        summary["exit_status"] = proc.returncode
        summary["samples"] = doc.get("samples")
        return summary


async def run_chaos(cfg: ChaosConfig, cluster: PostgresCluster, pg_url: str,
                    workdir: Path) -> ChaosReport:
    return await Chaos(cfg, cluster, pg_url, workdir).run()
