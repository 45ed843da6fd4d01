"""NexusKV disk tier: payloads in checksummed files under a directory (`DiskStore`), with zstd codecs (`codec`)."""

from __future__ import annotations

from nexuskv_tier_disk.codec import CODECS, decode, encode
from nexuskv_tier_disk.store import DiskStore, Recovery

__all__ = ["CODECS", "DiskStore", "Recovery", "decode", "encode"]
