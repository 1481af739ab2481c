"""Canonical JSON for transaction bodies and X-Matrix signatures, encoded once.

Theory of operation
-------------------
Every byte the client sends or signs must be *canonical JSON* exactly as
``canonicaljson.encode_canonical_json`` writes it (the library Synapse uses): sorted
keys, no whitespace, UTF-8 without ``\\u`` escapes for non-ASCII, ``allow_nan=False``.
:func:`canonical_json` gets there faster:

* **orjson, when it is provably identical.** ``orjson.dumps(obj, OPT_SORT_KEYS)`` writes
  the same bytes as the standard library for dicts with ``str`` keys, lists, tuples,
  ``str``, ``int`` (within 64 bits), ``bool`` and ``None``. It differs for floats
  (``1e+16`` against ``1e16``, NaN written as ``null``), which Matrix's canonical JSON
  does not allow but old events may still carry, and for subclasses and other types. So
  one iterative walk first checks that the value holds only those exact types; if not,
  or if orjson refuses the value (a non-``str`` key, an integer beyond 64 bits, nesting
  past its limit), ``encode_canonical_json`` writes it. The property test
  (``tests/transport/test_encoding.py``) checks byte equality over generated hostile
  JSON: unicode of every plane, control characters, deep nesting, keys that sort
  differently by code point and UTF-16, floats, huge integers.
* **Assembly instead of re-encoding.** A transaction body's keys sort as ``edus``,
  ``origin``, ``origin_server_ts``, ``pdus``, and the signed request object's as
  ``content``, ``destination``, ``method``, ``origin``, ``uri``; both are therefore
  concatenations of canonical pieces. PDUs are shared by every destination's
  transactions (the queue engine hands each destination the same dict), so
  :class:`PduEncodings` encodes each PDU once and every body joins those bytes; the
  signature is computed over the body bytes wrapped in the request object, never a
  second encoding of the body (:func:`signing_bytes`).

The module is pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence

import orjson
from canonicaljson import encode_canonical_json

_PLAIN_SCALARS = frozenset({str, int, bool, type(None)})
_SORT = orjson.OPT_SORT_KEYS


def orjson_safe(obj: object) -> bool:
    """True if ``obj`` holds only types orjson encodes exactly as canonicaljson does.

    Keys are not checked: orjson refuses non-``str`` keys, and the caller falls back.
    """
    stack = [obj]
    pop = stack.pop
    push = stack.extend
    while stack:
        o = pop()
        t = type(o)
        if t is dict:
            push(o.values())  # type: ignore[attr-defined]
        elif t is list or t is tuple:
            push(o)  # type: ignore[arg-type]
        elif t not in _PLAIN_SCALARS:
            return False
    return True


def canonical_json(obj: object) -> bytes:
    """``encode_canonical_json(obj)``, byte for byte, by orjson where that is safe."""
    if type(obj) is str:  # the request object's names and path: no walk needed
        try:
            return orjson.dumps(obj)
        except orjson.JSONEncodeError:
            return encode_canonical_json(obj)  # a lone surrogate: the library refuses it
    if orjson_safe(obj):
        try:
            return orjson.dumps(obj, option=_SORT)
        except orjson.JSONEncodeError:
            pass  # non-str key, integer beyond 64 bits, too deep: the library decides
    return encode_canonical_json(obj)


def stdlib_canonical_json(obj: object) -> bytes:
    """The reference encoder (for benchmarks' A/B and the property test)."""
    return encode_canonical_json(obj)


class PduEncodings:
    """Canonical encodings of PDU dicts, by object identity, bounded (FIFO).

    The queue engine shares one dict per PDU between every destination, so a PDU sent
    to 1,000 servers is encoded once. The identity check makes a reused ``id()`` of a
    dead object a miss, never a wrong hit.
    """

    def __init__(self, max_entries: int = 8192) -> None:
        self._max = max_entries
        self._cache: dict[int, tuple[object, bytes]] = {}
        self.entries = self._cache
        """``id(pdu) -> (pdu, encoding)``, read-only for callers inlining :meth:`get`."""
        self.encodes = 0
        """PDUs encoded (misses); for tests and benchmarks."""

    def __len__(self) -> int:
        return len(self._cache)

    def get(self, pdu: object) -> bytes:
        hit = self._cache.get(id(pdu))
        if hit is not None and hit[0] is pdu:
            return hit[1]
        encoded = canonical_json(pdu)
        self.encodes += 1
        cache = self._cache
        cache[id(pdu)] = (pdu, encoded)
        if len(cache) > self._max:
            del cache[next(iter(cache))]
        return encoded

    def clear(self) -> None:
        self._cache.clear()


def transaction_body(
    origin_json: bytes, ts_ms: int, pdus: Sequence[bytes], edus: Sequence[object]
) -> bytes:
    """The canonical body ``{"edus", "origin", "origin_server_ts", "pdus"}``.

    ``origin_json`` is the canonical encoding of the origin name; ``pdus`` are the
    canonical encodings of the PDUs, in order.
    """
    return b"".join(
        (
            b'{"edus":',
            canonical_json(list(edus)) if edus else b"[]",
            b',"origin":',
            origin_json,
            b',"origin_server_ts":',
            str(int(ts_ms)).encode(),
            b',"pdus":[',
            b",".join(pdus),
            b"]}",
        )
    )


def signing_bytes(
    *, content: bytes | None, destination: str, method: str, origin: str, uri: str
) -> bytes:
    """The canonical request object an X-Matrix signature covers, around ready
    canonical ``content`` bytes (``None``: a request without a body)."""
    tail = request_tail(destination=destination, method=method, origin=origin, uri=uri)
    # One join: the content (the whole body) is copied once.
    if content is None:
        return b"{" + tail
    return b"".join((CONTENT_HEAD, content, b",", tail))


CONTENT_HEAD = b'{"content":'
"""How a signed request object with a body begins: ``content`` sorts first."""


def request_tail(*, destination: str, method: str, origin: str, uri: str) -> bytes:
    """The signed request object after its content and the comma (or after ``{``
    without one): ``"destination":...,"method":...,"origin":...,"uri":...}``."""
    return b"".join(
        (
            b'"destination":',
            canonical_json(destination),
            b',"method":',
            canonical_json(method),
            b',"origin":',
            canonical_json(origin),
            b',"uri":',
            canonical_json(uri),
            b"}",
        )
    )
