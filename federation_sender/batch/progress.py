"""Progress lines while a job runs and the summary table at its end.

Each step prints a start line and a done line with its duration, on stderr (stdout is
for results: the summary, or JSON with ``--json``). Spark's own console progress bar
(stage x/y) can be switched on beside it; it also writes to stderr.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TextIO

from federation_sender.clock import Clock


class Progress:
    def __init__(self, job: str, clock: Clock, stream: TextIO | None = None,
                 enabled: bool = True,
                 on_step: Callable[[str | None], None] | None = None) -> None:
        """``on_step`` hears each step's numbered name as it starts and None as it
        ends (the command line names Spark's jobs after the steps with it)."""
        self._job = job
        self._on_step = on_step
        self._clock = clock
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = enabled
        self._started_s = clock.monotonic_s()
        self.steps: list[tuple[str, float]] = []

    def _say(self, text: str) -> None:
        if self._enabled:
            print(f"[{self._job}] {text}", file=self._stream, flush=True)

    def say(self, text: str) -> None:
        """A line of its own between the steps (on stderr unless quiet)."""
        self._say(text)

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        n = len(self.steps) + 1
        self._say(f"{n}. {name} ...")
        if self._on_step is not None:
            self._on_step(f"{n}. {name}")
        t0 = self._clock.monotonic_s()
        try:
            yield
        except BaseException:
            self._say(f"{n}. {name} FAILED after {self._clock.monotonic_s() - t0:.1f} s")
            raise
        finally:
            if self._on_step is not None:
                self._on_step(None)
        took = self._clock.monotonic_s() - t0
        self.steps.append((name, took))
        self._say(f"{n}. {name} done in {took:.1f} s")

    @property
    def elapsed_s(self) -> float:
        return self._clock.monotonic_s() - self._started_s


def format_summary(job: str, summary: Mapping[str, object],
                   steps: list[tuple[str, float]], elapsed_s: float) -> str:
    """A plain two-column table: the job's figures, then time per step."""
    rows = [(k, _fmt(v)) for k, v in summary.items()]
    rows += [(f"time: {name}", f"{s:.1f} s") for name, s in steps]
    rows.append(("time: total", f"{elapsed_s:.1f} s"))
    width = max(len(k) for k, _ in rows)
    lines = [f"== {job} =="]
    lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
    return "\n".join(lines)


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)
