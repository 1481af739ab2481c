from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from federation_sender.queue.core.batching import TXN_OVERHEAD_BYTES, Batch, Limits, take_batch
from federation_sender.queue.core.items import EduKind, PduItem, PendingItems, json_size


def pdu(i: int, size: int = 100) -> PduItem:
    return PduItem(i, f"$e{i}", "!r:x", {"event_id": f"$e{i}"}, size)


def test_pdu_and_edu_count_limits() -> None:
    p = PendingItems()
    for i in range(120):
        p.add_pdu(pdu(i))
        p.add_edu("m.other", {"i": i})
    b = take_batch(p, Limits())
    assert len(b.pdus) == 50 and len(b.edus) == 100
    assert [x.stream_ordering for x in b.pdus] == list(range(50))
    b2 = take_batch(p, Limits())
    assert len(b2.pdus) == 50 and len(b2.edus) == 20
    b3 = take_batch(p, Limits())
    assert len(b3.pdus) == 20 and len(b3.edus) == 0
    assert not p


def test_byte_budget_and_oversized_item_goes_alone() -> None:
    p = PendingItems()
    for i in range(10):
        p.add_pdu(pdu(i, 300))
    lim = Limits(max_bytes=TXN_OVERHEAD_BYTES + 1000)
    b = take_batch(p, lim)
    assert len(b.pdus) == 3 and b.size_bytes <= lim.max_bytes
    p2 = PendingItems()
    p2.add_pdu(pdu(1, 5000))
    p2.add_pdu(pdu(2, 10))
    b = take_batch(p2, lim)
    assert [x.event_id for x in b.pdus] == ["$e1"]


def test_edu_order_and_clobbering() -> None:
    p = PendingItems()
    p.add_edu("m.typing", {"room_id": "!a", "typing": True}, key="!a")
    p.add_edu("m.custom", {"n": 1})
    p.add_edu("m.typing", {"room_id": "!a", "typing": False}, key="!a")
    p.add_edu("m.typing", {"room_id": "!b", "typing": True}, key="!b")
    p.add_receipt("!a", "m.read", "@u:l", {"event_ids": ["$1"]})
    p.add_receipt("!a", "m.read", "@v:l", {"event_ids": ["$2"]})
    p.add_presence([{"user_id": "@u:l", "presence": "online"}])
    p.add_presence([{"user_id": "@u:l", "presence": "offline"}])
    from federation_sender.queue.core.items import make_edu
    p.device_lists.append(make_edu(EduKind.DEVICE_LIST, "m.device_list_update", {}, (1, "u", "d")))
    p.to_device.append(make_edu(EduKind.TO_DEVICE, "m.direct_to_device", {}, (1, "", "")))
    b = take_batch(p, Limits())
    assert [e.edu_type for e in b.edus] == [
        "m.presence", "m.receipt", "m.direct_to_device", "m.device_list_update",
        "m.custom", "m.typing", "m.typing",
    ]
    assert b.edus[0].content == {"push": [{"user_id": "@u:l", "presence": "offline"}]}
    assert set(b.edus[1].content["!a"]["m.read"]) == {"@u:l", "@v:l"}
    typing = [e.content for e in b.edus if e.edu_type == "m.typing"]
    assert typing == [{"room_id": "!a", "typing": False}, {"room_id": "!b", "typing": True}]


def test_to_device_leaves_slots_for_device_lists() -> None:
    from federation_sender.queue.core.items import make_edu
    p = PendingItems()
    for i in range(200):
        p.to_device.append(make_edu(EduKind.TO_DEVICE, "m.direct_to_device", {"i": i}, (i, "", "")))
    for i in range(30):
        p.device_lists.append(
            make_edu(EduKind.DEVICE_LIST, "m.device_list_update", {}, (i, "u", str(i))))
    b = take_batch(p, Limits())
    kinds = [e.kind for e in b.edus]
    assert len(b.edus) == 100
    assert kinds.count(EduKind.DEVICE_LIST) == 10
    assert kinds.count(EduKind.TO_DEVICE) == 90


items = st.lists(st.integers(min_value=1, max_value=3000), min_size=2, max_size=200)


@settings(max_examples=60, deadline=None)
@given(sizes=items, edus=st.integers(0, 150), budget=st.integers(500, 20_000))
def test_batches_respect_limits_and_lose_nothing(sizes: list[int], edus: int, budget: int) -> None:
    p = PendingItems()
    for i, s in enumerate(sizes):
        p.add_pdu(pdu(i, s))
    for i in range(edus):
        p.add_edu("m.x", {"i": i})
    lim = Limits(max_bytes=budget)
    seen: list[int] = []
    n_edus = 0
    while p:
        b = take_batch(p, lim)
        assert b, "progress"
        assert len(b.pdus) <= 50 and len(b.edus) <= 100
        assert b.size_bytes <= budget or b.item_count == 1
        seen.extend(x.stream_ordering for x in b.pdus)
        n_edus += len(b.edus)
        first, second = b.split() if b.item_count >= 2 else (b, Batch((), ()))
        assert [*first.pdus, *second.pdus] == list(b.pdus)
        assert [*first.edus, *second.edus] == list(b.edus)
    assert seen == list(range(len(sizes)))
    assert n_edus == edus


def test_json_size_matches_compact_encoding() -> None:
    assert json_size({"a": "é"}) == len('{"a":"é"}'.encode())


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 120).map(lambda n: ("add", n)),
                          st.integers(0, 70).map(lambda n: ("take", n))), max_size=40))
def test_pdu_runs_behave_as_one_list(ops: list[tuple[str, int]]) -> None:
    """The pending PDUs are held as the hand-over's runs, by reference (issue #32's
    memory): taking from the front across runs gives what one flat list would."""
    from federation_sender.queue.core.items import PduRuns

    runs, model, next_so = PduRuns(), list[PduItem](), 0
    for op, n in ops:
        if op == "add":
            items = tuple(pdu(next_so + i) for i in range(n))
            next_so += n
            runs.extend(items)
            model.extend(items)
        else:
            assert runs.head(n) == model[:n]
            runs.drop(n)
            del model[:n]
        assert len(runs) == len(model) and bool(runs) == bool(model)
        assert list(runs) == model
        if model:
            assert runs.first() is model[0] and runs.last() is model[-1]


def test_queues_share_the_hand_over_not_copy_it() -> None:
    """Two queues given the same tuple keep that tuple, not lists of their own."""
    shared = tuple(pdu(i) for i in range(1000))
    a, b = PendingItems(), PendingItems()
    a.add_pdus(shared)
    b.add_pdus(shared)
    assert a.pdus._runs[0] is shared and b.pdus._runs[0] is shared
    first = take_batch(a, Limits())
    assert [x.stream_ordering for x in first.pdus] == list(range(50))
    assert len(a.pdus) == 950 and len(b.pdus) == 1000 and a.pdus._runs[0] is shared
