"""Shared pieces of the queue benchmarks: receivers in separate processes, a database,
a world of rooms and remote servers, the two senders, the bare aiohttp baseline, RSS.

Receivers are FakeHomeservers (recording off) in child processes, so their CPU is not
charged to the sender; every benchmark that compares against the bare loop sends the
same bodies to the same receivers.

Two senders (``--sender``), usually both in one run, side by side:

* ``production``: what an operator runs. The real :class:`FederationClient` (canonical
  JSON, ed25519 X-Matrix signature per request, the outbound address policy with
  loopback allowed by configuration, response size limit, per-attempt deadline) and the
  real :class:`TelemetryObserver` with metrics and spans on (spans go through a
  ``BatchSpanProcessor`` to an exporter that drops them: everything but the network
  export of an OTLP collector). The one difference from a default configuration: every
  destination is overridden to the receivers' loopback address, and since all of them
  share that address, the pool has no per-host limit (a real deployment has one host
  per destination, where the per-host limit of 4 never binds: one transaction in flight
  per destination).
* ``stand-in``: ``testing/http_sender.py`` (unsigned JSON, no telemetry), the sender of
  the earlier figures, kept to show what production costs on top.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import multiprocessing as mp
import os
import random
import ssl
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from federation_sender.clock import SystemClock
from federation_sender.storage.engine import create_engine
from federation_sender.storage.migrate import upgrade
from federation_sender.testing.certs import CertFiles, LoopbackCA
from federation_sender.testing.fake_homeserver import FakeHomeserver
from federation_sender.testing.http_sender import HttpTransactionSender
from federation_sender.testing.postgres import ephemeral_cluster
from federation_sender.transport.client import FederationClient
from federation_sender.transport.encoding import canonical_json, signing_bytes
from federation_sender.transport.result import Outcome, SendResult, Transaction
from federation_sender.transport.signing import SigningKey, sign_request_bytes

ME = "local.bench"

# Runtime tuning a worker's entry point should apply too: with hundreds of thousands of
# long-lived small objects, the default thresholds run the cyclic collector constantly.
# BENCH_DEFAULT_GC=1 keeps Python's defaults (700, 10, 10), to measure the difference.
if not os.environ.get("BENCH_DEFAULT_GC"):
    gc.set_threshold(100_000, 50, 100)


class GcWindow:
    """The cyclic collector around a timed window.

    :meth:`settle` collects before the clock starts, so that the window does not pay
    for garbage-collector debt the harness ran up before it (writing the main process's
    events, building rooms, the warm-up): with the worker's threshold of 100,000 young
    objects, one collection costs 45-115 ms here, a sixth of a 1,600-transaction run at
    200 destinations, and whether it fell inside the window was chance. What the window
    allocates itself still triggers collections inside it, and they are counted
    (``collections``, ``gc_s``), so a sender that churns objects still pays for it.
    ``BENCH_GC_DEBT=1`` skips the settling, for the figures before it."""

    def __init__(self) -> None:
        self.collections = 0
        self.gc_s = 0.0
        self._t0 = 0.0
        self._on = False
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, _info: Mapping[str, Any]) -> None:
        if not self._on:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.collections += 1
            self.gc_s += time.perf_counter() - self._t0

    def settle(self) -> None:
        """Collect now (outside the window), then count the window's collections."""
        if not os.environ.get("BENCH_GC_DEBT"):
            gc.collect()
        self.collections, self.gc_s, self._on = 0, 0.0, True

    def end(self) -> None:
        self._on = False


GC = GcWindow()
"""The process's one window (benchmarks time one phase at a time)."""


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _serve(port_q: Any, stop_ev: Any, tls: CertFiles | None = None) -> None:
    async def main() -> None:
        fh = FakeHomeserver(record=False)
        await fh.start(ssl_context=None if tls is None else tls.server_context())
        port_q.put(fh.port)
        while not stop_ev.is_set():  # noqa: ASYNC110 - a multiprocessing event
            await asyncio.sleep(0.2)
        await fh.close()

    asyncio.run(main())


