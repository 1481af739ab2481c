"""Profile the engine phase of the fan-out benchmark with py-spy and summarise it.

py-spy is attached to this process only while the engine drains the events (the hook
``fanout.PROFILE``: setup, the warm-up and the bare-loop replay are not sampled; the
receivers are other processes). Samples are taken at ``--rate`` Hz; py-spy pauses the
process for each (``--nonblocking`` does not, and then reads torn stacks that charge
time to the wrong lines, so it is off by default). The raw samples
(collapsed stacks, one line per stack with its count; speedscope.app opens them) go to
``--out``; the summary printed here is what docs/benchmarks.md quotes:

* self time by function (the frame on top of each sample), top ``--top``;
* inclusive time of our own functions (any ``federation_sender`` frame on the stack);
* self time by component (our queue engine, transport, storage; aiohttp; SQLAlchemy;
  psycopg; asyncio; json; other), from the file of the top frame.

Idle samples (the loop waiting in ``epoll``) are not recorded, so percentages are of the
CPU the process used.

    .venv/bin/python bench/profile_fanout.py [--dests 1000] [--events 400] \
        [--out artifacts/fanout-profile.txt] [--svg artifacts/fanout-profile.svg]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import fanout
from common import EXTRA_SENDERS, SENDERS, receivers, report

ROOT = Path(__file__).resolve().parents[1]


def _py_spy() -> str:
    here = Path(sys.executable).with_name("py-spy")
    return str(here) if here.exists() else (shutil.which("py-spy") or "py-spy")


class PySpyWindow:
    """Duck-types ``cProfile.Profile``'s ``enable``/``disable`` for fanout.PROFILE."""

    def __init__(self, out: Path, fmt: str, rate: int, nonblocking: bool = False) -> None:
        self.out, self.fmt, self.rate, self.nonblocking = out, fmt, rate, nonblocking
        self.proc: subprocess.Popen[bytes] | None = None

    def enable(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [_py_spy(), "record", "--pid", str(os.getpid()), "--rate", str(self.rate),
             *(["--nonblocking"] if self.nonblocking else []),
             "--format", self.fmt, "--output", str(self.out)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def disable(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        if not self.out.exists():
            sys.stderr.write(err.decode(errors="replace"))
            raise SystemExit("py-spy wrote no profile (ptrace not permitted?)")
        self.proc = None


_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^():]*)(?::(?P<line>\d+))?\)$")

COMPONENTS = [
    ("federation_sender/queue/", "our queue engine"),
    ("federation_sender/transport/", "our transport"),
    ("federation_sender/testing/http_sender", "bench HTTP sender (testing/)"),
    ("federation_sender/storage/", "our storage"),
    ("federation_sender/", "our other code"),
    ("bench/", "benchmark harness"),
    ("aiohttp/", "aiohttp"),
    ("yarl/", "aiohttp (yarl, multidict)"),
    ("multidict/", "aiohttp (yarl, multidict)"),
    ("sqlalchemy/", "SQLAlchemy"),
    ("psycopg", "psycopg"),
    ("greenlet", "SQLAlchemy"),
    ("asyncio/", "asyncio event loop"),
    ("json/", "json"),
    ("selectors", "asyncio event loop"),
]


def component(file: str) -> str:
    for prefix, name in COMPONENTS:
        if prefix in file:
            return name
    return "other"


def parse_frame(frame: str) -> tuple[str, str]:
    m = _FRAME.match(frame)
    if not m:
        return frame, ""
    return m.group("func"), m.group("file")


def summarise(raw: Path, top: int) -> None:
    self_fn: collections.Counter[str] = collections.Counter()
    incl_fn: collections.Counter[str] = collections.Counter()
    comp: collections.Counter[str] = collections.Counter()
    incl_comp: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_s = line.rpartition(" ")
        if not stack:
            continue
        n = int(count_s)
        frames = [parse_frame(f) for f in stack.split(";")]
        # Some stacks begin with a "process"/"thread" pseudo-frame; ignore those.
        frames = [f for f in frames if f[1]]
        if not frames:
            continue
        total += n
        func, file = frames[-1]
        self_fn[f"{func} ({file})"] += n
        comp[component(file)] += n
        seen: set[str] = set()
        seen_c: set[str] = set()
        for func, file in frames:
            c = component(file)
            if c not in seen_c:
                seen_c.add(c)
                incl_comp[c] += n
            if "federation_sender/" in file or file.startswith("bench/"):
                key = f"{func} ({file})"
                if key not in seen:
                    seen.add(key)
                    incl_fn[key] += n
    if not total:
        print("no samples")
        return

    def pct(n: int) -> str:
        return f"{100 * n / total:5.1f} %"

    print(f"\n== py-spy profile of the engine phase: {total} CPU samples")
    print("\n-- self time by component (file of the top frame)")
    for name, n in comp.most_common():
        print(f"  {pct(n)}  {name}")
    print("\n-- inclusive time by component (any frame on the stack)")
    for name, n in incl_comp.most_common():
        print(f"  {pct(n)}  {name}")
    print(f"\n-- self time, top {top} functions")
    for name, n in self_fn.most_common(top):
        print(f"  {pct(n)}  {name}")
    print(f"\n-- inclusive time, top {top} of our functions (federation_sender, bench)")
    for name, n in incl_fn.most_common(top):
        print(f"  {pct(n)}  {name}")


async def run(a: argparse.Namespace) -> None:
    out = Path(a.out)
    if not a.summary_only:
        fanout.PROFILE = PySpyWindow(out, "raw", a.rate, a.nonblocking)
        with receivers(a.receivers) as urls:
            t0 = time.perf_counter()
            r = await fanout.run_one(a.db, a.dests, urls, a.events, a.burst, kind=a.sender)
            report(f"fan-out to {a.dests} destinations under py-spy ({a.rate} Hz, "
                   f"{time.perf_counter() - t0:.0f} s with setup)", [
                ("transactions", f"{int(r['txns'])}"),
                ("engine / bare txn per s", f"{r['engine_tps']:.0f} / {r['bare_tps']:.0f}"),
                ("ratio (perturbed by sampling)", f"{r['engine_tps'] / r['bare_tps']:.2f}"),
            ])
            if a.svg:
                fanout.PROFILE = PySpyWindow(Path(a.svg), "flamegraph", a.rate, a.nonblocking)
                await fanout.run_one(a.db, a.dests, urls, a.events, a.burst, kind=a.sender)
                print(f"  flame graph: {a.svg}")
        print(f"  raw samples: {out}")
    summarise(out, a.top)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", default="postgres", choices=["postgres", "sqlite"])
    ap.add_argument("--dests", type=int, default=1000)
    ap.add_argument("--events", type=int, default=400)
    ap.add_argument("--burst", type=int, default=5)
    ap.add_argument("--receivers", type=int, default=1)
    ap.add_argument("--rate", type=int, default=250)
    ap.add_argument("--sender", default="production", choices=[*SENDERS, *EXTRA_SENDERS])
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--nonblocking", action="store_true", help="sample without pausing")
    ap.add_argument("--out", default=str(ROOT / "artifacts" / "fanout-profile.txt"))
    ap.add_argument("--svg", default=None, help="also record a flame graph (second run)")
    ap.add_argument("--summary-only", action="store_true",
                    help="summarise an existing --out file without running")
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
