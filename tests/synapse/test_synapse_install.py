"""Installing the pinned Synapse: a failure is one line and leaves no marker."""

from __future__ import annotations

from pathlib import Path

import pytest

from federation_sender.testing import synapse_install


def test_failed_install_is_one_line_and_not_marked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    venv = blocker / "synapse-venv"  # cannot be created: its parent is a file
    monkeypatch.setenv("FEDERATION_SENDER_SYNAPSE_VENV", str(venv))
    monkeypatch.delenv("FEDERATION_SENDER_SYNAPSE_PYTHON", raising=False)
    with pytest.raises(synapse_install.SynapseInstallError) as caught:
        synapse_install.synapse_python()
    message = str(caught.value)
    assert "\n" not in message
    assert message == f"cannot use {venv}: File exists"
    assert not (venv / ".installed").exists()


def test_failed_pip_install_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    venv = tmp_path / "synapse-venv"
    monkeypatch.setenv("FEDERATION_SENDER_SYNAPSE_VENV", str(venv))
    monkeypatch.delenv("FEDERATION_SENDER_SYNAPSE_PYTHON", raising=False)
    monkeypatch.setattr(synapse_install, "SYNAPSE_REQUIREMENT", "./no-such-project")
    with pytest.raises(synapse_install.SynapseInstallError) as caught:
        synapse_install.synapse_python()
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("pip install ./no-such-project failed (exit 1): ")
    assert "no-such-project" in message.split("failed", 1)[1]  # pip's own reason
    assert not (venv / ".installed").exists()
