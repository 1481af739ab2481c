"""``--synapse-config`` on the command lines, without Spark or Synapse."""

from __future__ import annotations

from pathlib import Path

import pytest

from federation_sender.batch.__main__ import main as batch_main
from federation_sender.batch.arguments import EXIT_USAGE


def test_python_m_batch_refuses_synapse_files(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Only the main command line merges Synapse's files into the settings; the short
    entry point would otherwise run on the default database."""
    hs = tmp_path / "homeserver.yaml"
    hs.write_text("server_name: example.org\n")
    assert batch_main(["audit", "--synapse-config", str(hs)]) == EXIT_USAGE
    assert "federation-sender batch JOB --synapse-config" in capsys.readouterr().err
