"""The ``batch`` command line's arguments and exit statuses, apart from the jobs: the main
command line builds its parser from here, and only ``batch`` itself imports the jobs
(:mod:`.cli`), the database clients and the storage layer they need. Every other
command (``--version``, ``check-config``, the worker) starts without them (about 0.9 s of
imports)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_FINDINGS = 4

def _dry_run(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true", help="report the differences, change nothing")


def _rooms(p: argparse.ArgumentParser) -> None:
    """``--room`` (:mod:`.rooms`)."""
    p.add_argument("--room", action="append", default=None, metavar="ROOM_ID", dest="rooms",
                   help="only this room (repeatable): its pairs are found and repaired as in "
                   "a run on every room")


def _repair(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repair", action="store_true", help="fix destination_rooms and rewind "
                   "catch-up positions so the worker resends")
    _add_receiver_options(p)


@dataclass(frozen=True)
class JobSpec:
    """A job as the command line knows it: its help, its own options, and when a run
    writes to the database (a write needs ``--database-url`` and a database that answers,
    even with ``--snapshot``). What it runs is :func:`.cli._run`'s, which imports pyspark.
    A new job is an entry here, its module and a line there."""

    help: str
    options: tuple[Callable[[argparse.ArgumentParser], None], ...] = ()
    writes: Callable[[argparse.Namespace], bool] = lambda args: False
    needs_output: bool = False


JOBS: dict[str, JobSpec] = {
    "backfill-destination-rooms": JobSpec(
        "recompute destination_rooms from events and memberships", (_dry_run, _rooms),
        writes=lambda args: not args.dry_run),
    "audit": JobSpec(
        "anti-entropy check: undelivered events and wrong destination_rooms rows",
        (_rooms, _repair), writes=lambda args: bool(args.repair)),
    "health-report": JobSpec("per-destination health as Parquet, CSV and an HTML report"),
    "snapshot": JobSpec("copy the tables the jobs read into a Parquet directory",
                        needs_output=True),
}

ROOM_JOBS = tuple(name for name, job in JOBS.items() if _rooms in job.options)
"""The jobs ``--room`` restricts (:mod:`.rooms`)."""


def writes(job: str, args: argparse.Namespace) -> bool:
    """Whether this run of ``job`` writes to the database."""
    return JOBS[job].writes(args)


DESCRIPTION = """\
Spark batch jobs over the worker's database (PostgreSQL, or the embedded SQLite
file the demo and the default configuration use), or, with --synapse-config
homeserver.yaml, over Synapse's tables beside which the worker runs.

  backfill-destination-rooms  recompute destination_rooms (--dry-run: report only)
  audit                       find undelivered events and wrong rows (--repair)
  health-report               per-destination health: Parquet, CSV and HTML
  snapshot                    copy the tables to Parquet, for --snapshot runs

Exit status: 0 success, 1 the job failed, 2 bad arguments or configuration, or
a missing prerequisite (the batch extra, Java), 4 the audit found lost or
mismatched rows, or events a receiver does not hold (--ask-receivers).
'federation-sender batch JOB --help' lists a job's options."""


def _common() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("-c", "--config", metavar="FILE", help="YAML configuration file")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--master", help="Spark master URL (default local[*]): "
                       "spark://host:7077, yarn, k8s://..., local-cluster[N,C,MB]")
    where.add_argument("--remote", help="Spark Connect URL, e.g. sc://host:15002")
    p.add_argument("--database-url", help="PostgreSQL URL (default: database.url)")
    p.add_argument("--synapse-config", metavar="FILE", action="append", default=None,
                   help="Synapse's homeserver.yaml (repeat for the worker file, as the "
                   "worker takes them): run on Synapse's tables, in its database")
    p.add_argument("--jdbc-url", help="JDBC URL the executors use, when it differs "
                   "(jdbc:postgresql://host:port/db)")
    p.add_argument("--snapshot", metavar="DIR", help="read tables from this Parquet "
                   "snapshot (see 'batch snapshot') instead of JDBC")
    p.add_argument("--output", metavar="DIR", help="where to write results")
    p.add_argument("--partitions", type=int, default=None, metavar="N",
                   help="parallel JDBC range reads and shuffle partitions "
                   "(default: sized from the tables' row counts, at least 2 per core)")
    p.add_argument("--server-name", help="our server name (default: server_name)")
    p.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                   help="extra Spark configuration, e.g. spark.driver.memory=4g (repeatable)")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--spark-progress", action="store_true",
                   help="show Spark's stage progress bar")
    return p


def add_job_parsers(jobs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    common = _common()
    for name, job in JOBS.items():
        p = jobs.add_parser(name, help=job.help, description=job.help, parents=[common])
        for add_options in job.options:
            add_options(p)


def _add_receiver_options(p: argparse.ArgumentParser) -> None:
    """The audit's bilateral check (:mod:`.bilateral`); off unless asked for: it sends
    signed requests to other servers, where the rest of the audit reads only ours."""
    d = AskLimits()
    p.add_argument("--ask-receivers", type=int, nargs="?", const=d.total, default=0,
                   metavar="N", help="ask the receivers of up to N delivered (destination, "
                   f"room) pairs ({d.total} if N is left out) whether they hold the room's "
                   "newest event we sent; with --repair, hand what they lack back to "
                   "catch-up (default 0: off)")
    p.add_argument("--ask-rate", type=float, default=d.per_destination_per_s,
                   metavar="PER_S", help="requests per second to one destination "
                   f"(default {d.per_destination_per_s:g})")
    p.add_argument("--ask-seed", type=int, default=None, metavar="SEED",
                   help="seed of the sample (default: a random one, reported)")


def add_batch_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``batch <job>`` on the main CLI's sub-commands."""
    p = subparsers.add_parser("batch", help="Spark batch jobs (backfill, audit, health report)",
                              description=DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    jobs = p.add_subparsers(dest="job", metavar="JOB")
    jobs.required = True
    add_job_parsers(jobs)


@dataclass(frozen=True)
class AskLimits:
    """The check's bounds (see the module docstring)."""

    total: int = 1000
    per_destination_per_s: float = 2.0
    request_timeout_s: float = 10.0
    give_up_after: int = 3
    parallel: int = 32

    def __post_init__(self) -> None:
        if self.total < 0:
            raise ValueError("the number of receivers to ask must be at least 0")
        if not self.per_destination_per_s > 0:
            raise ValueError("the request rate per destination must be above 0")
        if not self.request_timeout_s > 0 or self.give_up_after < 1 or self.parallel < 1:
            raise ValueError("the request timeout, give-up count and parallelism must be "
                             "positive")
