"""Byte sizes and durations as people write them in config and policy files (`4GiB`, `512MB`, `30s`)."""

from __future__ import annotations

import re

__all__ = ["parse_bytes"]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
}  # fmt: skip
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(value: str | int) -> int:
    """`"4GiB"` -> 4294967296, `"1.5MB"` -> 1500000, `4096` -> 4096. Raises ValueError on anything else."""
    if isinstance(value, bool):
        raise ValueError(f"not a byte size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"byte size must not be negative: {value}")
        return value
    m = _SIZE.match(value) if isinstance(value, str) else None
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a byte size: {value!r} (use e.g. 512MiB, 4GiB, 1.5GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
