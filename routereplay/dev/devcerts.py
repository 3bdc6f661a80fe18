"""``python -m routereplay.dev.devcerts OUT_DIR``: throwaway certificates for development and tests.

Writes a CA (``ca.pem``, ``ca-key.pem``), a server certificate valid for ``localhost``,
``127.0.0.1`` and the compose and Kubernetes service names (``server.pem``,
``server-key.pem``), and a client certificate (``client.pem``, ``client-key.pem``) for mutual
TLS, all signed by that CA. Keys are ECDSA P-256, written unencrypted and readable by the owner
only. Not for production: use your own CA there.
"""

from __future__ import annotations

import datetime
import ipaddress
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SERVER_NAMES = ("localhost", "route-cache", "rollout-server", "redis")
SERVER_IPS = ("127.0.0.1", "::1")
VALID_DAYS = 30


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "router-replay dev"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _certificate(subject, public_key, issuer, signing_key, extensions) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
    )
    for extension, critical in extensions:
        builder = builder.add_extension(extension, critical=critical)
    return builder.sign(signing_key, hashes.SHA256())


def _write(folder: Path, stem: str, cert: x509.Certificate, key) -> None:
    (folder / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path = folder / f"{stem}-key.pem"
    key_path.touch(mode=0o600)
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def _leaf(name: str, usage, ca_cert, ca_key, sans=None):
    key = ec.generate_private_key(ec.SECP256R1())
    extensions = [
        (x509.BasicConstraints(ca=False, path_length=None), True),
        (x509.ExtendedKeyUsage([usage]), False),
    ]
    if sans:
        extensions.append((x509.SubjectAlternativeName(sans), False))
    cert = _certificate(_name(name), key.public_key(), ca_cert.subject, ca_key, extensions)
    return cert, key


def generate(folder: str | Path) -> Path:
    """Write the CA, server and client certificates and keys into ``folder`` (created)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("router-replay dev CA")
    ca_cert = _certificate(
        ca_name,
        ca_key.public_key(),
        ca_name,
        ca_key,
        [
            (x509.BasicConstraints(ca=True, path_length=0), True),
            (x509.KeyUsage(False, False, False, False, False, True, True, False, False), True),
        ],
    )
    _write(folder, "ca", ca_cert, ca_key)
    sans = [x509.DNSName(n) for n in SERVER_NAMES]
    sans += [x509.IPAddress(ipaddress.ip_address(a)) for a in SERVER_IPS]
    server = _leaf("route-cache", ExtendedKeyUsageOID.SERVER_AUTH, ca_cert, ca_key, sans)
    _write(folder, "server", *server)
    client = _leaf("router-replay client", ExtendedKeyUsageOID.CLIENT_AUTH, ca_cert, ca_key)
    _write(folder, "client", *client)
    return folder


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    folder = generate(argv[0])
    print(f"wrote ca, server and client certificates and keys to {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
