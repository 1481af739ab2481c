"""Run every benchmark in sequence and print a summary table.

    .venv/bin/python bench/run_all.py            # modest sizes, about 3 minutes
    .venv/bin/python bench/run_all.py --full     # the sizes of docs/benchmarks.md, ~7 min
    .venv/bin/python bench/run_all.py --only fanout,spike

Each benchmark is its own script (run here as a child process, its output shown as it
goes); this runner only picks the headline figures out of their output. Targets hold at
the full sizes (``--full``); at the modest default sizes the figures show the code works
and roughly how fast, and the "vs target" column is left blank where the size differs.

Not run here: ``batch.py`` (needs Spark and minutes per size: ``--batch`` adds it at
100,000 events), ``chaos.py`` (a long fault-injection test, not a benchmark figure),
and the diagnostics behind the fan-out figures (``fanout_diagnostics.py``,
``txlog_insert.py``, ``profile_fanout.py``, ``http_floor.py``).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Figure:
    label: str
    pattern: str  # a regex with one group: the value
    target: str = ""
    # Compare to the target: ("<=", 30.0) or (">=", 0.7), on the first number of the value.
    check: tuple[str, float] | None = None
    last: bool = False  # the last match rather than the first


@dataclass(frozen=True)
class Bench:
    name: str
    script: str
    modest: list[str]
    full: list[str]
    figures: list[Figure] = field(default_factory=list)


def _label(text: str) -> str:
    """The value printed after ``text`` by common.report (two spaces, padding, value)."""
    return rf"^\s+{re.escape(text)}\s+(.+)$"


BENCHES = [
    Bench("replication", "replication.py",
          ["--lines", "100000", "--rows", "50000", "--repeat", "1"],
          ["--repeat", "5"],
          [Figure("RDATA lines parsed and dispatched (wall median)",
                  r"^RDATA parsed\+dispatched\s+wall: best [\d,]+/s median ([\d,]+/s)",
                  ">= 200,000/s", (">=", 200_000)),
           Figure("  the same per CPU-second (machine shared)",
                  r"^RDATA parsed\+dispatched.*per CPU-second: median ([\d,]+/s)"),
           Figure("rows end to end over loopback TCP (wall median)",
                  r"^rows end to end \(TCP\)\s+wall: best [\d,]+/s median ([\d,]+/s)",
                  ">= 50,000/s", (">=", 50_000)),
           Figure("  the same per CPU-second (machine shared)",
                  r"^rows end to end \(TCP\).*per CPU-second: median ([\d,]+/s)")]),
    Bench("fanout", "fanout.py", [], [],
          [f for n, name in (("200", "200"), ("1000", "1,000")) for f in (
              Figure(f"fan-out {name} destinations: production txn/s",
                     rf"fan-out to {n} destinations[^\n]*\n(?:.*\n)*?\s+production: txn/s"
                     r"[^\n]*?\s+(\d+) \("),
              Figure(f"fan-out {name} destinations: production / signed bare loop",
                     rf"fan-out to {n} destinations[^\n]*\n(?:.*\n)*?\s+ratio production / bare"
                     r" signed \(target >= 0\.8\)\s+([\d.]+)", ">= 0.8", (">=", 0.8)),
              Figure(f"fan-out {name} destinations: stand-in / unsigned bare loop",
                     rf"fan-out to {n} destinations[^\n]*\n(?:.*\n)*?\s+ratio stand-in / bare"
                     r" unsigned\s+([\d.]+)"))]),
    Bench("spike", "spike.py", ["--events", "1500"], [],
          [Figure("spike drain time", _label("drain time (target <= 30 s)"), "<= 30 s",
                  ("<=", 30.0)),
           Figure("spike peak RSS", _label("peak RSS"))]),
    Bench("idle_memory", "idle_memory.py", ["--dests", "20000", "--senders", "production"],
          ["--senders", "production"],
          [Figure("known idle destinations: RSS after start and sweep",
                  _label("phase 1: started + wake-up sweep (woken)")),
           Figure("  after one transaction each: peak RSS", _label("phase 2: peak RSS")),
           Figure("  after one transaction each, all idle again and trimmed",
                  r"^\s+all idle again, after the worker's trim \(\d+ trims\) "
                  r"\(target <= 150\)\s+(.+)$", "<= 150 MB", ("<=", 150.0))]),
    Bench("recovery", "recovery.py", ["--dests", "2000"], [],
          [Figure("recovery: all caught up after",
                  _label("all caught up after (target <= 60 s)"), "<= 60 s", ("<=", 60.0)),
           Figure("recovery: destinations still behind",
                  _label("destinations still behind"), "0", ("<=", 0.0))]),
    Bench("scaling", "scaling.py",
          ["--destinations", "50,200,500", "--rooms", "10,100,300",
           "--events", "1000,2000,5000"], [],
          [Figure(f"scaling, largest {s[:-1]} point", rf"^\s*{s}:\s+(.*)$", last=True)
           for s in ("destinations", "rooms", "events")]),
]

BATCH = Bench("batch", "batch.py", ["--sizes", "100000", "--scaling-partitions", "4"],
              ["--sizes", "100000,1000000"], [])


def run(b: Bench, full: bool) -> tuple[str, float, int]:
    argv = [sys.executable, str(HERE / b.script), *(b.full if full else b.modest)]
    print(f"\n##### {b.name}: {' '.join(argv[1:])}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=HERE.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    out = []
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        out.append(line)
    rc = proc.wait()
    return "".join(out), time.perf_counter() - t0, rc


def verdict(f: Figure, value: str, same_size: bool) -> str:
    if f.check is None or not same_size:
        return ""
    m = re.search(r"-?[\d,]*\.?\d+", value)
    if not m:
        return "?"
    x = float(m.group(0).replace(",", ""))
    op, limit = f.check
    ok = x >= limit if op == ">=" else x <= limit
    return "met" if ok else "NOT met"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="the sizes of the documented figures")
    ap.add_argument("--only", default=None, help="comma-separated benchmark names")
    ap.add_argument("--batch", action="store_true", help="also run batch.py (needs Spark)")
    a = ap.parse_args()
    benches = BENCHES + ([BATCH] if a.batch else [])
    if a.only:
        wanted = set(a.only.split(","))
        benches = [b for b in benches if b.name in wanted]
    rows: list[tuple[str, str, str, str, str]] = []
    failed = []
    for b in benches:
        out, secs, rc = run(b, a.full)
        if rc != 0:
            failed.append(b.name)
        same_size = a.full or b.modest == b.full
        for f in b.figures:
            found = list(re.finditer(f.pattern, out, re.M))
            m = found[-1] if f.last else (found[0] if found else None)
            value = re.sub(r"\s+", " ", m.group(1).strip()) if m else "(not found)"
            rows.append((b.name, f.label, value, f.target, verdict(f, value, same_size)))
        rows.append((b.name, "run time (incl. setup)", f"{secs:.0f} s", "",
                     "" if rc == 0 else f"exit {rc}"))
    widths = [max(len(r[i]) for r in [("benchmark", "figure", "result", "target", "vs target"),
                                       *rows]) for i in range(5)]
    print(f"\n===== summary ({'full' if a.full else 'modest'} sizes)\n")
    head = ("benchmark", "figure", "result", "target", "vs target")
    for r in [head, tuple("-" * w for w in widths), *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
