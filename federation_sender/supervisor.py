"""Supervised long-running tasks: never a silent zombie.

Every background task of the worker runs under its one :class:`Supervisor` (the app
creates it and gives it to the parts that have background work: the shard heartbeat,
the queue engine's fan-out, wake-up sweep and idle eviction, the replication intake,
the instance lock, the memory trimmer). A task is started in one of three ways:

* :meth:`Supervisor.start`: a task that must keep running. When it raises, the
  exception is logged with the task's name (a :class:`LocalPermanentError`, an expected
  operational stop, as one line; anything else with its traceback). With
  ``restart=True`` it is restarted after a short, growing delay, at most
  ``max_restarts`` times within ``window_s``; beyond that, or for a task that must not
  be restarted, the supervisor fails: :meth:`Supervisor.wait` returns the failure and
  the process exits non-zero. A task that *returns* when it was not asked to stop is
  treated as a failure too.
* :meth:`Supervisor.keep_running`: a loop that outlives its failures (the queue's
  fan-out during a database restart): each failure is logged and the loop runs again
  after ``retry_s``, forever; it never ends the process, and returning ends it quietly.
* :meth:`Supervisor.every`: periodic work (:func:`every`): ``fn`` runs every interval
  on the injected clock; a failed tick is logged and the next one tries again.

A failure of the last two is logged by :func:`log_failure`: a database outage (told
apart by the caller's ``db_outage``, storage's classifier: this module sits below
storage) is one WARNING line without a traceback, anything else an ERROR with it.

Stopping: :meth:`Supervisor.stop` cancels the named tasks and waits for them (a part
stops its own tasks at its place in the worker's stop order: the shard heartbeat runs
until the queues have drained); :meth:`Supervisor.shutdown` cancels whatever is left.
A stopped task's end is never a failure.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from federation_sender.clock import Clock
from federation_sender.errors import LocalPermanentError

log = logging.getLogger(__name__)

TaskFactory = Callable[[], Awaitable[None]]
Outage = Callable[[BaseException], str | None]
"""The one-line reason of an expected database outage, ``None`` for anything else
(``federation_sender.storage.engine.db_outage``)."""
Seconds = float | Callable[[], float]
"""A wait: a number of seconds, or a function drawing each wait (a jittered interval)."""


def _seconds(wait: Seconds) -> float:
    return wait() if callable(wait) else wait


def log_failure(
    logger: logging.Logger,
    exc: BaseException,
    subject: str,
    *,
    db_outage: Outage | None = None,
    stopped: str = "stopped",
    then: str = "",
) -> None:
    """The one way a background failure is logged: ``"<subject> <stopped>, the database
    is unavailable (<reason>)<then>"`` as a WARNING without a traceback when
    ``db_outage`` recognises the error, else ``"<subject> failed<then>"`` as an ERROR
    with the traceback."""
    outage = db_outage(exc) if db_outage is not None else None
    if outage is not None:
        logger.warning("%s %s, the database is unavailable (%s)%s", subject, stopped, outage,
                       then)
    else:
        logger.error("%s failed%s", subject, then, exc_info=exc)


async def every(
    name: str,
    interval_s: Seconds,
    fn: Callable[[], Awaitable[object]],
    *,
    clock: Clock,
    first_s: Seconds | None = None,
    db_outage: Outage | None = None,
    logger: logging.Logger = log,
) -> None:
    """Run ``fn`` every ``interval_s`` on ``clock``, the first time after ``first_s``
    (default: one interval), until cancelled. A tick that raises is logged
    (:func:`log_failure`, ``"<name> skipped, ..."`` or ``"<name> failed"``) and the next
    tick tries again. A callable wait is drawn afresh before each tick."""
    await clock.sleep(_seconds(interval_s if first_s is None else first_s))
    while True:
        try:
            await fn()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the top of a periodic task: the next tick tries again
            log_failure(logger, e, name, db_outage=db_outage, stopped="skipped")
        await clock.sleep(_seconds(interval_s))


async def _keep_running(
    name: str,
    factory: TaskFactory,
    *,
    clock: Clock,
    retry_s: float,
    db_outage: Outage | None,
    logger: logging.Logger,
) -> None:
    while True:
        try:
            await factory()
            return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the top of the loop: it runs again
            log_failure(logger, e, f"{name} loop", db_outage=db_outage, then="; restarting")
        await clock.sleep(retry_s)


@dataclass
class _Spec:
    name: str
    factory: TaskFactory
    restart: bool
    may_return: bool = False
    stopping: bool = False
    restarts: list[float] = field(default_factory=list)
    task: asyncio.Task[None] | None = None


class SupervisorFailed(Exception):
    def __init__(self, name: str, cause: BaseException | None) -> None:
        super().__init__(f"task {name!r} failed permanently: {cause!r}")
        self.name = name
        self.cause = cause


class Supervisor:
    def __init__(self, clock: Clock, *, max_restarts: int = 5, window_s: float = 60.0) -> None:
        self._clock = clock
        self._max_restarts = max_restarts
        self._window_s = window_s
        self._specs: dict[str, _Spec] = {}
        self._failed: asyncio.Future[SupervisorFailed] | None = None

    def _failure_future(self) -> asyncio.Future[SupervisorFailed]:
        if self._failed is None:
            self._failed = asyncio.get_running_loop().create_future()
        return self._failed

    def start(self, name: str, factory: TaskFactory, *, restart: bool = False) -> None:
        """A task that must keep running (see the module docstring)."""
        self._add(_Spec(name, factory, restart))

    def keep_running(
        self,
        name: str,
        factory: TaskFactory,
        *,
        retry_s: float = 1.0,
        db_outage: Outage | None = None,
        logger: logging.Logger = log,
    ) -> None:
        """A loop that outlives its failures: each is logged (``"<name> loop stopped,
        the database is unavailable (...); restarting"`` or ``"<name> loop failed;
        restarting"`` with the traceback) and ``factory`` runs again after ``retry_s``,
        forever. Its returning ends it, and is no failure."""

        async def loop() -> None:
            await _keep_running(name, factory, clock=self._clock, retry_s=retry_s,
                                db_outage=db_outage, logger=logger)

        self._add(_Spec(name, loop, restart=False, may_return=True))

    def every(
        self,
        name: str,
        interval_s: Seconds,
        fn: Callable[[], Awaitable[object]],
        *,
        first_s: Seconds | None = None,
        db_outage: Outage | None = None,
        logger: logging.Logger = log,
    ) -> None:
        """Periodic work under the supervisor: :func:`every` on its clock."""

        async def loop() -> None:
            await every(name, interval_s, fn, clock=self._clock, first_s=first_s,
                        db_outage=db_outage, logger=logger)

        self._add(_Spec(name, loop, restart=False))

    def names(self) -> list[str]:
        """The supervised tasks not stopped yet, in the order they were started."""
        return list(self._specs)

    def _add(self, spec: _Spec) -> None:
        if spec.name in self._specs:
            raise ValueError(f"task {spec.name!r} already supervised")
        self._specs[spec.name] = spec
        spec.task = asyncio.create_task(self._run(spec), name=spec.name)

    async def _run(self, spec: _Spec) -> None:
        while True:
            try:
                await spec.factory()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if spec.stopping:
                    return
                if isinstance(e, LocalPermanentError):
                    # An expected operational stop (its message says why): one line.
                    log.error("supervised task %r stopped: %s", spec.name, e)
                else:
                    log.exception("supervised task %r crashed", spec.name)
                cause: BaseException | None = e
            else:
                if spec.stopping or spec.may_return:
                    return
                log.error("supervised task %r exited unexpectedly", spec.name)
                cause = None
            now = self._clock.monotonic_s()
            spec.restarts = [t for t in spec.restarts if now - t < self._window_s]
            if not spec.restart or len(spec.restarts) >= self._max_restarts:
                fut = self._failure_future()
                if not fut.done():
                    fut.set_result(SupervisorFailed(spec.name, cause))
                return
            spec.restarts.append(now)
            delay = min(5.0, 0.1 * 2 ** len(spec.restarts))
            log.warning("restarting task %r in %.1fs", spec.name, delay)
            await self._clock.sleep(delay)

    async def wait(self, stop: asyncio.Event) -> SupervisorFailed | None:
        """Wait until ``stop`` is set (returns None) or a task fails permanently."""
        fut = self._failure_future()
        stop_task: asyncio.Future[bool] = asyncio.ensure_future(stop.wait())
        waiting: set[asyncio.Future[object]] = {fut, stop_task}  # type: ignore[arg-type]
        try:
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop_task.cancel()
        return fut.result() if fut.done() else None

    async def stop(self, *names: str, timeout_s: float = 10.0) -> None:
        """Cancel these tasks (unknown or stopped names are skipped) and wait (bounded)
        for them to finish; their names may be started again."""
        specs = [self._specs.pop(n) for n in names if n in self._specs]
        tasks = []
        for spec in specs:
            spec.stopping = True
            if spec.task is not None:
                spec.task.cancel()
                tasks.append(spec.task)
        if tasks:
            _done, pending = await asyncio.wait(tasks, timeout=timeout_s)
            for t in pending:
                log.error("task %r did not stop within %.1fs", t.get_name(), timeout_s)

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Cancel every task still running and wait (bounded) for them to finish."""
        await self.stop(*self._specs, timeout_s=timeout_s)
