"""Building a transaction's request once: path, canonical body and X-Matrix header.

Theory of operation
-------------------
:class:`RequestBuilder` turns a :class:`Transaction` into what one attempt sends. The
body is assembled from canonical PDU encodings shared by every destination
(:class:`federation_sender.transport.encoding.PduEncodings`), and the signature is
computed over those same bytes wrapped in the request object: one encoding and one
ed25519 signature per transaction content.

A transaction that failed transiently is retried by the queue with the same id and the
same PDU objects (its frozen batch). The builder keeps the last prepared request per
destination until an attempt ends in anything but TRANSIENT; a retry whose id, PDU
objects and EDUs match reuses it -- body, ``origin_server_ts`` and signature -- so a
retry costs neither an encoding nor a signature, and the remote receives the same bytes
under the same transaction id. What is kept is bounded in bytes (oldest dropped first);
a retry whose request was dropped is simply prepared again.

**One content, many destinations.** When a room's event goes to many servers, their
queues often send the very same PDUs together: a 10,000-server room drains in rounds in
which every destination sends the same 50 events. Those transactions differ only in
the request object's ending (destination and transaction id), which canonical JSON
sorts after the content. So a large transaction without EDUs (at least
``LIBSODIUM_BELOW_BYTES``) shares its content -- its body bytes, its
``origin_server_ts`` and the first of ed25519's two hashes over it
(:meth:`~federation_sender.transport.signing.SigningKey.sign_split`) -- with every
later transaction of the same PDU encodings for ``SHARED_CONTENT_MAX_AGE_MS``. The
signature of a 25 KB body then costs about 60 instead of 95 µs
(``bench/runtime_ab.py signers``), and its body is joined once, not per destination.
The bytes the receivers get are those a fresh build would give, but for the timestamp:
a transaction's ``origin_server_ts`` is when its content was first built, at most that
long ago (a retry already carries its first attempt's). Synapse's receiver parses
it and uses it for nothing.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import quote

from unpaddedbase64 import encode_base64

from federation_sender.clock import Clock, time_ms
from federation_sender.transport.encoding import (
    CONTENT_HEAD,
    PduEncodings,
    canonical_json,
    request_tail,
    signing_bytes,
    transaction_body,
)
from federation_sender.transport.result import JsonDict, Outcome, Transaction
from federation_sender.transport.signing import (
    LIBSODIUM_BELOW_BYTES,
    SigningHead,
    SigningKey,
    XMatrixAuth,
    format_x_matrix,
)

SEND_PATH = "/_matrix/federation/v1/send/"
_UNRESERVED = re.compile(r"[A-Za-z0-9_.~-]+")
"""Characters ``quote(..., safe="")`` leaves as they are (RFC 3986 unreserved)."""
DEFAULT_KEPT_BYTES = 32 * 1024 * 1024
SHARED_CONTENT_MAX_AGE_MS = 10_000
"""How long one transaction content (body, timestamp, signing head) is shared."""
SHARED_CONTENTS_MAX = 64
SHARED_CONTENTS_MAX_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class _SharedContent:
    encodings: tuple[bytes, ...]
    """The PDU encodings, held so that the ids keying this entry stay theirs."""
    ts_ms: int
    body: bytes
    head: SigningHead


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    txn_id: str
    pdus: tuple[JsonDict, ...]
    edus: tuple[JsonDict, ...]
    path: str
    body: bytes
    authorization: str

    def matches(self, txn: Transaction) -> bool:
        """Same id, the very same PDU objects in order, equal EDUs."""
        if txn.txn_id != self.txn_id or len(txn.pdus) != len(self.pdus):
            return False
        for a, b in zip(txn.pdus, self.pdus, strict=True):
            if a is not b:
                return False
        return tuple(txn.edus) == self.edus


class RequestBuilder:
    """Prepares requests for one origin and key; counts encodings and signatures."""

    def __init__(
        self,
        *,
        origin: str,
        key: SigningKey,
        clock: Clock,
        pdu_cache_entries: int = 8192,
        kept_bytes: int = DEFAULT_KEPT_BYTES,
        share_contents_ms: int = SHARED_CONTENT_MAX_AGE_MS,
    ) -> None:
        """``share_contents_ms``: how long one large content is shared by destinations
        (0: never, every transaction is built and signed whole; for comparisons)."""
        self._origin = origin
        self._origin_json = canonical_json(origin)
        self._key = key
        self._key_id = key.key_id
        self._dest_params: dict[str, str] = {}
        self._clock = clock
        self.pdus = PduEncodings(pdu_cache_entries)
        self._kept: dict[str, PreparedRequest] = {}
        self._kept_bytes = 0
        self._max_kept_bytes = kept_bytes
        self._share_ms = share_contents_ms
        self._shared: dict[tuple[int, ...], _SharedContent] = {}
        self._shared_bytes = 0
        self.encodes = 0
        """Bodies encoded (not reused)."""
        self.signatures = 0
        """Signatures computed (not reused)."""
        self.shared = 0
        """Signatures whose content (body and first hash) another destination's
        transaction had built."""

    def _header(self, destination: str, signature: bytes) -> str:
        # sign_request_bytes' header with the constant parts formatted once.
        dest = self._dest_params.get(destination)
        if dest is None:
            if len(self._dest_params) >= 10_000:
                self._dest_params.clear()
            dest = self._dest_params[destination] = format_x_matrix(
                XMatrixAuth(self._origin, destination, self._key_id, "")
            ).removesuffix(',sig=""')
        return f'{dest},sig="{encode_base64(signature)}"'

    @property
    def kept(self) -> int:
        return len(self._kept)

    def prepare(self, txn: Transaction) -> PreparedRequest:
        prev = self._kept.get(txn.destination)
        if prev is not None and prev.matches(txn):
            return prev
        encoded = txn.pdu_bytes
        if encoded is None or len(encoded) != len(txn.pdus):
            # The cache lookup inlined: this runs for every PDU of every transaction.
            pdus = self.pdus
            cache = pdus.entries
            encoded = []
            for p in txn.pdus:
                hit = cache.get(id(p))
                encoded.append(hit[1] if hit is not None and hit[0] is p else pdus.get(p))
        txn_id = txn.txn_id
        # The queue's ids (letters, digits, "_", ".") need no quoting: skip urllib's.
        path = SEND_PATH + (txn_id if _UNRESERVED.fullmatch(txn_id) else quote(txn_id, safe=""))
        destination = txn.destination
        shared = (
            self._shared_content(encoded)
            if self._share_ms > 0 and not txn.edus
            and sum(map(len, encoded)) >= LIBSODIUM_BELOW_BYTES
            else None
        )
        if shared is None:
            body = transaction_body(self._origin_json, time_ms(self._clock), encoded, txn.edus)
            self.encodes += 1
            signature = self._key.sign_bytes(signing_bytes(
                content=body, destination=destination, method="PUT", origin=self._origin,
                uri=path,
            ))
        else:
            body = shared.body
            signature = self._key.sign_split(shared.head, request_tail(
                destination=destination, method="PUT", origin=self._origin, uri=path))
        auth = self._header(destination, signature)
        self.signatures += 1
        prepared = PreparedRequest(
            txn.txn_id, tuple(txn.pdus), tuple(txn.edus), path, body, auth
        )
        self._keep(txn.destination, prepared)
        return prepared

    def _shared_content(self, encoded: Sequence[bytes]) -> _SharedContent:
        """The content these PDU encodings share with other destinations' transactions,
        built now if it is new or too old. The caller asks only for bodies of at least
        ``LIBSODIUM_BELOW_BYTES``: below, libsodium's whole signature is as cheap."""
        key = tuple(map(id, encoded))
        now = time_ms(self._clock)
        found = self._shared.get(key)
        if found is not None and 0 <= now - found.ts_ms <= self._share_ms:
            self.shared += 1
            return found
        body = transaction_body(self._origin_json, now, encoded, ())
        self.encodes += 1
        content = _SharedContent(
            tuple(encoded), now, body, self._key.head(CONTENT_HEAD, body, b",")
        )
        shared = self._shared
        if found is not None:
            self._shared_bytes -= len(shared.pop(key).body)
        shared[key] = content
        self._shared_bytes += len(body)
        while len(shared) > 1 and (
            len(shared) > SHARED_CONTENTS_MAX or self._shared_bytes > SHARED_CONTENTS_MAX_BYTES
        ):
            self._shared_bytes -= len(shared.pop(next(iter(shared))).body)
        return content

    def finished(self, destination: str, outcome: Outcome) -> None:
        """An attempt ended: keep the request only for a retry of a transient failure."""
        if outcome is not Outcome.TRANSIENT:
            self._forget(destination)

    def forget_destination(self, destination: str) -> None:
        """The destination's queue was dropped: its kept request and header prefix go."""
        self._forget(destination)
        self._dest_params.pop(destination, None)

    def holds(self, destination: str) -> bool:
        return destination in self._kept or destination in self._dest_params

    def _keep(self, destination: str, prepared: PreparedRequest) -> None:
        self._forget(destination)
        self._kept[destination] = prepared
        self._kept_bytes += len(prepared.body)
        kept = self._kept
        while self._kept_bytes > self._max_kept_bytes and len(kept) > 1:
            oldest = next(iter(kept))
            self._kept_bytes -= len(kept.pop(oldest).body)

    def _forget(self, destination: str) -> None:
        old = self._kept.pop(destination, None)
        if old is not None:
            self._kept_bytes -= len(old.body)

