"""What every contract shares: the schema version, and the patterns of names and hex keys."""

from __future__ import annotations

__all__ = ["HEX_KEY", "NAME", "SCHEMA_VERSION"]

SCHEMA_VERSION = 1
"""The version every `*.v1.json` contract carries in `schema_version`."""

NAME = {"pattern": r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$", "maxLength": 256}
HEX_KEY = {"pattern": "^[0-9a-f]{32}$"}
