"""Key files, X-Matrix headers, and request verification."""

from __future__ import annotations

import contextlib
import itertools
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from signedjson.key import decode_verify_key_bytes
from unpaddedbase64 import decode_base64

from federation_sender.transport.signing import (
    AuthenticationError,
    KeyFileError,
    SigningKey,
    XMatrixAuth,
    format_x_matrix,
    generate_key_file,
    load_signing_key,
    parse_key_file,
    parse_x_matrix,
    sign_request,
    verify_key_lookup,
    verify_request,
)

# A key pair from the Matrix specification's signing examples would tie us to one
# text; instead a fixed seed gives a stable key for format checks.
SEED_B64 = "YJDBA9Xnr2sVqXD9Vj7XVUnmFZcZrlw8Md7kMW+3XA1"


def test_generate_then_load_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "signing.key"
    key = generate_key_file(path, "ed25519:a_test")
    assert key.key_id == "ed25519:a_test"
    assert os.stat(path).st_mode & 0o777 == 0o600
    text = path.read_text()
    alg, version, seed = text.split()
    assert (alg, version) == ("ed25519", "a_test")
    assert "=" not in seed and len(decode_base64(seed)) == 32
    loaded = load_signing_key(path)
    assert loaded.key_id == key.key_id
    assert loaded.verify_key_base64 == key.verify_key_base64


def test_generate_default_version_is_synapse_style(tmp_path: Path) -> None:
    key = generate_key_file(tmp_path / "k")
    assert key.version.startswith("a_") and len(key.version) == 6


def test_generate_refuses_to_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "k"
    path.write_text("precious")
    with pytest.raises(KeyFileError, match="overwrite"):
        generate_key_file(path)
    assert path.read_text() == "precious"


