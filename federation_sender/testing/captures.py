"""Real Synapse replication traffic, kept in the repository as test data
(``tests/data/synapse-replication``: what a Synapse 1.163.2 deployment published on its
Redis channel; that folder's README says how each file was recorded).

Only a checkout has them (they are not in the wheel): the tests and benchmarks that replay
them run from one.
"""

from __future__ import annotations

from pathlib import Path

CAPTURES_DIR = Path(__file__).resolve().parents[2] / "tests" / "data" / "synapse-replication"


def captures_dir() -> Path:
    if not CAPTURES_DIR.is_dir() or not any(CAPTURES_DIR.glob("*.txt")):
        raise FileNotFoundError(
            f"Synapse replication captures not found in {CAPTURES_DIR} "
            "(they come with a checkout of the repository, not with the wheel)"
        )
    return CAPTURES_DIR


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
