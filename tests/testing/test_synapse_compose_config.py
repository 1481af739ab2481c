"""Synapse 1.163 itself accepts the compose deployment's homeserver.yaml."""

from __future__ import annotations

import subprocess
from pathlib import Path

from federation_sender.testing.synapse_install import synapse_python

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "synapse"


def test_synapse_parses_the_compose_config_and_generates_its_key(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "config").mkdir()
    for name in ("homeserver.yaml", "fed1.yaml", "log.yaml"):
        text = (DEPLOY / name).read_text()
        text = text.replace("/data/", f"{tmp_path}/data/").replace(
            "/config/", f"{tmp_path}/config/"
        )
        (tmp_path / "config" / name).write_text(text)
    result = subprocess.run(
        [str(synapse_python()), "-m", "synapse.app.homeserver",
         "--config-path", str(tmp_path / "config" / "homeserver.yaml"), "--generate-keys"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "data" / "signing.key").read_text().startswith("ed25519 ")
