"""Server discovery: the specification's steps, caching, and one lookup at a time."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import Mapping
from typing import Any

import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from federation_sender.clock import SystemClock
from federation_sender.config import TelemetrySettings
from federation_sender.telemetry import names as n
from federation_sender.telemetry.tracing import Tracing, setup_tracing
from federation_sender.testing.certs import CertFiles
from federation_sender.testing.clock import FakeClock
from federation_sender.testing.waiting import wait_until
from federation_sender.transport.client import FederationClient
from federation_sender.transport.discovery import (
    Discovery,
    InvalidServerName,
    ResolvedServer,
    ServerName,
    WellKnownFetchError,
    WellKnownResponse,
    cache_period_from_headers,
    parse_server_name,
)
from federation_sender.transport.dns import DnsError, DnsLookup, SrvAnswer, SrvRecord
from federation_sender.transport.result import Outcome, Transaction
from federation_sender.transport.signing import SigningKey

from .conftest import LOOPBACK, FakeRemote, make_client
from .dns_server import LoopbackDns


@pytest.mark.parametrize(
    ("name", "parsed"),
    [
        ("example.org", ServerName("example.org", None, False)),
        ("example.org:8449", ServerName("example.org", 8449, False)),
        ("1.2.3.4", ServerName("1.2.3.4", None, True)),
        ("1.2.3.4:1", ServerName("1.2.3.4", 1, True)),
        ("[1234:5678::abcd]", ServerName("1234:5678::abcd", None, True)),
        ("[::1]:8448", ServerName("::1", 8448, True)),
        ("localhost", ServerName("localhost", None, False)),
    ],
)
def test_parse_server_name(name: str, parsed: ServerName) -> None:
    assert parse_server_name(name) == parsed


@pytest.mark.parametrize(
    "name",
    ["", "exa mple.org", "example.org:", "example.org:0", "example.org:65536", "a:b",
     "[::1", "[nope]:1", "[::1]x", "example.org:80:80", "ex_ample.org", "é.org"],
)  # fmt: skip
def test_parse_server_name_rejects(name: str) -> None:
    with pytest.raises(InvalidServerName):
        parse_server_name(name)


@given(st.text(max_size=300))
def test_parse_server_name_parses_or_raises_one_error(name: str) -> None:
    with contextlib.suppress(InvalidServerName):
        parse_server_name(name)


def test_cache_control() -> None:
    assert cache_period_from_headers({}) is None
    assert cache_period_from_headers({"cache-control": "public, max-age=600"}) == 600
    assert cache_period_from_headers({"cache-control": "no-store, max-age=600"}) == 0
    assert cache_period_from_headers({"cache-control": "max-age=soon"}) is None


class FakeSrv:
    def __init__(self, records: Mapping[str, list[tuple[int, int, int, str]]]) -> None:
        self.records = dict(records)
        self.queries: list[str] = []
        self.fail = False

    async def srv(self, name: str) -> SrvAnswer:
        self.queries.append(name)
        if self.fail:
            raise DnsError("SERVFAIL")
        return SrvAnswer(tuple(SrvRecord(*r) for r in self.records.get(name, [])), 600.0)


class FakeWellKnown:
    def __init__(self) -> None:
        self.answers: dict[str, WellKnownResponse | WellKnownFetchError] = {}
        self.fetches: list[str] = []
        self.gate: asyncio.Event | None = None

    def set(self, host: str, body: Any, status: int = 200, cache: str | None = None) -> None:
        headers = {"cache-control": cache} if cache else {}
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.answers[host] = WellKnownResponse(status, headers, raw)

    async def __call__(self, host: str) -> WellKnownResponse:
        self.fetches.append(host)
        if self.gate is not None:
            await self.gate.wait()
        answer = self.answers.get(host, WellKnownResponse(404, {}, b""))
        if isinstance(answer, WellKnownFetchError):
            raise answer
        return answer


def make_discovery(
    srv: FakeSrv, wk: FakeWellKnown, clock: FakeClock, max_entries: int = 100
) -> Discovery:
    return Discovery(
        srv_lookup=srv,
        fetch_well_known=wk,
        clock=clock,
        rng=random.Random(1),
        max_cache_entries=max_entries,
    )


async def test_spec_steps(fake_clock: FakeClock) -> None:
    srv = FakeSrv(
        {
            "_matrix-fed._tcp.srv.example": [(10, 0, 8000, "target.example")],
            "_matrix._tcp.legacy.example": [(10, 0, 8001, "old.example")],
            "_matrix-fed._tcp.delegated.example": [(10, 0, 8002, "t2.example")],
        }
    )
    wk = FakeWellKnown()
    wk.set("wk-port.example", {"m.server": "delegated.example:9000"})
    wk.set("wk-ip.example", {"m.server": "[::1]"})
    wk.set("wk-srv.example", {"m.server": "delegated.example"})
    wk.set("wk-plain.example", {"m.server": "nothing.example"})
    d = make_discovery(srv, wk, fake_clock)
    cases = {
        "1.2.3.4": ResolvedServer((("1.2.3.4", 8448),), "1.2.3.4", "1.2.3.4"),
        "[::1]:9": ResolvedServer((("::1", 9),), "[::1]:9", "::1"),
        "host.example:9": ResolvedServer((("host.example", 9),), "host.example:9", "host.example"),
        "wk-port.example": ResolvedServer(
            (("delegated.example", 9000),), "delegated.example:9000", "delegated.example"
        ),
        "wk-ip.example": ResolvedServer((("::1", 8448),), "[::1]", "::1"),
        "wk-srv.example": ResolvedServer(
            (("t2.example", 8002),), "delegated.example", "delegated.example"
        ),
        "wk-plain.example": ResolvedServer(
            (("nothing.example", 8448),), "nothing.example", "nothing.example"
        ),
        "srv.example": ResolvedServer((("target.example", 8000),), "srv.example", "srv.example"),
        "legacy.example": ResolvedServer(
            (("old.example", 8001),), "legacy.example", "legacy.example"
        ),
        "plain.example": ResolvedServer(
            (("plain.example", 8448),), "plain.example", "plain.example"
        ),
    }
    for name, expected in cases.items():
        assert await d.resolve(name) == expected, name
    # IP literals and explicit ports never ask for well-known
    assert "host.example" not in wk.fetches and "1.2.3.4" not in wk.fetches
    # _matrix-fed first, then the deprecated _matrix
    assert srv.queries[-2:] == ["_matrix-fed._tcp.plain.example", "_matrix._tcp.plain.example"]


async def test_srv_priority_and_weight_order(fake_clock: FakeClock) -> None:
    srv = FakeSrv(
        {"_matrix-fed._tcp.s.example": [(20, 0, 3, "c"), (10, 0, 1, "a"), (10, 0, 2, "b")]}
    )
    resolved = await make_discovery(srv, FakeWellKnown(), fake_clock).resolve("s.example")
    assert [p for _, p in resolved.targets][-1] == 3
    assert sorted(p for _, p in resolved.targets[:2]) == [1, 2]


@pytest.mark.parametrize(
    "body",
    [b"not json", b"[]", {"m.server": 5}, {"m.server": "bad name!"}, {}],
)
async def test_invalid_well_known_falls_back_and_is_cached_for_an_hour(
    fake_clock: FakeClock, body: Any
) -> None:
    wk = FakeWellKnown()
    wk.set("x.example", body)
    d = make_discovery(FakeSrv({}), wk, fake_clock)
    assert (await d.resolve("x.example")).targets == (("x.example", 8448),)
    fake_clock.advance(3000)  # < 1 h * 0.9 jitter
    await d.resolve("x.example")
    assert wk.fetches == ["x.example"]
    fake_clock.advance(1000)  # > 1 h * 1.1
    await d.resolve("x.example")
    assert wk.fetches == ["x.example", "x.example"]


@pytest.mark.parametrize(
    ("cache_control", "fresh_s", "stale_s"),
    [
        ("max-age=600", 599, 601),
        ("max-age=1", 299, 301),  # clamped up to 5 min
        ("max-age=999999", 48 * 3600 - 1, 48 * 3600 + 1),  # clamped down to 48 h
        (None, 0.9 * 24 * 3600 - 1, 1.1 * 24 * 3600 + 1),  # default 24 h, jittered
        ("no-store", None, 0.001),
    ],
)
async def test_well_known_cache_follows_cache_control(
    fake_clock: FakeClock, cache_control: str | None, fresh_s: float | None, stale_s: float
) -> None:
    wk = FakeWellKnown()
    wk.set("x.example", {"m.server": "y.example:1"}, cache=cache_control)
    d = make_discovery(FakeSrv({}), wk, fake_clock)
    await d.resolve("x.example")
    if fresh_s is not None:
        fake_clock.advance(fresh_s)
        await d.resolve("x.example")
        assert len(wk.fetches) == 1
        fake_clock.advance(-fresh_s)
    fake_clock.advance(stale_s)
    assert (await d.resolve("x.example")).targets == (("y.example", 1),)
    assert len(wk.fetches) == 2


async def test_temporary_well_known_failure_keeps_a_known_delegation(
    fake_clock: FakeClock,
) -> None:
    wk = FakeWellKnown()
    wk.set("x.example", {"m.server": "y.example:1"}, cache="max-age=600")
    d = make_discovery(FakeSrv({}), wk, fake_clock)
    await d.resolve("x.example")
    fake_clock.advance(700)
    wk.answers["x.example"] = WellKnownFetchError("connection refused", temporary=True)
    assert (await d.resolve("x.example")).targets == (("y.example", 1),)
    wk.set("x.example", {}, status=503)
    fake_clock.advance(200)
    assert (await d.resolve("x.example")).targets == (("y.example", 1),)
    # A definite "no delegation" replaces it, cached for the short period.
    wk.set("x.example", {}, status=404)
    fake_clock.advance(200)
    assert (await d.resolve("x.example")).targets == (("x.example", 8448),)
    fake_clock.advance(150)
    await d.resolve("x.example")
    assert len(wk.fetches) == 5


async def test_srv_cache_and_stale_answer_on_dns_failure(fake_clock: FakeClock) -> None:
    srv = FakeSrv({"_matrix-fed._tcp.s.example": [(10, 0, 1, "t.example")]})
    d = make_discovery(srv, FakeWellKnown(), fake_clock)
    await d.resolve("s.example")
    await d.resolve("s.example")
    assert srv.queries == ["_matrix-fed._tcp.s.example"]
    fake_clock.advance(601)
    srv.fail = True
    assert (await d.resolve("s.example")).targets == (("t.example", 1),)
    with pytest.raises(DnsError):
        await d.resolve("other.example")


async def test_one_lookup_per_name_at_a_time_and_cancellation_is_isolated(
    fake_clock: FakeClock,
) -> None:
    wk = FakeWellKnown()
    wk.gate = asyncio.Event()
    wk.set("x.example", {"m.server": "y.example:1"})
    d = make_discovery(FakeSrv({}), wk, fake_clock)
    waiters = [asyncio.create_task(d.resolve("x.example")) for _ in range(10)]
    await wait_until(lambda: wk.fetches, "the lookup under way", timeout_s=5)
    waiters[0].cancel()
    wk.gate.set()
    results = await asyncio.gather(*waiters[1:])
    assert {r.targets for r in results} == {(("y.example", 1),)}
    assert wk.fetches == ["x.example"]
    await d.close()


async def test_cache_is_bounded(fake_clock: FakeClock) -> None:
    wk = FakeWellKnown()
    d = make_discovery(FakeSrv({}), wk, fake_clock, max_entries=3)
    for i in range(5):
        await d.resolve(f"h{i}.example")
    await d.resolve("h0.example")  # evicted: fetched again
    assert wk.fetches.count("h0.example") == 2


# --- against real servers on loopback ------------------------------------------------


async def test_dns_lookup_against_a_loopback_dns_server(dns_server: LoopbackDns) -> None:
    dns_server.add("_matrix-fed._tcp.a.test", "SRV", "10 5 8448 target.test.")
    dns_server.add("_matrix-fed._tcp.dot.test", "SRV", "0 0 0 .")
    dns_server.add("target.test", "A", "127.0.0.2")
    dns_server.add("target.test", "AAAA", "::1")
    dns_server.fail("broken.test")
    lookup = DnsLookup([("127.0.0.1", dns_server.port)], timeout_s=1.0)
    answer = await lookup.srv("_matrix-fed._tcp.a.test")
    assert answer.records == (SrvRecord(10, 5, 8448, "target.test"),)
    assert answer.ttl_s == 300
    assert (await lookup.srv("_matrix-fed._tcp.dot.test")).records == ()
    assert (await lookup.srv("_matrix-fed._tcp.nothing.test")).records == ()
    assert await lookup.addresses("target.test") == ["::1", "127.0.0.2"]
    with pytest.raises(DnsError):
        await lookup.srv("broken.test")




async def test_full_discovery_over_dns_well_known_and_srv(
    certs: CertFiles, our_key: SigningKey, dns_server: LoopbackDns, remote: FakeRemote
) -> None:
    """wk.test delegates to delegated.test, whose SRV points at target.test."""
    wk_hits: list[str] = []

    async def well_known(request: web.Request) -> web.StreamResponse:
        wk_hits.append(request.host)
        return web.json_response(
            {"m.server": "delegated.test"}, headers={"Cache-Control": "max-age=3600"}
        )

    app = web.Application()
    app.router.add_get("/.well-known/matrix/server", well_known)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=certs.server_context())
    await site.start()
    wk_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    for name in ("wk.test", "target.test"):
        dns_server.add(name, "A", "127.0.0.1")
    dns_server.add("_matrix-fed._tcp.delegated.test", "SRV", f"10 0 {remote.port} target.test.")
    try:
        async with make_client(
            certs, our_key, nameservers=[("127.0.0.1", dns_server.port)],
            well_known_port=wk_port,
        ) as client:
            results = await asyncio.gather(
                *(
                    client.send_transaction(Transaction("wk.test", f"t{i}", [], []))
                    for i in range(5)
                )
            )
    finally:
        await runner.cleanup()
    assert all(r.outcome is Outcome.SUCCESS for r in results), results
    assert len(wk_hits) == 1  # one lookup for five concurrent sends
    assert dns_server.count("_matrix-fed._tcp.delegated.test", "SRV") == 1
    request, _ = remote.requests[0]
    assert request.headers["Host"] == "delegated.test"  # not the SRV target
    assert set(remote.sni) == {"delegated.test"}  # TLS name is the delegated name


async def test_well_known_redirects_are_followed_https_only(
    certs: CertFiles, our_key: SigningKey, dns_server: LoopbackDns
) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        if request.path == "/.well-known/matrix/server":
            raise web.HTTPFound("/moved")
        if request.path == "/moved":
            return web.json_response({"m.server": "found.test:1"})
        raise web.HTTPNotFound()

    app = web.Application()
    app.router.add_get("/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=certs.server_context())
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    dns_server.add("wk.test", "A", "127.0.0.1")
    try:
        async with FederationClient(
            server_name="origin.test",
            signing_key=our_key,
            clock=SystemClock(),
            tls_extra_ca_file=str(certs.ca_cert),
            ip_allow_list=LOOPBACK,
            nameservers=[("127.0.0.1", dns_server.port)],
            well_known_port=port,
        ) as client:
            resolved = await client.resolve("wk.test")
        async with FederationClient(
            server_name="origin.test",
            signing_key=our_key,
            clock=SystemClock(),
            tls_extra_ca_file=str(certs.ca_cert),
            ip_allow_list=(),  # the well-known host is on loopback: refused
            nameservers=[("127.0.0.1", dns_server.port)],
            well_known_port=port,
        ) as client:
            refused = await client.resolve("wk.test")
    finally:
        await runner.cleanup()
    assert resolved.targets == (("found.test", 1),)
    assert refused.targets == (("wk.test", 8448),)


async def test_cached_answers_without_a_lookup_only_while_every_step_is_fresh(
    fake_clock: FakeClock,
) -> None:
    srv = FakeSrv({"_matrix-fed._tcp.delegated.example": [(10, 0, 8002, "t2.example")]})
    wk = FakeWellKnown()
    wk.set("wk.example", {"m.server": "delegated.example"}, cache="max-age=3600")
    wk.set("nostore.example", {"m.server": "delegated.example"}, cache="no-store")
    d = make_discovery(srv, wk, fake_clock)
    # No lookup needed at all: an IP literal, an explicit port.
    assert d.cached("1.2.3.4") == ResolvedServer((("1.2.3.4", 8448),), "1.2.3.4", "1.2.3.4")
    assert d.cached("h.example:9") == ResolvedServer(
        (("h.example", 9),), "h.example:9", "h.example")
    with pytest.raises(InvalidServerName):
        d.cached("bad name!")
    # Nothing cached yet: a lookup is due; after it, the same answer without one.
    assert d.cached("wk.example") is None
    resolved = await d.resolve("wk.example")
    assert d.cached("wk.example") == resolved
    assert d.cached("nothing.example") is None  # a cached failure needs its own lookup
    await d.resolve("nothing.example")
    assert d.cached("nothing.example") == ResolvedServer(
        (("nothing.example", 8448),), "nothing.example", "nothing.example")
    assert (len(wk.fetches), len(srv.queries)) == (2, 3)  # cached() asked nobody
    # An answer that may not be stored, or one past its time, is looked up again.
    await d.resolve("nostore.example")
    assert d.cached("nostore.example") is None
    fake_clock.advance(601)  # the SRV answer's 600 s are over, the well-known's hour not
    assert d.cached("wk.example") is None
    assert await d.resolve("wk.example") == resolved
    assert len(wk.fetches) == 3 and srv.queries[-1] == "_matrix-fed._tcp.delegated.example"


async def test_discovery_is_spanned_only_when_it_looks_something_up(
    certs: CertFiles, our_key: SigningKey, dns_server: LoopbackDns, remote: FakeRemote
) -> None:
    """remote.test has no well-known (no address at all) and an SRV record: the first
    transaction looks both up under a discovery span; the next ones use the cache and
    record only their HTTP request, as does an IP literal, which needs no lookup."""
    dns_server.add("target.test", "A", "127.0.0.1")
    dns_server.add("_matrix-fed._tcp.remote.test", "SRV", f"10 0 {remote.port} target.test.")
    exported = InMemorySpanExporter()
    tracing = Tracing(setup_tracing(TelemetrySettings(), exporter=exported))
    sends = ["remote.test", "remote.test", f"127.0.0.1:{remote.port}", "remote.test"]
    async with make_client(
        certs, our_key, nameservers=[("127.0.0.1", dns_server.port)]
    ) as client:
        client.tracer = tracing.tracer
        for i, dest in enumerate(sends):
            with tracing.transaction_attempt(dest, f"t{i}", pdu_count=0, edu_count=0) as txn:
                result = await client.send_transaction(Transaction(dest, f"t{i}", [], []))
                txn.finish(result.outcome.value, http_status=result.status)
            assert result.outcome is Outcome.SUCCESS, result
    spans = exported.get_finished_spans()
    roots = [s for s in spans if s.name == n.SPAN_TRANSACTION]
    assert len(roots) == len(sends)
    children = [sorted(c.name for c in spans
                       if c.parent is not None and root.context is not None
                       and c.parent.span_id == root.context.span_id) for root in roots]
    assert children == [[n.SPAN_HTTP_REQUEST, n.SPAN_DISCOVERY]] + [[n.SPAN_HTTP_REQUEST]] * 3
    (discovery,) = [s for s in spans if s.name == n.SPAN_DISCOVERY]
    assert discovery.attributes == {n.ATTR_DESTINATION: "remote.test"}
    assert dns_server.count("_matrix-fed._tcp.remote.test", "SRV") == 1
    http = [s for s in spans if s.name == n.SPAN_HTTP_REQUEST]
    assert all(s.attributes is not None and s.attributes[n.ATTR_HTTP_STATUS] == 200
               and s.attributes[n.ATTR_SERVER_PORT] == remote.port for s in http)
