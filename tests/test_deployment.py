"""docker-compose.yml stays a valid description of a real deployment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from federation_sender.config import ENV_PREFIX, load_settings

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
    from federation_sender.synapse.config import load_synapse_config, merge_settings

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
