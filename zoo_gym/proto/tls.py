"""TLS for the gRPC transport: credentials from PEM files, and a private CA for operators and tests.

The server serves TLS by default (`--ssl-certfile`, `--ssl-keyfile`, optional `--ssl-ca-certfile`, the
flag names of Flower's SuperLink); plaintext needs an explicit `--insecure` on both sides. Clients verify
the server's certificate against `--root-certificates FILE`, or the system trust store without it.

`make_certificates` writes a private CA and a server certificate signed by it (the `cryptography`
package; `gym-server tls-cert`, `gym-demo` and the tests use it): give contributors `ca.pem` as their
`--root-certificates`, and the server `server.pem` / `server.key`. A public CA (e.g. Let's Encrypt) needs
no root file on the clients.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

import grpc


class TLSError(ValueError):
    """A certificate or key file is missing or unreadable; the message names the file and the flag."""


def read_pem(path: str | os.PathLike, *, flag: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TLSError(f"{flag} {path}: {exc.strerror or exc}") from exc
    if b"-----BEGIN" not in data:
        raise TLSError(f"{flag} {path}: not a PEM file (no -----BEGIN line)")
    return data


def server_credentials(*, certfile: str, keyfile: str, ca_certfile: str | None = None) -> grpc.ServerCredentials:
    """The server's TLS credentials. `ca_certfile` is sent as the chain's root (as Flower does); client
    certificates are not required."""
    cert = read_pem(certfile, flag="--ssl-certfile")
    key = read_pem(keyfile, flag="--ssl-keyfile")
    ca = read_pem(ca_certfile, flag="--ssl-ca-certfile") if ca_certfile else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=False)


def channel_credentials(root_certificates: str | os.PathLike | None) -> grpc.ChannelCredentials:
    """A client's TLS credentials: trust `root_certificates` (PEM), or the system trust store when None."""
    roots = read_pem(root_certificates, flag="--root-certificates") if root_certificates else None
    return grpc.ssl_channel_credentials(root_certificates=roots)


@dataclass(frozen=True)
class Certificates:
    ca: Path  # give this to contributors (--root-certificates)
    cert: Path  # --ssl-certfile
    key: Path  # --ssl-keyfile (mode 0600)


def make_certificates(out_dir: str | os.PathLike, *, hosts: tuple[str, ...] = ("localhost", "127.0.0.1"),
                      days: int = 365) -> Certificates:
    """A private CA and a server certificate for `hosts` (DNS names or IP addresses) signed by it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if not hosts:
        raise TLSError("give at least one host name or address the certificate is for")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "zoo-gym private CA")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False, encipher_only=False,
                                            decipher_only=False), critical=True)
               .sign(ca_key, hashes.SHA256()))
    names = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = Certificates(ca=out / "ca.pem", cert=out / "server.pem", key=out / "server.key")
    paths.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    paths.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    fd = os.open(paths.key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return paths
