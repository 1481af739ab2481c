"""The worker's key listener: HTTPS with the configured certificate, clear errors."""

from __future__ import annotations

import logging
import ssl
from pathlib import Path

import aiohttp
import pytest

from federation_sender.app.worker import Worker
from federation_sender.clock import SystemClock, time_ms
from federation_sender.config import (
    AdminSettings,
    DatabaseSettings,
    FederationSettings,
    ReplicationSettings,
    Settings,
    TelemetrySettings,
)
from federation_sender.config.loading import load_settings
from federation_sender.errors import ConfigError
from federation_sender.testing.certs import LoopbackCA
from federation_sender.testing.ports import free_port
from federation_sender.transport.keyserver import (
    SERVER_KEYS_PATH,
    KeyListenerTlsError,
    parse_server_keys,
    server_ssl_context,
)


def settings(tmp_path: Path, port: int, certs: tuple[Path, Path] | None) -> Settings:
    return Settings(
        server_name=f"localhost:{port}",
        data_dir=str(tmp_path),
        database=DatabaseSettings(url=f"sqlite:///{tmp_path}/w.db"),
        replication=ReplicationSettings(transport="none"),
        federation=FederationSettings(
            signing_key_path=str(tmp_path / "signing.key"),
            key_listener_port=port,
            key_listener_bind="127.0.0.1",
            tls_certificate_path=None if certs is None else str(certs[0]),
            tls_private_key_path=None if certs is None else str(certs[1]),
        ),
        admin=AdminSettings(enabled=False),
        telemetry=TelemetrySettings(metrics_port=None),
    )


async def test_keys_are_served_over_https_with_the_configured_certificate(
    tmp_path: Path, loopback_ca: LoopbackCA
) -> None:
    certs = loopback_ca.issue(tmp_path / "tls", ["localhost", "127.0.0.1"])
    port = free_port()
    worker = await Worker.create(settings(tmp_path, port, (certs.cert, certs.key)))
    try:
        await worker.start()
        assert worker.servers[-1].url == f"https://127.0.0.1:{port}"
        verify = ssl.create_default_context(cafile=str(loopback_ca.cert_path))
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"https://localhost:{port}{SERVER_KEYS_PATH}", ssl=verify) as r,
        ):
            doc = await r.json()
        keys = parse_server_keys(
            doc, server_name=f"localhost:{port}", now_ms=time_ms(SystemClock())
        )
        assert worker.signing_key is not None
        assert list(keys) == [worker.signing_key.key_id]
    finally:
        await worker.stop(deadline_s=1.0)


async def test_plain_http_key_listener_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    worker = await Worker.create(settings(tmp_path, free_port(), None))
    try:
        with caplog.at_level(logging.WARNING, logger="federation_sender.app"):
            await worker.start()
        assert worker.servers[-1].url.startswith("http://")
        assert "key listener serves plain HTTP" in caplog.text
    finally:
        await worker.stop(deadline_s=1.0)


def test_certificate_without_key_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"federation\.tls_private_key_path"):
        load_settings(None, environ={"FEDERATION_SENDER__FEDERATION__TLS_CERTIFICATE_PATH": "c"})


def test_unusable_certificate_files_are_one_line(tmp_path: Path, loopback_ca: LoopbackCA) -> None:
    with pytest.raises(KeyListenerTlsError, match="no such file") as missing:
        server_ssl_context(str(tmp_path / "nope.pem"), str(tmp_path / "nope.key"))
    one = loopback_ca.issue(tmp_path / "one", ["localhost"])
    other = loopback_ca.issue(tmp_path / "other", ["localhost"])
    with pytest.raises(KeyListenerTlsError, match="cannot load") as mismatch:
        server_ssl_context(str(one.cert), str(other.key))
    assert "\n" not in str(missing.value) + str(mismatch.value)
