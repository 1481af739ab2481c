"""The command lines docs/synapse.md gives, run on a real Synapse 1.163 deployment's
own files: ``migrate -c ours.yaml --synapse-config homeserver.yaml`` (no worker file,
our file naming no instance) works; a TLS or IP-range key of ours that Synapse's file
decides otherwise is refused with one line naming it (exit 2), not silently replaced."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from federation_sender.cli import main
from federation_sender.testing.synapse_deployment import SynapseDeployment

pytestmark = pytest.mark.postgres


def ours(tmp_path: Path, extra: dict[str, Any] | None = None) -> str:
    p = tmp_path / "ours.yaml"
    p.write_text(json.dumps({"data_dir": str(tmp_path / "data"), **(extra or {})}))
    return str(p)


def test_documented_migrate_command_needs_no_worker_file(
    synapse_deployment: SynapseDeployment, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = synapse_deployment
    argv = ["migrate", "-c", ours(tmp_path), "--synapse-config", str(d.homeserver_yaml)]
    assert main(argv) == 0, capsys.readouterr().err
    assert "schema federation_sender " in capsys.readouterr().out
    # The worker still needs to know which instance it is.
    argv[0] = "check-config"
    assert main(argv) == 2
    assert "federation_sender_instances" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("federation", "key", "synapses"),
    [
        ({"verify_tls": False}, "federation.verify_tls", "federation_verify_certificates"),
        ({"ip_allow_list": ["10.0.0.0/8"]}, "federation.ip_allow_list", "ip_range_whitelist"),
        ({"ip_deny_list": ["198.51.100.0/24"]}, "federation.ip_deny_list",
         "ip_range_blacklist"),
    ],
)
def test_shared_key_set_otherwise_than_synapse_is_refused(
    synapse_deployment: SynapseDeployment, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    federation: dict[str, Any], key: str, synapses: str,
) -> None:  # fmt: skip
    d = synapse_deployment
    argv = [
        "check-config", "-c", ours(tmp_path, {"federation": federation}),
        "--synapse-config", str(d.homeserver_yaml), "--synapse-config", str(d.worker_yaml),
    ]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert err.startswith(f"federation-sender: configuration error: config key {key!r}: "
                          f"expected to be left out beside Synapse, whose {synapses} decides")


def test_shared_key_equal_to_synapses_is_accepted(
    synapse_deployment: SynapseDeployment, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = synapse_deployment
    same = {"verify_tls": True, "ip_allow_list": ["::1/128", "127.0.0.0/8"]}
    argv = [
        "check-config", "-c", ours(tmp_path, {"federation": same}),
        "--synapse-config", str(d.homeserver_yaml), "--synapse-config", str(d.worker_yaml),
    ]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    printed = json.loads(capsys.readouterr().out)
    assert printed["federation"]["verify_tls"] is True


def test_default_value_set_explicitly_still_conflicts(
    synapse_deployment: SynapseDeployment, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``verify_tls: true`` in our file, Synapse's set to false: refused, although true
    is our default (the key is set, and it would silently become false)."""
    d = synapse_deployment
    hs = json.loads(d.homeserver_yaml.read_text())
    hs["federation_verify_certificates"] = False
    (tmp_path / "homeserver.yaml").write_text(json.dumps(hs))
    argv = [
        "check-config", "-c", ours(tmp_path, {"federation": {"verify_tls": True}}),
        "--synapse-config", str(tmp_path / "homeserver.yaml"),
        "--synapse-config", str(d.worker_yaml),
    ]  # fmt: skip
    assert main(argv) == 2
    assert "'federation.verify_tls'" in capsys.readouterr().err
    argv[2] = ours(tmp_path)  # left out: Synapse's value, no complaint
    assert main(argv) == 0
