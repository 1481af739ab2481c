"""Publishing our verify key: ``GET /_matrix/key/v2/server``.

Theory of operation
-------------------
A remote server that receives our signed request fetches our public key from
``https://<our server name>/_matrix/key/v2/server`` (after discovery). In a deployment
where the main homeserver already serves this for the same key, nothing here is
needed; a standalone deployment (and the interop tests) serve it from this worker with
:func:`make_key_app`. Remote servers fetch keys over HTTPS only (Synapse answers our
transactions 401 "Failed to find any key" otherwise), so the listener serves TLS with
the server name's certificate (:func:`server_ssl_context`), or sits behind a reverse
proxy that terminates TLS.

The response is built fresh for each request and signed by the key it publishes::

    {"server_name": ..., "valid_until_ts": now + valid_for,
     "verify_keys": {"ed25519:<v>": {"key": "<unpadded base64>"}},
     "old_verify_keys": {...}, "signatures": {<server_name>: {"ed25519:<v>": ...}}}

:func:`parse_server_keys` is the receiving side (used by fake remote servers in tests):
it checks the server name, the expiry and the self-signature before trusting a key.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from typing import Any

from aiohttp import web
from signedjson.key import decode_verify_key_bytes
from signedjson.sign import SignatureVerifyException, verify_signed_json
from unpaddedbase64 import decode_base64

from federation_sender.clock import Clock, time_ms
from federation_sender.errors import LocalPermanentError
from federation_sender.transport.signing import AuthenticationError, SigningKey

SERVER_KEYS_PATH = "/_matrix/key/v2/server"


class KeyListenerTlsError(LocalPermanentError):
    """The key listener's certificate or private key cannot be loaded."""


def server_ssl_context(certificate_path: str, private_key_path: str) -> ssl.SSLContext:
    """The key listener's TLS context (TLS 1.2+); one-line errors for bad files."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(certificate_path, private_key_path)
    except FileNotFoundError as e:
        raise KeyListenerTlsError(f"key listener TLS: no such file {e.filename!r}") from None
    except OSError as e:  # ssl.SSLError is an OSError: not PEM, key does not match, ...
        raise KeyListenerTlsError(
            f"key listener TLS: cannot load {certificate_path!r} with {private_key_path!r}: "
            f"{e.strerror or e}"
        ) from None
    return ctx
DEFAULT_VALID_FOR_S = 24 * 3600.0


def server_keys_response(
    *,
    server_name: str,
    signing_key: SigningKey,
    clock: Clock,
    valid_for_s: float = DEFAULT_VALID_FOR_S,
    old_verify_keys: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The signed key document for ``server_name``."""
    body: dict[str, Any] = {
        "server_name": server_name,
        "valid_until_ts": time_ms(clock) + int(valid_for_s * 1000),
        "verify_keys": {signing_key.key_id: {"key": signing_key.verify_key_base64}},
        "old_verify_keys": {k: dict(v) for k, v in (old_verify_keys or {}).items()},
    }
    return signing_key.sign_json(body, server_name)


def parse_server_keys(body: Any, *, server_name: str, now_ms: int) -> dict[str, Any]:
    """``key_id -> VerifyKey`` from a key document, after checking it is genuine.

    Raises :class:`AuthenticationError` for a wrong server name, an expired document,
    a malformed key, or a document not signed by one of the keys it lists.
    """
    if not isinstance(body, dict) or body.get("server_name") != server_name:
        raise AuthenticationError(f"key document is not for {server_name!r}")
    valid_until = body.get("valid_until_ts")
    if not isinstance(valid_until, int) or valid_until < now_ms:
        raise AuthenticationError(f"key document for {server_name!r} has expired")
    raw_keys = body.get("verify_keys")
    if not isinstance(raw_keys, dict):
        raise AuthenticationError("key document lacks verify_keys")
    keys: dict[str, Any] = {}
    for key_id, entry in raw_keys.items():
        try:
            keys[key_id] = decode_verify_key_bytes(key_id, decode_base64(entry["key"]))
        except Exception as e:  # any malformed entry is the same error to us
            raise AuthenticationError(f"malformed verify key {key_id!r}") from e
    for key in keys.values():
        try:
            verify_signed_json(body, server_name, key)
        except SignatureVerifyException:
            continue
        return keys
    raise AuthenticationError(f"key document for {server_name!r} is not self-signed")


SERVER_NAME_KEY = web.AppKey("server_name", str)
SIGNING_KEY_KEY = web.AppKey("signing_key", SigningKey)
CLOCK_KEY = web.AppKey("clock", Clock)
VALID_FOR_KEY = web.AppKey("valid_for_s", float)


async def _handle_server_keys(request: web.Request) -> web.Response:
    app = request.app
    body = server_keys_response(
        server_name=app[SERVER_NAME_KEY],
        signing_key=app[SIGNING_KEY_KEY],
        clock=app[CLOCK_KEY],
        valid_for_s=app[VALID_FOR_KEY],
    )
    return web.json_response(body)


def add_key_routes(
    app: web.Application,
    *,
    server_name: str,
    signing_key: SigningKey,
    clock: Clock,
    valid_for_s: float = DEFAULT_VALID_FOR_S,
) -> None:
    """Serve our key document on ``app`` (also at the deprecated ``/{keyId}`` path)."""
    app[SERVER_NAME_KEY] = server_name
    app[SIGNING_KEY_KEY] = signing_key
    app[CLOCK_KEY] = clock
    app[VALID_FOR_KEY] = valid_for_s
    app.router.add_get(SERVER_KEYS_PATH, _handle_server_keys)
    app.router.add_get(SERVER_KEYS_PATH + "/", _handle_server_keys)
    app.router.add_get(SERVER_KEYS_PATH + "/{key_id}", _handle_server_keys)


def make_key_app(
    *,
    server_name: str,
    signing_key: SigningKey,
    clock: Clock,
    valid_for_s: float = DEFAULT_VALID_FOR_S,
) -> web.Application:
    """A standalone aiohttp application serving only the key endpoint."""
    app = web.Application()
    add_key_routes(
        app, server_name=server_name, signing_key=signing_key, clock=clock, valid_for_s=valid_for_s
    )
    return app
