"""Optional TLS for the TCP transport: mutual TLS with certificates from config, around the peer-key handshake.

The peer key already authenticates both ends and MACs every request; TLS adds confidentiality on cross-host links
(a network observer otherwise reads the payloads). Both sides present a certificate signed by the deployment's CA
(`tls_ca`) and check the other's: a node without one is refused in the TLS handshake. Host names are not checked
(nodes are addressed by pod IPs; the CA is the deployment's own, so any certificate it signed is a node of it).
Certificates are checked strictly (`VERIFY_X509_STRICT`, Python 3.13's default, set on every Python): a CA needs
basic constraints and key usage, as RFC 5280 asks.
"""

from __future__ import annotations

import os
import ssl

__all__ = ["TlsContexts", "tls_contexts"]


class TlsContexts:
    """The server's and the client's SSL contexts of one transport (TLS 1.2 or later, peer certificates required)."""

    def __init__(self, cert: str, key: str, ca: str) -> None:
        for what, path in (("tls_cert", cert), ("tls_key", key), ("tls_ca", ca)):
            if not os.path.isfile(path):
                raise ValueError(f"{what}: no such file {path!r}")
        self.server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=ca)
        self.server.verify_mode = ssl.CERT_REQUIRED
        self.client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
        self.client.check_hostname = False  # nodes are addressed by IP; the deployment's CA is the check
        for ctx in (self.server, self.client):
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            ctx.verify_flags |= ssl.VERIFY_X509_STRICT  # RFC 5280 checks on every Python (3.13's default)
            try:
                ctx.load_cert_chain(cert, key)
            except (ssl.SSLError, OSError) as e:
                raise ValueError(f"tls_cert / tls_key: cannot load them: {e}") from None


def tls_contexts(cert: str | None, key: str | None, ca: str | None) -> TlsContexts | None:
    """The contexts when all three files are given, None when none is; a ValueError for anything in between."""
    given = [v is not None for v in (cert, key, ca)]
    if not any(given):
        return None
    if not all(given):
        raise ValueError("TLS needs tls_cert, tls_key and tls_ca together")
    return TlsContexts(str(cert), str(key), str(ca))
