"""The payload checksum a state descriptor carries (`<algorithm>:<hex digest>`): its algorithms and verification.

Part of the descriptor contract: an engine in any language that writes a descriptor computes the same string.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable

import xxhash

__all__ = ["CHECKSUMS", "DEFAULT_CHECKSUM", "checksum", "checksum_known", "verify_checksum"]

CHECKSUMS: dict[str, Callable[[bytes | bytearray | memoryview], str]] = {
    "xxh3-128": xxhash.xxh3_128_hexdigest,
    "blake2b-128": lambda payload: hashlib.blake2b(payload, digest_size=16).hexdigest(),
}
"""Payload checksum algorithms by the name a descriptor's `checksum` field starts with (`name:hexdigest`).

Checksums catch corruption (a torn write, a flipped bit, a truncated file), not forgery: they were never keyed,
and a writer to a tier could always have written a matching one. XXH3-128 checks a payload faster than it can be
copied; BLAKE2b-128 is what descriptors written before 0.2 carry, and it still verifies.
"""
DEFAULT_CHECKSUM = "xxh3-128"


def checksum(payload: bytes | bytearray | memoryview, algorithm: str = DEFAULT_CHECKSUM) -> str:
    """The checksum written into a descriptor: `<algorithm>:<hex digest>` of the stored payload."""
    return f"{algorithm}:{CHECKSUMS[algorithm](payload)}"


def checksum_known(expected: str) -> bool:
    """True when this version can verify `expected` (its algorithm is one of `CHECKSUMS`)."""
    return expected.partition(":")[0] in CHECKSUMS


def verify_checksum(payload: bytes | bytearray | memoryview, expected: str) -> bool:
    """True when `payload` matches `expected` (an unknown algorithm never matches)."""
    algo, _, digest = expected.partition(":")
    fn = CHECKSUMS.get(algo)
    return fn is not None and hmac.compare_digest(fn(payload), digest)
