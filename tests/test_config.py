from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from federation_sender.config import Settings
from federation_sender.config.loading import iter_keys, load_settings
from federation_sender.errors import ConfigError
from federation_sender.testing.synapse_config import minimal_worker_tree

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
        ("queue: {max_long_retries: -1}", "queue.max_long_retries"),
        ("queue: {max_short_retry_delay_s: 0}", "queue.max_short_retry_delay_s"),
        ("queue: {short_retry_probe_window_s: -5}", "queue.short_retry_probe_window_s"),
        ("admin: {port: 'x'}", "admin.port"),
        ("admin: {port: 70000}", "admin.port"),
        ("replication: {transport: carrier-pigeon}", "replication.transport"),
        ("nonsense_key: 1", "nonsense_key"),
        ("federation: {ip_allow_list: 10.0.0.0/8}", "federation.ip_allow_list"),
        ("database: {url: ''}", "database.url"),
        ("queue: [1, 2]", "queue"),
        ("server_name: 'a:b'", "server_name"),
        ("telemetry: {trace_sample_ratio: 1.5}", "telemetry.trace_sample_ratio"),
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


def _cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([sys.executable, "-m", "federation_sender", *args],
                          capture_output=True, text=True, timeout=120, cwd=cwd,
                          env=None if env is None else {**os.environ, **env})


