"""homeserver.yaml's TLS and client settings, each from the key to what a remote sees:
the key is read (synapse/config.py), merged into our settings (synapse/merge.py) and
built into the client (builders.py) that then talks to loopback TLS servers."""

from __future__ import annotations

import asyncio
import dataclasses
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from federation_sender.builders import build_federation_client
from federation_sender.clock import SystemClock
from federation_sender.config import Settings
from federation_sender.errors import ConfigError
from federation_sender.synapse.config import parse_synapse_config
from federation_sender.synapse.merge import merge_settings
from federation_sender.testing.certs import CertFiles, LoopbackCA
from federation_sender.testing.synapse_config import minimal_worker_tree
from federation_sender.transport.client import FederationClient
from federation_sender.transport.domain_metrics import LAST_SENT_PDU_TIME, DomainMetrics
from federation_sender.transport.result import Outcome, Transaction
from federation_sender.transport.signing import SigningKey

from .conftest import FakeRemote, start_remote

BASE = minimal_worker_tree(server_name="origin.test", signing_key_path="/unused/signing.key",
                           ip_range_whitelist=["127.0.0.0/8", "::1/128"])


def settings_from(keys: dict[str, Any], **ours: Any) -> Settings:
    merged = merge_settings(Settings(), parse_synapse_config({**BASE, **keys}))
    return dataclasses.replace(merged, federation=dataclasses.replace(merged.federation, **ours))


def client_from(key: SigningKey, keys: dict[str, Any], **ours: Any) -> FederationClient:
    return build_federation_client(settings_from(keys, **ours), key, SystemClock())


def txn(destination: str, txn_id: str = "t1", pdus: int = 0) -> Transaction:
    return Transaction(destination=destination, txn_id=txn_id,
                       pdus=[{"event_id": f"$e{i}", "origin_server_ts": 1_700_000_000_000 + i}
                             for i in range(pdus)],
                       edus=[{"edu_type": "m.test", "content": {}}])  # fmt: skip


@dataclasses.dataclass
class Server:
    port: int
    runner: web.AppRunner
    user_agents: list[str]


async def tls_server(certs: CertFiles, *, max_version: ssl.TLSVersion | None = None
                     ) -> Server:
    ctx = certs.server_context()
    if max_version is not None:
        ctx.maximum_version = max_version
    agents: list[str] = []

    async def send(request: web.Request) -> web.Response:
        agents.append(request.headers.get("User-Agent", ""))
        return web.json_response({"pdus": {}})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", send)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
    await site.start()
    return Server(site._server.sockets[0].getsockname()[1], runner, agents)  # type: ignore[union-attr]


@pytest.fixture
async def tls12(certs: CertFiles) -> AsyncIterator[Server]:
    server = await tls_server(certs, max_version=ssl.TLSVersion.TLSv1_2)
    yield server
    await server.runner.cleanup()


@pytest.mark.parametrize("http_client", ["builtin", "aiohttp"])
@pytest.mark.parametrize(("minimum", "outcome"), [("1.2", Outcome.SUCCESS),
                                                  (1.3, Outcome.TRANSIENT)])
async def test_federation_client_minimum_tls_version(
    certs: CertFiles, our_key: SigningKey, tls12: Server, http_client: str, minimum: object,
    outcome: Outcome,
) -> None:
    keys = {"federation_custom_ca_list": [str(certs.ca_cert)],
            "federation_client_minimum_tls_version": minimum}
    async with client_from(our_key, keys, http_client=http_client) as client:
        result = await client.send_transaction(txn(f"localhost:{tls12.port}"))
    assert result.outcome is outcome, result
    assert len(tls12.user_agents) == (1 if outcome is Outcome.SUCCESS else 0)


def test_minimum_tls_version_values_are_synapses() -> None:
    with pytest.raises(ConfigError, match="federation_client_minimum_tls_version"):
        settings_from({"federation_client_minimum_tls_version": "1.4"})
    assert settings_from({"federation_client_minimum_tls_version": 1}).federation \
        .tls_min_version == "1"


@pytest.mark.parametrize("http_client", ["builtin", "aiohttp"])
@pytest.mark.parametrize(("whitelist", "outcome"), [
    ([], Outcome.TRANSIENT),                   # the test CA is not trusted: refused
    (["*.example.org"], Outcome.TRANSIENT),    # a whitelist that does not match
    (["loc?lh*"], Outcome.SUCCESS),            # wildcards, matching "localhost"
    (["LOCALHOST"], Outcome.SUCCESS),          # case-insensitive, as Synapse
])
async def test_federation_certificate_verification_whitelist(
    our_key: SigningKey, remote: FakeRemote, http_client: str, whitelist: list[str],
    outcome: Outcome,
) -> None:
    keys = {"federation_certificate_verification_whitelist": whitelist}
    async with client_from(our_key, keys, http_client=http_client) as client:
        result = await client.send_transaction(txn(f"localhost:{remote.port}"))
    assert result.outcome is outcome, result


