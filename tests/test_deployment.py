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
