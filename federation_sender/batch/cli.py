"""``federation-sender batch <job>``: argument parsing and dispatch of the Spark jobs.

Jobs: ``backfill-destination-rooms`` (``--dry-run``), ``audit`` (``--repair``),
``health-report`` (``--output``) and ``snapshot`` (copy the tables the jobs read to a
Parquet directory, for ``--snapshot`` runs on a cluster). Exit status: 0 success,
1 the job failed, 2 bad arguments or configuration, or a missing prerequisite (the
``batch`` extra, Java: :mod:`.requirements`), 4 the audit found lost or mismatched rows
(or, with ``--ask-receivers``, events a receiver does not hold: :mod:`.bilateral`).

``--synapse-config`` (the files the worker takes; the main command line merges them into
the settings, so the database is homeserver.yaml's) picks Synapse's schema
(:mod:`.synapse_source`); without it the jobs read ours.

This module imports no pyspark (the jobs are imported when one runs), so the main
command line and the worker work without the ``batch`` extra.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from federation_sender.batch.arguments import (
    EXIT_FAILED,
    EXIT_FINDINGS,
    EXIT_USAGE,
    JOBS,
    AskLimits,
    writes,
)
from federation_sender.batch.bilateral import ProbeOpener, ReceiverCheck
from federation_sender.batch.io import Database, JdbcSource, SnapshotSource, Source, write_snapshot
from federation_sender.batch.job import JobContext, JobResult
from federation_sender.batch.progress import Progress, format_summary
from federation_sender.batch.requirements import (
    INSTALL_JAVA,
    START_CONNECT,
    START_MASTER,
    MissingPrerequisite,
    check_database,
    check_java,
    check_master,
    check_modules,
    check_remote,
    check_sqlite_jdbc,
)
from federation_sender.batch.rooms import OnlyRooms, checked_rooms
from federation_sender.batch.session import (
    SQLITE_JDBC_JAR,
    SessionOptions,
    SessionStartError,
    SparkUnreachable,
    build_session,
)
from federation_sender.batch.sizing import (
    BIG_TABLES,
    DRIVER_MEMORY_KEY,
    Sizing,
    available_mb,
    partitions_for,
    size_run,
)
from federation_sender.clock import Clock, SystemClock
from federation_sender.config import DEMO_SERVER_NAME, Settings
from federation_sender.storage import batch_reads

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

def _usage(msg: str) -> int:
    print(f"federation-sender batch: {msg}", file=sys.stderr)
    return EXIT_USAGE


def run_batch(args: argparse.Namespace, settings: Settings, *,
              spark: SparkSession | None = None, clock: Clock | None = None,
              out: TextIO | None = None, receivers: ProbeOpener | None = None) -> int:
    """Run the job named by ``args.job``; returns the exit status. ``spark`` reuses a
    running session (tests); otherwise one is built from ``--master``/``--remote`` and
    stopped at the end. ``receivers`` opens the worker's federation client for the
    audit's ``--ask-receivers`` (the main CLI passes it)."""
    out = out if out is not None else sys.stdout
    clock = clock if clock is not None else SystemClock()
    job: str = args.job
    if spark is None:
        # The extra first: without pyspark nothing else about the run matters.
        try:
            check_modules()
        except MissingPrerequisite as e:
            return _usage(str(e))
    server_name, db_url = _target(args, settings)
    db: Database | None = None
    try:
        db = Database.from_urls(db_url, args.jdbc_url)
    except ValueError as e:
        if not args.snapshot:
            return _usage(str(e))
    try:
        conf = _checked_options(args, job, db)
        check = _receiver_check(args, receivers)
    except ValueError as e:
        return _usage(str(e))
    owned = spark is None
    sizing: Sizing | None = None
    if spark is None:
        started = _start_spark(args, job, db, conf)
        if isinstance(started, int):
            return started
        spark, sizing = started
    partitions = args.partitions
    if partitions is None and sizing is not None:
        partitions = sizing.partitions
        if not args.remote and _local_cores(args.master or "local[*]") is None:
            # A cluster: two per executor core of the executors that came up.
            partitions = max(partitions, partitions_for(
                sizing.rows, spark.sparkContext.defaultParallelism // 2))
    if partitions:
        spark.conf.set("spark.sql.shuffle.partitions", str(partitions))
    progress = Progress(job, clock, enabled=not args.quiet,
                        on_step=None if args.remote else _job_namer(spark))
    if sizing is not None and args.partitions is None:
        progress.say(sizing.describe() if partitions == sizing.partitions else
                     f"{sizing.describe()}; {partitions} on this cluster")
    master = args.remote or spark.conf.get("spark.master", None) or "?"
    try:
        result = _run(job, args, spark, db, server_name, progress, clock, check, partitions)
    except Exception as e:  # top of the command: report and fail
        # One line: a Py4J error's text carries the whole Java stack.
        print(f"federation-sender batch {job}: failed: {_first_line(e)}"
              + _out_of_memory_hint(e, spark, sizing), file=sys.stderr)
        return EXIT_FAILED
    finally:
        if owned:
            spark.stop()
    result.summary["spark_master"] = master
    result.summary["partitions"] = partitions or int(
        spark.conf.get("spark.sql.shuffle.partitions") or 0)
    if sizing is not None and sizing.driver_mb is not None:
        result.summary["driver_memory"] = f"{sizing.driver_mb}m"
    _print(result, progress, out, as_json=args.json)
    return result.exit_status


def _job_namer(spark: SparkSession) -> Callable[[str | None], None]:
    """Names each Spark job after the step that runs it, in the Spark UI and the event
    log (None clears it). Spark Connect has no SparkContext to name them on."""
    context = spark.sparkContext

    def name(step: str | None) -> None:
        context.setJobDescription(step)  # type: ignore[arg-type]  # None clears it

    return name


def _target(args: argparse.Namespace, settings: Settings) -> tuple[str, str]:
    """The server name and database URL: the options', else the demo's database when
    it is there (said on stderr), else the settings'."""
    server_name = args.server_name or settings.server_name
    db_url = args.database_url or settings.database.url
    demo = None if args.database_url or args.snapshot else _demo_database(settings)
    if demo is not None:
        db_url, demo_server = demo
        server_name = args.server_name or demo_server
        print(f"federation-sender batch: using the demo's database {db_url} (server name "
              f"{server_name}); give --database-url for another", file=sys.stderr)
    return server_name, db_url


def _checked_options(args: argparse.Namespace, job: str, db: Database | None) -> dict[str, str]:
    """The ``--conf`` pairs, once the options are consistent (:class:`ValueError`: the
    usage line otherwise)."""
    if JOBS[job].needs_output and not args.output:
        raise ValueError(f"{job} needs --output DIR")
    if args.partitions is not None and args.partitions < 1:
        raise ValueError("--partitions must be at least 1")
    checked_rooms(getattr(args, "rooms", None) or ())
    if writes(job, args) and db is None:
        raise ValueError(f"{job} writes to the database: give a --database-url "
                         "(or use --dry-run / leave out --repair)")
    conf: dict[str, str] = {}
    for item in args.conf:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--conf wants KEY=VALUE, not {item!r}")
        conf[key] = value
    return conf


def _receiver_check(args: argparse.Namespace,
                    receivers: ProbeOpener | None) -> ReceiverCheck | None:
    """``--ask-receivers``' check, None when off (:class:`ValueError`: the usage line)."""
    n: int = getattr(args, "ask_receivers", 0)
    if n < 0:
        raise ValueError("--ask-receivers must be at least 0")
    if n == 0:
        return None
    if not args.ask_rate > 0:
        raise ValueError("--ask-rate must be above 0 (requests per second to one destination)")
    if receivers is None:
        raise ValueError("--ask-receivers asks with the worker's federation client: run "
                         "it as 'federation-sender batch audit ...'")
    seed = args.ask_seed if args.ask_seed is not None else secrets.randbelow(2**31)
    return ReceiverCheck(receivers, AskLimits(total=n, per_destination_per_s=args.ask_rate),
                         seed)


def _local_cores(master: str) -> int | None:
    """The cores a ``local[N]`` master runs tasks on, None for any other master (the
    driver is the executor only in local mode)."""
    m = re.fullmatch(r"local(?:\[(\*|\d+)(?:,\d+)?\])?", master)
    if m is None:
        return None
    return os.cpu_count() or 2 if m.group(1) in (None, "*") else int(m.group(1))


def _size(args: argparse.Namespace, db: Database | None,
          conf: dict[str, str]) -> Sizing | None:
    """The run sized from the database's row counts (:mod:`.sizing`); None for a
    snapshot, or when everything was given."""
    if db is None or args.snapshot:
        return None
    if args.partitions is not None and DRIVER_MEMORY_KEY in conf:
        return None
    schema = "synapse" if getattr(args, "synapse_config", None) else "native"
    with db.read() as conn:
        rows = batch_reads.estimated_rows(conn, BIG_TABLES[schema], sqlite=db.sqlite)
    cores = _local_cores(args.master or "local[*]") if not args.remote else None
    return size_run(rows, cores or 2, local=cores is not None and not args.remote,
                    driver_memory_given=DRIVER_MEMORY_KEY in conf,
                    available=available_mb())


def _out_of_memory_hint(e: BaseException, spark: SparkSession,
                        sizing: Sizing | None) -> str:
    """What to give a run that ran out of heap, as the end of its one line."""
    if "OutOfMemoryError" not in str(e):
        return ""
    memory = spark.conf.get(DRIVER_MEMORY_KEY, None) or "1g"
    return (f" (the JVM ran out of heap with spark.driver.memory={memory}"
            + (f" and {spark.conf.get('spark.sql.shuffle.partitions')} partitions"
               if sizing else "")
            + ": give more with --conf spark.driver.memory=, or more --partitions)")


def _start_spark(args: argparse.Namespace, job: str, db: Database | None,
                 conf: dict[str, str]) -> tuple[SparkSession, Sizing | None] | int:
    """A Spark session and the run's sizing, or the exit status when it cannot start
    (said in one line)."""
    try:
        if not args.remote:
            check_java()
        if db is not None and db.sqlite and not args.snapshot and "spark.jars" not in conf:
            check_sqlite_jdbc(SQLITE_JDBC_JAR)
        # What must answer, each in seconds, before Spark takes a minute to find out.
        if db is not None and (not args.snapshot or writes(job, args)):
            check_database(db)
        if args.master:
            check_master(args.master)
        if args.remote:
            check_remote(args.remote)
    except MissingPrerequisite as e:
        return _usage(str(e))
    sizing = _size(args, db, conf)
    if sizing is not None and sizing.driver_mb is not None:
        conf = {**conf, DRIVER_MEMORY_KEY: f"{sizing.driver_mb}m"}
    if sizing is not None and (short := sizing.shortfall()) is not None:
        print(f"federation-sender batch {job}: {short}", file=sys.stderr)
    try:
        return build_session(SessionOptions(
            master=args.master, remote=args.remote,
            shuffle_partitions=args.partitions or (sizing.partitions if sizing else None),
            progress_bar=args.spark_progress, conf=conf,
        )), sizing
    except SparkUnreachable as e:  # the master or the Connect server: configuration
        print(f"federation-sender batch {job}: could not start Spark: {e}: "
              f"{START_CONNECT if args.remote else START_MASTER}", file=sys.stderr)
        return EXIT_USAGE
    except SessionStartError as e:  # the reason Spark logged
        print(f"federation-sender batch {job}: could not start Spark: {e}", file=sys.stderr)
        return EXIT_FAILED
    except Exception as e:  # Py4J's gateway, Spark Connect's channel: one line
        print(f"federation-sender batch {job}: could not start Spark: "
              f"{_first_line(e)}" + ("" if args.remote else
                                     f" (is Java working? {INSTALL_JAVA})"),
              file=sys.stderr)
        return EXIT_FAILED


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _demo_database(settings: Settings) -> tuple[str, str] | None:
    """(URL, server name) of the database ``federation-sender demo`` left, when the
    configuration is the embedded default and that database was never created: so the
    demo followed by a batch job needs no arguments."""
    from sqlalchemy.engine import make_url

    from federation_sender.config import DatabaseSettings

    if settings.database.url != DatabaseSettings().url:
        return None
    if Path(make_url(settings.database.url).database or "").exists():
        return None
    demo = Path(settings.data_dir) / "demo" / "demo.db"
    if not demo.is_file():
        return None
    return f"sqlite:///{demo.resolve()}", DEMO_SERVER_NAME


def _run(job: str, args: argparse.Namespace, spark: SparkSession, db: Database | None,
         server_name: str, progress: Progress, clock: Clock,
         receivers: ReceiverCheck | None = None, sized: int | None = None) -> JobResult:
    # The jobs import pyspark at module level: only here, once it is known installed.
    from federation_sender.batch import audit, backfill, health

    # Each JDBC partition is one database connection: cap the default.
    # A reused session (tests) keeps its own shuffle partitions, and reads in at most 16.
    partitions = sized or min(int(spark.conf.get("spark.sql.shuffle.partitions") or 4), 16)
    beside_synapse = bool(getattr(args, "synapse_config", None))
    with progress.step("open source"):
        source: Source
        if args.snapshot:
            source = SnapshotSource(spark, args.snapshot)
        elif beside_synapse:
            from federation_sender.batch.synapse_source import SynapseJdbcSource

            assert db is not None
            source = SynapseJdbcSource(spark, db, partitions)
        else:
            assert db is not None
            source = JdbcSource(spark, db, partitions)
        rooms: list[str] | None = getattr(args, "rooms", None)
        if rooms:
            source = OnlyRooms(source, rooms)
    if beside_synapse != (source.schema == "synapse"):
        # A snapshot's repairs go to --synapse-config's database only if it is Synapse's.
        raise ValueError(f"a snapshot of the {source.schema} schema "
                         + ("with" if beside_synapse else "without") + " --synapse-config")
    output = Path(args.output) if args.output else None
    ctx = JobContext(spark, source, db, server_name, progress, clock, output)
    if job == "backfill-destination-rooms":
        return _only_rooms(backfill.run(ctx, dry_run=args.dry_run), source)
    if job == "audit":
        res = _only_rooms(audit.run(ctx, repair=args.repair, receivers=receivers), source)
        if res.exit_status:
            res.exit_status = EXIT_FINDINGS
        return res
    if job == "health-report":
        return health.run(ctx)
    if job == "snapshot":
        with progress.step(f"write snapshot to {args.output}"):
            counts = write_snapshot(spark, source, str(args.output))
        return JobResult(job, {"high_water_mark": source.high_water_mark,
                               **{f"rows_{k}": v for k, v in counts.items()}})
    raise AssertionError(job)  # pragma: no cover - argparse restricts the choices


def _only_rooms(result: JobResult, source: Source) -> JobResult:
    """The result, saying how many rooms it covers when ``--room`` restricted it."""
    if isinstance(source, OnlyRooms):
        result.summary["only_rooms"] = len(source.rooms)
    return result


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and v != v:
        return None
    if hasattr(v, "item"):  # numpy scalars from pandas
        return _jsonable(v.item())
    return v


def _print(result: JobResult, progress: Progress, out: TextIO, *, as_json: bool) -> None:
    if as_json:
        doc = {
            "job": result.job,
            "exit_status": result.exit_status,
            "summary": {k: _jsonable(v) for k, v in result.summary.items()},
            "samples": {k: [{c: _jsonable(x) for c, x in row.items()} for row in rows]
                        for k, rows in result.samples.items()},
            "steps": [{"step": n, "seconds": round(s, 3)} for n, s in progress.steps],
            "next_steps": result.next_steps,
        }
        print(json.dumps(doc, indent=2, default=str), file=out)
        return
    print(format_summary(result.job, result.summary, progress.steps, progress.elapsed_s),
          file=out)
    for line in result.next_steps:
        print(f"  next: {line}", file=out)
    for name, rows in result.samples.items():
        if not rows:
            continue
        print(f"  sample of {name}:", file=out)
        for row in rows:
            print("    " + ", ".join(f"{k}={_jsonable(v)}" for k, v in row.items()), file=out)
