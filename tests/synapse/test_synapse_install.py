"""Installing the pinned Synapse: a failure is one line and leaves no marker."""

from __future__ import annotations

from pathlib import Path

import pytest

from federation_sender.testing import synapse_install


def test_failed_install_is_one_line_and_not_marked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    venv = tmp_path / "synapse-venv"
    monkeypatch.setenv("FEDERATION_SENDER_SYNAPSE_VENV", str(venv))
    monkeypatch.delenv("FEDERATION_SENDER_SYNAPSE_PYTHON", raising=False)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # no network: pip cannot find the package
    with pytest.raises(synapse_install.SynapseInstallError) as caught:
        synapse_install.synapse_python()
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"pip install {synapse_install.SYNAPSE_REQUIREMENT} failed")
    assert "matrix-synapse" in message.split("failed", 1)[1]  # pip's own reason
    assert not (venv / ".installed").exists()
