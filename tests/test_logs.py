import io
import json

import pytest
import structlog

import nexuskv.logs as logs
from nexuskv import bind_request, configure_logging, get_logger


@pytest.fixture
def stream():
    buf = io.StringIO()
    configure_logging(json=True, level="debug", stream=buf, force=True)
    yield buf
    structlog.reset_defaults()
    logs._configured = False


def lines(buf):
    return [json.loads(line) for line in buf.getvalue().splitlines()]


def test_json_lines_carry_tenant_and_request_id(stream):
    log = get_logger("nexuskv.test")
    with bind_request(tenant="acme", request_id="r-1", node="n1"):
        log.info("planned", tokens=42)
    log.info("outside")
    first, second = lines(stream)
    assert first["event"] == "planned" and first["tenant"] == "acme" and first["request_id"] == "r-1"
    assert first["node"] == "n1" and first["tokens"] == 42 and first["component"] == "nexuskv.test"
    assert first["level"] == "info" and "timestamp" in first
    assert "tenant" not in second


def test_non_tty_defaults_to_json(monkeypatch):
    monkeypatch.delenv("NEXUSKV_LOG_FORMAT", raising=False)
    buf = io.StringIO()  # not a TTY
    configure_logging(stream=buf, force=True)
    get_logger("x").warning("hello")
    assert json.loads(buf.getvalue())["event"] == "hello"
    structlog.reset_defaults()
    logs._configured = False


def test_console_format_is_readable(monkeypatch):
    monkeypatch.setenv("NEXUSKV_LOG_FORMAT", "console")
    buf = io.StringIO()
    configure_logging(stream=buf, force=True)
    with bind_request(tenant="acme"):
        get_logger("x").warning("hello")
    out = buf.getvalue()
    assert "hello" in out and "tenant=acme" in out and not out.startswith("{")
    structlog.reset_defaults()
    logs._configured = False


def test_level_filtering(stream):
    configure_logging(json=True, level="warning", stream=stream, force=True)
    get_logger("x").info("quiet")
    get_logger("x").error("loud")
    assert [e["event"] for e in lines(stream)] == ["loud"]


def test_configure_once_unless_forced(stream):
    other = io.StringIO()
    configure_logging(json=True, stream=other)  # ignored: already configured
    get_logger("x").info("where")
    assert other.getvalue() == "" and "where" in stream.getvalue()


def test_unknown_level():
    with pytest.raises(ValueError, match="unknown log level"):
        configure_logging(level="chatty", force=True)
    structlog.reset_defaults()
    logs._configured = False