@contextlib.contextmanager
def receivers(n: int = 1, tls: CertFiles | None = None) -> Iterator[list[str]]:
    """``n`` receiver processes; yields their base URLs (``https://`` with ``tls``: they
    serve its leaf certificate)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    stop = ctx.Event()
    procs = [ctx.Process(target=_serve, args=(q, stop, tls), daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    scheme = "http" if tls is None else "https"
    urls = [f"{scheme}://127.0.0.1:{q.get(timeout=60)}" for _ in procs]
    try:
        yield urls
    finally:
        stop.set()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()


@contextlib.asynccontextmanager
async def databases(kind: str) -> AsyncIterator[Any]:
    """One PostgreSQL cluster (or a temporary directory for SQLite); yields an async
    context manager factory giving a fresh, migrated database per use."""
    if kind == "sqlite":
        @contextlib.asynccontextmanager
        async def fresh_sqlite() -> AsyncIterator[Any]:
            async with database("sqlite") as eng:
                yield eng

        yield fresh_sqlite
        return
    with bench_cluster() as cluster:
        yield fresh_db_factory(cluster)


@contextlib.contextmanager
def bench_cluster() -> Iterator[Any]:
    """A throwaway PostgreSQL cluster tuned like a dev box (no fsync wait)."""
    with ephemeral_cluster() as cluster:
        # Benchmarks measure the engine, not fsync: relax durability like a tuned dev box.
        cluster.psql("ALTER SYSTEM SET synchronous_commit = off")
        cluster.psql("SELECT pg_reload_conf()")
        yield cluster


def fresh_db_factory(cluster: Any) -> Any:
    """``fresh()``: an async context manager giving a new migrated database of
    ``cluster`` (usable from any event loop, one after another)."""
    count = 0

    @contextlib.asynccontextmanager
    async def fresh() -> AsyncIterator[Any]:
        nonlocal count
        count += 1
        eng = create_engine(cluster.create_database(f"bench{os.getpid()}_{count}"),
                            pool_size=20)
        await upgrade(eng)
        try:
            yield eng
        finally:
            await eng.dispose()

    return fresh


@contextlib.asynccontextmanager
async def database(kind: str) -> AsyncIterator[Any]:
    if kind == "sqlite":
        d = tempfile.mkdtemp(prefix="fsbench-")
        eng = create_engine(f"sqlite:///{d}/bench.db")
        await upgrade(eng)
        try:
            yield eng
        finally:
            await eng.dispose()
        return
    with ephemeral_cluster() as cluster:
        # Benchmarks measure the engine, not fsync: relax durability like a tuned dev box.
        cluster.psql("ALTER SYSTEM SET synchronous_commit = off")
        cluster.psql("SELECT pg_reload_conf()")
        url = cluster.create_database("bench")
        eng = create_engine(url, pool_size=20)
        await upgrade(eng)
        try:
            yield eng
        finally:
            await eng.dispose()


def dest_name(i: int) -> str:
    return f"r{i}.bench"


def loopback_tls(directory: Path, n_dests: int) -> CertFiles:
    """A throwaway CA and a leaf for the receivers, valid for 127.0.0.1 (the bare loop's
    URLs) and the first ``n_dests`` destinations' names (the production client checks
    the destination's name, as for any server)."""
    ca = LoopbackCA.create(directory)
    return ca.issue(directory, ["127.0.0.1", *(dest_name(i) for i in range(n_dests))])


def client_tls(tls: CertFiles | None) -> ssl.SSLContext | bool:
    """The bare loop's TLS: verify against the receivers' CA (``True``: aiohttp's
    default, for plain HTTP URLs)."""
    if tls is None:
        return True
    return ssl.create_default_context(cafile=str(tls.ca_cert))


def url_for(urls: Sequence[str]) -> Any:
    def f(dest: str) -> str:
        return urls[hash(dest) % len(urls)]

    return f


