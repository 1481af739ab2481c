"""Forward proxies: ``/send``, well-known and the outbound proxy's requests through a real
``tinyproxy`` on loopback (``CONNECT``, Basic credentials, ``no_proxy``, a proxy that is
down, a 407); and the parsing and matching rules on their own."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from aiohttp import web

from federation_sender.config import QueueSettings
from federation_sender.errors import ConfigError
from federation_sender.proxy_url import parse_proxy
from federation_sender.queue.core.states import DestinationState
from federation_sender.storage.engine import create_engine
from federation_sender.storage.migrate import upgrade
from federation_sender.testing.certs import CertFiles
from federation_sender.testing.clock import FakeClock
from federation_sender.testing.fake_homeserver import FakeHomeserver
from federation_sender.testing.forward_proxy_server import (
    ProxyServer,
    TinyproxyMissing,
    tinyproxy,
)
from federation_sender.testing.prereq import missing
from federation_sender.testing.queue_harness import ALICE, ME, Harness, room_with
from federation_sender.testing.queue_writer import HomeserverWriter
from federation_sender.testing.waiting import wait_until
from federation_sender.transport.forward_proxy import ProxyPolicy, policy_from_environment
from federation_sender.transport.result import Outcome, Transaction
from federation_sender.transport.signing import SigningKey

from .conftest import FakeRemote, make_client

CLIENTS = ["builtin", "aiohttp"]


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[ProxyServer]:
    try:
        with tinyproxy(tmp_path / "proxy") as server:
            yield server
    except TinyproxyMissing:
        missing("tinyproxy")


@pytest.fixture
def auth_proxy(tmp_path: Path) -> Iterator[ProxyServer]:
    try:
        with tinyproxy(tmp_path / "auth-proxy", credentials=("fed", "pass-word_1")) as server:
            yield server
    except TinyproxyMissing:
        missing("tinyproxy")


def txn(destination: str, txn_id: str = "t1") -> Transaction:
    return Transaction(destination=destination, txn_id=txn_id, pdus=[],
                       edus=[{"edu_type": "m.test", "content": {}}])


def policy(url: str, no_proxy: tuple[str, ...] = ()) -> ProxyPolicy:
    return ProxyPolicy.from_settings(None, url, no_proxy)


@pytest.mark.parametrize("http_client", CLIENTS)
async def test_send_goes_through_the_proxy(
    certs: CertFiles, our_key: SigningKey, remote: FakeRemote, proxy: ProxyServer,
    http_client: str,
) -> None:
    async with make_client(certs, our_key, proxy_policy=policy(proxy.url()),
                           http_client=http_client) as client:
        result = await client.send_transaction(txn(remote.name))
    assert result.outcome is Outcome.SUCCESS, result
    assert proxy.connects() == [remote.name]
    assert remote.requests[0][0].headers["Host"] == remote.name


@pytest.mark.parametrize("http_client", CLIENTS)
async def test_credentials_are_sent_and_a_407_is_one_clear_error(
    certs: CertFiles, our_key: SigningKey, remote: FakeRemote, auth_proxy: ProxyServer,
    http_client: str, caplog: pytest.LogCaptureFixture,
) -> None:
    good = policy(auth_proxy.url(("fed", "pass-word_1")))
    async with make_client(certs, our_key, proxy_policy=good, http_client=http_client) as c:
        assert (await c.send_transaction(txn(remote.name))).outcome is Outcome.SUCCESS
    # No credentials: 407. Wrong ones: tinyproxy 1.11 says 401, taken as the same.
    for url, status in ((auth_proxy.url(), "407"), (auth_proxy.url(("fed", "wrong")), "401")):
        caplog.clear()
        with caplog.at_level(logging.DEBUG, "federation_sender.transport"):
            async with make_client(certs, our_key, proxy_policy=policy(url),
                                   http_client=http_client) as c:
                first = await c.send_transaction(txn(remote.name, "t2"))
                second = await c.send_transaction(txn(remote.name, "t3"))
        assert first.outcome is Outcome.TRANSIENT and second.outcome is Outcome.TRANSIENT
        assert f"{status} Proxy Authentication Required" in (first.error or ""), first
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and status in errors[0].getMessage(), errors
        assert "wrong" not in caplog.text  # the password is never logged
    assert len(remote.requests) == 1


@pytest.mark.parametrize("http_client", CLIENTS)
@pytest.mark.parametrize("entry", ["127.0.0.1", "127.0.0.0/8", "*"])
async def test_no_proxy_host_bypasses_the_proxy(
    certs: CertFiles, our_key: SigningKey, remote: FakeRemote, proxy: ProxyServer,
    http_client: str, entry: str,
) -> None:
    async with make_client(certs, our_key, proxy_policy=policy(proxy.url(), (entry,)),
                           http_client=http_client) as client:
        result = await client.send_transaction(txn(remote.name))
    assert result.outcome is Outcome.SUCCESS, result
    assert proxy.connects() == []


@pytest.mark.parametrize("http_client", CLIENTS)
async def test_proxy_down_is_a_transient_failure(
    certs: CertFiles, our_key: SigningKey, remote: FakeRemote, proxy: ProxyServer,
    http_client: str,
) -> None:
    proxy.stop()
    async with make_client(certs, our_key, proxy_policy=policy(proxy.url()),
                           http_client=http_client) as client:
        result = await client.send_transaction(txn(remote.name))
    assert result.outcome is Outcome.TRANSIENT, result
    assert "connect" in (result.error or "").lower()
    assert remote.requests == []


async def test_proxy_down_backs_off_the_destination_and_it_is_delivered_once_back(
    certs: CertFiles, our_key: SigningKey, remote: FakeRemote, proxy: ProxyServer,
    sqlite_url: str,
) -> None:
    """The queue engine with our client behind a proxy that goes down: the destination
    backs off on Synapse's schedule (10 minutes first), the return probe (a minute after
    the failure, through the proxy like everything else) finds it back, and the event
    goes out at once instead of after the backoff; nothing is lost."""
    clock = FakeClock()
    engine = create_engine(sqlite_url)
    await upgrade(engine)
    client = make_client(certs, our_key, clock=clock, proxy_policy=policy(proxy.url()))
    await client.start()
    h = Harness(engine, clock, FakeHomeserver(), client,  # type: ignore[arg-type]
                HomeserverWriter(engine, ME), replace(QueueSettings(), wakeup_interval_s=60))
    h.without_short_retry()  # the persisted schedule, which the proxy's outage must reach
    try:
        proxy.stop()
        await room_with(h, "!a:l", remote.name)
        await h.start()
        event = await h.writer.message("!a:l", ALICE)
        h.poke()
        await h.settle()
        status = h.m.status(remote.name)
        assert status is not None and status.state is DestinationState.BACKING_OFF
        assert status.retry_interval_ms == 600_000 and "connect" in (status.last_error or "")
        assert remote.requests == []
        proxy.start()
        await h.advance(59)
        assert remote.requests == []  # the first return probe is due a minute after

        def sends() -> list[bytes]:
            return [body for req, body in remote.requests if req.method == "PUT"]

        await h.advance(1)
        await wait_until(lambda: len(sends()), "the retried transaction",
                         accept=lambda n: n == 1, timeout_s=10)
        assert event.event_id in sends()[0].decode()
        assert remote.requests[0][0].path == "/_matrix/federation/v1/version"
        assert set(proxy.connects()) == {remote.name}
        await h.settle()
        assert h.m.status(remote.name).state is DestinationState.IDLE  # type: ignore[union-attr]
    finally:
        if h.manager is not None:
            await h.manager.stop(0.0)
        await client.close()
        await engine.dispose()


async def test_well_known_and_forwarded_requests_go_through_the_proxy(
    certs: CertFiles, our_key: SigningKey, remote: FakeRemote, proxy: ProxyServer,
) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        if request.path == "/.well-known/matrix/server":
            return web.json_response({"m.server": f"localhost:{remote.port}"})
        return web.json_response({"pdus": {}})

    remote.handler = handler
    async with make_client(certs, our_key, proxy_policy=policy(proxy.url()),
                           well_known_port=remote.port) as client:
        result = await client.send_transaction(txn("localhost"))
        async with client.open_stream("GET", "localhost", "/_matrix/key/v2/server", {}, None,
                                      timeout_s=5.0) as response:
            assert response.status == 200
    assert result.outcome is Outcome.SUCCESS, result
    assert proxy.connects() == [f"localhost:{remote.port}"] * 3  # well-known, /send, GET
    assert remote.requests[0][0].path == "/.well-known/matrix/server"


def test_parse_proxy_forms() -> None:
    p = parse_proxy("https_proxy", "http://us%40er:p%3Ass@proxy.internal:3128/")
    assert (p.host, p.port, p.username, p.password) == ("proxy.internal", 3128, "us@er", "p:ss")
    assert p.authorization == "Basic dXNAZXI6cDpzcw=="
    assert "p:ss" not in repr(p) and p.url == "http://proxy.internal:3128"
    bare = parse_proxy("https_proxy", "10.0.0.1")
    assert (bare.host, bare.port, bare.authorization) == ("10.0.0.1", 1080, None)
    assert parse_proxy("x", "[::1]:8080").url == "http://[::1]:8080"
    with pytest.raises(ConfigError, match="https:// proxies are not supported"):
        parse_proxy("https_proxy", "https://proxy:443")
    with pytest.raises(ConfigError) as bad:
        parse_proxy("https_proxy", "http://u:secret@proxy:99999")
    assert "secret" not in str(bad.value)


def test_no_proxy_matching() -> None:
    p = policy("http://proxy:3128", ("matrix.org", ".example.com", "10.1.2.3", "192.168.0.0/16",
                                     "::1"))
    assert p.proxy_for("matrix.org", tls=True) is None
    assert p.proxy_for("sub.matrix.org", tls=True) is None
    assert p.proxy_for("notmatrix.org", tls=True) is not None
    assert p.proxy_for("example.com", tls=True) is None
    assert p.proxy_for("10.1.2.3", tls=True) is None
    assert p.proxy_for("10.1.2.4", tls=True) is not None
    assert p.proxy_for("192.168.7.7", tls=True) is None
    assert p.proxy_for("[::1]", tls=True) is None
    assert p.proxy_for("matrix.org", tls=False) is None  # no http_proxy: direct anyway
    assert p.proxy_for("elsewhere.org", tls=False) is None


def test_environment_lower_case_first() -> None:
    env = {"HTTPS_PROXY": "http://upper:1", "https_proxy": "http://lower:2",
           "NO_PROXY": "a.org,b.org"}
    assert policy_from_environment(env) == (None, "http://lower:2", ["a.org", "b.org"])
