"""The loopback CA's certificates (federation_sender/testing/certs.py) are shaped like a
real CA's, so that OpenSSL's strict verification accepts them: Python 3.13's default
client context sets ``ssl.VERIFY_X509_STRICT``, which refuses a chain without key
identifiers ("Missing Authority Key Identifier"). The handshakes here set the flags
explicitly, so every supported Python checks what 3.13 does by default.
"""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from federation_sender.testing.certs import CertFiles, LoopbackCA, make_certs

# What ssl.create_default_context() sets from Python 3.13 on.
STRICT = ssl.VERIFY_X509_STRICT | ssl.VERIFY_X509_PARTIAL_CHAIN


def _load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _ski(cert: x509.Certificate) -> bytes:
    ext = cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier)
    assert not ext.critical
    assert ext.value == x509.SubjectKeyIdentifier.from_public_key(cert.public_key())
    return ext.value.digest


def _aki(cert: x509.Certificate) -> bytes | None:
    ext = cert.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier)
    assert not ext.critical
    return ext.value.key_identifier


def test_the_ca_and_its_leaf_carry_key_identifiers_and_critical_constraints(
    tmp_path: Path,
) -> None:
    ca = LoopbackCA.create(tmp_path / "ca")
    leaf = _load(ca.issue(tmp_path / "leaf", ["127.0.0.1", "remote.test"]).cert)

    ca_constraints = ca.cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert ca_constraints.critical and ca_constraints.value.ca
    ca_usage = ca.cert.extensions.get_extension_for_class(x509.KeyUsage)
    assert ca_usage.critical and ca_usage.value.key_cert_sign and ca_usage.value.crl_sign
    ca_ski = _ski(ca.cert)
    assert _aki(ca.cert) == ca_ski  # a root names itself

    assert _ski(leaf) != ca_ski
    assert _aki(leaf) == ca_ski
    leaf_constraints = leaf.extensions.get_extension_for_class(x509.BasicConstraints)
    assert leaf_constraints.critical and not leaf_constraints.value.ca
    leaf_usage = leaf.extensions.get_extension_for_class(x509.KeyUsage)
    assert leaf_usage.critical and leaf_usage.value.digital_signature
    assert not leaf_usage.value.key_cert_sign
    purposes = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in purposes
    names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["remote.test"]


async def _handshake(files: CertFiles, server_hostname: str) -> dict[str, object]:
    """A TLS connection on loopback to a server presenting ``files``' leaf, verified
    strictly against ``files.ca_cert``; the server's certificate as the client saw it."""
    served = asyncio.Event()

    async def hello(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            w.write(b"hello")
            await w.drain()
        finally:
            w.close()
            served.set()

    client_ctx = ssl.create_default_context(cafile=str(files.ca_cert))
    client_ctx.verify_flags |= STRICT
    server = await asyncio.start_server(hello, "127.0.0.1", 0, ssl=files.server_context())
    try:
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=client_ctx, server_hostname=server_hostname
        )
        try:
            assert await reader.read() == b"hello"
            peer: dict[str, object] = writer.get_extra_info("peercert")
        finally:
            writer.close()
            await writer.wait_closed()
        await asyncio.wait_for(served.wait(), 10)
    finally:
        server.close()
        await server.wait_closed()
    return peer


@pytest.mark.parametrize("name", ["127.0.0.1", "localhost"])
async def test_a_leaf_of_the_loopback_ca_verifies_strictly_in_a_real_handshake(
    tmp_path: Path, name: str
) -> None:
    files = LoopbackCA.create(tmp_path).issue(tmp_path, [name])
    peer = await _handshake(files, name)
    assert peer["subject"] == ((("commonName", name),),)


async def test_make_certs_verifies_strictly_and_so_does_a_trusted_self_signed_one(
    tmp_path: Path,
) -> None:
    await _handshake(make_certs(tmp_path / "ca", ["127.0.0.1"]), "127.0.0.1")
    # A homeserver's snakeoil certificate, trusted as itself.
    await _handshake(make_certs(tmp_path / "self", ["localhost"], self_signed=True), "localhost")


async def test_strict_verification_still_refuses_a_leaf_of_another_ca(tmp_path: Path) -> None:
    leaf = LoopbackCA.create(tmp_path / "a", "CA a").issue(tmp_path / "a", ["127.0.0.1"])
    other = LoopbackCA.create(tmp_path / "b", "CA b")
    with pytest.raises(ssl.SSLCertVerificationError):
        await _handshake(CertFiles(other.cert_path, leaf.cert, leaf.key), "127.0.0.1")
