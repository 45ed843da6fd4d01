"""Logging: structlog configured once, JSON lines when not on a terminal, readable on one.

Every line carries the tenant and request id bound with `bind_request` (context variables, so it follows
the request through threads started with `contextvars.copy_context` and through asyncio tasks).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO

import structlog

__all__ = ["bind_request", "configure_logging", "get_logger"]

_configured = False


def configure_logging(
    *, json: bool | None = None, level: str | None = None, stream: TextIO | None = None, force: bool = False
) -> None:
    """Configure structlog once per process (later calls are no-ops unless `force`).

    `json` defaults to True when `stream` is not a TTY (or `NEXUSKV_LOG_FORMAT=json|console` decides);
    `level` defaults to `NEXUSKV_LOG_LEVEL` or `info`. Lines go to `stream` (default stderr).
    """
    global _configured
    if _configured and not force:
        return
    out = stream or sys.stderr
    fmt = os.environ.get("NEXUSKV_LOG_FORMAT", "")
    if json is None:
        json = fmt == "json" or (fmt != "console" and not out.isatty())
    lvl = (level or os.environ.get("NEXUSKV_LOG_LEVEL") or "info").upper()
    if lvl not in logging.getLevelNamesMapping():
        raise ValueError(f"unknown log level {lvl!r}")
    renderer: Any = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=out.isatty())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[lvl]),
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=False,
    )
    _configured = True


def get_logger(name: str) -> Any:
    """A lazy structlog logger tagged with `component=name`; it follows whatever configuration is current."""
    return structlog.get_logger(component=name)


@contextlib.contextmanager
def bind_request(tenant: str | None = None, request_id: str | None = None, **extra: Any) -> Iterator[None]:
    """Within the block, every log line carries `tenant` and `request_id` (and any `extra` keys)."""
    values = {k: v for k, v in {"tenant": tenant, "request_id": request_id, **extra}.items() if v is not None}
    with structlog.contextvars.bound_contextvars(**values):
        yield
