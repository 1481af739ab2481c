"""docs/synapse-reference.md's table of every key Synapse's federation sender reads, proved row by
row: each row has a probe here that sets the key and shows what it does (honoured,
validated) or that the worker refuses it at start (refused: ``federation-sender
check-config`` exits 2 with one line naming the key); the test a row cites must exist."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from federation_sender import cli
from federation_sender.admin.server import start_http_server
from federation_sender.builders import build_federation_client
from federation_sender.clock import SystemClock
from federation_sender.config import Settings
from federation_sender.errors import ConfigError
from federation_sender.storage.synapse.backend import SynapseBackend
from federation_sender.storage.synapse.database import create_synapse_engine
from federation_sender.synapse.config import SynapseConfig, parse_synapse_config
from federation_sender.synapse.egress import build_outbound_proxy, worker_listeners
from federation_sender.synapse.merge import merge_settings
from federation_sender.synapse.wiring import SynapseEdus, synapse_edus
from federation_sender.testing.certs import LoopbackCA
from federation_sender.testing.ports import free_port
from federation_sender.testing.synapse_config import minimal_worker_tree
from federation_sender.transport.signing import SigningKey

ROOT = Path(__file__).resolve().parents[2]
BASE = minimal_worker_tree()
KEY = SigningKey.generate("a_key")


def rows() -> list[tuple[str, str, str, str]]:
    text = (ROOT / "docs" / "synapse-reference.md").read_text()
    table = text.split("<!-- key-table -->", 1)[1].split("<!-- /key-table -->", 1)[0]
    out = []
    for line in table.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 5, line
        out.append((cells[0], cells[1], cells[2], cells[4]))
    return out


def syn(keys: dict[str, Any], drop: tuple[str, ...] = ()) -> SynapseConfig:
    tree = {k: v for k, v in {**BASE, **keys}.items() if k not in drop}
    return parse_synapse_config(tree)


def merged(keys: dict[str, Any], drop: tuple[str, ...] = ()) -> Settings:
    return merge_settings(Settings(), syn(keys, drop))


def refused(keys: dict[str, Any], key: str, drop: tuple[str, ...] = ()) -> None:
    with pytest.raises(ConfigError, match=re.escape(key)):
        merged(keys, drop)


def cli_refuses(tmp_path: Path, keys: dict[str, Any], key: str) -> None:
    """At start, as an operator sees it: one line naming the key, exit status 2. The
    CLI's own entry point, in this process (a subprocess per row cost 2-3 s each);
    tests/test_deployment.py runs the installed command itself."""
    path = tmp_path / "homeserver.yaml"
    path.write_text(json.dumps({**BASE, **keys}))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = cli.main(["check-config", "--synapse-config", str(path)])
    assert status == 2, err.getvalue()
    text = err.getvalue()
    assert len(text.strip().splitlines()) == 1 and f"'{key}'" in text, text


def restricted(port: int, **entry: Any) -> dict[str, Any]:
    return {"outbound_federation_restricted_to": ["fed1"], "worker_replication_secret": "s",
            "instance_map": {"main": {"host": "127.0.0.1", "port": 1},
                             "fed1": {"host": "127.0.0.1", "port": port, **entry}}}


async def get(url: str, ssl_context: ssl.SSLContext | bool = True) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.get(url, ssl=ssl_context) as r:
        return r.status, await r.text()


async def proxy_answers(keys: dict[str, Any], port: int,
                        ssl_context: ssl.SSLContext | None = None) -> int:
    s = syn(keys)
    settings = merge_settings(Settings(), s)
    client = build_federation_client(settings, KEY, SystemClock())
    proxy = build_outbound_proxy(settings, s, client, SystemClock(), CollectorRegistry())
    assert proxy is not None
    await proxy.start()
    try:
        scheme = "https" if ssl_context else "http"
        status, _ = await get(f"{scheme}://127.0.0.1:{port}/health", ssl_context or True)
        return status
    finally:
        await proxy.close()


# --- probes -------------------------------------------------------------------------------

def p_server_name(tmp: Path) -> None:
    assert merged({"server_name": "b.example"}).server_name == "b.example"


def p_signing_key(tmp: Path) -> None:
    assert merged({"signing_key_path": "/k"}).federation.signing_key_path == "/k"


def p_database(tmp: Path) -> None:
    url = merged({"database": {"name": "psycopg2", "args": {"dbname": "d2", "host": "h"}}})
    assert url.database.url == "postgresql://h/d2"
    refused({"database": {"name": "sqlite3", "args": {"database": "x.db"}}}, "database.name")


def p_redis(tmp: Path) -> None:
    assert merged({"redis": {"enabled": True, "host": "r", "port": 7}}).replication.redis_url \
        == "redis://r:7/0"
    refused({"redis": {"enabled": False}}, "redis.enabled")


def p_instances(tmp: Path) -> None:
    assert merged({"federation_sender_instances": ["fed1", "fed2"]}).sharding.mode == "static"
    refused({"federation_sender_instances": ["other"]}, "federation_sender_instances")


def p_send_federation(tmp: Path) -> None:
    legacy = {"send_federation": False, "worker_app": "synapse.app.federation_sender"}
    assert syn(legacy, drop=("federation_sender_instances",)
               ).federation_sender_instances == ("fed1",)
    refused({}, "federation_sender_instances", drop=("federation_sender_instances",))


def p_worker_app(tmp: Path) -> None:
    merged({"worker_app": "synapse.app.generic_worker"})
    cli_refuses(tmp, {"worker_app": "synapse.app.pusher"}, "worker_app")


def p_worker_name(tmp: Path) -> None:
    assert merged({"worker_name": "fed2", "federation_sender_instances": ["fed2"]}
                  ).instance_name == "fed2"


def p_worker_listeners(tmp: Path) -> None:
    port = free_port()
    keys = {"worker_listeners": [{"port": port, "type": "http", "bind_addresses": ["127.0.0.1"],
                                  "resources": [{"names": ["health", "metrics"]}]}]}
    s = syn(keys)
    [(_, bind, lport, app, _tls)] = worker_listeners(merge_settings(Settings(), s), s,
                                                      CollectorRegistry())

    async def serve() -> tuple[int, int]:
        server = await start_http_server(app, bind, lport)
        try:
            health, _ = await get(f"http://127.0.0.1:{port}/health")
            metrics, _ = await get(f"http://127.0.0.1:{port}/metrics")
            return health, metrics
        finally:
            await server.stop()

    assert asyncio.run(serve()) == (200, 200)
    cli_refuses(tmp, {"worker_listeners": [{"port": port, "type": "http", "resources": [
        {"names": ["client"]}]}]}, "worker_listeners[0].resources")


def p_instance_map(tmp: Path) -> None:
    port = free_port()
    assert asyncio.run(proxy_answers(restricted(port), port)) == 200
    refused({**restricted(port), "instance_map": {}}, "instance_map.fed1")


def p_restricted_to(tmp: Path) -> None:
    p_instance_map(tmp)
    cli_refuses(tmp, {**restricted(1), "outbound_federation_restricted_to": ["fed9"]},
                "outbound_federation_restricted_to")


def p_secret(tmp: Path) -> None:
    assert syn(restricted(1)).worker_replication_secret == "s"
    refused({**restricted(1), "worker_replication_secret": None}, "worker_replication_secret")


def p_secret_path(tmp: Path) -> None:
    (tmp / "secret").write_text("from-a-file\n")
    keys = {**restricted(1), "worker_replication_secret": None,
            "worker_replication_secret_path": str(tmp / "secret")}
    assert syn(keys).worker_replication_secret == "from-a-file"
    refused({**keys, "worker_replication_secret": "x"}, "worker_replication_secret_path")


def p_tls_paths(tmp: Path) -> None:
    ca = LoopbackCA.create(tmp / "ca")
    certs = ca.issue(tmp / "ca", ["127.0.0.1"])
    port = free_port()
    keys = {**restricted(port, tls=True), "tls_certificate_path": str(certs.cert),
            "tls_private_key_path": str(certs.key)}
    context = ssl.create_default_context(cafile=str(ca.cert_path))
    assert asyncio.run(proxy_answers(keys, port, context)) == 200
    with pytest.raises(ConfigError, match="tls_certificate_path"):
        s = syn(restricted(port, tls=True))
        settings = merge_settings(Settings(), s)
        build_outbound_proxy(settings, s, build_federation_client(settings, KEY, SystemClock()),
                             SystemClock(), CollectorRegistry())


def p_domain_whitelist(tmp: Path) -> None:
    s = syn({"federation_domain_whitelist": ["b.example"]})
    assert s.domain_allowed("b.example") and not s.domain_allowed("c.example")


def p_deny(tmp: Path) -> None:
    assert merged({"ip_range_blacklist": ["203.0.113.0/24"]}).federation.ip_deny_list == [
        "203.0.113.0/24"]


def p_old_deny(tmp: Path) -> None:
    assert merged({"federation_ip_range_blacklist": ["203.0.113.0/24"]}).federation \
        .ip_deny_list == ["203.0.113.0/24"]


def p_allow(tmp: Path) -> None:
    assert merged({"ip_range_whitelist": ["10.0.0.0/8"]}).federation.ip_allow_list == [
        "10.0.0.0/8"]


def client_for(keys: dict[str, Any]) -> Any:
    return build_federation_client(merged(keys), KEY, SystemClock())


def p_verify(tmp: Path) -> None:
    assert client_for({"federation_verify_certificates": False})._ssl is False


def p_ca_list(tmp: Path) -> None:
    ca = LoopbackCA.create(tmp / "ca2", "a CA")
    client = client_for({"federation_custom_ca_list": [str(ca.cert_path)]})
    assert [c["subject"] for c in client._ssl.get_ca_certs()] == [((("commonName", "a CA"),),)]


def p_min_tls(tmp: Path) -> None:
    client = client_for({"federation_client_minimum_tls_version": "1.3"})
    assert client._ssl.minimum_version is ssl.TLSVersion.TLSv1_3


def p_whitelist(tmp: Path) -> None:
    client = client_for({"federation_certificate_verification_whitelist": ["*.internal"]})
    assert client._ssl_for("a.internal") is client._unverified
    assert client._ssl_for("a.example") is client._ssl


def p_user_agent(tmp: Path) -> None:
    assert client_for({"user_agent_suffix": "ops"})._user_agent == "federation-sender ops"


def p_proxies(tmp: Path) -> None:
    client = client_for({"https_proxy": "http://p.internal:3128", "no_proxy_hosts": ["x.org"]})
    assert client._proxy.proxy_for("a.org", tls=True).host == "p.internal"
    assert client._proxy.proxy_for("x.org", tls=True) is None


def p_proxy_env(tmp: Path) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HTTPS_PROXY", "http://env.internal:8080")
        mp.setenv("NO_PROXY", "y.org")
        s = syn({})
        assert (s.https_proxy, s.no_proxy_hosts) == ("http://env.internal:8080", ("y.org",))
        assert syn({"https_proxy": "http://yaml:1"}).https_proxy == "http://yaml:1"


def p_client_timeout(tmp: Path) -> None:
    assert merged({"federation": {"client_timeout": "7s"}}).federation.request_timeout_s == 7


def p_retries(tmp: Path) -> None:
    s = syn({"federation": {"max_long_retries": 4, "max_short_retries": 2,
                            "max_long_retry_delay": "3s", "max_short_retry_delay": "1s"}})
    assert (s.max_long_retries, s.max_short_retries, s.max_long_retry_delay_ms,
            s.max_short_retry_delay_ms) == (4, 2, 3000, 1000)
    q = merged({"federation": {"max_long_retries": 4, "max_short_retries": 2,
                               "max_long_retry_delay": "3s", "max_short_retry_delay": "1s"}}
               ).queue
    assert (q.max_long_retries, q.max_short_retries, q.max_long_retry_delay_s,
            q.max_short_retry_delay_s) == (4, 2, 3.0, 1.0)
    cli_refuses(tmp, {"federation": {"max_long_retries": -1}}, "federation.max_long_retries")


def p_backoff(tmp: Path) -> None:
    q = merged({"federation": {"destination_min_retry_interval": "1m",
                               "destination_retry_multiplier": 3,
                               "destination_max_retry_interval": "1h"}}).queue
    assert (q.backoff_initial_s, q.backoff_multiplier, q.backoff_max_s) == (60, 3, 3600)


def p_metrics_domains(tmp: Path) -> None:
    assert merged({"federation_metrics_domains": ["b.example"]}).federation.metrics_domains \
        == ["b.example"]


def edus(keys: dict[str, Any]) -> SynapseEdus:
    s = syn(keys)
    engine = create_synapse_engine("postgresql://nobody@127.0.0.1:1/none")
    backend = SynapseBackend(engine, s, "fed1", SystemClock())
    rooms = backend.capabilities().edu_rooms
    found = synapse_edus(rooms, s, None, SystemClock())  # type: ignore[arg-type]
    assert found is not None
    return found


def p_rr(tmp: Path) -> None:
    assert edus({"federation_rr_transactions_per_room_per_second": 4}).receipt_max_delay_s \
        == 0.25


def p_presence(tmp: Path) -> None:
    assert edus({}).presence is not None
    assert edus({"presence": {"enabled": False}}).presence is None
    assert edus({"use_presence": False}).presence is None


def p_exclude(tmp: Path) -> None:
    fanout = edus({"exclude_rooms_from_presence": ["!r:a.example"]}).presence
    assert fanout is not None and fanout._excluded == {"!r:a.example"}


def p_granularity(tmp: Path) -> None:
    fanout = edus({"presence": {"last_active_granularity": "5m"}}).presence
    assert fanout is not None and fanout._granularity_ms == 300_000


def p_device_names(tmp: Path) -> None:
    assert syn({"allow_device_name_lookup_over_federation": True}
               ).allow_device_name_lookup_over_federation


def duty(key: str, value: Any) -> Callable[[Path], None]:
    def probe(tmp: Path) -> None:
        merged({key: ["main"] if isinstance(value, list) else "main"})  # not ours: accepted
        cli_refuses(tmp, {key: value}, key)
    return probe


def p_stream_writers(tmp: Path) -> None:
    assert syn({"stream_writers": {"events": ["persister1", "persister2"]}}
               ).event_writers == ("persister1", "persister2")
    assert syn({}).event_writers == ("master",)
    assert syn({"stream_writers": {"device_lists": ["main", "dl1"]}}
               ).device_list_writers == ("main", "dl1")
    assert syn({"stream_writers": {"device_lists": "dl1"}}).device_list_writers == ("dl1",)
    assert syn({}).device_list_writers == ("master",)
    merged({"stream_writers": {"typing": "main"}})
    cli_refuses(tmp, {"stream_writers": {"typing": ["fed1"]}}, "stream_writers.typing")


PROBES: dict[tuple[str, str], Callable[[Path], None]] = {
    ("`server_name`", "homeserver"): p_server_name,
    ("`signing_key_path`", "homeserver"): p_signing_key,
    ("`database`", "homeserver"): p_database,
    ("`redis`", "homeserver"): p_redis,
    ("`federation_sender_instances`", "homeserver"): p_instances,
    ("`send_federation`", "homeserver"): p_send_federation,
    ("`worker_app`", "worker"): p_worker_app,
    ("`worker_name`", "worker"): p_worker_name,
    ("`worker_listeners`", "worker"): p_worker_listeners,
    ("`instance_map`", "homeserver"): p_instance_map,
    ("`outbound_federation_restricted_to`", "homeserver"): p_restricted_to,
    ("`worker_replication_secret`", "homeserver"): p_secret,
    ("`worker_replication_secret_path`", "homeserver"): p_secret_path,
    ("`tls_certificate_path`, `tls_private_key_path`", "homeserver"): p_tls_paths,
    ("`federation_domain_whitelist`", "homeserver"): p_domain_whitelist,
    ("`ip_range_blacklist`", "homeserver"): p_deny,
    ("`federation_ip_range_blacklist`", "homeserver"): p_old_deny,
    ("`ip_range_whitelist`", "homeserver"): p_allow,
    ("`federation_verify_certificates`", "homeserver"): p_verify,
    ("`federation_custom_ca_list`", "homeserver"): p_ca_list,
    ("`federation_client_minimum_tls_version`", "homeserver"): p_min_tls,
    ("`federation_certificate_verification_whitelist`", "homeserver"): p_whitelist,
    ("`user_agent_suffix`", "homeserver"): p_user_agent,
    ("`http_proxy`, `https_proxy`, `no_proxy_hosts`", "homeserver"): p_proxies,
    ("`http_proxy`, `https_proxy`, `no_proxy`", "environment"): p_proxy_env,
    ("`federation.client_timeout`", "homeserver"): p_client_timeout,
    ("`federation.max_long_retries`, `max_short_retries`, `max_long_retry_delay`, "
     "`max_short_retry_delay`", "homeserver"): p_retries,
    ("`federation.destination_min_retry_interval`, `destination_retry_multiplier`, "
     "`destination_max_retry_interval`", "homeserver"): p_backoff,
    ("`federation_metrics_domains`", "homeserver"): p_metrics_domains,
    ("`federation_rr_transactions_per_room_per_second`", "homeserver"): p_rr,
    ("`presence.enabled` (`use_presence`)", "homeserver"): p_presence,
    ("`exclude_rooms_from_presence`", "homeserver"): p_exclude,
    ("`presence.last_active_granularity`", "homeserver"): p_granularity,
    ("`allow_device_name_lookup_over_federation`", "homeserver"): p_device_names,
    ("`experimental_features.msc4354_enabled`", "homeserver"): lambda tmp: cli_refuses(
        tmp, {"experimental_features": {"msc4354_enabled": True}},
        "experimental_features.msc4354_enabled"),
    ("`run_background_tasks_on`", "homeserver"): duty("run_background_tasks_on", "fed1"),
    ("`pusher_instances`", "homeserver"): duty("pusher_instances", ["fed1"]),
    ("`notify_appservices_from_worker`", "homeserver"): duty(
        "notify_appservices_from_worker", "fed1"),
    ("`update_user_directory_from_worker`", "homeserver"): duty(
        "update_user_directory_from_worker", "fed1"),
    ("`media_instance_running_background_jobs`", "homeserver"): duty(
        "media_instance_running_background_jobs", "fed1"),
    ("`stream_writers`", "homeserver"): p_stream_writers,
}


def test_every_row_has_a_probe_and_every_probe_a_row() -> None:
    assert {(k, f) for k, f, _, _ in rows()} == set(PROBES)
    assert {t for _, _, t, _ in rows()} <= {"honoured", "refused", "validated"}


@pytest.mark.parametrize(("key", "file", "treatment", "proof"), rows(),
                         ids=[f"{r[0]}@{r[1]}" for r in rows()])
def test_row(key: str, file: str, treatment: str, proof: str, tmp_path: Path) -> None:
    PROBES[(key, file)](tmp_path)
    if proof != "probe":
        module, _, function = proof.partition("::")
        found = list((ROOT / "tests").rglob(module))
        assert found, f"{proof}: no such test file"
        if function:
            assert f"def {function}(" in found[0].read_text(), f"{proof}: no such test"