@dataclass
class RecordingSender:
    """Counts (and with ``keep``, keeps for the bare-loop replay) every transaction
    ``inner`` delivers, through its ``on_success`` hook: a wrapping coroutine would add
    a frame per transaction to the engine's measured cost. Give the engine ``inner``."""

    inner: HttpTransactionSender
    keep: bool = True
    sent: list[Transaction] = field(default_factory=list)
    ok_txns: int = 0
    ok_pdus: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)
    target_pdus: int = 0

    def __post_init__(self) -> None:
        self.inner.on_success = self._delivered

    def _delivered(self, txn: Transaction) -> None:
        self.ok_txns += 1
        self.ok_pdus += len(txn.pdus)
        if self.keep:
            self.sent.append(txn)
        if self.target_pdus and self.ok_pdus >= self.target_pdus:
            self.done.set()


BENCH_KEY = SigningKey.generate("a_bench")


async def bare_loop(txns: Sequence[Transaction], url: Any, concurrency: int,
                    connection_limit: int = 1000, *, sign: bool = True,
                    warm: bool = True) -> tuple[float, float]:
    """Send ``txns`` like the simplest correct sender: per destination one at a time,
    in order; destinations concurrently, at most ``concurrency`` requests in flight.
    Bodies are encoded before the clock starts (the strictest baseline: no
    serialisation cost at all); with ``sign`` every request is signed (X-Matrix over the
    canonical request object, as any federation sender must) inside the clock. With
    ``warm``, one request per destination opens the pool's connections before the clock,
    as the engine's warm-up event does. Returns wall and CPU seconds from that clock."""
    by_dest: dict[str, list[tuple[str, bytes]]] = {}
    for t in txns:
        content = {"origin": ME, "origin_server_ts": int(time.time() * 1000),
                   "pdus": list(t.pdus), "edus": list(t.edus)}
        body = canonical_json(content) if sign else json.dumps(
            content, separators=(",", ":")).encode()
        by_dest.setdefault(t.destination, []).append((t.txn_id, body))
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connection_limit, limit_per_host=0)
    ) as session:

        async def put(dest: str, txn_id: str, body: bytes) -> None:
            path = f"/_matrix/federation/v1/send/bare{txn_id}"
            headers = {"Content-Type": "application/json", "Host": dest,
                       "X-Destination": dest}
            if sign:
                headers["Authorization"] = sign_request_bytes(
                    key=BENCH_KEY, origin=ME, destination=dest,
                    message=signing_bytes(content=body, destination=dest, method="PUT",
                                          origin=ME, uri=path))
            async with sem, session.put(f"{url(dest)}{path}", data=body,
                                        headers=headers) as resp:
                await resp.read()
                assert resp.status == 200, resp.status

        async def one_dest(dest: str, items: list[tuple[str, bytes]]) -> None:
            for txn_id, body in items:
                await put(dest, txn_id, body)

        if warm:
            empty = b'{"edus":[],"origin":"' + ME.encode() + b'","origin_server_ts":0,"pdus":[]}'
            await asyncio.gather(*(put(d, f"warm{d}", empty) for d in by_dest))
        GC.settle()
        t0 = time.perf_counter()
        c0 = time.process_time()
        await asyncio.gather(*(one_dest(d, items) for d, items in by_dest.items()))
        GC.end()
        return time.perf_counter() - t0, time.process_time() - c0


class NullExporter:
    """A span exporter that drops what it is given (spans are still recorded, batched
    and handed over: everything but an OTLP collector's network export)."""

    def __init__(self) -> None:
        self.spans = 0

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        self.spans += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


