from __future__ import annotations

import os

import attrs

from nexuskv import Kernel, KernelConfig, slot_of


def _kernel(path, secret=bytes(32), **opts):
    tier = {"store": "disk", "path": str(path), "capacity_bytes": "64MiB", "fsync": False, **opts}
    return Kernel(KernelConfig(tiers={"disk": tier}, plugins=("disk",)), secret=secret)  # only this plugin


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
            assert got is not None and bytes(got.payload) == it.payload
            assert got.descriptor.mac and attrs.evolve(got.descriptor, mac="") == it.desc  # sealed when stored


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


def test_a_directory_others_could_write_or_a_symlink_is_refused_at_start(tmp_path, item):
    """Issue 29, finding 2: a tier directory that was already 0777, or a symlink to someone else's, was used as is
    and files swapped in by its owner were served. Each is now a ConfigError naming the fix."""
    import pytest

    from nexuskv import ConfigError

    wide = tmp_path / "wide"
    wide.mkdir()
    wide.chmod(0o777)
    with pytest.raises(ConfigError, match="writable by group or others"):
        _kernel(wide)
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(ConfigError, match="is a symlink"):
        _kernel(link)
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(foreign, 65534, 65534)
        with pytest.raises(ConfigError, match="owned by uid 65534"):
            _kernel(foreign)
    with _kernel(tmp_path / "fresh") as k:  # a directory the tier makes itself is private, and accepted
        it = item(1)
        assert k.put(it.desc, it.payload)


def test_a_file_swapped_in_by_whoever_can_write_the_directory_is_never_served(tmp_path, item):
    """A sealed file replaced by one with a matching checksum but no MAC (or another deployment's) is a miss."""
    items = [item(i) for i in range(2)]
    with _kernel(tmp_path) as k:
        for it in items:
            assert k.put(it.desc, it.payload)
    import shutil

    from nexuskv import checksum

    other = tmp_path.parent / (tmp_path.name + "-other")
    tier = {"store": "disk", "path": str(other), "capacity_bytes": "64MiB", "fsync": False}
    with Kernel(KernelConfig(tiers={"disk": tier}, plugins=("disk",)), secret=bytes(range(1, 33))) as k2:
        forged = item(0)
        evil = b"forged" + forged.payload[6:]
        assert k2.put(attrs.evolve(forged.desc, checksum=checksum(evil)), evil)  # sealed, but with another secret
        k2.tiers["disk"].flush()
        src = k2.tiers["disk"].file_of(slot_of(forged.key))
    with _kernel(tmp_path) as k:
        k.tiers["disk"].flush()
        dst = k.tiers["disk"].file_of(slot_of(items[0].key))
    shutil.copyfile(src, dst)  # the owner of the directory swaps the file
    with _kernel(tmp_path) as k:
        assert k.load(items[0].key) is None  # its MAC is another deployment's: never served
        assert bytes(k.load(items[1].key).payload) == items[1].payload


def test_files_carry_the_kernels_keyed_names_and_only_the_same_secret_finds_them_again(tmp_path, item):
    """Issue 29: names are `store_name(StateSeal(secret).name_key, slot)`; a restart under the same secret
    re-indexes every file, a kernel under another secret finds none (and never serves one)."""
    from nexuskv import StateSeal, store_name

    items = [item(i) for i in range(3)]
    with _kernel(tmp_path) as k:
        for it in items:
            assert k.put(it.desc, it.payload)
        k.tiers["disk"].flush()
    key = StateSeal(bytes(32)).name_key
    listed = sorted(n for n in os.listdir(tmp_path) if n != ".lock")
    assert listed == sorted(store_name(key, slot_of(it.key)) + ".nkv" for it in items)
    assert not [n for n in listed for it in items if it.key.hex() in n]
    with _kernel(tmp_path) as k:
        assert all(bytes(k.load(it.key).payload) == it.payload for it in items)
    with _kernel(tmp_path, secret=bytes(range(1, 33))) as k:
        assert all(k.index.get(it.key) is None and k.load(it.key) is None for it in items)


def test_a_file_renamed_under_a_running_kernel_or_across_a_restart_is_never_served(tmp_path, item):
    a, b = item(1), item(2)
    with _kernel(tmp_path) as k:
        assert k.put(a.desc, a.payload) and k.put(b.desc, b.payload)
        store = k.tiers["disk"]
        store.flush()
        os.replace(store.file_of(slot_of(a.key)), store.file_of(slot_of(b.key)))  # a's state under b's name
        assert k.load(b.key) is None and k.index.get(b.key) is None  # refused (and dropped), never served
        assert k.load(a.key) is None
    with _kernel(tmp_path) as k:
        assert k.put(a.desc, a.payload) and k.put(b.desc, b.payload)
        k.tiers["disk"].flush()
        src, dst = k.tiers["disk"].file_of(slot_of(a.key)), k.tiers["disk"].file_of(slot_of(b.key))
    os.replace(src, dst)
    os.link(dst, os.path.join(tmp_path, slot_of(a.key).hex() + ".nkv"))  # and once more under its raw slot name
    with _kernel(tmp_path) as k:
        assert k.index.get(a.key) is None and k.index.get(b.key) is None
        assert k.load(a.key) is None and k.load(b.key) is None
        assert len(k.tiers["disk"].recovery.misnamed) == 2
