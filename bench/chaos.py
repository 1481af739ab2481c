"""Run the chaos test in its long mode and print its figures.

    .venv/bin/python bench/chaos.py [--seconds 900] [--seed 1] [--faults a,b,...]

A thin wrapper around ``pytest tests/reliability/test_rel_chaos.py`` with
``CHAOS_LONG=1``: the harness lives in ``tests/reliability/chaos.py`` so the suite and
this runner share one implementation. The summary (faults injected, events written,
delivery check, duplicates, audit result, worker RSS) is printed by the test on stderr.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=900.0, help="chaos phase length")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--faults", default=None,
                   help="comma-separated subset of kill_worker, cut_replication, "
                        "restart_main, restart_postgres, outage ('' for none)")
    args = p.parse_args()
    env = dict(os.environ, CHAOS_LONG="1", CHAOS_SECONDS=str(args.seconds),
               CHAOS_SEED=str(args.seed))
    if args.faults is not None:
        env["CHAOS_FAULTS"] = args.faults
    cmd = [sys.executable, "-m", "pytest", "tests/reliability/test_rel_chaos.py",
           "-q", "-s", "-p", "no:cacheprovider", "--runxfail"]
    return subprocess.call(cmd, cwd=ROOT, env=env)


if __name__ == "__main__":
    raise SystemExit(main())
