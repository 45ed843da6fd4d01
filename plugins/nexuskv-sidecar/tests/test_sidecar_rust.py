"""The Rust client (clients/rust, std only), built here with rustc when the toolchain is present, plans a request.

Skipped only where no Rust toolchain is installed (the reason says so); on a machine with one it must build and
plan against a real sidecar, fail open against a dead one, and report a refusal as an error.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
from _sidecar_helpers import TOKENS, commit_all, make_request

from nexuskv import to_dict

SRC = Path(__file__).resolve().parents[1] / "clients" / "rust"
RUSTC = shutil.which("rustc") or (str(Path.home() / ".cargo/bin/rustc") if (Path.home() / ".cargo/bin/rustc").exists()
                                  else None)  # fmt: skip


@pytest.fixture(scope="module")
def rust_client(tmp_path_factory):
    if RUSTC is None:
        pytest.skip("no Rust toolchain (rustc) on this machine: the Rust client is not built")
    out = tmp_path_factory.mktemp("rust") / "nexuskv-client"
    res = subprocess.run([RUSTC, "--edition", "2021", "-O", str(SRC / "src" / "main.rs"), "-o", str(out)],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "warning" not in res.stderr, res.stderr
    return out


def request_file(tmp_path, req):
    p = tmp_path / "request.json"
    p.write_text(json.dumps(to_dict(req)))
    return p


def test_rust_client_plans_a_request(rust_client, sidecar, kernel, tmp_path):
    req = make_request(range(320), request_id="from-rust")
    commit_all(kernel, req)
    res = subprocess.run([rust_client, "plan", sidecar.url, TOKENS["chat"], request_file(tmp_path, req)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode == 0, res.stderr
    plan_json, summary = res.stdout.splitlines()
    plan = json.loads(plan_json)
    assert plan["request_id"] == "from-rust" and plan["action"] == "materialize" and plan["tokens_reused"] == 320
    assert summary.startswith("action=materialize tokens_total=320 tokens_reused=320 fail_open=false")


def test_rust_client_sends_the_binary_encoding_and_gets_the_same_plan(rust_client, sidecar, kernel, tmp_path):
    req = make_request(range(70_000, 70_000 + 400), request_id="binary-from-rust")  # ids past 2^16: all four bytes
    commit_all(kernel, req)
    plans = {}
    for encoding in ("json", "binary"):
        res = subprocess.run([rust_client, "plan", sidecar.url, TOKENS["chat"], request_file(tmp_path, req), encoding],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert res.returncode == 0, res.stderr
        plans[encoding] = json.loads(res.stdout.splitlines()[0])
    same = ("action", "tokens_total", "tokens_reused", "spans", "request_id")
    assert {k: plans["binary"][k] for k in same} == {k: plans["json"][k] for k in same}
    assert plans["binary"]["tokens_reused"] == 400 - 400 % 16
    bad = subprocess.run([rust_client, "plan", sidecar.url, TOKENS["chat"], request_file(tmp_path, req), "xml"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_rust_client_fails_open_when_the_sidecar_is_down(rust_client, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = subprocess.run([rust_client, "plan", f"http://127.0.0.1:{port}", "t", request_file(tmp_path, make_request(
        range(64)))], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "action=recompute tokens_total=64 tokens_reused=0 fail_open=true" in res.stdout
    assert "fail-open: sidecar unreachable" in res.stdout


def test_rust_client_reports_a_refusal(rust_client, sidecar, tmp_path):
    res = subprocess.run([rust_client, "plan", sidecar.url, TOKENS["rag"], request_file(tmp_path, make_request(
        range(64)))], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode == 1 and "refused: 403" in res.stderr and "acts for tenant 'rag', not 'chat'" in res.stderr


def test_rust_client_bench_mode_counts_every_plan(rust_client, sidecar, kernel, tmp_path):
    before = kernel.decisions
    res = subprocess.run([rust_client, "bench", sidecar.url, TOKENS["chat"], request_file(tmp_path, make_request(
        range(128))), "3", "20"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 0, res.stderr
    fields = dict(kv.split("=") for kv in res.stdout.split())
    assert fields["plans"] == "60" and fields["fail_open"] == "0" and fields["server_fail_open"] == "0"
    assert kernel.decisions - before == 60


def test_rust_client_unit_tests(tmp_path):
    """The Rust client's own unit tests (its JSON reader and writer), built with `rustc --test`."""
    if RUSTC is None:
        pytest.skip("no Rust toolchain (rustc) on this machine: the Rust client is not built")
    out = tmp_path / "client-tests"
    res = subprocess.run([RUSTC, "--edition", "2021", "--test", str(SRC / "src" / "main.rs"), "-o", str(out)],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr
    res = subprocess.run([out], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "test result: ok. 6 passed" in res.stdout, res.stdout + res.stderr
