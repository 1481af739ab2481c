"""The pinned Synapse, installed from PyPI into its own cached virtualenv.

Synapse goes into a virtualenv of its own so its pins never disturb ours. The
virtualenv lives in the user's cache directory
(``$XDG_CACHE_HOME/federation-sender/synapse-<version>``, default ``~/.cache/...``) so
that fresh clones on one machine (CI) share it; ``FEDERATION_SENDER_SYNAPSE_VENV`` puts
it elsewhere and ``FEDERATION_SENDER_SYNAPSE_PYTHON`` names an existing interpreter
that has Synapse. ``FEDERATION_SENDER_SYNAPSE_VERSION`` picks another release than the
pinned one (``scripts/synapse-compat.sh`` runs the tests against each release of the
supported window, each in its own cached virtualenv). The first use installs
``matrix-synapse[postgres,redis]`` and byte-compiles it (a minute or two); a
``.installed`` marker written last makes later uses free. A file lock lets parallel
test runs install once. A failed install is one line (:class:`SynapseInstallError`)
naming pip's last error line, not pip's output.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

SYNAPSE_VERSION = "1.163.2"
"""The pinned release: what the suite runs against unless told otherwise."""
VERSION_ENV = "FEDERATION_SENDER_SYNAPSE_VERSION"
CONSTRAINTS = ("txredisapi<1.6.0",)
"""Installed beside Synapse: what its later releases pin. Releases before 1.163.0 do not
cap txredisapi, and 1.6.0 (published after them) makes main crash at start with Redis
(``AttributeError: 'super' object has no attribute 'startedConnecting'`` in
``synapse/replication/tcp/redis.py``); 1.163.0 and later ask for ``<1.6.0`` themselves."""
INSTALL_TIMEOUT_S = 1800.0


class SynapseInstallError(RuntimeError):
    """Synapse could not be installed; the message is one line."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "federation-sender"


def synapse_version() -> str:
    """The release to use: ``$FEDERATION_SENDER_SYNAPSE_VERSION``, else the pinned one."""
    return os.environ.get(VERSION_ENV) or SYNAPSE_VERSION


def synapse_requirement() -> str:
    return f"matrix-synapse[postgres,redis]=={synapse_version()}"


def venv_dir() -> Path:
    override = os.environ.get("FEDERATION_SENDER_SYNAPSE_VENV")
    return Path(override) if override else cache_dir() / f"synapse-{synapse_version()}"


def synapse_python() -> Path:
    """An interpreter with the pinned Synapse, installing it on first use."""
    override = os.environ.get("FEDERATION_SENDER_SYNAPSE_PYTHON")
    if override:
        return Path(override)
    venv = venv_dir()
    python = venv / "bin" / "python"
    marker = venv / ".installed"
    if marker.exists():
        return python
    try:
        venv.parent.mkdir(parents=True, exist_ok=True)
        lock = open(venv.parent / f"{venv.name}.lock", "w")  # noqa: SIM115 - closed below
    except OSError as e:
        raise SynapseInstallError(f"cannot use {venv}: {e.strerror or e}") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not marker.exists():
            _install(venv, python)
            marker.touch()
    return python


def _run(args: list[str], what: str) -> None:
    try:
        result = subprocess.run(args, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SynapseInstallError(f"{what}: timed out after {INSTALL_TIMEOUT_S:.0f} s") from None
    if result.returncode != 0:
        lines = [ln.strip() for ln in (result.stderr or result.stdout).splitlines() if ln.strip()]
        errors = [ln for ln in lines if "error" in ln.lower()]
        last = (errors or lines or ["no output"])[-1]
        raise SynapseInstallError(f"{what} failed (exit {result.returncode}): {last}")


def _install(venv: Path, python: Path) -> None:
    _run([sys.executable, "-m", "venv", "--clear", str(venv)], f"creating {venv}")
    requirement = synapse_requirement()
    _run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
         requirement, *CONSTRAINTS],
        f"pip install {requirement}",
    )  # fmt: skip
    # Byte-compile now: otherwise the first Synapse start takes ~30 s.
    subprocess.run(
        [str(python), "-m", "compileall", "-q", "-j0", str(venv / "lib")],
        capture_output=True,
        check=False,
    )


if __name__ == "__main__":  # scripts/bootstrap.sh test
    try:
        print(synapse_python())
    except SynapseInstallError as e:
        raise SystemExit(f"bootstrap: {e}") from None
