"""The emulated slow link: reads paced to latency + bytes / bandwidth, writes not; registered as `shaped-link`."""

from __future__ import annotations

import pytest

from nexuskv import PluginManager
from nexuskv.builtins.shaped import ShapedLinkStore


def test_shaped_link_paces_reads_not_writes(monkeypatch):
    import nexuskv.builtins.shaped as shaped

    slept = []
    monkeypatch.setattr(shaped.time, "sleep", slept.append)
    from tests.contracts.test_contracts import next_descriptor

    s = ShapedLinkStore(capacity_bytes=1 << 20, bandwidth_bytes_per_s=1e6, latency_ms=2.0)
    assert s.put(b"\x01" * 17, b"x" * 1000, next_descriptor()) and slept == []
    assert bytes(s.get(b"\x01" * 17).payload) == b"x" * 1000
    assert slept == [pytest.approx(0.002 + 1000 / 1e6)]
    assert s.get(b"\x02" * 17) is None and s.used_bytes() == 1000 and len(list(s.slots())) == 1
    with pytest.raises(ValueError):
        ShapedLinkStore(bandwidth_bytes_per_s=0)


def test_shaped_link_is_a_builtin_tier_store():
    assert PluginManager({}, entry_points=False).tier_stores()["shaped-link"] is ShapedLinkStore
