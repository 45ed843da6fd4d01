"""A peer process for the shm tests: writes, churns or reads segments, talking JSON lines on stdout.

Run as `python _shm_peer.py MODE JSON-ARGS`. Writers print one `ready` line and then wait until stdin closes
(or they are killed); readers print their results and exit.
"""

from __future__ import annotations

import json
import os
import sys
import time

from nexuskv import (
    Kernel,
    KernelConfig,
    Layout,
    ModelIdentity,
    Namespace,
    Placement,
    Request,
    StateDescriptor,
    StateGroup,
    StateSeal,
    TokenizerIdentity,
    TokenSpan,
    checksum,
    configure_logging,
    store_name,
)

SECRET_HEX = bytes(range(32)).hex()
NAME_KEY = StateSeal(bytes.fromhex(SECRET_HEX)).name_key
"""The name key of the kernels' secret: a store opened on its own with it names segments as those kernels do."""


def keyed(store, key: bytes = NAME_KEY):  # type: ignore[no-untyped-def]
    """`store`, handed the name key as a kernel would hand it (before anything else)."""
    store.use_name_key(key)
    return store


def seg(ns: str, slot: bytes, key: bytes = NAME_KEY) -> str:
    """The published segment name of `slot` in namespace `ns` under `key`."""
    return f"{ns}-s-{store_name(key, slot)}"


def descriptor(slot: bytes, payload: bytes | memoryview, tier: str = "shm") -> StateDescriptor:
    """A minimal valid descriptor of `payload` stored at `slot`."""
    return StateDescriptor(
        key=slot[:-1].hex(), namespace=Namespace("acme"), model=ModelIdentity(name="m"),
        tokenizer=TokenizerIdentity(name="t"), layout=Layout(groups=[StateGroup(kind="dense", layers=1)]),
        group=slot[-1], span=TokenSpan(0, 16), nbytes=len(payload), checksum=checksum(payload),
        placement=Placement(tier, "peer"),
    )  # fmt: skip


def slot_n(i: int) -> bytes:
    """The test slot number `i` (group 0)."""
    return i.to_bytes(16, "big") + b"\0"


def kernel_config(ns: str, ttl: float) -> KernelConfig:
    """A kernel whose only tier is the host shm tier of namespace `ns`."""
    return KernelConfig(node=f"p{os.getpid()}", secret=SECRET_HEX, tiers={"shm": {"store": "shm", "namespace": ns,
                        "lease_ttl_s": ttl, "capacity_bytes": "64MiB"}}, transports=("local", "shm"))  # fmt: skip


def request(n_tokens: int) -> Request:
    """The request both kernels agree on (same identity, same tokens: same block keys)."""
    return Request(
        request_id="r",
        tenant="acme",
        model=ModelIdentity(name="tiny", revision="1"),
        tokenizer=TokenizerIdentity(name="tok"),
        token_ids=list(range(n_tokens)),
        layout=Layout(groups=[StateGroup(kind="dense", layers=2, kv_heads=2, head_dim=8)], page_size=16),
    )


def say(**msg: object) -> None:
    """One JSON line to the parent."""
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


def main() -> None:
    mode, args = sys.argv[1], json.loads(sys.argv[2])
    configure_logging(stream=sys.stderr)  # stdout carries the JSON lines
    from nexuskv_transport_shm import ShmStore, ShmTransport, segments

    ns, ttl = args["ns"], args.get("ttl", 0.5)
    if mode == "store":
        store = keyed(ShmStore(1 << 26, namespace=ns, lease_ttl_s=ttl, reap_interval_s=args.get("reap", 3600.0)))
        for i in range(args["n"]):
            payload = bytes([i % 256]) * args["size"]
            assert store.put(slot_n(i), payload, descriptor(slot_n(i), payload))
        if args.get("partial"):  # a write cut short: a temp segment with no header yet
            fd = os.open(store.directory / segments.temp_name(ns, store.lease_id), os.O_CREAT | os.O_WRONLY, 0o600)
            os.pwrite(fd, b"\x07" * 1000, segments.HEADER_SIZE + 64)
            os.close(fd)
        say(ready=True, pid=os.getpid(), lease=store.lease_id)
        sys.stdin.read()
        store.close()
    elif mode == "churn":
        store = keyed(ShmStore(1 << 26, namespace=ns, lease_ttl_s=ttl, reap_interval_s=3600.0))
        slot = slot_n(0)
        i = 0
        say(ready=True, pid=os.getpid())
        while True:  # until killed: replace the slot with uniform payloads of a new value each time
            i += 1
            payload = bytes([i % 251]) * args["size"]
            store.put(slot, payload, descriptor(slot, payload))
    elif mode == "kernel":
        k = Kernel(kernel_config(ns, ttl))
        req = request(args["tokens"])
        keys = k.keys(req)
        for b in range(len(keys)):
            payload = bytes([b + 1]) * args["size"]
            assert k.put(k.describe(req, b, payload, tier="shm", keys=keys), payload)
        say(ready=True, pid=os.getpid(), keys=[key.hex() for key in keys])
        sys.stdin.read()
        k.close()
    elif mode == "reader":
        store = keyed(ShmStore(1 << 20, namespace=ns, lease_ttl_s=ttl, reap_interval_s=3600.0))
        t = ShmTransport()
        out = []
        for i in args["slots"]:
            got = t.fetch(store, slot_n(i))
            out.append(None if got is None else [got.payload[0], len(got.payload), type(got.payload.obj).__name__])
        t.close()
        store.close()
        say(results=out)
    elif mode == "sleep":
        time.sleep(60)


if __name__ == "__main__":
    main()
