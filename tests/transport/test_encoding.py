"""The fast canonical JSON writes exactly the bytes canonicaljson writes, and the
assembled body and signed request object are the canonical encodings of the objects
they stand for."""

from __future__ import annotations

import json
from typing import Any

from canonicaljson import encode_canonical_json
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from federation_sender.transport.encoding import (
    PduEncodings,
    canonical_json,
    orjson_safe,
    signing_bytes,
    transaction_body,
)
from federation_sender.transport.signing import (
    SigningKey,
    sign_request,
    sign_request_bytes,
    verify_key_lookup,
    verify_request,
)

# Strings from every plane, control characters, quotes and backslashes, the line and
# paragraph separators, and lone surrogates (which neither encoder may write).
_text = st.text(
    alphabet=st.one_of(
        st.characters(codec=None),
        st.sampled_from(['"', "\\", "\x00", "\x1f", "\x7f", "\u2028", "\u2029", "\ud800",
                         "\U0001f600", "\uffff", "\ue000", "é"]),
    ),
    max_size=12,
)
_plain_scalars = st.one_of(
    st.none(), st.booleans(), _text,
    st.integers(min_value=-(2**53) + 1, max_value=2**53 - 1),
)
# What Matrix does not allow but old events may carry, and what orjson refuses.
_awkward_scalars = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**70), max_value=2**70),
)
_json = st.recursive(
    st.one_of(_plain_scalars, _awkward_scalars),
    lambda children: st.one_of(
        st.lists(children, max_size=5),
        st.tuples(children, children),
        st.dictionaries(_text, children, max_size=5),
        # Non-str keys: canonicaljson turns them into strings (or refuses a mix).
        st.dictionaries(st.integers(-5, 5), children, max_size=3),
    ),
    max_leaves=25,
)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_json)
def test_byte_identical_to_canonicaljson(value: Any) -> None:
    try:
        expected: bytes | None = encode_canonical_json(value)
    except (TypeError, ValueError):  # includes UnicodeEncodeError (surrogates), NaN
        expected = None
    if expected is None:
        try:
            canonical_json(value)
        except (TypeError, ValueError):
            return
        raise AssertionError("canonical_json accepted what canonicaljson refuses")
    assert canonical_json(value) == expected


@given(st.dictionaries(_text, st.one_of(_plain_scalars, st.lists(_plain_scalars)), max_size=8))
def test_plain_json_takes_the_fast_path(value: dict[str, Any]) -> None:
    assert orjson_safe(value)


def test_keys_sort_by_code_point_not_utf16() -> None:
    # U+FF61 sorts after U+1F600 in UTF-16 (surrogates are D800-DFFF) but before it by
    # code point, which is canonical JSON's order.
    value = {"\U0001f600": 1, "\uff61": 2, "a": {"\ue000": [1, "x"], "\U00010000": None}}
    assert canonical_json(value) == encode_canonical_json(value)
    assert orjson_safe(value)


def test_floats_and_deep_nesting_fall_back() -> None:
    assert not orjson_safe({"a": [1, 2.5]})
    assert canonical_json({"a": 1e16, "b": -0.0}) == b'{"a":1e+16,"b":-0.0}'
    deep: Any = 1
    for _ in range(400):  # past orjson's depth limit, within the standard library's
        deep = [deep]
    assert canonical_json(deep) == encode_canonical_json(deep)


_no_surrogates = st.text(st.characters(codec="utf-8"), max_size=12)
_pdu_list = st.lists(st.dictionaries(_text, _plain_scalars, max_size=4), max_size=4)


@settings(max_examples=200, deadline=None)
@given(origin=_text, ts=st.integers(0, 2**53 - 1), pdus=_pdu_list, edus=_pdu_list)
def test_assembled_body_is_the_canonical_body(
    origin: str, ts: int, pdus: list[dict[str, Any]], edus: list[dict[str, Any]]
) -> None:
    try:
        expected = encode_canonical_json(
            {"origin": origin, "origin_server_ts": ts, "pdus": pdus, "edus": edus}
        )
    except ValueError:  # lone surrogates
        return
    cache = PduEncodings()
    body = transaction_body(canonical_json(origin), ts, [cache.get(p) for p in pdus], edus)
    assert body == expected


