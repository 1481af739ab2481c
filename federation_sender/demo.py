"""``federation-sender demo``: the whole system, end to end, in about a minute.

One process hosts everything, on loopback only:

* the homeserver simulator (:mod:`federation_sender.sim`) writing rooms, memberships
  (joins, leaves, kicks, partial-state rooms), messages and EDU outboxes into the
  database and announcing them over real TCP replication;
* a fleet of fake remote homeservers that verify our X-Matrix signatures, some with
  faults (slow, 500s, resets, hangs, 413, garbage), one of them down long enough for
  its queue to enter catch-up mode and come back;
* the real worker (:class:`federation_sender.app.worker.Worker`) with its admin API.

Time scale: the short-retry phase is 1 s of probes 0.5 s apart (instead of 30 s of
probes and Synapse's ~8 minutes of retries), backoff starts at 1 s and catch-up begins
past 2.5 s of backoff (instead of 10 minutes and 1 hour), so that an outage of a few
seconds shows the whole life cycle. The phase ends at most 1.5 s after the first
failure; with the jitter (each interval doubles times 0.8-1.4) the third persisted
failure always passes 2.5 s, at most 3.8 s after that (the first goes as soon as
nothing is in flight). So the outage (8 s or more) always ends in catch-up, which the
demo's test checks.

The demo ends with the delivery check: every destination must have received, for every
room it shares with us, the latest of our events it is entitled to. Exit status 0 when
it passes, 1 when it does not.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import errno
import logging
import random
import shutil
import signal
import socket
import sys
from pathlib import Path
from typing import IO

from federation_sender.app.worker import Worker
from federation_sender.builders import load_or_create_signing_key, signing_key_path
from federation_sender.clock import Clock, SystemClock
from federation_sender.config import DEMO_SERVER_NAME, Settings
from federation_sender.errors import StartupError
from federation_sender.queue.core.status import DestinationStatus
from federation_sender.sim.check import DeliveryReport, check_delivery
from federation_sender.sim.driver import Driver, Scenario
from federation_sender.sim.expected import Oracle
from federation_sender.sim.fleet import RemoteFleet
from federation_sender.sim.publish import WriterPublisher, serve_replication
from federation_sender.sim.remotes import RemoteRecord
from federation_sender.sim.store import DuplicateEventError
from federation_sender.storage.engine import create_engine
from federation_sender.storage.migrate import upgrade
from federation_sender.telemetry.logging import setup_logging
from federation_sender.testing.faults import FaultProfile, varied_profiles
from federation_sender.testing.ports import free_port
from federation_sender.transport.signing import verify_key_lookup

SERVER_NAME = DEMO_SERVER_NAME


REMOTES_PORT_OFFSET = 10
"""With ``--port-base N``: admin N, metrics N+1, replication N+2, remotes from N+10."""


class PortTaken(Exception):
    """A port of ``--port-base``'s range is in use: one line, exit 2."""

    def __init__(self, port: int, base: int, last: int) -> None:
        super().__init__(
            f"port {port} (of --port-base {base}'s range {base}-{last}) is already in "
            f"use: choose another --port-base, or omit it for free random ports")


def demo_ports(port_base: int, destinations: int) -> list[int]:
    """Every port ``--port-base`` fixes: admin, metrics, replication, one per remote."""
    remotes = port_base + REMOTES_PORT_OFFSET
    return [port_base, port_base + 1, port_base + 2, *range(remotes, remotes + destinations)]


def check_ports_free(port_base: int, destinations: int, host: str = "127.0.0.1") -> None:
    """Raise :class:`PortTaken` for the first port of the range that cannot be bound."""
    ports = demo_ports(port_base, destinations)
    for port in ports:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError:
                raise PortTaken(port, port_base, ports[-1]) from None


