"""The keyed MAC of stored state: what makes a payload in any tier, shared or not, provably this deployment's.

A descriptor's checksum catches corruption, not forgery: both come from the store, so anyone who can write a
store (another user of a host's shm, a client of a shared Redis or Mooncake, the owner of a disk directory)
could plant a payload and a descriptor that agree. `StateSeal` closes that: when the kernel stores a payload it
writes into the descriptor a MAC keyed by the deployment secret over everything the descriptor says of the
payload (its key, parent, group, span, sizes, codec, tensors, payload checksum, and its namespace, model,
tokenizer and layout), and every load, peer fetch, prefetch and re-index checks it. Only `placement` (where the
payload is now) and `usage` (how often it was read) are left out: they change as a payload moves, not what it is.

The MAC covers the payload's bytes too, with keyed BLAKE3 (the `blake3` package; multi-threaded from 1 MiB on
four cores or more):
a store writer who keeps a sealed descriptor and swaps the payload must find a BLAKE3 second preimage. A keyed MAC
over the descriptor's XXH3-128 would be about ten times cheaper but is not safe against that writer: XXH3 is not
collision resistant, so a payload with a sealed payload's XXH3-128 can be crafted. docs/guarantees.md has the
argument and `bench/identity.py` (`integrity.*`) the measured cost of each option. The descriptor's checksum stays:
when a MAC does not check, it tells corruption (checksum mismatch) from forgery.

The same secret gives the storage layer two more keys, each its own BLAKE2b derivation (a personalisation of its
own): `peer_key`, which node-to-node transports authenticate peers with, and `name_key`, which tier stores name
slots with in shared places (`nexuskv.store_name`), so a listing of a store reveals no slot or block key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import struct
from typing import Any

import attrs
import blake3

from nexuskv.contracts import StateDescriptor, to_dict

__all__ = ["StateSeal"]

_PERSON = b"nexuskv.state"
_MEMO = 4096
_PACK = struct.Struct("<IQQQQ")
_THREADED = 1 << 20
"""Payloads from this size are hashed on every core (BLAKE3's tree splits them) where there are at least four;
smaller ones, and every one on a smaller machine, on the caller's thread (on two busy cores, threads measured
slower: bench/identity.py)."""
_MANY_CORES = (os.cpu_count() or 1) >= 4


def _numbers_as_floats(value: Any) -> Any:
    """`value` with every int or float (not a bool) as a float, recursively."""
    if isinstance(value, dict):
        return {k: _numbers_as_floats(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_numbers_as_floats(v) for v in value]
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return value


def _nbytes(payload: bytes | bytearray | memoryview) -> int:
    return payload.nbytes if isinstance(payload, memoryview) else len(payload)


class StateSeal:
    """Seals and checks stored state with a key derived from the deployment secret (thread-safe).

    It holds the storage layer's other secret-derived keys too: the peer key (node-to-node transports) and the name
    key (names in shared stores).
    """

    __slots__ = ("_identities", "_key", "name_key", "peer_key")

    def __init__(self, secret: bytes) -> None:
        self._key = hashlib.blake2b(secret[:64], digest_size=32, person=b"nexuskv.stkey").digest()
        self._identities: dict[tuple[object, ...], bytes] = {}
        self.peer_key = hashlib.blake2b(secret[:64], digest_size=32, person=b"nexuskv.peers").digest()
        """The key node-to-node transports authenticate peers with (another derivation of the same secret)."""
        self.name_key = hashlib.blake2b(secret[:64], digest_size=32, person=b"nexuskv.names").digest()
        """The key tier stores name slots with in shared places (`store_name`; a third derivation of the secret)."""

    def _identity(self, d: StateDescriptor) -> bytes:
        """A digest of what blocks of one request share (memoised: thousands of blocks share one).

        Numbers are hashed as floats: a field a Python caller set to `2` reads back from JSON as `2.0` (and equal
        values share one memo entry), so the digest must not tell them apart.
        """
        memo = (d.namespace, d.model, d.tokenizer, d.layout, d.codec, d.tensors, d.schema_version)
        got = self._identities.get(memo)
        if got is None:
            shared = {"namespace": to_dict(d.namespace), "model": to_dict(d.model), "tokenizer": to_dict(d.tokenizer),
                      "layout": to_dict(d.layout), "codec": d.codec, "tensors": [to_dict(t) for t in d.tensors],
                      "schema_version": d.schema_version}  # fmt: skip
            got = hashlib.blake2b(json.dumps(_numbers_as_floats(shared), sort_keys=True, separators=(",", ":"))
                                  .encode(), digest_size=32).digest()  # fmt: skip
            if len(self._identities) >= _MEMO:
                self._identities.clear()
            self._identities[memo] = got
        return got

    def mac(self, d: StateDescriptor, payload: bytes | bytearray | memoryview) -> str:
        """The MAC of `d` and `payload` (whatever `d.mac` says)."""
        threads = blake3.blake3.AUTO if _MANY_CORES and _nbytes(payload) >= _THREADED else 1
        h = blake3.blake3(self._identity(d), key=self._key, max_threads=threads)
        h.update(_PACK.pack(d.group, d.span.start, d.span.end, d.nbytes, d.raw_nbytes))
        h.update(f"{d.key}|{d.parent_key or ''}|{d.checksum}|".encode())
        h.update(payload)
        return h.hexdigest(16)

    def seal(self, d: StateDescriptor, payload: bytes | bytearray | memoryview) -> StateDescriptor:
        """`d` with the MAC of `d` and `payload` set (a new descriptor unless it already carried that MAC)."""
        mac = self.mac(d, payload)
        return d if d.mac == mac else attrs.evolve(d, mac=mac)

    def check(self, d: StateDescriptor, payload: bytes | bytearray | memoryview) -> bool:
        """True when `d` and `payload` were sealed by a holder of this deployment's secret and are unchanged since."""
        return bool(d.mac) and hmac.compare_digest(d.mac, self.mac(d, payload))
