from __future__ import annotations

import os

from nexuskv import Kernel, KernelConfig, slot_of


def _kernel(path, **opts):
    tier = {"store": "disk", "path": str(path), "capacity_bytes": "64MiB", "fsync": False, **opts}
    return Kernel(KernelConfig(tiers={"disk": tier}, plugins=("disk",)), secret=bytes(32))  # only this plugin


def test_kernel_builds_the_tier_by_name_and_reindexes_it_at_start(tmp_path, item):
    items = [item(i) for i in range(5)]
    with _kernel(tmp_path) as k:
        assert type(k.tiers["disk"]).__name__ == "DiskStore" and k.tiers["disk"].capacity_bytes == 64 << 20
        for it in items:
            assert k.put(it.desc, it.payload)
        assert bytes(k.load(items[0].key).payload) == items[0].payload  # pending write, served from memory
    with _kernel(tmp_path) as k:
        for it in items:
            assert k.index.get(it.key) is not None
            got = k.load(it.key)
            assert got is not None and bytes(got.payload) == it.payload and got.descriptor == it.desc


def test_kernel_forgets_a_payload_whose_file_went_bad(tmp_path, item):
    it = item(1)
    with _kernel(tmp_path) as k:
        k.put(it.desc, it.payload)
        k.tiers["disk"].flush()
        path = k.tiers["disk"].file_of(slot_of(it.key))
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) - 10)
            f.write(b"\xff" * 10)
        assert k.load(it.key) is None
        assert k.index.get(it.key) is None  # the tier reported it through the eviction callback


def test_toml_config(tmp_path, item):
    cfg = tmp_path / "kernel.toml"
    cfg.write_text(
        f'plugins = ["disk"]\n[tiers.disk]\nstore = "disk"\npath = "{tmp_path / "tier"}"\n'
        'capacity_bytes = "4MiB"\ncodec = "zstd"\n'
    )
    with Kernel.from_config(cfg, secret=bytes(32)) as k:
        store = k.tiers["disk"]
        assert store.capacity_bytes == 4 << 20 and store.codec == "zstd" and store.path == str(tmp_path / "tier")
