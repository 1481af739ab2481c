"""Real Synapse replication traffic (``shared/testdata/synapse-replication``), found
beside the checkout (``../shared``) or through ``FEDERATION_SENDER_CAPTURES``."""

from __future__ import annotations

import os
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]


def captures_dir() -> Path:
    env = os.environ.get("FEDERATION_SENDER_CAPTURES")
    candidates = [Path(env)] if env else []
    candidates.append(_REPO.parent / "shared" / "testdata" / "synapse-replication")
    for c in candidates:
        if c.is_dir() and any(c.glob("*.txt")):
            return c
    raise FileNotFoundError(
        "Synapse replication captures not found; looked in "
        + ", ".join(str(c) for c in candidates)
        + " (set FEDERATION_SENDER_CAPTURES)"
    )


def capture_lines() -> list[str]:
    """Every command line of every capture (``<ts>\\t<channel>\\t<line>``)."""
    lines: list[str] = []
    for path in sorted(captures_dir().glob("*.txt")):
        for raw in path.read_text(encoding="utf-8").splitlines():
            if not raw or raw.startswith("#"):
                continue
            _ts, _channel, line = raw.split("\t", 2)
            lines.append(line)
    if not lines:
        raise FileNotFoundError("the Synapse replication captures hold no lines")
    return lines