def production_observer(spans: bool = True, sample_ratio: float = 1.0,
                        max_per_s: float | None = None) -> tuple[Any, Any, Any]:
    """The worker's TelemetryObserver, metrics on and spans recorded with the worker's
    sampler (``sample_ratio``: ``telemetry.trace_sample_ratio``; ``max_per_s``:
    ``telemetry.trace_max_per_s``, None for the worker's default), batched to an
    exporter that drops them; its tracer provider (to shut down) and its metrics."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from federation_sender.config import TelemetrySettings
    from federation_sender.queue.telemetry_observer import TelemetryObserver
    from federation_sender.telemetry.metrics import Metrics, new_registry
    from federation_sender.telemetry.tracing import make_sampler

    provider: TracerProvider | None = None
    if spans:
        settings = TelemetrySettings(trace_sample_ratio=sample_ratio)
        if max_per_s is not None:
            settings = replace(settings, trace_max_per_s=max_per_s)
        provider = TracerProvider(sampler=make_sampler(settings, SystemClock()))
        provider.add_span_processor(BatchSpanProcessor(NullExporter()))  # type: ignore[arg-type]
    metrics = Metrics(new_registry())
    return TelemetryObserver(metrics, provider, SystemClock()), provider, metrics


class LoopbackOverrides(Mapping[str, str]):
    """Every destination to one of the receivers' ``host:port`` (computed, not stored:
    100,000 destinations cost nothing here)."""

    def __init__(self, urls: Sequence[str]) -> None:
        self._targets = [u.split("://", 1)[-1] for u in urls]

    def __getitem__(self, dest: str) -> str:
        return self._targets[hash(dest) % len(self._targets)]

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


class CountingClient(FederationClient):
    """The production client, counting acknowledged transactions for the benchmark in
    the (synchronous) bookkeeping call every attempt already makes."""

    def __init__(self, counter: Deliveries, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.counter = counter

    def _finish(self, txn: Transaction, result: SendResult, size: int,
                started: float) -> SendResult:
        r = super()._finish(txn, result, size, started)
        if r.outcome is Outcome.SUCCESS:
            self.counter.delivered(txn)
        return r


@dataclass
class Deliveries:
    """What a sender delivered: counts, and with ``keep`` the transactions themselves
    (for the bare loop's replay); ``done`` is set at ``target_pdus``."""

    keep: bool = False
    sent: list[Transaction] = field(default_factory=list)
    ok_txns: int = 0
    ok_pdus: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)
    target_pdus: int = 0

    def delivered(self, txn: Transaction) -> None:
        self.ok_txns += 1
        self.ok_pdus += len(txn.pdus)
        if self.keep:
            self.sent.append(txn)
        if self.target_pdus and self.ok_pdus >= self.target_pdus:
            self.done.set()

    def reset(self, target_pdus: int, keep: bool = False) -> None:
        self.sent.clear()
        self.ok_txns = self.ok_pdus = 0
        self.done.clear()
        self.target_pdus = target_pdus
        self.keep = keep


SENDERS = ("stand-in", "production")
EXTRA_SENDERS = ("production-default-telemetry", "production-no-telemetry",
                 "production-sampled", "production-traced-all", "production-aiohttp")
"""``production`` is the worker with tracing on and its default sampler (every
transaction the ratio 1.0 keeps, at most ``telemetry.trace_max_per_s`` = 10 traces a
second). The others: the default telemetry (metrics on, tracing off: the
``tracing_exporter = "none"`` default); no observer at all; tracing at
``trace_sample_ratio = 0.1`` without the per-second limit; every transaction traced
(ratio 1.0, no limit): what spans and metrics cost. And the production client over
aiohttp (``federation.http_client = "aiohttp"``) instead of the built-in HTTP/1.1
pool, telemetry as ``production``."""
SAMPLED_RATIO = 0.1


