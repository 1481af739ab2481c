"""Parts of one transaction's cost that ``bench/txn_cost.py`` cannot resolve on a
shared machine (a few microseconds of about 150), timed alone in microseconds per
transaction, for whichever ``federation_sender`` is imported (run it twice, once with
``PYTHONPATH`` pointing at another version's source, to compare):

* ``queue attempt``: ``TimedAttempts.send`` around a sender that answers at once and,
  as ``FederationClient`` does, declares that it bounds every attempt
  (``attempt_bound_s``, 60 s; the queue's deadline 65 s, as the worker sets them);
* ``metrics``: what one transaction records in Prometheus (``http_request``,
  ``http_response``, ``transaction_finished``);
* ``dropped attempt``: ``DroppedAttempt``, entered for every transaction over the
  traces-per-second limit.

    .venv/bin/python bench/txn_parts.py [--n 50000] [--repeats 7]
    PYTHONPATH=/tmp/base .venv/bin/python bench/txn_parts.py   # another version
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from prometheus_client import CollectorRegistry

import federation_sender
from federation_sender.clock import SystemClock
from federation_sender.queue.attempt import TimedAttempts
from federation_sender.telemetry.metrics import Metrics
from federation_sender.telemetry.tracing import DroppedAttempt
from federation_sender.transport.result import Outcome, SendResult, Transaction

OK = SendResult(Outcome.SUCCESS, 200, request_bytes=10, duration_s=0.001)


class AnswersAtOnce:
    attempt_bound_s = 60.0

    async def send_transaction(self, txn: Transaction) -> SendResult:
        return OK


async def queue_attempt(n: int) -> float:
    attempts = TimedAttempts(AnswersAtOnce(), SystemClock(), 65.0)
    txn = Transaction("d.test", "t", (), ())
    t0 = time.perf_counter()
    for _ in range(n):
        await attempts.send(txn)
    attempts.close()
    return (time.perf_counter() - t0) / n * 1e6


def metrics(n: int) -> float:
    m = Metrics(CollectorRegistry())
    t0 = time.perf_counter()
    for _ in range(n):
        m.http_request("PUT")
        m.http_response("PUT", 200)
        m.transaction_finished("d.test", "success", 1, {}, 0.01)
    return (time.perf_counter() - t0) / n * 1e6


def dropped_attempt(n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        with DroppedAttempt():
            pass
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=50_000)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    runs: dict[str, list[float]] = {"queue attempt": [], "metrics": [], "dropped attempt": []}
    for _ in range(a.repeats):
        runs["queue attempt"].append(asyncio.run(queue_attempt(a.n)))
        runs["metrics"].append(metrics(a.n))
        runs["dropped attempt"].append(dropped_attempt(a.n))
    print(f"federation_sender from {federation_sender.__file__}")
    for name, v in runs.items():
        print(f"  {name:16s} {statistics.median(v):6.2f} us per transaction "
              f"(median of {a.repeats}; {min(v):.2f}-{max(v):.2f})")


if __name__ == "__main__":
    main()