def demo_settings(base: Settings, args: argparse.Namespace, data: Path) -> Settings:
    db_url = args.postgres or f"sqlite:///{data}/demo.db"
    port_base: int = getattr(args, "port_base", None) or 0
    return dataclasses.replace(
        base,
        server_name=SERVER_NAME,
        instance_name="demo_sender",
        data_dir=str(data),
        database=dataclasses.replace(base.database, url=db_url),
        replication=dataclasses.replace(base.replication, transport="tcp", host="127.0.0.1"),
        federation=dataclasses.replace(
            base.federation,
            signing_key_path=str(data / "signing.key"),
            use_tls=False,
            ip_allow_list=["127.0.0.0/8", "::1/128"],
            request_timeout_s=4.0,
            connect_timeout_s=2.0,
        ),
        queue=dataclasses.replace(
            base.queue,
            backoff_initial_s=1.0,
            backoff_max_s=8.0,
            catchup_threshold_s=2.5,
            wakeup_interval_s=2.0,
            short_retry_probe_window_s=1.0,
            max_short_retries=0,
            max_short_retry_delay_s=0.5,
            max_long_retries=0,
        ),
        admin=dataclasses.replace(base.admin, enabled=True, port=port_base or free_port(),
                                  token=None),
        telemetry=dataclasses.replace(base.telemetry, log_level="INFO",
                                      metrics_port=port_base + 1 if port_base else None),
    )


def delivered_counts(oracle: Oracle, records: dict[str, RemoteRecord]) -> tuple[int, int]:
    """(expected PDUs received, expected PDUs) over all destinations."""
    got = want = 0
    for dest, exp in oracle.destinations.items():
        rec = records.get(dest)
        seen = rec.pdu_counts if rec is not None else {}
        want += len(exp.should_receive)
        got += sum(1 for e in exp.should_receive if e.event_id in seen)
    return got, want


def _bar(done: int, total: int, width: int = 40) -> str:
    frac = done / total if total else 1.0
    full = int(frac * width)
    return "[" + "#" * full + "-" * (width - full) + f"] {done}/{total} ({frac:.0%})"


def render(
    elapsed_s: float,
    driver: Driver,
    fleet: RemoteFleet,
    statuses: dict[str, DestinationStatus],
    oracle: Oracle,
    admin_url: str | None,
) -> str:
    records = fleet.records()
    got, want = delivered_counts(oracle, records)
    lines = [
        f"federation-sender demo  t={elapsed_s:5.1f}s  admin API: {admin_url}",
        f"simulator: {driver.progress.describe()}",
        f"delivered events {_bar(got, want)}",
        "",
        f"{'destination':<22} {'state':<12} {'pending':>8} {'sent':>7} {'backoff':>8}  fault",
    ]
    for name in sorted(records):
        st = statuses.get(name)
        state = "idle" if st is None else st.state.value
        if st is not None and st.catching_up:
            state = "catching_up"
        pending = 0 if st is None else st.pending_pdus + st.pending_edus
        backoff = (
            "" if st is None or not st.retry_interval_ms else f"{st.retry_interval_ms / 1000:.0f}s"
        )
        remote = fleet[name]
        fault = remote.faults.describe() + (" (DOWN)" if remote.down else "")
        lines.append(
            f"{name:<22} {state:<12} {pending:>8} {records[name].pdus_received:>7} "
            f"{backoff:>8}  {fault}"
        )
    return "\n".join(lines)


