from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from federation_sender.config import Settings, iter_keys, load_settings
from federation_sender.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_need_no_file() -> None:
    s = load_settings(None, environ={})
    assert s == Settings()
    assert s.database.url.startswith("sqlite:///./data/")


def test_yaml_and_env_override(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("server_name: example.org\nqueue:\n  wakeup_rate_per_s: 75\n")
    s = load_settings(
        f,
        environ={
            "FEDERATION_SENDER__QUEUE__WAKEUP_RATE_PER_S": "120",
            "FEDERATION_SENDER__ADMIN__TOKEN": "s3cret",
            "UNRELATED": "x",
        },
    )
    assert s.server_name == "example.org"
    assert s.queue.wakeup_rate_per_s == 120.0
    assert s.admin.token == "s3cret"


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("queue: {max_pdus_per_txn: 51}", "queue.max_pdus_per_txn"),
        ("queue: {backoff_initial_s: -1}", "queue.backoff_initial_s"),
        ("admin: {port: 'x'}", "admin.port"),
        ("admin: {port: 70000}", "admin.port"),
        ("replication: {transport: carrier-pigeon}", "replication.transport"),
        ("nonsense_key: 1", "nonsense_key"),
        ("federation: {ip_allow_list: 10.0.0.0/8}", "federation.ip_allow_list"),
        ("database: {url: ''}", "database.url"),
        ("queue: [1, 2]", "queue"),
        ("server_name: 'a:b'", "server_name"),
        ("- just a list", "<file>"),
        ("a: [unclosed", "<file>"),
    ],
)
def test_bad_values_name_the_key(tmp_path: Path, text: str, key: str) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as ei:
        load_settings(f, environ={})
    assert ei.value.key == key


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="readable YAML file"):
        load_settings(tmp_path / "nope.yaml", environ={})


def test_every_key_is_documented() -> None:
    doc = (ROOT / "docs" / "configuration.md").read_text()
    documented = set(re.findall(r"^\| `([a-z_.]+)` \|", doc, flags=re.M))
    assert documented == set(iter_keys())


def test_cli_bad_config_exits_2_with_one_line(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("queue: {max_edus_per_txn: 1000}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "federation_sender", "check-config", "-c", str(f)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "queue.max_edus_per_txn" in lines[0]
    assert "1 to 100" in lines[0]


def test_cli_help_lists_commands() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "federation_sender", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0
    for cmd in ("worker", "migrate", "generate-key", "demo", "check-config"):
        assert cmd in proc.stdout


def test_cli_migrate_on_sqlite_is_idempotent(tmp_path: Path) -> None:
    env_url = f"sqlite:///{tmp_path}/x.db"
    import os

    env = dict(os.environ, FEDERATION_SENDER__DATABASE__URL=env_url)
    out = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-m", "federation_sender", "migrate"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        out.append(proc.stdout)
    assert "migrated from empty" in out[0]
    assert "already at revision" in out[1]


def test_cli_migrate_on_postgres(pg_url: str) -> None:
    import os

    env = dict(os.environ, FEDERATION_SENDER__DATABASE__URL=pg_url)
    proc = subprocess.run(
        [sys.executable, "-m", "federation_sender", "migrate"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "to 0001" in proc.stdout
