"""Port allocation: what failed a CI run with "Address already in use" (a Synapse
deployment's port taken between the probe and Synapse's bind) cannot happen again."""

from __future__ import annotations

from federation_sender.testing.ports import (
    LOWEST,
    PORT_SLICE_ENV,
    free_port,
    free_port_block,
    port_range,
)


def test_a_port_handed_out_is_never_handed_out_again_by_the_same_process() -> None:
    # 600 draws from 12,768 ports: without the memory, two of them are the same
    # port in all but about one run in a million (the birthday bound).
    ports = [free_port() for _ in range(600)]
    assert len(set(ports)) == len(ports)
    base = free_port_block(5)
    assert not set(range(base, base + 5)) & set(ports)


def test_each_xdist_worker_draws_from_a_slice_of_its_own() -> None:
    slices = [port_range(environ={"PYTEST_XDIST_WORKER": f"gw{i}",
                                  "PYTEST_XDIST_WORKER_COUNT": "3"}) for i in range(3)]
    for i, a in enumerate(slices):
        assert LOWEST <= a.start < a.stop <= 32768
        assert len(a) > 4000
        for b in slices[i + 1:]:
            assert not set(a) & set(b)
    assert port_range(environ={}) == range(LOWEST, 32768)
    assert port_range(environ={"PYTEST_XDIST_WORKER": "master"}) == range(LOWEST, 32768)


def test_a_process_given_a_slice_keeps_to_it_and_its_xdist_workers_share_it() -> None:
    quarters = [port_range(environ={PORT_SLICE_ENV: f"{k}/4"}) for k in range(4)]
    assert [len(q) for q in quarters] == [3192] * 4
    assert quarters[0].start == LOWEST and quarters[3].stop <= 32768
    for i, a in enumerate(quarters):
        for b in quarters[i + 1:]:
            assert not set(a) & set(b)
    workers = [port_range(environ={PORT_SLICE_ENV: "2/4", "PYTEST_XDIST_WORKER": f"gw{i}",
                                   "PYTEST_XDIST_WORKER_COUNT": "2"}) for i in range(2)]
    assert set(workers[0]) | set(workers[1]) <= set(quarters[2])
    assert not set(workers[0]) & set(workers[1])
    assert port_range(environ={PORT_SLICE_ENV: "nonsense"}) == range(LOWEST, 32768)
