"""Test certificates for the transport's mutual TLS, made with the `openssl` command (tests and benches only)."""

from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["make_pki"]


def make_pki(directory: str | Path, name: str = "deployment") -> dict[str, str]:
    """A fresh CA and one node certificate it signed, under `directory/name`: the transport's `tls_*` options.

    Both carry the extensions RFC 5280 asks for (basic constraints, key usage, key identifiers): Python 3.13's
    default TLS context verifies strictly (`VERIFY_X509_STRICT`) and refuses a CA without key usage.
    """
    d = Path(directory) / name
    d.mkdir(parents=True, exist_ok=False)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", f"/CN={name}-ca", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign", "-addext", "subjectKeyIdentifier=hash")  # fmt: skip
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "node.key", "-out", "node.csr", "-subj", f"/CN={name}")
    (d / "node.ext").write_text("basicConstraints=critical,CA:FALSE\n"
                                "keyUsage=critical,digitalSignature,keyEncipherment\n"
                                "extendedKeyUsage=serverAuth,clientAuth\nsubjectKeyIdentifier=hash\n"
                                "authorityKeyIdentifier=keyid,issuer\n")  # fmt: skip
    run("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
        "node.pem", "-days", "2", "-extfile", "node.ext")  # fmt: skip
    (d / "node.key").chmod(0o600)
    return {"tls_cert": str(d / "node.pem"), "tls_key": str(d / "node.key"), "tls_ca": str(d / "ca.pem")}
