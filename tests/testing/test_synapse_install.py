"""Installing the pinned Synapse: a failure is one line and leaves no marker."""

from __future__ import annotations

import sys
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


def test_a_failing_install_step_is_reported_by_its_last_error_line() -> None:
    """What pip prints on failure: pages of output, the reason last."""
    script = (
        "import sys; sys.stderr.write('Collecting x\\n  error: subprocess-exited-with-error\\n"
        "  long build log\\nERROR: No matching distribution found for x\\n'); sys.exit(1)"
    )
    with pytest.raises(synapse_install.SynapseInstallError) as caught:
        synapse_install._run([sys.executable, "-c", script], "pip install x")
    assert str(caught.value) == (
        "pip install x failed (exit 1): ERROR: No matching distribution found for x"
    )