async def test_several_custom_ca_files_and_they_replace_the_others(
    certs: CertFiles, our_key: SigningKey, remote: FakeRemote, tmp_path: Path
) -> None:
    other_ca = LoopbackCA.create(tmp_path / "other-ca", "another test CA")
    other = other_ca.issue(tmp_path / "other-ca", ["localhost", "127.0.0.1"])
    second, runner = await start_remote(other)
    try:
        both = {"federation_custom_ca_list": [str(certs.ca_cert), str(other.ca_cert)]}
        async with client_from(our_key, both) as client:
            first = await client.send_transaction(txn(f"localhost:{remote.port}"))
            then = await client.send_transaction(txn(f"localhost:{second.port}"))
        assert (first.outcome, then.outcome) == (Outcome.SUCCESS, Outcome.SUCCESS)
        only_other = {"federation_custom_ca_list": [str(other.ca_cert)]}
        async with client_from(our_key, only_other) as client:
            refused = await client.send_transaction(txn(f"localhost:{remote.port}"))
        assert refused.outcome is Outcome.TRANSIENT and "TLS" in (refused.error or "")
    finally:
        await runner.cleanup()
    with pytest.raises(ConfigError, match="federation_custom_ca_list"):
        settings_from({"federation_custom_ca_list": []})


@pytest.mark.parametrize("http_client", ["builtin", "aiohttp"])
async def test_user_agent_suffix(
    certs: CertFiles, our_key: SigningKey, http_client: str
) -> None:
    server = await tls_server(certs)
    keys = {"federation_custom_ca_list": [str(certs.ca_cert)],
            "user_agent_suffix": "(example.org ops)"}
    try:
        async with client_from(our_key, keys, http_client=http_client) as client:
            await client.send_transaction(txn(f"localhost:{server.port}"))
            async with client.open_stream("GET", f"localhost:{server.port}", "/x", {}, None,
                                          timeout_s=5.0) as response:
                assert response.status == 200
    finally:
        await server.runner.cleanup()
    assert server.user_agents == ["federation-sender (example.org ops)"] * 2


async def test_client_timeout_bounds_each_request(
    certs: CertFiles, our_key: SigningKey, remote: FakeRemote
) -> None:
    never = asyncio.Event()

    async def stall(request: web.Request) -> web.StreamResponse:  # until released
        await never.wait()
        return web.json_response({"pdus": {}})

    remote.handler = stall
    keys = {"federation_custom_ca_list": [str(certs.ca_cert)],
            "federation": {"client_timeout": "1s"}}
    async with client_from(our_key, keys) as client:
        result = await client.send_transaction(txn(f"localhost:{remote.port}"))
    never.set()  # the remote's handler may end (the fixture's teardown waits for it)
    assert result.outcome is Outcome.TRANSIENT
    assert result.error == "no response within 1 s"


def test_retry_counts_and_delays_are_read_and_validated() -> None:
    syn = parse_synapse_config({**BASE, "federation": {
        "client_timeout": "20s", "max_long_retries": 2, "max_short_retries": 1,
        "max_long_retry_delay": "500ms", "max_short_retry_delay": 200}})  # fmt: skip
    assert (syn.client_timeout_ms, syn.max_long_retries, syn.max_short_retries,
            syn.max_long_retry_delay_ms, syn.max_short_retry_delay_ms) == (
        20_000, 2, 1, 500, 200)
    assert merge_settings(Settings(), syn).federation.request_timeout_s == 20.0
    for bad in ({"max_long_retries": -1}, {"max_short_retries": "3"},
                {"client_timeout": "0s"}, {"max_short_retry_delay": "soon"}):
        with pytest.raises(ConfigError, match="federation"):
            parse_synapse_config({**BASE, "federation": bad})


async def test_federation_metrics_domains(
    certs: CertFiles, our_key: SigningKey, remote: FakeRemote
) -> None:
    second, runner = await start_remote(certs)
    listed = f"localhost:{remote.port}"
    keys = {"federation_custom_ca_list": [str(certs.ca_cert)],
            "federation_metrics_domains": [listed]}
    registry = CollectorRegistry()
    try:
        async with client_from(our_key, keys) as client:
            client.domain_metrics = DomainMetrics(
                registry, settings_from(keys).federation.metrics_domains)
            await client.send_transaction(txn(listed, "a", pdus=3))
            await client.send_transaction(txn(f"localhost:{second.port}", "b", pdus=3))
    finally:
        await runner.cleanup()
    assert registry.get_sample_value(
        LAST_SENT_PDU_TIME, {"destination_server_name": listed}) == 1_700_000_000.002
    assert registry.get_sample_value(
        LAST_SENT_PDU_TIME, {"destination_server_name": f"localhost:{second.port}"}) is None
