"""deploy/config.example.yaml: every key of the settings, each with a comment, valid
for check-config, and a worker started on it says where its listeners answer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from federation_sender.config import Settings
from federation_sender.config.loading import iter_keys, load_settings
from federation_sender.testing.ports import free_port
from federation_sender.testing.waiting import wait_until_blocking

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "deploy" / "config.example.yaml"


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value and prefix + key not in (
                "federation.destination_overrides",):
            out.update(_flatten(value, prefix + key + "."))
        else:
            out[prefix + key] = value
    return out


def test_the_example_has_every_key_at_its_default() -> None:
    flat = _flatten(yaml.safe_load(EXAMPLE.read_text()))
    assert sorted(flat) == sorted(iter_keys())
    assert load_settings(EXAMPLE, environ={}) == Settings()


def test_every_key_of_the_example_is_commented() -> None:
    lines = EXAMPLE.read_text().splitlines()
    uncommented = []
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith("#") or stripped.endswith(":"):
            continue  # a comment, or a section header
        j = i - 1
        # A key is explained by the comment above it, or above the group of keys it is in.
        while j >= 0 and lines[j].strip() and not lines[j].strip().startswith("#") \
                and not lines[j].strip().endswith(":"):
            j -= 1
        if j < 0 or not lines[j].strip().startswith("#"):
            uncommented.append(stripped)
    assert uncommented == []


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FEDERATION_SENDER__")}
    return {**clean, **extra}


def test_check_config_accepts_the_example(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "federation_sender", "check-config", "-c",
                           str(EXAMPLE)], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path, env=_env(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert '"server_name": "localhost:8448"' in proc.stdout


def _worker_log_until_started(tmp_path: Path, env: dict[str, str]) -> str:
    """Run the worker on the example until its start line, stop it; its log."""
    log = tmp_path / "worker.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "federation_sender", "worker", "-c",
                                 str(EXAMPLE)], stdout=out, stderr=subprocess.STDOUT,
                                cwd=tmp_path, env=env)
    try:
        def started() -> bool:
            assert proc.poll() is None, log.read_text()
            return " started for " in log.read_text()

        wait_until_blocking(started, "the worker's start line", timeout_s=60, every_s=0.1,
                            details=log.read_text)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()
    return log.read_text()


def test_the_worker_on_the_example_says_where_it_listens(tmp_path: Path) -> None:
    admin, metrics = free_port(), free_port()
    env = _env(tmp_path, FEDERATION_SENDER__ADMIN__PORT=str(admin),
               FEDERATION_SENDER__TELEMETRY__METRICS_PORT=str(metrics))
    text = _worker_log_until_started(tmp_path, env)
    (line,) = [ln for ln in text.splitlines() if " started for " in ln]
    base = f"http://127.0.0.1:{admin}"
    assert f"admin API {base}/_synapse/admin/v1/federation/destinations" in line, line
    assert f"dashboard {base}/dashboard" in line
    assert f"metrics http://127.0.0.1:{metrics}/metrics" in line
    # The example's defaults put everything under ./data.
    assert (tmp_path / "data" / "signing.key").exists()
    assert (tmp_path / "data" / "admin.token").exists()
    assert "forward proxy" not in text


def test_the_worker_says_when_federation_goes_through_a_forward_proxy(tmp_path: Path) -> None:
    """Issue #42.6: nothing in the log said so; the credentials stay out of it."""
    env = _env(tmp_path, FEDERATION_SENDER__ADMIN__PORT=str(free_port()),
               FEDERATION_SENDER__TELEMETRY__METRICS_PORT=str(free_port()),
               FEDERATION_SENDER__FEDERATION__HTTPS_PROXY="ops:hunter2@127.0.0.1:3128",
               FEDERATION_SENDER__FEDERATION__NO_PROXY='["internal.example"]')
    text = _worker_log_until_started(tmp_path, env)
    (line,) = [ln for ln in text.splitlines() if "forward proxy in use" in ln]
    assert line.endswith("forward proxy in use: TLS federation through "
                         "http://127.0.0.1:3128 (CONNECT); not for internal.example (no_proxy)")
    assert "hunter2" not in text
