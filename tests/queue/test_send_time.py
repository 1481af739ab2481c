"""What ``queue/send_time.py`` makes of a transaction's PDUs once the backend has said
which senders were erased and which events redacted (pure: :func:`apply_facts`), and
that the native backend's answer leaves a batch untouched."""

from __future__ import annotations

import json

import pytest

from federation_sender.pruning import ROOM_VERSIONS, prune
from federation_sender.queue.core.batching import Batch
from federation_sender.queue.core.items import EduKind, PduItem, make_edu
from federation_sender.queue.observer import NoopObserver
from federation_sender.queue.send_time import (
    ERASED_SENDER,
    UNKNOWN_ROOM_VERSION,
    apply_facts,
    filter_at_send,
)
from federation_sender.storage.backend import NativeBackend
from federation_sender.storage.engine import create_engine
from federation_sender.storage.protocols import SendTimeFacts
from federation_sender.transport.encoding import canonical_json


def _item(so: int, sender: str, body: str = "a secret") -> PduItem:
    pdu = {"type": "m.room.message", "room_id": "!r:a.test", "sender": sender,
           "content": {"body": body, "msgtype": "m.text"}, "depth": so,
           "hashes": {"sha256": "h"}, "signatures": {"a.test": {"ed25519:k": "s"}},
           "origin_server_ts": so, "prev_events": [], "auth_events": [], "unsigned": {}}
    encoded = canonical_json(pdu)
    return PduItem(so, f"$e{so}", "!r:a.test", pdu, len(encoded), encoded=encoded)


ALICE, EVE = "@alice:a.test", "@eve:a.test"


def test_erased_senders_events_are_left_out_and_redacted_ones_pruned_in_order() -> None:
    items = [_item(1, ALICE), _item(2, EVE), _item(3, ALICE), _item(4, EVE), _item(5, ALICE)]
    facts = SendTimeFacts(frozenset({EVE}), {"$e3": "11", "$e4": "11", "$e5": "no.such"})
    f = apply_facts(items, facts)
    assert [p.event_id for p in f.pdus] == ["$e1", "$e3"]
    assert f.withheld == {ERASED_SENDER: ["$e2", "$e4"], UNKNOWN_ROOM_VERSION: ["$e5"]}
    assert f.pruned == ["$e3"]
    assert f.pdus[0] is items[0]
    pruned = f.pdus[1]
    assert pruned.pdu == prune(items[2].pdu, ROOM_VERSIONS["11"])
    assert pruned.pdu["content"] == {} and pruned.pdu["hashes"] == {"sha256": "h"}
    # The canonical JSON is made again: the old bytes held the body.
    assert pruned.encoded == canonical_json(pruned.pdu)
    assert pruned.encoded is not None and b"secret" not in pruned.encoded
    assert pruned.size == len(pruned.encoded)
    assert (pruned.uid, pruned.stream_ordering) == (items[2].uid, 3)
    assert items[2].pdu["content"]["body"] == "a secret"  # the shared item is untouched


def test_facts_about_other_events_change_nothing() -> None:
    items = [_item(1, ALICE)]
    f = apply_facts(items, SendTimeFacts(frozenset({EVE}), {"$other": "10"}))
    assert f.pdus == tuple(items) and not f.withheld and not f.pruned


def test_a_pdu_canonical_json_refuses_is_sent_without_bytes() -> None:
    item = _item(1, ALICE)
    bad = PduItem(1, "$e1", "!r:a.test", {**item.pdu, "depth": float("nan")}, item.size,
                  encoded=None)
    (out,) = apply_facts([bad], SendTimeFacts(redacted={"$e1": "10"})).pdus
    assert out.encoded is None and out.pdu["content"] == {}
    assert Batch((out,), ()).pdu_bytes() is None
    json.dumps(out.pdu)  # still JSON for the sender's own encoding


@pytest.mark.parametrize("edus", [(), (make_edu(EduKind.OTHER, "m.typing", {"x": 1}),)])
async def test_the_native_backend_leaves_the_batch_as_it_is(sqlite_url: str,
                                                            edus: tuple) -> None:  # type: ignore[type-arg]
    engine = create_engine(sqlite_url)
    try:
        batch = Batch((_item(1, ALICE), _item(2, EVE)), edus)
        assert await filter_at_send(batch, NativeBackend(engine), NoopObserver(),
                                    "b.test") is batch
    finally:
        await engine.dispose()