@pytest.mark.parametrize("mode", [0o644, 0o604, 0o660, 0o602, 0o601])
def test_load_refuses_key_readable_or_writable_by_others(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "k"
    generate_key_file(path)
    path.chmod(mode)
    with pytest.raises(KeyFileError, match="mode"):
        load_signing_key(path)


@pytest.mark.parametrize("mode", [0o600, 0o400, 0o640])
def test_load_accepts_private_modes(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "k"
    generate_key_file(path)
    path.chmod(mode)
    load_signing_key(path)


def test_load_refuses_missing_empty_and_malformed(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="cannot stat"):
        load_signing_key(tmp_path / "absent")
    for text, match in [
        ("\n\n", "no key"),
        ("ed25519 a_1\n", "expected"),
        ("rsa a_1 AAAA\n", "unsupported"),
        ("ed25519 a-1 " + SEED_B64 + "\n", "version"),
        ("ed25519 a_1 !!!!\n", "invalid key seed"),
    ]:
        path = tmp_path / "k"
        path.write_text(text)
        path.chmod(0o600)
        with pytest.raises(KeyFileError, match=match):
            load_signing_key(path)


def test_parse_key_file_reads_synapse_format_first_key_signs() -> None:
    keys = parse_key_file(f"ed25519 a_one {SEED_B64}\n\ned25519 a_two {SEED_B64}\n")
    assert [k.key_id for k in keys] == ["ed25519:a_one", "ed25519:a_two"]


def test_x_matrix_format_and_parse_round_trip() -> None:
    auth = XMatrixAuth("origin.example:8448", "dest.example", "ed25519:a_1", "c2lnbmF0dXJl")
    header = format_x_matrix(auth)
    assert header == (
        'X-Matrix origin="origin.example:8448",destination="dest.example",'
        'key="ed25519:a_1",sig="c2lnbmF0dXJl"'
    )
    assert parse_x_matrix(header) == auth


def test_x_matrix_parse_is_lenient_where_rfc_7235_is() -> None:
    parsed = parse_x_matrix('x-matrix  Origin=a.example , KEY="ed25519:k" ,\tsig="s\\"x"')
    assert parsed == XMatrixAuth("a.example", None, "ed25519:k", 's"x')


@pytest.mark.parametrize(
    "header",
    [
        "",
        "Bearer abc",
        "X-Matrix",
        'X-Matrix origin="a"',
        'X-Matrix origin="a,key="k",sig="s"',
        'X-Matrix origin="a",origin="b",key="k",sig="s"',
        'X-Matrix origin="a" key="k",sig="s"',
        'X-Matrix origin=,key="k",sig="s"',
    ],
)
def test_x_matrix_parse_rejects_malformed(header: str) -> None:
    with pytest.raises(AuthenticationError):
        parse_x_matrix(header)


@given(st.text())
def test_x_matrix_parse_any_input_parses_or_raises_one_error(header: str) -> None:
    for candidate in (header, "X-Matrix " + header):
        with contextlib.suppress(AuthenticationError):
            parse_x_matrix(candidate)


@given(
    st.text(min_size=1),
    st.text(min_size=1),
    st.from_regex(r"ed25519:[A-Za-z0-9_]{1,8}", fullmatch=True),
)
def test_x_matrix_round_trips_any_values(origin: str, sig: str, key_id: str) -> None:
    auth = XMatrixAuth(origin, "d", key_id, sig)
    assert parse_x_matrix(format_x_matrix(auth)) == auth


def _signed(key: SigningKey, **overrides: object) -> dict[str, object]:
    args: dict[str, object] = {
        "key": key,
        "origin": "origin.example",
        "destination": "dest.example",
        "method": "PUT",
        "uri": "/_matrix/federation/v1/send/t%2F1",
        "content": {"origin": "origin.example", "pdus": [], "edus": []},
    }
    args.update(overrides)
    return args


def test_signed_request_verifies_and_tampering_fails() -> None:
    key = SigningKey.generate("a_1")
    other = SigningKey.generate("a_1")
    lookup = verify_key_lookup({"origin.example": {key.key_id: key.verify_key}})
    content = {"origin": "origin.example", "pdus": [], "edus": []}
    header = sign_request(**_signed(key))  # type: ignore[arg-type]

    def verify(**kw: object) -> str:
        args: dict[str, object] = {
            "authorization": [header],
            "method": "PUT",
            "uri": "/_matrix/federation/v1/send/t%2F1",
            "our_server_name": "dest.example",
            "content": content,
            "lookup_key": lookup,
        }
        args.update(kw)
        return verify_request(**args)  # type: ignore[arg-type]

    assert verify() == "origin.example"
    for bad in [
        {"method": "POST"},
        {"uri": "/_matrix/federation/v1/send/t/1"},
        {"content": {**content, "pdus": [{}]}},
        {"content": None},
        {"our_server_name": "other.example"},
        {"authorization": []},
        {"authorization": ["Bearer x"]},
        {"authorization": [sign_request(**_signed(other))]},  # type: ignore[arg-type]
        {"authorization": [sign_request(**_signed(key, origin="evil.example"))]},  # type: ignore[arg-type]
        {"lookup_key": verify_key_lookup({})},
    ]:
        with pytest.raises(AuthenticationError):
            verify(**bad)


def test_verify_accepts_keys_decoded_from_published_bytes() -> None:
    key = SigningKey.generate("a_9")
    published = decode_verify_key_bytes(key.key_id, decode_base64(key.verify_key_base64))
    header = sign_request(**_signed(key, content=None, method="GET"))  # type: ignore[arg-type]
    assert (
        verify_request(
            authorization=[header],
            method="GET",
            uri="/_matrix/federation/v1/send/t%2F1",
            our_server_name="dest.example",
            content=None,
            lookup_key=verify_key_lookup({"origin.example": {key.key_id: published}}),
        )
        == "origin.example"
    )


@given(message=st.binary(max_size=4096))
def test_sign_bytes_is_libsodiums_signature(message: bytes) -> None:
    # OpenSSL signs the hot path; ed25519 is deterministic, so it must be the very
    # signature PyNaCl (libsodium, what signedjson uses) gives, and verify with it.
    key = parse_key_file(f"ed25519 a_fix {SEED_B64}\n")[0]
    sig = key.sign_bytes(message)
    assert sig == key.raw.sign(message).signature
    key.verify_key.verify(message, sig)


def test_sign_bytes_matches_on_a_transaction_sized_message() -> None:
    key = SigningKey.generate()
    message = os.urandom(64 * 1024)
    assert key.sign_bytes(message) == key.raw.sign(message).signature


def test_sign_bytes_is_the_same_signature_either_side_of_the_signer_switch() -> None:
    """libsodium signs below LIBSODIUM_BELOW_BYTES, OpenSSL above: the same key gives
    the same (deterministic) signature on both paths, and the receiver's check passes."""
    from federation_sender.transport.signing import LIBSODIUM_BELOW_BYTES

    key = SigningKey.generate("a_sw")
    for size in (0, 150, LIBSODIUM_BELOW_BYTES - 1, LIBSODIUM_BELOW_BYTES, 42_000):
        msg = bytes(i % 251 for i in range(size))
        sig = key.sign_bytes(msg)
        assert sig == key.raw.sign(msg).signature, size  # libsodium's, via signedjson's key
        key.verify_key.verify(msg, sig)


@settings(max_examples=150, deadline=None)
@given(message=st.binary(max_size=20_000), cuts=st.lists(st.integers(0, 20_000), max_size=3))
def test_sign_split_is_the_whole_messages_signature(message: bytes, cuts: list[int]) -> None:
    """However a message is cut into a shared head (in parts) and a tail, the split
    signature is libsodium's signature of the whole, and verifies."""
    key = parse_key_file(f"ed25519 a_fix {SEED_B64}\n")[0]
    bounds = sorted({0, len(message), *(min(c, len(message)) for c in cuts)})
    pieces = [message[a:b] for a, b in itertools.pairwise(bounds)] or [b""]
    head = key.head(*pieces[:-1])
    sig = key.sign_split(head, pieces[-1])
    assert sig == key.raw.sign(message).signature
    key.verify_key.verify(message, sig)


def test_one_head_serves_many_tails_and_other_keys_never() -> None:
    key, other = SigningKey.generate("a_one"), SigningKey.generate("a_two")
    body = os.urandom(30_000)
    head = key.head(b'{"content":', body, b",")
    for dest in ("a.test", "b.test", "c.test"):
        tail = f'"destination":"{dest}"}}'.encode()
        message = b'{"content":' + body + b"," + tail
        assert key.sign_split(head, tail) == key.sign_bytes(message)
        assert other.sign_split(other.head(message), b"") == other.sign_bytes(message)
        assert other.sign_bytes(message) != key.sign_bytes(message)


def test_sign_split_without_libsodiums_point_functions_signs_the_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import federation_sender.transport.signing as signing

    key = SigningKey.generate("a_min")
    message = os.urandom(12_000)
    head = key.head(message[:9_000])
    monkeypatch.setattr(signing, "SPLIT_SIGNING", False)
    assert key.sign_split(head, message[9_000:]) == key.raw.sign(message).signature
