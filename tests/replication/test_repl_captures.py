"""The Synapse replication captures live in the repository, so a clone anywhere runs the
tests that replay them (issue #42.4: they were looked up beside the checkout)."""

from __future__ import annotations

from pathlib import Path

from federation_sender.testing.captures import capture_lines, captures_dir

REPO = Path(__file__).resolve().parents[2]


def test_captures_are_inside_the_checkout() -> None:
    found = captures_dir()
    assert found.is_relative_to(REPO / "tests" / "data")
    names = sorted(p.name for p in found.glob("*.txt"))
    assert names == [
        "edus_typing_receipts_todevice_presence.redis.txt",
        "restart_replicate_position.redis.txt",
        "spike_slice.redis.txt",
    ]


def test_captures_hold_real_commands() -> None:
    lines = capture_lines()
    assert len(lines) > 1000
    assert any(line.startswith("POSITION ") for line in lines)
    assert any(line.startswith("RDATA ") for line in lines)
