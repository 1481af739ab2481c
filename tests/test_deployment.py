"""docker-compose.yml stays a valid description of a real deployment."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from federation_sender.config import ENV_PREFIX, AdminSettings, Settings
from federation_sender.config.loading import load_settings

ROOT = Path(__file__).resolve().parents[1]


def _compose() -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert isinstance(data, dict)
    return data


def test_compose_has_the_services_of_a_real_deployment() -> None:
    services = _compose()["services"]
    assert {"postgres", "redis", "main", "worker1", "worker2", "otel-collector", "migrate"} <= set(
        services
    )
    for name in ("worker1", "worker2"):
        svc = services[name]
        assert svc["command"][:2] == ["federation-sender", "worker"]
        assert svc["depends_on"]["migrate"]["condition"] == "service_completed_successfully"


def test_compose_worker_environment_is_a_valid_configuration() -> None:
    services = _compose()["services"]
    names = set()
    for name in ("worker1", "worker2", "main", "migrate"):
        env = {k: str(v) for k, v in services[name]["environment"].items()}
        assert all(k.startswith(ENV_PREFIX) for k in env)
        settings = load_settings(None, environ=env)
        assert settings.database.url.startswith("postgresql://")
        if name.startswith("worker"):
            assert settings.replication.transport == "redis"
            assert settings.sharding.mode == "dynamic"
            names.add(settings.instance_name)
    assert len(names) == 2, "the two workers need distinct instance names"


def test_compose_references_existing_files() -> None:
    assert (ROOT / "Dockerfile").is_file()
    for svc in _compose()["services"].values():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("./"):
                assert (ROOT / src).exists(), src


def test_compose_main_process_command_is_ours() -> None:
    import importlib

    cmd = _compose()["services"]["main"]["command"]
    assert cmd[:3] == ["python", "-m", "federation_sender.sim"]
    mod = importlib.import_module("federation_sender.sim.__main__")
    # The compose file's arguments parse: --help after them exits 0 (a bad one exits 2).
    try:
        mod.main([*cmd[3:], "--help"])
    except SystemExit as e:
        assert e.code == 0
    else:
        raise AssertionError("--help did not exit")


SYNAPSE_DIR = ROOT / "deploy" / "synapse"


def test_compose_synapse_profile_runs_our_worker_as_synapses_sender() -> None:
    from federation_sender.synapse.config import load_synapse_config
    from federation_sender.synapse.merge import merge_settings

    services = _compose()["services"]
    ours = services["synapse-federation-sender"]
    assert ours["profiles"] == ["synapse"]
    assert "synapse" in services["synapse-main"]["profiles"]
    assert services["synapse-fed1"]["profiles"] == ["synapse-own-sender"]  # never both
    assert ours["command"][:2] == ["federation-sender", "worker"]
    files = [
        a for i, a in enumerate(ours["command"]) if ours["command"][i - 1] == "--synapse-config"
    ]
    assert files == ["/config/homeserver.yaml", "/config/fed1.yaml"]
    local = [SYNAPSE_DIR / Path(f).name for f in files]
    settings = merge_settings(load_settings(None, environ={}), load_synapse_config(local))
    assert settings.instance_name == "fed1"
    assert settings.replication.transport == "redis"
    assert settings.replication.redis_url == "redis://synapse-redis:6379/0"
    assert settings.database.url.startswith("postgresql://synapse:synapse@synapse-postgres:5432/")
    fed1 = services["synapse-fed1"]["command"]
    assert fed1[-1] == "/config/fed1.yaml"  # Synapse's worker reads the same worker file
    pg_args = services["synapse-postgres"]["environment"]["POSTGRES_INITDB_ARGS"]
    assert "--lc-collate=C" in pg_args and "--lc-ctype=C" in pg_args


def test_secrets_are_created_once_before_the_workers_start() -> None:
    services = _compose()["services"]
    init = services["init"]
    assert init["command"] == ["federation-sender", "init"]
    assert "keys:/app/data" in init["volumes"]
    for name in ("worker1", "worker2"):
        assert services[name]["depends_on"]["init"]["condition"] == \
            "service_completed_successfully"
        assert "keys:/app/data" in services[name]["volumes"]


def test_workers_have_healthchecks_on_their_admin_listener() -> None:
    services = _compose()["services"]
    for name in ("worker1", "worker2", "synapse-federation-sender"):
        check = services[name]["healthcheck"]
        assert check["test"][0] == "CMD"
        assert f"http://127.0.0.1:{AdminSettings().port}/ready" in " ".join(check["test"])


def test_prometheus_scrapes_the_workers_metrics_listener() -> None:
    from federation_sender.config import TelemetrySettings

    services = _compose()["services"]
    assert "./deploy/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in \
        services["prometheus"]["volumes"]
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    (job,) = prom["scrape_configs"]
    assert job["metrics_path"] == "/_synapse/metrics"
    port = TelemetrySettings().metrics_port
    targets = job["static_configs"][0]["targets"]
    assert targets == [f"worker1:{port}", f"worker2:{port}"]
    for name in ("worker1", "worker2"):
        env = services[name]["environment"]
        assert env["FEDERATION_SENDER__TELEMETRY__METRICS_BIND"] == "0.0.0.0"


def _exported_names() -> set[str]:
    """Every series name a worker's registry can export (labelled families included)."""
    from federation_sender.telemetry.metrics import Metrics, QueueSnapshot, new_registry

    registry = new_registry(process_metrics=False)
    Metrics(registry).set_snapshot_source(QueueSnapshot)
    names: set[str] = set()
    for family in registry.collect():
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                    "gauge": ("",)}[family.type]
        names.update(family.name + s for s in suffixes)
    return names