@settings(max_examples=100, deadline=None)
@given(dest=_no_surrogates, uri=_no_surrogates)
def test_signature_over_assembled_bytes_equals_signedjson(dest: str, uri: str) -> None:
    key = _KEY
    content = {"origin": "o.test", "origin_server_ts": 5, "pdus": [{"k": "é"}], "edus": []}
    body = encode_canonical_json(content)
    message = signing_bytes(content=body, destination=dest, method="PUT", origin="o.test",
                            uri=uri)
    assert message == encode_canonical_json(
        {"content": content, "destination": dest, "method": "PUT", "origin": "o.test",
         "uri": uri}
    )
    header = sign_request_bytes(key=key, origin="o.test", destination=dest, message=message)
    assert header == sign_request(key=key, origin="o.test", destination=dest, method="PUT",
                                  uri=uri, content=content)
    assert verify_request(
        authorization=[header], method="PUT", uri=uri, our_server_name=dest,
        content=json.loads(body),
        lookup_key=verify_key_lookup({"o.test": {key.key_id: key.verify_key}}),
    ) == "o.test"


_KEY = SigningKey.generate("a_enc")


def test_a_shared_pdu_is_encoded_once_and_a_dead_ones_id_is_never_a_hit() -> None:
    cache = PduEncodings(max_entries=2)
    pdu = {"event_id": "$1", "content": {"body": "hi"}}
    first = cache.get(pdu)
    assert cache.get(pdu) is first and cache.encodes == 1
    other = {"event_id": "$2"}
    assert cache.get(other) == b'{"event_id":"$2"}'
    cache.get({"event_id": "$3"})  # evicts the oldest: bounded
    assert len(cache) == 2
    assert cache.get(pdu) == first and cache.encodes == 4


def test_a_transaction_carrying_its_pdus_encodings_is_not_encoded_again() -> None:
    from federation_sender.clock import SystemClock
    from federation_sender.transport.prepare import RequestBuilder
    from federation_sender.transport.result import Transaction

    builder = RequestBuilder(origin="o.test", key=_KEY, clock=SystemClock())
    pdus = [{"event_id": "$1", "b": "é"}, {"event_id": "$2"}]
    carried = [canonical_json(p) for p in pdus]
    sent = builder.prepare(Transaction("d.test", "t1", pdus, [], pdu_bytes=carried))
    assert builder.pdus.encodes == 0  # the carried bytes were used
    body = json.loads(sent.body)
    assert body["pdus"] == pdus
    assert sent.body == encode_canonical_json({**body, "pdus": pdus})
    # Encodings that do not match the PDUs one for one are not trusted.
    builder.prepare(Transaction("d.test", "t2", pdus, [], pdu_bytes=carried[:1]))
    assert builder.pdus.encodes == 2


def test_transaction_ids_in_the_path_are_quoted_unless_unreserved() -> None:
    from urllib.parse import quote

    from federation_sender.clock import SystemClock
    from federation_sender.transport.prepare import SEND_PATH, RequestBuilder
    from federation_sender.transport.result import Transaction

    builder = RequestBuilder(origin="o.test", key=_KEY, clock=SystemClock())
    for txn_id in ("m1764.17", "a~b-c_D.9", "a b", "x/y?z", "é", "%41", "t\n"):
        path = builder.prepare(Transaction(f"{len(txn_id)}.test", txn_id, [], [])).path
        assert path == SEND_PATH + quote(txn_id, safe=""), txn_id


def test_the_queue_item_of_an_event_carries_its_canonical_json() -> None:
    from federation_sender.model import EventRow
    from federation_sender.queue.core.catchup import pdu_item

    def row(text: str) -> EventRow:
        return EventRow(stream_ordering=7, event_id="$e", room_id="!r", type="m.room.message",
                        state_key=None, sender="@a:o.test", outlier=False, rejected=False,
                        json=text)

    item = pdu_item(row('{"z": 1, "a": {"y": "é", "b": [1, 2]}}'))
    assert item.encoded == encode_canonical_json(item.pdu)
    # canonical JSON refuses a NaN: the item has no encoding and the sender decides.
    assert pdu_item(row('{"a": NaN}')).encoded is None


def _large_pdus(n: int, tag: str = "") -> tuple[list[dict[str, Any]], list[bytes]]:
    pdus = [{"event_id": f"${tag}{i}", "content": {"body": "é" * 200}} for i in range(n)]
    return pdus, [canonical_json(p) for p in pdus]


def _verified(sent: Any, destination: str) -> dict[str, Any]:
    """The receiver's check of one prepared request: it must verify as sent."""
    content: dict[str, Any] = json.loads(sent.body)
    assert verify_request(
        authorization=[sent.authorization], method="PUT", uri=sent.path,
        our_server_name=destination, content=content,
        lookup_key=verify_key_lookup({"o.test": {_KEY.key_id: _KEY.verify_key}}),
    ) == "o.test"
    assert sent.body == encode_canonical_json(content)
    return content


