"""The plugin's hooks: the native keyer and matcher answer unless the config names the pure-Python ones."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nexuskv import hookimpl
from nexuskv_native.index import NativeIndex
from nexuskv_native.keyer import NativeKeyer

__all__: list[str] = []


@hookimpl
def nexuskv_keyer(secret: bytes, page_size: int, config: Mapping[str, Any]) -> NativeKeyer | None:
    """The native keyer, unless `[keyer] name` names another."""
    return NativeKeyer(secret, page_size) if config.get("name", "native") == "native" else None


@hookimpl
def nexuskv_matcher(config: Mapping[str, Any]) -> NativeIndex | None:
    """The native index, unless `[matcher] name` names another."""
    return NativeIndex() if config.get("name", "native") == "native" else None
