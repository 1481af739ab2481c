"""Fixtures for the replication tests: captures, a fake clock, helpers."""

from __future__ import annotations

from pathlib import Path

import pytest

from federation_sender.testing.clock import FakeClock

CAPTURES = Path("/work/shared/testdata/synapse-replication")


def capture_lines() -> list[str]:
    """Every command line of every capture (``<ts>\\t<channel>\\t<line>``)."""
    lines: list[str] = []
    for path in sorted(CAPTURES.glob("*.txt")):
        for raw in path.read_text(encoding="utf-8").splitlines():
            if not raw or raw.startswith("#"):
                continue
            _ts, _channel, line = raw.split("\t", 2)
            lines.append(line)
    return lines


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock()