async def _run(base: Settings, args: argparse.Namespace, out: IO[str]) -> int:
    clock: Clock = SystemClock()
    data = Path(base.data_dir) / "demo"
    if data.exists() and not args.postgres:
        shutil.rmtree(data)
    data.mkdir(parents=True, exist_ok=True)
    settings = demo_settings(base, args, data)
    port_base: int = getattr(args, "port_base", None) or 0
    log_file = (data / "worker.log").open("w")  # closed below
    setup_logging(settings.telemetry, stream=log_file)
    live = sys.stdout.isatty() and not args.no_live

    engine = create_engine(settings.database.url)
    await upgrade(engine)
    key = load_or_create_signing_key(signing_key_path(settings))
    scenario = _scenario(args)
    names = scenario.remote_server_names
    lookup = verify_key_lookup({SERVER_NAME: {key.key_id: key.verify_key}})
    publisher = await WriterPublisher.for_database(engine, SERVER_NAME)
    print(
        f"federation-sender demo: {len(names)} remote servers, {args.rooms} rooms, "
        f"{args.events} simulated operations over ~{args.duration:.0f}s; "
        f"worker log in {data / 'worker.log'}",
        file=out,
    )
    async with (
        RemoteFleet(names, lookup_key=lookup, clock=clock, faults=_faults(args, names),
                    port_base=port_base + REMOTES_PORT_OFFSET if port_base else 0) as fleet,
        serve_replication(publisher.writer, transport="tcp", clock=clock,
                          port=port_base + 2 if port_base else 0) as port,
    ):
        assert port is not None
        settings = dataclasses.replace(
            settings,
            replication=dataclasses.replace(settings.replication, port=port),
            federation=dataclasses.replace(
                settings.federation, destination_overrides=fleet.overrides()
            ),
        )
        driver = Driver.build(scenario, engine=engine, publisher=publisher, clock=clock)
        report, records, elapsed = await _run_worker(settings, driver, fleet, clock, args,
                                                     live, out)
    await engine.dispose()
    log_file.close()
    if not getattr(args, "keep_running", False):
        _print_totals(report, driver, records, elapsed, out)
    return 0 if report.ok else 1


def _faults(args: argparse.Namespace, names: list[str]) -> dict[str, FaultProfile]:
    """The first remote is down from 2 s until 60 % of the run (at least 10 s); four in
    ten of the others misbehave, each as one of the fault archetypes."""
    outage_end = max(10.0, args.duration * 0.6)
    return varied_profiles(
        names, rng=random.Random(1), faulty_fraction=0.4, outage=(2.0, outage_end)
    )


async def _run_worker(
    settings: Settings,
    driver: Driver,
    fleet: RemoteFleet,
    clock: Clock,
    args: argparse.Namespace,
    live: bool,
    out: IO[str],
) -> tuple[DeliveryReport, dict[str, RemoteRecord], float]:
    """Start the worker, make the rooms, watch the run to its delivery report (then,
    with ``--keep-running``, wait for Ctrl-C), stop the worker; the report, what each
    remote received and the seconds it took.

    The rooms are made once the worker runs: on its first start it begins at the
    events stream's current end (as beside a homeserver that already has history), so
    our join of a partial-state room made before it would never be sent, while the
    delivery check expects it (the one delivery the demo used to miss, at a slow remote
    that no later catch-up covered)."""
    worker = await Worker.create(settings, clock=clock)
    await worker.start()
    await driver.setup()
    print(f"dashboard: {worker.admin_url}/dashboard (admin token in "
          f"{Path(settings.data_dir) / 'admin.token'})", file=out)
    start = clock.monotonic_s()
    try:
        report = await _watch(worker, driver, fleet, clock, args, live, out)
        elapsed = clock.monotonic_s() - start
        records = fleet.records()
        if getattr(args, "keep_running", False):
            _print_totals(report, driver, records, elapsed, out)
            print(f"still running (--keep-running): dashboard {worker.admin_url}/dashboard;"
                  " Ctrl-C to stop", file=out, flush=True)
            await _until_interrupted()
    finally:
        await worker.stop(deadline_s=5.0)
    return report, records, elapsed


