"""The telemetry's own cost per transaction, without the engine or the network.

Replays, N times, exactly the telemetry calls one successful transaction makes on the
production path: the runner's ``observer.attempt`` around the client's HTTP request span
with its request/response counters (no discovery span: a destination already reached
has its discovery cached), ``observer.persisting`` on the result's commit future and
``observer.transaction_sent``. Prints microseconds of
CPU per transaction with spans on (every transaction traced, a ``BatchSpanProcessor``
to an exporter that drops them), with the worker's default sampler (``default``: at most
10 traces a second, so nearly every transaction of this loop goes untraced, as
``bench/common.py``'s production sender), with a sampling ratio and no limit, and with
tracing off (the default configuration: metrics only).

    .venv/bin/python bench/telemetry_cost.py [--txns 20000] [--dests 1000] [--cprofile]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from opentelemetry import trace

from bench.common import NullExporter
from federation_sender.clock import SystemClock
from federation_sender.config import TelemetrySettings
from federation_sender.queue.telemetry_observer import TelemetryObserver
from federation_sender.telemetry import names
from federation_sender.telemetry.metrics import Metrics, new_registry
from federation_sender.telemetry.tracing import child_span_dropped, leaf_span, setup_tracing
from federation_sender.transport.client import _NO_SPAN
from federation_sender.transport.result import Outcome


def _observer(variant: str) -> TelemetryObserver:
    provider = None
    if variant != "metrics-only":
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        settings = TelemetrySettings(trace_max_per_s=0)  # "spans": every one traced
        if variant.startswith("ratio="):
            settings = TelemetrySettings(trace_sample_ratio=float(variant.split("=")[1]),
                                         trace_max_per_s=0)
        elif variant == "default":  # the worker's sampler: ratio 1.0, 10 traces a second
            settings = TelemetrySettings()
        provider = setup_tracing(settings, exporter=NullExporter())  # type: ignore[arg-type]
        assert provider is not None
        # as in production with otlp: batched, not the synchronous test processor
        provider._active_span_processor._span_processors = ()
        provider.add_span_processor(BatchSpanProcessor(NullExporter()))  # type: ignore[arg-type]
    return TelemetryObserver(Metrics(new_registry()), provider, SystemClock())


async def _run(obs: TelemetryObserver, txns: int, dests: int) -> float:
    tracer = obs.tracing.tracer
    metrics = obs._metrics
    loop = asyncio.get_running_loop()
    no_edus: dict[str, int] = {}
    t0 = time.process_time()
    for i in range(txns):
        d = f"remote{i % dests}.test"
        with obs.attempt(d, f"t{i}", 1, 0, False):
            # as FederationClient._attempt does for a destination whose discovery is
            # cached (no discovery span: that is only for a real lookup)
            untraced = child_span_dropped(tracer)
            with (_NO_SPAN if untraced else leaf_span(
                    tracer, names.SPAN_HTTP_REQUEST, trace.SpanKind.CLIENT,
                    {names.ATTR_HTTP_METHOD: "PUT", names.ATTR_SERVER_ADDRESS: "127.0.0.1",
                     names.ATTR_SERVER_PORT: 8448})) as span:
                metrics.http_request("PUT")
                metrics.http_response("PUT", 200)
                span.set_attribute(names.ATTR_HTTP_STATUS, 200)
            fut: asyncio.Future[None] = loop.create_future()
            obs.persisting(d, fut)
            obs.transaction_sent(d, f"t{i}", Outcome.SUCCESS, 200, 1, 0, no_edus, 900,
                                 0.01, False)
        fut.set_result(None)
        if i % 100 == 0:
            await asyncio.sleep(0)  # run the futures' callbacks
    await asyncio.sleep(0)
    return time.process_time() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--txns", type=int, default=20_000)
    p.add_argument("--dests", type=int, default=1_000)
    p.add_argument("--variants", nargs="+",
                   default=["spans", "default", "ratio=0.1", "metrics-only"])
    p.add_argument("--cprofile", action="store_true")
    args = p.parse_args()
    for variant in args.variants:
        obs = _observer(variant)
        asyncio.run(_run(obs, 500, args.dests))  # warm
        prof = cProfile.Profile() if args.cprofile else None
        if prof:
            prof.enable()
        cpu = asyncio.run(_run(obs, args.txns, args.dests))
        if prof:
            prof.disable()
        obs.tracing.shutdown()
        print(f"{variant:>14}: {cpu / args.txns * 1e6:7.1f} us CPU per transaction")
        if prof:
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
