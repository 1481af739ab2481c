"""Server signing keys and X-Matrix request authentication.

Theory of operation
-------------------
A homeserver proves who it is with an ed25519 key. The key lives in a file in
Synapse's format, one key a line: ``ed25519 <version> <unpadded base64 seed>``;
the first key in the file signs. Because the seed *is* the server's identity, a key
file that other users can read (or that its group can write) is refused when loaded:
the worker will not start with a leaked-by-permission key.

Every federation request carries an ``Authorization: X-Matrix ...`` header. The
sender builds the JSON object::

    {"method": "PUT", "uri": "/_matrix/...", "origin": "<us>",
     "destination": "<them>", "content": <body, if any>}

signs it with :func:`signedjson.sign.sign_json` (canonical JSON, then ed25519) and puts
``origin``, ``destination``, ``key`` and ``sig`` into the header. The receiver rebuilds
the same object from the request line, its own name and the parsed body, and checks
the signature with the origin's published verify key (:func:`verify_request`).

Canonical JSON and the signature scheme come from ``canonicaljson`` and ``signedjson``
(the libraries Synapse uses); nothing here re-implements them.

Failure modes: a malformed key file, wrong permissions or an existing file on
generation raise :class:`KeyFileError` (local, permanent). Any malformed or forged
``Authorization`` header raises :class:`AuthenticationError` -- the header parser has
no other way to fail.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import stat
import string
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from nacl.bindings import (
    crypto_core_ed25519_scalar_add,
    crypto_core_ed25519_scalar_mul,
    crypto_core_ed25519_scalar_reduce,
    crypto_scalarmult_ed25519_base_noclamp,
    crypto_sign,
    has_crypto_core_ed25519,
    has_crypto_scalarmult_ed25519,
)
from nacl.exceptions import RuntimeError as NaclRuntimeError
from signedjson.key import (
    decode_signing_key_base64,
    encode_signing_key_base64,
    encode_verify_key_base64,
    generate_signing_key,
    get_verify_key,
)
from signedjson.sign import SignatureVerifyException, sign_json, verify_signed_json
from unpaddedbase64 import encode_base64

from federation_sender.errors import LocalPermanentError, RemotePermanentError

ED25519 = "ed25519"
LIBSODIUM_BELOW_BYTES = 8192
"""Messages shorter than this are signed by libsodium, longer ones by OpenSSL."""
_KEY_VERSION_RE = re.compile(r"^[A-Za-z0-9_]+$")
_FORBIDDEN_KEY_FILE_BITS = stat.S_IRWXO | stat.S_IWGRP
# Synapse writes its key file 0644; beside Synapse, others' read access is its choice.
_READ_BY_OTHERS = stat.S_IROTH

log = logging.getLogger(__name__)
"""Other users may not touch the file at all; the group may at most read it."""
SPLIT_SIGNING = has_crypto_core_ed25519 and has_crypto_scalarmult_ed25519
"""Whether this libsodium has the primitives :meth:`SigningKey.sign_split` needs
(PyNaCl's wheels do; a minimal system libsodium may not): without them it signs the
whole message as :meth:`SigningKey.sign_bytes` does."""


@dataclass(frozen=True, slots=True, eq=False)
class SigningHead:
    """The first bytes of messages one key signs many times with different endings,
    with ed25519's nonce hash already taken over them (see :meth:`SigningKey.head`).

    Holds a hash state seeded with the key's secret nonce prefix: keep it in memory,
    never log or persist it."""

    parts: tuple[bytes, ...]
    _nonce: Any = field(repr=False)
    """``SHA-512(prefix || parts)``, copied for each signature."""


class KeyFileError(LocalPermanentError):
    """The signing key file is missing, malformed, or has unsafe permissions."""


class AuthenticationError(RemotePermanentError):
    """An X-Matrix header is malformed, names the wrong destination, or does not verify."""


@dataclass(frozen=True, slots=True)
class SigningKey:
    """An ed25519 server signing key with its key id (``ed25519:<version>``).

    Wraps the untyped ``signedjson``/PyNaCl key object so the rest of the package is
    typed; ``raw`` is what ``signedjson`` functions take. :meth:`sign_bytes`, the hot
    path (one signature per transaction), signs small messages with libsodium and large
    ones with OpenSSL through ``cryptography``: ed25519 signatures are deterministic
    (RFC 8032), so the bytes are libsodium's either way, and OpenSSL's SHA-512 makes a
    42 KB transaction about a quarter cheaper to sign. :meth:`head` and
    :meth:`sign_split` sign many messages that share a long beginning (one transaction
    content to many destinations) for about 60 % of that (``bench/runtime_ab.py
    signers``).
    """

    raw: Any
    _openssl: Ed25519PrivateKey = field(init=False, repr=False, compare=False)
    _seed_and_public: bytes = field(init=False, repr=False, compare=False)
    """libsodium's 64-byte secret key (the seed, then the public key)."""
    _scalar: bytes = field(init=False, repr=False, compare=False)
    """The secret scalar ``a`` (RFC 8032 5.1.5: the clamped first half of
    ``SHA-512(seed)``), reduced mod L for libsodium's scalar functions."""
    _nonce_prefix: Any = field(init=False, repr=False, compare=False)
    """``SHA-512`` seeded with the second half of ``SHA-512(seed)``."""

    def __post_init__(self) -> None:
        seed = bytes(self.raw)
        object.__setattr__(self, "_openssl", Ed25519PrivateKey.from_private_bytes(seed))
        object.__setattr__(self, "_seed_and_public", seed + bytes(self.raw.verify_key))
        expanded = hashlib.sha512(seed).digest()
        scalar = bytearray(expanded[:32])
        scalar[0] &= 248
        scalar[31] &= 127
        scalar[31] |= 64
        if SPLIT_SIGNING:
            scalar = bytearray(crypto_core_ed25519_scalar_reduce(bytes(scalar) + bytes(32)))
        object.__setattr__(self, "_scalar", bytes(scalar))
        object.__setattr__(self, "_nonce_prefix", hashlib.sha512(expanded[32:]))

    def sign_bytes(self, message: bytes) -> bytes:
        """The 64-byte ed25519 signature of ``message``. Below
        ``LIBSODIUM_BELOW_BYTES`` libsodium signs (PyNaCl, as ``signedjson`` does):
        its fixed cost is lower, 16 against 26 µs for a request without a body, 22
        against 30 µs at 2 KB, where a light load's one-PDU transactions are
        (``bench/runtime_ab.py signers``); above it OpenSSL's SHA-512 wins. Both give
        the same bytes (RFC 8032 signatures are deterministic)."""
        if len(message) < LIBSODIUM_BELOW_BYTES:
            return crypto_sign(message, self._seed_and_public)[:64]
        return self._openssl.sign(message)

    def head(self, *parts: bytes) -> SigningHead:
        """The messages that begin with ``parts`` (joined), ready for
        :meth:`sign_split`: the first of ed25519's two hashes over them is taken once
        here, and each signature hashes only its own ending for it."""
        nonce = self._nonce_prefix.copy()
        for part in parts:
            nonce.update(part)
        return SigningHead(parts, nonce)

    def sign_split(self, head: SigningHead, tail: bytes) -> bytes:
        """The ed25519 signature of ``b"".join(head.parts) + tail``: the same 64 bytes
        as :meth:`sign_bytes` (RFC 8032 5.1.6, deterministic), for a fraction of the
        cost when many messages share a long head.

        RFC 8032 hashes the message twice. The nonce ``r = SHA-512(prefix || M)``
        continues from the head's hash state with the tail alone; the challenge
        ``k = SHA-512(R || A || M)`` depends on ``R = rB`` and is taken in full. The
        scalar arithmetic is libsodium's (constant time), never Python integers, which
        would time the secret scalar."""
        if not SPLIT_SIGNING:
            return self.sign_bytes(b"".join((*head.parts, tail)))
        nonce = head._nonce.copy()
        nonce.update(tail)
        r = crypto_core_ed25519_scalar_reduce(nonce.digest())
        try:
            big_r = crypto_scalarmult_ed25519_base_noclamp(r)
        except NaclRuntimeError:  # r = 0 (mod L), a chance of 2^-252: libsodium refuses
            return self.sign_bytes(b"".join((*head.parts, tail)))
        challenge = hashlib.sha512(big_r)
        challenge.update(self._seed_and_public[32:])
        for part in head.parts:
            challenge.update(part)
        challenge.update(tail)
        k = crypto_core_ed25519_scalar_reduce(challenge.digest())
        s = crypto_core_ed25519_scalar_add(r, crypto_core_ed25519_scalar_mul(k, self._scalar))
        return big_r + s

    @property
    def version(self) -> str:
        return str(self.raw.version)

    @property
    def key_id(self) -> str:
        return f"{ED25519}:{self.version}"

    @property
    def verify_key(self) -> Any:
        """The public half, as a ``nacl.signing.VerifyKey`` with ``alg``/``version``."""
        return get_verify_key(self.raw)

    @property
    def verify_key_base64(self) -> str:
        return str(encode_verify_key_base64(self.verify_key))

    def sign_json(self, obj: dict[str, Any], signer: str) -> dict[str, Any]:
        """Return a copy of ``obj`` with this key's signature under ``signer`` added."""
        signed: dict[str, Any] = sign_json(dict(obj), signer, self.raw)
        return signed

    @classmethod
    def generate(cls, version: str | None = None) -> SigningKey:
        """A fresh random key; the version defaults to Synapse's ``a_XXXX`` style."""
        return cls(generate_signing_key(_checked_version(version or _random_version())))


def _random_version() -> str:
    alphabet = string.ascii_letters + string.digits
    return "a_" + "".join(secrets.choice(alphabet) for _ in range(4))


def _checked_version(version: str) -> str:
    if not _KEY_VERSION_RE.match(version):
        raise KeyFileError(f"key version {version!r} must match [A-Za-z0-9_]+")
    return version


def parse_key_file(text: str) -> list[SigningKey]:
    """Parse Synapse's key file format; blank lines are ignored."""
    keys: list[SigningKey] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 3:
            raise KeyFileError(f"key file line {lineno}: expected 'ed25519 <version> <seed>'")
        algorithm, version, seed = fields
        if algorithm != ED25519:
            raise KeyFileError(f"key file line {lineno}: unsupported algorithm {algorithm!r}")
        _checked_version(version)
        try:
            raw = decode_signing_key_base64(algorithm, version, seed)
        except Exception as e:  # binascii.Error, ValueError, nacl errors: all mean "bad seed"
            raise KeyFileError(f"key file line {lineno}: invalid key seed") from e
        keys.append(SigningKey(raw))
    return keys


def format_key_file(keys: Iterable[SigningKey]) -> str:
    return "".join(f"{ED25519} {k.version} {encode_signing_key_base64(k.raw)}\n" for k in keys)


def check_key_file_permissions(path: Path, *, others_may_read: bool = False) -> None:
    """Refuse a key file that is not a regular file or that others can read or write.

    ``others_may_read`` (Synapse's own key file, which Synapse writes with mode 0644):
    read access for others is only warned about; write or execute access is still
    refused."""
    try:
        st = path.stat()
    except OSError as e:
        raise KeyFileError(f"cannot stat signing key file {str(path)!r}: {e.strerror}") from e
    if not stat.S_ISREG(st.st_mode):
        raise KeyFileError(f"signing key file {str(path)!r} is not a regular file")
    forbidden = st.st_mode & _FORBIDDEN_KEY_FILE_BITS
    if others_may_read and forbidden == _READ_BY_OTHERS:
        log.warning(
            "signing key file %s has mode %o (as Synapse writes it); consider chmod 640",
            path,
            stat.S_IMODE(st.st_mode),
        )
        return
    if forbidden:
        raise KeyFileError(
            f"signing key file {str(path)!r} has mode {stat.S_IMODE(st.st_mode):o}; "
            "other users must have no access (try: chmod 600)"
        )


def load_signing_key(
    path: str | os.PathLike[str], *, others_may_read: bool = False
) -> SigningKey:
    """Load the first (signing) key of a key file after checking its permissions."""
    p = Path(path)
    check_key_file_permissions(p, others_may_read=others_may_read)
    try:
        text = p.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as e:
        raise KeyFileError(f"cannot read signing key file {str(p)!r}: {e}") from e
    keys = parse_key_file(text)
    if not keys:
        raise KeyFileError(f"signing key file {str(p)!r} contains no key")
    return keys[0]


def generate_key_file(path: str | os.PathLike[str], key_id: str | None = None) -> SigningKey:
    """Create a new key file (mode 0600) holding one fresh key; never overwrites.

    ``key_id`` may be given as ``ed25519:<version>`` or just ``<version>``.
    """
    version = None
    if key_id is not None:
        version = key_id.removeprefix(f"{ED25519}:")
    key = SigningKey.generate(version)
    p = Path(path)
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError as e:
        raise KeyFileError(f"refusing to overwrite existing key file {str(p)!r}") from e
    except OSError as e:
        raise KeyFileError(f"cannot create key file {str(p)!r}: {e.strerror}") from e
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(format_key_file([key]))
    return key


# --- X-Matrix ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class XMatrixAuth:
    """The parameters of one ``Authorization: X-Matrix`` header."""

    origin: str
    destination: str | None
    key_id: str
    sig: str


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def format_x_matrix(auth: XMatrixAuth) -> str:
    params = [f"origin={_quote(auth.origin)}"]
    if auth.destination is not None:
        params.append(f"destination={_quote(auth.destination)}")
    params += [f"key={_quote(auth.key_id)}", f"sig={_quote(auth.sig)}"]
    return "X-Matrix " + ",".join(params)


_TOKEN_RE = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_OWS = " \t"


def parse_x_matrix(header: str) -> XMatrixAuth:
    """Parse an ``X-Matrix`` credentials string (RFC 7235 auth-params).

    The scheme and parameter names are case-insensitive; values are tokens or quoted
    strings. Anything else raises :class:`AuthenticationError` and nothing else.
    """
    scheme, sep, rest = header.partition(" ")
    if scheme.lower() != "x-matrix" or not sep:
        raise AuthenticationError("Authorization header is not X-Matrix")
    params: dict[str, str] = {}
    i, n = 0, len(rest)
    while True:
        while i < n and rest[i] in _OWS:
            i += 1
        m = _TOKEN_RE.match(rest, i)
        if m is None:
            raise AuthenticationError("malformed X-Matrix header: expected a parameter name")
        name = m.group().lower()
        i = m.end()
        while i < n and rest[i] in _OWS:
            i += 1
        if i >= n or rest[i] != "=":
            raise AuthenticationError("malformed X-Matrix header: expected '='")
        i += 1
        while i < n and rest[i] in _OWS:
            i += 1
        value, i = _parse_value(rest, i)
        if name in params:
            raise AuthenticationError(f"malformed X-Matrix header: duplicate {name!r}")
        params[name] = value
        while i < n and rest[i] in _OWS:
            i += 1
        if i >= n:
            break
        if rest[i] != ",":
            raise AuthenticationError("malformed X-Matrix header: expected ','")
        i += 1
    try:
        return XMatrixAuth(
            origin=params["origin"],
            destination=params.get("destination"),
            key_id=params["key"],
            sig=params["sig"],
        )
    except KeyError as e:
        raise AuthenticationError(f"X-Matrix header lacks {e.args[0]!r}") from None


def _parse_value(s: str, i: int) -> tuple[str, int]:
    if i < len(s) and s[i] == '"':
        out: list[str] = []
        i += 1
        while i < len(s):
            c = s[i]
            if c == "\\" and i + 1 < len(s):
                out.append(s[i + 1])
                i += 2
            elif c == '"':
                return "".join(out), i + 1
            else:
                out.append(c)
                i += 1
        raise AuthenticationError("malformed X-Matrix header: unterminated quoted string")
    m = _TOKEN_RE.match(s, i)
    if m is None:
        raise AuthenticationError("malformed X-Matrix header: expected a value")
    return m.group(), m.end()


def _request_json(
    method: str, uri: str, origin: str, destination: str, content: Any | None
) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "method": method,
        "uri": uri,
        "origin": origin,
        "destination": destination,
    }
    if content is not None:
        obj["content"] = content
    return obj


