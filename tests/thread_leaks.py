"""A test, or a module's fixtures, that leaves a thread behind fails (a pytest plugin,
loaded by tests/conftest.py).

A leaked thread outlives what started it and breaks tests that run after it in the same
process, far from the cause: the thread check names the test that leaked it instead.

* Per test: an autouse function-scoped fixture records ``threading.enumerate()`` before
  the test's other function-scoped fixtures are set up (wider-scoped ones already are)
  and, once they are torn down, joins each new thread for a grace period and fails the
  test if one is still alive.
* Per module: the same around a module's module-scoped fixtures (a thread that a module
  fixture starts, that its teardown does not stop).

A thread that a wider-scoped resource starts lazily, during whichever test first uses it,
belongs to that resource, not to the test: a thread started by a thread that was already
running before the test (other than the test's own, the main thread) is that thread's
doing. The admin dashboard's server loop (tests/admin/test_admin_dashboard.py, a module
fixture's thread) opens its aiosqlite connections, one thread each, when the browser's
requests arrive; a thread pool or py4j gateway of the session would do the same. Such a
thread is the module's or the session's to stop; so is one that a session-scoped
fixture starts while it is set up (in whichever module first asks for it). The module
check, whose baseline is taken before the module's fixtures, still fails a module
fixture's thread that outlives the module. Nothing is exempted by name.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from collections.abc import Iterator

import pytest

GRACE_S = 5.0
"""How long the check waits for new threads to end (a thread that is stopping, joined
by nobody, is not a leak): generous, since the 2-core machine is often busy."""


_STARTED_BY: weakref.WeakKeyDictionary[threading.Thread, threading.Thread] = (
    weakref.WeakKeyDictionary()
)
"""Each thread started since this plugin was loaded, and the thread that started it."""

_start = threading.Thread.start


def _recording_start(self: threading.Thread) -> None:
    _STARTED_BY[self] = threading.current_thread()
    _start(self)


threading.Thread.start = _recording_start  # type: ignore[method-assign]


_SESSION_FIXTURE_THREADS: weakref.WeakKeyDictionary[threading.Thread, str] = (
    weakref.WeakKeyDictionary()
)
"""Threads started while a session-scoped fixture was set up, and that fixture's name:
the session's (the SparkSession's py4j finalizer and accumulator server, started in
whichever module first asks for ``spark``), stopped at the session's end."""


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[object]) -> object:
    if fixturedef.scope != "session":
        return (yield)
    before = set(threading.enumerate())
    try:
        return (yield)
    finally:
        for thread in threading.enumerate():
            if thread not in before:
                _SESSION_FIXTURE_THREADS[thread] = fixturedef.argname


def _owned_by_a_wider_scope(thread: threading.Thread, before: set[threading.Thread]) -> bool:
    """Started by a session fixture, or by a thread that was running before the test (or
    module) other than the main thread that runs the tests: a wider-scoped resource's
    thread started it."""
    if thread in _SESSION_FIXTURE_THREADS:
        return True
    starter = _STARTED_BY.get(thread)
    return (
        starter is not None
        and starter in before
        and starter is not threading.main_thread()
    )


def _describe(thread: threading.Thread) -> str:
    target = getattr(thread, "_target", None)
    if target is not None:
        what = f"target {getattr(target, '__qualname__', target)!r}"
        module = getattr(target, "__module__", None)
        if module:
            what += f" in {module}"
    else:
        what = f"a {type(thread).__module__}.{type(thread).__qualname__}"
    frame = sys._current_frames().get(thread.ident) if thread.ident else None
    where = ""
    if frame is not None:
        where = f", now at {frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"
    daemon = ", daemon" if thread.daemon else ""
    return f"{thread.name!r} ({what}{daemon}{where})"


def _left_behind(before: set[threading.Thread]) -> list[threading.Thread]:
    """The threads started since ``before`` that do not end within the grace period."""
    deadline = time.monotonic() + GRACE_S
    alive = []
    for thread in threading.enumerate():
        if thread in before or _owned_by_a_wider_scope(thread, before):
            continue
        if isinstance(thread, threading._DummyThread):  # type: ignore[attr-defined]
            # A thread started outside threading (by C code) that asked for its
            # current_thread(): it cannot be joined; report it as it is.
            alive.append(thread)
            continue
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            alive.append(thread)
    return alive


def _check(before: set[threading.Thread], what: str) -> None:
    leaked = _left_behind(before)
    if leaked:
        names = "\n  ".join(_describe(t) for t in leaked)
        pytest.fail(
            f"{what} left {len(leaked)} thread(s) running ({GRACE_S:g} s after its "
            f"teardown):\n  {names}",
            pytrace=False,
        )


@pytest.fixture(autouse=True)
def no_thread_left_by_the_test(request: pytest.FixtureRequest) -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    _check(before, f"test {request.node.nodeid}")


@pytest.fixture(autouse=True, scope="module")
def no_thread_left_by_the_module(request: pytest.FixtureRequest) -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    _check(before, f"the module-scoped fixtures of {request.node.nodeid}")
