"""The tests' one wait helper (federation_sender/testing/waiting.py): it returns what it
waited for, and a timeout names what was awaited and what was last seen."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from federation_sender.testing.waiting import WaitTimedOut, wait_until, wait_until_blocking


async def test_returns_the_first_accepted_value() -> None:
    counter = itertools.count()
    assert await wait_until(lambda: next(counter), "three looks", accept=lambda n: n >= 3,
                            timeout_s=5, every_s=0.001) == 3


async def test_a_timeout_names_what_was_awaited_and_the_last_value_seen() -> None:
    seen = {"in_flight": 0}
    with pytest.raises(WaitTimedOut) as e:
        await wait_until(lambda: seen["in_flight"], "one transaction in flight",
                         accept=lambda n: n == 1, timeout_s=0.05,
                         details=lambda: "the log's tail")
    assert str(e.value) == ("timed out after 0.05 s waiting for one transaction in flight; "
                            "last observed: 0\nthe log's tail")
    assert isinstance(e.value, AssertionError)  # pytest reports it as a failed check


async def test_without_a_description_the_probe_s_source_names_it() -> None:
    with pytest.raises(WaitTimedOut, match=r"waiting for .*lambda: \[\], timeout_s"):
        await wait_until(lambda: [], timeout_s=0.02)


async def test_a_probe_that_hangs_is_cancelled_at_the_deadline() -> None:
    async def hangs() -> bool:
        await asyncio.Event().wait()
        return True

    with pytest.raises(WaitTimedOut, match="last observed: nothing"):
        await asyncio.wait_for(wait_until(hangs, "a hanging probe", timeout_s=0.05), 5)


async def test_a_probe_s_own_timeout_is_its_error_not_the_wait_s() -> None:
    async def times_out() -> bool:
        raise TimeoutError("the probe's own")

    with pytest.raises(TimeoutError, match="the probe's own") as e:
        await wait_until(times_out, "a probe that times out", timeout_s=5)
    assert not isinstance(e.value, WaitTimedOut)


async def test_a_wake_up_rechecks_before_the_interval() -> None:
    wake, state = asyncio.Event(), {"done": False}

    async def finish() -> None:
        state["done"] = True
        wake.set()

    asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(finish()))
    # every_s is far beyond the deadline: only the wake-up can end the wait in time.
    assert await wait_until(lambda: state["done"], "the wake-up", timeout_s=5, every_s=60,
                            wake=wake)


def test_the_blocking_flavour_reports_the_same_way() -> None:
    with pytest.raises(WaitTimedOut, match=r"waiting for rows gone; last observed: '2'$"):
        wait_until_blocking(lambda: "2", "rows gone", accept=lambda left: left == "0",
                            timeout_s=0.02, every_s=0.005)
    long = "x" * 2000
    with pytest.raises(WaitTimedOut) as e:
        wait_until_blocking(lambda: long + "END", "the end", accept=lambda _: False,
                            timeout_s=0.01, every_s=0.005)
    assert str(e.value).endswith("END'")  # a long value keeps its tail