def test_cli_version() -> None:
    from importlib.metadata import version

    proc = _cli("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"federation-sender {version('federation-sender')}"


def test_the_command_line_loads_the_batch_jobs_only_for_batch() -> None:
    """The main parser takes ``batch``'s arguments from batch/arguments.py: ``--version``,
    ``check-config`` and the worker do not import the jobs, their database clients and
    the storage layer (0.9 s of the 1.2 s ``--version`` took before)."""
    probe = ("import sys\nfrom federation_sender.cli import build_parser\n"
             "build_parser().parse_args(['batch', 'audit', '--repair'])\n"
             "print(sorted(m for m in sys.modules if m.startswith(("
             "'sqlalchemy', 'psycopg', 'federation_sender.storage', "
             "'federation_sender.batch.'))))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['federation_sender.batch.arguments']"


def test_a_mistyped_key_gets_a_suggestion(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("queue: {max_pdu_per_txn: 20}\n")
    with pytest.raises(ConfigError) as ei:
        load_settings(f, environ={})
    assert ei.value.key == "queue.max_pdu_per_txn"
    assert "did you mean 'queue.max_pdus_per_txn'?" in str(ei.value)
    f.write_text("telemetry: {zzz: 1}\n")
    with pytest.raises(ConfigError) as ei:
        load_settings(f, environ={})
    assert "did you mean" not in str(ei.value)


@pytest.mark.parametrize("url", [
    "mysql://fs:hunter2@db/fs",
    "postgresql+asyncpg://fs:hunter2@db/fs",
    "sqlite://",
    "sqlite:///:memory:",
    "postgresql://fs:hunter2@db",
    "not a url",
])
def test_check_config_refuses_a_database_url_the_worker_cannot_use(url: str) -> None:
    proc = _cli("check-config", env={"FEDERATION_SENDER__DATABASE__URL": url})
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "database.url" in line
    assert "hunter2" not in line


@pytest.mark.parametrize("url", ["postgresql://fs:pw@db/fs", "postgres://db/fs",
                                 "postgresql+psycopg://fs@db:5433/fs",
                                 "sqlite:///data/x.db", "sqlite+aiosqlite:////abs/x.db"])
def test_usable_database_urls_are_accepted(url: str) -> None:
    assert load_settings(None, environ={"FEDERATION_SENDER__DATABASE__URL": url}
                         ).database.url == url


def test_check_config_hides_every_password() -> None:
    proc = _cli("check-config", env={
        "FEDERATION_SENDER__DATABASE__URL": "postgresql://fs:db-s3cret@db/fs",
        "FEDERATION_SENDER__REPLICATION__REDIS_URL": "redis://:redis-s3cret@redis:6379/0",
        "FEDERATION_SENDER__ADMIN__TOKEN": "admin-s3cret"})
    assert proc.returncode == 0, proc.stderr
    assert "s3cret" not in proc.stdout
    assert "postgresql://fs:<redacted>@db/fs" in proc.stdout
    assert "redis://:<redacted>@redis:6379/0" in proc.stdout


def test_batch_help_is_plain_text() -> None:
    for args in (("batch", "--help"), ("batch", "audit", "--help")):
        proc = _cli(*args)
        assert proc.returncode == 0, proc.stderr
        assert "``" not in proc.stdout and ":class:" not in proc.stdout
        assert "`" not in proc.stdout
    assert "health-report" in _cli("batch", "--help").stdout


def test_init_creates_the_shared_secrets_once(tmp_path: Path) -> None:
    env = {"FEDERATION_SENDER__DATA_DIR": str(tmp_path / "data"),
           "FEDERATION_SENDER__FEDERATION__SIGNING_KEY_PATH": str(tmp_path / "data" / "k.key")}
    first = _cli("init", cwd=tmp_path, env=env)
    assert first.returncode == 0, first.stderr
    assert "wrote signing key ed25519:" in first.stdout and "wrote an admin token" in first.stdout
    key, token = (tmp_path / "data" / "k.key"), (tmp_path / "data" / "admin.token")
    before = key.read_bytes(), token.read_bytes()
    assert token.stat().st_mode & 0o077 == 0
    second = _cli("init", cwd=tmp_path, env=env)
    assert second.returncode == 0, second.stderr
    assert "already" in second.stdout and "wrote" not in second.stdout
    assert (key.read_bytes(), token.read_bytes()) == before


def test_check_config_hides_secret_query_parameters() -> None:
    url = ("postgresql://fs@db/fs?password=q-s3cret&sslpassword=ssl-s3cret"
           "&sslmode=verify-full&sslkey=/etc/fs/client.key")
    proc = _cli("check-config", env={
        "FEDERATION_SENDER__DATABASE__URL": url,
        "FEDERATION_SENDER__REPLICATION__REDIS_URL": "redis://redis/0?token=t-s3cret"})
    assert proc.returncode == 0, proc.stderr
    assert "s3cret" not in proc.stdout
    assert ("postgresql://fs@db/fs?password=<redacted>&sslpassword=<redacted>"
            "&sslmode=verify-full&sslkey=/etc/fs/client.key") in proc.stdout
    assert "redis://redis/0?token=<redacted>" in proc.stdout


def test_config_does_not_import_telemetry() -> None:
    """config and telemetry.logging share the redaction, which sits below both."""
    code = ("import sys, federation_sender.config.loading as c; c.load_settings(None, environ={}); "
            "print(sorted(m for m in sys.modules if m.startswith('federation_sender.tele')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    assert proc.stdout.strip() == "[]"


def test_signing_key_follows_data_dir(tmp_path: Path) -> None:
    env = {"FEDERATION_SENDER__DATA_DIR": str(tmp_path / "elsewhere")}
    proc = _cli("init", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "elsewhere" / "signing.key").exists()
    assert (tmp_path / "elsewhere" / "admin.token").exists()
    assert not (tmp_path / "data").exists()


def test_migrate_with_the_database_down_is_one_line() -> None:
    from federation_sender.testing.ports import free_port

    port = free_port()  # nothing listens there
    proc = _cli("migrate", env={
        "FEDERATION_SENDER__DATABASE__URL": f"postgresql://fs:pw@127.0.0.1:{port}/fs",
        "FEDERATION_SENDER__DATABASE__CONNECT_ATTEMPTS": "2",
        "FEDERATION_SENDER__DATABASE__CONNECT_RETRY_S": "0"})
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2, lines  # the retry's warning, then the verdict
    assert lines[-1].startswith(
        f"federation-sender: database postgresql 127.0.0.1:{port}/fs unreachable after 2")
    assert "pw" not in proc.stderr


def test_outbound_proxy_max_connections_is_a_count_or_derived(tmp_path: Path) -> None:
    """``federation.outbound_proxy_max_connections``: from the file or the environment,
    positive, and what the proxy built for a restricted deployment is capped at; unset,
    the cap derived from the open-file limit."""
    from dataclasses import replace

    from prometheus_client import CollectorRegistry

    from federation_sender.builders import build_federation_client
    from federation_sender.clock import SystemClock
    from federation_sender.synapse.config import parse_synapse_config
    from federation_sender.synapse.egress import build_outbound_proxy
    from federation_sender.synapse.merge import merge_settings
    from federation_sender.transport.outbound_proxy import default_max_connections
    from federation_sender.transport.signing import SigningKey

    key = "federation.outbound_proxy_max_connections"
    env_name = "FEDERATION_SENDER__FEDERATION__OUTBOUND_PROXY_MAX_CONNECTIONS"
    assert load_settings(None, environ={}).federation.outbound_proxy_max_connections is None
    f = tmp_path / "c.yaml"
    f.write_text("federation: {outbound_proxy_max_connections: 300}\n")
    ours = load_settings(f, environ={})
    assert ours.federation.outbound_proxy_max_connections == 300
    assert load_settings(None, environ={env_name: "40"}
                         ).federation.outbound_proxy_max_connections == 40
    for bad in ("0", "-3", "many", "1.5"):
        with pytest.raises(ConfigError) as ei:
            load_settings(None, environ={env_name: bad})
        assert ei.value.key == key

    synapse = parse_synapse_config(minimal_worker_tree(
        outbound_federation_restricted_to=["fed1"], worker_replication_secret="s",
        instance_map={"main": {"host": "127.0.0.1", "port": 1},
                      "fed1": {"host": "127.0.0.1", "port": 2}},
    ))
    for settings, cap in ((ours, 300), (Settings(), default_max_connections())):
        merged = merge_settings(settings, synapse)
        client = build_federation_client(merged, SigningKey.generate("a_k"), SystemClock())
        proxy = build_outbound_proxy(merged, synapse, client, SystemClock(),
                                     CollectorRegistry())
        assert proxy is not None and proxy.max_connections == cap
    assert replace(ours.federation, outbound_proxy_max_connections=None
                   ) == Settings().federation
