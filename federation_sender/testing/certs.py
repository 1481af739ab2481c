"""A throwaway certificate authority for loopback TLS tests (uses ``cryptography``)."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class CertFiles:
    ca_cert: Path
    cert: Path
    key: Path

    def server_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.cert, self.key)
        return ctx


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


@dataclass(frozen=True)
class LoopbackCA:
    """A certificate authority that issues leaf certificates for loopback servers."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey
    cert_path: Path

    @classmethod
    def create(cls, directory: Path, name: str = "test CA") -> LoopbackCA:
        """``name``: the CA's subject; two CAs trusted together need different ones
        (OpenSSL finds an issuer by its name)."""
        key = ec.generate_private_key(ec.SECP256R1())
        signed = (
            _builder(_name(name), _name(name), key, issuer_key=key)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(_CA_USAGE, critical=True)
            .sign(key, hashes.SHA256())
        )
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "ca.pem"
        path.write_bytes(signed.public_bytes(serialization.Encoding.PEM))
        return cls(signed, key, path)

    def issue(self, directory: Path, names: list[str]) -> CertFiles:
        """A leaf for ``names`` (DNS names or IP addresses) signed by this CA."""
        leaf_key = ec.generate_private_key(ec.SECP256R1())
        leaf = (
            _builder(_name(names[0]), self.cert.subject, leaf_key, issuer_key=self.key)
            .add_extension(x509.SubjectAlternativeName(_alt_names(names)), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_LEAF_USAGE, critical=True)
            .add_extension(_LEAF_PURPOSES, critical=False)
            .sign(self.key, hashes.SHA256())
        )
        return _write(directory, self.cert, leaf, leaf_key)


_CA_USAGE = x509.KeyUsage(
    digital_signature=True,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    key_cert_sign=True,
    crl_sign=True,
    encipher_only=False,
    decipher_only=False,
)


# A leaf's: the TLS signature (ECDSA keys sign the handshake; no key encipherment).
_LEAF_USAGE = x509.KeyUsage(
    digital_signature=True,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    key_cert_sign=False,
    crl_sign=False,
    encipher_only=False,
    decipher_only=False,
)
_LEAF_PURPOSES = x509.ExtendedKeyUsage(
    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
)


def _builder(
    subject: x509.Name,
    issuer: x509.Name,
    key: ec.EllipticCurvePrivateKey,
    *,
    issuer_key: ec.EllipticCurvePrivateKey,
) -> x509.CertificateBuilder:
    """A certificate for ``key`` with the key identifiers a real CA writes: its own
    (SubjectKeyIdentifier) and its issuer's (AuthorityKeyIdentifier, from
    ``issuer_key``). OpenSSL's strict verification, the default from Python 3.13
    (``ssl.VERIFY_X509_STRICT``), refuses a chain without them ("Missing Authority Key
    Identifier")."""
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                       critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
            critical=False,
        )
    )


def _alt_names(names: list[str]) -> list[x509.GeneralName]:
    alt_names: list[x509.GeneralName] = []
    for n in names:
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            alt_names.append(x509.DNSName(n))
    return alt_names


def _write(
    directory: Path,
    ca_cert: x509.Certificate,
    leaf: x509.Certificate,
    leaf_key: ec.EllipticCurvePrivateKey,
) -> CertFiles:
    directory.mkdir(parents=True, exist_ok=True)
    files = CertFiles(directory / "ca.pem", directory / "cert.pem", directory / "key.pem")
    pem = serialization.Encoding.PEM
    files.ca_cert.write_bytes(ca_cert.public_bytes(pem))
    files.cert.write_bytes(leaf.public_bytes(pem))
    files.key.write_bytes(
        leaf_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return files


def make_certs(directory: Path, names: list[str], *, self_signed: bool = False) -> CertFiles:
    """A fresh CA and a leaf certificate for ``names`` (DNS names or IP addresses).

    With ``self_signed`` the leaf is its own issuer (as a homeserver's snakeoil cert).
    """
    if not self_signed:
        return LoopbackCA.create(directory).issue(directory, names)
    leaf_key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        _builder(_name(names[0]), _name(names[0]), leaf_key, issuer_key=leaf_key)
        .add_extension(x509.SubjectAlternativeName(_alt_names(names)), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(_CA_USAGE, critical=True)
        .sign(leaf_key, hashes.SHA256())
    )
    return _write(directory, leaf, leaf, leaf_key)
