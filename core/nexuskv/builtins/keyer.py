"""Builtin keyer: the pure-Python `BlockKeyer`, answering last so a native keyer plugin can win."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nexuskv import BlockKeyer, hookimpl

__all__: list[str] = []


@hookimpl(trylast=True)
def nexuskv_keyer(secret: bytes, page_size: int, config: Mapping[str, Any]) -> BlockKeyer | None:
    """Provide the reference keyer unless the config names another (`native` falls back here when not installed)."""
    return BlockKeyer(secret, page_size) if config.get("name", "python") in ("python", "native") else None
