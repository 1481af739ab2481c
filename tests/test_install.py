"""A runtime-only install works: the wheel, alone in an empty virtualenv, runs the demo.

The suite itself runs with the dev extra installed, which once hid a runtime import that
only the dev extra satisfied (``cryptography``): every command of a plain ``pip install``
died with ``ModuleNotFoundError``. This test builds the distribution as an operator would
(``python -m build``: sdist, then the wheel from the sdist), checks the wheel's contents,
installs it without extras into a virtualenv that sees nothing of ours, and runs what an
operator runs first.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from federation_sender.testing.ports import free_port_block

ROOT = Path(__file__).resolve().parents[1]
DESTINATIONS = 6

pytestmark = pytest.mark.timeout(600)


def _run(cmd: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    out = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"{cmd}: exit {proc.returncode}\n{out}"
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)], cwd=out)
    wheels = list(out.glob("federation_sender-*.whl"))
    assert len(wheels) == 1, list(out.iterdir())
    return wheels[0]


@pytest.fixture(scope="module")
def runtime_env(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtualenv with the wheel and its runtime dependencies, no extras."""
    env_dir = tmp_path_factory.mktemp("runtime-venv")
    venv.EnvBuilder(with_pip=True, system_site_packages=False).create(env_dir)
    py = env_dir / "bin" / "python"
    _run([str(py), "-m", "pip", "install", "-q", str(wheel)], cwd=env_dir, timeout=500)
    return env_dir


def test_the_wheel_has_what_it_should_and_nothing_else(wheel: Path) -> None:
    proc = _run([sys.executable, "-m", "check_wheel_contents", str(wheel)], cwd=wheel.parent)
    assert "OK" in proc.stdout


def test_runtime_install_has_no_dev_or_batch_packages(runtime_env: Path) -> None:
    py = str(runtime_env / "bin" / "python")
    probe = (
        "import importlib.util as u; "
        "print(' '.join(m for m in ('pytest', 'selenium', 'hypothesis', 'pyspark', "
        "'pandas', 'matplotlib') if u.find_spec(m)))"
    )
    proc = _run([py, "-c", probe], cwd=runtime_env)
    assert proc.stdout.strip() == "", "a runtime-only install must not carry these"


def test_runtime_install_runs_version_check_config_and_the_demo(
    runtime_env: Path, tmp_path: Path
) -> None:
    exe = str(runtime_env / "bin" / "federation-sender")
    version = _run([exe, "--version"], cwd=tmp_path)
    assert version.stdout.strip().startswith("federation-sender ")

    checked = _run(
        [exe, "check-config", "-c", str(ROOT / "deploy" / "config.example.yaml")], cwd=tmp_path
    )
    assert "Traceback" not in checked.stdout + checked.stderr

    # The batch jobs are an extra: without it, one line naming it.
    batch = subprocess.run(
        [exe, "batch", "health-report"], cwd=tmp_path, capture_output=True, text=True,
        timeout=60,
    )
    assert batch.returncode == 2, batch.stdout + batch.stderr
    assert "federation-sender[batch]" in batch.stderr
    assert len(batch.stderr.strip().splitlines()) == 1, batch.stderr

    base = free_port_block(10 + DESTINATIONS)
    demo = _run(
        [
            exe, "demo", "--destinations", str(DESTINATIONS), "--rooms", "4",
            "--events", "120", "--duration", "6", "--no-live", "--port-base", str(base),
        ],
        cwd=tmp_path,
        timeout=240,
    )
    assert "delivery check: OK" in demo.stdout, demo.stdout[-3000:]
    assert "Traceback" not in demo.stdout + demo.stderr