@dataclass
class BenchSender:
    """A sender of either kind with its counter and telemetry observer (or None)."""

    kind: str
    sender: Any
    counter: Deliveries
    observer: Any = None
    provider: Any = None

    async def start(self) -> None:
        if isinstance(self.sender, FederationClient):
            await self.sender.start()

    async def warm_pool(self, dests: Sequence[str], concurrency: int = 500) -> None:
        """Open the pool's connections as the bare loop's warm-up does: one empty
        transaction per destination, all at once (at most ``concurrency``)."""
        sem = asyncio.Semaphore(concurrency)

        async def one(d: str) -> None:
            async with sem:
                await self.sender.send_transaction(Transaction(d, f"warm{d}", (), ()))

        await asyncio.gather(*(one(d) for d in dests))
        self.counter.reset(0)

    def manager(self, engine: Any, settings: Any, **kwargs: Any) -> Any:
        """A QueueManager over this sender and observer, as the worker builds it."""
        from federation_sender.queue.manager import QueueManager
        from federation_sender.storage.backend import NativeBackend

        return QueueManager(NativeBackend(engine), self.sender, settings, ME, "bench", clock(),
                            random.Random(1), lambda _d: True, self.observer, **kwargs)

    async def close(self) -> None:
        await self.sender.close()
        if self.provider is not None:
            self.provider.shutdown()


def make_sender(kind: str, urls: Sequence[str], *, timeout_s: float = 60.0,
                tls: CertFiles | None = None) -> BenchSender:
    """``tls``: the receivers serve TLS; the production client verifies their leaf
    against its CA (``federation.extra_ca_file``), as over any federation link."""
    counter = Deliveries()
    if kind == "stand-in":
        inner = HttpTransactionSender(url_for(urls), ME, clock(), timeout_s=timeout_s)
        inner.on_success = counter.delivered
        return BenchSender(kind, inner, counter, None)
    if kind not in ("production", *EXTRA_SENDERS):
        raise ValueError(kind)
    client = CountingClient(
        counter,
        server_name=ME,
        signing_key=BENCH_KEY,
        clock=clock(),
        attempt_timeout_s=timeout_s,
        max_connections=1000,
        max_connections_per_host=0,
        ip_allow_list=("127.0.0.0/8",),
        destination_overrides=LoopbackOverrides(urls),
        plain_http=tls is None,
        tls_extra_ca_file=None if tls is None else str(tls.ca_cert),
        http_client="aiohttp" if kind == "production-aiohttp" else "builtin",
    )
    if kind == "production-no-telemetry":
        return BenchSender(kind, client, counter)
    unlimited = kind in ("production-sampled", "production-traced-all")
    observer, provider, metrics = production_observer(
        spans=kind != "production-default-telemetry",
        sample_ratio=SAMPLED_RATIO if kind == "production-sampled" else 1.0,
        max_per_s=0.0 if unlimited else None)
    # As app.py wires them: the client's spans and HTTP counters in the same telemetry.
    client.tracer = observer.tracing.tracer
    client.request_counter = metrics
    return BenchSender(kind, client, counter, observer, provider)


def load_average() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


async def build_rooms(engine: Any, n_dests: int, n_rooms: int, dests_per_room: int | None = None,
                      seed: int = 1) -> list[str]:
    """Rooms each joined by alice and remote users; every destination in at least one."""
    from federation_sender.testing.queue_writer import HomeserverWriter

    w = HomeserverWriter(engine, ME)
    await w.init()
    rng = random.Random(seed)
    rooms = [f"!room{i}:{ME}" for i in range(n_rooms)]
    per = dests_per_room or n_dests
    for i, room in enumerate(rooms):
        if per >= n_dests:
            members = range(n_dests)
        else:
            members = sorted({(i * per + k) % n_dests for k in range(per)}
                             | set(rng.sample(range(n_dests), 0)))
        await w.bulk_joins(room, [f"@alice:{ME}"] + [f"@u:{dest_name(j)}" for j in members])
    return rooms


def clock() -> SystemClock:
    return SystemClock()


def report(title: str, rows: list[tuple[str, str]]) -> None:
    print(f"\n== {title}")
    for k, v in rows:
        print(f"  {k:<44} {v}")


def pid() -> int:
    return os.getpid()
