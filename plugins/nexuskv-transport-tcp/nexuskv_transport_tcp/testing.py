"""Test certificates for the transport's mutual TLS, made with the `openssl` command (tests and benches only)."""

from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["make_pki"]


def make_pki(directory: str | Path, name: str = "deployment") -> dict[str, str]:
    """A fresh CA and one node certificate it signed, under `directory/name`: the transport's `tls_*` options."""
    d = Path(directory) / name
    d.mkdir(parents=True, exist_ok=False)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", f"/CN={name}-ca")  # fmt: skip
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "node.key", "-out", "node.csr", "-subj", f"/CN={name}")
    run("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
        "node.pem", "-days", "2")  # fmt: skip
    (d / "node.key").chmod(0o600)
    return {"tls_cert": str(d / "node.pem"), "tls_key": str(d / "node.key"), "tls_ca": str(d / "ca.pem")}
