"""Summarise a py-spy raw profile: the share of samples under each function (inclusive)
and per thread how often it was idle. This is how the profile shares in
docs/benchmarks.md were read ("18 % of the worker's loop", "busy 94 % of the time").

    py-spy record -r 100 -d 20 --idle --threads -f raw -o worker.raw -p <worker pid>
    .venv/bin/python bench/pyspy_summary.py worker.raw [--thread MainThread] \
        [--exclude name,...] [--top 40]

py-spy is not a dependency of the project: install it anywhere (``pip install py-spy``).
``--exclude`` drops samples whose stack has a frame containing any of the names (a
benchmark's own set-up, say); samples ending in a wait (selector, lock, condition,
executor queue) count as idle.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

_IDLE = ("select (selectors", "epoll", "Condition.wait", "wait (threading",
         "_wait_for_tstate_lock", "get (queue", "_worker (concurrent", "poll (", "sleep")


def _frame(f: str) -> str:
    f = re.sub(r" \(.*?/(site-packages|federation_sender|bench|python3\.\d+)/", r" (\1/", f)
    return re.sub(r":\d+\)$", ")", f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("profile", type=Path)
    ap.add_argument("--exclude", default="")
    ap.add_argument("--thread", default="", help="only the threads whose name contains this "
                    "(MainThread: the event loop)")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    exclude = [x for x in a.exclude.split(",") if x]
    inclusive: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    idle: Counter[str] = Counter()
    busy = 0
    for line in a.profile.read_text().splitlines():
        stack, _, n_text = line.rpartition(" ")
        n = int(n_text)
        frames = stack.split(";")
        if any(e in f for f in frames for e in exclude) or a.thread not in frames[0]:
            continue
        thread = frames[0] if frames[0].startswith("thread ") else "(one thread)"
        threads[thread] += n
        if any(k in frames[-1] for k in _IDLE):
            idle[thread] += n
            continue
        busy += n
        for f in {_frame(f) for f in frames}:
            inclusive[f] += n
    print("threads: samples, idle share")
    for t, n in threads.most_common():
        print(f"  {t[:60]:60s} {n:6d}  {100 * idle[t] / n:5.1f} % idle")
    print(f"busy samples: {busy}; share of them under each function:")
    for f, n in inclusive.most_common(a.top):
        print(f"  {100 * n / max(1, busy):5.1f} %  {f[:140]}")


if __name__ == "__main__":
    main()
