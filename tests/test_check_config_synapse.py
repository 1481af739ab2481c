"""``check-config --synapse-config ...`` shows where this instance serves the outbound
federation proxy (issue #42.6: it did not), and never the proxy's secret. No database
or Synapse is contacted: check-config only reads the files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from federation_sender.cli import main

SECRET = "s3cret-replication-value"


def _files(tmp_path: Path, restricted: bool) -> list[str]:
    hs: dict[str, Any] = {
        "server_name": "example.org",
        "signing_key_path": str(tmp_path / "signing.key"),
        "database": {"name": "psycopg2", "args": {"user": "synapse", "host": "127.0.0.1",
                                                  "port": 5432, "dbname": "synapse"}},
        "redis": {"enabled": True},
        "federation_sender_instances": ["fed1"],
        "worker_replication_secret": SECRET,
        "instance_map": {"main": {"host": "127.0.0.1", "port": 9093},
                         "fed1": {"host": "10.0.0.5", "port": 8034}},
    }
    if restricted:
        hs["outbound_federation_restricted_to"] = ["fed1"]
    worker: dict[str, Any] = {"worker_app": "synapse.app.generic_worker",
                              "worker_name": "fed1"}
    if restricted:  # where the proxy binds (a listener we serve only as the proxy)
        worker["worker_listeners"] = [{"type": "http", "port": 8034,
                                       "bind_addresses": ["0.0.0.0"],
                                       "resources": [{"names": ["replication"]}]}]
    (tmp_path / "hs.yaml").write_text(json.dumps(hs))
    (tmp_path / "fed1.yaml").write_text(json.dumps(worker))
    (tmp_path / "ours.yaml").write_text(json.dumps({"data_dir": str(tmp_path / "data")}))
    return ["check-config", "-c", str(tmp_path / "ours.yaml"),
            "--synapse-config", str(tmp_path / "hs.yaml"),
            "--synapse-config", str(tmp_path / "fed1.yaml")]


@pytest.mark.parametrize("restricted", [True, False])
def test_check_config_shows_the_outbound_proxy_listener(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], restricted: bool,
) -> None:
    assert main(_files(tmp_path, restricted)) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert SECRET not in out
    shown = json.loads(out)["outbound_federation_proxy"]
    if restricted:
        cap = shown.pop("max_connections")
        assert shown == {"listen": "http://10.0.0.5:8034", "bind": ["0.0.0.0"]}
        assert isinstance(cap, int) and 16 <= cap <= 1024
    else:
        assert shown is None
