"""The Synapse releases we support are written once: storage/synapse/schema.py's
SYNAPSE_RELEASE_WINDOW. The suite's pinned release and scripts/synapse-compat.sh's
window come from it, so a new Synapse release is one line there (and its schema
version, if it changed)."""

from __future__ import annotations

import re
from pathlib import Path

from federation_sender.storage.synapse.schema import (
    SYNAPSE_RELEASE_WINDOW,
    TESTED_SYNAPSE_RELEASES,
)
from federation_sender.testing import synapse_install

ROOT = Path(__file__).resolve().parents[1]


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def test_the_window_is_ordered_and_the_suite_runs_its_newest_release() -> None:
    assert list(SYNAPSE_RELEASE_WINDOW) == sorted(set(SYNAPSE_RELEASE_WINDOW), key=_key)
    assert (SYNAPSE_RELEASE_WINDOW[0], SYNAPSE_RELEASE_WINDOW[-1]) == TESTED_SYNAPSE_RELEASES
    assert SYNAPSE_RELEASE_WINDOW[-1] == synapse_install.SYNAPSE_VERSION


def test_synapse_compat_sh_reads_the_window_from_the_package() -> None:
    script = (ROOT / "scripts" / "synapse-compat.sh").read_text()
    # No release number of its own: the window is read from the package.
    assert not re.search(r"\b1\.1\d\d\.\d\b", script.split("set -uo pipefail", 1)[1])
    line = next(x for x in script.splitlines() if "SYNAPSE_RELEASE_WINDOW" in x)
    assert "import" in line
