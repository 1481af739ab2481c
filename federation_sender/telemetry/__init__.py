"""Metrics (Prometheus exposition), tracing (OpenTelemetry) and structured logs.

Theory of operation: nothing here is global. The composition root creates a
``prometheus_client.CollectorRegistry`` and a :class:`.metrics.Metrics` over it, a
tracer provider with :func:`.tracing.setup_tracing`, and configures logging once with
:func:`.logging.setup_logging`; components receive the objects they report to. All
names live in :mod:`.names`. Telemetry sits below what it observes and imports none of
it: the queue engine's hooks are turned into metrics and spans by
:mod:`federation_sender.queue.telemetry_observer`, and the metrics endpoint is an
application (:func:`.metrics.metrics_app`) the composition root serves.

Gauges that describe the whole queue (pending PDUs, destinations backing off, oldest
in-flight age) are not pushed: :class:`.metrics.Metrics` calls a snapshot function at
scrape time, so they are never stale and cost nothing between scrapes. A failing
snapshot function is logged and omitted from that scrape rather than failing it.

Logs carry ``destination`` and ``txn_id`` from :func:`.logging.log_context`
(contextvars, so tasks started inside inherit them); formatters redact bearer tokens,
X-Matrix signatures, signing-key material and any secret registered at setup.
"""