def test_destinations_sending_the_same_large_content_share_body_and_first_hash() -> None:
    from federation_sender.testing.clock import FakeClock
    from federation_sender.transport.prepare import SHARED_CONTENT_MAX_AGE_MS, RequestBuilder
    from federation_sender.transport.result import Transaction

    clock = FakeClock()
    builder = RequestBuilder(origin="o.test", key=_KEY, clock=clock)
    pdus, carried = _large_pdus(50)
    sent = [builder.prepare(Transaction(f"d{i}.test", f"t{i}", pdus, [], pdu_bytes=carried))
            for i in range(3)]
    assert (builder.encodes, builder.signatures, builder.shared) == (1, 3, 2)
    assert sent[0].body is sent[1].body is sent[2].body
    for i, s in enumerate(sent):
        assert _verified(s, f"d{i}.test")["pdus"] == pdus
    assert len({s.authorization for s in sent}) == 3
    # An EDU makes the content this destination's own.
    edu = {"edu_type": "m.typing", "content": {}}
    own = builder.prepare(Transaction("e.test", "te", pdus, [edu], pdu_bytes=carried))
    assert builder.shared == 2 and own.body is not sent[0].body
    assert _verified(own, "e.test")["edus"] == [edu]
    # Past the age bound the content (and its timestamp) is built again.
    clock.advance(SHARED_CONTENT_MAX_AGE_MS / 1000 + 1)
    late = builder.prepare(Transaction("f.test", "tf", pdus, [], pdu_bytes=carried))
    assert builder.shared == 2
    assert _verified(late, "f.test")["origin_server_ts"] == int(clock.time_s() * 1000)
    assert json.loads(sent[0].body)["origin_server_ts"] < int(clock.time_s() * 1000)


def test_small_or_different_contents_are_not_shared_and_old_ones_are_let_go() -> None:
    from federation_sender.testing.clock import FakeClock
    from federation_sender.transport.prepare import SHARED_CONTENTS_MAX, RequestBuilder
    from federation_sender.transport.result import Transaction

    builder = RequestBuilder(origin="o.test", key=_KEY, clock=FakeClock())
    small, small_carried = _large_pdus(2)
    for i in range(2):
        _verified(builder.prepare(
            Transaction(f"s{i}.test", "ts", small, [], pdu_bytes=small_carried)), f"s{i}.test")
    assert builder.shared == 0
    # The same PDU dicts in another order, or one PDU fewer, are other contents.
    pdus, carried = _large_pdus(50)
    builder.prepare(Transaction("a.test", "t1", pdus, [], pdu_bytes=carried))
    builder.prepare(Transaction("b.test", "t2", pdus[::-1], [], pdu_bytes=carried[::-1]))
    builder.prepare(Transaction("c.test", "t3", pdus[1:], [], pdu_bytes=carried[1:]))
    assert builder.shared == 0
    # Once SHARED_CONTENTS_MAX newer contents were built, the first is built again.
    for k in range(SHARED_CONTENTS_MAX):
        more, more_carried = _large_pdus(20, tag=f"{k}.")
        builder.prepare(Transaction(f"m{k}.test", "tm", more, [], pdu_bytes=more_carried))
    encodes = builder.encodes
    again = builder.prepare(Transaction("z.test", "tz", pdus, [], pdu_bytes=carried))
    assert (builder.shared, builder.encodes) == (0, encodes + 1)
    assert _verified(again, "z.test")["pdus"] == pdus


def test_sharing_turned_off_builds_and_signs_every_content_whole() -> None:
    from federation_sender.testing.clock import FakeClock
    from federation_sender.transport.prepare import RequestBuilder
    from federation_sender.transport.result import Transaction

    clock = FakeClock()
    on = RequestBuilder(origin="o.test", key=_KEY, clock=clock)
    off = RequestBuilder(origin="o.test", key=_KEY, clock=clock, share_contents_ms=0)
    pdus, carried = _large_pdus(50)
    for i in range(3):
        txn = Transaction(f"d{i}.test", f"t{i}", pdus, [], pdu_bytes=carried)
        a, b = on.prepare(txn), off.prepare(txn)
        # Same clock, same content: the very bytes and header either way.
        assert (a.body, a.authorization) == (b.body, b.authorization)
        _verified(b, f"d{i}.test")
    assert (on.shared, on.encodes) == (2, 1)
    assert (off.shared, off.encodes) == (0, 3)
