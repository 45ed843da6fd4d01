"""Mutual TLS on the TCP transport: payloads encrypted on the wire, nodes without the deployment CA's cert refused."""

from __future__ import annotations

import shutil
import time

import pytest
from _tcp_peer import NS, TIER, put, slot_n, tcp

from nexuskv_transport_tcp import TransportError
from nexuskv_transport_tcp.testing import make_pki

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the test certificates")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pki")
    return make_pki(tmp, "deployment"), make_pki(tmp, "stranger")


def test_payloads_cross_in_tls_and_a_node_of_another_ca_or_none_is_refused(store, pki):
    mine, stranger = pki
    payload = put(store, 1, 70_000)
    server = tcp(**mine)
    address = server.serve({TIER: store})
    ok, plain, foreign = tcp(timeout_s=10.0, **mine), tcp(timeout_s=0.5), tcp(timeout_s=10.0, **stranger)
    try:
        got = ok.fetch_remote(address, TIER, [slot_n(1), slot_n(2)], namespace=NS)
        assert bytes(got[0].payload) == payload and got[1] is None
        again = ok.fetch_remote(address, TIER, [slot_n(1)], namespace=NS)  # a pooled TLS connection
        assert bytes(again[0].payload) == payload
        assert ok.idle_connections(address) == 1
        with pytest.raises(TransportError):  # speaks plain TCP to a TLS server: nothing but a failed handshake
            plain.fetch_remote(address, TIER, [slot_n(1)], namespace=NS)
        with pytest.raises(TransportError):  # a certificate the deployment's CA did not sign
            foreign.fetch_remote(address, TIER, [slot_n(1)], namespace=NS)
        deadline = time.monotonic() + 10  # the server counts a refusal once its side of the handshake gives up
        while server.refused < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.refused >= 2
        for t in (ok, plain, foreign):
            t.close()
        deadline = time.monotonic() + 10  # every connection, TLS or refused, leaves the server's tracking
        while server._server._conns and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not server._server._conns
    finally:
        for t in (ok, plain, foreign, server):
            t.close()


def test_tls_options_come_together_or_not_at_all(pki):
    mine, _ = pki
    with pytest.raises(ValueError, match="tls_cert, tls_key and tls_ca together"):
        tcp(tls_cert=mine["tls_cert"])
    with pytest.raises(ValueError, match="no such file"):
        tcp(**{**mine, "tls_ca": "/nonexistent.pem"})


def test_a_ca_without_key_usage_is_refused_on_every_python(store, tmp_path):
    """Python 3.13 verifies strictly by default and 3.11 did not: the transport asks for it on every Python."""
    import subprocess

    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=tmp_path)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=loose-ca")  # no key usage: accepted by OpenSSL unless verification is strict
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=loose")
    run("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
        "node.pem", "-days", "2")
    loose = {"tls_cert": str(tmp_path / "node.pem"), "tls_key": str(tmp_path / "node.key"),
             "tls_ca": str(tmp_path / "ca.pem")}  # fmt: skip
    put(store, 1, 1000)
    server = tcp(**loose)
    address = server.serve({TIER: store})
    client = tcp(timeout_s=5.0, **loose)
    try:
        with pytest.raises(TransportError, match="CERTIFICATE_VERIFY_FAILED"):
            client.fetch_remote(address, TIER, [slot_n(1)], namespace=NS)
    finally:
        client.close()
        server.close()
