"""Supervised long-running tasks: never a silent zombie.

Every background loop of the worker runs under one :class:`Supervisor`. When a task
raises, the exception is logged with the task's name and context. A task marked
``restart=True`` is restarted after a short, growing delay, at most ``max_restarts``
times within ``window_s``; beyond that, or for a task that must not be restarted, the
supervisor fails: :meth:`wait` returns the failure and the process exits non-zero.
A task that *returns* when it was not asked to stop is treated as a failure too.
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


@dataclass
class _Spec:
    name: str
    factory: TaskFactory
    restart: bool
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
        self._stopping = False
        self._failed: asyncio.Future[SupervisorFailed] | None = None

    def _failure_future(self) -> asyncio.Future[SupervisorFailed]:
        if self._failed is None:
            self._failed = asyncio.get_running_loop().create_future()
        return self._failed

    def start(self, name: str, factory: TaskFactory, *, restart: bool = False) -> None:
        if name in self._specs:
            raise ValueError(f"task {name!r} already supervised")
        spec = _Spec(name, factory, restart)
        self._specs[name] = spec
        self._launch(spec)

    def _launch(self, spec: _Spec) -> None:
        spec.task = asyncio.create_task(self._run(spec), name=spec.name)

    async def _run(self, spec: _Spec) -> None:
        while True:
            try:
                await spec.factory()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if self._stopping:
                    return
                if isinstance(e, LocalPermanentError):
                    # An expected operational stop (its message says why): one line.
                    log.error("supervised task %r stopped: %s", spec.name, e)
                else:
                    log.exception("supervised task %r crashed", spec.name)
                cause: BaseException | None = e
            else:
                if self._stopping:
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

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Cancel every task and wait (bounded) for them to finish."""
        self._stopping = True
        tasks = [s.task for s in self._specs.values() if s.task is not None]
        for t in tasks:
            t.cancel()
        if tasks:
            _done, pending = await asyncio.wait(tasks, timeout=timeout_s)
            for t in pending:
                log.error("task %r did not stop within %.1fs", t.get_name(), timeout_s)
