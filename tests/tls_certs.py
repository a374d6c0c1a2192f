"""Throwaway PKI for the NATS TLS tests: a CA, server certificates (SAN 127.0.0.1 and localhost) and client
certificates, written as PEM files (keys 0600). Made with `cryptography`; valid for one day."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class CertFiles:
    cert: Path
    key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject: str, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1)))


def write_key(key, path: Path, password: bytes | None = None) -> Path:
    encryption = (serialization.BestAvailableEncryption(password) if password
                  else serialization.NoEncryption())
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       encryption))
    path.chmod(0o600)
    return path


class TestCA:
    """A self-signed CA in `folder` (ca.pem) that issues server and client certificates there."""

    __test__ = False  # not a pytest test class

    def __init__(self, folder: Path, name: str = "kite-test-ca") -> None:
        self.folder = folder
        self.name = name
        self.key = ec.generate_private_key(ec.SECP256R1())
        key_usage = x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                  content_commitment=False, key_encipherment=False, data_encipherment=False,
                                  key_agreement=False, encipher_only=False, decipher_only=False)
        self.cert = (_builder(name, _name(name), self.key.public_key())
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .add_extension(key_usage, critical=True)
                     .add_extension(x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()),
                                    critical=False)
                     .sign(self.key, hashes.SHA256()))
        self.pem = folder / f"{name}.pem"
        self.pem.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, server: bool, hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
              key_password: bytes | None = None) -> CertFiles:
        """A leaf certificate: for a server (SAN `hosts`) or a client (client-auth usage)."""
        key = ec.generate_private_key(ec.SECP256R1())
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (_builder(name, self.cert.subject, key.public_key())
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                                  critical=False))
        if server:
            sans: list[x509.GeneralName] = []
            for host in hosts:
                try:
                    sans.append(x509.IPAddress(ipaddress.ip_address(host)))
                except ValueError:
                    sans.append(x509.DNSName(host))
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        cert_path = self.folder / f"{name}.pem"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return CertFiles(cert_path, write_key(key, self.folder / f"{name}-key.pem", key_password))