async def _until_interrupted() -> None:
    """Return on SIGINT (Ctrl-C) or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


def _scenario(args: argparse.Namespace) -> Scenario:
    return Scenario(
        server_name=SERVER_NAME,
        remote_servers=args.destinations,
        rooms=args.rooms,
        partial_state_rooms=max(1, args.rooms // 6),
        servers_per_room=min(8, args.destinations),
        steps=args.events,
        rate_per_s=max(1.0, args.events / max(1.0, args.duration)),
        batch_size=10,
        seed=1,
    )


async def _watch(
    worker: Worker,
    driver: Driver,
    fleet: RemoteFleet,
    clock: Clock,
    args: argparse.Namespace,
    live: bool,
    out: IO[str],
) -> DeliveryReport:
    """Run the simulator and show progress until everything expected was delivered (or
    45 s after the simulator finished); the delivery report."""
    start = clock.monotonic_s()
    gen = asyncio.create_task(driver.run(), name="simulator")
    deadline = start + args.duration + 45.0
    last_print = -10.0
    try:
        while True:
            now = clock.monotonic_s()
            statuses = {s.destination: s for s in worker.manager.statuses()}
            if live:
                screen = render(
                    now - start, driver, fleet, statuses, driver.oracle, worker.admin_url
                )
                out.write("\x1b[H\x1b[2J" + screen + "\n")
                out.flush()
            elif now - last_print >= 5.0:
                got, want = delivered_counts(driver.oracle, fleet.records())
                busy = sum(1 for s in statuses.values() if s.state.value != "idle")
                print(
                    f"t={now - start:5.1f}s {driver.progress.describe()} | delivered "
                    f"{got}/{want} | active queues {busy}",
                    file=out,
                )
                last_print = now
            if gen.done():
                gen.result()
                report = check_delivery(driver.oracle, fleet.records())
                if report.ok or now > deadline:
                    return report
            await clock.sleep(1.0)
    finally:
        if not gen.done():
            gen.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gen


def _print_totals(
    report: DeliveryReport,
    driver: Driver,
    records: dict[str, RemoteRecord],
    elapsed: float,
    out: IO[str],
) -> None:
    txns = sum(len(r.txns) for r in records.values())
    got, want = delivered_counts(driver.oracle, records)
    print("", file=out)
    print(report.summary(), file=out)
    print(
        f"totals: {driver.progress.events} events written ({driver.progress.local_events} "
        f"local), {got}/{want} expected PDU deliveries seen, {txns} transactions received "
        f"by {len(records)} remotes, in {elapsed:.1f}s",
        file=out,
    )
    if got < want:
        missing = want - got
        print(f"({missing} expected deliver{'y' if missing == 1 else 'ies'} not seen: a "
              "destination that went through "
              "catch-up receives each room's newest event, which stands for the older ones "
              "it missed; the delivery check counts the room as up to date)", file=out)
        short = sorted((d.destination, d.events_expected - d.events_received)
                       for d in report.destinations.values()
                       if d.events_received < d.events_expected)
        # By destination, so that a reader (and tests/worker/test_demo.py) can check that
        # each one went through catch-up: a live destination misses nothing.
        print("expected deliveries not seen, by destination: "
              + ", ".join(f"{d} {n}" for d, n in short), file=out)


def run_demo(settings: Settings, args: argparse.Namespace) -> int:
    logging.getLogger("asyncio").setLevel(logging.WARNING)
    port_base: int | None = getattr(args, "port_base", None)
    try:
        if port_base:
            check_ports_free(port_base, args.destinations)
        return asyncio.run(_run(settings, args, sys.stdout))
    except PortTaken as e:
        print(f"federation-sender demo: {e}", file=sys.stderr)
        return EXIT_PORT_TAKEN
    except DuplicateEventError as e:
        print(f"federation-sender demo: {e}", file=sys.stderr)
        return 1
    except (OSError, StartupError) as e:
        # Taken between the check and the bind (another process was quicker).
        if not port_base or not _address_in_use(e):
            raise
        print(f"federation-sender demo: {e}: choose another --port-base, or omit it "
              "for free random ports", file=sys.stderr)
        return EXIT_PORT_TAKEN


EXIT_PORT_TAKEN = 2


def _address_in_use(e: BaseException) -> bool:
    if isinstance(e, OSError):
        return e.errno == errno.EADDRINUSE
    return "already in use" in str(e)