def sign_request(
    *,
    key: SigningKey,
    origin: str,
    destination: str,
    method: str,
    uri: str,
    content: Any | None = None,
) -> str:
    """The ``Authorization`` header value for one request.

    ``uri`` is the request target exactly as sent (path and query, already encoded).
    """
    signed = key.sign_json(_request_json(method, uri, origin, destination, content), origin)
    sig = signed["signatures"][origin][key.key_id]
    return format_x_matrix(XMatrixAuth(origin, destination, key.key_id, sig))


def sign_request_bytes(
    *, key: SigningKey, origin: str, destination: str, message: bytes, key_id: str | None = None
) -> str:
    """The ``Authorization`` header value for a request whose canonical request object
    (:func:`federation_sender.transport.encoding.signing_bytes`) is ``message``.

    The same header as :func:`sign_request` (ed25519 is deterministic), without
    encoding the content again: ``sign_json`` is canonical JSON, then this signature.
    """
    sig = encode_base64(key.sign_bytes(message))
    return format_x_matrix(XMatrixAuth(origin, destination, key_id or key.key_id, sig))


VerifyKeyLookup = Callable[[str, str], Any | None]
"""``(origin, key_id) -> nacl VerifyKey or None``: the origin's published keys."""


def verify_request(
    *,
    authorization: Iterable[str],
    method: str,
    uri: str,
    our_server_name: str,
    content: Any | None,
    lookup_key: VerifyKeyLookup,
) -> str:
    """Authenticate a received federation request; return the origin server name.

    ``authorization`` holds every ``Authorization`` header value of the request. All
    X-Matrix headers must name the same origin and (if present) ``our_server_name``
    as destination; at least one must carry a valid signature by a key that
    ``lookup_key`` knows. Raises :class:`AuthenticationError` otherwise.
    """
    auths = [parse_x_matrix(h) for h in authorization if h[:8].lower() == "x-matrix"]
    if not auths:
        raise AuthenticationError("missing X-Matrix Authorization header")
    origins = {a.origin for a in auths}
    if len(origins) != 1:
        raise AuthenticationError("X-Matrix headers name different origins")
    origin = auths[0].origin
    for a in auths:
        if a.destination is not None and a.destination != our_server_name:
            raise AuthenticationError(f"X-Matrix destination mismatch: {a.destination!r}")
    obj = _request_json(method, uri, origin, our_server_name, content)
    for a in auths:
        verify_key = lookup_key(origin, a.key_id)
        if verify_key is None:
            continue
        candidate = dict(obj, signatures={origin: {a.key_id: a.sig}})
        try:
            verify_signed_json(candidate, origin, verify_key)
        except SignatureVerifyException:
            continue
        return origin
    raise AuthenticationError(f"no valid signature from {origin!r}")


def verify_key_lookup(keys: Mapping[str, Mapping[str, Any]]) -> VerifyKeyLookup:
    """A :data:`VerifyKeyLookup` over a fixed ``{server: {key_id: VerifyKey}}`` map."""

    def lookup(origin: str, key_id: str) -> Any | None:
        return keys.get(origin, {}).get(key_id)

    return lookup
