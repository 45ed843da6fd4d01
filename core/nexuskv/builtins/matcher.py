"""Builtin matcher: the pure-Python `DictIndex`, answering last so a native matcher plugin can win."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nexuskv import DictIndex, hookimpl

__all__: list[str] = []


@hookimpl(trylast=True)
def nexuskv_matcher(config: Mapping[str, Any]) -> DictIndex | None:
    """Provide the dict index unless the config names another matcher."""
    return DictIndex() if config.get("name", "dict") in ("dict", "native") else None  # native: when not installed