def test_the_grafana_dashboard_reads_only_series_the_worker_exports() -> None:
    import json
    import re

    dash = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\b((?:synapse|federation_sender)_\w+)", e)}
    assert used - _exported_names() == set()
    # What Synapse's own federation-sender panels read is there too.
    for synapse_name in ("synapse_federation_client_sent_transactions_total",
                         "synapse_federation_client_sent_pdu_destinations_count_total",
                         "synapse_federation_client_sent_pdu_destinations_total",
                         "synapse_federation_client_events_processed_total",
                         "synapse_event_processing_loop_count_total",
                         "synapse_event_processing_loop_room_count_total",
                         "synapse_http_matrixfederationclient_requests_total",
                         "synapse_http_matrixfederationclient_responses_total",
                         "synapse_federation_transaction_queue_pending_destinations",
                         "synapse_federation_client_sent_edus_by_type_total",
                         "synapse_event_processing_lag"):
        assert synapse_name in used and synapse_name in _exported_names()
    services = _compose()["services"]
    assert "./deploy/grafana-dashboard.json:/var/lib/grafana/dashboards/federation-sender.json" \
        ":ro" in services["grafana"]["volumes"]


def _dockerfile_stages() -> dict[str, list[str]]:
    """The Dockerfile's stages by name, each as its instruction lines (continuations
    joined), in order; the last one is what ``docker build .`` produces."""
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            current = []
            stages[line.split()[-1]] = current
        current.append(line)
    return stages


def test_the_worker_image_is_the_default_and_carries_no_java_or_spark() -> None:
    stages = _dockerfile_stages()
    assert list(stages)[-1] == "worker", "docker build . must give the worker image"
    worker = " ".join(stages["worker"])
    assert stages["worker"][0] == "FROM base AS worker"
    assert "apt-get" not in worker and "java" not in worker.lower()
    # The wheel without extras: the runtime dependencies only (tests/test_install.py runs
    # that install and the demo in an empty virtualenv).
    assert "pip install /dist/federation_sender-*.whl" in worker
    assert "[batch]" not in worker and "-e " not in worker
    assert stages["worker"][-2:] == ["USER fedsender", 'CMD ["federation-sender", "worker"]']
    base = " ".join(stages["base"])
    assert "--uid 991" in base  # Synapse's user: reads Synapse's signing key beside it


def test_the_batch_image_adds_java_the_jdbc_drivers_and_the_batch_extra() -> None:
    batch = " ".join(_dockerfile_stages()["batch"])
    for package in ("openjdk-17-jre-headless", "libpostgresql-jdbc-java",
                    "libxerial-sqlite-jdbc-java"):
        assert package in batch
    assert "[batch]" in batch
    assert "USER fedsender" in batch


def test_images_are_built_from_the_wheel_and_compose_uses_the_worker_target() -> None:
    build = " ".join(_dockerfile_stages()["build"])
    assert "python -m build" in build
    services = _compose()["services"]
    ours = {n: s for n, s in services.items() if "federation-sender" in str(s.get("image"))}
    for name, svc in ours.items():
        want = "batch" if name == "batch" else "worker"
        assert svc["build"] == {"context": ".", "target": want}, name
    assert services["synapse-federation-sender"]["build"]["target"] == "worker"


def test_default_listener_ports_are_not_synapses_replication_port() -> None:
    """Our default admin and metrics ports differ from the replication listener port
    docs/synapse.md and the compose deployment give Synapse's main (9093, as in
    Synapse's own worker docs), and docs/configuration.md states the real default."""
    root = Path(__file__).resolve().parents[1]
    page = (root / "docs/synapse.md").read_text()
    m = re.search(r"instance_map: \{main: \{host: [^,]+, port: (\d+)\}\}", page)
    assert m is not None
    hs = yaml.safe_load((root / "deploy/synapse/homeserver.yaml").read_text())
    replication = {int(m.group(1))} | {
        int(li["port"]) for li in hs["listeners"]
        if any("replication" in r.get("names", []) for r in li.get("resources", []))
    }
    s = Settings()
    assert replication and s.admin.port not in replication
    assert s.telemetry.metrics_port not in replication
    table = (root / "docs/configuration.md").read_text()
    assert f"| `admin.port` | `{s.admin.port}` |" in table
