"""`nexuskv status`: the view of real kernels read over HTTP from their ports, dead nodes in one line each."""

from __future__ import annotations

import json
import socket

import pytest
from click.testing import CliRunner

from nexuskv import Kernel, KernelConfig
from nexuskv.cli import cli
from tests.conftest import SECRET, make_request

WIDE = {"COLUMNS": "200"}


@pytest.fixture
def served():
    k = Kernel(KernelConfig(node="node-a", metrics_port=0, tiers={"dram": {"store": "dram", "capacity_bytes": "4MiB"}}),
               secret=SECRET)  # fmt: skip
    req = make_request(range(320), request_id="req-cold")
    k.plan(req)
    keys = k.keys(req)
    k.commit(req, [bytes([i]) * 4096 for i in range(len(keys))], keys=keys)
    assert k.flush(5)
    warm = make_request(range(320), request_id="req-warm")
    assert k.materialize(k.plan(warm, keys=keys), warm, keys=keys).complete
    yield k
    k.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_status_shows_tiers_links_breakers_queues_and_decisions(served):
    res = CliRunner().invoke(cli, ["status", f"http://127.0.0.1:{served.metrics.port}"], env=WIDE)
    assert res.exit_code == 0, res.output
    out = res.output
    for text in ("node-a", "tiers", "dram", "4.0 MiB", "100.0%", "links", "breakers", "queues", "writer",
                 "prefetch", "last decisions", "req-warm", "req-cold", "materialize", "320/320"):  # fmt: skip
        assert text in out, text
    assert out.index("req-warm") < out.index("req-cold")  # newest first


def test_a_dead_node_is_one_line_and_the_live_one_is_still_shown(served):
    res = CliRunner().invoke(cli, ["status", "127.0.0.1:1", f"127.0.0.1:{served.metrics.port}"], env=WIDE)
    assert res.exit_code == 1
    dead = [line for line in res.output.splitlines() if "unreachable" in line]
    assert dead == [dead[0]] and dead[0].startswith("unreachable: http://127.0.0.1:1/status: ")
    assert "Traceback" not in res.output and "node-a" in res.output


def test_watch_refreshes_the_given_number_of_times(served):
    calls = []
    status = served.metrics.status
    served.metrics.status = lambda n: calls.append(n) or status(n)  # counts the scrapes the endpoint serves
    res = CliRunner().invoke(cli, ["status", "--watch", "--interval", "0.05", "--count", "3", "--decisions", "4",
                                   f"http://127.0.0.1:{served.metrics.port}"], env=WIDE)  # fmt: skip
    assert res.exit_code == 0, res.output
    assert calls == [4, 4, 4] and "node-a" in res.output and "req-warm" in res.output


def test_json_prints_the_raw_documents(served):
    res = CliRunner().invoke(cli, ["status", "--json", "--decisions", "1", f"127.0.0.1:{served.metrics.port}"])
    assert res.exit_code == 0, res.output
    [doc] = [json.loads(line) for line in res.output.splitlines()]
    assert doc["node"] == "node-a" and [d["request_id"] for d in doc["decisions"]["recent"]] == ["req-warm"]
    assert doc == json.loads(json.dumps(served.metrics.status(1))) | {"at": doc["at"]}


def test_config_names_the_port_and_a_config_without_one_is_a_usage_error(tmp_path):
    port = free_port()
    with Kernel(KernelConfig(node="node-c", metrics_port=port), secret=SECRET):
        cfg = tmp_path / "kernel.toml"
        cfg.write_text(f'node = "node-c"\nmetrics_port = {port}\n')
        res = CliRunner().invoke(cli, ["status", "--json", "--config", str(cfg)])
        assert res.exit_code == 0, res.output
        assert json.loads(res.output)["node"] == "node-c"
    bare = tmp_path / "bare.toml"
    bare.write_text('node = "x"\n')
    res = CliRunner().invoke(cli, ["status", "--config", str(bare)])
    assert res.exit_code == 2 and "no fixed metrics_port" in res.output
    res = CliRunner().invoke(cli, ["status"])
    assert res.exit_code == 2 and "name at least one kernel" in res.output


def test_a_token_never_follows_a_redirect_and_a_kernel_read_with_one_says_so(served):
    """Review findings: urllib copied the operator token to whatever host a redirect named; a kernel read with a
    token (NEXUSKV_TOKEN exported) answered a bare 404."""
    import http.server
    import threading

    seen: list[str | None] = []

    class Thief(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.headers.get("authorization"))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"node": "stolen"}')

        def log_message(self, *args):
            pass

    thief = http.server.HTTPServer(("127.0.0.1", 0), Thief)

    class Redirect(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(302)
            self.send_header("Location", f"http://127.0.0.1:{thief.server_port}/steal")
            self.end_headers()

        def log_message(self, *args):
            pass

    redirect = http.server.HTTPServer(("127.0.0.1", 0), Redirect)
    for srv in (thief, redirect):
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        res = CliRunner().invoke(cli, ["status", f"http://127.0.0.1:{redirect.server_port}", "--json",
                                       "--token", "OPERATOR-SECRET"])  # fmt: skip
        assert res.exit_code == 1 and "HTTP 302" in res.output and seen == [], (res.output, seen)
    finally:
        for srv in (thief, redirect):
            srv.shutdown()
    res = CliRunner().invoke(cli, ["status", f"http://127.0.0.1:{served.metrics.port}", "--json"],
                             env={"NEXUSKV_TOKEN": "tok"})  # fmt: skip
    assert res.exit_code == 1 and "not a sidecar?" in res.output, res.output
